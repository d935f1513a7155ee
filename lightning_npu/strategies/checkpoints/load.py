"""Loading a checkpoint (a sharded directory or a full file) into a sharded model and its optimizers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_npu.parallel.handle import StateLayout
from lightning_npu.compat import (
    has_dtensor_modules,
    load_raw_module_state,
    move_state_into,
    validate_keys_for_strict_loading,
)
from lightning_npu.strategies.checkpoints.layout import DCP_METADATA_FILENAME, META_FILENAME, is_sharded_checkpoint
from lightning_npu.strategies.checkpoints.optimizer_state import from_full_state, keyed_by_name
from lightning_npu.strategies.checkpoints.pipeline_state import local_optimizer_state


def load_into(
    path: Path, state: dict[str, Any], strict: bool, optimizer_states_from_list: bool = False,
    weights_only: Optional[bool] = None, *, layout: StateLayout,
) -> dict[str, Any]:
    """Restore the sharded model and optimizers in ``state`` from ``path`` (sharded directory or full file);
    fill the other requested keys of ``state`` from the checkpoint and return what was not requested. ``layout``:
    where this rank's parameters sit in the whole model's state (split over a pipeline's stages, a full file is
    read by stages, see ``pipeline_state``)."""
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
                                   weights_only, layout)
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
        template = get_optimizer_state_dict(module, optimizer)
        optimizer_state = {key: _only_saved(template, key, saved)}
        dcp.load(optimizer_state, checkpoint_id=path)
        for group, live in zip(optimizer_state[key]["param_groups"], template["param_groups"]):
            group["params"] = live["params"]  # this rank's (a pipeline stage holds its own), not the saved list
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key],
                                 options=StateDictOptions(cpu_offload=True))
    return torch.load(path / META_FILENAME, weights_only=weights_only)


def load_local_model_state(module: nn.Module, state_dict: dict[str, Any], strict: bool) -> None:
    """Load this rank's pipeline stages' share of the whole model's full ``state_dict`` (every rank holds it) into
    ``module``, each rank sharding from its own copy (:func:`_what_it_holds`; tensors of other stages are expected
    in the file)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    local = _what_it_holds(module, state_dict, strict, whole_model=False)
    set_model_state_dict(module, local, options=StateDictOptions(full_state_dict=True, strict=False))


def _what_it_holds(module: nn.Module, saved: dict[str, Any], strict: bool, whole_model: bool = True) -> dict[str, Any]:
    """The tensors of a full file's model state ``saved`` that ``module``'s own ``state_dict()`` names (its local,
    sharded view: names only, nothing gathered): a LightningModule may leave some out of its checkpoints (a LoRA
    run's frozen base, which comes from elsewhere). With ``strict`` the file must hold each of them and, for the
    ``whole_model`` (not one pipeline stage, whose file holds the other stages' too), nothing else; KeyError
    otherwise."""
    expected = set(module.state_dict())
    missing = sorted(expected - set(saved))
    unexpected = sorted(set(saved) - expected) if whole_model else []
    if strict and (missing or unexpected):
        scope = "the model" if whole_model else "this pipeline stage"
        raise KeyError(f"the checkpoint's model state lacks {missing[:5]} ({len(missing)} of {scope}'s tensors) and"
                       f" holds {unexpected[:5]} ({len(unexpected)}) the model does not, so it was written for another"
                       " model; load the checkpoint of this model, or set strict loading off to load what matches")
    return {name: value for name, value in saved.items() if name in expected}


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
        {k: v for k, v in group.items() if k != "params" and f"{key}.param_groups.{i}.{k}" in saved}
        for i, group in enumerate(template.get("param_groups", []))
    ]
    return {**template, "state": {name: values for name, values in state.items() if values}, "param_groups": groups}


def _load_full(path: Path, module_key: str, module: nn.Module, optimizers: dict[str, Optimizer], strict: bool,
               from_list: bool, weights_only: Optional[bool], layout: StateLayout) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    if not layout.split:
        load_raw_module_state(_what_it_holds(module, checkpoint.pop(module_key), strict), module, strict=False)
    else:
        load_local_model_state(module, checkpoint.pop(module_key), strict=strict)
    if from_list:  # a Trainer checkpoint: the optimizers' states in a list, in the optimizers' order
        checkpoint.update(zip(optimizers, checkpoint.pop("optimizer_states", [])))
    for key, optimizer in _with_saved_state(optimizers, checkpoint, path, required=strict or from_list).items():
        # In the layout of the live state, which the saved tensors are sharded onto (AdamW8bit: fp32 moments ->
        # codes and scales).
        saved = checkpoint.pop(key)
        saved = keyed_by_name(saved, module, optimizer) if not layout.split else local_optimizer_state(
            saved, module, optimizer, layout)
        saved = from_full_state(optimizer, saved)
        # torch's full-state path shards the saved tensors onto the live ones and fails when there are none (an
        # optimizer without state, e.g. SGD without momentum): then only the param groups need restoring. Under
        # pipeline parallelism every rank shards from its own copy: rank 0's broadcast holds the first stage only.
        full = any(isinstance(t, torch.Tensor) for values in saved.get("state", {}).values() for t in values.values())
        options = StateDictOptions(full_state_dict=full, broadcast_from_rank0=full and not layout.split, strict=strict)
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
