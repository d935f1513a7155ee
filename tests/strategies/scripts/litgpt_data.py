"""What litgpt's runs in the tests start from, all local: a tiny model (``MODEL_CONFIG``) with random weights in a
litgpt checkpoint directory (``write_checkpoint_dir``, with the recipes' tokenizer), a ``DataModule`` of the recipes'
corpus for ``pretrain`` (``CorpusRows``) and instruction pairs for ``finetune_lora`` (``write_instructions``). Nothing
is downloaded, and litdata (litgpt's own text datasets) is not needed."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from litgpt import GPT, Config, Tokenizer
from litgpt.utils import save_config
from litgpt.data import DataModule
from torch.utils.data import DataLoader

ASSETS = Path(__file__).resolve().parents[3] / "recipes" / "assets"
TOKENIZER = ASSETS / "tokenizer"
SEQ_LEN = 32
#: A pythia-like model of 2 blocks over the recipes' tokenizer's 2048 tokens.
MODEL_CONFIG = {
    "name": "tiny-pythia", "block_size": SEQ_LEN, "vocab_size": 2048, "padded_vocab_size": 2048, "n_layer": 2,
    "n_head": 2, "n_embd": 32, "intermediate_size": 64, "rotary_percentage": 0.25, "parallel_residual": True,
    "bias": True, "norm_class_name": "LayerNorm", "mlp_class_name": "GptNeoxMLP",
}


def write_checkpoint_dir(directory: Path, seed: int = 0) -> Path:
    """A litgpt checkpoint directory of ``MODEL_CONFIG`` with random weights (``seed``) and the recipes' tokenizer:
    every run of a comparison starts from these same weights (``initial_checkpoint_dir`` / ``checkpoint_dir``)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = Config(**MODEL_CONFIG)
    torch.manual_seed(seed)
    torch.save(GPT(config).state_dict(), directory / "lit_model.pth")
    save_config(config, directory)
    for file in TOKENIZER.iterdir():
        shutil.copy(file, directory / file.name)
    return directory


def write_instructions(path: Path, count: int = 32) -> Path:
    """The first ``count`` instruction-output pairs of the recipes' instructions (recipes/assets/instructions.jsonl,
    whose other rows are conversations) as litgpt's JSON instruction data (``litgpt.data.JSON``)."""
    pairs = []
    with open(ASSETS / "instructions.jsonl") as lines:
        for line in lines:
            row = json.loads(line)
            if "instruction" in row:
                pairs.append({"instruction": row["instruction"], "input": "", "output": row["output"]})
            if len(pairs) == count:
                break
    path.write_text(json.dumps(pairs))
    return path


@dataclass
class CorpusRows(DataModule):
    """``rows`` rows of the corpus; the first ``val_rows`` of them also make the validation set."""

    rows: int = 64
    val_rows: int = 4
    batch_size: int = field(default=1, init=False, repr=False)
    max_seq_length: int = field(default=-1, init=False, repr=False)

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int = -1) -> None:
        self.batch_size, self.max_seq_length = batch_size, max_seq_length

    def setup(self, stage: str = "") -> None:
        tokenizer = Tokenizer(TOKENIZER)
        width = self.max_seq_length + 1
        ids: list[int] = []
        with open(ASSETS / "corpus.jsonl") as lines:
            for line in lines:
                ids.extend(tokenizer.encode(json.loads(line)["text"], eos=True).tolist())
                if len(ids) >= self.rows * width:
                    break
        self.data = torch.tensor(ids[: self.rows * width]).view(self.rows, width)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data[: self.val_rows], batch_size=self.batch_size, shuffle=False)
