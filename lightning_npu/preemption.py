"""Preemption (SIGTERM, SLURM's requeue signal) that stops every rank at the same step, optionally saves, and exits.

Lightning's own SIGTERM handler runs a collective (``dist.broadcast``) inside the signal handler. When the
whole process group is signalled (what SLURM and Kubernetes do) the ranks are caught in different collectives,
disagree, and hang until the process-group timeout (30 min); when they do exit, the code is 0
(``SIGTERMException`` subclasses ``SystemExit``) and nothing is saved. Fabric installs no handler at all: a
signalled rank dies at once, mid-collective, and the others hang.

:class:`Preemption` is the mechanism, one for the Trainer and Fabric:

1. The handler only records the signal (and forwards it once to the local ranks the launcher started, as
   Lightning does, for a signal sent to the main process alone). It arms a watchdog that ends the process
   with ``128 + signum`` after ``exit_timeout_s`` whatever happens, so no process outlives the grace period.
2. At an optimizer-step boundary, every ``check_every_n_steps`` steps, the ranks agree with one all-reduce
   (MAX) of a one-element tensor on the device. Every rank takes part at the same steps, so the collective is
   matched whatever the signal timing, and one signalled rank is enough to stop them all.
3. If a signal was seen: optionally save a checkpoint (a collective, by every rank at the same point), then
   raise :class:`Preempted` (a ``SystemExit`` with code ``128 + signum``, 143 for SIGTERM) on every rank; the
   main process first waits for the ranks it launched, so none outlives it.

Under SLURM with auto-requeue (Lightning's ``SLURMEnvironment``, its default inside an ``srun`` step), the requeue
signal (``sbatch --signal=USR1@N``) always saves in a Trainer run, as Lightning's own handler does, to Lightning's
``<default_root_dir>/hpc_ckpt_N.ckpt``; then global rank 0 runs ``scontrol requeue <job>``, once the checkpoint
is complete (SLURM kills the job right after), and every rank exits with 138. The requeued job (same
directory) resumes from the newest *complete* ``hpc_ckpt_N.ckpt`` by itself: for NPU strategies the connector's
choice ignores the hidden temporary an interrupted save leaves (Lightning reads the digits of any name
containing ``ckpt_``, so ``.hpc_ckpt_2.ckpt.tmp-0123456789ab`` became version 20123456789, a path that does
not exist). ``SLURMEnvironment(auto_requeue=False)`` keeps the job from being requeued.

Two thin adapters drive it: :class:`GracefulPreemption`, a Trainer callback (checked in ``on_train_batch_end``
once ``global_step`` moved; saves with ``trainer.save_checkpoint``), added to every Trainer run on an NPU strategy
by ``lightning_npu.lightning_patches.preemption`` (wrapped into Lightning's signal connector at
``import lightning_npu``); and
:class:`FabricPreemption`, which a Fabric loop asks ``should_stop(step)`` before its own ``fabric.save`` and
``exit(path)``.

Cost: one 4-byte all-reduce and one host read per check. For the Trainer it replaces the device broadcast and host
read of Lightning's own SIGTERM flag that Lightning makes before every batch
(``_TrainingEpochLoop._broadcast_sigterm_tensor``): under these handlers that flag never becomes True, so for NPU
strategies that broadcast is skipped and a step costs one small collective, not two. ``check_every_n_steps``
trades that against the stopping latency (at most that many steps).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn, Optional

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_npu.facts.env import SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID, SLURM_JOB_ID

#: Lightning's name for the checkpoint a SLURM job saves on the requeue signal and resumes from (N from 1 up).
HPC_CHECKPOINT = re.compile(r"hpc_ckpt_(?P<version>[0-9]+)\.ckpt")


class Preempted(SystemExit):
    """Raised on every rank at the agreed step; the process exits with ``128 + signum``."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str], unsaved: str) -> None:
        super().__init__(128 + signum)
        self.signum, self.step, self.checkpoint, self._unsaved = signum, step, checkpoint, unsaved

    def __str__(self) -> str:
        saved = f"; checkpoint {self.checkpoint}" if self.checkpoint else f"; no checkpoint saved ({self._unsaved})"
        return f"preempted by {signal.Signals(self.signum).name} at step {self.step}{saved}"


class Preemption:
    """The mechanism the Trainer and Fabric adapters share (see the module docstring).

    Args:
        check_every_n_steps: agree on the flag every this many optimizer steps (see the module docstring).
        exit_timeout_s: seconds after the first signal by which the process is gone in any case (a watchdog
            calls ``os._exit(128 + signum)``); keep it below the scheduler's grace period
            (Kubernetes' ``terminationGracePeriodSeconds``, SLURM's ``KillWait`` / ``--signal=...@N``). None: no watchdog.
    """

    #: Why no checkpoint was written (in :class:`Preempted`'s message), and how to resume from one (``{path}``).
    UNSAVED: str
    RESUME: str

    def __init__(self, check_every_n_steps: int = 1, exit_timeout_s: Optional[float] = 120.0) -> None:
        if not isinstance(check_every_n_steps, int) or check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps={check_every_n_steps!r} must be an integer >= 1, e.g. 1")
        if exit_timeout_s is not None and float(exit_timeout_s) <= 0:
            raise ValueError(f"exit_timeout_s={exit_timeout_s!r} must be a positive number of seconds, or None")
        self.check_every_n_steps = check_every_n_steps
        self.exit_timeout_s = exit_timeout_s
        self.signum: Optional[int] = None
        self._signalled_at: Optional[float] = None
        self._strategy: Any = None
        self._last_checked_step = -1
        self._children: list[subprocess.Popen] = []  # the launcher's ranks, once detached (``_detach_children``)

    # ------------------------------------------------------------------------------ signals
    def signals(self, strategy: Any) -> list[int]:
        """SIGTERM, and the requeue signal (SLURM's configured one, else SIGUSR1)."""
        environment = _environment(strategy)
        requeue = environment.requeue_signal if isinstance(environment, SLURMEnvironment) else None
        return [signal.SIGTERM, requeue or signal.SIGUSR1]

    def arm(self, strategy: Any) -> dict[int, Any]:
        """Install the flag-only handlers (main thread only, as Python requires); returns the ones they replace."""
        self._strategy, self.signum, self._signalled_at, self._last_checked_step = strategy, None, None, -1
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, self._on_signal) for signum in self.signals(strategy)}

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Async-signal context: record, forward, arm the watchdog; no collective, no lock-taking logging.
        if self.signum is not None:
            return
        self.signum, self._signalled_at = signum, time.monotonic()
        sys.stderr.write(f"[lightning-npu] pid {os.getpid()} received {signal.Signals(signum).name}: stopping at the"
                         " next step boundary agreed by all ranks\n")
        for proc in list(_launcher_procs(self._strategy)):
            if proc.poll() is None:
                proc.send_signal(signum)
        if self.exit_timeout_s is not None:
            watchdog = threading.Timer(float(self.exit_timeout_s), _hard_exit, args=(signum, self.exit_timeout_s))
            watchdog.daemon = True
            watchdog.start()

    # ------------------------------------------------------------------------- the agreement
    def agreed_signal(self, strategy: Any, step: int) -> int:
        """The largest signal number any rank received (0: none), at a check step (every ``check_every_n_steps``,
        once per step; 0 at other steps). A collective at check steps: every rank calls it at the same steps."""
        if step == self._last_checked_step or step % self.check_every_n_steps:
            return 0
        self._last_checked_step = step
        local = self.signum or 0
        if local:  # this agreement stops every rank
            self._detach_children(strategy)
        if not (dist.is_available() and dist.is_initialized() and getattr(strategy, "world_size", 1) > 1):
            return local
        flag = torch.tensor([local], dtype=torch.int32, device=strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        agreed = int(flag.item())
        if agreed:
            self._detach_children(strategy)
        return agreed

    def _detach_children(self, strategy: Any) -> None:
        """Take the ranks the launcher started out of its list, which Lightning's child-process observer polls
        (every 5 s) and answers a child's non-zero exit in by SIGKILLing this process: every rank is about to exit
        128 + signum, and a rank that got there first while this process was still saving or reaping turned this
        process's 143 into -9. ``reap_children`` waits for them instead."""
        procs = _launcher_procs(strategy)
        self._children += [proc for proc in procs if proc not in self._children]
        procs.clear()

    # ------------------------------------------------------------------------------ actions
    def stop(self, strategy: Any, signum: int, step: int, checkpoint: Optional[str]) -> Preempted:
        """The exception every rank raises at the agreed step; requeues the job first (SLURM) and says so on rank 0."""
        self._requeue(strategy, signum)
        preempted = Preempted(signum, step, checkpoint, self.UNSAVED)
        if strategy.is_global_zero:
            resume = f" -- resume with {self.RESUME.format(path=checkpoint)}" if checkpoint else ""
            print(f"[lightning-npu] {preempted}{resume}; exiting with code {128 + signum}", flush=True)
        return preempted

    def reap_children(self, strategy: Any) -> None:
        """Wait for the ranks the launcher started (they stop at the same step), so none outlives the main process."""
        deadline = (self._signalled_at or time.monotonic()) + float(self.exit_timeout_s or 60.0)
        self._detach_children(strategy)
        for proc in self._children:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                proc.kill()
        self._children = []

    def _requeue(self, strategy: Any, signum: int) -> None:
        """``scontrol requeue`` this job (or array task), from global rank 0, on SLURM's requeue signal."""
        if not (_requeues(strategy, signum) and strategy.is_global_zero):
            return
        array_job = os.environ.get(SLURM_ARRAY_JOB_ID)
        job = f"{array_job}_{os.environ[SLURM_ARRAY_TASK_ID]}" if array_job else os.environ[SLURM_JOB_ID]
        result = subprocess.call(["scontrol", "requeue", job])
        print(f"[lightning-npu] scontrol requeue {job}: {'done' if result == 0 else f'failed ({result})'}", flush=True)


class GracefulPreemption(Preemption, Callback):
    """Stop all ranks at the same step on SIGTERM / the requeue signal, optionally save, exit ``128 + signum``.

    Added to every Trainer run on an NPU strategy (with ``save_on_preemption=False``) unless the user passes one.

    Args:
        save_on_preemption: write a checkpoint before exiting: ``<ModelCheckpoint dirpath>/preempted-step=N.ckpt``,
            or Lightning's ``hpc_ckpt_N.ckpt`` under SLURM auto-requeue (which Lightning resumes from by itself).
            SLURM's requeue signal under auto-requeue saves whatever this says: a job requeued without a
            checkpoint would start again from step 0.
        check_every_n_steps, exit_timeout_s: see :class:`Preemption`.
    """

    UNSAVED = "save_on_preemption=False"
    RESUME = "ckpt_path={path}"

    def __init__(self, save_on_preemption: bool = False, check_every_n_steps: int = 1,
                 exit_timeout_s: Optional[float] = 120.0) -> None:
        super().__init__(check_every_n_steps, exit_timeout_s)
        self.save_on_preemption = save_on_preemption

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Only at optimizer-step boundaries (global_step moved), so a stop never drops accumulated gradients.
        step = trainer.global_step
        signum = self.agreed_signal(trainer.strategy, step)
        if signum:
            save = self.save_on_preemption or _requeues(trainer.strategy, signum)
            path = self._save(trainer) if save else None
            raise self.stop(trainer.strategy, signum, step, path)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, Preempted):
            self.reap_children(trainer.strategy)

    def _save(self, trainer: Trainer) -> str:
        if _auto_requeue(trainer.strategy):
            path = next_hpc_checkpoint(str(trainer.default_root_dir))
        else:
            checkpoint = trainer.checkpoint_callback
            folder = getattr(checkpoint, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
            path = str(Path(folder) / f"preempted-step={trainer.global_step}.ckpt")
        path = trainer.strategy.broadcast(path)  # one name on every rank, whatever each sees on disk
        trainer.save_checkpoint(path)
        wait_for_checkpoint = getattr(trainer.strategy, "wait_for_checkpoint", None)  # npu_fsdp's async_save
        if wait_for_checkpoint is not None:
            # The process must not exit, nor the job be requeued (SLURM kills it then), before the save is complete.
            wait_for_checkpoint()
        return path


class FabricPreemption(Preemption):
    """For a Fabric loop: stop all ranks at the same step on SIGTERM / the requeue signal, exit ``128 + signum``.

    Creating it installs the handlers in this process (every rank creates one); :meth:`close` (or the end of a
    ``with`` block) puts the previous ones back. In the loop, on every rank, after the optimizer step::

        if preemption.should_stop(step):   # a collective every check_every_n_steps steps
            fabric.save(path, state)         # optional
            preemption.exit(path)            # raises Preempted: exit status 128 + signum

    Args:
        fabric: the Fabric whose ranks agree (its strategy's device, process group, launcher and cluster environment).
        check_every_n_steps, exit_timeout_s: see :class:`Preemption`.
    """

    UNSAVED = "no checkpoint passed to FabricPreemption.exit()"
    RESUME = "fabric.load('{path}', state)"

    def __init__(self, fabric: Fabric, check_every_n_steps: int = 1, exit_timeout_s: Optional[float] = 120.0) -> None:
        super().__init__(check_every_n_steps, exit_timeout_s)
        self.fabric = fabric
        self._replaced = self.arm(fabric.strategy)
        self._agreed: Optional[tuple[int, int]] = None  # (signum, step) once should_stop said True

    def should_stop(self, step: int) -> bool:
        """Whether every rank stops now. ``step``: the optimizer steps done so far (as ``trainer.global_step``; the
        step a resume continues from), the same on every rank; a collective when it is a multiple of
        ``check_every_n_steps``, so call it on every rank at every step."""
        signum = self.agreed_signal(self.fabric.strategy, step)
        if signum:
            self._agreed = (signum, step)
        return bool(signum)

    def exit(self, checkpoint: Optional[str] = None) -> NoReturn:
        """Raise :class:`Preempted` (exit status ``128 + signum``) on every rank, once ``should_stop`` said True.
        ``checkpoint``: what ``fabric.save`` just wrote, named in the message; an asynchronous save is waited for."""
        if self._agreed is None:
            raise RuntimeError("FabricPreemption.exit() was called before should_stop(step) returned True; call it"
                               " only then, on every rank: `if preemption.should_stop(step): ...; preemption.exit()`")
        signum, step = self._agreed
        wait_for_checkpoint = getattr(self.fabric.strategy, "wait_for_checkpoint", None)  # npu_fsdp's async_save
        if wait_for_checkpoint is not None:
            wait_for_checkpoint()  # a save still in flight would be lost with the process
        stop = self.stop(self.fabric.strategy, signum, step, None if checkpoint is None else str(checkpoint))
        self.reap_children(self.fabric.strategy)
        raise stop

    def close(self) -> None:
        """Put back the signal handlers this replaced."""
        for signum, handler in self._replaced.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._replaced = {}

    def __enter__(self) -> FabricPreemption:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _environment(strategy: Any) -> Any:
    # Single-device strategies have no cluster environment.
    return getattr(strategy, "cluster_environment", None)


def _auto_requeue(strategy: Any) -> bool:
    environment = _environment(strategy)
    return isinstance(environment, SLURMEnvironment) and environment.auto_requeue


def _requeues(strategy: Any, signum: int) -> bool:
    """Whether ``signum`` is SLURM's requeue signal for a job that auto-requeues."""
    return _auto_requeue(strategy) and signum == (_environment(strategy).requeue_signal or signal.SIGUSR1)


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


def _launcher_procs(strategy: Any) -> list[subprocess.Popen]:
    """The launcher's own list of the local ranks it started (empty outside the main process)."""
    procs = getattr(getattr(strategy, "launcher", None), "procs", None)
    return procs if procs is not None else []


def _hard_exit(signum: int, after_s: float) -> None:
    sys.stderr.write(f"[lightning-npu] pid {os.getpid()}: not stopped {after_s:g} s after"
                     f" {signal.Signals(signum).name} (exit_timeout_s); exiting now\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def preemption_callback(trainer: Trainer) -> GracefulPreemption:
    """The Trainer's GracefulPreemption callback, added to its callbacks if it has none."""
    for callback in trainer.callbacks:
        if isinstance(callback, GracefulPreemption):
            return callback
    callback = GracefulPreemption()
    trainer.callbacks.append(callback)
    return callback


__all__ = ["FabricPreemption", "GracefulPreemption", "Preempted", "Preemption"]
