"""npu_fsdp's one mesh (``lightning_npu.parallel.mesh.ParallelMesh``): its views for each consumer, the process groups
it creates (no more than plain sharding needs: none; on an NPU each HCCL communicator reserves 2 x HCCL_BUFFSIZE),
and Lightning ModelParallelStrategy's names at every size, without torch's deprecation warnings."""

import json

import pytest

from lightning_npu.facts.options import MESH_DIM_NAMES, MeshLayout
from tests.helpers import room_scripts, run_python
from tests.quick_tier import slow_fixture

SCRIPTS = room_scripts("parallel")


@slow_fixture(scope="module")
def mesh_groups():
    out = run_python([str(SCRIPTS / "mesh_groups_check.py")], simulate=None, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_mesh_dimensions_are_always_the_same_names_outermost_first():
    assert MESH_DIM_NAMES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    layout = MeshLayout(dp_shard=8)
    assert layout.sizes == {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1}
    assert layout.coordinates(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 5, "cp": 0, "tp": 0}


@pytest.mark.slow
def test_plain_sharding_creates_no_process_group_and_each_layout_only_those_its_mechanisms_use(mesh_groups):
    """Groups created on rank 5 of 8 (torch's fake process group): plain sharding's mesh is the default group (0, as
    before this mesh); hybrid sharding's two dimensions (2, as before); tensor and context parallelism one group per
    dimension of size > 1, plus one for FSDP's dp_shard x cp when both are; experts theirs only when asked for. The
    mesh before this one had 4 dimensions (sizes 1 included) and 4 flattened views: 8 groups under tp 2."""
    counts = {name: (result["at_setup"], result["with_mechanisms"]) for name, result in mesh_groups.items()}
    assert counts == {"plain": (0, 0), "hybrid": (2, 2), "tp2": (2, 2), "cp2": (2, 2), "tp2_cp2": (4, 4),
                      "ep4": (0, 2), "tp2_ep2": (2, 4)}


@pytest.mark.slow
def test_the_views_span_the_ranks_each_consumer_needs(mesh_groups):
    """FSDP shards over dp_shard x cp, the loss is averaged over dp x cp (the ranks whose tokens differ), the experts
    borrow dp_shard x cp x tp (ep of them split each layer's experts, FSDP shards them over the rest)."""
    views = {name: result["views"] for name, result in mesh_groups.items()}
    assert views["tp2_cp2"] == {"fsdp": 4, "data_parallel": 4, "lightning": [4, 2], "tp": 2, "cp": 2,
                                "expert_fsdp": 8}
    assert views["tp2_ep2"] == {"fsdp": 4, "data_parallel": 4, "lightning": [4, 2], "tp": 2, "cp": None,
                                "expert_fsdp": 4, "ep": 2}
    assert views["ep4"]["expert_fsdp"] == 2 and views["ep4"]["ep"] == 4
    assert views["hybrid"]["fsdp"] == 8 and views["plain"]["tp"] is None


@pytest.mark.slow
def test_lightning_s_names_exist_at_every_size_and_a_size_one_dimension_gets_a_group_only_when_used(mesh_groups):
    """A module written for ModelParallelStrategy reads device_mesh["data_parallel"] / ["tensor_parallel"]: they
    exist under plain sharding too (tensor_parallel of size 1, whose one-rank group is made when it is read, not at
    setup), and no lookup warns ("Slicing a flattened dim from root mesh will be deprecated")."""
    for name, result in mesh_groups.items():
        assert result["lightning_sizes"] == result["views"]["lightning"], name
        assert result["warnings"] == [], name
        size_one = result["views"]["tp"] is None
        assert result["after_lightning"] == result["with_mechanisms"] + (1 if size_one else 0), name
