"""The LLaMA-3 family in the recipe: presets, the llama3 rotary scaling, tied embeddings, Hugging Face import and
export with logits parity against transformers' LlamaForCausalLM (no downloads), and the planner's profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from recipes import convert
from recipes.decoder import hf_checkpoint
from recipes.models.llama import memory_profile
from recipes.decoder.checkpoint_layout import CheckpointError, load_recipe_checkpoint
from recipes.models.llama.config import LLAMA3_PRESETS, PRESETS, LLaMAConfig
from recipes.decoder.data import check_vocab_fits
from recipes.decoder.rotary import rotary_cos_sin, rotary_frequencies
from recipes.models.llama.model import LLaMA

VOCAB, SEQ = 97, 64
#: A short pretraining length, so that the scaling's three bands all hold frequencies at head_dim 32 (wavelengths
#: 6.3 kept, 14.3 blended, 32.5 and up divided) and the test positions (up to SEQ) run past it.
SHORT_ORIGINAL = 32

# Parameter counts of transformers' LlamaForCausalLM at each preset's shape (counted on the meta device below).
PARAMETER_COUNTS = {
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
}

# Each family's rotary settings (the presets'), at tiny dims (head_dim 32): name -> (rope_parameters, tied, heads).
# 8B and 3.2-1B share 4 query heads per kv head, 3.2-3B 3 (24 / 8), so the 3B case has 6 heads over 2 kv heads.
LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
VARIANTS = {
    "3-8b": ({"rope_type": "default", "rope_theta": 500000.0}, False, (8, 2)),
    "3.1-8b": ({"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA31}, False, (8, 2)),
    "3.2-1b": ({"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA31, "factor": 32.0}, True, (4, 1)),
    "3.2-3b": ({"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA31, "factor": 32.0}, True, (6, 2)),
    "3.1-short-original": (
        {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA31, "original_max_position_embeddings": SHORT_ORIGINAL},
        False,
        (4, 2),
    ),
}


def hf_config(rope_parameters: dict, tied: bool, heads: tuple[int, int] = (4, 2)) -> LlamaConfig:
    """A tiny LlamaConfig, head_dim 32, ``heads`` = (query heads, kv heads)."""
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32 * heads[0], num_hidden_layers=2, num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        intermediate_size=96, max_position_embeddings=SEQ, rms_norm_eps=1e-5, rope_parameters=dict(rope_parameters),
        tie_word_embeddings=tied,
    )


def wide(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights drawn wide (std 0.2) so a wrong rotary frequency moves the logits far beyond 1e-5."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def logits_of(model) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def small_recipe_config(**overrides) -> LLaMAConfig:
    values = dict(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=96, max_seq_len=SEQ)
    values.update(overrides)
    return LLaMAConfig(**values)


# ------------------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("name", list(PARAMETER_COUNTS))
def test_presets_have_the_parameter_count_of_transformers_llama_at_their_shape(name):
    """Catches a wrong size field in a preset, a tied matrix counted twice (by num_params or by the model) and an
    HF config.json written from the preset that transformers would build differently."""
    config = LLaMAConfig.from_preset(name)
    hf = LlamaConfig(**{k: v for k, v in hf_checkpoint.hf_config_dict(config, dtype=torch.bfloat16).items()
                        if k not in ("architectures", "model_type", "torch_dtype", "dtype", "rope_scaling",
                                     "rope_theta")})
    with torch.device("meta"):
        theirs = sum(p.numel() for p in LlamaForCausalLM(hf).parameters())
        ours = sum(p.numel() for p in LLaMA(config).parameters())
    assert theirs == ours == config.num_params() == PARAMETER_COUNTS[name]
    assert (config.vocab_size, config.n_kv_heads, config.rope_theta) == (128256, 8, 500000.0)
    check_vocab_fits(128256, config.vocab_size)  # LLaMA-3's tokenizer: 128000 tokens + 256 special


def test_llama2_presets_keep_their_shape_and_llama3_presets_are_listed_in_errors():
    """Catches LLaMA-3 defaults leaking into LLaMA-2 (rope base, scaling, ties) and an unknown-preset message that
    hides the new names."""
    for name in PRESETS:
        config = LLaMAConfig.from_preset(name)
        assert (config.rope_theta, config.rope_scaling, config.tie_embeddings) == (10000.0, None, False)
    with pytest.raises(ValueError, match=r"'llama3-8b', 'llama3.1-8b', 'llama3.2-1b', 'llama3.2-3b'\] \(LLaMA-3"):
        LLaMAConfig.from_preset("llama3-70b")
    assert set(LLAMA3_PRESETS) == set(PARAMETER_COUNTS)


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ([8.0], r"rope_scaling=\[8.0\] is invalid: give a mapping"),
        ({**LLAMA31, "rope_type": "yarn"}, r"rope_type='yarn' is not implemented"),
        ({k: v for k, v in LLAMA31.items() if k != "factor"}, r"lacks \['factor'\]"),
        ({**LLAMA31, "beta": 1.0}, r"unknown key\(s\) \['beta'\]"),
        ({**LLAMA31, "original_max_position_embeddings": 8192.5}, r"original_max_position_embeddings=8192.5 is inv"),
        ({**LLAMA31, "factor": 0.5}, r"factor=0.5 is invalid: .* must be >= 1"),
        ({**LLAMA31, "high_freq_factor": 1.0}, r"high_freq_factor=1.0 must exceed low_freq_factor=1.0"),
    ],
)
def test_bad_rope_scaling_names_the_entry_and_the_fix(scaling, message):
    """Catches a scaling the model would compute wrongly (a division by high - low = 0, a shrinking factor, an
    unimplemented type) being accepted."""
    with pytest.raises(ValueError, match=message):
        small_recipe_config(rope_scaling=scaling)


def test_rope_scaling_is_stored_normalised_so_yaml_and_config_json_values_compare_equal():
    """Catches a preset that differs from the config read from a checkpoint only in int vs float, which makes
    init_from refuse matching weights."""
    from_yaml = small_recipe_config(rope_scaling={"factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
                                                  "original_max_position_embeddings": 8192})
    assert from_yaml == small_recipe_config(rope_scaling={**LLAMA31, "rope_type": "llama3"})
    assert LLaMAConfig.from_dict(from_yaml.to_dict()) == from_yaml


# ------------------------------------------------------------------------------------------------ rotary


def test_scaled_frequencies_equal_transformers_llama3_rule_and_differ_from_unscaled():
    """Catches a wrong band (which wavelengths are divided, kept or blended) or blend direction: the frequencies
    must equal transformers' own llama3 initialiser, and with a short original length the scaled tables must differ
    from the plain ones at positions past it."""
    rope = VARIANTS["3.1-short-original"][0]  # 4 heads: head_dim 32 as small_recipe_config
    config = small_recipe_config(rope_theta=500000.0, rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config(rope, False), "cpu")
    ours = rotary_frequencies(config)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=1e-6)
    plain = rotary_frequencies(small_recipe_config(rope_theta=500000.0))
    divided, kept = torch.isclose(ours, plain / 8.0), torch.isclose(ours, plain)
    assert divided.any() and kept.any() and (~divided & ~kept).any()  # all three bands are exercised
    cos, sin = rotary_cos_sin(config)
    plain_cos, _ = rotary_cos_sin(small_recipe_config(rope_theta=500000.0))
    assert cos.shape == (SEQ, 32) and (cos[SHORT_ORIGINAL:] - plain_cos[SHORT_ORIGINAL:]).abs().max() > 0.1


# ------------------------------------------------------------------------------------------------ tied embeddings


def test_tied_model_holds_one_embedding_parameter_that_both_ends_train():
    """Catches an untied copy (two parameters, or a tie lost when the model is materialised from the meta device)
    and a tie that leaves one end without gradient."""
    config = small_recipe_config(tie_embeddings=True)
    untied = LLaMA(small_recipe_config())
    with torch.device("meta"):
        model = LLaMA(config)
    model.to_empty(device="cpu")
    model.reset_parameters()
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == len(list(untied.parameters())) - 1
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    logits = model(torch.randint(0, VOCAB, (1, 8)))
    logits.sum().backward()
    grad = model.tok_embeddings.weight.grad
    only_output = torch.autograd.grad(model(torch.randint(0, VOCAB, (1, 8))).sum(), model.output.weight)[0]
    assert grad is not None and grad.abs().sum() > 0 and only_output.abs().sum() > 0


def test_tied_checkpoint_whose_lm_head_differs_from_the_embedding_is_refused():
    """Catches a tied import that silently keeps one of two different matrices."""
    hf = wide(LlamaForCausalLM(hf_config(VARIANTS["3.2-1b"][0], tied=False)))
    config = hf_checkpoint.config_from_hf({**hf.config.to_dict(), "tie_word_embeddings": True})
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings=true but 'lm_head.weight' differs"):
        hf_checkpoint.hf_to_recipe_state_dict(hf.state_dict(), config)


def test_unimplemented_rope_type_in_config_json_is_refused():
    """Catches a checkpoint with another rotary scaling (its logits would silently differ) being converted."""
    rope = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    with pytest.raises(CheckpointError, match=r"rope_type='yarn'; the recipe implements .* 'llama3'"):
        hf_checkpoint.config_from_hf({**hf_config(VARIANTS["3-8b"][0], False).to_dict(), "rope_parameters": rope})


# ------------------------------------------------------------------------------------------------ HF parity


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_to_recipe_to_hf_logits_match_transformers_for_each_family(tmp_path, variant):
    """HF -> recipe (convert.py from-hf) and recipe -> HF (to-hf, loaded by LlamaForCausalLM) give transformers'
    logits within 1e-5 in fp32 at positions 0..63. Catches a wrong base, missing or wrong llama3 scaling, a tie lost
    on import, an lm_head.weight written for a tied model or a rope_parameters entry transformers misreads."""
    rope, tied, heads = VARIANTS[variant]
    hf = wide(LlamaForCausalLM(hf_config(rope, tied, heads)))
    hf.save_pretrained(tmp_path / "hf")
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "recipe.ckpt")]) == 0
    config, state_dict = load_recipe_checkpoint(tmp_path / "recipe.ckpt")
    assert (config.rope_theta, config.tie_embeddings) == (500000.0, tied)
    assert (config.rope_scaling is None) == (rope["rope_type"] == "default")
    ours = LLaMA(config)
    ours.load_state_dict(state_dict)
    expected = logits_of(hf)
    assert expected.abs().max() > 1.0  # a meaningful comparison, not two near-zero tensors
    torch.testing.assert_close(logits_of(ours.eval()), expected, atol=1e-5, rtol=0)

    assert convert.main(["to-hf", str(tmp_path / "recipe.ckpt"), str(tmp_path / "hf_again")]) == 0
    written = hf_checkpoint.load_hf_state_dict(tmp_path / "hf_again")
    assert ("lm_head.weight" in written) == (not tied)
    again = LlamaForCausalLM.from_pretrained(tmp_path / "hf_again").eval()
    assert again.config.rope_parameters == hf.config.rope_parameters
    assert again.config.tie_word_embeddings == tied
    torch.testing.assert_close(logits_of(again), expected, atol=1e-5, rtol=0)


def test_meta_llama_config_json_with_legacy_rope_keys_imports_as_transformers_reads_it(tmp_path):
    """Meta's LLaMA-3.1/3.2 downloads carry rope_theta and rope_scaling (no rope_parameters); transformers 5 converts
    them at load. Catches an import that ignores the legacy keys (plain rotary, base 10000)."""
    rope, _, _ = VARIANTS["3.1-short-original"]
    hf = wide(LlamaForCausalLM(hf_config(rope, False)))
    hf.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    written = json.loads(path.read_text())
    parameters = written.pop("rope_parameters")
    written["rope_theta"] = parameters.pop("rope_theta")
    written["rope_scaling"] = parameters
    path.write_text(json.dumps(written))
    reread = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert reread.config.rope_parameters["rope_type"] == "llama3"
    config, state_dict = hf_checkpoint.load_hf_checkpoint(tmp_path / "hf")
    assert config.rope_scaling["original_max_position_embeddings"] == SHORT_ORIGINAL
    ours = LLaMA(config)
    ours.load_state_dict(state_dict)
    torch.testing.assert_close(logits_of(ours.eval()), logits_of(reread), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ planner


def test_planner_profile_counts_a_tied_embedding_once_and_plans_llama3_shapes():
    """Catches the planner counting LLaMA-3.2's tied matrix twice (parameters, shards) or planning a LLaMA-3 preset
    with LLaMA-2's vocabulary or kv heads."""
    from lightning_npu.plan import PlanSpec, state_bytes

    tied = memory_profile.lightning_npu_memory_profile({"preset": "llama3.2-1b"})
    untied = memory_profile.lightning_npu_memory_profile({"preset": "llama3.2-1b", "config": {"tie_embeddings": False}})
    assert tied.num_params() == LLaMAConfig.from_preset("llama3.2-1b").num_params() == PARAMETER_COUNTS["llama3.2-1b"]
    assert untied.num_params() - tied.num_params() == 128256 * 2048
    eight_b = memory_profile.lightning_npu_memory_profile({"preset": "llama3.1-8b"})
    assert eight_b.num_params() == PARAMETER_COUNTS["llama3.1-8b"]
    assert (eight_b.shape.vocab_size, eight_b.shape.n_kv_heads) == (128256, 8)

    def shards(profile) -> float:
        spec = PlanSpec(model=profile.shape, seq_len=2048, micro_batch=1, devices=8, profile=profile)
        return state_bytes(spec)["parameters"]

    assert shards(untied) - shards(tied) == pytest.approx(128256 * 2048 / 8 * 4, rel=1e-3)


def test_llama3_8b_config_names_a_llama3_preset_the_planner_reads():
    """Catches the shipped config drifting from the preset table (a typo'd preset fails here, not on 8 NPUs)."""
    import yaml

    document = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes/models/llama/configs/llama3_8b.yaml").read_text())
    profile = memory_profile.lightning_npu_memory_profile(document["model"])
    assert profile.num_params() == PARAMETER_COUNTS[document["model"]["preset"]]
    assert document["data"]["seq_len"] <= LLaMAConfig.from_preset(document["model"]["preset"]).max_seq_len
