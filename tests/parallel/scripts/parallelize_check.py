"""Sharding layout checks for one rank of a larger world, using torch's fake process group (no peers run).

Prints one JSON object with what npu_fsdp's parallelize functions produced for 8 ranks on 2 nodes.
"""

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_npu.facts.options import FSDPOptions
from lightning_npu.parallel import ParallelPlan
from lightning_npu.parallel.mesh import ParallelMesh
from lightning_npu.parallel.parallelize import parallelize
from tests.strategies.scripts.trainer_run import Block, Net


def layout(net: nn.Module) -> dict:
    block = net.blocks[0]
    group = block._get_fsdp_state()._fsdp_param_group
    return {
        "placements": [str(p) for p in block.linear.weight.placements],
        "local_rows": block.linear.weight.to_local().shape[0],
        "reshard_after_forward": group._reshard_after_forward,
        "offload": type(group.offload_policy).__name__,
        "sharded": [name for name, m in net.named_modules() if isinstance(m, FSDPModule)],
    }


def column_plan(model: nn.Module, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel

    return {f"blocks.{i}.linear": ColwiseParallel() for i in range(len(model.blocks))}


def mesh_of(options: FSDPOptions, num_nodes: int) -> ParallelMesh:
    return ParallelMesh("cpu", options.layout(num_nodes, 8 // num_nodes), sharding=options.sharding)


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    results = {}
    for name, options, num_nodes in [
        ("full_zero3", FSDPOptions(auto_wrap_policy=[Block]), 1),
        ("hybrid_zero2", FSDPOptions(auto_wrap_policy=["Block"], zero_stage=2, sharding="hybrid"), 2),
        ("offload", FSDPOptions(auto_wrap_policy=[Block], cpu_offload=True), 1),
    ]:
        mesh = mesh_of(options, num_nodes)
        net = Net(width=32)
        parallelize(net, mesh, options, "32-true", ParallelPlan())
        results[name] = {"mesh": list(mesh.root.shape), **layout(net)}

    # Hybrid sharding with tensor parallelism: mesh (2 nodes, 2, 2), no cp dimension (size 1); each block's Linear
    # split columnwise over tp, then sharded over dp_shard and replicated over the nodes.
    options = FSDPOptions(auto_wrap_policy=[Block], sharding="hybrid", tensor_parallel_size=2)
    mesh = mesh_of(options, 2)
    net = Net(width=32)
    plan = ParallelPlan(tensor_parallel=lambda tp_mesh, **flags: column_plan(net, tp_mesh, **flags))
    parallelize(net, mesh, options, "32-true", plan)
    results["hybrid_tp"] = {"mesh": list(mesh.root.shape), "dims": list(mesh.root.mesh_dim_names), **layout(net),
                            "sampler_rank": options.layout(2, 4).data_parallel_rank(5)}

    # Blocks the user already sharded keep their own settings; the rest follow the policy.
    mesh = mesh_of(FSDPOptions(), 1)
    net = Net(width=32)
    fully_shard(net.blocks[1], mesh=mesh.fsdp, reshard_after_forward=False)
    parallelize(net, mesh, FSDPOptions(auto_wrap_policy=[Block], zero_stage=3), "32-true", ParallelPlan())
    results["user_sharded"] = {
        "block1_reshard": net.blocks[1]._get_fsdp_state()._fsdp_param_group._reshard_after_forward,
        "block0_reshard": net.blocks[0]._get_fsdp_state()._fsdp_param_group._reshard_after_forward,
    }

    # bf16-mixed: parameters are gathered in bf16, gradients reduced in fp32.
    net = Net(width=32)
    parallelize(net, mesh, FSDPOptions(auto_wrap_policy=[Block]), "bf16-mixed", ParallelPlan())
    policy = net.blocks[0]._get_fsdp_state()._mp_policy
    results["mixed_precision"] = {"param_dtype": str(policy.param_dtype), "reduce_dtype": str(policy.reduce_dtype),
                                  "master_dtype": str(net.blocks[0].linear.weight.dtype)}

    # No policy: the repeated block is found; an empty policy means one unit.
    for name, policy in [("auto", None), ("one_unit", [])]:
        net = Net(width=32)
        parallelize(net, mesh, FSDPOptions(auto_wrap_policy=policy), "32-true", ParallelPlan())
        results[name] = [name for name, m in net.named_modules() if isinstance(m, FSDPModule)]

    # A block whose weight is tied to a module outside it stays in the root unit, so the tie holds.
    net = Net(width=32)
    net.head = nn.Linear(32, 32)
    net.head.weight = net.blocks[2].linear.weight
    parallelize(net, mesh, FSDPOptions(auto_wrap_policy=[Block]), "32-true", ParallelPlan())
    results["tied"] = {"sharded": [name for name, m in net.named_modules() if isinstance(m, FSDPModule)],
                       "same_parameter": net.head.weight is net.blocks[2].linear.weight}
    print(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
