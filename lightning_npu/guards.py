"""A non-finite (NaN / Inf) training loss stops the run with an error naming the step, and no checkpoint is written
from the weights it produced.

:class:`NonFiniteLossFlag` is the mechanism, one for the Trainer and Fabric; :class:`NonFiniteLossGuard` (a Trainer
callback, any LightningModule and strategy) and :class:`FabricNonFiniteLossGuard` (called from a Fabric loop) adapt
it. Two modes:

``max_skipped_steps=0`` (default): one check per step on the device, no host sync on steps that are fine.
    ``isfinite(loss)`` is folded into a device tensor holding the first bad step. The host reads it (after a MIN
    all-reduce, so every rank agrees even when only one rank's batch diverged) only at *read points*: every
    ``check_every_n_steps`` optimizer steps (for the Trainer by default its ``log_every_n_steps``, where Lightning's
    logging syncs the host with the device anyway), before every checkpoint save (the Trainer's
    ``on_save_checkpoint``, so ModelCheckpoint, preemption saves and ``trainer.save_checkpoint`` never write weights a
    non-finite loss produced; for Fabric every ``fabric.save`` of the guarded Fabric) and at the end of training.
    The trade-off: the run may train up to ``check_every_n_steps - 1`` steps past the bad one before it stops --
    compute, never a saved checkpoint.
``max_skipped_steps=N > 0``: the optimizer step of a batch with a non-finite loss is not applied, up to N times.
    Skipping must be decided before ``optimizer.step()``, so this mode reads (and all-reduces) the flag on every
    step, before the optimizer step: one host sync per step. The Trainer's guard skips by setting every gradient to
    ``None``, which torch optimizers (AdamW, SGD, ...) treat as "no update": no moment update, no weight decay, no
    step count; a Fabric loop skips by not calling ``optimizer.step()``. Under FSDP the flag is all-reduced first,
    so every rank skips the same steps.

Steps are the optimizer steps done before the loss was computed: ``trainer.global_step`` then, the step number
Lightning logs; for Fabric the ``step`` the loop passes.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.utilities import rank_zero_warn
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

# Sentinel for "no non-finite loss yet": larger than any step count.
_NONE = torch.iinfo(torch.int64).max


class NonFiniteLossError(RuntimeError):
    """The training loss was NaN or Inf."""


class NonFiniteLossFlag:
    """The mechanism the Trainer and Fabric guards share: the device flag, its agreed reads, the skip budget.

    Args:
        max_skipped_steps: optimizer steps with a non-finite loss to skip (not apply) before stopping; 0 stops at
            the first. Above 0 costs one host sync per step (see the module docstring).
        check_every_n_steps: with ``max_skipped_steps=0``, read the device flag every this many optimizer steps.
            Checkpoint saves and the end of training always read it.
    """

    #: What the step numbers count, and which checkpoints predate a bad step, as the error message names them.
    STEP: str
    EARLIER_CHECKPOINTS: str

    def __init__(self, max_skipped_steps: int = 0, check_every_n_steps: Optional[int] = None) -> None:
        if isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int) or max_skipped_steps < 0:
            raise ValueError(f"max_skipped_steps={max_skipped_steps!r} must be an integer >= 0 (0: stop at the first)")
        if check_every_n_steps is not None and (not isinstance(check_every_n_steps, int) or check_every_n_steps < 1):
            raise ValueError(f"check_every_n_steps={check_every_n_steps!r} must be an integer >= 1, or None")
        self.max_skipped_steps = max_skipped_steps
        self.check_every_n_steps = check_every_n_steps
        self.skipped_steps: list[int] = []
        self._first_bad: Optional[Tensor] = None  # device int64: first step with a non-finite loss, or _NONE
        self._step_bad: Optional[Tensor] = None  # device bool: this optimizer step saw a non-finite loss
        self._stopped_at: Optional[int] = None  # host: the agreed bad step once found
        self._last_read_step = -1

    @property
    def _skipping(self) -> bool:
        return self.max_skipped_steps > 0

    def reset(self, device: torch.device, step: int) -> None:
        """Start watching on ``device`` from ``step`` (optimizer steps done so far)."""
        self._first_bad = torch.full((), _NONE, dtype=torch.int64, device=device)
        self._step_bad = torch.zeros((), dtype=torch.bool, device=device)
        self.skipped_steps, self._stopped_at, self._last_read_step = [], None, step

    def observe(self, loss: Tensor, step: int) -> None:
        """Fold ``isfinite(loss)`` of step ``step`` into the device flag: no host sync."""
        bad = ~torch.isfinite(loss.detach()).all()
        if self._skipping:
            self._step_bad = self._step_bad | bad  # OR over the micro-batches of one optimizer step
        else:
            self._first_bad = torch.where(bad, self._first_bad.clamp(max=step), self._first_bad)

    def skip_step(self, step: int, strategy: Any) -> bool:
        """With ``max_skipped_steps > 0``, before the optimizer step of ``step``: whether any rank saw a non-finite
        loss in it (then the step must not be applied); raises past the budget. A collective: every rank, every step."""
        bad = bool(_all_reduce(self._step_bad.to(torch.int32), dist.ReduceOp.MAX, strategy).item())
        self._step_bad = torch.zeros_like(self._step_bad)
        if not bad:
            return False
        if len(self.skipped_steps) >= self.max_skipped_steps:
            self._fail(step)
        self.skipped_steps.append(step)
        rank_zero_warn(
            f"{type(self).__name__}: non-finite training loss at step {step}; its optimizer step is skipped"
            f" ({len(self.skipped_steps)} of max_skipped_steps={self.max_skipped_steps})"
        )
        return True

    def read_due(self, steps_done: int, every: int) -> bool:
        """Whether ``steps_done`` optimizer steps make a periodic read point (once each; never when skipping, which
        reads every step)."""
        if self._skipping or steps_done == self._last_read_step or steps_done % max(every, 1):
            return False
        self._last_read_step = steps_done
        return True

    def read(self, strategy: Any) -> None:
        """Raise :class:`NonFiniteLossError` if any rank saw a non-finite loss. A collective: call on every rank."""
        if self._stopped_at is not None:
            self._fail(self._stopped_at)
        if self._skipping or self._first_bad is None:
            return
        first = int(_all_reduce(self._first_bad.clone(), dist.ReduceOp.MIN, strategy).item())
        if first != _NONE:
            self._fail(first)

    def _fail(self, step: int) -> None:
        self._stopped_at = step
        skipped = f" after skipping steps {self.skipped_steps}" if self.skipped_steps else ""
        raise NonFiniteLossError(
            f"The training loss was NaN or Inf at step {step} ({self.STEP}){skipped}; training stopped and"
            f" no checkpoint was written from the weights it produced"
            f" ({self.EARLIER_CHECKPOINTS.format(step=step)} predate it)."
            " Lower the learning rate or raise the warmup, enable gradient clipping, check the data of that step,"
            f" or allow {type(self).__name__}(max_skipped_steps=N) to skip up to N such steps"
            f" (now {self.max_skipped_steps})."
        )


class NonFiniteLossGuard(NonFiniteLossFlag, Callback):
    """Stop on the first NaN/Inf training loss (optionally skip up to ``max_skipped_steps`` such steps first).

    Args:
        max_skipped_steps: see :class:`NonFiniteLossFlag`.
        check_every_n_steps: with ``max_skipped_steps=0``, read the device flag every this many optimizer steps;
            None: the Trainer's ``log_every_n_steps``. Checkpoint saves and the end of training always read it.
    """

    STEP = "trainer.global_step"
    EARLIER_CHECKPOINTS = "checkpoints of global_step <= {step}"

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.reset(trainer.strategy.root_device, trainer.global_step)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        if self._first_bad is not None:  # else not fitting (e.g. a manual backward outside fit)
            self.observe(loss, trainer.global_step)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if not self._skipping or self._step_bad is None:
            return
        if self.skip_step(trainer.global_step, trainer.strategy):
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None  # torch optimizers leave parameters without a gradient untouched

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.read_due(trainer.global_step, self.check_every_n_steps or trainer.log_every_n_steps):
            self.read(trainer.strategy)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Runs inside every save, on every rank, before any file is written: a raise here writes nothing.
        self.read(trainer.strategy)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.read(trainer.strategy)


class FabricNonFiniteLossGuard(NonFiniteLossFlag):
    """For a Fabric loop: stop on the first NaN/Inf training loss (optionally skip up to ``max_skipped_steps`` first).

    On every rank, every step, after ``fabric.backward(loss)``::

        if guard.skip(loss, step):        # True only with max_skipped_steps > 0
            optimizer.zero_grad()
            continue
        optimizer.step()

    Every ``fabric.save`` of ``fabric`` reads the flag first (a raise there writes nothing); after a loop that ends
    without a save, call :meth:`check`.

    Args:
        fabric: the Fabric whose ranks agree and whose saves are guarded.
        max_skipped_steps: see :class:`NonFiniteLossFlag`.
        check_every_n_steps: with ``max_skipped_steps=0``, read the device flag every this many steps (a Fabric
            loop has no logging interval to default to; 50 is the Trainer's default ``log_every_n_steps``).
    """

    STEP = "the step passed to skip()"
    EARLIER_CHECKPOINTS = "checkpoints saved at step <= {step}"

    def __init__(self, fabric: Fabric, max_skipped_steps: int = 0, check_every_n_steps: int = 50) -> None:
        if check_every_n_steps is None:
            raise ValueError("check_every_n_steps=None: a Fabric loop has no log_every_n_steps to read the flag at;"
                             " pass an integer >= 1, e.g. your logging interval")
        super().__init__(max_skipped_steps, check_every_n_steps)
        self.fabric = fabric
        save = fabric.save

        @functools.wraps(save)
        def save_if_finite(*args: Any, **kwargs: Any) -> Any:
            self.check()  # on every rank (fabric.save is called on all), before any file is written
            return save(*args, **kwargs)

        fabric.save = save_if_finite

    def skip(self, loss: Tensor, step: int) -> bool:
        """Watch ``loss`` (every element must be finite; with gradient accumulation, the micro-batches' losses
        stacked) of step ``step`` (optimizer steps done before it, the same on every rank). Returns whether to skip
        this optimizer step; raises :class:`NonFiniteLossError` at a read point after a non-finite loss, or past
        ``max_skipped_steps``. A collective at read points (with skipping: every step): call it on every rank."""
        if self._first_bad is None:
            self.reset(loss.device, step)
        self.observe(loss, step)
        if self._skipping:
            return self.skip_step(step, self.fabric.strategy)
        if self.read_due(step + 1, self.check_every_n_steps):  # after this step's loss: step + 1 steps' losses
            self.check()
        return False

    def check(self) -> None:
        """Raise :class:`NonFiniteLossError` if any rank saw a non-finite loss. A collective: call on every rank."""
        self.read(self.fabric.strategy)


def _all_reduce(tensor: Tensor, op: Any, strategy: Any) -> Tensor:
    if dist.is_available() and dist.is_initialized() and getattr(strategy, "world_size", 1) > 1:
        dist.all_reduce(tensor, op=op)
    return tensor


__all__ = ["FabricNonFiniteLossGuard", "NonFiniteLossError", "NonFiniteLossFlag", "NonFiniteLossGuard"]
