"""A tiny LightningCLI recipe (as ``recipes/train.py`` is one) that the cluster tests start the way Ascend clusters
start jobs: ``lightning-npu run`` in Ascend Operator "pods", the ModelArts boot file once per "card".

``fit --model.out DIR --trainer.devices N --trainer.num_nodes M``: 3 steps of a small regression on the simulated
NPUs; every rank writes ``DIR/rank<r>.json`` with its ranks, the world size, the cluster environment Lightning chose,
an all-reduce of rank + 1 and its (rank-averaged) losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning_npu  # noqa: F401 -- "npu" for the Trainer (lightning-npu run imports it too)
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = Path(out)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(48, 8, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        rank_sum = strategy.reduce(torch.tensor(float(self.global_rank + 1)), reduce_op="sum").item()
        self.out.mkdir(parents=True, exist_ok=True)
        report = {
            "global_rank": self.global_rank, "local_rank": self.local_rank, "node_rank": self.trainer.node_rank,
            "world_size": self.trainer.world_size, "cluster_environment": type(strategy.cluster_environment).__name__,
            "strategy": type(strategy).__name__, "rank_sum": rank_sum, "losses": self.losses,
        }
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    LightningCLI(Regression, seed_everything_default=0, save_config_callback=None, trainer_defaults={
        "accelerator": "npu", "max_steps": 3, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False})
