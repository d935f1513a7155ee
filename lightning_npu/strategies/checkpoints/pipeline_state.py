"""Full (one-file) checkpoints under pipeline parallelism.

Each rank holds its stages' parameters only (``parallel.pipeline.split``), under the names they have in the whole
model. torch's full state dict gathers each tensor onto global rank 0, which holds the first stage alone, and its
loading broadcasts every tensor from rank 0 in each rank's own parameter order, which differs between stages: the
stages would exchange each other's tensors (same shapes: wrong weights, silently; other shapes: an error or a hang).
So under pipeline parallelism:

- saving: every rank of a stage makes each of its tensors whole (the stage's FSDP / tensor-parallel collectives); the
  ranks of the pipeline that holds global rank 0 send them there one at a time, each as soon as it is whole (global
  rank 0 holds the whole model once on the host, the others one tensor at a time), and global rank 0 writes one file
  of the whole model, in its parameter order, its optimizer state numbered as without the pipeline;
- loading: every rank reads the file (memory-mapped) and takes its stages' tensors, each sharded from the rank's own
  copy (no broadcast); an optimizer state numbered by index is named by the whole model's param groups first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_npu.parallel.handle import StateLayout
from lightning_npu.strategies.checkpoints.optimizer_state import keyed_by_name, whole_param_groups


def full_model_state(module: nn.Module, layout: StateLayout) -> dict[str, Any]:
    """The whole model's full state dict on global rank 0 (``{}`` on the others); a collective on every rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    parts = _onto_rank0(get_model_state_dict(module), layout)
    if parts is None:
        return {}
    position = {name: index for index, name in enumerate(layout.order)}
    merged = {name: value for part in parts for name, value in part.items()}
    # The whole model's parameter order (what the file holds without the pipeline); buffers after the parameters.
    return dict(sorted(merged.items(), key=lambda item: position.get(item[0], len(position))))


def full_optimizer_state(module: nn.Module, optimizer: Optimizer, layout: StateLayout) -> dict[str, Any]:
    """``optimizer``'s whole state keyed by name, its param groups listing every stage's parameters, on global rank
    0 (``{}`` on the others); a collective on every rank."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    # An optimizer without state (SGD without momentum) saves its param groups only (see save.optimizer_state_dict).
    state = get_optimizer_state_dict(module, optimizer) if optimizer.state else keyed_by_name(
        optimizer.state_dict(), module, optimizer)
    state = whole_param_groups(state, layout.order, layout.group, numbered=True)
    parts = _onto_rank0(state["state"], layout)
    if parts is None:
        return {}
    return {"state": {name: value for part in parts for name, value in part.items()},
            "param_groups": state["param_groups"]}


def local_optimizer_state(saved: dict[str, Any], module: nn.Module, optimizer: Optimizer,
                          layout: StateLayout) -> dict[str, Any]:
    """A full checkpoint's optimizer state (numbered over the whole model, or keyed by name) cut to this rank's
    parameters, keyed by name, its param groups this rank's; a collective over the pipeline."""
    local = keyed_by_name(optimizer.state_dict(), module, optimizer)
    groups = saved.get("param_groups", [])
    if len(groups) != len(local["param_groups"]):
        raise ValueError(f"the checkpoint's optimizer state has {len(groups)} param groups, the optimizer"
                         f" {len(local['param_groups'])}, so it was written for another optimizer; build the"
                         " optimizer with the groups it was saved with (configure_optimizers)")
    whole = whole_param_groups(local, layout.order, layout.group, numbered=True)["param_groups"]
    numbered = [p for group in groups for p in group.get("params", [])]
    names = [name for group in whole for name in group["params"]]
    if numbered and isinstance(numbered[0], int):
        if len(numbered) != len(names):
            raise ValueError(f"the checkpoint's optimizer state covers {len(numbered)} parameters, the pipelined"
                             f" model has {len(names)}, so it was written for another model or optimizer; load the"
                             " checkpoint of this model, or only its weights (a new fit from them, without ckpt_path)")
        by_index = dict(zip(numbered, names))
        state = {by_index[index]: value for index, value in saved.get("state", {}).items()}
    else:
        state = dict(saved.get("state", {}))
    mine = {name for group in local["param_groups"] for name in group["params"]}
    return {"state": {name: value for name, value in state.items() if name in mine},
            "param_groups": [{**group, "params": live["params"]} for group, live in zip(groups, local["param_groups"])]}


def _onto_rank0(state: dict[str, Any], layout: StateLayout) -> Optional[list[dict[str, Any]]]:
    """Each rank's ``state`` with every tensor whole and on the host, from the ranks of the pipeline that holds
    global rank 0, on global rank 0 (a list by pipeline rank); None elsewhere. Every rank of a stage takes part in
    making its tensors whole (collectives over the stage's meshes), in the same order; the other pipeline ranks send
    each to global rank 0 as soon as it is whole, and global rank 0 receives every rank's in pipeline order."""
    ranks = dist.get_process_group_ranks(layout.group)
    if 0 not in ranks:
        _whole(state, lambda tensor: None)
        return None
    # What global rank 0 rebuilds each rank's state from: its structure, each tensor's shape and dtype.
    shapes: Optional[list] = [None] * len(ranks) if dist.get_rank() == 0 else None
    dist.gather_object(_shapes(state), shapes, dst=0, group=layout.group)
    if dist.get_rank() != 0:
        device = layout.device
        _whole(state, lambda tensor: dist.send(tensor.to(device or tensor.device).contiguous(), dst=0,
                                               group=layout.group))
        return None
    return [_whole(state, lambda tensor: tensor.cpu()) if sender == 0 else _received(sent, sender, layout)
            for sender, sent in zip(ranks, shapes)]


@dataclass(frozen=True)
class _Meta:
    """A tensor's (whole) shape and dtype, standing in for it in the shapes a rank sends global rank 0 first."""

    shape: tuple[int, ...]
    dtype: Any


def _each(value: Any, leaf: type, fn: Any) -> Any:
    """``value`` (nested dicts, lists and tuples) with each ``leaf`` replaced by ``fn(leaf)``, in traversal order:
    the order every rank makes tensors whole in, and a sender sends and global rank 0 receives them in."""
    if isinstance(value, leaf):
        return fn(value)
    if isinstance(value, dict):
        return {key: _each(item, leaf, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_each(item, leaf, fn) for item in value)
    return value


def _shapes(value: Any) -> Any:
    """``value`` with each tensor replaced by its whole shape and dtype (no collective: a DTensor knows its shape)."""
    return _each(value, Tensor, lambda tensor: _Meta(tuple(tensor.shape), tensor.dtype))


def _whole(value: Any, take: Any) -> Any:
    """``value`` with each tensor made whole (a DTensor's collective) and replaced by ``take(tensor)``."""
    from torch.distributed.tensor import DTensor

    return _each(value, Tensor, lambda tensor: take(
        (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()))


def _received(shapes: Any, sender: int, layout: StateLayout) -> Any:
    """The state ``sender`` sends tensor by tensor (``_onto_rank0``), rebuilt on the host from its ``shapes``."""
    def receive(meta: _Meta) -> Tensor:
        buffer = torch.empty(meta.shape, dtype=meta.dtype, device=layout.device)
        dist.recv(buffer, src=sender, group=layout.group)
        return buffer.cpu()

    return _each(shapes, _Meta, receive)


__all__ = ["full_model_state", "full_optimizer_state", "local_optimizer_state"]
