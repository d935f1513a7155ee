"""A callback that records every training step's loss averaged over the ranks holding different data (the
strategy's ``reduce``: every rank under plain sharding, ``dp x cp`` under context parallelism), so runs whose ranks
split one global batch differently can be compared step by step. Rank 0 writes ``{"losses": [...]}`` to ``out``."""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch import Callback


class ReducedLosses(Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps({"losses": self.losses}))
