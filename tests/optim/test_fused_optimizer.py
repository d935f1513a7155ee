"""Fused AdamW on NPUs: the runtime decides, the recipe follows, bf16 clipping allows it, FSDP2's DTensors step with it."""

import json

import pytest
from lightning.pytorch import Trainer

from lightning_npu import runtime
from lightning_npu.runtime.npu import NPURuntime
from lightning_npu.runtime.simulated import SimulatedRuntime
from recipes.decoder.module import DecoderLM
from tests.helpers import read_json, room_scripts, run_python
from tests.npu_fake import install_fake_torch_npu

SCRIPTS = room_scripts("optim")


@pytest.fixture
def fake_npu_runtime(monkeypatch):
    install_fake_torch_npu(monkeypatch, device_count=2)
    runtime.reset()
    yield
    runtime.reset()


def _recipe_optimizer(tmp_path, **trainer_options):
    module = DecoderLM(preset="tiny", config={"n_layers": 1})
    module.configure_model()
    module.trainer = Trainer(max_steps=10, logger=False, default_root_dir=tmp_path, **trainer_options)
    return module.configure_optimizers()["optimizer"]


def test_only_the_npu_runtime_asks_for_fused_optimizers():
    assert NPURuntime.fused_optimizer is True
    assert SimulatedRuntime.fused_optimizer is False


@pytest.mark.parametrize(
    ("precision", "clip", "fused"),
    [("bf16-mixed", 1.0, True), ("32-true", None, True), ("16-mixed", None, True), ("16-mixed", 1.0, None)],
)
def test_recipe_steps_with_fused_adamw_on_npus(fake_npu_runtime, tmp_path, precision, clip, fused):
    """Catches the recipe's AdamW running torch's unfused default on NPUs (one kernel per step is torch_npu's
    fast path), and fp16 with clipping getting a fused step that would unscale after the clip."""
    optimizer = _recipe_optimizer(tmp_path, accelerator="npu", devices=1, precision=precision, gradient_clip_val=clip)
    assert optimizer.defaults["fused"] is fused


def test_recipe_keeps_torchs_default_optimizer_off_npus(simulate, tmp_path):
    """Catches fused AdamW leaking onto the CPU simulation or a plain CPU run."""
    assert _recipe_optimizer(tmp_path, accelerator="cpu").defaults["fused"] is None
    simulate(1)
    assert _recipe_optimizer(tmp_path, accelerator="npu", devices=1).defaults["fused"] is None


# In a fresh process: other tests rename PrivateUse1 to "npu" for the fake, after which torch's optimizer step
# looks for a torch.npu module.
_CLIP_SCRIPT = """
import json, torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset
import lightning_npu

class FusedRegression(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        return (self.layer(batch[0]) * 1e3).pow(2).mean()  # large gradients: the clip has work to do
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

norms, original = [], torch.nn.utils.clip_grad_norm_
def recording_clip(parameters, max_norm, *args, **kwargs):
    parameters = list(parameters)
    total = original(parameters, max_norm, *args, **kwargs)
    norms.append((float(total), float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in parameters])))))
    return total
torch.nn.utils.clip_grad_norm_ = recording_clip
trainer = Trainer(accelerator="npu", devices=1, precision="bf16-mixed", gradient_clip_val=0.5, max_steps=2,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=%r)
trainer.fit(FusedRegression(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
print(json.dumps({"steps": trainer.global_step, "norms": norms}))
"""


@pytest.mark.slow
def test_bf16_mixed_clips_gradients_for_a_fused_optimizer(tmp_path):
    """Catches Lightning's MixedPrecision refusing to clip for any fused optimizer ("performs unscaling of
    gradients internally") under bf16, where no loss scaler exists: every recipe config clips in bf16."""
    proc = run_python(["-c", _CLIP_SCRIPT % str(tmp_path)], simulate=1)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == 2 and len(result["norms"]) == 2
    assert all(before > 0.5 and after == pytest.approx(0.5, rel=1e-3) for before, after in result["norms"])


@pytest.mark.slow
def test_fused_adamw_steps_fsdp2_dtensor_parameters_under_npu_fsdp(tmp_path):
    """Catches a fused optimizer that cannot step FSDP2's sharded (DTensor) parameters: the recipe under
    npu_fsdp, bf16-mixed and clipping, with the runtime's fused choice on, trains 3 steps on 2 ranks."""
    run_python([str(SCRIPTS / "fused_optimizer_run.py"), "--out", str(tmp_path)], simulate=2)
    for rank in (0, 1):
        result = read_json(tmp_path / f"result_rank{rank}.json")
        assert result["fused"] is True
        assert (result["param_type"], result["exp_avg_type"], result["step"]) == ("DTensor", "DTensor", 3.0)
        assert len(result["losses"]) == 3 and all(0 < loss < 20 for loss in result["losses"])
