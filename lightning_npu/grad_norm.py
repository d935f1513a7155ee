"""Gradient-norm clipping over parameters that live on different device meshes.

Under tensor parallelism some parameters are split over a 2-D mesh (FSDP x TP) while others (modules the plan left
alone, parameters FSDP cannot shard) live on the 1-D FSDP mesh or on no mesh at all. torch's ``clip_grad_norm_``
stacks the per-tensor norms, which DTensor refuses across meshes. Here each mesh's gradients are reduced to one
global norm first (a DTensor norm is a partial value until ``full_tensor()`` adds its shards' parts), and the total
is the norm of those norms: the same value ``clip_grad_norm_`` gives where all parameters share one mesh.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Union

import torch
from torch import Tensor


def clip_grad_norm(parameters: Union[Tensor, Iterable[Tensor]], max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on any mix of meshes; returns the total norm (a plain
    tensor)."""
    from torch.distributed.tensor import DTensor

    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    by_mesh: dict[object, list[Tensor]] = {}
    for param in params:
        if param.grad is not None:
            by_mesh.setdefault(param.grad.device_mesh if isinstance(param.grad, DTensor) else None, []).append(param)
    if len(by_mesh) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type, error_if_nonfinite)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    total = torch.nn.utils.get_total_norm([norm.to(device) for norm in norms], norm_type, error_if_nonfinite)
    for group in by_mesh.values():  # one call per mesh: DTensor ops take the tensors of one mesh
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


__all__ = ["clip_grad_norm"]
