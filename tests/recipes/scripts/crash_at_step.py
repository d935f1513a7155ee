"""A callback that kills every rank at the start of a given optimizer step, as a crash would (no teardown)."""

import os

from lightning.pytorch import Callback


class CrashAtStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os._exit(3)
