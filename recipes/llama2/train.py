"""Train or fine-tune LLaMA-2 with LightningCLI.

    python recipes/llama2/train.py fit --config recipes/llama2/configs/tiny.yaml
    LIGHTNING_NPU_SIMULATE=2 python recipes/llama2/train.py fit --config recipes/llama2/configs/tiny.yaml
    torchrun --nproc-per-node 8 recipes/llama2/train.py fit --config recipes/llama2/configs/llama2_7b.yaml

Every check of the configuration (checkpoint path, tokenizer against the model's vocabulary, context length
against the model's positions) runs before any worker process starts.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    # Run as a script: make `recipes.llama2` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

from lightning_npu import TokenThroughputMonitor  # importing the plugin registers accelerator="npu" and npu_*
from recipes.llama2.data import TextDataModule, check_vocab_fits
from recipes.llama2.module import LLaMA2

GENERATE_SCRIPT = Path(__file__).resolve().parent / "generate.py"


class RunSummary(Callback):
    """Prints the first and last training loss, where the checkpoint went, and how to generate from it."""

    def __init__(self) -> None:
        # Device tensors, read once at the end: a float() per batch would stall the NPU's queue every step.
        self.first_loss: Optional[Tensor] = None
        self.last_loss: Optional[Tensor] = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"].detach()
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.last_loss = loss

    @rank_zero_only
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.first_loss is None:
            return
        print(f"train loss: first {float(self.first_loss):.4f} -> last {float(self.last_loss):.4f}")
        checkpoint = trainer.checkpoint_callback
        path = getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")
        if path:
            print(f"checkpoint: {path}")
            script = GENERATE_SCRIPT.relative_to(Path.cwd()) if GENERATE_SCRIPT.is_relative_to(Path.cwd()) else GENERATE_SCRIPT
            command = ["python", str(script), "--checkpoint", path, "--prompt", "The", "--max-new-tokens", "40"]
            print("generate: " + shlex.join(command))


class LLaMACLI(LightningCLI):
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments("data.tokenizer", "model.tokenizer_path")

    def before_fit(self) -> None:
        check_run(self.model, self.datamodule, self.config_init[self.subcommand].get("ckpt_path"))


def check_run(model: LLaMA2, data: TextDataModule, ckpt_path: Optional[str]) -> None:
    """Configuration errors that would otherwise surface inside the workers, after start-up."""
    if ckpt_path not in (None, "last", "hpc", "best", "registry") and not Path(ckpt_path).exists():
        raise FileNotFoundError(
            f"ckpt_path={ckpt_path!r} does not exist; give the path of a checkpoint file or sharded checkpoint"
            " directory written by an earlier run (its location is printed at the end of that run)"
        )
    init_from = model.hparams.init_from
    if init_from and not Path(init_from).exists():
        raise FileNotFoundError(
            f"model.init_from={init_from!r} does not exist; give a local Hugging Face LLaMA directory (config.json +"
            " safetensors) or a recipe checkpoint, or remove init_from to train from scratch"
        )
    check_vocab_fits(data.vocab_size, model.config.vocab_size)
    if data.seq_len > model.config.max_seq_len:
        raise ValueError(
            f"data.seq_len={data.seq_len} exceeds the model's max_seq_len={model.config.max_seq_len}:"
            f" rotary positions beyond it were never trained. Lower data.seq_len or set"
            f" model.config.max_seq_len >= {data.seq_len}"
        )


def main(args: Optional[list[str]] = None) -> LLaMACLI:
    return LLaMACLI(
        LLaMA2,
        TextDataModule,
        trainer_defaults={"callbacks": [TokenThroughputMonitor(), RunSummary(), ModelCheckpoint(save_last=True)]},
        save_config_kwargs={"overwrite": False},
        args=args,
    )


if __name__ == "__main__":
    main()
