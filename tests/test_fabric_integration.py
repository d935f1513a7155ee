"""The same mechanisms under Fabric: two simulated NPUs, FSDP2 sharding, bf16, DCP checkpoint and resume."""

import pytest

from tests.helpers import SCRIPTS, read_json, run_python

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
    fractions = [read_json(tmp_path / "full" / f"fraction_rank{rank}.json") for rank in range(2)]
    assert all(0.45 < f < 0.55 for f in fractions)
    assert sum(fractions) == pytest.approx(1.0)


def test_fabric_bf16_mixed_computes_linear_layers_in_bf16(tmp_path):
    result = _run(tmp_path, "--steps", "2", "--precision", "bf16-mixed")
    assert result["linear_dtypes"] == ["torch.bfloat16"]
