"""The same mechanisms under Fabric: two simulated NPUs, FSDP2 sharding, bf16, DCP checkpoint and resume,
gradient accumulation with no_backward_sync."""

import pytest

from tests.helpers import read_json, room_scripts, run_python

SCRIPTS = room_scripts("strategies")

pytestmark = pytest.mark.slow  # every test here starts processes or trains (or shares a fixture that does)


SCRIPT = str(SCRIPTS / "fabric_run.py")


def _run(out, *args):
    run_python([SCRIPT, "--out", str(out), *args])
    return read_json(out / "result.json")


def test_fabric_resume_reproduces_uninterrupted_losses_and_shards(tmp_path):
    ckpt = tmp_path / "ckpt"
    full = _run(tmp_path / "full", "--steps", "6", "--save-at", "3", "--save", str(ckpt))
    resumed = _run(tmp_path / "resumed", "--steps", "6", "--resume", str(ckpt))
    assert full["strategy"] == "NPUFabricFSDPStrategy"
    assert ckpt.is_dir() and (ckpt / ".metadata").is_file()
    assert resumed["losses"] == pytest.approx(full["losses"][3:], abs=1e-6)
    assert full["losses"][-1] < full["losses"][0]
    # A second Fabric in the launched process sets up and trains its model ("Accessing the device mesh before
    # processes have initialized" before): the same seed and batches, the same losses.
    assert full["second_fabric_losses"] == pytest.approx(full["losses"], abs=1e-6)
    fractions = [read_json(tmp_path / "full" / f"fraction_rank{rank}.json") for rank in range(2)]
    assert all(0.45 < f < 0.55 for f in fractions)
    assert sum(fractions) == pytest.approx(1.0)


def test_fabric_bf16_mixed_computes_linear_layers_in_bf16(tmp_path):
    result = _run(tmp_path, "--steps", "2", "--precision", "bf16-mixed")
    assert result["linear_dtypes"] == ["torch.bfloat16"]


def test_no_backward_sync_accumulates_like_ddp_and_leaves_sync_as_found_under_fsdp(tmp_path):
    """Catches Lightning's FSDP2 ``no_backward_sync`` leaving gradient sync off after an ``enabled=False``
    context (the next plain backward reduced nothing: step 1's gradients were missing) and an inner context
    turning sync back on inside an outer one (a gradient was reduced mid-accumulation).

    Both strategies run the same accumulation schedule (see the script) and are checked against an unsharded
    reference trained on every rank's micro-batches; npu_ddp, whose ``no_sync`` is DDP's own, vouches for it.
    """
    results = {}
    for strategy in ("npu_fsdp", "npu_ddp"):
        run_python([str(SCRIPTS / "fabric_no_sync.py"), "--out", str(tmp_path / strategy), "--strategy", strategy])
        results[strategy] = read_json(tmp_path / strategy / "result.json")
    fsdp, ddp = results["npu_fsdp"], results["npu_ddp"]
    assert fsdp["strategy"] == "NPUFabricFSDPStrategy"
    for result in (fsdp, ddp):
        assert len(result["grad_errors"]) == 4
        assert max(result["grad_errors"]) < 1e-5, result["grad_errors"]
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
    assert fsdp["losses"][-1] < fsdp["losses"][0]
    assert fsdp["fsdp_reduced_inside_outer_context"] is False


def test_joint_fabric_setup_trains_the_sharded_model_as_npu_ddp_does(tmp_path):
    """``model, optimizer = fabric.setup(model, optimizer)`` with an optimizer made (and stepped once) before
    sharding: under npu_fsdp its steps used to leave the sharded weights unchanged, and fabric.save raised KeyError.
    Now the per-step losses (with gradient clipping) equal npu_ddp's, the moments it held are sharded with it, and
    a sharded and a full checkpoint of the pair resume steps 3-4 exactly. The full checkpoint numbers the optimizer's
    parameters as optimizer.state_dict() does, so a plain model's AdamW loads it."""
    run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(SCRIPTS / "fabric_joint_setup_run.py"), str(tmp_path)])
    results = [read_json(tmp_path / f"rank{rank}.json") for rank in range(2)]
    mean_ddp = [sum(losses) / 2 for losses in zip(*(result["npu_ddp"]["losses"] for result in results))]
    assert len(mean_ddp) == 4 and mean_ddp[-1] < mean_ddp[0]
    for result in results:
        ddp = result["npu_ddp"]["losses"]
        for run in ("npu_fsdp", "npu_fsdp_full"):
            assert result[run]["weights_changed"] is True
            assert result[run]["losses"] == pytest.approx(ddp, rel=1e-5)
            assert result[run]["resumed"] == pytest.approx(result[run]["losses"][2:], abs=1e-6)
        assert result["full_optimizer_state_keys"] == list(range(10))
        assert result["full_optimizer_group_params"] == [list(range(10))]
        assert result["plain_optimizer_state_size"] == 10
