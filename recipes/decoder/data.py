"""Text data for the recipe (every model family): read, tokenise once (cached), pack, shard, resume.

Pipeline
  1. Read documents with HF ``datasets`` from ``path``:
       * a ``save_to_disk`` directory (a ``DatasetDict`` gives its ``"train"`` split),
       * Parquet, JSON / JSON Lines (optionally ``.gz``/``.bz2``/``.xz``/``.zst``) -- a file, or a
         directory searched recursively (one format per directory),
       * plain text (``.txt``): one document per blank-line-separated paragraph, in a column named
         ``"text"`` (use JSON Lines when documents contain blank lines).
  2. Split documents, not blocks, into train/validation with a seeded permutation, so no document
     leaks across the split.
  3. Tokenise each document the way the tokenizer encodes a prompt (its own BOS convention, e.g.
     ``<s>`` for LLaMA-2) and end it with EOS. The token lists are written once, by ``prepare_data``,
     as ``datasets`` cache files under ``cache_dir`` keyed by the data's fingerprint, the tokenizer
     files and the split settings; later runs and other ranks load them. Nothing is ever written next
     to the data.
  4. Pack: the documents of a split are one token stream, cut into consecutive blocks of
     ``seq_len + 1`` tokens (the tail shorter than a block is dropped). A block is read straight from
     the memory-mapped cache, so ``seq_len`` can change without re-tokenising.
     A sample is ``{"input_ids": block[:-1], "labels": block[1:]}``.
  5. Shard and shuffle with :class:`ResumableDistributedSampler`: a seeded per-epoch permutation of
     the blocks, rank ``r`` of ``W`` taking positions ``r, r + W, ...``. After ``k`` steps the ranks
     together consumed exactly the first ``k * batch_size * W`` positions, so the position in the
     epoch is one number, saved in checkpoints by :meth:`TextDataModule.state_dict` and restored
     exactly on resume (no block repeated or skipped).

Lightning: the sampler subclasses ``DistributedSampler``, which is what Lightning checks before
injecting its own, so it is kept whatever ``use_distributed_sampler`` says; the recipe passes
``use_distributed_sampler=False`` anyway. Rank and world size come from ``self.trainer``.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from recipes import legacy
from recipes.decoder.tokenizer import TOKENIZER_FILES, load_tokenizer

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
DEFAULT_CORPUS = str(ASSETS_DIR / "corpus.jsonl")
DEFAULT_TOKENIZER = str(ASSETS_DIR / "tokenizer")

# Bump when the tokenised cache layout or the encoding rule changes, so old caches are not reused.
_CACHE_FORMAT = 2
# Written last by TextDataModule.prepare: a cache folder without it is incomplete.
_MANIFEST = "manifest.json"
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
_FORMAT_OF_SUFFIX = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text"}


def check_vocab_fits(tokenizer_vocab_size: int, model_vocab_size: int) -> None:
    """Raise ``ValueError`` if token ids from the tokenizer could index past the model's embedding.

    Args:
        tokenizer_vocab_size: number of token ids the tokenizer can emit (``TextDataModule.vocab_size``).
        model_vocab_size: rows of the model's embedding table (the model config's ``vocab_size``).
    """
    if tokenizer_vocab_size > model_vocab_size:
        raise ValueError(
            f"The tokenizer has {tokenizer_vocab_size} tokens but the model's vocab_size is "
            f"{model_vocab_size}: token ids >= {model_vocab_size} would index past the embedding table. "
            f"Set the model's vocab_size to at least {tokenizer_vocab_size}, or use the tokenizer the "
            "model was built for."
        )


class NotPreparedError(RuntimeError):
    """A multi-rank run found no prepared token cache."""


class PackedBlocks(Dataset):
    """Consecutive blocks of ``seq_len + 1`` tokens cut from one split's token stream.

    ``tokens`` is a ``datasets.Dataset`` with an ``input_ids`` list column (one row per document,
    EOS-terminated). Reads are zero-copy views of its memory-mapped Arrow file; a DataLoader worker
    re-opens the file instead of receiving the tokens through pickling.
    """

    def __init__(self, tokens: Any, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.block_len = seq_len + 1
        self._chunks: list[np.ndarray] | None = None
        self._chunk_starts: np.ndarray | None = None
        self.num_tokens = int(sum(len(c) for c in self._arrays()[0]))
        self.num_blocks = self.num_tokens // self.block_len

    def _arrays(self) -> tuple[list[np.ndarray], np.ndarray]:
        if self._chunks is None:
            column = self.tokens.data.column("input_ids")
            # `flatten` honours each chunk's offsets/slicing; int32 without nulls maps to numpy zero-copy.
            chunks = [c.flatten().to_numpy(zero_copy_only=True) for c in column.chunks]
            self._chunks = [c for c in chunks if len(c)]
            self._chunk_starts = np.cumsum([0] + [len(c) for c in self._chunks])
        assert self._chunk_starts is not None
        return self._chunks, self._chunk_starts

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_chunks"] = state["_chunk_starts"] = None
        return state

    def __len__(self) -> int:
        return self.num_blocks

    def block(self, index: int) -> np.ndarray:
        """Token ids of block ``index`` (``seq_len + 1`` of them, int64)."""
        if not 0 <= index < self.num_blocks:
            raise IndexError(f"block {index} is out of range for {self.num_blocks} blocks")
        chunks, starts = self._arrays()
        begin, end = index * self.block_len, (index + 1) * self.block_len
        i = int(np.searchsorted(starts, begin, side="right")) - 1
        pieces = []
        while begin < end:
            take = min(end, int(starts[i + 1])) - begin
            offset = begin - int(starts[i])
            pieces.append(chunks[i][offset : offset + take])
            begin += take
            i += 1
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = torch.from_numpy(self.block(index))
        return {"input_ids": block[:-1], "labels": block[1:]}


class ResumableDistributedSampler(DistributedSampler):
    """Seeded per-epoch shuffle split across ranks that can start part-way through an epoch.

    Each epoch orders the dataset by ``randperm(seed + epoch)`` (or by index when ``shuffle=False``),
    drops the tail that does not divide evenly across ranks, and gives rank ``r`` the positions
    ``start + r, start + r + W, ...``. ``start`` (in samples, counted over all ranks) is where the
    epoch resumes; it is cleared when :meth:`set_epoch` moves to another epoch. ``len()`` is always
    the full epoch's share per rank, because Lightning counts resumed batches against it.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        num_replicas: int,
        rank: int,
        seed: int,
        shuffle: bool = True,
        epoch: int = 0,
        start: int = 0,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.epoch = epoch
        self.start = start

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        return iter(order[self.start + self.rank : self.total_size : self.num_replicas].tolist())


class ResumableDataLoader(DataLoader):
    """The training DataLoader; it implements Lightning's resumable-loader protocol (``state_dict`` /
    ``load_state_dict``) so Lightning knows a mid-epoch resume is exact, but holds no state itself.

    The position lives in :meth:`TextDataModule.state_dict` instead, because Lightning calls a
    loader's ``load_state_dict`` only when it restarts mid-epoch, after the loader is built, whereas
    the DataModule's state is restored before ``train_dataloader()`` runs, also across an epoch end.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class TextDataModule(L.LightningDataModule):
    """Tokenised, packed, rank-sharded and resumable text for causal-LM training.

    A batch is ``{"input_ids": LongTensor[batch_size, seq_len], "labels": LongTensor[batch_size, seq_len]}``
    with ``labels`` the inputs shifted left by one token. ``batch_size`` is per rank.

    Args:
        path: dataset location (see the module docstring for formats). Default: the small embedded
            corpus of Python standard-library docstrings.
        tokenizer: local directory of a Hugging Face tokenizer (never downloaded). Default: the
            embedded 2048-token byte-level BPE.
        text_column: column holding the document text.
        seq_len: tokens per sample (the model's context length for training).
        batch_size: samples per rank per step.
        val_fraction: fraction of documents held out for validation, in ``[0, 1)``; 0 disables validation.
        num_workers: DataLoader worker processes per rank.
        seed: seeds the train/validation split and the per-epoch shuffle.
        cache_dir: where tokenised caches (and ``datasets``' own Arrow conversions) are written.
            Default: ``<HF datasets cache>/lightning_npu``. On several nodes point it at node-local
            or shared storage; writes are atomic, so a shared directory is safe.
        max_documents: read only the first this-many documents (quick experiments).
        tokenize_num_proc: processes used to tokenise (``datasets.map(num_proc=...)``); None = one.
    """

    # Turns a list of samples into a batch; None = torch's default (stacks the equal-length blocks).
    collate_fn: Callable[[list[Any]], dict[str, torch.Tensor]] | None = None
    # What one record of the source is, in the log.
    records = "documents"

    def __init__(
        self,
        path: str = DEFAULT_CORPUS,
        tokenizer: str = DEFAULT_TOKENIZER,
        text_column: str = "text",
        seq_len: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        seed: int = 42,
        cache_dir: str | None = None,
        max_documents: int | None = None,
        tokenize_num_proc: int | None = None,
    ) -> None:
        super().__init__()
        _check_positive("seq_len", seq_len, "the number of tokens per training sample, e.g. 256")
        _check_positive("batch_size", batch_size, "samples per rank per step, e.g. 8")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(
                f"val_fraction={val_fraction!r} must be in [0, 1): it is the fraction of documents held out "
                "for validation. Use e.g. 0.05, or 0 to disable validation."
            )
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be >= 0 (0 loads data in the training process).")
        if max_documents is not None:
            _check_positive("max_documents", max_documents, "a document count, or null to read them all")
        if tokenize_num_proc is not None:
            _check_positive("tokenize_num_proc", tokenize_num_proc, "a process count, or null for one")

        # A config saved by a run of the recipe's former layout names the embedded data in its old directory.
        self.path = legacy.moved_path(str(path))
        self.tokenizer_path = legacy.moved_path(str(tokenizer))
        self.text_column = text_column
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.seed = seed
        self.max_documents = max_documents
        self.tokenize_num_proc = tokenize_num_proc
        self.cache_dir = cache_dir

        self._format, self._data_files = _resolve_source(self.path)
        self.tokenizer = load_tokenizer(self.tokenizer_path)

        self.train_dataset: PackedBlocks | None = None
        self.val_dataset: PackedBlocks | None = None
        self._train_sampler: ResumableDistributedSampler | None = None
        self._resume_state: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------------- facts
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can emit, added tokens included."""
        return len(self.tokenizer)

    @property
    def eos_id(self) -> int:
        """Token id placed after every document."""
        return int(self.tokenizer.eos_token_id)

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one batch on one rank (``batch_size * seq_len``)."""
        return self.batch_size * self.seq_len

    # ------------------------------------------------------------------------------- lifecycle
    def prepare_data(self) -> None:
        """Check that the token cache exists, tokenising into it in a single-process run (Lightning runs this on
        one process per node; several ranks need :meth:`prepare` run beforehand)."""
        self._tokenized_splits()

    def setup(self, stage: str | None = None) -> None:
        """Load the cached token streams (tokenising here if ``prepare_data`` did not run) and pack them."""
        if self.train_dataset is not None:
            return
        train_tokens, val_tokens = self._tokenized_splits()
        train = PackedBlocks(train_tokens, self.seq_len)
        if train.num_blocks == 0:
            raise ValueError(
                f"The training split of {self.path!r} has {train.num_tokens} tokens, fewer than one block of "
                f"seq_len + 1 = {self.seq_len + 1}. Lower seq_len or add data."
            )
        val = PackedBlocks(val_tokens, self.seq_len) if val_tokens is not None else None
        if val is not None and val.num_blocks == 0:
            raise ValueError(
                f"The validation split of {self.path!r} ({len(val_tokens)} documents, {val.num_tokens} tokens) "
                f"is shorter than one block of seq_len + 1 = {self.seq_len + 1} tokens. Raise val_fraction "
                f"(now {self.val_fraction}), lower seq_len, or set val_fraction: 0 to disable validation."
            )
        self.train_dataset, self.val_dataset = train, val
        rank, world = self._rank_and_world()
        self._check_enough_blocks(world)
        rank_zero_info(
            f"TextDataModule: {train.num_blocks} train blocks"
            + (f", {val.num_blocks} validation blocks" if val is not None else "")
            + f" of {self.seq_len} tokens; {self._steps_per_epoch(world)} steps/epoch with "
            f"{world} rank(s) x batch_size {self.batch_size}"
        )

    def train_dataloader(self) -> DataLoader:
        train = self._require_setup()
        rank, world = self._rank_and_world()
        self._check_enough_blocks(world)
        sampler = ResumableDistributedSampler(train, num_replicas=world, rank=rank, seed=self.seed, shuffle=True)
        if self._resume_state:
            sampler.epoch, sampler.start = self._resume_position(self._resume_state, world)
            self._resume_state = None
        self._train_sampler = sampler
        return self._loader(ResumableDataLoader, train, sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader | list:
        self._require_setup()
        val = self.val_dataset
        if val is None:
            return []
        rank, world = self._rank_and_world()
        if val.num_blocks < world:
            raise ValueError(
                f"The validation split has {val.num_blocks} blocks of {self.seq_len + 1} tokens, fewer than one per "
                f"rank ({world} ranks). Raise val_fraction (now {self.val_fraction}) or set val_fraction: 0."
            )
        sampler = ResumableDistributedSampler(val, num_replicas=world, rank=rank, seed=self.seed, shuffle=False)
        return self._loader(DataLoader, val, sampler, drop_last=False)

    # ------------------------------------------------------------------------------ resumption
    def state_dict(self) -> dict[str, Any]:
        """Position in the training epoch, saved by Lightning in every checkpoint.

        Counted from the batches the fit loop has finished, not from what the sampler handed out:
        DataLoader workers and prefetching read ahead of training.
        """
        sampler, trainer = self._train_sampler, self.trainer
        if sampler is None or trainer is None:
            return {}
        batches_done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        samples_per_step = self.batch_size * sampler.num_replicas
        return {
            "epoch": sampler.epoch,
            "consumed_samples": batches_done * samples_per_step,
            "samples_per_step": samples_per_step,
            "num_blocks": len(sampler.dataset),  # type: ignore[arg-type]
            "seed": self.seed,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Remember the saved position; the next ``train_dataloader()`` starts from it."""
        self._resume_state = dict(state_dict) if state_dict else None

    def _resume_position(self, state: dict[str, Any], world: int) -> tuple[int, int]:
        train = self._require_setup()
        epoch, consumed = int(state["epoch"]), int(state["consumed_samples"])
        if state.get("num_blocks") != train.num_blocks or state.get("seed") != self.seed:
            rank_zero_warn(
                f"TextDataModule: the checkpoint was written for {state.get('num_blocks')} train blocks with "
                f"seed {state.get('seed')}, this run has {train.num_blocks} blocks with seed {self.seed}: the data "
                f"changed, so epoch {epoch} restarts from its first sample."
            )
            return epoch, 0
        samples_per_step = self.batch_size * world
        if state.get("samples_per_step") != samples_per_step:
            rank_zero_warn(
                f"TextDataModule: the checkpoint consumed {consumed} samples with batch_size x data-parallel replicas = "
                f"{state.get('samples_per_step')}, this run uses {samples_per_step}. The epoch resumes at the "
                f"same sample (rounded down to a multiple of {world} replicas); Lightning's batch count for this "
                "epoch is in the old units, so this epoch may end early or late."
            )
            consumed -= consumed % world
        if consumed >= self._steps_per_epoch(world) * samples_per_step:
            return epoch + 1, 0
        return epoch, consumed

    # -------------------------------------------------------------------------------- helpers
    def _loader(
        self, cls: type[DataLoader], dataset: PackedBlocks, sampler: ResumableDistributedSampler, drop_last: bool
    ) -> DataLoader:
        return cls(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            worker_init_fn=_ignore_termination if self.num_workers > 0 else None,
            # Workers forked from a forkserver, not from the rank: a rank runs threads (gloo's, the queues' feeders
            # of the other loader's workers), and Python 3.11 can deadlock a child forked while one of them holds the
            # interpreter's thread-state lock (seen: a worker stuck in PyOS_AfterFork_Child, its rank's batch never
            # came, and the other rank waited in a collective).
            multiprocessing_context="forkserver" if self.num_workers > 0 else None,
            collate_fn=self.collate_fn,
        )

    def _rank_and_world(self) -> tuple[int, int]:
        """This rank's data-parallel replica and the number of replicas: the strategy's sampler split, in which
        the ranks of a tensor- or context-parallel group share their batches (one rank, one replica otherwise)."""
        split = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if not split:
            return 0, 1
        return int(split["rank"]), int(split["num_replicas"])

    def _steps_per_epoch(self, world: int) -> int:
        train = self._require_setup()
        return (train.num_blocks // world) // self.batch_size

    def _check_enough_blocks(self, world: int) -> None:
        train = self._require_setup()
        if self._steps_per_epoch(world) == 0:
            raise ValueError(
                f"The training split has {train.num_blocks} blocks of {self.seq_len + 1} tokens, fewer than one "
                f"step needs (batch_size {self.batch_size} x {world} ranks = {self.batch_size * world}). "
                "Lower batch_size or seq_len, or add data."
            )

    def _require_setup(self) -> PackedBlocks:
        if self.train_dataset is None:
            raise RuntimeError("TextDataModule.setup() must run before its dataloaders are requested.")
        return self.train_dataset

    def _cache_root(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        import datasets

        return Path(datasets.config.HF_DATASETS_CACHE) / "lightning_npu"

    # ------------------------------------------------------------------------------ preparation
    @property
    def cache_path(self) -> Path:
        """The folder of this data's token cache: keyed by the data files (path, size, mtime), the tokenizer
        files and the split settings, so it is found without reading the data."""
        key = _fingerprint(
            _CACHE_FORMAT,
            _source_fingerprint(self._format, self.path, self._data_files),
            _hash_tokenizer_files(self.tokenizer_path),
            self.text_column,
            self.val_fraction,
            self.seed,
            self.max_documents,
        )
        return self._cache_root() / "tokenized" / key

    def is_prepared(self) -> bool:
        """Whether :meth:`prepare` completed for this data and these settings (its manifest exists)."""
        return (self.cache_path / _MANIFEST).is_file()

    def prepare(self) -> dict[str, Any]:
        """Check the data, tokenise it into the cache (``tokenize_num_proc`` processes, with a progress bar) and
        write the cache's manifest last, atomically. Returns the manifest (documents, tokens, seconds, tokens/s);
        when the cache is already complete, returns its manifest without reading the data."""
        if self.is_prepared():
            return json.loads((self.cache_path / _MANIFEST).read_text())
        begin = time.perf_counter()
        documents = self._load_documents()
        train_rows, val_rows = _split_documents(len(documents), self.val_fraction, self.seed)
        train_documents = documents.select(train_rows, keep_in_memory=True)
        self._check_trainable(train_documents)
        out_dir = self.cache_path
        out_dir.mkdir(parents=True, exist_ok=True)
        encode, encode_kwargs, features = self._encoding()
        manifest: dict[str, Any] = {"path": self.path, "tokenize_num_proc": self.tokenize_num_proc or 1, "splits": {}}
        tokenise_s = 0.0
        for name, rows in (("train", train_rows), ("val", val_rows)):
            if rows is None:
                continue
            # keep_in_memory: the index mapping must not be written next to the user's data.
            subset = train_documents if name == "train" else documents.select(rows, keep_in_memory=True)
            started = time.perf_counter()
            tokens = subset.map(
                encode,
                batched=True,
                remove_columns=subset.column_names,
                features=features,
                fn_kwargs=encode_kwargs,
                cache_file_name=str(out_dir / f"{name}.arrow"),
                new_fingerprint=_fingerprint(out_dir.name, name),
                load_from_cache_file=True,
                num_proc=self.tokenize_num_proc,
                desc=f"Tokenising {name} {self.records}",
            )
            tokenise_s += time.perf_counter() - started
            manifest["splits"][name] = {
                "files": [Path(f["filename"]).name for f in tokens.cache_files],
                "documents": len(subset),
                "tokens": PackedBlocks(tokens, 1).num_tokens,
            }
        total = sum(split["tokens"] for split in manifest["splits"].values())
        manifest.update(seconds=round(time.perf_counter() - begin, 3), tokenise_seconds=round(tokenise_s, 3),
                        tokens=total, tokens_per_s=round(total / max(tokenise_s, 1e-9)))
        scratch = out_dir / f".{_MANIFEST}.{os.getpid()}"
        scratch.write_text(json.dumps(manifest, indent=1))
        os.replace(scratch, out_dir / _MANIFEST)  # the cache counts as complete only once this exists
        rank_zero_info(
            f"{type(self).__name__}: prepared {sum(s['documents'] for s in manifest['splits'].values())} {self.records},"
            f" {total} tokens in {manifest['seconds']:.1f} s ({manifest['tokens_per_s']:,} tokens/s tokenising with"
            f" {manifest['tokenize_num_proc']} process(es)) into {out_dir}"
        )
        return manifest

    def _check_trainable(self, train_documents: Any) -> None:
        """Fail when the training split holds nothing to train on (a hook: SFT data checks its own samples)."""
        if not _has_text(train_documents, self.text_column):
            raise ValueError(
                f"The dataset at {self.path!r} has no document with text in column {self.text_column!r} "
                "(all are empty or null) in its training split."
            )

    def _encoding(self) -> tuple[Callable[..., dict[str, list]], dict[str, Any], Any]:
        """The batched ``datasets.map`` function that tokenises documents, its keyword arguments and the
        features of the cache it writes (a hook: SFT data also stores which tokens are trained on)."""
        import datasets

        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
        kwargs = {"tokenizer": self.tokenizer, "text_column": self.text_column, "eos_id": self.eos_id}
        return _encode_documents, kwargs, features

    def _tokenized_splits(self) -> tuple[Any, Any | None]:
        """Token datasets (``input_ids`` per document) of the train and validation splits, from the cache.

        A single process tokenises here if the cache is missing. Several ranks do not: the others would wait for
        it at Lightning's barrier under the process-group timeout, so they stop with the command that prepares it.
        """
        import datasets

        if not self.is_prepared():
            _, world = self._rank_and_world()
            if world > 1:
                raise NotPreparedError(self.not_prepared_message(world))
            self.prepare()
        manifest = json.loads((self.cache_path / _MANIFEST).read_text())
        splits = []
        for name in ("train", "val"):
            files = manifest["splits"].get(name, {}).get("files")
            if files is None:
                splits.append(None)
                continue
            parts = [datasets.Dataset.from_file(str(self.cache_path / f)) for f in files]
            splits.append(parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts))
        return splits[0], splits[1]

    def not_prepared_message(self, world: int) -> str:
        return (
            f"The token cache of data.path={self.path!r} is not prepared ({self.cache_path} has no {_MANIFEST}), and"
            f" this run has {world} ranks: tokenising inside them would keep the other ranks waiting at a barrier"
            " under the process-group timeout. Prepare it once first, with the same config and --data options"
            " (on any machine that sees data.cache_dir; tokenize_num_proc sets its processes):"
            " python recipes/train.py prepare --config <config.yaml> [--data.tokenize_num_proc 8]"
        )

    def _load_documents(self) -> Any:
        import datasets

        if self._format == "arrow":
            loaded = datasets.load_from_disk(self.path)
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise ValueError(
                        f"The DatasetDict at {self.path!r} has splits {sorted(loaded)} but no 'train' split; "
                        "save the split to train on as 'train', or save that Dataset alone."
                    )
                loaded = loaded["train"]
        else:
            if all(os.path.getsize(f) == 0 for f in self._data_files):
                raise ValueError(f"The dataset at {self.path!r} is empty: every data file has 0 bytes.")
            _peek(self._format, self._data_files, self.text_column, self.path)
            if self._format == "json":
                for file in self._data_files:
                    _check_json_lines(file)
            kwargs = {"sample_by": "paragraph"} if self._format == "text" else {}
            try:
                loaded = datasets.load_dataset(
                    self._format,
                    data_files=self._data_files,
                    split="train",
                    cache_dir=str(self._cache_root() / "hf"),
                    **kwargs,
                )
            except datasets.exceptions.DatasetGenerationError as err:
                raise ValueError(
                    f"datasets could not read {self.path!r} as {self._format}: {err.__cause__ or err}"
                ) from err
        _check_text_column(loaded, self.text_column, self.path)
        if len(loaded) == 0:
            raise ValueError(f"The dataset at {self.path!r} is empty: it has no documents.")
        if self.max_documents is not None and self.max_documents < len(loaded):
            loaded = loaded.select(range(self.max_documents), keep_in_memory=True)
        return loaded


# ------------------------------------------------------------------------------ module helpers
def _ignore_termination(worker_id: int) -> None:
    """DataLoader workers ignore SIGTERM: a scheduler signals the whole process group, and a worker killed by it
    fails its rank's next batch before the ranks can stop together (lightning_npu.GracefulPreemption). The
    DataLoader stops its workers through its queues, and a worker exits by itself once its rank is gone."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _check_positive(name: str, value: int, meaning: str) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1: it is {meaning}.")


def _resolve_source(path: str) -> tuple[str, list[str]]:
    """The ``datasets`` builder for ``path`` and its data files ("arrow" for a ``save_to_disk`` directory)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"Dataset path {path!r} does not exist. Give a save_to_disk directory, a Parquet/JSON/JSONL/.txt "
            "file, or a directory of such files."
        )
    if p.is_dir():
        if any((p / marker).is_file() for marker in ("dataset_dict.json", "state.json")):
            return "arrow", []
        by_format: dict[str, list[str]] = {}
        for f in sorted(p.rglob("*")):
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts):
                fmt = _format_of(f)
                if fmt is not None:
                    by_format.setdefault(fmt, []).append(str(f))
        if not by_format:
            raise ValueError(
                f"Directory {path!r} holds no dataset: no save_to_disk files (state.json or dataset_dict.json) "
                f"and no files ending in {sorted(_FORMAT_OF_SUFFIX)}."
            )
        if len(by_format) > 1:
            found = {fmt: len(files) for fmt, files in sorted(by_format.items())}
            raise ValueError(
                f"Directory {path!r} mixes data formats {found}; put one format per directory and point path at it."
            )
        ((fmt, files),) = by_format.items()
        return fmt, files
    fmt = _format_of(p)
    if fmt is None:
        raise ValueError(
            f"Cannot tell the format of {path!r} from its name; use a file ending in {sorted(_FORMAT_OF_SUFFIX)} "
            f"(optionally compressed: {', '.join(_COMPRESSION_SUFFIXES)}) or a save_to_disk directory."
        )
    return fmt, [str(p)]


def _format_of(file: Path) -> str | None:
    name = file.name.lower()
    for compression in _COMPRESSION_SUFFIXES:
        if name.endswith(compression):
            name = name[: -len(compression)]
            break
    return _FORMAT_OF_SUFFIX.get(Path(name).suffix)


def _peek(fmt: str, files: Sequence[str], text_column: str, path: str) -> None:
    """Fail on a missing text column or no rows before ``datasets`` converts a possibly large corpus."""
    columns: list[str] | None = None
    first = files[0]
    if fmt == "text":
        columns = ["text"]
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        columns = list(pq.read_schema(first).names)
        # datasets fails on row-less Parquet with an opaque Arrow error; the footer has the count.
        if text_column in columns and sum(pq.read_metadata(f).num_rows for f in files) == 0:
            raise ValueError(f"The dataset at {path!r} is empty: it has no documents.")
    elif fmt == "json" and not first.endswith(_COMPRESSION_SUFFIXES):
        with open(first, encoding="utf-8") as f:
            line = f.readline().strip()
        try:
            record = json.loads(line) if line.startswith("{") else None
        except json.JSONDecodeError:
            record = None  # not JSON Lines (e.g. one pretty-printed document): checked after loading
        if isinstance(record, dict):
            columns = list(record)
    if columns is not None and text_column not in columns:
        raise _missing_column_error(text_column, columns, path)


_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


def _check_json_lines(file: str) -> None:
    """Fail on the first line of a JSON Lines file that is not a JSON object, naming its line number (``datasets``
    reports a row number within a parse chunk instead, and only inside the workers). A ``.json`` file whose first
    line is not a whole object is one JSON document, left to ``datasets``; ``.zst`` files are left to it too."""
    name = file.lower()
    suffix = next((c for c in _OPENERS if name.endswith(c)), "")
    if name.endswith(".zst"):
        return
    json_lines = name[: len(name) - len(suffix)].endswith(".jsonl")
    with (_OPENERS[suffix] if suffix else open)(file, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                if not json_lines and number == 1:
                    return  # not JSON Lines: one (pretty-printed) JSON document
                raise ValueError(
                    f"Line {number} of {file} is not JSON ({err.msg}, column {err.colno}): {line.strip()[:80]!r}."
                    " Each line of a JSON Lines file must be one JSON object; fix or delete that line."
                ) from None
            if not isinstance(record, dict):
                if not json_lines and number == 1:
                    return
                raise ValueError(
                    f"Line {number} of {file} is a JSON {type(record).__name__}, not an object: each line of a JSON"
                    " Lines file must be one object with the text column, e.g. {\"text\": \"...\"}."
                )


def _source_fingerprint(fmt: str, path: str, data_files: Sequence[str]) -> list[Any]:
    """What identifies the data without reading it: every file's resolved path, size and modification time."""
    files = [Path(f) for f in data_files] if fmt != "arrow" else sorted(p for p in Path(path).rglob("*") if p.is_file())
    return [fmt] + [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def _check_text_column(dataset: Any, text_column: str, path: str) -> None:
    if text_column not in dataset.column_names:
        raise _missing_column_error(text_column, dataset.column_names, path)
    feature = dataset.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ValueError(
            f"Column {text_column!r} of {path!r} holds {feature}, not text; set text_column to a string column "
            f"(columns: {dataset.column_names})."
        )


def _missing_column_error(text_column: str, columns: Sequence[str], path: str) -> ValueError:
    hint = " (plain-text files always give a column named 'text')" if list(columns) == ["text"] else ""
    return ValueError(
        f"text_column={text_column!r} is not a column of {path!r}; its columns are {list(columns)}{hint}. "
        "Set text_column to the one holding the documents."
    )


def _hash_tokenizer_files(path: str) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = Path(path).expanduser() / name
        if f.is_file():
            digest.update(name.encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def _split_documents(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int] | None]:
    """Document rows of the train and validation splits, each in corpus order."""
    if val_fraction == 0:
        return list(range(n)), None
    num_val = max(1, round(n * val_fraction))
    if num_val >= n:
        raise ValueError(
            f"val_fraction={val_fraction} of {n} document(s) leaves no training document; add documents, "
            "lower val_fraction, or set it to 0."
        )
    order = np.random.default_rng(seed).permutation(n)
    return sorted(order[num_val:].tolist()), sorted(order[:num_val].tolist())


def _has_text(documents: Any, text_column: str) -> bool:
    """Whether any document has non-blank text; stops at the first one, so it costs one batch in practice."""
    for batch in documents.with_format("arrow").iter(batch_size=1024):
        texts = batch.column(text_column).to_pylist()
        if any(t is not None and t.strip() for t in texts):
            return True
    return False


def _encode_documents(batch: dict[str, list], tokenizer: Any, text_column: str, eos_id: int) -> dict[str, list]:
    texts = [t for t in batch[text_column] if t is not None and t.strip()]
    if not texts:
        return {"input_ids": []}
    # add_special_tokens: encode as a prompt is encoded at generation time (LLaMA-2 prepends <s>).
    encoded = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
    return {"input_ids": [ids if ids and ids[-1] == eos_id else ids + [eos_id] for ids in encoded]}
