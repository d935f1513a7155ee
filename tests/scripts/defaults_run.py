"""A project that leaves the accelerator, devices, strategy and precision at their defaults (``accelerator="auto"``),
trained with the Trainer or Fabric on the simulated NPUs (driven by tests/test_auto_accelerator.py).

Rank 0 writes ``<out>/result.json`` (accelerator, strategy, world size, per-step losses averaged over ranks); each
rank writes ``<out>/rank<r>.json`` (the sums of the batches it trained on and its weights after training).
"""

import argparse
import json
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.pytorch import Callback, Trainer, seed_everything

import lightning_npu  # noqa: F401 -- the one line a project adds
from tests.scripts.fabric_run import batch, train
from tests.scripts.trainer_run import Net, Regression, data

STEPS = 4


class RecordBatches(Callback):
    def __init__(self) -> None:
        self.sums: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.sums.append(batch[0].sum().item())


def with_trainer() -> tuple[object, list[float], list[float], torch.nn.Module]:
    record = RecordBatches()
    trainer = Trainer(max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[record])
    model = Regression()
    trainer.fit(model, train_dataloaders=data())
    return trainer, model.losses, record.sums, model.net


def with_fabric() -> tuple[object, list[float], list[float], torch.nn.Module]:
    fabric = Fabric()
    fabric.launch()
    seed_everything(7)
    model = fabric.setup(Net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses: list[float] = []
    for losses in train(fabric, model, optimizer, {"step": 0}, STEPS):
        pass
    sums = [batch(step, fabric.global_rank)[0].sum().item() for step in range(STEPS)]
    return fabric, losses, sums, model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=["trainer", "fabric"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    seed_everything(7)
    runner, losses, sums, net = with_trainer() if args.api == "trainer" else with_fabric()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    weights = [round(value, 6) for value in torch.cat([p.detach().flatten() for p in net.parameters()]).tolist()]
    (out / f"rank{runner.global_rank}.json").write_text(json.dumps({"batch_sums": sums, "weights": weights}))
    if runner.global_rank == 0:
        result = {"accelerator": type(runner.accelerator).__name__, "strategy": type(runner.strategy).__name__,
                  "world_size": runner.world_size, "losses": losses}
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
