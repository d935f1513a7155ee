"""Unmodified LightningModules from Lightning's own demos train on (simulated) NPUs with only the Trainer
line changed."""

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, TensorDataset

from lightning_npu import NPUSingleStrategy
from tests.helpers import SCRIPTS, read_json, run_python
from tests.scripts.demo_run import OfflineTransformer


def test_boring_model_trains_validates_and_tests_on_one_npu(simulate, tmp_path):
    simulate(1)
    model = BoringModel()
    before = model.layer.weight.detach().clone()
    trainer = Trainer(accelerator="npu", devices=1, max_steps=4, limit_val_batches=2, limit_test_batches=2,
                      default_root_dir=tmp_path, enable_progress_bar=False)
    trainer.fit(model)
    trainer.test(model)
    assert isinstance(trainer.strategy, NPUSingleStrategy)
    assert trainer.global_step == 4
    assert not torch.equal(before, model.layer.weight.detach())
    assert list((tmp_path / "lightning_logs").rglob("*.ckpt"))


def test_demo_transformer_loss_falls_on_one_npu_in_bf16(simulate):
    simulate(1)
    tokens = torch.randint(0, 64, (16, 9), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    model = OfflineTransformer(vocab_size=64)
    losses = []

    trainer = Trainer(accelerator="npu", devices=1, precision="bf16-mixed", max_epochs=6, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False)
    model.on_train_batch_end = lambda outputs, *_: losses.append(float(outputs["loss"]))
    trainer.fit(model, train_dataloaders=data)
    assert len(losses) == 24
    assert sum(losses[-4:]) < sum(losses[:4])


def test_demo_transformer_trains_sharded_on_two_npus(tmp_path):
    run_python([str(SCRIPTS / "demo_run.py"), str(tmp_path)])
    result = read_json(tmp_path / "result.json")
    assert result["strategy"] == "NPUFSDPStrategy"
    assert len(result["losses"]) == 8  # 16 sequences / 2 ranks / batch 4, 4 epochs
    assert sum(result["losses"][-2:]) < sum(result["losses"][:2])
