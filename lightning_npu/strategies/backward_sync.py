"""``fabric.no_backward_sync`` for FSDP2 modules that leaves gradient sync as it found it.

Lightning 2.6's FSDP2 control (``_FSDPNoSync`` in ``lightning/fabric/strategies/model_parallel.py``) sets each
unit's flag to ``not enabled`` on enter and to ``enabled`` on exit, so ``enabled=False`` leaves sync *off*
(the next plain backward reduces nothing and the ranks drift apart) and an inner context turns sync back on
inside an outer one. Here, as in DDP's ``no_sync``: ``enabled=False`` changes nothing, and ``enabled=True``
records every unit's flags, turns reduction off, and puts the recorded flags back on exit.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_npu import compat


@contextmanager
def gradients_unsynced(module: nn.Module) -> Iterator[None]:
    """Inside: backward passes through ``module``'s FSDP2 units accumulate local gradients without reducing them.

    On exit every unit's flags (reduce-scatter, and all-reduce across replicas under hybrid sharding) are
    what they were on entry, so contexts nest and a backward after the outermost one reduces what accumulated.
    """
    saved = [(unit, flags) for unit in module.modules() if isinstance(unit, FSDPModule)
             if (flags := compat.fsdp_gradient_sync_flags(unit)) is not None]
    for unit, _ in saved:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit, (reduce, all_reduce) in saved:
            unit.set_requires_gradient_sync(reduce, recurse=False)  # sets both flags to `reduce`
            unit.set_requires_all_reduce(all_reduce, recurse=False)


class RestoringBackwardSyncControl(compat.BackwardSyncControl):
    """Fabric's hook behind ``fabric.no_backward_sync(model, enabled)`` for FSDP2-sharded models."""

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return gradients_unsynced(module) if enabled else nullcontext()


class RestoresBackwardSync:
    """Mixin for Fabric FSDP2 strategies: installs :class:`RestoringBackwardSyncControl` in place of Lightning's.

    List it after the class whose ``__init__`` has the strategy's signature and before Lightning's
    ``ModelParallelStrategy``, whose ``__init__`` assigns the control this one replaces.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        compat.set_backward_sync_control(self, RestoringBackwardSyncControl())


__all__ = ["RestoresBackwardSync", "RestoringBackwardSyncControl", "gradients_unsynced"]
