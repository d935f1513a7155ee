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
3. If a signal was seen: optionally save a checkpoint (a collective, by every rank at the same point) and wait
   until it is complete (an asynchronous save included), then raise :class:`Preempted` (a ``SystemExit`` with
   code ``128 + signum``, 143 for SIGTERM) on every rank.

Under SLURM with auto-requeue (Lightning's ``SLURMEnvironment``, its default inside an ``srun`` step), the requeue
signal (``sbatch --signal=USR1@N``) always saves, as Lightning's own handler does, to Lightning's
``<default_root_dir>/hpc_ckpt_N.ckpt``; then global rank 0 runs ``scontrol requeue <job>``, once the checkpoint
is complete (SLURM kills the job right after), and every rank exits with 138. The requeued job (same
directory) resumes from the newest *complete* ``hpc_ckpt_N.ckpt`` by itself: for NPU strategies the connector's
choice ignores the hidden temporary an interrupted save leaves (Lightning reads the digits of any name
containing ``ckpt_``, so ``.hpc_ckpt_2.ckpt.tmp-0123456789ab`` became version 20123456789, a path that does
not exist). SLURMEnvironment(auto_requeue=False) keeps the job from being requeued.

Cost: one 4-byte all-reduce and one host read per check. It replaces the device broadcast and host read of
Lightning's own SIGTERM flag that Lightning makes before every batch (``_TrainingEpochLoop._broadcast_sigterm_tensor``):
under these handlers that flag never becomes True, so for NPU strategies that broadcast is skipped and a step
costs one small collective, not two. ``check_every_n_steps`` trades that against the stopping latency (at most
that many steps).
"""

from __future__ import annotations

import functools
import os
import re
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
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_npu import compat
from lightning_npu.compat import CheckpointConnector, SignalConnector, TrainingEpochLoop

from lightning_npu.facts.env import SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID, SLURM_JOB_ID

_PATCHED = "_lightning_npu_patched"
#: Lightning's name for the checkpoint a SLURM job saves on the requeue signal and resumes from (N from 1 up).
HPC_CHECKPOINT = re.compile(r"hpc_ckpt_(?P<version>[0-9]+)\.ckpt")


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
            SLURM's requeue signal under auto-requeue saves whatever this says: a job requeued without a
            checkpoint would start again from step 0.
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
            requeue = _requeues(trainer, signum)
            path = self._save(trainer) if self.save_on_preemption or requeue else None
            if requeue:
                _requeue(trainer)
            stop = Preempted(signum, step, path)
            if trainer.is_global_zero:
                resume = f" -- resume with ckpt_path={path}" if path else ""
                if path and HPC_CHECKPOINT.fullmatch(os.path.basename(path)):
                    resume += " (a run under SLURM in the same default_root_dir resumes from it by itself)"
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
        if _auto_requeue(trainer):
            path = next_hpc_checkpoint(str(trainer.default_root_dir))
        else:
            checkpoint = trainer.checkpoint_callback
            folder = getattr(checkpoint, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
            path = str(Path(folder) / f"preempted-step={trainer.global_step}.ckpt")
        path = trainer.strategy.broadcast(path)  # one name on every rank, whatever each sees on disk
        trainer.save_checkpoint(path)
        from lightning_npu.strategies import SHARDED_STRATEGY_TYPES

        if isinstance(trainer.strategy, SHARDED_STRATEGY_TYPES):
            # An asynchronous save returns with the shards still being written; the process must not exit, nor the
            # job be requeued (SLURM kills it then), before the checkpoint is complete.
            trainer.strategy.wait_for_checkpoint()
        return path


def _environment(trainer: Trainer) -> Any:
    # Single-device strategies have no cluster environment.
    return getattr(trainer.strategy, "cluster_environment", None)


def _auto_requeue(trainer: Trainer) -> bool:
    environment = _environment(trainer)
    return isinstance(environment, SLURMEnvironment) and environment.auto_requeue


def _requeues(trainer: Trainer, signum: int) -> bool:
    """Whether ``signum`` is SLURM's requeue signal for a job that auto-requeues."""
    return _auto_requeue(trainer) and signum == (_environment(trainer).requeue_signal or signal.SIGUSR1)


def _requeue(trainer: Trainer) -> None:
    """``scontrol requeue`` this job (or array task), from global rank 0."""
    if not trainer.is_global_zero:
        return
    array_job = os.environ.get(SLURM_ARRAY_JOB_ID)
    job = f"{array_job}_{os.environ[SLURM_ARRAY_TASK_ID]}" if array_job else os.environ[SLURM_JOB_ID]
    result = subprocess.call(["scontrol", "requeue", job])
    print(f"[lightning-npu] scontrol requeue {job}: {'done' if result == 0 else f'failed ({result})'}", flush=True)


def hpc_checkpoint_versions(root: str) -> list[int]:
    """The N of every ``hpc_ckpt_N.ckpt`` in ``root`` (local or fsspec), ascending; hidden temporaries excluded."""
    fs = get_filesystem(root)
    if not fs.isdir(root):
        return []
    names = (os.path.basename(str(entry["name"]).rstrip("/")) for entry in fs.listdir(root))
    return sorted(int(match["version"]) for match in map(HPC_CHECKPOINT.fullmatch, names) if match)


def latest_hpc_checkpoint(root: str) -> Optional[str]:
    """The newest complete ``hpc_ckpt_N.ckpt`` in ``root`` (what a requeued job resumes from), or None."""
    versions = hpc_checkpoint_versions(root)
    return os.path.join(root, f"hpc_ckpt_{versions[-1]}.ckpt") if versions else None


def next_hpc_checkpoint(root: str) -> str:
    """Where the next requeue checkpoint goes: ``hpc_ckpt_<newest N + 1>.ckpt`` in ``root``."""
    versions = hpc_checkpoint_versions(root)
    return os.path.join(root, f"hpc_ckpt_{(versions[-1] if versions else 0) + 1}.ckpt")


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
    """Replace Lightning's signal handlers by :class:`GracefulPreemption`'s, and its choice of the SLURM
    checkpoint to resume from by :func:`latest_hpc_checkpoint`, for NPU strategies (idempotent)."""
    if getattr(SignalConnector, _PATCHED, False):
        return
    from lightning_npu.strategies import NPU_STRATEGY_TYPES

    original = SignalConnector.register_signal_handlers

    @functools.wraps(original)
    def register_signal_handlers(self: SignalConnector) -> None:
        if not isinstance(self.trainer.strategy, NPU_STRATEGY_TYPES):
            return original(self)
        self.received_sigterm = False  # stays False: Lightning's own per-step broadcast then never stops a rank alone
        compat.keep_signal_handlers(self)  # restored by Lightning's teardown()
        _preemption_callback(self.trainer).arm(self.trainer)

    original_broadcast = getattr(TrainingEpochLoop, compat.BROADCAST_SIGTERM)

    @functools.wraps(original_broadcast)
    def broadcast_sigterm_tensor(self: Any) -> None:
        # Lightning's flag stays False under the handlers above: broadcasting it would only cost a collective
        # and a host read before every batch. GracefulPreemption's check agrees on the signal instead.
        if not isinstance(self.trainer.strategy, NPU_STRATEGY_TYPES):
            original_broadcast(self)

    original_resume_path = getattr(CheckpointConnector, compat.HPC_RESUME_PATH)

    def hpc_resume_path(self: Any) -> Optional[str]:
        # Lightning counts the digits of every name containing "ckpt_", a save's hidden temporary included.
        if not isinstance(self.trainer.strategy, NPU_STRATEGY_TYPES):
            return original_resume_path.fget(self)
        return latest_hpc_checkpoint(str(self.trainer.default_root_dir))

    SignalConnector.register_signal_handlers = register_signal_handlers
    setattr(TrainingEpochLoop, compat.BROADCAST_SIGTERM, broadcast_sigterm_tensor)
    setattr(CheckpointConnector, compat.HPC_RESUME_PATH, property(hpc_resume_path, doc=original_resume_path.__doc__))
    setattr(SignalConnector, _PATCHED, True)


__all__ = ["GracefulPreemption", "Preempted", "install"]
