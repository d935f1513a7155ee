"""Expert parallelism: each rank of an expert-parallel group holds ``n_experts / ep`` experts of every MoE layer,
and the tokens travel to their experts' ranks and back by all_to_all (HCCL on NPUs, gloo when simulated).

The model code knows only the contract of :class:`StackedExperts`: a module whose every parameter (its
submodules' too: per-expert adapters) stacks its experts on dim 0, and whose ``forward(rows, counts)`` runs rows sorted by expert (``counts[e]`` rows for expert e)
and returns one output row per input row, in the same order. :func:`apply_expert_parallel` turns each such module
into its expert-parallel form without touching its code:

- its parameters become DTensors ``Shard(0)`` over the ``"ep"`` mesh (each rank keeps its consecutive block of
  experts), and FSDP shards them further over ``"dp_shard_mod_ep"``, the ranks that hold the same experts
  (:func:`shard_experts`; torchtitan's "efsdp"). The DTensors keep the global shape ``[n_experts, ...]``, so a
  sharded (DCP) checkpoint saved under one ``expert_parallel_size`` loads under another, and full checkpoints and
  Hugging Face exports hold every expert;
- a forward pre-hook exchanges the per-expert counts (one small all_to_all and one host sync per layer: the row
  split sizes must be known on the host), sends each rank the rows of its experts (a differentiable all_to_all) and re-sorts
  them by local expert; the module then runs only its own experts (:meth:`StackedExperts.local` gives it their
  weights); a forward hook sends the outputs back to the ranks the rows came from, in their original order.

A rank that receives no rows still runs its experts on an empty batch and takes part in every collective, so the
ranks never desync, and its expert weights get zero gradients (every rank reduce-scatters the same tensors).
An expert's gradient on its rank sums the contributions of every rank's tokens; the reduce-scatter over
``dp_shard_mod_ep`` divides it by the whole data-parallel size, so it is the average the other parameters get.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn


class StackedExperts(nn.Module):
    """The experts of one MoE layer, in parameters (its submodules' included) stacked on dim 0 (``[n_experts, ...]``), run by
    ``forward(rows, counts)`` over rows sorted by expert. A subclass calls :meth:`local` on each parameter it
    computes with, and is otherwise free of parallelism: under expert parallelism its forward receives only its
    rank's experts' rows and counts."""

    @staticmethod
    def local(param: Tensor) -> Tensor:
        """The experts of this rank: ``param``'s local block under expert parallelism, ``param`` otherwise."""
        from torch.distributed.tensor import DTensor

        return param.to_local() if isinstance(param, DTensor) else param


def stacked_experts(model: nn.Module) -> list[tuple[str, StackedExperts]]:
    """The :class:`StackedExperts` modules of ``model``, by name."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, StackedExperts)]


def check_experts_divide(model: nn.Module, ep: int) -> list[tuple[str, StackedExperts]]:
    """The experts modules ``apply_expert_parallel`` would split over ``ep`` ranks; ValueError (the same on every
    rank, before any collective) if there are none or a module's expert count is not a multiple of ``ep``."""
    modules = stacked_experts(model)
    if not modules:
        raise ValueError(
            f"expert_parallel_size={ep}, but the model has no experts module to split (a StackedExperts from"
            " lightning_npu.strategies.expert_parallel, as the MoE recipe's Experts is): each group of ranks would"
            " hold and compute the same dense model. Use expert_parallel_size=1 for a model without MoE layers"
        )
    for name, module in modules:
        counts = {p.shape[0] for p in module.parameters()}
        if len(counts) != 1:
            raise ValueError(f"{name}: a StackedExperts module's parameters must all stack their experts on dim 0;"
                             f" their first dimensions are {sorted(counts)}")
        (n_experts,) = counts
        if n_experts % ep:
            raise ValueError(
                f"expert_parallel_size={ep} does not divide the {n_experts} experts of {name}: each rank of an"
                f" expert-parallel group holds n_experts / expert_parallel_size of them; use a divisor of {n_experts}"
            )
    return modules


def apply_expert_parallel(model: nn.Module, ep_mesh: Any) -> list[str]:
    """Split every :class:`StackedExperts` of ``model`` over the ranks of the 1-D ``ep_mesh`` (see the module
    docstring); returns their names. Works on meta parameters too (rank 0's values arrive after sharding)."""
    from torch.distributed.tensor import DTensor, Shard

    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    modules = check_experts_divide(model, ep)
    for _, module in modules:
        for name, param in list(module.named_parameters()):
            per_rank = param.shape[0] // ep
            block = param.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
            sharded = DTensor.from_local(block, ep_mesh, [Shard(0)], run_check=False)
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, nn.Parameter(sharded, requires_grad=param.requires_grad))
        dispatcher = _Dispatcher(ep_mesh.get_group(), ep)
        module.register_forward_pre_hook(dispatcher.dispatch)
        module.register_forward_hook(dispatcher.combine)
    return [name for name, _ in modules]


def shard_experts(model: nn.Module, mesh: Any, data_parallel_size: int, **fsdp_kwargs: Any) -> list[str]:
    """``fully_shard`` each :class:`StackedExperts` of ``model`` (expert-parallel already) over ``mesh``
    (``"dp_shard_mod_ep"``), its gradients averaged over all ``data_parallel_size`` ranks; returns the names."""
    from torch.distributed.fsdp import fully_shard

    from lightning_npu import compat

    modules = stacked_experts(model)
    for _, module in modules:
        fully_shard(module, mesh=mesh, **fsdp_kwargs)
        compat.set_gradient_divide_factor(module, float(data_parallel_size), mesh.size())
    return [name for name, _ in modules]


class _Dispatcher:
    """The forward pre-hook and hook of one experts module: rows out to their experts' ranks, outputs back.

    ``dispatch`` leaves the split sizes of the forward in flight for ``combine`` (a recomputed forward under
    activation checkpointing runs the pair again, in the same order)."""

    def __init__(self, group: Any, ep: int) -> None:
        self.group = group
        self.ep = ep
        self._in_flight: Optional[tuple[list[int], list[int], list[list[int]]]] = None

    def dispatch(self, module: nn.Module, args: tuple) -> tuple:
        rows, counts = args
        import torch.distributed as dist

        n_experts = counts.numel()
        per_rank = n_experts // self.ep
        counts = counts.to(torch.int64)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # El counts to each rank, El from each
        if counts.device.type != "cpu":
            # Reading an HCCL result on the host needs the device synchronised first (moe-facts.md, EP pitfalls).
            from lightning_npu.runtime import get_runtime

            get_runtime().synchronize(counts.device)
        # One host sync for every split size: what this rank sends each rank, and what each sends it per expert.
        host = torch.cat([counts.view(self.ep, per_rank).sum(1), received]).tolist()
        send = host[:self.ep]
        by_source = [host[self.ep + s * per_rank:self.ep + (s + 1) * per_rank] for s in range(self.ep)]
        receive = [sum(row) for row in by_source]
        self._in_flight = (send, receive, by_source)
        arrived = _AllToAll.apply(rows, receive, send, self.group)
        # Arrived: source-major (source s: its rows for local expert 0, 1, ...); the experts need expert-major.
        chunks = arrived.split([c for row in by_source for c in row])
        local = torch.cat([chunks[s * per_rank + e] for e in range(per_rank) for s in range(self.ep)])
        local_counts = torch.tensor([sum(row[e] for row in by_source) for e in range(per_rank)],
                                    dtype=torch.int64, device=counts.device)
        return local, local_counts

    def combine(self, module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        assert self._in_flight is not None, "an experts module's forward hook ran without its pre-hook"
        send, receive, by_source = self._in_flight
        self._in_flight = None
        per_rank = len(by_source[0])
        pieces = out.split([by_source[s][e] for e in range(per_rank) for s in range(self.ep)])
        source_major = torch.cat([pieces[e * self.ep + s] for s in range(self.ep) for e in range(per_rank)])
        return _AllToAll.apply(source_major, send, receive, self.group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows (``send[r]`` rows to rank r, ``receive[r]`` from it); its backward is the
    reverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, receive: list[int], send: list[int], group: Any) -> Tensor:
        ctx.sizes, ctx.group = (receive, send), group
        return _all_to_all(x, receive, send, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        receive, send = ctx.sizes
        return _all_to_all(grad, send, receive, ctx.group), None, None, None


def _all_to_all(x: Tensor, receive: list[int], send: list[int], group: Any) -> Tensor:
    import torch.distributed as dist

    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


__all__ = ["StackedExperts", "apply_expert_parallel", "check_experts_divide", "shard_experts", "stacked_experts"]
