"""Checkpoints of the ``npu_fsdp`` strategies (Trainer and Fabric): atomic, optionally asynchronous, readable
without the strategy.

Layout (unchanged from Lightning's ``ModelParallelStrategy``): a sharded checkpoint is a directory with torch
distributed checkpoint (DCP) files -- ``__<rank>_0.distcp`` shards and ``.metadata`` -- plus ``meta.pt`` with
everything else (step counters, hyper-parameters, callback states); a full checkpoint is one ``torch.save`` file.

Atomicity: every save is written under a hidden temporary name next to its target (``.<name>.tmp-<token>``) and
made visible by one rename on global rank 0 once every rank's part is on disk. A directory that replaces an
existing checkpoint first moves the old one aside (``.<name>.old-<token>``), then renames the new one in, then
deletes the old one; a crash between the two renames is repaired by :func:`recover` (the next save into that
directory, or a load of that path, puts the old checkpoint back). Leftover temporary names are never read:
Lightning's ``ckpt_path="last"`` only matches ``last*.ckpt``.

Asynchronous saves (``async_save=True``): the save call copies the shards into host buffers that the writer
allocates at its first save and reuses (:mod:`lightning_npu.strategies.staging`), and returns; a background thread
writes that copy -- DCP's planning (its collectives, over a dedicated gloo group, so they never interleave with
training's) and the files -- and renames it into place when it is complete. So training stalls only for the copy.
One save is in flight at a time: the next save (which refills the same buffers), a load, a removal and the end of
training wait for it, and a failed background save raises :class:`CheckpointSaveError` there.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

# Lightning's private helpers for the parts of its checkpoint format we keep (fenced in compat).
from lightning_npu import compat
from lightning_npu.compat import (
    LIGHTNING_METADATA_FILENAME,
    Stateful,
    apply_filter,
    has_dtensor_modules,
    load_raw_module_state,
    move_state_into,
    validate_keys_for_strict_loading,
)
from lightning_npu.optim.adamw8bit import AdamW8bit, full_state
from lightning_npu.strategies.staging import HostStaging

#: DCP's index file inside a sharded checkpoint directory.
DCP_METADATA_FILENAME = ".metadata"
#: ``meta.pt``: the non-tensor part of a sharded checkpoint.
META_FILENAME = LIGHTNING_METADATA_FILENAME
CONSOLIDATE_HINT = "lightning-npu consolidate {path} consolidated.ckpt"
_TMP, _OLD = ".tmp-", ".old-"
_LEFTOVER = re.compile(r"^\.(?P<name>.+)(?P<kind>\.tmp-|\.old-)(?P<token>[0-9a-f]{12})$")
_TRAINER_VERSION_KEY = "pytorch-lightning_version"


class CheckpointSaveError(RuntimeError):
    """A checkpoint save (usually a background one) failed; the previous checkpoint at that path is intact."""


# --------------------------------------------------------------------------------------------------------------
# Names, publication and repair
# --------------------------------------------------------------------------------------------------------------


def is_sharded_checkpoint(path: Union[str, Path]) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (what a sharded save of these strategies writes)."""
    path = Path(path)
    return path.is_dir() and (path / DCP_METADATA_FILENAME).is_file()


def consolidate_hint(path: Union[str, Path]) -> str:
    """The one-line command that turns the sharded checkpoint ``path`` into one file."""
    return CONSOLIDATE_HINT.format(path=str(path).rstrip("/"))


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def temporary_path(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}{_TMP}{token}"


def aside_path(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}{_OLD}{token}"


def publish(temporary: Path, path: Path, token: str) -> None:
    """Make the complete checkpoint at ``temporary`` visible as ``path`` (one rename; the old one is removed after)."""
    if path.is_dir() or (temporary.is_dir() and path.exists()):
        # A directory cannot atomically replace a non-empty directory: move the old one aside, rename the new one
        # in, then delete the old one. `recover` repairs a crash between the two renames.
        old = aside_path(path, token)
        os.replace(path, old)
        os.replace(temporary, path)
        _sync_directory(path.parent)
        _remove(old)
    else:
        os.replace(temporary, path)  # a file replaces a file atomically
        _sync_directory(path.parent)


def recover(directory: Path) -> None:
    """Repair what an interrupted save left in ``directory``: put back a checkpoint that was moved aside and never
    replaced, delete temporary checkpoints and old ones already replaced. Run on one rank, with no save in flight."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        match = _LEFTOVER.match(entry.name)
        if match is None:
            continue
        target = directory / match["name"]
        if match["kind"] == _OLD and not target.exists():
            os.replace(entry, target)
        else:
            _remove(entry)


def remove_checkpoint_path(path: Path) -> None:
    if path.exists() or path.is_symlink():
        _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=False)
    else:
        path.unlink(missing_ok=True)


def _sync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------------


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


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer, options: Any) -> dict[str, Any]:
    """``optimizer``'s state for a checkpoint of the sharded ``module``: keyed by parameter name in a sharded
    checkpoint (DCP matches names), numbered as ``optimizer.state_dict()`` numbers them in a full one (so a plain
    optimizer loads it, as it loads the full checkpoints of Lightning's FSDP strategies). A full state exists on
    global rank 0 only, the rank that writes the file: the others get ``{}``, as from Lightning's FSDPStrategy."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    off_rank0 = options.full_state_dict and dist.is_initialized() and dist.get_rank() != 0
    if not optimizer.state:
        # Only the param groups to save. torch would first create the state by a step with a zero gradient
        # allocated per parameter: on every save of an optimizer that keeps none (SGD without momentum), a stall
        # longer than the copy of the weights and a gradients-sized peak; before another's first step, a state of
        # zeros, which a fresh optimizer equals anyway (loading restores exactly what was saved, see _only_saved).
        if off_rank0:
            return {}
        state = optimizer.state_dict()
        return state if options.full_state_dict else keyed_by_name(state, module, optimizer)
    state = get_optimizer_state_dict(module, optimizer, options=options)  # a collective: every rank takes part
    if off_rank0:
        return {}
    # A full checkpoint holds AdamW8bit's moments dequantized, as torch's AdamW keeps and loads them.
    return keyed_by_index(full_state(state)) if options.full_state_dict else state


def split_fabric_state(
    state: Mapping[str, Any], full_state_dict: bool, filter: Optional[dict[str, Callable[[str, Any], bool]]],
    cpu_offload: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fabric's ``state``: (modules' and optimizers' state dicts, everything else), as Fabric's strategy splits it."""
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
            apply_filter(key, filter or {}, get_model_state_dict(obj, options=options), tensors)
        elif isinstance(obj, Optimizer):
            apply_filter(key, filter or {}, optimizer_state_dict(modules[0], obj, options), tensors)
        else:
            apply_filter(key, filter or {}, obj.state_dict() if isinstance(obj, Stateful) else obj, metadata)
    return tensors, metadata


# --------------------------------------------------------------------------------------------------------------
# Loading into a sharded model
# --------------------------------------------------------------------------------------------------------------


def load_into(
    path: Path, state: dict[str, Any], strict: bool, optimizer_states_from_list: bool = False,
    weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """Restore the sharded model and optimizers in ``state`` from ``path`` (sharded directory or full file);
    fill the other requested keys of ``state`` from the checkpoint and return what was not requested."""
    modules = {key: obj for key, obj in state.items() if has_dtensor_modules(obj)}
    if len(modules) != 1:
        raise ValueError(
            f"npu_fsdp loads exactly one sharded model per checkpoint, but the state holds {len(modules)}: pass the"
            " model set up by the strategy (e.g. state={'model': model, 'optimizer': optimizer})"
        )
    (module_key, module), = modules.items()
    optimizers = {key: obj for key, obj in state.items() if isinstance(obj, Optimizer)}
    # The caller may be inside torch.inference_mode() (evaluation code often is): tensors DCP and torch.load
    # create there are inference tensors, which cannot be copied into parameters.
    with torch.inference_mode(False):
        if is_sharded_checkpoint(path):
            remainder = _load_sharded(path, module_key, module, optimizers, strict, optimizer_states_from_list,
                                      weights_only)
        elif path.is_file():
            remainder = _load_full(path, module_key, module, optimizers, strict, optimizer_states_from_list,
                                   weights_only)
        else:
            raise FileNotFoundError(
                f"no checkpoint at {path}: expected a sharded checkpoint directory (with {DCP_METADATA_FILENAME} and"
                f" {META_FILENAME}) or a checkpoint file"
            )
    requested = state.keys() - modules.keys() - optimizers.keys()
    validate_keys_for_strict_loading(requested, remainder.keys(), strict=strict)
    move_state_into(source=remainder, destination=state, keys=requested)
    return remainder


def _load_sharded(path: Path, module_key: str, module: nn.Module, optimizers: dict[str, Optimizer], strict: bool,
                  from_list: bool, weights_only: Optional[bool]) -> dict[str, Any]:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    if not (path / META_FILENAME).is_file():
        raise FileNotFoundError(
            f"{path} holds DCP shards but no {META_FILENAME}: it was not written by a Lightning strategy, or its save"
            " was interrupted"
        )
    saved = _saved_prefixes(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    optimizers = _with_saved_state(optimizers, saved, path, required=strict or from_list)
    model_state = {module_key: get_model_state_dict(module)}
    dcp.load(model_state, checkpoint_id=path)
    module.load_state_dict(model_state[module_key], strict=strict)
    for key, optimizer in optimizers.items():
        optimizer_state = {key: _only_saved(get_optimizer_state_dict(module, optimizer), key, saved)}
        dcp.load(optimizer_state, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key],
                                 options=StateDictOptions(cpu_offload=True))
    return torch.load(path / META_FILENAME, weights_only=weights_only)


def _saved_prefixes(keys: Any) -> set[str]:
    """Every dotted prefix of the checkpoint's flattened keys (``optimizer_0.state.net.0.weight.exp_avg`` gives
    ``optimizer_0``, ``optimizer_0.state``, ...)."""
    prefixes = set()
    for key in keys:
        parts = key.split(".")
        prefixes.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return prefixes


def _only_saved(template: dict[str, Any], key: str, saved: set[str]) -> dict[str, Any]:
    """The live optimizer's state-dict template cut down to what the checkpoint holds.

    The live optimizer may hold more than was saved: param-group entries added since (lr_find's scheduler adds
    ``initial_lr``) or state created since (a checkpoint written before the first step). Asking DCP for those fails
    with "Missing key in checkpoint"; leaving them out makes ``load_state_dict`` restore exactly the saved state.
    """
    state = {
        name: {k: v for k, v in values.items() if f"{key}.state.{name}.{k}" in saved}
        for name, values in template.get("state", {}).items()
    }
    groups = [
        {k: v for k, v in group.items() if k == "params" or f"{key}.param_groups.{i}.{k}" in saved}
        for i, group in enumerate(template.get("param_groups", []))
    ]
    return {**template, "state": {name: values for name, values in state.items() if values}, "param_groups": groups}


def _load_full(path: Path, module_key: str, module: nn.Module, optimizers: dict[str, Optimizer], strict: bool,
               from_list: bool, weights_only: Optional[bool]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    load_raw_module_state(checkpoint.pop(module_key), module, strict=strict)
    if from_list:  # a Trainer checkpoint: the optimizers' states in a list, in the optimizers' order
        checkpoint.update(zip(optimizers, checkpoint.pop("optimizer_states", [])))
    for key, optimizer in _with_saved_state(optimizers, checkpoint, path, required=strict or from_list).items():
        saved = keyed_by_name(checkpoint.pop(key), module, optimizer)
        if isinstance(optimizer, AdamW8bit):  # fp32 moments -> the codes and scales its live state is sharded into
            saved = optimizer.quantized_full_state(saved)
        # torch's full-state path shards the saved tensors onto the live ones and fails when there are none (an
        # optimizer without state, e.g. SGD without momentum): then only the param groups need restoring.
        full = any(isinstance(t, torch.Tensor) for values in saved.get("state", {}).values() for t in values.values())
        options = StateDictOptions(full_state_dict=full, broadcast_from_rank0=full, strict=strict)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=saved, options=options)
    return checkpoint


def _with_saved_state(optimizers: dict[str, Optimizer], saved: Any, path: Path, required: bool) -> dict[str, Optimizer]:
    """The optimizers whose key the checkpoint holds (``saved``: its keys); a missing one fails if ``required``."""
    missing = [key for key in optimizers if key not in saved]
    if missing and required:
        raise KeyError(
            f"the checkpoint {path} holds no optimizer state for {', '.join(map(repr, missing))}: it was saved with"
            " weights only (`save_checkpoint(..., weights_only=True)`, `ModelCheckpoint(save_weights_only=True)`), so"
            " it cannot resume training. Evaluate from it (trainer.validate/test/predict(ckpt_path=...)), or start a"
            " new fit from its weights (`MyModule.load_from_checkpoint(path)`, then trainer.fit(model) without"
            " ckpt_path)"
        )
    return {key: optimizer for key, optimizer in optimizers.items() if key not in missing}


def keyed_by_name(optimizer_state: dict[str, Any], module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (what ``set_optimizer_state_dict`` takes), from one keyed by
    index (plain ``optimizer.state_dict()``) or by name. Works when the state is empty (an optimizer without state,
    such as SGD without momentum, before or after its first step)."""
    groups = optimizer_state.get("param_groups", [])
    ids = [p for group in groups for p in group.get("params", [])]
    if not ids or not isinstance(ids[0], int):
        return optimizer_state  # already keyed by name
    # The names DCP's state-dict API keys parameters by (a compiled submodule's `_orig_mod.` is not in them).
    name_of = {id(p): next(iter(compat.dcp_parameter_fqns(module, name))) for name, p in module.named_parameters()}
    live = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(live) != len(ids):
        raise ValueError(
            f"the checkpoint's optimizer state covers {len(ids)} parameters, the optimizer has {len(live)}: the"
            " checkpoint was written for another model or optimizer"
        )
    names = dict(zip(sorted(ids), live))
    return {
        "state": {names[index]: value for index, value in optimizer_state.get("state", {}).items()},
        "param_groups": [{**group, "params": [names[p] for p in group["params"]]} for group in groups],
    }


def keyed_by_index(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """The inverse for one file readable by a plain ``optimizer.load_state_dict``: parameters numbered in
    param-group order, as ``torch.optim.Optimizer.state_dict`` numbers them."""
    groups = optimizer_state.get("param_groups", [])
    order = [name for group in groups for name in group.get("params", [])]
    if not order or isinstance(order[0], int):
        return optimizer_state
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: value for name, value in optimizer_state.get("state", {}).items()},
        "param_groups": [{**group, "params": [index[p] for p in group["params"]]} for group in groups],
    }


# --------------------------------------------------------------------------------------------------------------
# Reading a sharded checkpoint without the strategy (one process, no process group)
# --------------------------------------------------------------------------------------------------------------


def read_sharded(path: Union[str, Path]) -> dict[str, Any]:
    """The whole sharded checkpoint at ``path`` as one in-memory dict, unsharded, on the CPU.

    A Trainer checkpoint comes back in the layout of a normal Lightning checkpoint file (``state_dict``,
    ``optimizer_states`` keyed like ``optimizer.state_dict()``, counters, hyper-parameters); a Fabric checkpoint with
    the keys it was saved with.
    """
    path = Path(path)
    if not is_sharded_checkpoint(path):
        missing = "does not exist" if not path.exists() else f"holds no {DCP_METADATA_FILENAME}"
        raise FileNotFoundError(f"{path} is not a sharded checkpoint directory: it {missing}")
    checkpoint = compat.load_distributed_checkpoint(path)
    for key, value in checkpoint.items():  # optimizer states: AdamW8bit's moments dequantized, as in a full save
        if isinstance(value, dict) and {"state", "param_groups"} <= value.keys():
            checkpoint[key] = full_state(value)
    if _TRAINER_VERSION_KEY in checkpoint and "state_dict" in checkpoint:
        numbered = sorted((int(k.split("_")[1]), k) for k in checkpoint if re.fullmatch(r"optimizer_\d+", k))
        if numbered:
            checkpoint["optimizer_states"] = [keyed_by_index(checkpoint.pop(k)) for _, k in numbered]
    return checkpoint


def read_sharded_state_dict(path: Union[str, Path]) -> dict[str, Any]:
    """Only the model weights (``state_dict``) of the sharded Trainer checkpoint at ``path``, unsharded, on the CPU,
    in one process: the optimizer states a sharded checkpoint also holds (about twice the weights) are not read."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    if not is_sharded_checkpoint(path):
        missing = "does not exist" if not path.exists() else f"holds no {DCP_METADATA_FILENAME}"
        raise FileNotFoundError(f"{path} is not a sharded checkpoint directory: it {missing}")
    loaded: dict[str, Any] = {}
    compat.dcp_load_state_dict(loaded, storage_reader=FileSystemReader(path),
                               planner=compat.EmptyStateDictLoadPlanner(keys={"state_dict"}), no_dist=True)
    if "state_dict" not in loaded:
        raise KeyError(f"the sharded checkpoint {path} holds no 'state_dict' entry: it is not a Trainer checkpoint")
    return loaded["state_dict"]


def consolidate(directory: Union[str, Path], output: Union[str, Path]) -> Path:
    """Write the sharded checkpoint ``directory`` as one checkpoint file ``output`` (atomically)."""
    output = Path(output)
    if output.exists() and output.is_dir():
        raise IsADirectoryError(f"the output {output} is a directory; give a file name, e.g. {output}/model.ckpt")
    checkpoint = read_sharded(directory)
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(output, new_token())
    torch.save(checkpoint, temporary)
    os.replace(temporary, output)
    return output


# --------------------------------------------------------------------------------------------------------------
# Lightning's file loader, taught to read a sharded directory (LightningModule.load_from_checkpoint and friends)
# --------------------------------------------------------------------------------------------------------------

_PATCHED = "_lightning_npu_reads_sharded"


def install_loader() -> None:
    """Let Lightning's checkpoint file loader (``load_from_checkpoint``, ``TorchCheckpointIO``) read a sharded
    checkpoint directory as if it were one file; anything else loads as before. Idempotent."""
    import lightning.fabric.plugins.io.torch_io as torch_io
    import lightning.pytorch.core.saving as saving

    original = compat.lightning_file_loader()
    if getattr(original, _PATCHED, False):
        return

    def load(path_or_url: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> Any:
        directory = _local_directory(path_or_url)
        if directory is not None:
            return _read_for_lightning(directory, map_location)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    load.__doc__ = original.__doc__
    setattr(load, _PATCHED, True)
    # Each module bound the name at import (`from ... import _load as pl_load`): rebind every binding.
    compat.set_lightning_file_loader(load)
    for module in (saving, torch_io):
        if getattr(module, "pl_load", None) is original:
            module.pl_load = load


def _local_directory(path: Any) -> Optional[Path]:
    if not isinstance(path, (str, Path)):
        return None
    text = str(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        return None
    return Path(text) if Path(text).is_dir() else None


def _read_for_lightning(path: Path, map_location: Any) -> dict[str, Any]:
    if not is_sharded_checkpoint(path):
        raise IsADirectoryError(
            f"{path} is a directory but not a sharded checkpoint (no {DCP_METADATA_FILENAME} inside); pass a"
            " checkpoint file, or a sharded checkpoint directory written by npu_fsdp"
        )
    checkpoint = read_sharded(path)
    if isinstance(map_location, (str, torch.device)):
        checkpoint = _map_tensors(checkpoint, torch.device(map_location))
    return checkpoint


def _map_tensors(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {key: _map_tensors(value, device) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(value, device) for value in obj)
    return obj


def directory_error(path: Path, what: str) -> IsADirectoryError:
    """The error for a sharded directory met where only a file works; names the command that makes the file."""
    return IsADirectoryError(
        f"{path} is a sharded checkpoint directory, but {what} needs one checkpoint file. Consolidate it first:"
        f" `{consolidate_hint(path)}`"
    )


__all__ = [
    "CheckpointSaveError",
    "CheckpointWriter",
    "consolidate",
    "install_loader",
    "is_sharded_checkpoint",
    "keyed_by_index",
    "keyed_by_name",
    "load_into",
    "read_sharded",
    "recover",
    "split_fabric_state",
]
