"""Train a decoder LM of the recipe with GRPO under LightningCLI (``grpo_module.GRPOModule`` on
``grpo_data.PromptDataModule``):

    LIGHTNING_NPU_SIMULATE=2 python recipes/posttrain/train_grpo.py fit --config recipes/models/llama/configs/tiny_grpo.yaml

Before any worker starts: every reward function imports and returns one reward per completion (called once on the
first prompts), the batch divides into groups of ``num_generations``, a reference that cannot be built for beta > 0
is named (``reference.choose_reference``, when the model is built), and so are the parallel layouts GRPO cannot run
(``recipes/train.py``'s ``check_parallel_layout``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: makes `recipes` importable

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from lightning_npu import GracefulPreemption, NonFiniteLossGuard  # importing the plugin registers accelerator="npu"
from recipes.posttrain.grpo_data import PromptDataModule
from recipes.posttrain.grpo_module import GRPOModule
from recipes.posttrain.rewards import score
from recipes.train import check_parallel_layout


class GRPOCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments("data.tokenizer", "model.tokenizer_path")
        parser.link_arguments("model.num_generations", "data.num_generations")
        parser.link_arguments("model.max_completion_length", "data.max_completion_length")

    def before_fit(self) -> None:
        check_parallel_layout(self.model, self.datamodule, self.trainer)
        check_accumulation(self.trainer.accumulate_grad_batches)
        check_rewards(self.model, self.datamodule)
        if self.datamodule.seq_len > self.model.config.max_seq_len:
            raise ValueError(f"data.seq_len={self.datamodule.seq_len} exceeds the model's max_seq_len="
                             f"{self.model.config.max_seq_len}; lower it or max_completion_length")


def check_accumulation(accumulate_grad_batches: int) -> None:
    """GRPO's step is a rollout phase and its loss, normalised per optimizer step: accumulating several would roll
    out at each and mis-normalise the loss, so it is refused."""
    if accumulate_grad_batches != 1:
        raise ValueError(f"trainer.accumulate_grad_batches={accumulate_grad_batches}: a GRPO step rolls out and"
                         " normalises its loss per optimizer step, which accumulating micro-batches would break; use"
                         " accumulate_grad_batches=1 and raise data.batch_size (completions per NPU and step)")


def check_rewards(model: GRPOModule, data: PromptDataModule) -> None:
    """Each reward function called on the first prompts, with their own text as stand-in completions: it must run and
    return one reward per completion (``score`` raises otherwise, naming the function)."""
    rows = data.rows[:2]
    prompts = [row["prompt"] for row in rows]
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"}
    score(model.reward_funcs, model.reward_weights, prompts, prompts, columns, model.reward_names)


def main(args: Any = None) -> GRPOCLI:
    return GRPOCLI(GRPOModule, PromptDataModule, save_config_kwargs={"overwrite": True}, args=args,
                   trainer_defaults={"callbacks": [ModelCheckpoint(save_last=True),
                                                   GracefulPreemption(save_on_preemption=True), NonFiniteLossGuard()]})


if __name__ == "__main__":
    main()
