"""Generation: cached decoding equals uncached, sampling filters hold, seeds reproduce, the script runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.decoder import checkpoint_layout, hf_checkpoint
from recipes.models.llama.config import LLaMAConfig
from recipes.generate import generate, main, sample_next_token
from recipes.models.llama.model import LLaMA
from tests.recipes.models.test_llama import small_config
from tests.helpers import REPO

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]  # 64 ids


def config(**overrides) -> LLaMAConfig:
    return small_config(**{"vocab_size": 64, "max_seq_len": 48, **overrides})


def random_model(cfg: LLaMAConfig, seed: int = 0) -> LLaMA:
    torch.manual_seed(seed)
    model = LLaMA(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)  # wide weights: peaked, varied logits, so greedy paths are not trivial
    return model.eval()


def prompt(batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level HF tokenizer over WORDS (ids equal to list positions), BOS prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.WordPiece()
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        directory
    )
    return directory


def test_cached_greedy_decoding_gives_the_same_tokens_as_uncached():
    model = random_model(config())
    cached = generate(model, prompt(), 20, temperature=0.0, use_cache=True)
    uncached = generate(model, prompt(), 20, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 25)
    assert torch.equal(cached[:, :5], prompt())
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, 5:].tolist())) > 1  # not one token repeated: the test can tell paths apart


def test_cached_step_logits_match_full_recompute():
    model = random_model(config())
    tokens = generate(model, prompt(), 12, temperature=0.0)
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2)
        steps = [model(tokens[:, :5], cache=cache)]
        steps += [model(tokens[:, p : p + 1], cache=cache, start_pos=p) for p in range(5, tokens.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_greedy_is_argmax_and_ignores_filters():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next_token(logits, temperature=0.0, top_k=3, top_p=0.1), logits.argmax(-1))


def test_top_k_sampling_never_leaves_the_top_k():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    allowed = logits.topk(4, dim=-1).indices
    generator = torch.Generator().manual_seed(0)
    seen = [set() for _ in range(3)]
    for _ in range(300):
        ids = sample_next_token(logits, temperature=2.0, top_k=4, generator=generator)
        for row, token in enumerate(ids.tolist()):
            assert token in allowed[row].tolist()
            seen[row].add(token)
    # A high temperature flattens the distribution: every allowed token turns up, nothing else.
    assert all(len(s) == 4 for s in seen)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([[0.50, 0.30, 0.15, 0.05]]).log()
    generator = torch.Generator().manual_seed(0)
    draws = {sample_next_token(logits, temperature=1.0, top_p=0.7, generator=generator).item() for _ in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7 stops there
    draws = {sample_next_token(logits, temperature=1.0, top_p=0.5, generator=generator).item() for _ in range(50)}
    assert draws == {0}


def test_seed_makes_sampling_reproducible():
    model = random_model(config())

    def sample(seed: int) -> torch.Tensor:
        return generate(
            model, prompt(), 15, temperature=1.5, top_k=20, top_p=0.95, generator=torch.Generator().manual_seed(seed)
        )

    assert torch.equal(sample(1), sample(1))
    assert not torch.equal(sample(1), sample(2))


def test_sampled_cached_and_uncached_decoding_agree_under_one_seed():
    model = random_model(config())
    kwargs = dict(temperature=1.0, top_k=10)
    cached = generate(model, prompt(), 10, generator=torch.Generator().manual_seed(3), use_cache=True, **kwargs)
    uncached = generate(model, prompt(), 10, generator=torch.Generator().manual_seed(3), use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def test_generation_stops_at_eos_and_pads_finished_rows():
    model = random_model(config())
    free = generate(model, prompt(), 10, temperature=0.0)
    eos = int(free[0, 7])  # the third token row 0 generates
    out = generate(model, prompt(), 10, temperature=0.0, eos_id=eos)
    row0 = out[0, 5:].tolist()
    first = row0.index(eos)
    assert first <= 2 and all(t == eos for t in row0[first:])
    assert out.shape[1] <= 15


def test_one_dimensional_prompt_gives_one_dimensional_output():
    model = random_model(config())
    out = generate(model, prompt(1)[0], 4)
    assert out.shape == (9,)


def test_too_long_requests_and_bad_sampling_settings_are_errors():
    model = random_model(config(max_seq_len=12))
    with pytest.raises(
        ValueError,
        match=r"5 tokens \+ max_new_tokens=8 = 13 exceeds the model's max_seq_len=12; "
        r"lower max_new_tokens to at most 7",
    ):
        generate(model, prompt(), 8)
    with pytest.raises(ValueError, match=r"temperature=-1"):
        generate(model, prompt(), 2, temperature=-1)
    with pytest.raises(ValueError, match=r"top_k=0"):
        generate(model, prompt(), 2, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match=r"top_p=1.5"):
        generate(model, prompt(), 2, temperature=1.0, top_p=1.5)


def test_script_generates_from_recipe_file_sharded_dir_and_hf_dir(tmp_path, tokenizer_dir, capsys):
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save

    cfg = config()
    model = random_model(cfg)
    checkpoint_layout.save_recipe_checkpoint(tmp_path / "r.ckpt", cfg, model.state_dict(), tokenizer_path=tokenizer_dir)
    args = ["--prompt", "w1 w2 w3", "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu"]
    assert main([str(tmp_path / "r.ckpt"), *args]) == 0
    text = capsys.readouterr().out.strip()
    # Greedy: exactly what generate() gives for the tokenised prompt.
    expected = generate(model, torch.tensor([1, 4, 5, 6]), 6, temperature=0.0, eos_id=2)
    assert text == " ".join(WORDS[i] for i in expected.tolist() if i > 2)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    checkpoint = checkpoint_layout.make_recipe_checkpoint(cfg, model.state_dict(), tokenizer_path=tokenizer_dir)
    with pytest.warns(UserWarning, match="single process"):
        _distributed_checkpoint_save({"state_dict": checkpoint.pop("state_dict")}, sharded)
    torch.save(checkpoint, sharded / checkpoint_layout.LIGHTNING_METADATA_FILE)
    assert main([str(sharded), *args]) == 0
    assert capsys.readouterr().out.strip() == text

    hf_checkpoint.convert_recipe_to_hf(tmp_path / "r.ckpt", tmp_path / "hf")  # tokenizer travels along
    assert main([str(tmp_path / "hf"), *args]) == 0
    assert capsys.readouterr().out.strip() == text


def test_script_explains_missing_checkpoint_and_tokenizer(tmp_path, capsys):
    assert main([str(tmp_path / "nope.ckpt"), "--prompt", "w1", "--device", "cpu"]) == 1
    assert "nope.ckpt' does not exist" in capsys.readouterr().err
    cfg = config()
    checkpoint_layout.save_recipe_checkpoint(tmp_path / "r.ckpt", cfg, random_model(cfg).state_dict())
    assert main([str(tmp_path / "r.ckpt"), "--prompt", "w1", "--device", "cpu"]) == 1
    assert "records no tokenizer; pass --tokenizer DIR" in capsys.readouterr().err


def test_script_checks_the_tokenizer_like_the_data_module(tmp_path, capsys):
    """generate.py loads its tokenizer through the recipe's one loader: a directory without a tokenizer is refused
    with the data module's message (a copy of the loader without its checks would pass transformers' error on)."""
    cfg = config()
    checkpoint_layout.save_recipe_checkpoint(tmp_path / "r.ckpt", cfg, random_model(cfg).state_dict())
    (tmp_path / "empty").mkdir()
    args = ["--prompt", "w1", "--device", "cpu", "--tokenizer", str(tmp_path / "empty")]
    assert main([str(tmp_path / "r.ckpt"), *args]) == 1
    assert "Could not load a Hugging Face tokenizer from" in capsys.readouterr().err


def test_relative_tokenizer_path_resolves_from_the_repository_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    metadata = {"hyper_parameters": {"config": "tiny"}, "datamodule_hyper_parameters": {"tokenizer_path": "recipes"}}
    assert checkpoint_layout.tokenizer_from_metadata(metadata) == str(REPO / "recipes")
    assert checkpoint_layout.tokenizer_from_metadata({"hyper_parameters": {"tokenizer": "elsewhere"}}) == "elsewhere"
    assert checkpoint_layout.tokenizer_from_metadata({"hyper_parameters": {}}) is None


@pytest.mark.slow
def test_generate_runs_as_a_script(tmp_path, tokenizer_dir):
    cfg = config()
    checkpoint_layout.save_recipe_checkpoint(tmp_path / "r.ckpt", cfg, random_model(cfg).state_dict())
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes/generate.py"),
            str(tmp_path / "r.ckpt"),
            "--tokenizer",
            str(tokenizer_dir),
            "--prompt",
            "w5 w6",
            "--max-new-tokens",
            "5",
            "--seed",
            "3",
            "--top-k",
            "5",
            "--device",
            "cpu",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:2] == ["w5", "w6"] and 2 <= len(words) <= 7
    assert "tokens/s on cpu" in result.stderr
