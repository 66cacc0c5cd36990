"""The Hugging Face ``Trainer``: a memory-growth callback, and ``LossLog`` for extra losses.

* :class:`LeakfreeCallback`, a ``transformers.TrainerCallback``: live bytes after every
  optimizer step, a growth verdict per window after a warm-up (warning, or ``fail=True``
  raising), and ``leakfree/live_bytes`` / ``leakfree/growth_bytes_per_step`` added to the
  Trainer's training logs (so they reach TensorBoard, W&B... with the Trainer's own).
* :class:`LossLogMixin`, for ``Trainer`` subclasses: ``self.record_loss("aux", aux)`` in
  ``compute_loss``; the mean of each declared loss joins the training logs at each logging
  step, with one device-to-host transfer for all of them.

Lifetime contract
-----------------
``LeakfreeCallback`` keeps its watcher (see :mod:`leakfree.integrations._growth`) from
``on_train_begin`` to ``on_train_end``; on the CPU that includes a storage tracker active on
the training thread. A ``train()`` that raises skips ``on_train_end``: call
:meth:`LeakfreeCallback.close` then (the next ``train()`` also closes a leftover run). The
Trainer passed to :meth:`LeakfreeCallback.attach` is held by a weak reference.
``LossLogMixin`` keeps detached values (never a graph) from ``record_loss`` until the next
training log, which reduces and clears them.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

try:
    from transformers import DefaultFlowCallback, Trainer, TrainerCallback
except ModuleNotFoundError as e:
    if e.name != "transformers":
        raise  # transformers is there but broken: its own error says why
    raise ImportError(
        "leakfree.integrations.transformers needs the transformers package: "
        "pip install transformers"
    ) from e

import torch

from leakfree.integrations._growth import WatchingCallback
from leakfree.losses import LossLog

__all__ = ["LeakfreeCallback", "LossLogMixin"]

#: keys the Trainer itself puts in a training log: a declared loss may not shadow them
_TRAINER_KEYS = ("loss", "grad_norm", "learning_rate", "epoch", "num_input_tokens_seen")


def _is_training_log(logs: Mapping[str, Any]) -> bool:
    # A logging step's dict has "loss"; evaluation's has "eval_loss", the end-of-training
    # summary "train_loss".
    return "loss" in logs


class LeakfreeCallback(WatchingCallback, TrainerCallback):  # type: ignore[misc]
    """Warn (or fail) when live memory grows per optimizer step; log the numbers.

    Args:
        warmup: optimizer steps not judged across steps (default 3: optimizer state and
            caches). Memory that builds up per backward pass within a step (tensors kept
            per microbatch) is judged from the first step, with no warm-up.
        window: the most recent optimizer steps fitted at every step (default 10, at
            least 4); a training shorter than ``warmup + window`` steps is not judged and
            says so at its end (:class:`~leakfree.integrations.NotJudgedWarning`).
        tolerance: bytes per step of growth accepted beyond the noise bound (default 0).
        floor: bytes per step of growth accepted when no autograd graph holds it
            (default 64: a loss history of a few detached scalars is not a leak).
        fail: raise :class:`~leakfree.testing.LeakError` (from ``trainer.train()``)
            instead of warning :class:`~leakfree.integrations.MemoryGrowthWarning`.
        sample_every: on the CPU, track tensor storages during about one optimizer step in
            this many (default 8, the first step always, and every step while growth the
            C heap's count suspected is confirmed: every step is judged; see
            docs/diagnostics.md for the cost; 1: every step, exact, about 2.5x the step
            time of a small causal LM). An accelerator is read from its allocator at
            every step, free.
        device: the device judged (default: the accelerator if any, read from its
            allocator; else the CPU, where tensor storages created during training are
            tracked).
        roots: more objects to search for holders, ``{name: object}`` or a list. Always
            searched: the model, optimizer, LR scheduler and train dataloader, and the
            Trainer itself once :meth:`attach` ed.
        log: add the numbers to the Trainer's training logs (default True).

    Use ``trainer.add_callback(LeakfreeCallback())`` or, so that its numbers reach the
    ``report_to`` integrations too, ``LeakfreeCallback().attach(trainer)``: the Trainer
    calls callbacks in order and puts the integrations before the ones you add, so only
    callbacks after this one see the keys it adds to ``logs``.
    """

    _trainer: weakref.ref[Any] | None = None  # set by attach()

    def attach(self, trainer: Trainer) -> LeakfreeCallback:
        """Add this callback to ``trainer`` right after its ``DefaultFlowCallback``, before
        the logging integrations, so they log its numbers; returns ``self``. The Trainer
        is also searched for holders (held by a weak reference)."""
        if not isinstance(trainer, Trainer):
            raise TypeError(
                f"LeakfreeCallback.attach(trainer={type(trainer).__name__}): expected a "
                "transformers.Trainer"
            )
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        flow = [i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)]
        callbacks.insert(flow[0] + 1 if flow else 0, self)
        self._trainer = weakref.ref(trainer)
        return self

    def close(self) -> None:
        """Stop watching (idempotent); the numbers stay in :attr:`watch`."""
        self.watch.stop()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.watch.stop()  # a run that raised left its watch open
        self.watch.start()

    def on_step_end(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        def holders() -> dict[str, Any]:  # called only when a window grows
            trainer = self._trainer() if self._trainer is not None else None
            return {
                "model": model,
                "optimizer": optimizer,
                "lr_scheduler": lr_scheduler,
                "train_dataloader": train_dataloader,
                "trainer": trainer,
            }

        self.watch.step(holders)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if not self._log or logs is None or not _is_training_log(logs):
            return
        metrics = self.watch.metrics()
        logs.update(metrics)
        # The Trainer stored a copy of `logs` in its history before calling the callbacks.
        history = state.log_history
        if history and history[-1].get("step") == state.global_step and "loss" in history[-1]:
            history[-1].update(metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.watch.stop()


if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class LossLogMixin(_TrainerBase):  # type: ignore[misc, valid-type]
    """Log extra losses from a ``Trainer`` subclass without keeping graphs or syncing.

    The Trainer already handles its own loss: ``training_step`` returns it detached and
    the Trainer sums it on the device, reading it once per logging step. Anything else a
    ``compute_loss`` wants to log (an auxiliary, a z-loss, a per-task loss) has no such
    path: ``self.log({"aux": aux.item()})`` syncs every microbatch and logs off the
    logging cadence; a list of ``aux`` tensors keeps each one's graph. This mixin gives
    those losses the Trainer's treatment:

    * ``self.record_loss(name, value)`` stores ``value`` detached in :attr:`loss_log`
      (a :class:`~leakfree.LossLog`: never a graph, by any path), only while the model
      trains (``evaluate`` runs ``compute_loss`` too; those values are not recorded);
    * at each training logging step, each loss's reduction (``"mean"`` by default: the
      mean over the microbatches since the last log, across ranks under
      ``torch.distributed``) joins the Trainer's ``logs`` under its name, with one
      device-to-host transfer for all keys; the log is then cleared.

    Args (keyword, before the Trainer's own):
        loss_log: the loss names (each reduced with ``"mean"``), a mapping
            ``{name: "sum"|"mean"|"min"|"max"}``, or a ready :class:`~leakfree.LossLog`.
            Names may not shadow the Trainer's keys (``loss``, ``grad_norm``...).
        loss_log_groups: the ``groups`` of ``LossLog.reduce``; default ``None``: the
            default group when ``torch.distributed`` is initialised, else this process.

    Put it first among the bases: ``class MyTrainer(LossLogMixin, Trainer)``.
    """

    def __init__(
        self,
        *args: Any,
        loss_log: LossLog | Sequence[str] | Mapping[str, str],
        loss_log_groups: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(loss_log, (LossLog, Sequence, Mapping)) or isinstance(loss_log, str):
            raise TypeError(
                f"{type(self).__name__}(loss_log={loss_log!r}): expected a LossLog, or the "
                "names (or {name: reduction}) of one"
            )
        log = loss_log if isinstance(loss_log, LossLog) else LossLog(loss_log)
        clash = [k for k in log if k in _TRAINER_KEYS or k.startswith("leakfree/")]
        if clash:
            raise ValueError(
                f"{type(self).__name__}(loss_log=...): {clash[0]!r} is a key the Trainer "
                "(or leakfree's callback) logs itself; name the loss differently, e.g. "
                f"{'aux_' + clash[0]!r}"
            )
        if loss_log_groups is not None and (
            isinstance(loss_log_groups, (str, bytes)) or not isinstance(loss_log_groups, Sequence)
        ):
            raise TypeError(
                f"{type(self).__name__}(loss_log_groups={loss_log_groups!r}): expected a "
                "sequence of process groups (None inside it is the default group)"
            )
        self.loss_log = log
        self.loss_log_groups = loss_log_groups
        super().__init__(*args, **kwargs)

    def record_loss(self, name: str, value: torch.Tensor | float) -> None:
        """Store ``value`` (a 1-element tensor, or a number) detached under ``name``, if
        the model is training; never syncs, never keeps a graph."""
        model = self.model
        if model is not None and model.training:
            self.loss_log[name].append(value)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``, with the recorded losses' reductions added to training
        logs (every rank calls it at the same steps, as the Trainer's own gather needs)."""
        if _is_training_log(logs):
            logs.update(self.loss_log.reduce(self.loss_log_groups))
        super().log(logs, *args, **kwargs)  # `start_time` in recent releases, none before
