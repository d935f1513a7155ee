"""The Qwen dense family (recipes/models/qwen/): random tiny transformers Qwen2 and Qwen3 checkpoints give
transformers' logits and greedy decoding through the recipe, and round-trip bit-exactly."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from recipes import convert, families
from recipes.decoder import hf_checkpoint
from recipes.decoder.checkpoint_layout import CheckpointError
from recipes.models.qwen import hf as qwen_hf
from recipes.models.qwen.config import QwenConfig
from recipes.models.qwen.model import Qwen
from tests.hf_models import assert_convert_and_generation_are_transformers, random_hf_model, random_tokens, saved

_COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
               max_position_embeddings=64, rms_norm_eps=1e-6)
# Each exercises its architecture's features: Qwen2's q/k/v biases, Qwen3's per-head q/k norms; GQA or MHA; a
# head_dim that is not hidden / heads; tied and untied embeddings; a non-default rotary base.
HF_MODELS = {
    "qwen2-gqa-tied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                       dict(num_key_value_heads=2, tie_word_embeddings=True, rope_parameters={
                           "rope_type": "default", "rope_theta": 50000.0})),
    "qwen2-mha-head-dim": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                           dict(num_key_value_heads=4, head_dim=12)),
    "qwen3-gqa-head-dim": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                           dict(num_key_value_heads=2, head_dim=12)),
    "qwen3-tied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                   dict(num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)),
}


def hf_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_class, model_class, fields = HF_MODELS[name]
    return random_hf_model(config_class, model_class, {**_COMMON, **fields}, seed=seed)


def tokens(seed: int = 1, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return random_tokens(_COMMON["vocab_size"], seed=seed, batch=batch, seq=seq)


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_imported_model_gives_transformers_logits(tmp_path, name):
    hf = hf_model(name)
    config, state_dict = hf_checkpoint.load_hf_checkpoint(saved(hf, tmp_path / "hf"))
    assert type(config) is QwenConfig and config.architecture == hf.config.model_type
    assert config.tie_embeddings == hf.config.tie_word_embeddings
    assert config.head_dim == (getattr(hf.config, "head_dim", None) or _COMMON["hidden_size"] // 4)
    ours = Qwen(config)
    ours.load_state_dict(state_dict)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters()) == config.num_params()
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids), hf(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_hf_to_recipe_to_hf_is_bit_exact(tmp_path, name):
    hf = hf_model(name)
    config, state_dict = hf_checkpoint.load_hf_checkpoint(saved(hf, tmp_path / "hf"))
    hf_checkpoint.save_hf_checkpoint(config, state_dict, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == hf.config.model_type
    ours, theirs = (load_file(tmp_path / d / "model.safetensors") for d in ("out", "hf"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(hf)
    assert hf_checkpoint.load_hf_checkpoint(tmp_path / "out")[0] == config


@pytest.mark.parametrize("name", ["qwen2-gqa-tied", "qwen3-gqa-head-dim"])
def test_convert_and_greedy_generation_from_an_hf_directory_or_a_checkpoint_are_transformers(tmp_path, name):
    assert_convert_and_generation_are_transformers(tmp_path, hf_model(name), tokens(seed=4, batch=2, seq=5), Qwen)


def test_hf_configs_the_model_cannot_hold_are_refused():
    qwen3 = json.loads(hf_model("qwen3-tied").config.to_json_string())
    for change, message in [
        ({"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True, "sliding_window": 8},
         r"layers \[1\] use sliding-window attention .*Set use_sliding_window to false"),
        ({"attention_bias": True}, r"attention_bias=true"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, r"rope_type='yarn'"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            qwen_hf.config_from_hf({**qwen3, **change})
    # transformers 4's config.json has no layer_types: the sliding layers come from the flags, as transformers derives.
    legacy = {k: v for k, v in qwen3.items() if k != "layer_types"}
    with pytest.raises(CheckpointError, match=r"layers \[1\] use sliding-window"):
        qwen_hf.config_from_hf({**legacy, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})
    # A window named but switched off (as the released Qwen2.5 / Qwen3 config.json files have it) is full attention.
    assert qwen_hf.config_from_hf({**legacy, "use_sliding_window": False, "sliding_window": 4096}).architecture == "qwen3"


def test_config_rules_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"architecture='qwen2.5' is unknown.*Qwen2.5 is 'qwen2'"):
        QwenConfig.from_preset("tiny", architecture="qwen2.5")
    with pytest.raises(ValueError, match=r"head_dim=7 is odd"):
        QwenConfig.from_preset("tiny", head_dim=7)
    with pytest.raises(ValueError, match=r"Unknown Qwen preset 'qwen3-9b'"):
        QwenConfig.from_preset("qwen3-9b")
    assert families.of_hf_model_type("qwen3") is families.of_hf_model_type("qwen2") is families.get("qwen")


@pytest.mark.parametrize(("preset", "published"), [("qwen2.5-7b", 7.62e9), ("qwen3-8b", 8.19e9), ("qwen3-32b", 32.76e9)])
def test_real_size_presets_have_transformers_parameter_count_and_the_published_size(preset, published):
    config = QwenConfig.from_preset(preset)
    fields = json.loads(json.dumps(qwen_hf.hf_config_dict(config, dtype=torch.bfloat16)))
    hf_config = transformers.AutoConfig.for_model(**fields)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in hf.parameters()) == config.num_params()
    assert abs(config.num_params() / published - 1) < 0.005


@pytest.mark.slow  # two processes
def test_the_tensor_parallel_plan_splits_the_biases_with_their_weights_and_sums_the_qk_norm_gradients():
    """Two gloo ranks split tiny Qwen2 and Qwen3 models by the recipe's plan (tests/recipes/models/scripts/qwen_tensor_parallel_check.py):
    the logits and every gradient are the unsplit model's. Catches q/k/v biases left whole beside split weights, and
    the q/k norm gains (shared by every head) getting only their rank's heads' gradient."""
    from tests.helpers import room_scripts, run_python

    out = run_python([str(room_scripts("recipes/models") / "qwen_tensor_parallel_check.py")], simulate=None)
    results = {r["arch"]: r for r in map(json.loads, out.stdout.strip().splitlines()[-2:])}
    assert set(results) == {"qwen2", "qwen3"}
    for result in results.values():
        assert result["logits"] < 1e-5 and result["grad"] < 1e-6, result
    assert {"layers.0.attention.wq.bias", "layers.1.attention.wv.bias"} <= set(results["qwen2"]["split"])
    assert not any("norm" in name for name in results["qwen3"]["split"])


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_lora_exports_a_peft_adapter_and_a_merged_model_with_the_recipe_logits(tmp_path, name):
    """Adapters on every projection (Qwen2's biased q/k/v, Qwen3's q/k before their head norms, a head_dim that is
    not hidden / heads, tied embeddings): ``to-peft`` on transformers' Qwen model and ``to-hf --merge-lora`` give the
    adapted recipe model's fp32 logits (1e-5)."""
    from recipes.decoder.lora import LoRAConfig
    from tests.hf_models import assert_lora_exports_give_the_recipe_logits, with_random_adapters

    base_dir = saved(hf_model(name), tmp_path / "hf")
    config, state_dict = hf_checkpoint.load_hf_checkpoint(base_dir)
    ours = Qwen(config)
    ours.load_state_dict(state_dict)
    lora = LoRAConfig(rank=2, alpha=3.0, dropout=0.1, targets=("q", "k", "v", "o", "gate", "up", "down"))
    base, adapters = with_random_adapters(ours, lora, seed=5, std=0.2)
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in base.items() if k.endswith("bias"))  # frozen, kept
    assert_lora_exports_give_the_recipe_logits(tmp_path, base_dir, ours, lora, adapters, tokens())


def test_a_qwen3_config_json_without_head_dim_takes_transformers_default():
    """transformers' Qwen3Config gives head_dim 128 where the file has none; the recipe took hidden / heads, and the
    weights then failed to load with an error that blamed the config.json."""
    from recipes.models.qwen import hf as qwen_hf

    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64).to_dict()
    del config["head_dim"]
    assert qwen_hf.config_from_hf(config).head_dim == transformers.AutoConfig.for_model(**config).head_dim == 128
