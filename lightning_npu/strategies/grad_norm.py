"""Gradient clipping by the total norm when the parameters are DTensors on several device meshes.

Under expert parallelism the experts' gradients live on the experts' mesh (``dp_shard_mod_ep`` x ``ep``) and the
other parameters' on npu_fsdp's mesh; under tensor parallelism the split weights' on ``dp_shard_cp`` x ``tp`` and
the norms' on ``dp_shard_cp``. ``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor norms into one DTensor,
which fails for norms on different meshes ("All operands in aten.stack.default must have the same mesh"), so this
takes the norm of each mesh's gradients, combines those whole (``full_tensor``), and scales each group by the
same coefficient. Gradients on one mesh (or none) take torch's function unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

import torch
from torch import Tensor


def clip_grad_norm_(parameters: Union[Tensor, Iterable[Tensor]], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Any = None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters whose gradients may lie on several device meshes;
    returns the total norm (a plain tensor when there are several meshes)."""
    from torch.distributed.tensor import DTensor, Replicate

    parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    groups: dict[Any, list[Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(mesh, []).append(param)
    if len(groups) <= 1:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type, error_if_nonfinite, foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    first_device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([norm.to(first_device) for norm in norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped")
    for mesh, group in groups.items():
        # clip_grads_with_norm_ multiplies the gradients by a coefficient made from ``total``: a DTensor for them.
        norm = total if mesh is None else DTensor.from_local(total.to(mesh.device_type), mesh,
                                                             [Replicate()] * mesh.ndim, run_check=False)
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach)
    return total


def use_for_trainer_clipping(plugin: Any) -> None:
    """Make a Trainer precision plugin clip by norm with :func:`clip_grad_norm_` (Lightning's ``clip_grad_by_norm``
    calls torch's function on the optimizer's parameters); a plugin class with its own ``clip_grad_by_norm`` keeps
    it."""
    from lightning.pytorch.plugins.precision import Precision

    if type(plugin).clip_grad_by_norm is not Precision.clip_grad_by_norm:
        return

    def clip_grad_by_norm(optimizer: Any, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(plugin.main_params(optimizer), clip_val)

    plugin.clip_grad_by_norm = clip_grad_by_norm


__all__ = ["clip_grad_norm_", "use_for_trainer_clipping"]
