"""The experts of MoE layers across ranks: expert parallelism, and a share of the rows per tensor-parallel rank.

A model names its experts modules in its ``ParallelPlan`` (``experts``; the contract is in
``lightning_npu.parallel.protocol``): every parameter stacks the experts on dim 0, and ``forward(rows, counts)``
runs rows sorted by expert. :func:`apply_experts` turns each into its parallel form without touching its code:

- under ``expert_parallel_size`` (``ep``) its parameters become DTensors ``Shard(0)`` over the mesh's ``ep`` ranks
  (each rank keeps its consecutive block of experts). The DTensors keep the global shape ``[n_experts, ...]``, so a
  sharded (DCP) checkpoint saved under one layout loads under another, and full checkpoints and Hugging Face
  exports hold every expert. A forward pre-hook exchanges the per-expert counts (one small all-to-all and one host
  sync per layer: the row split sizes must be known on the host), sends each rank the rows of its experts (the
  differentiable ``all_to_all``) and re-sorts them by local expert; the module runs only its own experts
  (:func:`local_experts` gives it their weights); a forward hook sends the outputs back, in their original order.
  A rank that receives no rows still runs its experts on an empty batch and takes part in every collective.
- under ``tensor_parallel_size`` (``tp``) the MoE layer runs on every tensor-parallel rank with the same tokens, as
  a dense MLP's input is gathered (the router and the routing are the same on each), and the experts are not split
  by columns and rows: each tensor-parallel rank runs ``1 / tp`` of the routed rows (a contiguous share of the rows
  sorted by expert; no host sync) and the outputs are all-gathered over the tensor-parallel ranks. The expert-parallel
  ranks are carved out of ``dp_shard x cp x tp`` with ``ep`` innermost, so at ``ep = tp`` the expert-parallel group
  is the tensor-parallel one (torchtitan's choice for EP with TP: the other, experts split like dense MLPs, is
  refused by ``parallel.tensor``).

The experts are then FSDP units of their own (:func:`shard_experts`) over ``efsdp``, the ranks of
``dp_shard x cp x tp`` holding the same experts. Their gradients sum every contribution of those ranks (and, through
the all-to-all, of the expert-parallel ones), which is the sum over tensor-parallel shares of rows and, divided by
``dp_shard x cp`` (the ranks of different tokens), the average the other parameters get.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_npu.parallel.all_to_all import all_to_all
from lightning_npu.parallel.tensor import local_tensor


def local_experts(param: Tensor) -> Tensor:
    """The experts of this rank in a stacked parameter: its local block under expert parallelism, itself otherwise.
    An experts module computes with this of each parameter."""
    return local_tensor(param)


def check_experts(modules: Sequence[tuple[str, nn.Module]], ep: int) -> None:
    """ValueError (the same on every rank, before any collective) if ``ep > 1`` and there are no experts modules,
    or a module's parameters do not stack one expert count on dim 0, or ``ep`` does not divide it."""
    if ep > 1 and not modules:
        raise ValueError(
            f"expert_parallel_size={ep}, but the model's ParallelPlan names no experts modules (ParallelPlan.experts):"
            " each group of ranks would hold and compute the same dense model. Name the modules holding each MoE"
            " layer's stacked experts, or use expert_parallel_size=1 for a model without MoE layers"
        )
    for name, module in modules:
        counts = {p.shape[0] for p in module.parameters()}
        if len(counts) != 1:
            raise ValueError(f"{name}: an experts module's parameters must all stack their experts on dim 0; their"
                             f" first dimensions are {sorted(counts)}")
        (n_experts,) = counts
        if n_experts % ep:
            raise ValueError(
                f"expert_parallel_size={ep} does not divide the {n_experts} experts of {name}: each rank of an"
                f" expert-parallel group holds n_experts / expert_parallel_size of them; use a divisor of {n_experts}"
            )


def apply_experts(modules: Sequence[tuple[str, nn.Module]], ep_mesh: Optional[Any], tp_group: Optional[Any]) -> None:
    """Split each experts module of ``modules`` over the 1-D ``ep_mesh`` (None: ``ep`` 1) and share its rows over
    ``tp_group`` (None: ``tp`` 1); see the module docstring. Works on meta parameters too (rank 0's values arrive
    after sharding)."""
    if ep_mesh is not None:
        _split_experts(modules, ep_mesh)
    for _, module in modules:
        hooks = _Hooks(None if ep_mesh is None else ep_mesh.get_group(), tp_group)
        module.register_forward_pre_hook(hooks.before)
        module.register_forward_hook(hooks.after)


def shard_experts(modules: Sequence[tuple[str, nn.Module]], mesh: Any, token_ranks: int, **fsdp_kwargs: Any) -> None:
    """``fully_shard`` each experts module over ``mesh`` (``efsdp``), its gradients divided by ``token_ranks`` (the
    ranks of different tokens) rather than by the mesh size."""
    from torch.distributed.fsdp import fully_shard

    from lightning_npu import compat

    for _, module in modules:
        fully_shard(module, mesh=mesh, **fsdp_kwargs)
        compat.set_gradient_divide_factor(module, float(token_ranks), mesh.size())


def _split_experts(modules: Sequence[tuple[str, nn.Module]], ep_mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Shard

    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for _, module in modules:
        for name, param in list(module.named_parameters()):
            per_rank = param.shape[0] // ep
            block = param.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
            sharded = DTensor.from_local(block, ep_mesh, [Shard(0)], run_check=False)
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, nn.Parameter(sharded, requires_grad=param.requires_grad))


class _Hooks:
    """The forward pre-hook and hook of one experts module: this tensor-parallel rank's share of the rows, out to
    their experts' ranks; outputs back, then every share's gathered.

    ``before`` leaves the sizes of the forward in flight for ``after`` (a recomputed forward under activation
    checkpointing runs the pair again, in the same order)."""

    def __init__(self, ep_group: Optional[Any], tp_group: Optional[Any]) -> None:
        self.ep_group = ep_group
        self.tp_group = tp_group
        self._in_flight: Optional[tuple[Any, Any]] = None

    def before(self, module: nn.Module, args: tuple) -> tuple:
        rows, counts = args
        counts = counts.to(torch.int64)
        shares = None
        if self.tp_group is not None:
            shares = _shares(rows.shape[0], dist.get_world_size(self.tp_group))
            rows, counts = _own_share(rows, counts, shares, self.tp_group)
        dispatch = None
        if self.ep_group is not None:
            dispatch = _dispatch_sizes(counts, self.ep_group)
            rows, counts = _dispatch(rows, dispatch, self.ep_group)
        self._in_flight = (shares, dispatch)
        return rows, counts

    def after(self, module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        assert self._in_flight is not None, "an experts module's forward hook ran without its pre-hook"
        shares, dispatch = self._in_flight
        self._in_flight = None
        if dispatch is not None:
            out = _combine(out, dispatch, self.ep_group)
        if shares is not None:
            out = _GatherShares.apply(out, shares, self.tp_group)
        return out


# ---------------------------------------------------------------- tensor parallelism: a share of the rows each


def _shares(rows: int, tp: int) -> list[int]:
    """How many of ``rows`` each of ``tp`` ranks runs: contiguous, as equal as can be."""
    return [(t + 1) * rows // tp - t * rows // tp for t in range(tp)]


def _own_share(rows: Tensor, counts: Tensor, shares: list[int], group: Any) -> tuple[Tensor, Tensor]:
    """This rank's contiguous share of ``rows`` (sorted by expert) and how many of them each expert has."""
    me = dist.get_rank(group)
    start = sum(shares[:me])
    end = start + shares[me]
    ends = torch.cumsum(counts, 0)
    own = (ends.clamp(max=end) - (ends - counts).clamp(min=start)).clamp(min=0)
    return _SplitShares.apply(rows, shares, group), own


def _gather(x: Tensor, shares: list[int], group: Any) -> Tensor:
    """Every rank's share of the rows (``shares[r]`` of them from rank ``r``), in rank order."""
    longest = max(shares)
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    gathered = [torch.empty_like(padded) for _ in shares]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    return torch.cat([part[:size] for part, size in zip(gathered, shares)])


def _own(x: Tensor, shares: list[int], group: Any) -> Tensor:
    me = dist.get_rank(group)
    start = sum(shares[:me])
    return x[start:start + shares[me]]


class _SplitShares(torch.autograd.Function):
    """Forward: this rank's share of rows every rank holds alike. Backward: every rank's share of the gradient,
    gathered, so the rows' gradient is whole (and alike) on every rank, as they were."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, shares: list[int], group: Any) -> Tensor:
        ctx.shares, ctx.group = shares, group
        return _own(x, shares, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather(grad.contiguous(), ctx.shares, ctx.group), None, None


class _GatherShares(torch.autograd.Function):
    """Forward: every rank's share of the output rows, gathered. Backward: this rank's share of the gradient (the
    gathered rows' gradient is alike on every rank, as the gathered rows are)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, shares: list[int], group: Any) -> Tensor:
        ctx.shares, ctx.group = shares, group
        return _gather(x, shares, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _own(grad, ctx.shares, ctx.group).contiguous(), None, None


# ---------------------------------------------------------------- expert parallelism: rows to their experts' ranks


def _dispatch_sizes(counts: Tensor, group: Any) -> tuple[list[int], list[int], list[list[int]]]:
    """What this rank sends each rank of ``group``, what each sends it, and per source what for each local expert
    (one all-to-all of the counts and one host sync)."""
    ep = dist.get_world_size(group)
    per_rank = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # El counts to each rank, El from each
    if counts.device.type != "cpu":
        # Reading an HCCL result on the host needs the device synchronised first (moe-facts.md, EP pitfalls).
        from lightning_npu.runtime import get_runtime

        get_runtime().synchronize(counts.device)
    host = torch.cat([counts.view(ep, per_rank).sum(1), received]).tolist()
    send = host[:ep]
    by_source = [host[ep + s * per_rank:ep + (s + 1) * per_rank] for s in range(ep)]
    return send, [sum(row) for row in by_source], by_source


def _dispatch(rows: Tensor, sizes: tuple[list[int], list[int], list[list[int]]], group: Any) -> tuple[Tensor, Tensor]:
    """The rows of this rank's experts from every rank, sorted by local expert, and their counts."""
    send, receive, by_source = sizes
    ep, per_rank = len(by_source), len(by_source[0])
    arrived = all_to_all(rows, group, send, receive)
    # Arrived: source-major (source s: its rows for local expert 0, 1, ...); the experts need expert-major.
    chunks = arrived.split([c for row in by_source for c in row])
    local = torch.cat([chunks[s * per_rank + e] for e in range(per_rank) for s in range(ep)])
    counts = torch.tensor([sum(row[e] for row in by_source) for e in range(per_rank)], dtype=torch.int64,
                          device=rows.device)
    return local, counts


def _combine(out: Tensor, sizes: tuple[list[int], list[int], list[list[int]]], group: Any) -> Tensor:
    """The experts' output rows back to the ranks they came from, in their original order."""
    send, receive, by_source = sizes
    ep, per_rank = len(by_source), len(by_source[0])
    pieces = out.split([by_source[s][e] for e in range(per_rank) for s in range(ep)])
    source_major = torch.cat([pieces[e * ep + s] for s in range(ep) for e in range(per_rank)])
    return all_to_all(source_major, group, receive, send)


__all__ = ["apply_experts", "check_experts", "local_experts", "shard_experts"]
