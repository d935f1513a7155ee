"""npu_fsdp's one device mesh: ``ParallelMesh``, built from a ``MeshLayout``, with a named view for each consumer.

Its dimensions are always ``MESH_DIM_NAMES``, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``
(``layout`` gives their sizes and each rank's coordinates). The views:

=================== ================================================ ==============================================
view                ranks                                            used by
=================== ================================================ ==============================================
``fsdp``            ``dp_shard x cp`` (2-D with ``dp_replicate``     ``fully_shard`` (hybrid: replicated over
                    under hybrid sharding)                           ``dp_replicate``)
``data_parallel``   ``dp_replicate x dp_shard x cp``: the ranks of   the logged loss and gradient-norm reductions;
                    a stage whose tokens differ                      Lightning's ``data_parallel``
``tp`` / ``cp`` /   one dimension each (None at size 1)              tensor, context and pipeline parallelism
``pp``
``experts``         ``dp_shard x cp x tp`` split ``(efsdp, ep)``,    expert parallelism (``ep``) and the experts'
                    ``ep`` innermost                                 FSDP (``efsdp``)
``lightning``       ``("data_parallel", "tensor_parallel")``         ``device_mesh`` of the strategy and of the
                                                                     LightningModule: a module written for
                                                                     Lightning's ``ModelParallelStrategy`` runs
                                                                     unchanged, at every size
=================== ================================================ ==============================================

The sampler's split needs no group: ``layout.data_parallel_size`` replicas, ``layout.data_parallel_rank(rank)``.

Process groups. On an NPU every HCCL communicator reserves ``2 x HCCL_BUFFSIZE`` of device memory, so no group exists
that nothing uses: the torch mesh behind the views (``root``) has only the dimensions of size > 1 (and ``dp_shard``,
which FSDP always shards over); a view of one of them is a slice (no new group), a view joining several is flattened
once (its own groups), and a view spanning every rank is the default group. Plain sharding thus creates no group
at all, as before. The ``lightning`` view reuses the ``data_parallel`` and ``tp`` groups; its ``tensor_parallel``
dimension at size 1 gets a one-rank group only when a module uses it. Views are made on first use: every first use
is at a point every rank passes (the strategy's setup, ``parallelize``), since making a group is a collective.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_npu import compat
from lightning_npu.facts.options import MESH_DIM_NAMES, MeshLayout

#: The names of a tensor-parallel mesh dimension: npu_fsdp's, and Lightning ModelParallelStrategy's.
TENSOR_PARALLEL_DIMS = frozenset({"tp", "tensor_parallel"})
#: The experts' mesh dimensions, outermost first (``ParallelMesh.experts``).
EXPERT_DIMS = ("efsdp", "ep")
#: Lightning ModelParallelStrategy's mesh dimensions (``ParallelMesh.lightning``).
LIGHTNING_DIMS = ("data_parallel", "tensor_parallel")


class ParallelMesh:
    """One run's mesh (``MESH_DIM_NAMES``, sizes from ``layout``) on ``device_type`` and its views (module docstring).

    ``sharding``: ``"hybrid"`` replicates FSDP's shards over ``dp_replicate``; ``expert_parallel_size``: how many
    ranks of ``dp_shard x cp x tp`` split each MoE layer's experts. Making one creates ``root`` (a collective: every
    rank makes it, with the same arguments).
    """

    def __init__(self, device_type: str, layout: MeshLayout, *, sharding: str = "full",
                 expert_parallel_size: int = 1) -> None:
        self.device_type = device_type
        self.layout = layout
        self.sharding = sharding
        self.expert_parallel_size = expert_parallel_size
        dims = tuple(name for name, size in layout.sizes.items() if size > 1 or name == "dp_shard")
        self.root: DeviceMesh = init_device_mesh(device_type, tuple(layout.sizes[name] for name in dims),
                                                 mesh_dim_names=dims)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}={size}" for name, size in self.layout.sizes.items())
        return f"ParallelMesh({sizes}, sharding={self.sharding!r}, expert_parallel_size={self.expert_parallel_size})"

    # ---- one dimension each

    @property
    def tp(self) -> Optional[DeviceMesh]:
        """The tensor-parallel ranks of this one (consecutive ranks); None without tensor parallelism."""
        return self._dimension("tp")

    @property
    def cp(self) -> Optional[DeviceMesh]:
        """The context-parallel ranks of this one; None without context parallelism."""
        return self._dimension("cp")

    @property
    def pp(self) -> Optional[DeviceMesh]:
        """The pipeline stages' ranks in line with this one; None without pipeline parallelism."""
        return self._dimension("pp")

    # ---- views over several dimensions

    @cached_property
    def fsdp(self) -> DeviceMesh:
        """What ``fully_shard`` shards over: ``dp_shard x cp``; under hybrid sharding 2-D, ``(dp_replicate, that)``."""
        shard = self._joined(("dp_shard", "cp"))
        if self.sharding != "hybrid" or self.layout.dp_replicate == 1:
            return shard
        if self.layout.cp == 1:
            return self.root["dp_replicate", "dp_shard"]
        return compat.join_meshes([self.root["dp_replicate"], shard])

    @cached_property
    def data_parallel(self) -> DeviceMesh:
        """The ranks of this stage whose tokens differ (``dp_replicate x dp_shard x cp``): a logged loss is their
        mean, and gradients are averaged over them."""
        return self._joined(("dp_replicate", "dp_shard", "cp"))

    @cached_property
    def experts(self) -> DeviceMesh:
        """The experts' mesh ``(efsdp, ep)`` over ``dp_shard x cp x tp``: ``ep`` consecutive ranks (tensor-parallel
        ones first) split each MoE layer's experts; FSDP shards them over ``efsdp``, the ranks holding the same."""
        ep = self.expert_parallel_size
        shape = (self.layout.expert_parallel_ranks // ep, ep)
        if self.layout.expert_parallel_ranks == self.layout.world_size:
            # Every rank: a mesh of its own (no view of the root needed, so any torch release has it).
            return init_device_mesh(self.device_type, shape, mesh_dim_names=EXPERT_DIMS)
        compat.check_mesh_unflatten("expert_parallel_size with several pipeline stages or replicas")
        return compat.unflatten_mesh(self._joined(("dp_shard", "cp", "tp")), shape, EXPERT_DIMS)

    @cached_property
    def expert_fsdp(self) -> DeviceMesh:
        """What ``fully_shard`` shards the experts over: ``efsdp`` (every rank of ``dp_shard x cp x tp`` when
        ``expert_parallel_size`` is 1; under hybrid sharding 2-D, replicated over ``dp_replicate``)."""
        if self.expert_parallel_size > 1:  # sharding "full" (check_expert_parallel_size)
            return self.experts["efsdp"]
        shard = self._joined(("dp_shard", "cp", "tp"))
        if self.sharding != "hybrid" or self.layout.dp_replicate == 1:
            return shard
        return compat.join_meshes([self.root["dp_replicate"], shard])

    @cached_property
    def lightning(self) -> DeviceMesh:
        """Lightning ModelParallelStrategy's 2-D mesh ``("data_parallel", "tensor_parallel")`` over this stage's
        ranks, on the ``data_parallel`` and ``tp`` views' groups (a size-1 ``tensor_parallel``: a one-rank group,
        made when first used)."""
        layout = self.layout
        stage = dist.get_rank() // layout.stage_size
        ranks = torch.arange(stage * layout.stage_size, (stage + 1) * layout.stage_size)
        data_parallel_group = self.data_parallel.get_group().group_name

        def group_names() -> list[str]:
            tp = self.tp
            if tp is not None:
                return [data_parallel_group, tp.get_group().group_name]
            own = dist.new_group([dist.get_rank()], use_local_synchronization=True)
            return [data_parallel_group, own.group_name]

        return compat.mesh_with_groups(self.device_type, ranks.view(-1, layout.tp), LIGHTNING_DIMS, group_names)

    # ---- groups the strategy reduces over

    @property
    def loss_group(self) -> Optional[Any]:
        """The group a logged value is averaged over (``data_parallel``); None when that is every rank."""
        return None if self.layout.loss_ranks == self.layout.world_size else self.data_parallel.get_group()

    def _dimension(self, name: str) -> Optional[DeviceMesh]:
        return self.root[name] if name in (self.root.mesh_dim_names or ()) and self.layout.sizes[name] > 1 else None

    def _joined(self, names: tuple[str, ...]) -> DeviceMesh:
        """One dimension of the ranks the dimensions ``names`` span: a slice of the root when only one of them has
        size > 1, else their flattening, made once (views over the same dimensions share its groups)."""
        present = tuple(name for name in names if name in (self.root.mesh_dim_names or ()))
        if len(present) == 1:
            return self.root[present[0]]
        flattened = self.__dict__.setdefault("_flattened", {})
        if present not in flattened:
            flattened[present] = compat.flatten_mesh(self.root[present], "_".join(present))
        return flattened[present]


__all__ = ["EXPERT_DIMS", "LIGHTNING_DIMS", "MESH_DIM_NAMES", "ParallelMesh", "TENSOR_PARALLEL_DIMS"]
