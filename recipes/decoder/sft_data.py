"""Supervised fine-tuning (SFT) data for the recipe (every model family): chat or instruction samples, formatted,
tokenised once (cached), labelled on assistant tokens only, packed into rows of ``seq_len`` tokens, sharded and resumable.

Samples (one JSON object per JSON Lines line, one row of Parquet / ``save_to_disk``, or one item of a JSON list):
  * chat: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}`` -- an optional first
    system message, then user and assistant turns alternating, ending with an assistant turn;
  * instruction: ``{"instruction": str, "input": str (optional), "output": str}``, read as one user turn
    (``instruction``, then a blank line and ``input`` when given) answered by one assistant turn (``output``).
  Every sample is checked in ``prepare_data`` (before any worker starts); a bad one stops the run with its file and
  line (JSON Lines), item (a JSON list) or row (Parquet, ``save_to_disk``).

Formatting: a sample is a list of pieces (texts, and special token ids), each either trained on (assistant) or not.
The texts between special token ids are tokenised as one text (``add_special_tokens=False``), so the tokens are those
of the whole conversation (tokenising piece by piece would differ for SentencePiece-style tokenizers, which prepend
"▁" to every text they are given); a token is trained on when its first character belongs to a trained piece (the
fast tokenizer's offsets).
  * The tokenizer's own chat template when it has one: the template is rendered as text (``tokenize=False``;
    ``apply_chat_template`` would otherwise return a ``BatchEncoding``) for the conversation up to each turn; an
    assistant piece is what the rendering of ``messages[:k + 1]`` adds to that of ``messages[:k]`` with the
    generation prompt (its content and end-of-turn tokens), the other pieces are what each rendering adds to the
    previous one. A template must therefore render each conversation prefix as a prefix of the next, and must emit
    BOS itself (rendered text is tokenised without special tokens) when the tokenizer has one. The rendered
    conversation is one text, so its tokens are the ones ``apply_chat_template(tokenize=True)`` and inference give.
    Qwen's ChatML (no BOS): an assistant turn trains on its content, ``<|im_end|>`` and the newline after it.
  * Otherwise the LLaMA-2 chat format of Meta's reference (``llama/generation.py``): the system text goes into
    the first user turn as ``<<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user}``, and each user/assistant pair is
    ``BOS "[INST] {user} [/INST]"`` (not trained on) + ``" {assistant} " EOS`` (trained on), contents stripped. As in
    that reference (``encode(f"{B_INST} {user} {E_INST} {answer} ", bos=True, eos=True)`` per pair), each pair's text
    is tokenised as one text between its BOS and EOS.

Rows (built in ``setup`` from the cached tokens, so ``seq_len`` and ``overlong`` change without re-tokenising):
  * A sample longer than ``seq_len`` tokens is cut to its first ``seq_len`` tokens (``overlong="truncate"``) or left
    out (``"drop"``); a truncated sample left with no assistant token is left out too. The counts are logged once.
  * Samples are packed greedily in corpus order: a row takes samples while they fit in ``seq_len`` tokens; a sample
    is never split across rows. The unused tail of a row is one padding segment (pad token ids).
  * A row is ``input_ids`` [seq_len]; ``labels`` [seq_len], ``labels[i]`` the token ``i + 1`` of the same sample
    when that token is an assistant token, else -100 (so the last token of every sample, and all padding, is
    -100: no label crosses a sample boundary); ``position_ids`` [seq_len], restarting at 0 for each sample and for
    the padding segment; ``cu_seqlens`` int32, the cumulative segment lengths ``[0, l1, l1 + l2, ..., seq_len]``
    (the padding segment, if any, is the last one, so the list always ends at ``seq_len``).
  * :func:`collate_packed` stacks rows into a batch and joins their ``cu_seqlens`` into one list of ints over the
    batch flattened to ``batch_size * seq_len`` tokens (row ``b``'s offsets shifted by ``b * seq_len``), the layout a
    document-masked (varlen) attention kernel takes. A list, not a tensor: it stays on the host when the batch moves
    to the device, where the kernel reads it (npu_fusion_attention takes the boundaries as host ints; reading a
    device tensor back would stall the NPU every step). Each segment, padding included, attends only to itself, so no
    attention row is fully masked.

Sharding, shuffling and the exact mid-epoch resume are the text pipeline's (:class:`TextDataModule`): the rows are
what :class:`ResumableDistributedSampler` permutes and shards, and the position is saved by ``state_dict``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset

from recipes.decoder.data import (
    _OPENERS,
    ASSETS_DIR,
    DEFAULT_TOKENIZER,
    TextDataModule,
    _fingerprint,
    _hash_tokenizer_files,
    _source_fingerprint,
)

#: The embedded instruction set (built from the embedded corpus: assets/build_assets.py), the default ``path``.
DEFAULT_INSTRUCTIONS = str(ASSETS_DIR / "instructions.jsonl")
# Bump when the formatting or the cached columns change, so old caches are not reused.
_SFT_CACHE_FORMAT = 3
IGNORE_INDEX = -100  # the label torch's cross_entropy skips
ROLES = ("system", "user", "assistant")
OVERLONG = ("truncate", "drop")
# Meta's LLaMA-2 chat markup (llama/generation.py).
B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"


class BadSampleError(ValueError):
    """A sample that cannot be trained on; the message names its file and line or row."""


# ------------------------------------------------------------------------------------------ samples
def to_messages(record: Any) -> list[dict[str, str]]:
    """The conversation of one raw sample (chat or instruction), checked. Raises ``ValueError`` saying what is
    wrong (the caller adds where the sample is)."""
    if not isinstance(record, dict):
        raise ValueError(f"a sample must be a JSON object, not a {type(record).__name__}")
    if record.get("messages") is not None:
        return _check_messages(record["messages"])
    if "instruction" in record:
        instruction, extra, output = record.get("instruction"), record.get("input"), record.get("output")
        for name, value, optional in (("instruction", instruction, False), ("input", extra, True),
                                      ("output", output, False)):
            if value is None and optional:
                continue
            if value is None:
                raise ValueError(f"'{name}' is missing: an instruction sample needs 'instruction' and 'output'")
            if not isinstance(value, str):
                raise ValueError(f"'{name}' is a {type(value).__name__}, not a string")
            if not optional and not value.strip():
                raise ValueError(f"'{name}' is empty")
        user = instruction if not (extra or "").strip() else f"{instruction}\n\n{extra}"
        return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    raise ValueError(
        f"it has neither 'messages' (a chat sample) nor 'instruction' (an instruction sample); its keys are "
        f"{sorted(record)}"
    )


def _check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"'messages' must be a non-empty list of {{role, content}} objects, not {messages!r:.60}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] is a {type(message).__name__}, not a {{role, content}} object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}] has role {role!r}; the roles are {list(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}] ({role}) has content of type {type(content).__name__}, not a string")
        if not content.strip():
            raise ValueError(f"messages[{i}] ({role}) has empty content")
        checked.append({"role": role, "content": content})
    turns = checked[1:] if checked[0]["role"] == "system" else checked
    if not any(m["role"] == "assistant" for m in turns):
        raise ValueError("it has no assistant turn, so nothing to train on")
    for i, message in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            index = i + len(checked) - len(turns)
            raise ValueError(
                f"messages[{index}] is {message['role']!r} where {expected!r} was expected: after an optional first "
                "system message, user and assistant turns alternate, starting with user"
            )
    if turns[-1]["role"] != "assistant":
        raise ValueError("it ends with a user turn, which has no answer to train on; end it with the assistant")
    return checked


def read_samples(fmt: str, path: str, data_files: list[str]) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for every raw sample of a source resolved by ``data._resolve_source``; ``where`` names
    the file and line (JSON Lines), item (a JSON list) or row (Parquet, ``save_to_disk``)."""
    if fmt == "json":
        for file in data_files:
            yield from _read_json(file)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        for file in data_files:
            row = 0
            for batch in pq.ParquetFile(file).iter_batches():
                for record in batch.to_pylist():
                    yield f"row {row} of {file}", record
                    row += 1
    elif fmt == "arrow":
        import datasets

        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(f"The DatasetDict at {path!r} has splits {sorted(loaded)} but no 'train' split.")
            loaded = loaded["train"]
        for row, record in enumerate(loaded):
            yield f"row {row} of {path}", record
    else:
        raise ValueError(f"SFT data at {path!r} is {fmt}; use JSON / JSON Lines, Parquet or a save_to_disk directory.")


def _read_json(file: str) -> Iterator[tuple[str, Any]]:
    name = file.lower()
    if name.endswith(".zst"):
        raise ValueError(f"{file}: .zst is not read as SFT data; decompress it or use .gz / .bz2 / .xz.")
    suffix = next((c for c in _OPENERS if name.endswith(c)), "")
    with (_OPENERS[suffix] if suffix else open)(file, "rt", encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON document: a list of samples
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise BadSampleError(f"{file} is not valid JSON ({err.msg}, line {err.lineno}, column {err.colno}).")
        for i, record in enumerate(items):
            yield f"item {i} of {file}", record
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise BadSampleError(
                f"Line {number} of {file} is not JSON ({err.msg}, column {err.colno}): {line.strip()[:80]!r}. Each "
                "line of a JSON Lines file must be one sample object; fix or delete that line."
            ) from None
        yield f"line {number} of {file}", record


# ------------------------------------------------------------------------------------------ tokens
def tokenize_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of one conversation and a mask (1 = an assistant token, trained on), see the module docstring: the
    tokenizer's chat template if it has one, else the LLaMA-2 chat format."""
    pieces = _template_pieces(tokenizer, messages) if tokenizer.chat_template else _llama2_pieces(tokenizer, messages)
    if not tokenizer.is_fast:
        raise ValueError(
            f"The tokenizer {type(tokenizer).__name__} is a slow (Python) tokenizer, which gives no character offsets, "
            "so the assistant tokens cannot be found; save it as a fast tokenizer (tokenizer.json)."
        )
    ids: list[int] = []
    mask: list[int] = []
    text: list[tuple[str, bool]] = []
    for piece in [*pieces, None]:  # None: the end, which flushes the last text
        if piece is not None and isinstance(piece[0], str):
            text.append(piece)
            continue
        if text:
            run_ids, run_mask = _tokenize_text(tokenizer, text)
            ids, mask, text = ids + run_ids, mask + run_mask, []
        if piece is not None:  # a special token id
            ids.append(piece[0])
            mask.append(int(piece[1]))
    return ids, mask


def _llama2_pieces(tokenizer: Any, messages: list[dict[str, str]]) -> list[tuple[str | int, bool]]:
    if messages[0]["role"] == "system":
        first = {"role": "user", "content": B_SYS + messages[0]["content"] + E_SYS + messages[1]["content"]}
        messages = [first] + messages[2:]
    pieces: list[tuple[str | int, bool]] = []
    for user, assistant in zip(messages[::2], messages[1::2]):
        pieces += [
            (tokenizer.bos_token_id, False),
            (f"{B_INST} {user['content'].strip()} {E_INST}", False),
            (f" {assistant['content'].strip()} ", True),
            (tokenizer.eos_token_id, True),
        ]
    return pieces


def _tokenize_text(tokenizer: Any, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """The pieces' text tokenised whole; a token is trained on when its first character is in a trained piece."""
    spans, start = [], 0
    for piece, trained in pieces:
        if trained:
            spans.append((start, start + len(piece)))
        start += len(piece)
    encoded = tokenizer("".join(piece for piece, _ in pieces), add_special_tokens=False, return_offsets_mapping=True,
                        verbose=False)
    mask = [int(any(a <= first < b for a, b in spans)) for first, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def _template_pieces(tokenizer: Any, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages[:upto], tokenize=False, add_generation_prompt=generation_prompt
        )

    pieces: list[tuple[str, bool]] = []
    done = ""
    for k, message in enumerate(messages):
        steps = [(render(k, True), False)] if message["role"] == "assistant" else []
        steps.append((render(k + 1, False), message["role"] == "assistant"))
        for text, trained in steps:
            if not text.startswith(done):
                raise ValueError(
                    f"The chat template renders messages[:{k + 1}] not as a continuation of what it renders for the"
                    " turns before it, so the assistant tokens cannot be told apart turn by turn. Use a template"
                    " that renders each conversation prefix as a prefix of the next (or remove chat_template from"
                    " the tokenizer to use the LLaMA-2 format)."
                )
            if len(text) > len(done):
                pieces.append((text[len(done):], trained))
            done = text
    return pieces


def _encode_samples(batch: dict[str, list], tokenizer: Any) -> dict[str, list]:
    encoded = [tokenize_conversation(tokenizer, messages) for messages in batch["messages"]]
    return {"input_ids": [ids for ids, _ in encoded], "assistant_mask": [mask for _, mask in encoded]}


def _check_template_emits_bos(tokenizer: Any, messages: list[dict[str, str]], tokenizer_path: str) -> None:
    bos = tokenizer.bos_token_id
    if not tokenizer.chat_template or bos is None:
        return
    ids, _ = tokenize_conversation(tokenizer, messages)
    if ids[:1] != [bos]:
        raise ValueError(
            f"The chat template of the tokenizer at {tokenizer_path!r} does not start with BOS ({tokenizer.bos_token!r},"
            f" id {bos}); its text is tokenised without special tokens, so the template must emit it: begin the"
            " template with {{ bos_token }}."
        )


# ------------------------------------------------------------------------------------------ rows
class PackedSamples(Dataset):
    """Rows of ``seq_len`` tokens, each a greedy in-order pack of whole samples (see the module docstring).

    ``tokens`` is a ``datasets.Dataset`` with ``input_ids`` and ``assistant_mask`` list columns (one row per
    sample). ``num_truncated`` / ``num_dropped`` count the samples longer than ``seq_len`` that were cut or left
    out; ``num_blocks`` is the number of rows (the name the text pipeline's sampler bookkeeping reads).
    """

    def __init__(self, tokens: Any, seq_len: int, overlong: str, pad_id: int) -> None:
        import pyarrow.compute as pc

        self.tokens = tokens.with_format("numpy")
        self.seq_len = seq_len
        self.pad_id = pad_id
        lengths = pc.list_value_length(tokens.data.column("input_ids")).to_numpy()
        self.num_samples = len(lengths)
        self.num_truncated = self.num_dropped = 0
        kept: list[tuple[int, int]] = []  # (sample, tokens used)
        for index, length in enumerate(lengths.tolist()):
            if length > seq_len:
                # Truncation keeps a sample only if a label survives: mask[i + 1] for some i < seq_len - 1.
                if overlong == "drop" or not self.tokens[index]["assistant_mask"][1:seq_len].any():
                    self.num_dropped += 1
                    continue
                self.num_truncated += 1
                length = seq_len
            kept.append((index, length))
        self.rows: list[list[tuple[int, int]]] = []
        used = seq_len
        for sample in kept:
            if used + sample[1] > seq_len:
                self.rows.append([])
                used = 0
            self.rows[-1].append(sample)
            used += sample[1]
        self.num_tokens = sum(length for _, length in kept)

    @property
    def num_blocks(self) -> int:
        return len(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def samples_of_row(self, index: int) -> list[int]:
        """Indices (into the token dataset) of the samples packed into row ``index``, in order."""
        return [sample for sample, _ in self.rows[index]]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        position_ids = np.zeros(self.seq_len, dtype=np.int64)
        cu_seqlens = [0]
        for sample, length in self.rows[index]:
            row = self.tokens[sample]
            ids, mask = row["input_ids"][:length], row["assistant_mask"][:length]
            begin = cu_seqlens[-1]
            input_ids[begin : begin + length] = ids
            # Next-token targets inside the sample only; the sample's last position predicts nothing.
            labels[begin : begin + length - 1] = np.where(mask[1:] == 1, ids[1:], IGNORE_INDEX)
            position_ids[begin : begin + length] = np.arange(length)
            cu_seqlens.append(begin + length)
        if cu_seqlens[-1] < self.seq_len:  # the padding segment
            position_ids[cu_seqlens[-1] :] = np.arange(self.seq_len - cu_seqlens[-1])
            cu_seqlens.append(self.seq_len)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids),
            "cu_seqlens": torch.tensor(cu_seqlens, dtype=torch.int32),
        }


def collate_packed(rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """A batch of packed rows: ``input_ids`` / ``labels`` / ``position_ids`` LongTensor[batch, seq_len] and
    ``cu_seqlens``, a list of ints over the batch flattened to ``batch * seq_len`` tokens (``[0, ..., batch * seq_len]``)."""
    batch: dict[str, Any] = {key: torch.stack([row[key] for row in rows]) for key in ("input_ids", "labels", "position_ids")}
    seq_len = batch["input_ids"].shape[1]
    batch["cu_seqlens"] = [0] + [b * seq_len + end for b, row in enumerate(rows) for end in row["cu_seqlens"][1:].tolist()]
    return batch


# ------------------------------------------------------------------------------------------ module
class SFTDataModule(TextDataModule):
    """Chat / instruction samples, labelled on assistant tokens, packed, rank-sharded and resumable.

    A batch is :func:`collate_packed`'s (``input_ids``, ``labels``, ``position_ids`` [batch_size, seq_len] and
    ``cu_seqlens``). ``batch_size`` is per rank, in rows.

    Args:
        path: a JSON / JSON Lines / Parquet file, a directory of them, or a ``save_to_disk`` directory of samples
            (default: the embedded instruction set, ``assets/instructions.jsonl``).
        tokenizer: local directory of a Hugging Face tokenizer (its chat template, if any, formats the samples).
        seq_len: tokens per row.
        overlong: what happens to a sample longer than ``seq_len``: ``"truncate"`` (keep its first ``seq_len``
            tokens) or ``"drop"``.
        batch_size: rows per rank per step.
        val_fraction: fraction of samples held out for validation, in ``[0, 1)``; 0 disables validation.
        num_workers: DataLoader worker processes per rank.
        seed: seeds the train/validation split and the per-epoch shuffle of the rows.
        cache_dir: where tokenised caches are written (default ``<HF datasets cache>/lightning_npu``).
        max_samples: read only the first this-many samples.
        tokenize_num_proc: processes used to tokenise; None = one.
    """

    collate_fn = staticmethod(collate_packed)
    records = "samples"

    def __init__(
        self,
        path: str = DEFAULT_INSTRUCTIONS,
        tokenizer: str = DEFAULT_TOKENIZER,
        seq_len: int = 256,
        overlong: str = "truncate",
        batch_size: int = 8,
        val_fraction: float = 0.0,
        num_workers: int = 0,
        seed: int = 42,
        cache_dir: str | None = None,
        max_samples: int | None = None,
        tokenize_num_proc: int | None = None,
    ) -> None:
        if overlong not in OVERLONG:
            raise ValueError(
                f"overlong={overlong!r} is not one of {list(OVERLONG)}: it says what happens to a sample longer than"
                " seq_len (cut to seq_len tokens, or left out)."
            )
        super().__init__(
            path=path,
            tokenizer=tokenizer,
            text_column="messages",
            seq_len=seq_len,
            batch_size=batch_size,
            val_fraction=val_fraction,
            num_workers=num_workers,
            seed=seed,
            cache_dir=cache_dir,
            max_documents=max_samples,
            tokenize_num_proc=tokenize_num_proc,
        )
        if self._format == "text":
            raise ValueError(
                f"SFT data at {path!r} is plain text; give chat or instruction samples as JSON / JSON Lines, "
                "Parquet or a save_to_disk directory."
            )
        self.overlong = overlong

    @property
    def pad_id(self) -> int:
        """Token id of the padding segment (the tokenizer's pad token, else EOS; padding is never a label)."""
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    @property
    def cache_path(self) -> Path:
        """The folder of this data's token cache: keyed by the data files, the tokenizer (files and chat template),
        the split settings and the formatting version; not by ``seq_len`` or ``overlong`` (applied in ``setup``)."""
        key = _fingerprint(
            "sft",
            _SFT_CACHE_FORMAT,
            _source_fingerprint(self._format, self.path, self._data_files),
            _hash_tokenizer_files(self.tokenizer_path),
            self.tokenizer.chat_template,
            self.val_fraction,
            self.seed,
            self.max_documents,
        )
        return self._cache_root() / "sft" / key

    def setup(self, stage: str | None = None) -> None:
        """Load the cached samples (tokenising here if ``prepare_data`` did not run), cut or drop the overlong ones
        and pack them into rows; logs the counts once."""
        if self.train_dataset is not None:
            return
        train_tokens, val_tokens = self._tokenized_splits()
        train = PackedSamples(train_tokens, self.seq_len, self.overlong, self.pad_id)
        if train.num_blocks == 0:
            raise ValueError(
                f"No training sample of {self.path!r} fits seq_len={self.seq_len} with overlong={self.overlong!r} "
                f"({train.num_dropped} of {train.num_samples} left out). Raise seq_len or use overlong='truncate'."
            )
        val = PackedSamples(val_tokens, self.seq_len, self.overlong, self.pad_id) if val_tokens is not None else None
        if val is not None and val.num_blocks == 0:
            raise ValueError(
                f"No validation sample of {self.path!r} fits seq_len={self.seq_len}; raise val_fraction (now "
                f"{self.val_fraction}) or seq_len, or set val_fraction: 0."
            )
        self.train_dataset, self.val_dataset = train, val  # type: ignore[assignment]
        _, world = self._rank_and_world()
        self._check_enough_blocks(world)
        for name, split in (("train", train), ("validation", val)):
            if split is None:
                continue
            rank_zero_info(
                f"SFTDataModule: {split.num_samples} {name} samples -> {split.num_blocks} rows of {self.seq_len} tokens "
                f"({split.num_tokens / (split.num_blocks * self.seq_len):.0%} filled); longer than seq_len: "
                f"{split.num_truncated} truncated, {split.num_dropped} dropped (overlong={self.overlong!r})"
            )

    # ------------------------------------------------------------------- hooks of TextDataModule.prepare
    def _load_documents(self) -> Any:
        """Every sample read and checked (the first bad one stops the run naming its file and line), as a
        ``datasets.Dataset`` with one ``messages`` column."""
        import datasets

        conversations = []
        for where, record in read_samples(self._format, self.path, self._data_files):
            if self.max_documents is not None and len(conversations) >= self.max_documents:
                break
            try:
                conversations.append({"messages": to_messages(record)})
            except ValueError as err:
                raise BadSampleError(f"Bad SFT sample at {where}: {err}. Fix or remove that sample.") from None
        if not conversations:
            raise ValueError(f"The dataset at {self.path!r} is empty: it has no samples.")
        _check_template_emits_bos(self.tokenizer, conversations[0]["messages"], self.tokenizer_path)
        message = {"role": datasets.Value("string"), "content": datasets.Value("string")}
        features = datasets.Features({"messages": datasets.List(message)})
        return datasets.Dataset.from_list(conversations, features=features)

    def _check_trainable(self, train_documents: Any) -> None:
        pass  # every sample was checked to have an assistant turn when it was read

    def _encoding(self) -> tuple[Any, dict[str, Any], Any]:
        import datasets

        features = datasets.Features({
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "assistant_mask": datasets.Sequence(datasets.Value("int8")),
        })
        return _encode_samples, {"tokenizer": self.tokenizer}, features
