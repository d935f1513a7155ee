"""Lightning's own sharded strategies, as projects build them, trained on 2 simulated NPUs in one process group
(torchrun starts both ranks, so several Trainers and Fabrics run in sequence): the Trainer's
``FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy=...)``, ``strategy="fsdp"`` and
``ModelParallelStrategy()``; Fabric's ``FSDPStrategy(...)``, ``"fsdp"`` and ``ModelParallelStrategy(parallelize_fn)``;
each against ``npu_ddp`` from the same seed and data. Each Trainer run also saves a checkpoint and tests from it.

Writes ``<out>/rank<r>.json``: per run, this rank's per-step losses, the strategy class it ran as, and (Trainer) the
test loss from its checkpoint and the loss it ended with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import lightning_npu  # noqa: F401

STEPS = 4
VOCAB = 32


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


class TinyModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.model, batch)
        self.losses.append(float(loss))
        return loss

    def test_step(self, batch, batch_idx):
        self.log("test_loss", lm_loss(self.model, batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> DataLoader:
    tokens = torch.randint(0, VOCAB, (4 * STEPS, 9), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)


def shard_blocks(model: nn.Module, device_mesh) -> nn.Module:
    """A Fabric ModelParallelStrategy parallelize function, as projects write them."""
    mesh = device_mesh["data_parallel"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def trainer_run(strategy, out: Path, name: str) -> dict:
    """Fit with ``strategy()`` (a name, or a new instance each call), save a checkpoint, test from it on a new
    Trainer with another ``strategy()``."""
    seed_everything(0)
    module = TinyModule()
    trainer = Trainer(accelerator="npu", devices=2, strategy=strategy(), max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data())
    checkpoint = out / f"{name}.ckpt"
    trainer.save_checkpoint(checkpoint)
    tested = Trainer(accelerator="npu", devices=2, strategy=strategy(),
                     logger=False, enable_progress_bar=False, enable_model_summary=False)
    (result,) = tested.test(TinyModule(), data(), ckpt_path=str(checkpoint), verbose=False)
    return {"strategy": type(trainer.strategy).__name__, "losses": module.losses, "test_loss": result["test_loss"]}


def fabric_run(strategy) -> dict:
    fabric = Fabric(accelerator="npu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup_module(TinyLM())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for batch in fabric.setup_dataloaders(data()):
        loss = lm_loss(model, batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return {"strategy": type(fabric.strategy).__name__, "losses": losses}


def main(out: Path) -> None:
    runs = {
        "trainer_npu_ddp": lambda: trainer_run(lambda: "npu_ddp", out, "ddp"),
        "trainer_fsdp_strategy": lambda: trainer_run(lambda: FSDPStrategy(
            auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy="SHARD_GRAD_OP"), out, "fsdp_full"),
        "trainer_fsdp_string": lambda: trainer_run(lambda: "fsdp", out, "fsdp_string"),
        "trainer_model_parallel": lambda: trainer_run(ModelParallelStrategy, out, "model_parallel"),
        "fabric_npu_ddp": lambda: fabric_run("npu_ddp"),
        "fabric_fsdp_strategy": lambda: fabric_run(FabricFSDPStrategy(
            auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy="FULL_SHARD")),
        "fabric_fsdp_string": lambda: fabric_run("fsdp"),
        "fabric_model_parallel": lambda: fabric_run(FabricModelParallelStrategy(shard_blocks)),
    }
    result = {name: run() for name, run in runs.items()}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
