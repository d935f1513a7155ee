"""npu_fsdp's one device mesh, and the views of it each mechanism uses.

Plain sharding (tensor and context parallel sizes 1) keeps its mesh: ``("shard",)``, or ``("replicate", "shard")``
for hybrid sharding. With tensor or context parallelism the mesh is ``MESH_DIM_NAMES``
``(dp_replicate, dp_shard, cp, tp)``, tp innermost, with flattened views named for their users:

- ``"dp_shard_cp"``: FSDP shards parameters over these ranks (with ``"dp_replicate"`` for hybrid sharding);
- ``"dp"``: the data-parallel replicas the sampler splits batches over (a TP or CP group shares its batch);
- ``"data_parallel"`` / ``"tensor_parallel"``: Lightning ``ModelParallelStrategy``'s names, so a LightningModule
  written for it (``configure_model`` calls ``parallelize_module`` and ``fully_shard`` on ``self.device_mesh``)
  runs unchanged; ``"data_parallel"`` is every rank outside a TP group (``dp x cp``), over which the reduced
  (logged) loss is averaged.

Under expert parallelism the experts have a mesh of their own dimensions (``EXPERT_DIMS``, ``build_expert_mesh``):
with tensor or context parallelism it is a view of this one (``"dp_shard_cp"`` split into ``dp_shard_mod_ep x ep``).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_npu import compat
from lightning_npu.facts.options import MESH_DIM_NAMES, MeshLayout

#: The names a tensor-parallel mesh dimension has: npu_fsdp's, and Lightning ModelParallelStrategy's.
TENSOR_PARALLEL_DIMS = frozenset({"tp", "tensor_parallel"})
#: The experts' mesh dimensions under expert parallelism (``build_expert_mesh``), outermost first.
EXPERT_DIMS = ("dp_shard_mod_ep", "ep")
#: The flattened views of a model-parallel mesh: name -> the dimensions it joins.
FLATTENED = {
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp": ("dp_replicate", "dp_shard"),
    "data_parallel": ("dp_replicate", "dp_shard", "cp"),
    "tensor_parallel": ("tp",),
}


def build_mesh(device_type: str, layout: MeshLayout, sharding: str) -> DeviceMesh:
    """The run's mesh (see the module docstring); ``layout`` comes from the options (``FSDPChoices.layout``)."""
    if layout.model_parallel:
        mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIM_NAMES)
        for name, dims in FLATTENED.items():
            compat.flatten_mesh(mesh[dims], name)
        return mesh
    if sharding == "hybrid":
        # Sharded within a node, replicated across nodes: parameter all-gathers stay on the fast intra-node links.
        shape = (layout.dp_replicate, layout.dp_shard)
        return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (layout.dp_shard,), mesh_dim_names=("shard",))


def build_expert_mesh(mesh: DeviceMesh, layout: MeshLayout, expert_parallel_size: int) -> DeviceMesh:
    """The mesh of the expert parameters (``lightning_npu.strategies.expert_parallel``): ``"ep"`` innermost
    (consecutive ranks split each layer's experts and exchange its tokens), ``"dp_shard_mod_ep"`` the ranks holding
    the same experts, over which FSDP shards them (torchtitan's "efsdp").

    Expert parallelism borrows its ranks from those FSDP shards over (``dp_shard x cp``, whose tokens differ): on a
    model-parallel mesh the experts' mesh is the ``"dp_shard_cp"`` view unflattened, so it is a view of ``mesh``
    (ep takes the cp ranks first, then dp_shard's); under plain sharding (``("shard",)``) it is its own
    ``(dp_shard_mod_ep, ep)`` mesh over all ranks."""
    borrowed = layout.expert_parallel_ranks
    shape = (borrowed // expert_parallel_size, expert_parallel_size)
    if layout.model_parallel:
        return compat.unflatten_mesh(mesh["dp_shard_cp"], shape, EXPERT_DIMS)
    return init_device_mesh(mesh.device_type, shape, mesh_dim_names=EXPERT_DIMS)


def is_model_parallel(mesh: DeviceMesh) -> bool:
    return mesh.mesh_dim_names == MESH_DIM_NAMES


def fsdp_mesh(mesh: DeviceMesh, sharding: str) -> DeviceMesh:
    """The mesh ``fully_shard`` shards over: ``dp_shard x cp`` (replicated over ``dp_replicate`` when hybrid)."""
    if not is_model_parallel(mesh):
        return mesh
    return mesh["dp_replicate", "dp_shard_cp"] if sharding == "hybrid" else mesh["dp_shard_cp"]


__all__ = ["EXPERT_DIMS", "FLATTENED", "TENSOR_PARALLEL_DIMS", "build_expert_mesh", "build_mesh", "fsdp_mesh", "is_model_parallel"]
