"""Lightning: a callback that warns (or fails) when live memory grows per optimizer step.

:class:`LeakfreeCallback` is a Lightning ``Callback``: from ``lightning.pytorch`` when the
``lightning`` package is installed, else from the standalone ``pytorch_lightning`` (whose
``Trainer`` runs either: both call callbacks by hook name). It samples live bytes after
every optimizer step (``trainer.global_step`` moving, so gradient accumulation and manual
optimization count optimizer steps, not batches), judges growth per window after a
warm-up, and logs ``leakfree/live_bytes`` and ``leakfree/growth_bytes_per_step`` through
``pl_module.log_dict`` (so they reach the Trainer's loggers, at their ``log_every_n_steps``
cadence).

Lifetime contract
-----------------
The watcher (see :mod:`leakfree.integrations._growth`) runs from ``on_train_start`` to
``on_train_end``, or ``on_exception`` when training raises; on the CPU that includes a
storage tracker active on the training thread. The trainer and module are walked only
when a window grows, and not kept.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ModuleNotFoundError as missing:
    if missing.name not in ("lightning", "lightning.pytorch"):
        raise  # Lightning is there but broken: its own error says why
    try:
        from pytorch_lightning import (  # type: ignore[assignment]
            Callback,
            LightningModule,
            Trainer,
        )
    except ModuleNotFoundError as e:
        if e.name != "pytorch_lightning":
            raise
        raise ImportError(
            "leakfree.integrations.lightning needs Lightning: pip install lightning "
            "(or the standalone pytorch-lightning)"
        ) from e


from leakfree.integrations._growth import WatchingCallback

__all__ = ["LeakfreeCallback"]


class LeakfreeCallback(WatchingCallback, Callback):  # type: ignore[misc]
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
        fail: raise :class:`~leakfree.testing.LeakError` (out of ``trainer.fit``) instead
            of warning :class:`~leakfree.integrations.MemoryGrowthWarning`.
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
            searched: the LightningModule (``pl_module``) and the Trainer.
        log: log the numbers with ``pl_module.log`` (default True).
    """

    _last_step = -1

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.watch.stop()
        self.watch.start()
        self._last_step = trainer.global_step

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # accumulating gradients: no optimizer step in this batch
        self._last_step = trainer.global_step
        self.watch.step(lambda: {"pl_module": pl_module, "trainer": trainer})
        if self._log:
            metrics = self.watch.metrics()
            if metrics:
                pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.watch.stop()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self.watch.stop(failed=True)
