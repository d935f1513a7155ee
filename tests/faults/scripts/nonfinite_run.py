"""A Trainer run on 2 simulated NPUs (npu_fsdp) whose loss is made NaN at chosen steps on chosen ranks.

Rank 0 writes ``<out>/result.json``: the error (if any), the steps ModelCheckpoint saved, the steps the guard skipped,
how many optimizer updates AdamW applied, and whether the final weights are finite. The script re-raises the error,
so the exit status is that of the run.
"""

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_npu
from lightning_npu.guards import NonFiniteLossGuard


class Poisoned(LightningModule):
    def __init__(self, nan_steps: set[int], nan_ranks: set[int]) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.nan_steps, self.nan_ranks = nan_steps, nan_ranks

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.trainer.global_step in self.nan_steps and self.global_rank in self.nan_ranks:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--nan-steps", type=int, nargs="*", default=[])
    parser.add_argument("--nan-ranks", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--max-skipped-steps", type=int, default=0)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--save-every", type=int, default=3)
    args = parser.parse_args()

    seed_everything(3)
    out = Path(args.out)
    guard = NonFiniteLossGuard(max_skipped_steps=args.max_skipped_steps)
    trainer = Trainer(
        accelerator="npu", devices=2, strategy=lightning_npu.NPUFSDPStrategy(state_dict_type="full", timeout=60),
        max_steps=args.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=args.log_every, num_sanity_val_steps=0,
        callbacks=[guard, ModelCheckpoint(dirpath=out / "ckpts", filename="{step}", every_n_train_steps=args.save_every,
                                          save_top_k=-1)],
    )
    model = Poisoned(set(args.nan_steps), set(args.nan_ranks))
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(0))
    error = None
    try:
        trainer.fit(model, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
    except Exception as err:  # noqa: BLE001 -- recorded, then re-raised
        error = err
    # full_tensor() gathers the shards: a collective, so every rank computes it.
    finite = all(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all() for p in model.parameters())
    if trainer.global_rank == 0:
        optimizer = trainer.optimizers[0]
        updates = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "saved": sorted(p.name for p in (out / "ckpts").glob("*.ckpt")),
            "skipped": guard.skipped_steps,
            "updates": sorted(set(updates)),
            "global_step": trainer.global_step,
            "finite": bool(finite),
        }))
    if error is not None:
        raise error


if __name__ == "__main__":
    main()
