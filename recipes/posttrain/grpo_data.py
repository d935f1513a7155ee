"""GRPO's prompt data: TRL's format, one JSON object a line with a ``prompt`` string and any other columns (a
``solution`` ...), which reach the reward functions by name. Each rank takes ``batch_size / num_generations``
prompts a step (``batch_size`` counts completions, as TRL's per-device batch does), shuffled by the seed, resumable
mid-epoch (the position is in every checkpoint, as for ``TextDataModule``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from recipes.decoder.data import ResumableDataLoader, ResumableDistributedSampler
from recipes.decoder.tokenizer import load_tokenizer

#: The toy verifiable task of ``tiny_grpo.yaml`` (its reward: ``rewards.digits_reward``).
TOY_PROMPTS = Path(__file__).with_name("grpo_toy_prompts.jsonl")


class PromptDataModule(L.LightningDataModule):
    """Prompts for GRPO.

    Args:
        path: a JSONL file of rows with a ``prompt`` string.
        tokenizer: a Hugging Face tokenizer directory; prompts are encoded with it (BOS as the tokenizer adds).
        batch_size: completions per rank and step; a multiple of ``num_generations``.
        num_generations: completions per prompt (the model's, linked by the CLI).
        seq_len: the longest prompt + completion, in tokens (the planner's sequence length): a prompt longer than
            ``seq_len - max_completion_length`` is refused here, before training starts.
        max_completion_length: the model's (linked by the CLI).
        seed: the shuffle's seed.
    """

    def __init__(self, path: str = str(TOY_PROMPTS), tokenizer: str = "recipes/assets/tokenizer", batch_size: int = 8,
                 num_generations: int = 8, seq_len: int = 256, max_completion_length: int = 256,
                 seed: int = 1234) -> None:
        super().__init__()
        if num_generations < 1 or batch_size % num_generations:
            raise ValueError(f"data.batch_size={batch_size} (completions per rank and step) does not divide by"
                             f" num_generations={num_generations} (completions per prompt); make batch_size a"
                             f" multiple of it, e.g. {max(num_generations, 1) * max(batch_size // max(num_generations, 1), 1)}")
        self.path, self.tokenizer_path, self.batch_size, self.seed = path, tokenizer, batch_size, seed
        self.num_generations = num_generations
        self.rows = read_prompts(path)
        self.tokenizer = load_tokenizer(tokenizer)
        self.seq_len = seq_len
        self.prompt_ids = [self.tokenizer(row["prompt"])["input_ids"] for row in self.rows]
        longest = max(range(len(self.rows)), key=lambda i: len(self.prompt_ids[i]))
        if len(self.prompt_ids[longest]) + max_completion_length > seq_len:
            raise ValueError(f"{path} row {longest + 1} has a prompt of {len(self.prompt_ids[longest])} tokens, and"
                             f" with max_completion_length={max_completion_length} it exceeds data.seq_len={seq_len};"
                             " raise seq_len (within the model's max_seq_len), shorten the prompt or the completions")
        self._sampler: Optional[ResumableDistributedSampler] = None
        self._resume_state: Optional[dict[str, Any]] = None

    @property
    def prompts_per_step(self) -> int:
        return self.batch_size // self.num_generations

    def train_dataloader(self) -> ResumableDataLoader:
        split = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        rank, world = (int(split["rank"]), int(split["num_replicas"])) if split else (0, 1)
        if len(self.rows) < self.prompts_per_step * world:
            raise ValueError(f"{self.path} holds {len(self.rows)} prompts, fewer than one step takes"
                             f" ({self.prompts_per_step} per rank x {world} ranks); add prompts or lower batch_size")
        indices = list(range(len(self.rows)))
        sampler = ResumableDistributedSampler(indices, num_replicas=world, rank=rank, seed=self.seed)
        if self._resume_state:
            sampler.epoch, sampler.start = int(self._resume_state["epoch"]), int(self._resume_state["consumed"])
            self._resume_state = None
        self._sampler = sampler
        return ResumableDataLoader(indices, batch_size=self.prompts_per_step, sampler=sampler, drop_last=True,
                                   collate_fn=self.collate)

    def collate(self, indices: list[int]) -> dict[str, Any]:
        """``prompt_ids`` (one 1-D tensor a prompt) and the rows' columns as lists."""
        rows = [self.rows[i] for i in indices]
        columns = {key: [row.get(key) for row in rows] for key in rows[0]}
        ids = [torch.tensor(self.prompt_ids[i], dtype=torch.long) for i in indices]
        return {"prompt_ids": ids, **columns}

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the prompts consumed in it over all ranks, counted from the finished batches."""
        if self._sampler is None or self.trainer is None:
            return {}
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {"epoch": self._sampler.epoch, "consumed": done * self.prompts_per_step * self._sampler.num_replicas}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_state = dict(state_dict) if state_dict else None


def read_prompts(path: str) -> list[dict[str, Any]]:
    """The rows of a JSONL prompt file; ValueError naming the first row without a ``prompt`` string."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"data.path={path!r} is not a file; give a JSONL file of rows with a 'prompt' string")
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path} line {number} has no 'prompt' string ({str(row)[:80]}); GRPO rows are"
                             " {\"prompt\": \"...\", ...other columns for the rewards}")
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows
