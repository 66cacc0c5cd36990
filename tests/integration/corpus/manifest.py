"""The held-out corpus: training scripts written as users write them, each reproducing a public
leak report (or the control a report implies), with what a good report of each must say.

Written and measured before the finders were changed for them (BEFORE.md has the numbers of
the code they were measured on). Imports nothing heavy: the tests, ``validate.py`` and
``measure.py`` read it.

Every script takes its number of optimizer steps as its first argument. A leaky script marks
the line that makes the tensor it keeps with a trailing ``# MADE``; its fixed twin does the
same work without keeping it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "scripts"
#: the step counts every script runs at (the work item's "16, 40 and 160 steps")
STEPS = (16, 40, 160)


@dataclass(frozen=True)
class Report:
    """A public report: ``repo#number``, when it was opened, and what it says."""

    ref: str
    date: str
    says: str

    @property
    def url(self) -> str:
        repo, number = self.ref.split("#")
        return f"https://github.com/{repo}/issues/{number}"


@dataclass(frozen=True)
class Case:
    """One script of the corpus.

    ``role``: ``leak`` (must be found, holder named, line cited), ``fixed`` (its twin: must be
    quiet), ``control`` (no leak: must be quiet). ``holder``: a regular expression one holder
    of a finding must match (its path, its cycle, or a line of its message outside the
    creation sites: reading.py); ``says``: expressions the finding's text must match outside
    the creation sites too. ``made_in``: the function the ``# MADE`` line is in, as a creation
    site names it. ``flat_after``: for a
    control that fills a bounded store, the last step (counted from 1) that adds to it.
    """

    name: str
    role: str
    shape: str
    reports: tuple[Report, ...]
    what: str
    twin: str | None = None
    holder: str = ""
    says: tuple[str, ...] = ()
    made_in: str = ""
    flat_after: int | None = None
    steps: tuple[int, ...] = STEPS

    @property
    def path(self) -> Path:
        return SCRIPTS / f"{self.name}.py"

    def made_line(self) -> int:
        """The line marked ``# MADE`` (leaky scripts only)."""
        lines = self.path.read_text().splitlines()
        return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith("# MADE"))


WARP = Report(
    "NVIDIA/warp#675",
    "2025-04-23",
    "a custom Function stores the array it returns on the Torch ctx: a reference cycle "
    "(output -> grad_fn -> ctx -> output) that only the cyclic collector frees",
)
TORCHTITAN_GC = Report(
    "pytorch/torchtitan#1230",
    "2025-05-28",
    "large trainers switch automatic gc off and collect every N steps; a debug mode calls "
    "warn_tensor_cycles to find tensors held by cycles",
)
TANGERMEME_CLEAR = Report(
    "jmschrei/tangermeme#84",
    "2026-09-01",
    "deep_lift_shap's forward hooks set module.input / module.output; _clear_hooks removes "
    "the hooks but not the attributes, so every explained model keeps its activations",
)
TANGERMEME_STACKS = Report(
    "jmschrei/tangermeme#54",
    "2026-01-16",
    "the hooks store `module.input = input[0].clone().detach()` and "
    "`module.output = outputs.clone().detach()` on each module",
)
KIMI = Report(
    "MoonshotAI/Kimi-Audio#117",
    "2025-06-08",
    "`@lru_cache(maxsize=None)` on the fine-tuning dataset's `__getitem__` returning a dict "
    "of tensors: memory grows with the data read",
)
FORECASTING_CACHE = Report(
    "sktime/pytorch-forecasting#1905",
    "2025-06-30",
    "`@property` over `@lru_cache` on a dataset method kept every instance alive through the "
    "class-level cache; fixed with `@cached_property`",
)
TRANSFORMERS_CACHE = Report(
    "huggingface/transformers#45412",
    "2026-04-13",
    "a class-level lru_cache on module methods holds every instance (and what it returned) "
    "for the life of the process (PRs #45708, #45780)",
)
METTA = Report(
    "Metta-AI/metta#1139",
    "2025-06-24",
    "the LSTM state was stored with its autograd graph in the experience kept by the "
    "trainer; fixed by detaching it before storing",
)
FORECASTING_OUTPUTS = Report(
    "sktime/pytorch-forecasting#1924",
    "2025-07-22",
    "per-batch outputs appended to the step-output lists with their graphs for the whole "
    "epoch; fixed by detaching before appending",
)
LAMBEQ = Report(
    "Quantinuum/lambeq#251",
    "2025-09-16",
    "a trainer's training_step hands back the model output with its graph for the caller to keep",
)
PRIME_RL = Report(
    "PrimeIntellect-ai/prime-rl#1936",
    "2026-03-03",
    "an unbounded rollout history was flagged as growing without limit; the bounded "
    "buffer is the usual form",
)
DEEPMD = Report(
    "deepmodeling/deepmd-kit#4616",
    "2025-02-26",
    "an lru_cache with a maxsize on the set loader: bounded by design",
)
RSLEARN = Report(
    "allenai/rslearn#632",
    "2026-05-04",
    "freeze for some epochs, then unfreeze by toggling requires_grad: the optimizer makes "
    "state for a part only when it first gets gradients",
)
TRTLLM = Report(
    "NVIDIA/TensorRT-LLM#18389",
    "2026-08-28",
    "a tokenization cache that fills as new inputs arrive (host objects, no tensors)",
)
TOKENIZERS = Report(
    "huggingface/tokenizers#1539",
    "2024-10-21",
    "a tokenizer's word cache filling was reported as a leak (cache_capacity)",
)
FAIRCHEM = Report(
    "facebookresearch/fairchem#775",
    "2024-07-18",
    "variable batch sizes make allocations of every size (expandable segments added)",
)
SPECFORGE = Report(
    "sgl-project/SpecForge#739",
    "2026-08-01",
    "variable-length microbatches request differently sized allocations every step; "
    "reserved-but-unallocated memory grows (fragmentation), not a leak",
)

CASES: tuple[Case, ...] = (
    Case(
        "ctx_forces_leak",
        "leak",
        "a",
        (WARP, TORCHTITAN_GC),
        "a Function returns the forces it computed in forward and keeps them on ctx "
        "(node -> ctx -> tensor -> grad_fn -> node); gc.disable() as trainers do",
        twin="ctx_forces_fixed",
        holder=r"Restraint\.ctx\.forces",
        says=(r"a cycle the collector would not free|(the collector|gc) is disabled",),
        made_in="Restraint.forward",
    ),
    Case(
        "ctx_forces_fixed",
        "fixed",
        "a",
        (WARP, TORCHTITAN_GC),
        "the forces go through save_for_backward: no cycle",
    ),
    Case(
        "explainer_hooks_leak",
        "leak",
        "b",
        (TANGERMEME_CLEAR, TANGERMEME_STACKS),
        "an explainer per step, its hooks set .input/.output on its modules and are removed; "
        "the explainer is kept in a list of result dicts",
        twin="explainer_hooks_fixed",
        holder=r"reports\[\*\]\['explainer'\]\.softmax\.input",
        says=(r"\b_keep_io\b",),
        made_in="Explainer._keep_io",
    ),
    Case(
        "explainer_hooks_fixed",
        "fixed",
        "b",
        (TANGERMEME_CLEAR,),
        "_clear_hooks deletes the attributes too (the upstream fix)",
    ),
    Case(
        "getitem_lru_leak",
        "leak",
        "c",
        (KIMI,),
        "Dataset.__getitem__ under an unbounded functools.lru_cache, items of tensors",
        twin="getitem_lru_fixed",
        holder=r"SpeechTextDataset\.__getitem__.*cache|cache.*SpeechTextDataset\.__getitem__",
        made_in="SpeechTextDataset.__getitem__",
    ),
    Case("getitem_lru_fixed", "fixed", "c", (KIMI,), "no cache on __getitem__"),
    Case(
        "window_cache_leak",
        "leak",
        "c",
        (FORECASTING_CACHE, TRANSFORMERS_CACHE),
        "@property over @functools.cache on a method: the class-level cache keeps every "
        "window made per step and its features",
        twin="window_cache_fixed",
        holder=r"Window\.features.*cache|cache.*Window\.features",
        made_in="Window.features",
    ),
    Case(
        "window_cache_fixed",
        "fixed",
        "c",
        (FORECASTING_CACHE,),
        "@functools.cached_property: the features live as long as their window (the fix)",
    ),
    Case(
        "utterance_property_leak",
        "leak",
        "c",
        (FORECASTING_CACHE,),
        "functools.cached_property on objects the dataset keeps for the run: every sample "
        "read keeps its features (the fix of the report, where the instances live long)",
        twin="utterance_property_fixed",
        holder=r"utterances\[\*\]\.features",
        made_in="Utterance.features",
    ),
    Case(
        "utterance_property_fixed",
        "fixed",
        "c",
        (FORECASTING_CACHE,),
        "a plain property: computed when read, not kept",
    ),
    Case(
        "episode_log_leak",
        "leak",
        "d",
        (METTA,),
        "a list of dicts of AgentState objects holding the recurrent state with its graph",
        twin="episode_log_fixed",
        holder=r"episode_log\[\*\]\['state'\]",
        made_in="<module>",
    ),
    Case(
        "episode_log_fixed",
        "fixed",
        "d",
        (METTA,),
        "the log keeps numbers (detached norms), not the state",
    ),
    Case(
        "trainer_logits_leak",
        "leak",
        "e",
        (FORECASTING_OUTPUTS, LAMBEQ),
        "HF Trainer, 4 microbatches a step; compute_loss keeps every microbatch's logits "
        "(16 KiB each) with their graph across steps",
        twin="trainer_logits_fixed",
        holder=r"epoch_logits\[\*\]",
        made_in="AccuracyTrainer.compute_loss",
        steps=(4, *STEPS),
    ),
    Case(
        "trainer_logits_fixed",
        "fixed",
        "e",
        (FORECASTING_OUTPUTS,),
        "compute_loss counts correct tokens; nothing kept",
        steps=(4, *STEPS),
    ),
    Case(
        "control_replay_deque",
        "control",
        "f",
        (PRIME_RL,),
        "replay buffer deque(maxlen=64) of transitions, 4 a step: grows for 16 steps "
        "(about 1.6 KiB a step), then flat",
        flat_after=16,
    ),
    Case(
        "control_lru_bounded",
        "control",
        "f",
        (DEEPMD,),
        "lru_cache(maxsize=24) over per-step systems: fills for 24 steps, then flat",
        flat_after=24,
    ),
    Case(
        "control_lazy_optimizer",
        "control",
        "f",
        (RSLEARN,),
        "gradual unfreezing, one block every 4 steps: AdamW state made lazily up to step 21",
        flat_after=21,
    ),
    Case(
        "control_tokenizer_cache",
        "control",
        "f",
        (TRTLLM, TOKENIZERS),
        "a word-piece cache of Python lists filling for hundreds of steps (host heap only)",
    ),
    Case(
        "control_batch_sizes",
        "control",
        "f",
        (FAIRCHEM,),
        "noisy: 4 to 64 rows a microbatch, two microbatches a step",
    ),
    Case(
        "control_seq_lengths",
        "control",
        "f",
        (SPECFORGE,),
        "noisy: a tiny causal transformer on 8 to 64 tokens a microbatch",
    ),
)
BY_NAME = {case.name: case for case in CASES}
