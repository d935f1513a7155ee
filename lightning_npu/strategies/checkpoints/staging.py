"""The host copy an asynchronous checkpoint save writes from: one buffer per state-dict tensor, allocated by the
first save and refilled by every later one.

Fresh host memory costs several times the copy into it: the kernel faults in and zeroes every page on first
touch (0.67 GB per rank on the simulated runtime: 2.5 s into new memory, 0.5-0.8 s into memory written before),
and pinning it for device-to-host DMA (NPUs) costs more still. So the buffers live as long as their
:class:`HostStaging` (one staging copy of each rank's shards, for the life of the strategy), and a save whose
tensors changed shape or dtype, or whose keys changed, re-allocates only those tensors' buffers.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_npu import compat
from lightning_npu.runtime import Runtime

#: Where a tensor sits in a state dict: the keys and list indices leading to it.
_Path = tuple[Any, ...]


class HostStaging:
    """Copies a state dict's tensors into host buffers it keeps from one :meth:`stage` to the next."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._buffers: dict[_Path, torch.Tensor] = {}

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` whose tensors are the host buffers, filled when this returns: the training loop may
        change ``state`` from then on. DTensors stay DTensors with the same sharding, their local shard on the
        host. Non-tensor values (param groups, step counters) are deep-copied.

        Each call overwrites the buffers the previous copy returned: stage again only once that copy is written.
        """
        buffers: dict[_Path, torch.Tensor] = {}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Saves also happen inside inference mode (ModelCheckpoint after validation): buffers made there would be
        # inference tensors, which a later save outside it could not copy into.
        with torch.inference_mode(False), torch.no_grad():
            staged = self._staged(state, (), buffers, copies, {})
            self._runtime.copy_to_host(copies)
        self._buffers = buffers  # the buffers of keys this state no longer has are freed
        return staged

    def release(self) -> None:
        """Free the buffers (the next :meth:`stage` allocates again)."""
        self._buffers = {}

    def _staged(self, obj: Any, path: _Path, buffers: dict[_Path, torch.Tensor],
                copies: list[tuple[torch.Tensor, torch.Tensor]], seen: dict[int, Any]) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) in seen:  # one tensor under two keys (tied weights): one buffer, as DCP writes it once
                return seen[id(obj)]
            is_dtensor = isinstance(obj, DTensor)
            local = obj.to_local() if is_dtensor else obj
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                buffer = self._runtime.host_buffer(local)
            buffers[path] = buffer
            copies.append((buffer, local))
            seen[id(obj)] = compat.dtensor_with_local(obj, buffer) if is_dtensor else buffer
            return seen[id(obj)]
        if isinstance(obj, dict):
            return {key: self._staged(value, (*path, key), buffers, copies, seen) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._staged(value, (*path, i), buffers, copies, seen) for i, value in enumerate(obj)]
            if isinstance(obj, list):
                return items
            # The tuple subclasses of a state dict are namedtuples, which take their fields as arguments.
            return tuple(items) if type(obj) is tuple else type(obj)(*items)
        return copy.deepcopy(obj)


__all__ = ["HostStaging"]
