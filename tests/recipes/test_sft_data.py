"""SFT data (recipes/decoder/sft_data.py): formatting, assistant-only labels, packing, overlong samples, bad samples,
resume and sharding, with the embedded real tokenizer (LLaMA-2 format) and a saved copy of it with a chat template."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from recipes.decoder.data import DEFAULT_TOKENIZER
from recipes.decoder.sft_data import IGNORE_INDEX, BadSampleError, SFTDataModule, collate_packed, tokenize_conversation
from recipes.decoder.tokenizer import load_tokenizer

# A small template in the style of the common ones: role headers, the assistant's EOS ending its turn, BOS first.
_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _chat(i: int, turns: int = 1, system: bool = False, words: int = 1) -> dict:
    messages = [{"role": "system", "content": "Answer in one line."}] if system else []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {i}.{t}: what does item {i} return?"})
        messages.append({"role": "assistant", "content": " ".join([f"It returns value {i}.{t}."] * words)})
    return {"messages": messages}


def _instruction(i: int) -> dict:
    record = {"instruction": f"Explain function {i}.", "output": f"Function {i} adds one."}
    if i % 2:
        record["input"] = f"def f{i}(x): return x + 1"
    return record


def _samples(n: int) -> list[dict]:
    return [_chat(i, turns=1 + i % 2, system=i % 3 == 0) if i % 4 else _instruction(i) for i in range(n)]


def _write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _module(path: str, tmp_path: Path, **kwargs) -> SFTDataModule:
    kwargs.setdefault("seq_len", 128)
    kwargs.setdefault("batch_size", 2)
    return SFTDataModule(path, cache_dir=str(tmp_path / "cache"), **kwargs)


def _ready(path: str, tmp_path: Path, **kwargs) -> SFTDataModule:
    dm = _module(path, tmp_path, **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _trainer(rank: int, world: int, batches_done: int = 0) -> SimpleNamespace:
    progress = SimpleNamespace(current=SimpleNamespace(processed=batches_done))
    return SimpleNamespace(
        global_rank=rank, world_size=world, distributed_sampler_kwargs={"num_replicas": world, "rank": rank},
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress))
    )


def _assistant_spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    spans: list[list[int]] = []
    for i, (token, m) in enumerate(zip(ids, mask)):
        if m:
            if i == 0 or not mask[i - 1]:
                spans.append([])
            spans[-1].append(token)
    return spans


def _template_tokenizer(tmp_path: Path, template: str = _TEMPLATE) -> str:
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER)
    tokenizer.chat_template = template
    out = tmp_path / "tokenizer_with_template"
    tokenizer.save_pretrained(str(out))
    return str(out)


def test_llama2_format_is_metas_and_labels_exactly_the_assistant_texts_with_their_eos():
    """Catches a wrong LLaMA-2 layout (system text, [INST] markers, BOS/EOS per pair), a mask that covers the prompt
    or misses the answer's EOS, and turn-wise tokens that differ from tokenising the whole text."""
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER)
    messages = _chat(7, turns=2, system=True)["messages"]
    ids, mask = tokenize_conversation(tokenizer, messages)
    system, (u1, a1, u2, a2) = messages[0]["content"], [m["content"] for m in messages[1:]]
    expected = (
        f"<s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{u1} [/INST] {a1} </s>"
        f"<s>[INST] {u2} [/INST] {a2} </s>"
    )
    assert tokenizer.decode(ids) == expected
    assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    spans = _assistant_spans(ids, mask)
    assert [tokenizer.decode(span) for span in spans] == [f" {a1} </s>", f" {a2} </s>"]
    assert sum(mask) == sum(len(span) for span in spans)


def test_instruction_samples_become_one_user_turn_with_the_input_after_a_blank_line(tmp_path):
    """Catches a dropped or misplaced ``input`` and labels on the instruction instead of the output."""
    path = _write_jsonl(tmp_path / "s.jsonl", [_instruction(1), _instruction(2)])
    dm = _ready(path, tmp_path, seq_len=256, batch_size=1)
    row = dm.train_dataset[0]
    text = dm.tokenizer.decode(row["input_ids"][: int(row["cu_seqlens"][1])])
    assert text == "<s>[INST] Explain function 1.\n\ndef f1(x): return x + 1 [/INST] Function 1 adds one. </s>"
    labels = row["labels"][row["labels"] != IGNORE_INDEX]
    assert dm.tokenizer.decode(labels) == " Function 1 adds one. </s> Function 2 adds one. </s>"


def test_chat_template_formats_the_samples_and_only_its_assistant_turns_are_labelled(tmp_path):
    """Catches ignoring the tokenizer's template, labelling its role headers, losing the template's BOS, and
    template pieces whose tokens differ from tokenising the rendered text whole."""
    tokenizer_dir = _template_tokenizer(tmp_path)
    sample = _chat(3, turns=2, system=True)
    path = _write_jsonl(tmp_path / "s.jsonl", [sample])
    dm = _ready(path, tmp_path, tokenizer=tokenizer_dir, seq_len=256, batch_size=1)
    rendered = dm.tokenizer.apply_chat_template(sample["messages"], tokenize=False)
    row = dm.train_dataset[0]
    length = int(row["cu_seqlens"][1])
    ids = row["input_ids"][:length].tolist()
    assert ids[0] == dm.tokenizer.bos_token_id
    assert ids == dm.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    answers = [m["content"] for m in sample["messages"] if m["role"] == "assistant"]
    labels = row["labels"][row["labels"] != IGNORE_INDEX]
    assert dm.tokenizer.decode(labels) == "".join(f"{a}</s>" for a in answers)


_LLAMA2_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)
_TWO_EXCHANGES = [{"role": "user", "content": "What does the module return?"},
                  {"role": "assistant", "content": "It returns a value."},
                  {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Nothing else."}]


def _sentencepiece_style_tokenizer(chat_template=None):
    """A tokenizer laid out as Llama-2-7b-hf's tokenizer.json: BPE with byte fallback behind a normalizer that
    prepends "▁" to every text it is given (SentencePiece's dummy prefix) and turns spaces into "▁"."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = Path(DEFAULT_TOKENIZER).parent / "corpus.jsonl"
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()[:40]]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
                                                             show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = chat_template
    return fast


@pytest.mark.slow
def test_the_llama2_format_on_a_sentencepiece_style_tokenizer_gives_metas_tokens():
    """Catches each piece tokenised on its own: a SentencePiece-style tokenizer then adds a "▁" before every answer
    (trained on), where Meta's reference encodes each user/assistant pair as one text between BOS and EOS."""
    tokenizer = _sentencepiece_style_tokenizer()
    ids, mask = tokenize_conversation(tokenizer, _TWO_EXCHANGES)
    pairs = [("What does the module return?", "It returns a value."), ("And then?", "Nothing else.")]
    expected = []
    for user, answer in pairs:
        text = tokenizer(f"[INST] {user} [/INST] {answer} ", add_special_tokens=False)["input_ids"]
        expected += [tokenizer.bos_token_id, *text, tokenizer.eos_token_id]
    assert ids == expected
    spans = _assistant_spans(ids, mask)
    assert [tokenizer.decode(span) for span in spans] == ["It returns a value. </s>", "Nothing else. </s>"]


@pytest.mark.slow
def test_a_template_on_a_sentencepiece_style_tokenizer_gives_the_tokens_of_the_whole_rendered_text():
    """Catches template pieces tokenised one by one: a SentencePiece-style tokenizer prepends "▁" to every text it is
    given, so those tokens differ from what apply_chat_template(tokenize=True) and inference see; and labels that
    miss or overrun the answers."""
    tokenizer = _sentencepiece_style_tokenizer(_LLAMA2_CHAT_TEMPLATE)
    ids, mask = tokenize_conversation(tokenizer, _TWO_EXCHANGES)
    rendered = tokenizer.apply_chat_template(_TWO_EXCHANGES, tokenize=False)
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    spans = _assistant_spans(ids, mask)
    assert [tokenizer.decode(span) for span in spans] == ["It returns a value. </s>", "Nothing else. </s>"]


def test_a_chat_template_that_does_not_emit_bos_is_refused(tmp_path):
    """Catches a template whose text lacks BOS being trained on silently (apply_chat_template adds no special
    tokens)."""
    tokenizer_dir = _template_tokenizer(tmp_path, _TEMPLATE.replace("{{ bos_token }}", ""))
    path = _write_jsonl(tmp_path / "s.jsonl", [_chat(1)])
    with pytest.raises(ValueError, match=r"begin the template with \{\{ bos_token \}\}"):
        _module(path, tmp_path, tokenizer=tokenizer_dir).prepare_data()


def test_packing_keeps_samples_whole_in_order_with_restarting_positions_and_matching_cu_seqlens(tmp_path):
    """Catches a sample split across rows, a non-greedy or reordered pack, positions that do not restart, cu_seqlens
    off the sample boundaries, a label that reaches into the next sample or the padding, and a collate that does
    not offset the rows' cu_seqlens."""
    path = _write_jsonl(tmp_path / "s.jsonl", _samples(40))
    dm = _ready(path, tmp_path, seq_len=160)
    train = dm.train_dataset
    tokens = train.tokens
    seen: list[int] = []
    for r in range(len(train)):
        row, samples = train[r], train.samples_of_row(r)
        cu = row["cu_seqlens"].tolist()
        assert row["cu_seqlens"].dtype == torch.int32 and cu[0] == 0 and cu[-1] == dm.seq_len
        lengths = [len(tokens[s]["input_ids"]) for s in samples]
        used = sum(lengths)
        assert cu[: len(samples) + 1] == [sum(lengths[:k]) for k in range(len(samples) + 1)]
        assert len(cu) == len(samples) + 1 + (used < dm.seq_len)
        if r + 1 < len(train):  # greedy: the next row's first sample did not fit here
            assert used + len(tokens[train.samples_of_row(r + 1)[0]]["input_ids"]) > dm.seq_len
        for s, begin, end in zip(samples, cu, cu[1:]):
            ids, mask = tokens[s]["input_ids"], tokens[s]["assistant_mask"]
            assert row["input_ids"][begin:end].tolist() == ids.tolist()
            assert row["position_ids"][begin:end].tolist() == list(range(end - begin))
            expected = [int(ids[i + 1]) if mask[i + 1] else IGNORE_INDEX for i in range(end - begin - 1)]
            assert row["labels"][begin:end].tolist() == expected + [IGNORE_INDEX]
        assert row["labels"][used:].eq(IGNORE_INDEX).all()
        assert row["position_ids"][used:].tolist() == list(range(dm.seq_len - used))
        seen += samples
    assert seen == list(range(len(tokens)))

    batch = collate_packed([train[0], train[1]])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (2, dm.seq_len)
    second = (train[1]["cu_seqlens"][1:] + dm.seq_len).tolist()
    assert batch["cu_seqlens"] == train[0]["cu_seqlens"].tolist() + second


@pytest.mark.parametrize(("overlong", "truncated", "dropped"), [("truncate", 2, 1), ("drop", 0, 3)])
def test_overlong_samples_are_truncated_or_dropped_and_counted_in_the_log(tmp_path, caplog, overlong, truncated,
                                                                          dropped):
    """Catches overlong samples kept whole (rows longer than seq_len), the wrong mode applied, a truncated sample
    kept with no assistant token left, and counts missing from the log."""
    long_answer = _chat(1, words=40)
    long_prompt = {"messages": [{"role": "user", "content": "why " * 200}, {"role": "assistant", "content": "ok"}]}
    records = [_chat(0), long_answer, _chat(2), long_prompt, _chat(4, words=30)]
    path = _write_jsonl(tmp_path / "s.jsonl", records)
    with caplog.at_level(logging.INFO):
        dm = _ready(path, tmp_path, seq_len=96, batch_size=1, overlong=overlong)
    train = dm.train_dataset
    assert (train.num_truncated, train.num_dropped) == (truncated, dropped)
    assert f"{truncated} truncated, {dropped} dropped" in caplog.text
    kept = [s for r in range(len(train)) for s in train.samples_of_row(r)]
    assert kept == ([0, 1, 2, 4] if overlong == "truncate" else [0, 2])
    for r in range(len(train)):
        row = train[r]
        assert row["cu_seqlens"][-1] == 96 and (row["labels"] != IGNORE_INDEX).any()


_BAD = {
    "no-assistant": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    "unknown-role": ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
                     "role 'tool'"),
    "empty-content": ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}]},
                      "empty content"),
    "wrong-type": ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
                   "type int"),
    "missing-output": ({"instruction": "do it"}, "'output' is missing"),
    "ends-with-user": ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                     {"role": "user", "content": "c"}]}, "ends with a user turn"),
}


@pytest.mark.parametrize("kind", sorted(_BAD))
def test_a_bad_jsonl_sample_fails_in_prepare_data_naming_the_file_and_line(tmp_path, kind):
    """Catches bad samples reaching tokenisation or training, and errors that do not say where the sample is."""
    record, reason = _BAD[kind]
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(_chat(0)) + "\n\n" + json.dumps(record) + "\n" + json.dumps(_chat(1)) + "\n")
    dm = _module(str(path), tmp_path)
    with pytest.raises(BadSampleError, match=rf"line 3 of {path}: .*{reason}"):
        dm.prepare_data()
    assert not dm.is_prepared()


@pytest.mark.parametrize("fmt", ["parquet", "save_to_disk", "json-list"])
def test_a_bad_sample_in_parquet_save_to_disk_or_a_json_list_is_named_by_its_row(tmp_path, fmt):
    """Catches a row (or list item) index that is off or missing for the formats without lines per sample."""
    import datasets

    records = [_instruction(0), _instruction(1), {"instruction": "x", "output": ""}]
    table = datasets.Dataset.from_list(records)
    where = tmp_path / {"parquet": "s.parquet", "save_to_disk": "saved", "json-list": "s.json"}[fmt]
    if fmt == "json-list":
        where.write_text(json.dumps(records, indent=1))
    else:
        table.to_parquet(str(where)) if fmt == "parquet" else table.save_to_disk(str(where))
    unit = "item" if fmt == "json-list" else "row"
    with pytest.raises(BadSampleError, match=rf"{unit} 2 of {where}: 'output' is empty"):
        _module(str(where), tmp_path).prepare_data()


def test_resume_mid_epoch_yields_exactly_the_remaining_rows_on_every_rank(tmp_path):
    """Catches a resume that restarts the epoch, skips or repeats rows, or ignores the saved position on a rank."""
    path = _write_jsonl(tmp_path / "s.jsonl", _samples(80))
    world, stop = 2, 2
    for rank in range(world):
        full = _module(path, tmp_path, seq_len=96)
        full.prepare()  # what `train.py prepare` does before a multi-rank run
        full.trainer = _trainer(rank, world)
        full.setup("fit")
        epoch = [b["input_ids"] for b in full.train_dataloader()]
        assert len(epoch) > stop + 1

        full.trainer = _trainer(rank, world, batches_done=stop)
        state = full.state_dict()
        resumed = _module(path, tmp_path, seq_len=96)
        resumed.trainer = _trainer(rank, world)
        resumed.setup("fit")
        resumed.load_state_dict(state)
        rest = [b["input_ids"] for b in resumed.train_dataloader()]
        assert len(rest) == len(epoch) - stop
        assert all(torch.equal(a, b) for a, b in zip(rest, epoch[stop:]))


def test_two_ranks_get_disjoint_rows_that_cover_the_epoch(tmp_path):
    """Catches ranks that share rows or leave rows unseen (beyond the tail that does not divide evenly)."""
    path = _write_jsonl(tmp_path / "s.jsonl", _samples(60))
    per_rank = []
    for rank in range(2):
        dm = _ready(path, tmp_path, seq_len=96, batch_size=1)
        dm.trainer = _trainer(rank, 2)
        loader = dm.train_dataloader()
        per_rank.append([index for index in loader.sampler])
        assert len(list(loader)) == len(per_rank[-1])
    rows = len(dm.train_dataset)
    assert not set(per_rank[0]) & set(per_rank[1])
    assert len(per_rank[0]) == len(per_rank[1]) == rows // 2
    assert len(set(per_rank[0]) | set(per_rank[1])) == rows - rows % 2


def test_bad_settings_are_refused_at_construction(tmp_path):
    """Catches an unknown overlong mode or plain text accepted as SFT data."""
    path = _write_jsonl(tmp_path / "s.jsonl", [_chat(0)])
    with pytest.raises(ValueError, match="overlong='cut' is not one of"):
        _module(path, tmp_path, overlong="cut")
    text = tmp_path / "t.txt"
    text.write_text("just text\n")
    with pytest.raises(ValueError, match="is plain text"):
        _module(str(text), tmp_path)


# ChatML in the form of Qwen2.5's template (no tools): a default system turn when the conversation has none, each
# turn `<|im_start|>{role}\n{content}<|im_end|>\n`, no BOS.
_CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _qwen_style_tokenizer(tmp_path: Path) -> str:
    """A tokenizer laid out as Qwen2.5-Instruct's tokenizer.json, saved to a directory: byte-level BPE, the special
    tokens <|endoftext|> (padding), <|im_start|> and <|im_end|> (EOS), no BOS, and the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = Path(DEFAULT_TOKENIZER).parent / "corpus.jsonl"
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()[:40]]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = _CHATML_TEMPLATE
    fast.save_pretrained(str(tmp_path / "qwen_tokenizer"))
    return str(tmp_path / "qwen_tokenizer")


@pytest.mark.parametrize("system", [True, False], ids=["system", "default_system"])
def test_qwen_chatml_labels_exactly_each_assistant_content_its_im_end_and_the_newline_after_it(tmp_path, system):
    """With a Qwen-style tokenizer (ChatML template, no BOS): the row is apply_chat_template's tokens, and the
    tokens carrying loss are exactly each assistant turn's content, its <|im_end|> and the newline the template
    writes after it (as LLaMA-Factory's qwen template labels a response); no system (given or the template's
    default), user or `<|im_start|>assistant\\n` header token, nor the padding."""
    tokenizer_dir = _qwen_style_tokenizer(tmp_path)
    sample = _chat(5, turns=2, system=system)
    path = _write_jsonl(tmp_path / "s.jsonl", [sample])
    dm = _ready(path, tmp_path, tokenizer=tokenizer_dir, seq_len=256, batch_size=1)
    tokenizer = dm.tokenizer
    assert tokenizer.bos_token_id is None and tokenizer.eos_token == "<|im_end|>"
    row = dm.train_dataset[0]
    length = int(row["cu_seqlens"][1])
    ids = row["input_ids"][:length].tolist()
    assert ids == tokenizer.apply_chat_template(sample["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert length < 256 and (row["input_ids"][length:] == tokenizer.pad_token_id).all()

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    system_text = sample["messages"][0]["content"] if system else "You are a helpful assistant."
    turns = [m for m in sample["messages"] if m["role"] != "system"]
    expected_ids = [im_start, *encode(f"system\n{system_text}"), im_end, *encode("\n")]
    expected_loss = [0] * len(expected_ids)
    for message in turns:
        header = [im_start, *encode(f"{message['role']}\n")]
        body = [*encode(message["content"]), im_end, *encode("\n")]
        expected_ids += header + body
        expected_loss += [0] * len(header) + [int(message["role"] == "assistant")] * len(body)
    assert ids == expected_ids
    # labels[i] is token i + 1 where that token carries loss, else -100.
    expected_labels = [token if loss else IGNORE_INDEX for token, loss in zip(expected_ids[1:], expected_loss[1:])]
    assert row["labels"][:length].tolist() == expected_labels + [IGNORE_INDEX]
    assert (row["labels"][length:] == IGNORE_INDEX).all()
    answers = [m["content"] for m in turns if m["role"] == "assistant"]
    assert tokenizer.decode(row["labels"][row["labels"] != IGNORE_INDEX]) == "".join(
        f"{a}<|im_end|>\n" for a in answers)
