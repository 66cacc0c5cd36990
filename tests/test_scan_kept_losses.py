"""LF003 (a loss or forward result kept with its graph in a long-lived container).

The stand-ins in tests/scan_cases/ are data files (never imported): the leaky ones mark each
line LF003 must flag with ``# LF003 <symbol>``; the fixed ones must stay silent.
"""

from __future__ import annotations

import ast
import re
import textwrap

import pytest

from leakfree.scan._model import ScanFinding, Source
from leakfree.scan.rules.kept_losses import RULES
from tests._scan import CASES, project_of, source

RULE = RULES[0]


def scan(*sources: Source) -> list[ScanFinding]:
    project = project_of(*sources)
    return [f for src in sources for f in RULE.check(src, project)]


def scan_text(text: str) -> list[ScanFinding]:
    return scan(source("case.py", textwrap.dedent(text)))


def scan_case(name: str) -> list[ScanFinding]:
    path = CASES / name
    return scan(source(str(path), path.read_text()))


def test_rule_metadata() -> None:
    assert RULE.code == "LF003"
    assert "find_retained" in RULE.confirm


def test_fast_llm_leaky_flags_both_real_sites() -> None:
    findings = scan_case("fast_llm_losses_leaky.py")
    lines = (CASES / "fast_llm_losses_leaky.py").read_text().splitlines()
    got = {(f.line, f.symbol) for f in findings}
    # head: losses[self._total_loss_name].append(total_loss)
    append = next(i for i, t in enumerate(lines, 1) if ".append(total_loss)" in t)
    # loss: self._record(self._name, loss, losses) -> losses[name].append(value)
    call = next(i for i, t in enumerate(lines, 1) if "self._record(self._name, loss" in t)
    assert got == {(append, "losses"), (call, "losses")}
    assert all(f.rule == "LF003" for f in findings)
    by_line = {f.line: f for f in findings}
    assert "by _record()" in by_line[call].message
    assert ".detach()" in by_line[append].message


def test_fast_llm_fixed_is_silent() -> None:
    assert scan_case("fast_llm_losses_fixed.py") == []


def _marked(name: str) -> set[tuple[int, str]]:
    lines = (CASES / name).read_text().splitlines()
    return {
        (i, m.group(1))
        for i, text in enumerate(lines, 1)
        if (m := re.search(r"# LF003 (\S+)$", text))
    }


def test_small_leaky_cases_flagged_exactly() -> None:
    findings = scan_case("loss_logging_leaky.py")
    assert {(f.line, f.symbol) for f in findings} == _marked("loss_logging_leaky.py")
    assert len(findings) == len(_marked("loss_logging_leaky.py"))


def test_small_fixed_cases_silent() -> None:
    assert scan_case("loss_logging_fixed.py") == []


def test_running_sum_message() -> None:
    (finding,) = scan_text(
        """
        class T:
            def step(self, batch):
                loss = self.model(batch).loss
                self.total_loss += loss
        """
    )
    assert finding.symbol == "self.total_loss"
    assert "running sum" in finding.message


def test_helper_followed_across_files() -> None:
    helper = source(
        "helpers.py",
        textwrap.dedent(
            """
            def log_loss(losses, name, value):
                losses[name].append(value)
            """
        ),
    )
    caller = source(
        "train.py",
        textwrap.dedent(
            """
            def micro_step(context, model, batch):
                loss = model(batch)
                log_loss(context.losses, "lm", loss)
                log_loss(context.losses, "lm", loss.detach())
                return loss
            """
        ),
    )
    findings = scan(helper, caller)
    assert [(f.path, f.line, f.symbol) for f in findings] == [("train.py", 4, "context.losses")]


def test_helper_with_conflicting_definitions_is_not_followed() -> None:
    # names are not resolved through imports: follow only when every definition stores
    a = source("a.py", "def log_loss(losses, name, value):\n    losses[name].append(value)\n")
    b = source("b.py", "def log_loss(losses, name, value):\n    print(name, value)\n")
    caller = source("c.py", "def step(context, loss):\n    log_loss(context.losses, 'lm', loss)\n")
    assert scan(a, b, caller) == []


@pytest.mark.parametrize(
    "body",
    [
        "self.history.append(loss.detach())",
        "self.history.append(loss.item())",
        "self.history.append(float(loss))",
        "self.history.append(loss.cpu().item())",
        "self.history.append(loss.detach().cpu())",
        "self.history.append(loss.tolist())",
        "self.history.append(loss.shape)",
        "self.history.append(loss.dtype)",
        "self.history.append(len(losses))",
        "self.history.append(f'{loss}')",
        "self.history.append(loss > 0)",
        "self.history.append(leakfree.detach_tree(loss))",
        "self.last_loss = loss",
        "self.train_loss.update(loss)",
        "local = []\n    local.append(loss)",
        "local = []\n    local.append(loss)\n    return local",
        "with torch.no_grad():\n        loss = model(x).loss\n    self.history.append(loss)",
    ],
)
def test_quiet_on_clean_values_and_locals(body: str) -> None:
    text = f"def step(self, model, x, loss, losses):\n    {body}\n"
    # a method body, so that ``self`` is the receiver's root
    assert scan_text(f"class T:\n{textwrap.indent(text, '    ')}") == []


@pytest.mark.parametrize(
    ("body", "symbol"),
    [
        ("self.history.append(loss)", "self.history"),
        ("self.history.append(loss.cpu())", "self.history"),
        ("self.history.append(loss.float().mean())", "self.history"),
        ("self.history.extend([loss, aux_loss])", "self.history"),
        ("self.history.insert(0, loss * 2)", "self.history"),
        ("self.history.append(-loss)", "self.history"),
        ("self.log['lm'] = outputs.loss", "self.log"),
        ("self.log['lm'] = F.cross_entropy(x, y)", "self.log"),
        ("self.log['lm'] = self.criterion(x, y)", "self.log"),
        ("self.log.setdefault('lm', []).append(loss)", "self.log"),
        ("self.metrics['logits'].append(model(x).logits)", "self.metrics"),
        ("self.stats.update(lm=loss)", "self.stats"),
        ("self.stats.update({'lm': loss})", "self.stats"),
        ("self.state.total = self.state.total + loss", "self.state.total"),
        ("acc = []\n    acc.append(loss)\n    self.kept = acc", "self.kept"),
    ],
)
def test_flags_graph_values_in_self(body: str, symbol: str) -> None:
    text = f"def step(self, model, x, y, loss, aux_loss, outputs):\n    {body}\n"
    findings = scan_text(f"class T:\n{textwrap.indent(text, '    ')}")
    assert [f.symbol for f in findings] == [symbol]


def test_forward_results_only_into_log_named_containers() -> None:
    # pipeline schedules and caches keep outputs for a later backward
    assert (
        scan_text(
            """
            class Stage:
                def forward_one(self, mb, x):
                    output = self.model(x)
                    self.fwd_cache[mb] = output
                    self.outputs_by_mb.append(output)
            """
        )
        == []
    )


def test_container_that_feeds_backward_is_quiet() -> None:
    text = """
        class Schedule:
            def forward_one(self, stage, mb):
                loss = self.loss_fn(stage(mb), mb)
                self._pending.append(loss)

            def backward_one(self, mb):
                for loss in self._pending:
                    loss.backward()
        """
    assert scan_text(text) == []
    # the same without the backward reading it is flagged (the test can fail)
    assert len(scan_text(text.replace("self._pending:", "self._other:"))) == 1


def test_module_global_and_global_statement() -> None:
    findings = scan_text(
        """
        HISTORY = []
        TOTAL = 0.0

        def step(model, x):
            global TOTAL
            loss = model(x).loss
            HISTORY.append(loss)
            TOTAL += loss
            HISTORY2 = []
            HISTORY2.append(loss)
        """
    )
    assert [(f.line, f.symbol) for f in findings] == [(8, "HISTORY"), (9, "TOTAL")]


def test_parameter_containers_need_a_log_or_context_name() -> None:
    findings = scan_text(
        """
        def collect(outputs_list, model, x):
            loss = model(x).loss
            outputs_list.append(loss)

        def log(state, metrics, model, x):
            loss = model(x).loss
            state.log_history.append(loss)
            metrics["loss"].append(loss)
        """
    )
    assert [(f.line, f.symbol) for f in findings] == [(8, "state.log_history"), (9, "metrics")]


def test_reassignment_decides_over_the_name() -> None:
    assert (
        scan_text(
            """
            class T:
                def step(self, x):
                    loss = self.model(x).loss
                    loss = loss.detach()
                    self.history.append(loss)
                    output = {"loss": 1.0, "step": 3}
                    self.log_history.append(output)
                    smoothed_loss = self.avg / 2
                    self.losses.append(smoothed_loss)
            """
        )
        == []
    )


def test_no_grad_decorator_and_eval_steps_are_quiet() -> None:
    text = """
        class T:
            @torch.no_grad()
            def score(self, x):
                self.history.append(self.model(x).loss)

            @torch.inference_mode()
            def score2(self, x):
                self.history.append(self.model(x).loss)

            def validation_step(self, batch, idx):
                self.history.append(self.model(batch).loss)
        """
    assert scan_text(text) == []
    assert len(scan_text(text.replace("@torch.no_grad()", ""))) == 1


def test_losslog_containers_are_quiet() -> None:
    assert (
        scan_text(
            """
            import leakfree

            class T:
                def __init__(self):
                    self.losses = leakfree.LossLog(["lm"])

                def step(self, x):
                    loss = self.model(x).loss
                    self.losses["lm"].append(loss)

            def make_context():
                return Context(losses=leakfree.LossLog(["lm"]))

            def micro(context, loss):
                context.losses["lm"].append(loss)
            """
        )
        == []
    )


def test_autograd_function_bodies_are_left_to_lf001() -> None:
    assert (
        scan_text(
            """
            class F(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    ctx.losses = []
                    ctx.losses.append(x)
                    return x
            """
        )
        == []
    )


def test_alias_symbol_names_the_long_lived_container() -> None:
    (finding,) = scan_text(
        """
        class T:
            def step(self, x):
                hist = self.state.history
                hist.append(self.model(x).loss)
        """
    )
    assert finding.symbol == "self.state.history"


def test_cls_call_is_not_a_forward() -> None:
    assert (
        scan_text(
            """
            class Bundler:
                @classmethod
                def get(cls, key):
                    bundler = cls()
                    cls._log_bundlers[key] = bundler
            """
        )
        == []
    )


def test_module_level_script_loop() -> None:
    findings = scan_text(
        """
        history = []
        logged = []
        for step in range(3):
            loss = model(batch).loss
            loss.backward()
            history.append(loss)
            logged.append(loss.item())
        """
    )
    assert [(f.line, f.symbol) for f in findings] == [(7, "history")]


def test_an_enum_member_named_like_a_loss_is_not_a_loss() -> None:
    # found by scanning leakfree itself: `kind = Kind.LOSS; self.env.kinds[name] = kind`

    from leakfree.scan._model import Project, Source
    from leakfree.scan.rules.kept_losses import RULES

    text = (
        "class A:\n    def f(self, name):\n        kind = Kind.LOSS\n"
        "        self.kinds[name] = kind\n"
    )
    source = Source("m.py", text, ast.parse(text))
    project = Project()
    project.add(source)
    assert list(RULES[0].check(source, project)) == []
    flagged = text.replace("Kind.LOSS", "outputs.loss")
    source = Source("m.py", flagged, ast.parse(flagged))
    project = Project()
    project.add(source)
    assert [f.line for f in RULES[0].check(source, project)] == [4]


# --- evidence before a finding, and the FAQ's running sum --------------------------------


def test_a_nested_helper_that_detaches_is_read_deepspeed_pipe_engine() -> None:
    # DeepSpeed 0.19 runtime/pipe/engine.py, _exec_forward_pass: add_to_total_loss is named
    # like a loss function, but its body accumulates `_loss.detach()`
    found = scan_text(
        """
        import torch

        class PipelineEngine:
            def _exec_forward_pass(self, buffer_id):
                outputs = self.module(inputs)
                self.loss = self.loss_model(outputs, labels)

                def add_to_total_loss(_total_loss, _loss):
                    if isinstance(_loss, torch.Tensor):
                        if _total_loss is None:
                            _total_loss = torch.zeros_like(_loss)
                        _total_loss += _loss.detach()
                    else:
                        if _total_loss is None:
                            _total_loss = [torch.zeros_like(_l) for _l in _loss]
                        for _idx, _l in enumerate(_loss):
                            _total_loss[_idx] += _l.detach()
                    return _total_loss

                self.total_loss = add_to_total_loss(self.total_loss, self.loss)
                for name, loss in self.module.get_additional_losses().items():
                    kept = self.total_additional_losses
                    total = kept[name] if name in kept else None
                    self.total_additional_losses[name] = add_to_total_loss(total, loss)
        """
    )
    assert found == []


def test_a_helper_that_keeps_the_graph_is_still_a_loss() -> None:
    (f,) = scan_text(
        """
        class Engine:
            def step(self, batch):
                def add_to_total_loss(total, loss):
                    return total + loss

                loss = self.criterion(self.model(batch))
                loss.backward()
                self.history.append(add_to_total_loss(0.0, loss))
        """
    )
    assert f.symbol == "self.history"


def test_values_read_from_a_tracker_are_what_it_was_filled_with_megatron_mtp() -> None:
    # Megatron-Core 0.16 transformer/multi_token_prediction.py: the tracker is filled with
    # `loss.detach()` elsewhere; reading it back and logging it keeps no graph
    assert (
        scan_text(
            """
            def track_mtp_metrics(loss_scale, iteration, writer, total_loss_dict=None):
                tracker = MTPLossLoggingHelper.tracker
                mtp_losses = tracker["values"] * loss_scale
                for i in range(mtp_losses.shape[0]):
                    name = f"mtp_{i+1} loss"
                    loss = mtp_losses[i]
                    if total_loss_dict is not None:
                        if name in total_loss_dict:
                            total_loss_dict[name] += loss
                        else:
                            total_loss_dict[name] = loss
            """
        )
        == []
    )


def test_torchmetrics_updates_run_without_grad_composer() -> None:
    # Composer 0.32 metrics/metrics.py (a torchmetrics Metric's update) and
    # models/huggingface.py (metric.update(outputs=...))
    assert (
        scan_text(
            """
            from torchmetrics import Metric

            class LanguageCrossEntropy(Metric):
                def update(self, output, target):
                    losses = self.loss_function(output, target)
                    self.sum_loss += losses

            class HuggingFaceModel:
                def update_metric(self, batch, outputs, metric):
                    if getattr(metric, "needs_batch", False):
                        return metric.update(batch=batch, outputs=outputs, labels=self.labels)
                    return metric.update(outputs, self.labels)
            """
        )
        == []
    )


FAQ = """
    total_loss = 0
    for i in range(10000):
        optimizer.zero_grad()
        output = model(input)
        loss = criterion(output)
        loss.backward()
        optimizer.step()
        total_loss += loss
"""


def test_the_pytorch_faq_epoch_running_sum_at_module_level_and_in_a_function() -> None:
    (f,) = scan_text(FAQ)
    assert f.symbol == "total_loss" and "running sum total_loss += loss" in f.message
    inside = "def train(model, optimizer, criterion, input):\n" + textwrap.indent(
        textwrap.dedent(FAQ), "    "
    )
    (g,) = scan_text(inside)
    assert g.symbol == "total_loss" and g.line == 10
    assert "each iteration's graph" in g.message


def test_summing_losses_for_one_backward_is_not_the_faq_leak() -> None:
    # gradient accumulation: the sum is what backward runs on; and a detached sum
    assert (
        scan_text(
            """
            def step(model, batches, criterion):
                total = 0
                for batch in batches:
                    loss = criterion(model(batch))
                    total += loss
                total.backward()

            def epoch(model, batches, criterion):
                total_loss = 0
                for batch in batches:
                    loss = criterion(model(batch))
                    loss.backward()
                    total_loss += loss.item()
            """
        )
        == []
    )


def test_an_entry_read_straight_from_a_tracker_is_clean() -> None:
    # the same tracker, read by key: what a logger stores is detached by convention; a
    # logger that keeps graphs is reported where it stores them
    assert (
        scan_text(
            """
            class Reporter:
                def log(self):
                    loss = self.tracker["loss"]
                    self.history.append(loss)
            """
        )
        == []
    )
