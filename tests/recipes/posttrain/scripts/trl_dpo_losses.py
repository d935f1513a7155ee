"""TRL 1.16's DPOTrainer on a Hugging Face model directory and preference rows in file order, on the CPU, fp32:
writes every optimizer step's loss (exact, not the Trainer's rounded log) to a JSON file.

    python tests/recipes/posttrain/scripts/trl_dpo_losses.py HF_DIR TOKENIZER ROWS.jsonl OUT.json --batch 4 --steps 10 --lr 1e-4
"""

import argparse
import json

import datasets
import torch
from torch.utils.data import SequentialSampler
from transformers import AutoTokenizer
from trl import DPOConfig, DPOTrainer


class InOrder(DPOTrainer):
    """The rows in file order (the recipe's ``shuffle: false``), each step's loss recorded."""

    losses: list[float] = []

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            self.losses.append(float(loss.detach()))
        return loss


parser = argparse.ArgumentParser()
for name in ("model", "tokenizer", "rows", "out"):
    parser.add_argument(name)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--lr", type=float, default=1e-4)
parser.add_argument("--beta", type=float, default=0.1)
parser.add_argument("--max-length", type=int, default=128)
args = parser.parse_args()
torch.manual_seed(0)
config = DPOConfig(
    output_dir=args.out + ".trainer", per_device_train_batch_size=args.batch, max_steps=args.steps,
    learning_rate=args.lr, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
    adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, beta=args.beta, loss_type=["sigmoid"],
    max_length=args.max_length, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
    fp16=False, seed=0, dataloader_drop_last=True,
)
rows = datasets.load_dataset("json", data_files=args.rows, split="train")
trainer = InOrder(model=args.model, args=config, train_dataset=rows,
                  processing_class=AutoTokenizer.from_pretrained(args.tokenizer))
trainer.train()
with open(args.out, "w") as out:
    json.dump(trainer.losses, out)
