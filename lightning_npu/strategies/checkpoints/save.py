"""Writing the checkpoints of the ``npu_fsdp`` strategies (Trainer and Fabric): atomically (``publish``), in the
background when asked.

Asynchronous saves (``async_save=True``): the save call copies the shards into host buffers that the writer
allocates at its first save and reuses (``staging``), and returns; a background thread writes that copy -- DCP's
planning (its collectives, over a dedicated gloo group, so they never interleave with training's) and the files --
and renames it into place when it is complete. So training stalls only for the copy. One save is in flight at a
time: the next save (which refills the same buffers), a load, a removal and the end of training wait for it, and a
failed background save raises :class:`CheckpointSaveError` there.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn
from torch.optim import Optimizer

# Lightning's private helpers for the parts of its checkpoint format we keep (fenced in compat).
from lightning_npu.parallel.handle import StateLayout
from lightning_npu.compat import Stateful, apply_filter, has_dtensor_modules
from lightning_npu.strategies.checkpoints.layout import META_FILENAME, is_sharded_checkpoint
from lightning_npu.strategies.checkpoints.optimizer_state import (
    keyed_by_index,
    keyed_by_name,
    to_full_state,
    whole_param_groups,
)
from lightning_npu.strategies.checkpoints.pipeline_state import full_model_state, full_optimizer_state
from lightning_npu.strategies.checkpoints.publish import (
    new_token,
    publish,
    recover,
    remove_checkpoint_path,
    temporary_path,
)
from lightning_npu.strategies.checkpoints.staging import HostStaging


class CheckpointSaveError(RuntimeError):
    """A checkpoint save (usually a background one) failed; the previous checkpoint at that path is intact."""


class CheckpointWriter:
    """Writes the checkpoints of one strategy: atomically, in the background when ``async_save``.

    ``strategy`` supplies ``global_rank``, ``broadcast`` and ``barrier``; every method is called on all ranks except
    :meth:`remove` (global rank 0 only, as Lightning calls ``remove_checkpoint``).
    """

    def __init__(self, async_save: bool, timeout: Any) -> None:
        self.async_save = async_save
        self._timeout = timeout
        self._group: Any = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._in_flight: Optional[Future] = None
        self._in_flight_path: Optional[Path] = None
        self._lock = threading.Lock()
        self._pending_removals: list[Path] = []
        self._defer_removals = False  # True from a background save's start until it is published (or has failed)
        self._recovered: set[Path] = set()
        self._staging: Optional[HostStaging] = None  # the host copy of an async save, kept from save to save

    # ---- the two save kinds -----------------------------------------------------------------------------------

    def save_sharded(self, strategy: Any, path: Path, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
        """Write ``tensors`` (state dicts of DTensors) as DCP shards and ``metadata`` as ``meta.pt`` into ``path``."""
        from torch.distributed import checkpoint as dcp

        token = self._begin(strategy, path)
        temporary = temporary_path(path, token)
        temporary.mkdir(parents=True, exist_ok=True)
        if not self.async_save:
            dcp.save(tensors, checkpoint_id=temporary)
            # dcp.save returns on rank 0 only after every rank's shards and then `.metadata` are written.
            if strategy.global_rank == 0:
                torch.save(metadata, temporary / META_FILENAME)
            self._finish(strategy.global_rank, temporary, path, token)
            strategy.barrier()  # every rank returns once the checkpoint is visible
            return
        # Now, not in the background: the training loop may change these objects once the call returns.
        if strategy.global_rank == 0:
            torch.save(metadata, temporary / META_FILENAME)
        staged = self._host_staging().stage(tensors)  # `_begin` waited for the write of the previous copy
        group = self._background_group()
        with self._lock:
            self._defer_removals = True
        self._in_flight_path = path
        self._in_flight = self._background().submit(self._write_and_finish, staged, group, strategy.global_rank,
                                                    temporary, path, token)

    def save_full(self, strategy: Any, path: Path, checkpoint: dict[str, Any]) -> None:
        """Write ``checkpoint`` (already gathered on global rank 0) as one file at ``path``."""
        token = self._begin(strategy, path)
        if strategy.global_rank == 0:
            temporary = temporary_path(path, token)
            temporary.parent.mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint, temporary)
            with open(temporary, "rb") as handle:
                os.fsync(handle.fileno())
            self._finish(0, temporary, path, token)
        strategy.barrier()

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    def remove(self, path: Path) -> None:
        """Delete the checkpoint at ``path`` -- after the save in flight is complete, never before it."""
        with self._lock:
            if self._defer_removals:
                self._pending_removals.append(path)
                return
        remove_checkpoint_path(path)

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete and visible; raise if it failed."""
        future, path = self._in_flight, self._in_flight_path
        if future is None:
            return
        self._in_flight = self._in_flight_path = None
        try:
            future.result()
        except BaseException as error:
            with self._lock:
                # The new checkpoint does not exist: keep the ones it was meant to supersede.
                self._pending_removals, self._defer_removals = [], False
            raise CheckpointSaveError(
                f"the background checkpoint save to {path} failed ({type(error).__name__}: {error}); the previous"
                f" checkpoint at {path} (if any) is intact. Fix the cause (disk space, permissions) and save again."
            ) from error

    def recover_path(self, strategy: Any, path: Path) -> None:
        """Before a load: finish our own save in flight and repair an interrupted save of ``path``."""
        self.wait()
        if strategy.global_rank == 0:
            recover(path.parent)
        strategy.barrier()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._staging is not None:
            self._staging.release()

    # ---- internals -----------------------------------------------------------------------------------------

    def _begin(self, strategy: Any, path: Path) -> str:
        self.wait()  # one save in flight at a time
        if strategy.global_rank == 0 and path.parent not in self._recovered:
            # The first save into a directory clears what an interrupted earlier run left there.
            recover(path.parent)
            self._recovered.add(path.parent)
        if path.is_dir() and not is_sharded_checkpoint(path):
            # Checked on every rank (they share the file system), so all of them raise and none waits for the others.
            raise IsADirectoryError(
                f"the checkpoint path {path} is a directory that holds no checkpoint (it would be replaced); choose"
                " another path"
            )
        return strategy.broadcast(new_token())

    def _finish(self, rank: int, temporary: Path, path: Path, token: str) -> None:
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            publish(temporary, path, token)
        # Removals asked for while the save was in flight happen now that the new checkpoint is visible.
        with self._lock:
            removals, self._pending_removals, self._defer_removals = self._pending_removals, [], False
        for old in removals:
            remove_checkpoint_path(old)

    def _write_and_finish(self, staged: dict[str, Any], group: Any, rank: int, temporary: Path, path: Path,
                          token: str) -> None:
        from torch.distributed import checkpoint as dcp

        # On rank 0 this returns once every rank's shards and then `.metadata` are written.
        dcp.save(staged, checkpoint_id=temporary, process_group=group)
        self._finish(rank, temporary, path, token)

    def _host_staging(self) -> HostStaging:
        if self._staging is None:
            from lightning_npu.runtime import get_runtime

            self._staging = HostStaging(get_runtime())
        return self._staging

    def _background(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-npu-checkpoint")
        return self._executor

    def _background_group(self) -> Any:
        # The background write plans over a process group with a CPU backend (its tensors are on the host; the
        # training group may be hccl), and its collectives must not share a communicator with the training loop's.
        import torch.distributed as dist

        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group


def trainer_tensors(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Take the model's and optimizers' state out of a Trainer checkpoint, under the DCP keys Lightning uses
    (``state_dict``, ``optimizer_<i>``); what stays in ``checkpoint`` goes to ``meta.pt``."""
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    return tensors


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer, options: Any,
                         layout: StateLayout) -> dict[str, Any]:
    """``optimizer``'s state for a checkpoint of the sharded ``module``: keyed by parameter name in a sharded
    checkpoint (DCP matches names), numbered as ``optimizer.state_dict()`` numbers them in a full one (so a plain
    optimizer loads it, as it loads the full checkpoints of Lightning's FSDP strategies). A full state exists on
    global rank 0 only, the rank that writes the file: the others get ``{}``, as from Lightning's FSDPStrategy.
    Where ``layout`` splits the parameters over a pipeline's stages the param groups list every stage's parameters
    (``whole_param_groups``)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if options.full_state_dict and layout.split:  # every stage's state, gathered onto global rank 0
        state = full_optimizer_state(module, optimizer, layout)
        return keyed_by_index(to_full_state(optimizer, state)) if state else {}
    off_rank0 = options.full_state_dict and dist.is_initialized() and dist.get_rank() != 0
    if not optimizer.state:
        # Only the param groups to save. torch would first create the state by a step with a zero gradient
        # allocated per parameter: on every save of an optimizer that keeps none (SGD without momentum), a stall
        # longer than the copy of the weights and a gradients-sized peak; before another's first step, a state of
        # zeros, which a fresh optimizer equals anyway (loading restores exactly what was saved, see _only_saved).
        if off_rank0:
            return {}
        state = optimizer.state_dict()
        return state if options.full_state_dict else _whole(keyed_by_name(state, module, optimizer), layout)
    state = get_optimizer_state_dict(module, optimizer, options=options)  # a collective: every rank takes part
    if off_rank0:
        return {}
    # A full checkpoint holds the state as a plain torch optimizer loads it (AdamW8bit's moments dequantized).
    return keyed_by_index(to_full_state(optimizer, state)) if options.full_state_dict else _whole(state, layout)


def _whole(state: dict[str, Any], layout: StateLayout) -> dict[str, Any]:
    return state if not layout.split else whole_param_groups(state, layout.order, layout.group)


def split_fabric_state(
    state: Mapping[str, Any], full_state_dict: bool, filter: Optional[dict[str, Callable[[str, Any], bool]]],
    cpu_offload: bool = True, *, layout: StateLayout,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fabric's ``state``: (modules' and optimizers' state dicts, everything else), as Fabric's strategy splits it
    (``layout``: as ``optimizer_state_dict`` takes it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    modules = [obj for obj in state.values() if has_dtensor_modules(obj)]
    if len(modules) != 1:
        raise ValueError(
            f"npu_fsdp saves exactly one sharded model per checkpoint, but the state holds {len(modules)}: pass the"
            " model set up by `fabric.setup` in `state` (e.g. state={'model': model, 'optimizer': optimizer}) and save"
            " other models to other paths"
        )
    options = StateDictOptions(full_state_dict=full_state_dict, cpu_offload=cpu_offload)
    tensors: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            whole = full_state_dict and layout.split  # every stage's tensors, gathered onto global rank 0
            model_state = full_model_state(obj, layout) if whole else get_model_state_dict(obj, options=options)
            apply_filter(key, filter or {}, model_state, tensors)
        elif isinstance(obj, Optimizer):
            apply_filter(key, filter or {}, optimizer_state_dict(modules[0], obj, options, layout), tensors)
        else:
            apply_filter(key, filter or {}, obj.state_dict() if isinstance(obj, Stateful) else obj, metadata)
    return tensors, metadata
