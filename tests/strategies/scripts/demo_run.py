"""Lightning's own demo transformer, unmodified, on two simulated NPUs with npu_fsdp: only the Trainer line
names the NPU. (fp32 here: under bf16-mixed, CPU autocast leaves LayerNorm uncast, and the demo's fp32
positional buffer meets FSDP's bf16 LayerNorm weights, which the CPU kernel rejects; NPU autocast casts it.)

The same two processes then train the same demo with Lightning's own CPU DDP from the same seed, the reference
the sharded run must reproduce (dropout draws the same masks: every rank seeds alike under both strategies).
Writes ``<out>/result.json`` with rank 0's per-step losses of both runs."""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.transformer import LightningTransformer
from torch.utils.data import DataLoader, TensorDataset

import lightning_npu  # noqa: F401


class OfflineTransformer(LightningTransformer):
    """The demo with its WikiText2 download hook disabled (no network here); model and steps untouched."""

    def prepare_data(self) -> None:
        pass


class RecordLoss(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(accelerator: str, strategy: str) -> tuple[Trainer, list[float]]:
    seed_everything(0)
    tokens = torch.randint(0, 64, (16, 9), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    record = RecordLoss()
    trainer = Trainer(accelerator=accelerator, devices=2, strategy=strategy, max_epochs=4,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[record])
    trainer.fit(OfflineTransformer(vocab_size=64), train_dataloaders=data)
    return trainer, record.losses


def main(out: str) -> None:
    trainer, losses = fit("npu", "npu_fsdp")
    strategy = type(trainer.strategy).__name__
    _, reference = fit("cpu", "ddp")
    if trainer.global_rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "result.json").write_text(json.dumps({"losses": losses, "ddp_losses": reference,
                                                           "strategy": strategy}))


if __name__ == "__main__":
    main(sys.argv[1])
