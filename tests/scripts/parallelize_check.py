"""Sharding layout checks for one rank of a larger world, using torch's fake process group (no peers run).

Prints one JSON object with what npu_fsdp's parallelize functions produced for 8 ranks on 2 nodes.
"""

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_npu.strategies.fsdp import FSDPOptions
from lightning_npu.strategies.mesh import build_mesh
from tests.scripts.trainer_run import Block, Net


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


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    results = {}
    for name, options, num_nodes in [
        ("full_zero3", FSDPOptions(auto_wrap_policy=[Block]), 1),
        ("hybrid_zero2", FSDPOptions(auto_wrap_policy=["Block"], zero_stage=2, sharding="hybrid"), 2),
        ("offload", FSDPOptions(auto_wrap_policy=[Block], cpu_offload=True), 1),
    ]:
        mesh = build_mesh("cpu", options.layout(num_nodes, 8 // num_nodes), options.sharding)
        net = Net(width=32)
        options.parallelize(net, mesh, "32-true")
        results[name] = {"mesh": list(mesh.shape), **layout(net)}

    # Hybrid sharding with tensor parallelism: mesh (2 nodes, 2, 1, 2); each block's Linear split columnwise over tp,
    # then sharded over dp_shard_cp and replicated over the nodes.
    options = FSDPOptions(auto_wrap_policy=[Block], sharding="hybrid", tensor_parallel_size=2,
                          tensor_parallel_plan=column_plan)
    mesh = build_mesh("cpu", options.layout(2, 4), options.sharding)
    net = Net(width=32)
    options.parallelize(net, mesh, "32-true")
    results["hybrid_tp"] = {"mesh": list(mesh.shape), "dims": list(mesh.mesh_dim_names), **layout(net),
                            "sampler_rank": options.layout(2, 4).data_parallel_rank(5)}

    # Blocks the user already sharded keep their own settings; the rest follow the policy.
    mesh = build_mesh("cpu", FSDPOptions().layout(1, 8), "full")
    net = Net(width=32)
    fully_shard(net.blocks[1], mesh=mesh, reshard_after_forward=False)
    FSDPOptions(auto_wrap_policy=[Block], zero_stage=3).parallelize(net, mesh, "32-true")
    results["user_sharded"] = {
        "block1_reshard": net.blocks[1]._get_fsdp_state()._fsdp_param_group._reshard_after_forward,
        "block0_reshard": net.blocks[0]._get_fsdp_state()._fsdp_param_group._reshard_after_forward,
    }

    # bf16-mixed: parameters are gathered in bf16, gradients reduced in fp32.
    net = Net(width=32)
    FSDPOptions(auto_wrap_policy=[Block]).parallelize(net, mesh, "bf16-mixed")
    policy = net.blocks[0]._get_fsdp_state()._mp_policy
    results["mixed_precision"] = {"param_dtype": str(policy.param_dtype), "reduce_dtype": str(policy.reduce_dtype),
                                  "master_dtype": str(net.blocks[0].linear.weight.dtype)}

    # No policy: the repeated block is found; an empty policy means one unit.
    for name, policy in [("auto", None), ("one_unit", [])]:
        net = Net(width=32)
        FSDPOptions(auto_wrap_policy=policy).parallelize(net, mesh, "32-true")
        results[name] = [name for name, m in net.named_modules() if isinstance(m, FSDPModule)]

    # A block whose weight is tied to a module outside it stays in the root unit, so the tie holds.
    net = Net(width=32)
    net.head = nn.Linear(32, 32)
    net.head.weight = net.blocks[2].linear.weight
    FSDPOptions(auto_wrap_policy=[Block]).parallelize(net, mesh, "32-true")
    results["tied"] = {"sharded": [name for name, m in net.named_modules() if isinstance(m, FSDPModule)],
                       "same_parameter": net.head.weight is net.blocks[2].linear.weight}
    print(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
