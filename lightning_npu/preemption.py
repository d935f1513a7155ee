"""Preemption (SIGTERM, SLURM's requeue signal) that stops every rank at the same step, optionally saves, and exits.

Lightning's own SIGTERM handler runs a collective (``dist.broadcast``) inside the signal handler. When the
whole process group is signalled (what SLURM and Kubernetes do) the ranks are caught in different collectives,
disagree, and hang until the process-group timeout (30 min); when they do exit, the code is 0
(``SIGTERMException`` subclasses ``SystemExit``) and nothing is saved.

Here, for every Trainer run on an NPU strategy (:func:`install`, wrapped into Lightning's signal connector at
``import lightning_npu``):

1. The handler only records the signal (and forwards it once to the local ranks the launcher started, as
   Lightning does, for a signal sent to the main process alone). It arms a watchdog that ends the process
   with ``128 + signum`` after ``exit_timeout_s`` whatever happens, so no process outlives the grace period.
2. At an optimizer-step boundary (``on_train_batch_end`` once ``global_step`` moved, every
   ``check_every_n_steps`` steps) the ranks agree with one all-reduce (MAX) of a one-element tensor on the
   device. Every rank takes part at the same steps, so the collective is matched whatever the signal timing,
   and one signalled rank is enough to stop them all.
3. If a signal was seen: optionally save a checkpoint (a collective, by every rank at the same point), then
   raise :class:`Preempted` (a ``SystemExit`` with code ``128 + signum``, 143 for SIGTERM) on every rank.

Cost: one 4-byte all-reduce and one host read per check. Lightning already ends every step with a device
broadcast and a host read of its own SIGTERM flag (``_TrainingEpochLoop._broadcast_sigterm_tensor``), so the
device queue is drained at that point anyway and the check adds about one small-collective latency per step
(tens of microseconds on HCCL, against steps of seconds). ``check_every_n_steps`` trades that against the
stopping latency (at most that many steps).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from lightning_npu.facts.env import SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID, SLURM_JOB_ID

_PATCHED = "_lightning_npu_patched"


class Preempted(SystemExit):
    """Raised on every rank at the agreed step; the process exits with ``128 + signum``."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]) -> None:
        super().__init__(128 + signum)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    def __str__(self) -> str:
        saved = f"; checkpoint {self.checkpoint}" if self.checkpoint else "; no checkpoint saved (save_on_preemption=False)"
        return f"preempted by {signal.Signals(self.signum).name} at step {self.step}{saved}"


class GracefulPreemption(Callback):
    """Stop all ranks at the same step on SIGTERM / the requeue signal, optionally save, exit ``128 + signum``.

    Added to every Trainer run on an NPU strategy (with ``save_on_preemption=False``) unless the user passes one.

    Args:
        save_on_preemption: write a checkpoint before exiting: ``<ModelCheckpoint dirpath>/preempted-step=N.ckpt``,
            or Lightning's ``hpc_ckpt_N.ckpt`` under SLURM auto-requeue (which Lightning resumes from by itself).
        check_every_n_steps: agree on the flag every this many optimizer steps (see the module docstring).
        exit_timeout_s: seconds after the first signal by which the process is gone in any case (a watchdog
            calls ``os._exit(128 + signum)``); keep it below the scheduler's grace period
            (Kubernetes' ``terminationGracePeriodSeconds``, SLURM's ``KillWait`` / ``--signal=...@N``). None: no watchdog.
    """

    def __init__(self, save_on_preemption: bool = False, check_every_n_steps: int = 1,
                 exit_timeout_s: Optional[float] = 120.0) -> None:
        if not isinstance(check_every_n_steps, int) or check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps={check_every_n_steps!r} must be an integer >= 1, e.g. 1")
        if exit_timeout_s is not None and float(exit_timeout_s) <= 0:
            raise ValueError(f"exit_timeout_s={exit_timeout_s!r} must be a positive number of seconds, or None")
        self.save_on_preemption = save_on_preemption
        self.check_every_n_steps = check_every_n_steps
        self.exit_timeout_s = exit_timeout_s
        self.signum: Optional[int] = None
        self._signalled_at: Optional[float] = None
        self._trainer: Optional[Trainer] = None
        self._last_checked_step = -1

    # ------------------------------------------------------------------------------ signals
    def signals(self, trainer: Trainer) -> list[int]:
        """SIGTERM, and the requeue signal (SLURM's configured one, else SIGUSR1)."""
        environment = _environment(trainer)
        requeue = environment.requeue_signal if isinstance(environment, SLURMEnvironment) else None
        return [signal.SIGTERM, requeue or signal.SIGUSR1]

    def arm(self, trainer: Trainer) -> None:
        """Install the flag-only handlers (main thread only, as Python requires)."""
        self._trainer, self.signum, self._signalled_at, self._last_checked_step = trainer, None, None, -1
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals(trainer):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Async-signal context: record, forward, arm the watchdog; no collective, no lock-taking logging.
        if self.signum is not None:
            return
        self.signum, self._signalled_at = signum, time.monotonic()
        sys.stderr.write(f"[lightning-npu] pid {os.getpid()} received {signal.Signals(signum).name}: stopping at the"
                         " next step boundary agreed by all ranks\n")
        for proc in _children(self._trainer):
            if proc.poll() is None:
                proc.send_signal(signum)
        if self.exit_timeout_s is not None:
            watchdog = threading.Timer(float(self.exit_timeout_s), _hard_exit, args=(signum, self.exit_timeout_s))
            watchdog.daemon = True
            watchdog.start()

    # ------------------------------------------------------------------------------- hooks
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        # Only at optimizer-step boundaries (global_step moved), so a stop never drops accumulated gradients.
        if step == self._last_checked_step or step % self.check_every_n_steps:
            return
        self._last_checked_step = step
        signum = self.agreed_signal(trainer)
        if signum:
            path = self._save(trainer) if self.save_on_preemption else None
            self._requeue(trainer, signum)
            stop = Preempted(signum, step, path)
            if trainer.is_global_zero:
                resume = f" -- resume with ckpt_path={path}" if path else ""
                print(f"[lightning-npu] {stop}{resume}; exiting with code {128 + signum}", flush=True)
            raise stop

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, Preempted):
            # The launcher's children stop at the same step; reap them so none outlives the main process.
            deadline = (self._signalled_at or time.monotonic()) + float(self.exit_timeout_s or 60.0)
            for proc in _children(trainer):
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
                except subprocess.TimeoutExpired:
                    proc.kill()

    def agreed_signal(self, trainer: Trainer) -> int:
        """The largest signal number any rank received (0: none). A collective: every rank calls it together."""
        local = self.signum or 0
        if not (dist.is_available() and dist.is_initialized() and trainer.world_size > 1):
            return local
        flag = torch.tensor([local], dtype=torch.int32, device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    # ------------------------------------------------------------------------------ actions
    def _save(self, trainer: Trainer) -> str:
        environment = _environment(trainer)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        else:
            checkpoint = trainer.checkpoint_callback
            folder = getattr(checkpoint, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
            path = str(Path(folder) / f"preempted-step={trainer.global_step}.ckpt")
        path = trainer.strategy.broadcast(path)  # one name on every rank, whatever each sees on disk
        trainer.save_checkpoint(path)
        return path

    def _requeue(self, trainer: Trainer, signum: int) -> None:
        environment = _environment(trainer)
        if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue and trainer.is_global_zero):
            return
        if signum != (environment.requeue_signal or signal.SIGUSR1):
            return
        array_job = os.environ.get(SLURM_ARRAY_JOB_ID)
        job = f"{array_job}_{os.environ[SLURM_ARRAY_TASK_ID]}" if array_job else os.environ[SLURM_JOB_ID]
        result = subprocess.call(["scontrol", "requeue", job])
        print(f"[lightning-npu] scontrol requeue {job}: {'done' if result == 0 else f'failed ({result})'}", flush=True)


def _environment(trainer: Trainer) -> Any:
    # Single-device strategies have no cluster environment.
    return getattr(trainer.strategy, "cluster_environment", None)


def _children(trainer: Optional[Trainer]) -> list[subprocess.Popen]:
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    return list(getattr(launcher, "procs", None) or [])


def _hard_exit(signum: int, after_s: float) -> None:
    sys.stderr.write(f"[lightning-npu] pid {os.getpid()}: not stopped {after_s:g} s after"
                     f" {signal.Signals(signum).name} (exit_timeout_s); exiting now\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def _preemption_callback(trainer: Trainer) -> GracefulPreemption:
    for callback in trainer.callbacks:
        if isinstance(callback, GracefulPreemption):
            return callback
    callback = GracefulPreemption()
    trainer.callbacks.append(callback)
    return callback


def install() -> None:
    """Replace Lightning's signal handlers by :class:`GracefulPreemption`'s for NPU strategies (idempotent)."""
    if getattr(_SignalConnector, _PATCHED, False):
        return
    from lightning_npu.strategies import NPU_STRATEGY_TYPES

    original = _SignalConnector.register_signal_handlers

    @functools.wraps(original)
    def register_signal_handlers(self: _SignalConnector) -> None:
        if not isinstance(self.trainer.strategy, NPU_STRATEGY_TYPES):
            return original(self)
        self.received_sigterm = False  # stays False: Lightning's own per-step broadcast then never stops a rank alone
        self._original_handlers = self._get_current_signal_handlers()  # restored by Lightning's teardown()
        _preemption_callback(self.trainer).arm(self.trainer)

    _SignalConnector.register_signal_handlers = register_signal_handlers
    setattr(_SignalConnector, _PATCHED, True)


__all__ = ["GracefulPreemption", "Preempted", "install"]
