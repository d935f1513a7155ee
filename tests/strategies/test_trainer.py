"""Two simulated NPUs (two processes, gloo): fit, validate, checkpoint and resume through the Trainer."""

import pytest
import torch

from tests.helpers import read_json, room_scripts, run_python

SCRIPTS = room_scripts("strategies")

pytestmark = pytest.mark.slow  # every test here starts processes or trains (or shares a fixture that does)


SCRIPT = str(SCRIPTS / "trainer_run.py")


def _run(out, *args):
    run_python([SCRIPT, "--out", str(out), *args])
    return read_json(out / "result.json")


@pytest.mark.parametrize(
    ("strategy", "state_dict_type"),
    [("npu_fsdp", "sharded"), ("npu_fsdp", "full"), ("npu_ddp", "sharded")],
)
def test_resume_reproduces_uninterrupted_losses(tmp_path, strategy, state_dict_type):
    """The uninterrupted run checkpoints after epoch 0 (as ModelCheckpoint would); a run resumed from it must give
    the uninterrupted run's epoch-1 losses and validation loss. Under npu_fsdp (ZeRO-3) each rank also holds about
    half of every parameter, and a full (consolidated) checkpoint loads strictly into the plain, unsharded model."""
    common = ["--strategy", strategy, "--state-dict-type", state_dict_type]
    ckpt = tmp_path / "epoch1.ckpt"
    full = _run(tmp_path / "full", *common, "--epochs", "2", "--save", str(ckpt))
    resumed = _run(tmp_path / "resumed", *common, "--epochs", "2", "--resume", str(ckpt))

    assert full["world_size"] == 2
    assert len(full["losses"]) == 6  # 48 samples / 2 ranks / batch 8 = 3 steps per epoch
    assert len(resumed["losses"]) == 3
    assert resumed["losses"] == pytest.approx(full["losses"][3:], abs=1e-6)
    assert resumed["val_loss"] == pytest.approx(full["val_loss"], abs=1e-6)
    assert full["losses"][-1] < full["losses"][0]
    if strategy == "npu_fsdp":
        assert ckpt.is_dir() == (state_dict_type == "sharded")
        assert full["strategy"] == "NPUFSDPStrategy"
        fractions = [read_json(tmp_path / "full" / f"fraction_rank{rank}.json") for rank in range(2)]
        # dim-0 shards; odd sizes differ by a row.
        assert all(0.45 < f < 0.55 for f in fractions)
        assert sum(fractions) == pytest.approx(1.0)
    if state_dict_type == "full":
        from tests.strategies.scripts.trainer_run import Regression

        state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
        Regression().load_state_dict(state)  # strict: every name and shape of the unsharded model
        assert not any(hasattr(t, "to_local") for t in state.values())


@pytest.mark.parametrize("strategy", ["npu_fsdp", "npu_ddp"])
def test_bf16_mixed_autocasts_on_two_npus(tmp_path, strategy):
    """Catches a no-op autocast (e.g. CUDA autocast on an NPU run): the fp32 matmul in training_step stays fp32,
    and under npu_ddp the Linear outputs too (under npu_fsdp FSDP2's bf16 parameters make Linear outputs bf16
    by themselves, which is why the matmul is checked)."""
    result = _run(tmp_path, "--epochs", "1", "--precision", "bf16-mixed", "--strategy", strategy)
    assert result["precision"] == "MixedPrecision"
    assert result["linear_dtypes"] == ["torch.bfloat16"]
    assert result["matmul_dtypes"] == ["torch.bfloat16"]
