"""Preference data for DPO, in TRL's format and tokenised as TRL 1.16 tokenises it (``DPOTrainer._prepare_dataset``,
``DataCollatorForPreference``), so that the same rows give the same tokens.

Rows (one JSON object per JSON Lines line, one row of Parquet / ``save_to_disk``, or one item of a JSON list):
  * standard: ``{"prompt": str, "chosen": str, "rejected": str}``;
  * conversational: ``prompt`` / ``chosen`` / ``rejected`` lists of ``{"role", "content"}`` messages (the prompt ends
    before the answer, chosen and rejected are the answers); without ``prompt``, the messages that chosen and rejected
    begin with in common are the prompt (TRL's ``extract_prompt``).
  Every row is checked before any worker starts; a bad one stops the run naming its file and line or row. All rows of
  a data set are of one kind (TRL decides the kind from the first row).

Tokens, per row:
  * standard: EOS is appended to chosen and rejected unless they end with it; ``prompt``, ``prompt + chosen`` and
    ``prompt + rejected`` are tokenised as texts (``tokenizer(text)``, its special tokens included);
  * conversational: the tokenizer's chat template (the family's) renders ``prompt`` with the generation prompt,
    ``prompt + chosen`` and ``prompt + rejected`` (``apply_chat_template(tokenize=True)``); a tokenizer without one
    cannot read conversational rows;
  * the prompt is the common prefix of the three token lists (``min`` over chosen and rejected), the completions what
    follows it: a template that renders the prompt alone differently, or tokens that merge across the boundary,
    shorten the prompt.

Batches (``collate_preferences``): ``input_ids`` [2B, T], the B chosen sequences then the B rejected ones, each
``prompt + completion`` cut to its first ``seq_len`` tokens (TRL's ``max_length``) and right-padded (pad token, else
EOS) to the batch's longest; ``completion_mask`` [2B, T], 1 on completion tokens. Rows whose prompt alone fills
``seq_len`` are left out (nothing of their completions would remain). Sharding, shuffling and the exact mid-epoch
resume are the text pipeline's (:class:`recipes.decoder.data.TextDataModule`), over the rows.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset

from recipes.decoder.data import (
    DEFAULT_TOKENIZER,
    TextDataModule,
    _fingerprint,
    _hash_tokenizer_files,
    _source_fingerprint,
)
from recipes.decoder.sft_data import BadSampleError, read_samples

COLUMNS = ("prompt", "chosen", "rejected")
# Bump when the tokenisation or the cached columns change, so old caches are not reused.
_CACHE_FORMAT = 1


# ------------------------------------------------------------------------------------------ rows
def to_preference(record: Any) -> dict[str, Any]:
    """``{"prompt", "chosen", "rejected"}`` of one raw row, checked (strings, or lists of messages). Raises
    ``ValueError`` saying what is wrong (the caller adds where the row is)."""
    if not isinstance(record, dict):
        raise ValueError(f"a preference row must be a JSON object, not a {type(record).__name__}")
    for name in ("chosen", "rejected"):
        if record.get(name) is None:
            raise ValueError(f"{name!r} is missing: a preference row needs 'prompt', 'chosen' and 'rejected' (or, in"
                             f" conversational rows, 'chosen' and 'rejected' that share the prompt's messages); its"
                             f" keys are {sorted(record)}")
    chosen, rejected = record["chosen"], record["rejected"]
    conversational = isinstance(chosen, list)
    if record.get("prompt") is None:
        if not conversational:
            raise ValueError("'prompt' is missing: a standard (text) preference row needs 'prompt', 'chosen' and"
                             " 'rejected'")
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        record = {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}
    row = {name: record[name] for name in COLUMNS}
    for name, value in row.items():
        if conversational:
            _check_messages(name, value)
        elif not isinstance(value, str):
            raise ValueError(f"{name!r} is a {type(value).__name__} where 'chosen' is a string: give all three as"
                             " strings (standard) or all as lists of {role, content} messages (conversational)")
    for name in ("chosen", "rejected"):
        if not row[name]:
            raise ValueError(f"{name!r} is empty: there is no completion to score")
    return row


def _check_messages(name: str, messages: Any) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"{name!r} is a {type(messages).__name__} where 'chosen' is a list of messages: give all"
                         " three as lists of {role, content} messages (conversational) or all as strings (standard)")
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{name}[{index}] is {message!r:.80}, not a {{'role': str, 'content': str}} message")


def is_conversational(row: dict[str, Any]) -> bool:
    return isinstance(row["chosen"], list)


# ------------------------------------------------------------------------------------------ tokens
def tokenize_preference(tokenizer: Any, row: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """The prompt's, the chosen completion's and the rejected completion's token ids of one checked row (see the
    module docstring)."""
    if is_conversational(row):
        def encode(messages: list, **kwargs: Any) -> list[int]:
            return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])

        prompt = encode(row["prompt"], add_generation_prompt=True)
        with_chosen, with_rejected = encode(row["prompt"] + row["chosen"]), encode(row["prompt"] + row["rejected"])
    else:
        eos = tokenizer.eos_token
        chosen, rejected = (text if text.endswith(eos) else text + eos for text in (row["chosen"], row["rejected"]))
        prompt, with_chosen, with_rejected = (list(tokenizer(text)["input_ids"]) for text in (
            row["prompt"], row["prompt"] + chosen, row["prompt"] + rejected))
    length = min(_common_prefix(prompt, with_chosen), _common_prefix(prompt, with_rejected))
    return prompt[:length], with_chosen[length:], with_rejected[length:]


def _common_prefix(ids: list[int], other: list[int]) -> int:
    length = 0
    for token, other_token in zip(ids, other):
        if token != other_token:
            break
        length += 1
    return length


def _encode_rows(batch: dict[str, list], tokenizer: Any) -> dict[str, list]:
    """``datasets.map``'s batched encoding: each row's tokens as one list (prompt, chosen, rejected) and the three
    lengths."""
    input_ids, lengths = [], []
    for values in zip(*(batch[name] for name in COLUMNS)):
        parts = tokenize_preference(tokenizer, {name: json.loads(value) for name, value in zip(COLUMNS, values)})
        input_ids.append([token for part in parts for token in part])
        lengths.append([len(part) for part in parts])
    return {"input_ids": input_ids, "lengths": lengths}


# ------------------------------------------------------------------------------------------ batches
class PreferencePairs(Dataset):
    """The tokenised rows whose prompt is shorter than ``seq_len`` (``num_dropped`` counts the others); an item is
    ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (lists of ints) and its ``index`` here. ``num_blocks``: the rows,
    the name the text pipeline's sampler bookkeeping reads."""

    def __init__(self, tokens: Any, seq_len: int) -> None:
        self.tokens = tokens.with_format("numpy")
        lengths = np.asarray(tokens["lengths"]).reshape(-1, 3)
        self.num_samples = len(lengths)
        self.kept = np.flatnonzero(lengths[:, 0] < seq_len).tolist()
        self.num_dropped = self.num_samples - len(self.kept)
        self.num_tokens = int(lengths[self.kept].sum())

    @property
    def num_blocks(self) -> int:
        return len(self.kept)

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        row = self.tokens[self.kept[index]]
        ids, (prompt, chosen, _) = row["input_ids"].tolist(), row["lengths"].tolist()
        return {"prompt_ids": ids[:prompt], "chosen_ids": ids[prompt:prompt + chosen],
                "rejected_ids": ids[prompt + chosen:], "index": index}


def collate_preferences(rows: list[dict[str, list[int]]], *, pad_id: int, max_length: int) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``completion_mask`` LongTensor[2 * len(rows), T]: the chosen sequences, then the rejected
    ones, each cut to ``max_length`` tokens and right-padded with ``pad_id`` to the longest (see the module
    docstring); ``row_index`` [len(rows)], the rows' ``index`` in their split (-1 where a row has none)."""
    sequences, masks = [], []
    for completion in ("chosen_ids", "rejected_ids"):
        for row in rows:
            sequences.append((row["prompt_ids"] + row[completion])[:max_length])
            masks.append(([0] * len(row["prompt_ids"]) + [1] * len(row[completion]))[:max_length])
    length = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, (ids, mask) in enumerate(zip(sequences, masks)):
        input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        completion_mask[i, :len(mask)] = torch.tensor(mask, dtype=torch.long)
    row_index = torch.tensor([row.get("index", -1) for row in rows], dtype=torch.long)
    return {"input_ids": input_ids, "completion_mask": completion_mask, "row_index": row_index}


# ------------------------------------------------------------------------------------------ module
class PreferenceDataModule(TextDataModule):
    """Preference rows (TRL's format), tokenised as TRL does, rank-sharded and resumable.

    A batch is :func:`collate_preferences`'s; ``batch_size`` is per rank, in preference rows (each gives a chosen and
    a rejected sequence).

    Args:
        path: a JSON / JSON Lines / Parquet file, a directory of them, or a ``save_to_disk`` directory of rows.
        tokenizer: local directory of a Hugging Face tokenizer (its chat template renders conversational rows).
        seq_len: tokens per sequence at most (prompt + completion), TRL's ``max_length``; longer ones keep their
            start.
        batch_size: preference rows per rank per step.
        val_fraction: fraction of rows held out for validation, in ``[0, 1)``; 0 disables validation.
        num_workers: DataLoader worker processes per rank.
        seed: seeds the train/validation split and the per-epoch shuffle of the rows.
        shuffle: shuffle the rows each epoch (from ``seed``); False keeps the file's order.
        cache_dir: where tokenised caches are written (default ``<HF datasets cache>/lightning_npu``).
        max_samples: read only the first this-many rows.
        tokenize_num_proc: processes used to tokenise; None = one.
    """

    records = "preference rows"

    def __init__(
        self,
        path: str,
        tokenizer: str = DEFAULT_TOKENIZER,
        seq_len: int = 1024,
        batch_size: int = 8,
        val_fraction: float = 0.0,
        num_workers: int = 0,
        seed: int = 42,
        shuffle: bool = True,
        cache_dir: str | None = None,
        max_samples: int | None = None,
        tokenize_num_proc: int | None = None,
    ) -> None:
        super().__init__(path=path, tokenizer=tokenizer, text_column="chosen", seq_len=seq_len,
                         batch_size=batch_size, val_fraction=val_fraction, num_workers=num_workers, seed=seed,
                         cache_dir=cache_dir, max_documents=max_samples, tokenize_num_proc=tokenize_num_proc)
        if self._format == "text":
            raise ValueError(f"preference data at {path!r} is plain text; give prompt / chosen / rejected rows as"
                             " JSON / JSON Lines, Parquet or a save_to_disk directory")
        self.shuffle = shuffle
        pad = self.tokenizer.pad_token_id
        self.collate_fn = functools.partial(collate_preferences, max_length=seq_len,
                                            pad_id=int(pad if pad is not None else self.tokenizer.eos_token_id))

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one batch on one rank at most (a chosen and a rejected sequence per row)."""
        return 2 * self.batch_size * self.seq_len

    @property
    def cache_path(self) -> Path:
        """The token cache's folder: keyed by the data files, the tokenizer (files and chat template), the split
        settings and the tokenisation's version; not by ``seq_len`` (applied in ``setup``)."""
        key = _fingerprint("preference", _CACHE_FORMAT, _source_fingerprint(self._format, self.path, self._data_files),
                           _hash_tokenizer_files(self.tokenizer_path), self.tokenizer.chat_template,
                           self.val_fraction, self.seed, self.max_documents)
        return self._cache_root() / "preference" / key

    def setup(self, stage: str | None = None) -> None:
        """Load the cached rows (tokenising here if ``prepare_data`` did not run) and leave out those whose prompt
        fills ``seq_len``; logs the counts once."""
        if self.train_dataset is not None:
            return
        train_tokens, val_tokens = self._tokenized_splits()
        splits = [PreferencePairs(tokens, self.seq_len) if tokens is not None else None
                  for tokens in (train_tokens, val_tokens)]
        for name, split in zip(("training", "validation"), splits):
            if split is not None and split.num_blocks == 0:
                raise ValueError(f"No {name} row of {self.path!r} has a prompt shorter than seq_len="
                                 f"{self.seq_len} ({split.num_dropped} of {split.num_samples} left out); raise"
                                 " seq_len")
        self.train_dataset, self.val_dataset = splits  # type: ignore[assignment]
        _, world = self._rank_and_world()
        self._check_enough_blocks(world)
        for name, split in zip(("train", "validation"), splits):
            if split is not None:
                rank_zero_info(f"PreferenceDataModule: {split.num_blocks} {name} rows ({split.num_tokens} tokens);"
                               f" {split.num_dropped} left out, their prompt filling seq_len={self.seq_len}")

    def train_dataloader(self) -> Any:
        loader = super().train_dataloader()
        self._train_sampler.shuffle = self.shuffle  # read when the sampler iterates
        return loader

    # ------------------------------------------------------------------- hooks of TextDataModule.prepare
    def _load_documents(self) -> Any:
        """Every row read and checked (the first bad one stops the run naming its file and line), as a
        ``datasets.Dataset`` of prompt / chosen / rejected in JSON (one schema for text and messages)."""
        import datasets

        rows, kind = [], None
        for where, record in read_samples(self._format, self.path, self._data_files):
            if self.max_documents is not None and len(rows) >= self.max_documents:
                break
            try:
                row = to_preference(record)
                kind = is_conversational(row) if kind is None else kind
                if is_conversational(row) != kind:
                    raise ValueError(f"it is {'conversational' if not kind else 'standard'} where the first row is"
                                     f" {'conversational' if kind else 'standard'}; give one kind of rows")
                if kind and not self.tokenizer.chat_template:
                    raise ValueError(f"it is conversational, but the tokenizer at {self.tokenizer_path!r} has no chat"
                                     " template to render it; give the family's tokenizer, or standard (text) rows")
            except ValueError as err:
                raise BadSampleError(f"Bad preference row at {where}: {err}. Fix or remove that row.") from None
            rows.append({name: json.dumps(row[name]) for name in COLUMNS})
        if not rows:
            raise ValueError(f"The dataset at {self.path!r} is empty: it has no preference rows.")
        return datasets.Dataset.from_list(rows)

    def _check_trainable(self, train_documents: Any) -> None:
        pass  # every row was checked to have both completions when it was read

    def _encoding(self) -> tuple[Any, dict[str, Any], Any]:
        import datasets

        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                      "lengths": datasets.Sequence(datasets.Value("int32"))})
        return _encode_rows, {"tokenizer": self.tokenizer}, features
