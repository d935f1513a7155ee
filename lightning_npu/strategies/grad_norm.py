"""Gradient clipping by the total norm when the parameters are DTensors on several device meshes.

Under expert parallelism the experts' gradients live on the experts' mesh (``dp_shard_mod_ep`` x ``ep``) and the
other parameters' on npu_fsdp's mesh; under tensor parallelism the split weights' on ``dp_shard_cp`` x ``tp`` and
the norms' on ``dp_shard_cp``. ``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor norms into one DTensor,
which fails for norms on different meshes ("All operands in aten.stack.default must have the same mesh"), so this
takes the norm of each mesh's gradients, combines those whole (``full_tensor``), and scales each group by the
same coefficient. Gradients on one mesh (or none) take torch's function unchanged.

Under pipeline parallelism each rank holds its stages' gradients only: the norm of each rank's is combined over the
pipeline's ranks (``stages_group``: the sum of ``norm ** p``, the largest for the infinity norm), so every stage is
clipped by the whole model's norm, as without the pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

import torch
from torch import Tensor

from lightning_npu.parallel.tensor import local_tensor


def clip_grad_norm_(parameters: Union[Tensor, Iterable[Tensor]], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Any = None, stages_group: Any = None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters whose gradients may lie on several device meshes, or on the
    ranks of ``stages_group`` (a pipeline's, each holding other parameters); returns the total norm (a plain tensor
    when there are several meshes or stages)."""
    from torch.distributed.tensor import DTensor, Replicate

    parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    groups: dict[Any, list[Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(mesh, []).append(param)
    if len(groups) <= 1 and stages_group is None:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type, error_if_nonfinite, foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = local_tensor(parameters[0]).device if parameters else torch.device("cpu")
    total = _combined(norms, float(norm_type), stages_group, device)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped")
    for mesh, group in groups.items():
        # clip_grads_with_norm_ multiplies the gradients by a coefficient made from ``total``: a DTensor for them.
        norm = total if mesh is None else DTensor.from_local(total.to(mesh.device_type), mesh,
                                                             [Replicate()] * mesh.ndim, run_check=False)
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach)
    return total


def _combined(norms: list[Tensor], norm_type: float, stages_group: Any, device: torch.device) -> Tensor:
    """The norm of order ``norm_type`` of the gradients whose norms are ``norms``, over every rank of
    ``stages_group`` too (a collective there, on ``device``, where the parameters live; a rank without gradients
    contributes 0)."""
    import torch.distributed as dist

    local = torch.linalg.vector_norm(torch.stack([norm.to(device) for norm in norms]), norm_type) if norms else (
        torch.zeros((), device=device))
    if stages_group is None:
        return local
    local = local.to(torch.float32)
    if norm_type == float("inf"):
        dist.all_reduce(local, dist.ReduceOp.MAX, group=stages_group)
        return local
    local = local.pow(norm_type)
    dist.all_reduce(local, group=stages_group)
    return local.pow(1.0 / norm_type)


def use_for_trainer_clipping(plugin: Any, stages_group: Any = None) -> None:
    """Make a Trainer precision plugin clip by norm with :func:`clip_grad_norm_` (Lightning's ``clip_grad_by_norm``
    calls torch's function on the optimizer's parameters), over ``stages_group`` too under pipeline parallelism; a
    plugin class with its own ``clip_grad_by_norm`` keeps it."""
    from lightning.pytorch.plugins.precision import Precision

    if type(plugin).clip_grad_by_norm is not Precision.clip_grad_by_norm:
        return

    def clip_grad_by_norm(optimizer: Any, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(plugin.main_params(optimizer), clip_val, stages_group=stages_group)

    plugin.clip_grad_by_norm = clip_grad_by_norm


__all__ = ["clip_grad_norm_", "use_for_trainer_clipping"]
