"""LightningCLI entry point for the YAML tests. With IMPORT_PLUGIN=0 it does not import lightning_npu
itself: then only the YAML's ``class_path`` entries can bring the plugin in."""

import json
import os
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

if os.environ.get("IMPORT_PLUGIN", "1") == "1":
    import lightning_npu  # noqa: F401

from tests.strategies.scripts.trainer_run import Regression, data


class CLIRegression(Regression):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    def train_dataloader(self):
        return data()

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        options = getattr(strategy, "options", None)
        if self.trainer.global_rank == 0:
            Path(self.out).mkdir(parents=True, exist_ok=True)
            result = {
                "strategy": type(strategy).__name__,
                "accelerator": type(self.trainer.accelerator).__name__,
                "world_size": self.trainer.world_size,
                "zero_stage": getattr(options, "zero_stage", None),
                "ac_ratio": getattr(options, "activation_checkpointing_ratio", None),
                "precision": getattr(self.trainer.precision_plugin, "precision", None),
                "losses": self.losses,
            }
            (Path(self.out) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    LightningCLI(CLIRegression, save_config_callback=None)
