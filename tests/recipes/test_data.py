"""TextDataModule: formats, packing, rank sharding, exact mid-epoch resume, caching, errors, embedded assets."""

from __future__ import annotations

import gzip
import importlib.util
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import datasets
import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoTokenizer

import recipes.decoder.data as data_mod
from recipes.decoder.data import (
    ASSETS_DIR,
    DEFAULT_TOKENIZER,
    PackedBlocks,
    ResumableDistributedSampler,
    TextDataModule,
    check_vocab_fits,
)

pytestmark = pytest.mark.timeout(120)


def _documents(n: int) -> list[str]:
    """Distinct documents of varying length, no blank lines (so .txt paragraphs are documents)."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    return [f"Document {i} says " + " ".join(f"{w}{i}" for w in words[: 2 + i % 9]) + "." for i in range(n)]


def _write(tmp_path: Path, fmt: str, docs: list[str], column: str = "text") -> Path:
    rows = {column: docs, "id": list(range(len(docs)))}
    if fmt == "arrow":
        out = tmp_path / "arrow"
        datasets.Dataset.from_dict(rows).save_to_disk(str(out))
    elif fmt == "arrow_dict":
        out = tmp_path / "arrow_dict"
        datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(out))
    elif fmt == "parquet":
        out = tmp_path / "docs.parquet"
        datasets.Dataset.from_dict(rows).to_parquet(str(out))
    elif fmt == "parquet_dir":
        out = tmp_path / "shards"
        out.mkdir()
        half = len(docs) // 2
        for i, part in enumerate((slice(0, half), slice(half, None))):
            part_rows = {k: v[part] for k, v in rows.items()}
            datasets.Dataset.from_dict(part_rows).to_parquet(str(out / f"part-{i}.parquet"))
    elif fmt == "jsonl":
        out = tmp_path / "docs.jsonl"
        out.write_text("".join(json.dumps({column: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    elif fmt == "jsonl_gz":
        out = tmp_path / "docs.jsonl.gz"
        out.write_bytes(gzip.compress(_write(tmp_path, "jsonl", docs, column).read_bytes()))
    elif fmt == "txt":
        out = tmp_path / "docs.txt"
        out.write_text("\n\n".join(docs))
    else:
        raise AssertionError(fmt)
    return out


def _expected_stream(docs: list[str]) -> list[int]:
    tok = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER)
    stream: list[int] = []
    for d in docs:
        stream += tok(d)["input_ids"] + [tok.eos_token_id]
    return stream


def _all_blocks(dataset: PackedBlocks) -> list[list[int]]:
    return [dataset.block(i).tolist() for i in range(len(dataset))]


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _fake_trainer(rank: int, world: int) -> SimpleNamespace:
    return SimpleNamespace(global_rank=rank, world_size=world,
                           distributed_sampler_kwargs={"num_replicas": world, "rank": rank})


# ----------------------------------------------------------------------------- formats and packing
@pytest.mark.parametrize("fmt", ["arrow", "arrow_dict", "parquet", "parquet_dir", "jsonl", "jsonl_gz", "txt"])
def test_every_format_yields_the_documents_as_one_eos_separated_stream(tmp_path, fmt):
    docs = _documents(30)
    path = _write(tmp_path, fmt, docs)
    dm = TextDataModule(path=str(path), seq_len=15, batch_size=2, val_fraction=0.0, cache_dir=str(tmp_path / "c"))
    dm.prepare_data()
    dm.setup("fit")
    stream = _expected_stream(docs)
    blocks = _all_blocks(dm.train_dataset)
    assert len(blocks) == len(stream) // 16
    assert sum(blocks, []) == stream[: len(blocks) * 16]


def test_packing_puts_eos_between_documents_and_labels_are_inputs_shifted_by_one(tmp_path):
    docs = _documents(12)
    dm = TextDataModule(
        path=str(_write(tmp_path, "jsonl", docs)), seq_len=9, val_fraction=0.0, cache_dir=str(tmp_path / "c")
    )
    dm.setup("fit")
    tok = dm.tokenizer
    flat = sum(_all_blocks(dm.train_dataset), [])
    # Decoding the stream and splitting at EOS gives back the documents, in order.
    pieces = []
    start = 0
    for i, t in enumerate(flat):
        if t == dm.eos_id:
            pieces.append(tok.decode(flat[start:i]))
            start = i + 1
    assert pieces == docs[: len(pieces)]
    assert len(pieces) >= len(docs) - 1  # only the tail that fills no block is cut
    for i in range(len(dm.train_dataset)):
        sample = dm.train_dataset[i]
        block = dm.train_dataset.block(i)
        assert sample["input_ids"].dtype == torch.long and sample["input_ids"].shape == (9,)
        assert sample["input_ids"].tolist() == block[:-1].tolist()
        assert sample["labels"].tolist() == block[1:].tolist()
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (8, 9)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])


def test_validation_split_holds_whole_documents_absent_from_training(tmp_path):
    docs = _documents(40)
    dm = TextDataModule(
        path=str(_write(tmp_path, "jsonl", docs)),
        seq_len=7,
        val_fraction=0.2,
        batch_size=2,
        cache_dir=str(tmp_path / "c"),
    )
    dm.setup("fit")
    tok = dm.tokenizer

    def documents_in(tokens) -> set[str]:
        return {tok.decode(ids[:-1]) for ids in tokens["input_ids"]}

    train_docs = documents_in(dm.train_dataset.tokens)
    val_docs = documents_in(dm.val_dataset.tokens)
    assert len(val_docs) == 8 and len(train_docs) == 32
    assert train_docs | val_docs == set(docs) and not train_docs & val_docs
    val_batches = list(dm.val_dataloader())
    seen = sum((b["input_ids"].shape[0] for b in val_batches), 0)
    assert seen == dm.val_dataset.num_blocks
    # A second module with the same seed splits the same way.
    again = TextDataModule(path=dm.path, seq_len=7, val_fraction=0.2, cache_dir=str(tmp_path / "c2"))
    again.setup("fit")
    assert documents_in(again.val_dataset.tokens) == val_docs


# --------------------------------------------------------------------------------- rank sharding
def _block_ids(dm: TextDataModule) -> dict[tuple[int, ...], int]:
    ids = {tuple(b[:-1]): i for i, b in enumerate(_all_blocks(dm.train_dataset))}
    assert len(ids) == len(dm.train_dataset), "test data must give distinct blocks"
    return ids


def _epoch_of(dm: TextDataModule, epoch: int) -> list[int]:
    lookup = _block_ids(dm)
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)
    return [lookup[tuple(row)] for batch in loader for row in batch["input_ids"].tolist()]


def test_two_ranks_see_disjoint_samples_that_cover_the_epoch(tmp_path):
    path = str(_write(tmp_path, "jsonl", _documents(120)))
    ranks = []
    for rank in (0, 1):
        dm = TextDataModule(path=path, seq_len=15, batch_size=3, val_fraction=0.0, cache_dir=str(tmp_path / "c"))
        dm.prepare()  # several ranks need the cache prepared beforehand
        dm.trainer = _fake_trainer(rank, 2)
        dm.setup("fit")
        ranks.append(dm)
    n = len(ranks[0].train_dataset)
    steps = (n // 2) // 3
    seen = [_epoch_of(dm, 0) for dm in ranks]
    assert len(seen[0]) == len(seen[1]) == steps * 3
    assert not set(seen[0]) & set(seen[1])
    # Together the ranks consumed exactly the first steps*3*2 positions of epoch 0's permutation.
    order = torch.randperm(n, generator=torch.Generator().manual_seed(42)).tolist()
    assert sorted(seen[0] + seen[1]) == sorted(order[: steps * 3 * 2])
    # Every epoch reshuffles, identically on both ranks' views.
    epoch1 = [_epoch_of(dm, 1) for dm in ranks]
    assert epoch1[0] != seen[0] and not set(epoch1[0]) & set(epoch1[1])


def test_sampler_resumed_at_a_global_position_yields_exactly_the_rest_of_the_epoch():
    data = list(range(23))
    full = [list(ResumableDistributedSampler(data, num_replicas=2, rank=r, seed=7, epoch=3)) for r in (0, 1)]
    consumed = 6  # three steps of one sample per rank
    rest = [
        list(ResumableDistributedSampler(data, num_replicas=2, rank=r, seed=7, epoch=3, start=consumed)) for r in (0, 1)
    ]
    assert rest[0] == full[0][3:] and rest[1] == full[1][3:]
    assert len(ResumableDistributedSampler(data, num_replicas=2, rank=0, seed=7, start=consumed)) == 11
    sampler = ResumableDistributedSampler(data, num_replicas=2, rank=0, seed=7, epoch=3, start=consumed)
    sampler.set_epoch(3)
    assert sampler.start == consumed  # same epoch: keep the position
    sampler.set_epoch(4)
    assert sampler.start == 0 and len(list(sampler)) == 11


def test_lightning_keeps_the_sampler_under_ddp_even_with_use_distributed_sampler(tmp_path):
    dm = TextDataModule(
        path=str(_write(tmp_path, "jsonl", _documents(60))),
        seq_len=15,
        batch_size=2,
        val_fraction=0.0,
        cache_dir=str(tmp_path / "c"),
    )
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", use_distributed_sampler=True, logger=False)
    dm.prepare()
    dm.trainer = _fake_trainer(1, 2)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert trainer._accelerator_connector.is_distributed
    assert not trainer._data_connector._requires_distributed_sampler(loader)
    assert loader.sampler.rank == 1 and loader.sampler.num_replicas == 2


# --------------------------------------------------------------------------- resume through Trainer
class _Recorder(L.LightningModule):
    """Records, per training step, which blocks the batch held."""

    def __init__(self, lookup: dict[tuple[int, ...], int]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.lookup = lookup
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append([self.lookup[tuple(row)] for row in batch["input_ids"].tolist()])
        return (self.weight * batch["input_ids"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


_FIT = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=False,
    num_sanity_val_steps=0,
)
_EPOCHS = 2


def _datamodule(path: str, cache: Path, num_workers: int = 0) -> TextDataModule:
    return TextDataModule(
        path=path, seq_len=15, batch_size=4, val_fraction=0.0, num_workers=num_workers, cache_dir=str(cache), seed=3
    )


@pytest.fixture(scope="module")
def resume_corpus(tmp_path_factory):
    """A corpus of 5 steps per epoch and the block order of an uninterrupted 2-epoch run."""
    tmp = tmp_path_factory.mktemp("resume")
    path = str(_write(tmp, "jsonl", _documents(11)))
    dm = _datamodule(path, tmp / "c")
    dm.setup("fit")
    assert dm._steps_per_epoch(1) == 5
    model = _Recorder(_block_ids(dm))
    L.Trainer(max_epochs=_EPOCHS, default_root_dir=tmp, enable_checkpointing=False, **_FIT).fit(model, datamodule=dm)
    return path, tmp / "c", model.lookup, model.seen


@pytest.mark.parametrize(
    ("stop_step", "accumulate", "num_workers"),
    [(3, 1, 0), (5, 1, 0), (7, 1, 0), (2, 2, 0), (6, 1, 2), (5, 1, 2)],
    ids=[
        "mid-epoch-0",
        "end-of-epoch-0",
        "mid-epoch-1",
        "grad-accumulation",
        "workers-mid-epoch",
        "workers-end-of-epoch",
    ],
)
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_mid_epoch_continues_exactly_where_training_stopped(
    tmp_path, resume_corpus, stop_step, accumulate, num_workers
):
    path, cache, lookup, uninterrupted = resume_corpus
    assert len(uninterrupted) == 5 * _EPOCHS
    assert sorted(sum(uninterrupted[:5], [])) == sorted(set(sum(uninterrupted[:5], [])))  # no repeat in an epoch
    assert uninterrupted[:5] != uninterrupted[5:]

    first = _Recorder(lookup)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=stop_step, save_top_k=-1)
    L.Trainer(
        max_epochs=_EPOCHS,
        max_steps=stop_step,
        accumulate_grad_batches=accumulate,
        callbacks=[ckpt],
        default_root_dir=tmp_path,
        **_FIT,
    ).fit(first, datamodule=_datamodule(path, cache, num_workers))
    (ckpt_path,) = tmp_path.glob(f"*step={stop_step}.ckpt")

    second = _Recorder(lookup)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(
            max_epochs=_EPOCHS,
            accumulate_grad_batches=accumulate,
            default_root_dir=tmp_path,
            enable_checkpointing=False,
            **_FIT,
        ).fit(second, datamodule=_datamodule(path, cache, num_workers), ckpt_path=str(ckpt_path))
    assert len(first.seen) == stop_step * accumulate
    assert first.seen + second.seen == uninterrupted
    assert not [w for w in caught if "not resumable" in str(w.message)]


def test_state_dict_is_empty_before_training_and_a_changed_dataset_restarts_the_epoch(tmp_path):
    path = str(_write(tmp_path, "jsonl", _documents(50)))
    dm = _datamodule(path, tmp_path / "c")
    assert dm.state_dict() == {}
    dm.setup("fit")
    steps = dm._steps_per_epoch(1)
    dm.load_state_dict({"epoch": 2, "consumed_samples": 8, "samples_per_step": 4, "num_blocks": 999, "seed": 3})
    with pytest.warns(UserWarning, match="the data changed"):
        loader = dm.train_dataloader()
    assert (loader.sampler.epoch, loader.sampler.start) == (2, 0)
    dm.load_state_dict(
        {
            "epoch": 2,
            "consumed_samples": steps * 4,
            "samples_per_step": 4,
            "num_blocks": len(dm.train_dataset),
            "seed": 3,
        }
    )
    loader = dm.train_dataloader()
    assert (loader.sampler.epoch, loader.sampler.start) == (3, 0)  # a finished epoch resumes at the next


# ------------------------------------------------------------------------------------------ caching
def test_second_run_reads_the_token_cache_instead_of_tokenising(tmp_path, monkeypatch):
    path = _write(tmp_path, "arrow", _documents(40))
    calls = []
    encode = data_mod._encode_documents

    def counting(*args, **kwargs):
        calls.append(1)
        return encode(*args, **kwargs)

    monkeypatch.setattr(data_mod, "_encode_documents", counting)
    cache = tmp_path / "cache"

    def run(**overrides) -> TextDataModule:
        dm = TextDataModule(
            **{"path": str(path), "seq_len": 7, "val_fraction": 0.1, "cache_dir": str(cache), **overrides}
        )
        dm.prepare_data()
        dm.setup("fit")
        return dm

    first = run()
    assert calls
    files = {p: p.stat().st_mtime_ns for p in (cache / "tokenized").rglob("*.arrow")}
    assert len(files) == 2  # train and val

    calls.clear()
    second = run()
    assert not calls
    assert {p: p.stat().st_mtime_ns for p in (cache / "tokenized").rglob("*.arrow")} == files
    assert _all_blocks(second.train_dataset) == _all_blocks(first.train_dataset)

    run(seq_len=11)  # packing is not cached: another seq_len reuses the tokens
    assert not calls
    run(val_fraction=0.2)  # another split is another cache
    assert calls


def test_a_read_only_data_directory_is_never_written(tmp_path):
    path = _write(tmp_path, "arrow", _documents(40))
    before = _snapshot(path)
    dm = TextDataModule(path=str(path), seq_len=7, val_fraction=0.1, cache_dir=str(tmp_path / "c"))
    dm.prepare_data()
    dm.setup("fit")
    next(iter(dm.train_dataloader()))
    assert _snapshot(path) == before


# -------------------------------------------------------------------------------------------- errors
def _file(tmp_path: Path, name: str, content: str) -> Path:
    (tmp_path / name).write_text(content)
    return tmp_path / name


def _empty_parquet(tmp_path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), out)
    return out


def _mixed_dir(tmp_path: Path) -> Path:
    out = tmp_path / "mixed"
    out.mkdir()
    (out / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    (out / "b.txt").write_text("y")
    return out


def _dict_without_train(tmp_path: Path) -> Path:
    out = tmp_path / "dict"
    ds = datasets.Dataset.from_dict({"text": _documents(5)})
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(out))
    return out


_FOUND_AFTER_TOKENISING = {"fewer-tokens-than-a-block", "fewer-blocks-than-a-step", "validation-shorter-than-a-block"}


@pytest.mark.parametrize(
    ("make", "kwargs", "error", "match"),
    [
        (lambda t: t / "nowhere.jsonl", {}, FileNotFoundError, r"'.*nowhere.jsonl' does not exist"),
        (
            lambda t: _file(t, "docs.csv", "text\nsome text\n"),
            {},
            ValueError,
            r"Cannot tell the format of '.*docs.csv'",
        ),
        (_mixed_dir, {}, ValueError, r"mixes data formats \{'json': 1, 'text': 1\}"),
        (_dict_without_train, {}, ValueError, r"splits \['validation'\] but no 'train' split"),
        (lambda t: _file(t, "e.jsonl", ""), {}, ValueError, "every data file has 0 bytes"),
        (_empty_parquet, {}, ValueError, "is empty: it has no documents"),
        (lambda t: _write(t, "jsonl", ["", "   ", "\n"]), {}, ValueError, "no document with text in column 'text'"),
        (
            lambda t: _write(t, "jsonl", ["tiny"]),
            {"val_fraction": 0.0},
            ValueError,
            r"has 3 tokens, fewer than one block of seq_len \+ 1 = 257",
        ),
        (
            lambda t: _write(t, "jsonl", _documents(5), column="body"),
            {},
            ValueError,
            r"text_column='text' is not a column of .*; its columns are \['body', 'id'\]",
        ),
        (
            lambda t: _write(t, "parquet", _documents(5), column="body"),
            {},
            ValueError,
            r"its columns are \['body', 'id'\]",
        ),
        (
            lambda t: _write(t, "arrow", _documents(5), column="body"),
            {},
            ValueError,
            r"its columns are \['body', 'id'\]",
        ),
        (
            lambda t: _write(t, "jsonl", _documents(5)),
            {"text_column": "id"},
            ValueError,
            r"Column 'id' of .* holds Value\('int64'\), not text",
        ),
        (lambda t: _write(t, "jsonl", _documents(1)), {"val_fraction": 0.5}, ValueError, "leaves no training document"),
        (
            lambda t: _write(t, "jsonl", _documents(30)),
            {"seq_len": 7, "val_fraction": 0.0, "batch_size": 1000},
            ValueError,
            r"fewer than one step needs \(batch_size 1000 x 1 ranks = 1000\)",
        ),
        (
            lambda t: _write(t, "jsonl", _documents(30)),
            {"seq_len": 200, "val_fraction": 0.04},
            ValueError,
            "validation split .* is shorter than one block",
        ),
    ],
    ids=[
        "missing-path",
        "unknown-format",
        "mixed-formats",
        "no-train-split",
        "zero-bytes",
        "no-rows",
        "blank-documents",
        "fewer-tokens-than-a-block",
        "missing-column-jsonl",
        "missing-column-parquet",
        "missing-column-arrow",
        "non-text-column",
        "no-training-document",
        "fewer-blocks-than-a-step",
        "validation-shorter-than-a-block",
    ],
)
def test_bad_data_is_refused_before_training_without_touching_the_data(tmp_path, request, make, kwargs, error, match):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    path = make(data_dir)
    before = _snapshot(data_dir)
    cache = tmp_path / "cache"
    with pytest.raises(error, match=match):
        dm = TextDataModule(path=str(path), cache_dir=str(cache), **kwargs)
        dm.prepare_data()
        dm.setup("fit")
        dm.train_dataloader()
    assert _snapshot(data_dir) == before
    # Only a shortage of tokens is found after tokenising; every other error leaves no token cache.
    tokenised = request.node.callspec.id in _FOUND_AFTER_TOKENISING
    assert (cache / "tokenized").exists() == tokenised


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("seq_len", 0, r"seq_len=0 must be an integer >= 1"),
        ("batch_size", -2, r"batch_size=-2 must be an integer >= 1"),
        ("val_fraction", 1.0, r"val_fraction=1.0 must be in \[0, 1\)"),
        ("num_workers", -1, r"num_workers=-1 must be >= 0"),
        ("max_documents", 0, r"max_documents=0 must be an integer >= 1"),
    ],
)
def test_bad_settings_are_refused_at_construction(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        TextDataModule(**{field: value})


def test_missing_tokenizer_is_refused_at_construction(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Tokenizer path '.*no-tokenizer' does not exist"):
        TextDataModule(tokenizer=str(tmp_path / "no-tokenizer"))
    (tmp_path / "not-a-tokenizer").mkdir()
    with pytest.raises(ValueError, match="Could not load a Hugging Face tokenizer from"):
        TextDataModule(tokenizer=str(tmp_path / "not-a-tokenizer"))


def test_fewer_blocks_than_ranks_times_batch_is_refused(tmp_path):
    dm = TextDataModule(
        path=str(_write(tmp_path, "jsonl", _documents(30))),
        seq_len=15,
        batch_size=4,
        val_fraction=0.0,
        cache_dir=str(tmp_path / "c"),
    )
    dm.prepare()
    dm.trainer = _fake_trainer(0, 64)
    with pytest.raises(ValueError, match=r"batch_size 4 x 64 ranks = 256"):
        dm.setup("fit")


def test_check_vocab_fits_refuses_a_tokenizer_larger_than_the_model():
    check_vocab_fits(2048, 2048)
    check_vocab_fits(2048, 32000)
    with pytest.raises(ValueError, match=r"tokenizer has 32001 tokens but the model's vocab_size is 32000"):
        check_vocab_fits(32001, 32000)


# ---------------------------------------------------------------------------------- embedded assets
def test_embedded_default_loads_tokenises_and_batches(tmp_path):
    dm = TextDataModule(cache_dir=str(tmp_path / "c"))
    assert (dm.vocab_size, dm.eos_id, dm.tokens_per_batch) == (2048, 1, 8 * 256)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_dataset.num_blocks > 1000 and dm.val_dataset.num_blocks > 8
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (8, 256) and batch["input_ids"].dtype == torch.long
    assert int(batch["input_ids"].max()) < 2048
    assert next(iter(dm.val_dataloader()))["labels"].shape == (8, 256)


def test_embedded_assets_are_small_real_text_with_a_license():
    corpus = ASSETS_DIR / "corpus.jsonl"
    records = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
    assert corpus.stat().st_size <= 2_000_000 and len(records) >= 300
    assert all(r["text"].strip() and r["source"].startswith("Lib/") for r in records)
    assert "Python Software Foundation" in (ASSETS_DIR / "PSF-LICENSE.txt").read_text()


def test_embedded_tokenizer_is_a_2048_byte_level_bpe_that_round_trips_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER)
    assert len(tok) == 2048
    assert [tok.bos_token, tok.eos_token, tok.unk_token] == ["<s>", "</s>", "<unk>"]
    assert [tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2]
    assert {p.name for p in Path(DEFAULT_TOKENIZER).iterdir()} >= {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    first = json.loads((ASSETS_DIR / "corpus.jsonl").read_text(encoding="utf-8").splitlines()[0])["text"]
    for text in (first, "Grüße, 世界! \t tabs  and  spaces .\n", "x = [1, 2]  # comment"):
        ids = tok(text, add_special_tokens=True)["input_ids"]
        assert tok.eos_token_id not in ids and tok.unk_token_id not in ids
        assert tok.decode(ids) == text
    assert len(tok(first)["input_ids"]) < len(first.encode()) / 2  # BPE merges real text, not just bytes


def _load_build_script():
    spec = importlib.util.spec_from_file_location("build_assets", ASSETS_DIR / "build_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _committed_corpus() -> list[dict[str, str]]:
    return [json.loads(line) for line in (ASSETS_DIR / "corpus.jsonl").read_text(encoding="utf-8").splitlines()]


def test_build_script_retrains_the_committed_tokenizer_byte_for_byte(tmp_path):
    build = _load_build_script()
    build.train_tokenizer([r["text"] for r in _committed_corpus()]).save(str(tmp_path / "tokenizer.json"), pretty=True)
    assert (tmp_path / "tokenizer.json").read_bytes() == (ASSETS_DIR / "tokenizer" / "tokenizer.json").read_bytes()


def test_build_script_takes_docstrings_in_source_order_and_skips_tests_and_foreign_copyright(tmp_path):
    build = _load_build_script()
    words = "one two three four five six seven eight"
    (tmp_path / "b.py").write_text(
        f'"""Module b {words}."""\nclass C:\n    """Class C {words}."""\n    def f(self):\n'
        f'        """Method f {words}."""\ndef g():\n    """Too short."""\n'
    )
    (tmp_path / "a.py").write_text(f'# Copyright 1999 Someone Else\n"""Module a {words}."""\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f'# Copyright (C) 2001 Python Software Foundation\n"""Pkg m {words}."""\n')
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text(f'"""Test t {words}."""\n')
    records = build.build_corpus(tmp_path)
    assert records == [
        {"text": f"Module b {words}.\n\nClass C {words}.\n\nMethod f {words}.", "source": "Lib/b.py"},
        {"text": f"Pkg m {words}.", "source": "Lib/pkg/m.py"},
    ]
    assert records == build.build_corpus(tmp_path)


def test_build_script_rebuilds_the_committed_instruction_set_byte_for_byte(tmp_path):
    """Catches an instructions.jsonl edited by hand or left stale after a change of the rule in build_assets.py."""
    build = _load_build_script()
    build.write_jsonl(tmp_path / "instructions.jsonl", build.build_instructions(_committed_corpus()))
    committed = (ASSETS_DIR / "instructions.jsonl").read_bytes()
    assert (tmp_path / "instructions.jsonl").read_bytes() == committed
    assert "instructions.jsonl" in build.OUTPUTS  # so build_assets.py --check compares it too


def test_committed_instructions_are_short_trainable_samples_of_both_formats():
    """Catches an instruction set SFTDataModule would refuse, one mostly longer than the tiny recipe's 256-token rows,
    or one that no longer exercises instruction samples (with and without input) and chats (system, two turns)."""
    from recipes.decoder.sft_data import to_messages, tokenize_conversation

    tok = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER)
    path = ASSETS_DIR / "instructions.jsonl"
    samples = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert 1000 <= len(samples) <= 3000 and path.stat().st_size <= 600_000
    lengths = []
    for sample in samples:
        ids, mask = tokenize_conversation(tok, to_messages(sample))
        assert sum(mask) > 0 and tok.unk_token_id not in ids
        lengths.append(len(ids))
    assert sum(n <= 256 for n in lengths) >= 0.95 * len(samples)
    chats = [s["messages"] for s in samples if "messages" in s]
    instructions = [s for s in samples if "instruction" in s]
    assert any(m[0]["role"] == "system" for m in chats) and any(m[0]["role"] == "user" for m in chats)
    assert any(sum(t["role"] == "assistant" for t in m) >= 2 for m in chats)
    assert any("input" in s for s in instructions) and any("input" not in s for s in instructions)


def test_build_script_turns_hand_made_records_into_exactly_the_instructions_of_its_rule(monkeypatch):
    """Catches a change of the instruction rule: which paragraphs count as prose, where sentences end (not after
    "e.g."), the cut at SHOWN_CHARS, the ANSWER_CHARS limit, the per-module cap, repeated inputs left out, the system
    message on every second module, and the module and file names."""
    build = _load_build_script()
    monkeypatch.setattr(build, "SHOWN_CHARS", 60)
    monkeypatch.setattr(build, "ANSWER_CHARS", 45)
    records = [
        {
            "source": "Lib/nothing.py",
            "text": "lower-case start is not taken as prose here.\n\n"
            "    Indented code is never taken as prose here either.\n\n"
            "Steps to follow, in order:\n- heat the pan well.\n- add the spam.\n\n"
            "Or the other way round:\n* add the spam.\n* heat the pan well.",
        },
        {
            "source": "Lib/pkg/__init__.py",
            "text": "Tools for frying spam in a pan. Spam is best served hot, e.g. With eggs.\n\n"
            "Fry it so:\n>>> fry('spam')\nFried spam is ready.\n\nThe pan must be hot before the\nspam goes in.",
        },
        {
            "source": "Lib/pkg/eggs.py",
            "text": "The pan must be hot before the spam goes in.\n\nEggs are laid by hens. Hens live on farms.\n\n"
            "Boil the eggs for nine minutes. Then cool them. Then peel them.\n\n"
            "Serve the eggs with spam and toast on a plate. Pour a large mug of strong black tea to go with it.\n\n"
            "Never serve eggs that smell of sulphur or worse.",
        },
        {"source": "Lib/toast.py", "text": "Toast is bread that has been browned on both sides by heat. Butter it."},
    ]
    which, go_on = build.ASK_MODULE, build.ASK_CONTINUE
    toast = "Toast is bread that has been browned on both sides by heat."

    def chat(module: str, first: str, source: str) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": f"Give the first sentence of the documentation of module {module}."},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "Which file of the standard library defines that module?"},
            {"role": "assistant", "content": source},
        ]

    assert build.build_instructions(records) == [
        {"messages": [{"role": "system", "content": build.SYSTEM_PROMPT}]
         + chat("pkg", "Tools for frying spam in a pan.", "Lib/pkg/__init__.py")},
        {"instruction": "Which module does the standard-library file Lib/pkg/__init__.py define? Give its import name.",
         "output": "pkg"},
        {"instruction": which, "input": "Tools for frying spam in a pan.", "output": "pkg"},
        {"instruction": which, "input": "The pan must be hot before the spam goes in.", "output": "pkg"},
        {"instruction": go_on, "input": "Tools for frying spam in a pan.",
         "output": "Spam is best served hot, e.g. With eggs."},
        {"messages": chat("pkg.eggs", "The pan must be hot before the spam goes in.", "Lib/pkg/eggs.py")},
        {"instruction": "Which module does the standard-library file Lib/pkg/eggs.py define? Give its import name.",
         "output": "pkg.eggs"},
        # Its first paragraph was pkg's input already; its last one is past PARAGRAPHS_PER_TASK (3).
        {"instruction": which, "input": "Eggs are laid by hens. Hens live on farms.", "output": "pkg.eggs"},
        {"instruction": which, "input": "Boil the eggs for nine minutes. Then cool them.", "output": "pkg.eggs"},
        {"instruction": which, "input": "Serve the eggs with spam and toast on a plate.", "output": "pkg.eggs"},
        {"instruction": go_on, "input": "Eggs are laid by hens.", "output": "Hens live on farms."},
        {"instruction": go_on, "input": "Boil the eggs for nine minutes. Then cool them.", "output": "Then peel them."},
        # Its first sentence is longer than ANSWER_CHARS: no chat.
        {"instruction": "Which module does the standard-library file Lib/toast.py define? Give its import name.",
         "output": "toast"},
        {"instruction": which, "input": toast, "output": "toast"},
        {"instruction": go_on, "input": toast, "output": "Butter it."},
    ]


def test_parallel_tokenisation_gives_the_same_blocks(tmp_path):
    path = str(_write(tmp_path, "jsonl", _documents(40)))
    blocks = []
    for procs in (None, 2):
        dm = TextDataModule(
            path=path, seq_len=7, val_fraction=0.0, cache_dir=str(tmp_path / f"c{procs}"), tokenize_num_proc=procs
        )
        dm.prepare_data()
        dm.setup("fit")
        blocks.append(_all_blocks(dm.train_dataset))
    assert blocks[0] == blocks[1]
    assert len(list((tmp_path / "c2" / "tokenized").rglob("train_*_of_00002.arrow"))) == 2
