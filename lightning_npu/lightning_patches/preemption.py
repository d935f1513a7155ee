"""Lightning's signal handling, its per-batch SIGTERM broadcast and its choice of the SLURM checkpoint to resume from,
for NPU strategies (``lightning_npu.preemption`` says why and what replaces them):

- ``SignalConnector.register_signal_handlers``: Lightning's SIGTERM handler runs ``dist.broadcast`` inside the signal
  handler, so a signalled process group hangs; :class:`~lightning_npu.preemption.GracefulPreemption` arms its own.
- ``_TrainingEpochLoop._broadcast_sigterm_tensor``: Lightning's flag stays False under those handlers, so its
  collective and host read before every batch are skipped.
- ``_CheckpointConnector._hpc_resume_path``: Lightning reads the digits of any name containing ``ckpt_``, a save's
  hidden temporary included; ``latest_hpc_checkpoint`` ignores those.

Other strategies keep Lightning's behaviour.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from lightning_npu import compat
from lightning_npu.compat import CheckpointConnector, SignalConnector, TrainingEpochLoop
from lightning_npu.preemption import latest_hpc_checkpoint, preemption_callback
from lightning_npu.strategies import NPU_STRATEGY_TYPES

_PATCHED = "_lightning_npu_patched"


def install() -> None:
    """Replace Lightning's signal handlers by :class:`GracefulPreemption`'s, and its choice of the SLURM
    checkpoint to resume from by :func:`latest_hpc_checkpoint`, for NPU strategies (idempotent)."""
    if getattr(SignalConnector, _PATCHED, False):
        return
    original = SignalConnector.register_signal_handlers

    @functools.wraps(original)
    def register_signal_handlers(self: SignalConnector) -> None:
        if not isinstance(self.trainer.strategy, NPU_STRATEGY_TYPES):
            return original(self)
        self.received_sigterm = False  # stays False: Lightning's own per-step broadcast then never stops a rank alone
        compat.keep_signal_handlers(self)  # restored by Lightning's teardown()
        preemption_callback(self.trainer).arm(self.trainer.strategy)

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
