"""Tensor parallelism under npu_fsdp: one mesh (pp, dp_replicate, dp_shard, cp, tp), its sizes checked before workers
start, and training on a 2 x 2 mesh that equals plain sharding on 4 simulated NPUs."""

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer

from lightning_npu import NPUFabricFSDPStrategy, NPUFSDPStrategy
from lightning_npu.facts.options import MeshLayout
from tests.helpers import read_json, room_scripts, run_python
from tests.prefetch import PREFETCHED

SCRIPTS = room_scripts("parallel")


@pytest.mark.parametrize(
    ("nodes", "devices", "sharding", "tp", "cp", "shape"),
    [
        (1, 4, "full", 2, 1, (1, 1, 2, 1, 2)),
        (2, 8, "full", 8, 1, (1, 1, 2, 1, 8)),
        (4, 8, "hybrid", 2, 1, (1, 4, 4, 1, 2)),
        (2, 8, "full", 2, 2, (1, 1, 4, 2, 2)),
        (1, 8, "full", 1, 1, (1, 1, 8, 1, 1)),
    ],
)
def test_mesh_layout_puts_tensor_parallel_innermost(nodes, devices, sharding, tp, cp, shape):
    layout = MeshLayout.for_run(num_nodes=nodes, devices_per_node=devices, sharding=sharding,
                                tensor_parallel_size=tp, context_parallel_size=cp)
    assert layout.shape == shape
    world = nodes * devices
    assert layout.world_size == world and layout.loss_ranks == world // tp
    assert layout.data_parallel_size == world // (tp * cp)
    # Consecutive ranks share a batch (a TP group, then a CP group); the sampler sees each replica once.
    ranks = [layout.data_parallel_rank(rank) for rank in range(world)]
    assert ranks == [rank // (tp * cp) for rank in range(world)]
    assert sorted(set(ranks)) == list(range(layout.data_parallel_size))
    # The rank formula read backwards gives each rank's coordinates.
    for rank in range(world):
        at = layout.coordinates(rank)
        assert ((((at["pp"] * layout.dp_replicate + at["dp_replicate"]) * layout.dp_shard + at["dp_shard"])
                 * layout.cp + at["cp"]) * layout.tp + at["tp"]) == rank


@pytest.mark.parametrize(
    ("nodes", "devices", "sharding", "tp", "cp", "message"),
    [
        (1, 4, "full", 3, 1, r"tensor_parallel_size=3 does not divide the 4 devices of each node: .*use a divisor of"
                             r" 4 \(1, 2, 4\)"),
        (2, 4, "full", 8, 1, r"tensor_parallel_size=8 does not divide the 4 devices of each node"),
        (1, 6, "full", 2, 4, r"tensor_parallel_size=2 x context_parallel_size=4 = 8 does not divide the world size 6"),
        (2, 4, "hybrid", 2, 4, r"sharding='hybrid' shards within each node of 4 devices, which .* = 8 does not"),
    ],
)
def test_mesh_layout_refuses_sizes_the_devices_cannot_form(nodes, devices, sharding, tp, cp, message):
    with pytest.raises(ValueError, match=message):
        MeshLayout.for_run(num_nodes=nodes, devices_per_node=devices, sharding=sharding, tensor_parallel_size=tp,
                           context_parallel_size=cp)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 0}, r"tensor_parallel_size=0 must be a positive integer"),
        ({"context_parallel_size": 0}, r"context_parallel_size=0 must be a positive integer"),
        ({"context_parallel_algo": "zigzag"}, r"context_parallel_algo='zigzag' is not supported; use 'ulysses' .*'ring'"),
        ({"parallel_plan": "nowhere.plan"}, r"parallel_plan: cannot import 'nowhere.plan'"),
        ({"parallel_plan": "tests.parallel.scripts.tensor_parallel_run.WIDTH"},
         r"names an object of type int, not a function"),
    ],
)
def test_mesh_options_are_checked_when_the_strategy_is_made(kwargs, message):
    for strategy in (NPUFSDPStrategy, NPUFabricFSDPStrategy):
        with pytest.raises(ValueError, match=message):
            strategy(**kwargs)


def test_tensor_parallel_size_the_devices_cannot_form_fails_before_workers_start(simulate):
    """Catches a mesh-size error surfacing only inside the workers (init_device_mesh's assertion, after every rank
    started): the Trainer and Fabric refuse it where they are made, with the numbers and the fix."""
    simulate(4)
    message = r"tensor_parallel_size=3 does not divide the 4 devices of each node"
    with pytest.raises(ValueError, match=message):
        Trainer(accelerator="npu", devices=4, strategy=NPUFSDPStrategy(tensor_parallel_size=3), logger=False)
    with pytest.raises(ValueError, match=message):
        Fabric(accelerator="npu", devices=4, strategy=NPUFabricFSDPStrategy(tensor_parallel_size=3))
    # A size that fits is accepted, and the sampler splits over data-parallel ranks only.
    trainer = Trainer(accelerator="npu", devices=4, strategy=NPUFSDPStrategy(tensor_parallel_size=2), logger=False)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


@PREFETCHED.fixture(seconds=8)
def tensor_parallel_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tensor_parallel")
    run_python([str(SCRIPTS / "tensor_parallel_run.py"), "--out", str(out)], simulate=4, timeout=900)
    return out, read_json(out / "result.json")


@pytest.mark.slow
def test_a_model_parallel_strategy_module_trains_under_npu_fsdp_with_tensor_parallelism(tensor_parallel_runs):
    """A LightningModule written for Lightning's ModelParallelStrategy (configure_model: parallelize_module on
    device_mesh["tensor_parallel"], fully_shard on device_mesh["data_parallel"]) runs unchanged with
    tensor_parallel_size=2 and 1 on 4 simulated NPUs, with plain npu_fsdp's per-step losses (the same global
    batch), and without torch's warnings about the mesh."""
    _, result = tensor_parallel_runs
    dp, tp = result["dp"], result["tp_user"]
    # Lightning ModelParallelStrategy's names at every size, as its modules read them.
    assert dp["mesh_dims"] == tp["mesh_dims"] == ["data_parallel", "tensor_parallel"]
    assert len(tp["losses"]) == len(dp["losses"]) == 8
    assert torch.allclose(torch.tensor(tp["losses"]), torch.tensor(dp["losses"]), rtol=0, atol=1e-5)
    # Under plain sharding (tensor_parallel_size=1) the module runs unchanged too: its tensor_parallel mesh has one
    # rank. No lookup of Lightning's names warns ("Slicing a flattened dim from root mesh will be deprecated").
    assert torch.allclose(torch.tensor(result["tp1_user"]["losses"]), torch.tensor(dp["losses"]), rtol=0, atol=1e-5)
    assert result["tp1_user"]["mesh_dims"] == ["data_parallel", "tensor_parallel"]
    assert tp["mesh_warnings"] == result["tp1_user"]["mesh_warnings"] == []
    # Row-parallel weights are split on the tp dimension (columns) and sharded by FSDP on the dp one (rows).
    assert all(rank["w2_placements"] == ["S(0)", "S(1)"] for rank in tp["ranks"])
    # The ranks of a tensor-parallel group (0, 1 and 2, 3) train on the same batch, the two groups on different ones.
    sums = [rank["first_batch_sum"] for rank in tp["ranks"]]
    assert sums[0] == sums[1] and sums[2] == sums[3] and sums[0] != sums[2]


@pytest.mark.slow
def test_a_tensor_parallel_plan_given_to_the_strategy_trains_like_plain_sharding(tensor_parallel_runs):
    """parallel_plan= (an import path) splits the same model as its own configure_model did: the same
    losses as plain npu_fsdp on 4, a full checkpoint (state_dict_type="full") of whole tensors equal to its, and
    the full optimizer state on rank 0 only."""
    out, result = tensor_parallel_runs
    assert torch.allclose(torch.tensor(result["tp_plan"]["losses"]), torch.tensor(result["dp"]["losses"]),
                          rtol=0, atol=1e-5)
    assert all(rank["w2_placements"] == ["S(0)", "S(1)"] for rank in result["tp_plan"]["ranks"])
    # strategy.optimizer_state() is the full state on rank 0 and {} on the others, as from Lightning's strategies.
    for run in ("dp", "tp_plan"):
        entries = [rank["optimizer_state_entries"] for rank in result[run]["ranks"]]
        assert entries == [["param_groups", "state"], [], [], []], run
    plain = torch.load(out / "dp.ckpt", weights_only=False)["state_dict"]
    split = torch.load(out / "tp_plan.ckpt", weights_only=False)["state_dict"]
    assert split.keys() == plain.keys() and len(plain) == 8
    for name, tensor in plain.items():
        assert type(split[name]) is torch.Tensor and split[name].shape == tensor.shape, name
        assert torch.allclose(split[name], tensor, rtol=0, atol=1e-5), name


@pytest.mark.slow
def test_a_sharded_checkpoint_of_a_2x2_mesh_resumes_with_the_uninterrupted_losses(tensor_parallel_runs):
    """A DCP checkpoint of 2-D DTensors (Shard on tp, Shard on dp) saved after epoch 0 and resumed on the same
    2 x 2 mesh reproduces the uninterrupted run's epoch-1 losses."""
    _, result = tensor_parallel_runs
    resumed, uninterrupted = result["tp_resume"]["losses"], result["tp_user"]["losses"]
    assert len(resumed) == 4
    assert torch.allclose(torch.tensor(resumed), torch.tensor(uninterrupted[4:]), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_fabric_trains_with_tensor_parallelism_like_plain_sharding(tensor_parallel_runs):
    """NPUFabricFSDPStrategy(tensor_parallel_size=2, parallel_plan=<a function>) in a Fabric loop (the plan
    finds the blocks in the module given to fabric.setup; fabric.all_reduce averages over data-parallel ranks) has
    the per-step losses of plain NPUFabricFSDPStrategy on 4: the same first weights (rank 0's), data and optimizer."""
    _, result = tensor_parallel_runs
    plain, split = result["fabric_dp"], result["fabric_tp"]
    assert split["mesh_dims"] == plain["mesh_dims"] == ["data_parallel", "tensor_parallel"]
    assert split["w2_placements"] == ["S(0)", "S(1)"]
    assert len(split["losses"]) == len(plain["losses"]) == 8
    assert torch.allclose(torch.tensor(split["losses"]), torch.tensor(plain["losses"]), rtol=0, atol=1e-5)
