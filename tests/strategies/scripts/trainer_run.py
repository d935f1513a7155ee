"""One Trainer run on the simulated NPUs, driven by the integration tests through a subprocess.

Writes ``<out>/result.json`` from rank 0 (per-step losses, the dtype of Linear outputs) and
``<out>/fraction_rank<r>.json`` from each rank (the share of parameter elements it holds after training).
``<out>/losses.json`` (rank 0) holds the losses of the steps this process ran, also when a signal stopped it.

Started by Lightning (one process; it launches the second rank) or as srun starts it (one process per rank, the
``SLURM_*`` variables set): ``--signal-at-step`` then delivers SLURM's requeue signal as ``sbatch --signal`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_npu


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.linear(x))


class Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.losses: list[float] = []
        self.linear_dtypes: set[str] = set()
        self.matmul_dtypes: set[str] = set()
        for module in self.net.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(lambda _m, _i, out: self.linear_dtypes.add(str(out.dtype)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        # A matmul of fp32 tensors that FSDP's MixedPrecisionPolicy does not cast: only autocast makes it bf16.
        self.matmul_dtypes.add(str((x.float() @ x.float().t()).dtype))
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        # The loss averaged over ranks, so every rank records the same number.
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).float(), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SaveAfterFirstEpoch(Callback):
    """Checkpoint at the end of epoch 0 (after its validation), as ModelCheckpoint does, inside an uninterrupted run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


class SignalAtStep(Callback):
    """Deliver ``signum`` to this process once ``global_step`` reaches ``step`` (what ``--signal=USR1@N`` does
    to every task of a SLURM job, at a step the test chooses instead of a time)."""

    def __init__(self, step: int, signum: int = signal.SIGUSR1) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def sharded_fraction(module: nn.Module) -> float | None:
    """Local parameter elements over global parameter elements on this rank (None without parameters).

    FSDP units are resharded first: a unit left gathered after an evaluation forward (the root unit keeps its
    parameters gathered after forward) would otherwise count whole.
    """
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
    local = total = 0
    for param in module.parameters():
        total += param.numel()
        local += param.to_local().numel() if hasattr(param, "to_local") else param.numel()
    return local / total if total else None


def data(n: int = 48) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    return DataLoader(TensorDataset(x, y), batch_size=8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="npu_fsdp")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save", default=None, help="checkpoint written at the end of the first epoch")
    parser.add_argument("--state-dict-type", default="sharded")
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--root-dir", default=None, help="the Trainer's default_root_dir (hpc_ckpt_N.ckpt lands there)")
    parser.add_argument("--signal-at-step", type=int, default=None, help="SIGUSR1 to this process at this step")
    args = parser.parse_args()

    seed_everything(7)
    strategy = args.strategy
    if strategy == "npu_fsdp":
        strategy = lightning_npu.NPUFSDPStrategy(
            auto_wrap_policy={Block}, zero_stage=args.zero_stage, state_dict_type=args.state_dict_type,
            activation_checkpointing_policy=["Block"], activation_checkpointing_ratio=0.5, timeout=120,
            async_save=args.async_save,
        )
    trainer = Trainer(
        accelerator="npu", devices=2, strategy=strategy, precision=args.precision, max_epochs=args.epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=2, num_sanity_val_steps=0, deterministic=True, default_root_dir=args.root_dir,
        callbacks=[SaveAfterFirstEpoch(args.save)] if args.save else [],
    )
    if args.signal_at_step is not None:
        trainer.callbacks.append(SignalAtStep(args.signal_at_step))
    model = Regression()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    try:
        trainer.fit(model, train_dataloaders=data(), val_dataloaders=data(16), ckpt_path=args.resume)
    finally:
        if trainer.global_rank == 0:
            (Path(args.out) / "losses.json").write_text(json.dumps(model.losses))
    # Each rank reports the share of parameter elements it holds.
    (Path(args.out) / f"fraction_rank{trainer.global_rank}.json").write_text(json.dumps(sharded_fraction(model)))
    if trainer.global_rank == 0:
        result = {
            "losses": model.losses,
            "linear_dtypes": sorted(model.linear_dtypes),
            "matmul_dtypes": sorted(model.matmul_dtypes),
            "strategy": type(trainer.strategy).__name__,
            "precision": type(trainer.precision_plugin).__name__,
            "world_size": trainer.world_size,
            "val_loss": trainer.callback_metrics["val_loss"].item(),
            "simulate": os.environ.get("LIGHTNING_NPU_SIMULATE"),
        }
        (Path(args.out) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
