"""A non-finite (NaN / Inf) training loss stops the run with an error naming the step, and no checkpoint is written
from the weights it produced.

:class:`NonFiniteLossGuard` works with any LightningModule and strategy. Two modes:

``max_skipped_steps=0`` (default): one check per step on the device, no host sync on steps that are fine.
    ``on_before_backward`` folds ``isfinite(loss)`` into a device tensor holding the first bad step. The host
    reads it (after a MIN all-reduce, so every rank agrees even when only one rank's batch diverged) only at
    *read points*: every ``check_every_n_steps`` optimizer steps (default: the Trainer's ``log_every_n_steps``,
    where Lightning's logging syncs the host with the device anyway), before every checkpoint save
    (``on_save_checkpoint``, so ModelCheckpoint, preemption saves and ``trainer.save_checkpoint`` never write weights
    a non-finite loss produced) and at the end of training. The trade-off: the run may train up to
    ``check_every_n_steps - 1`` steps past the bad one before it stops -- compute, never a saved checkpoint.
``max_skipped_steps=N > 0``: the optimizer step of a batch with a non-finite loss is not applied, up to N times.
    Skipping must be decided before ``optimizer.step()``, so this mode reads (and all-reduces) the flag on every
    step, in ``on_before_optimizer_step``: one host sync per step. Skipping sets every gradient to ``None``, which
    torch optimizers (AdamW, SGD, ...) treat as "no update": no moment update, no weight decay, no step count.
    Under FSDP the flag is all-reduced first, so every rank skips the same steps.

Steps are ``trainer.global_step`` when the loss was computed: the number of optimizer steps done before it, the
step number Lightning logs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

# Sentinel for "no non-finite loss yet": larger than any step count.
_NONE = torch.iinfo(torch.int64).max


class NonFiniteLossError(RuntimeError):
    """The training loss was NaN or Inf."""


class NonFiniteLossGuard(Callback):
    """Stop on the first NaN/Inf training loss (optionally skip up to ``max_skipped_steps`` such steps first).

    Args:
        max_skipped_steps: optimizer steps with a non-finite loss to skip (not apply) before stopping; 0 stops at
            the first. Above 0 costs one host sync per step (see the module docstring).
        check_every_n_steps: with ``max_skipped_steps=0``, read the device flag every this many optimizer steps;
            None: the Trainer's ``log_every_n_steps``. Checkpoint saves and the end of training always read it.
    """

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

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = trainer.strategy.root_device
        self._first_bad = torch.full((), _NONE, dtype=torch.int64, device=device)
        self._step_bad = torch.zeros((), dtype=torch.bool, device=device)
        self.skipped_steps, self._stopped_at, self._last_read_step = [], None, trainer.global_step

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        if self._first_bad is None:  # not fitting (e.g. a manual backward outside fit)
            return
        bad = ~torch.isfinite(loss.detach()).all()
        if self._skipping:
            self._step_bad = self._step_bad | bad  # OR over the micro-batches of one optimizer step
        else:
            self._first_bad = torch.where(bad, self._first_bad.clamp(max=trainer.global_step), self._first_bad)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if not self._skipping or self._step_bad is None:
            return
        bad = bool(_all_reduce(self._step_bad.to(torch.int32), dist.ReduceOp.MAX, trainer).item())
        self._step_bad = torch.zeros_like(self._step_bad)
        if not bad:
            return
        step = trainer.global_step
        if len(self.skipped_steps) >= self.max_skipped_steps:
            self._fail(step, trainer)
        self.skipped_steps.append(step)
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None  # torch optimizers leave parameters without a gradient untouched
        rank_zero_warn(
            f"NonFiniteLossGuard: non-finite training loss at step {step}; its optimizer step is skipped"
            f" ({len(self.skipped_steps)} of max_skipped_steps={self.max_skipped_steps})"
        )

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        every = self.check_every_n_steps or trainer.log_every_n_steps
        if self._skipping or step == self._last_read_step or step % max(every, 1):
            return
        self._last_read_step = step
        self.check(trainer)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Runs inside every save, on every rank, before any file is written: a raise here writes nothing.
        self.check(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.check(trainer)

    def check(self, trainer: Trainer) -> None:
        """Raise :class:`NonFiniteLossError` if any rank saw a non-finite loss. A collective: call on every rank."""
        if self._stopped_at is not None:
            self._fail(self._stopped_at, trainer)
        if self._skipping or self._first_bad is None:
            return
        first = int(_all_reduce(self._first_bad.clone(), dist.ReduceOp.MIN, trainer).item())
        if first != _NONE:
            self._fail(first, trainer)

    def _fail(self, step: int, trainer: Trainer) -> None:
        self._stopped_at = step
        skipped = f" after skipping steps {self.skipped_steps}" if self.skipped_steps else ""
        raise NonFiniteLossError(
            f"The training loss was NaN or Inf at step {step} (trainer.global_step){skipped}; training stopped and"
            f" no checkpoint was written from the weights it produced (checkpoints of global_step <= {step} predate it)."
            " Lower the learning rate or raise the warmup, enable gradient clipping, check the data of that step,"
            f" or allow NonFiniteLossGuard(max_skipped_steps=N) to skip up to N such steps"
            f" (now {self.max_skipped_steps})."
        )


def _all_reduce(tensor: Tensor, op: Any, trainer: Trainer) -> Tensor:
    if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
        dist.all_reduce(tensor, op=op)
    return tensor


__all__ = ["NonFiniteLossError", "NonFiniteLossGuard"]
