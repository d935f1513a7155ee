"""The DeepSeek family (recipes/models/deepseek/): random tiny transformers DeepSeek-V3 and V2 checkpoints give
transformers' logits and greedy decoding through the recipe, and round-trip bit-exactly; FP8 block-quantized and
multi-token-prediction checkpoints import."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file

from recipes import convert, families
from recipes.decoder import hf_adapter, hf_checkpoint
from recipes.decoder.checkpoint_layout import CheckpointError
from recipes.generate import generate
from recipes.models.deepseek import hf as deepseek_hf
from recipes.models.deepseek.config import DeepSeekConfig
from recipes.models.deepseek.model import DeepSeek
from tests.hf_models import assert_convert_and_generation_are_transformers, random_hf_model, random_tokens, saved

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
               n_shared_experts=1, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
               first_k_dense_replace=1, max_position_embeddings=64, routed_scaling_factor=2.5, n_group=4,
               topk_group=2)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
             beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)
# Each exercises its architecture's features: q low rank on and off, the first layer dense, 1 or 2 shared experts,
# group-limited routing (V3: groups by their two best biased sigmoid scores, renormalised; V2: group max of the
# softmax, or plain greedy), YaRN (scaled tables and softmax scale), interleaved rotary pairs or not (V3).
HF_MODELS = {
    "v3-q-lora-yarn": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                       dict(q_lora_rank=24, rope_parameters=_YARN)),
    "v3-no-q-lora-halves": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                            dict(q_lora_rank=None, rope_interleave=False, n_shared_experts=2, norm_topk_prob=False)),
    "v2-group-limited-yarn": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                              dict(q_lora_rank=None, topk_method="group_limited_greedy", rope_parameters=_YARN)),
    "v2-q-lora-greedy": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                         dict(q_lora_rank=16, topk_method="greedy", n_shared_experts=2)),
}


def hf_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random transformers model (``random_hf_model``) with V3's correction bias random too, so each feature
    moves the logits and the routing."""
    config_class, model_class, fields = HF_MODELS[name]
    model = random_hf_model(config_class, model_class, {**_COMMON, **fields}, seed=seed)
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


def tokens(seed: int = 1, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return random_tokens(_COMMON["vocab_size"], seed=seed, batch=batch, seq=seq)


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_imported_model_gives_transformers_logits(tmp_path, name):
    hf = hf_model(name)
    config, state_dict = hf_checkpoint.load_hf_checkpoint(saved(hf, tmp_path / "hf"))
    assert type(config) is DeepSeekConfig and config.architecture == hf.config.model_type
    assert config.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    ours = DeepSeek(config)
    ours.load_state_dict(state_dict)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters()) == config.num_params()
    ids = tokens()
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours.eval()(ids), expected, rtol=0, atol=1e-5)
    assert expected.std() > 0.1  # the logits are not near zero, so 1e-5 is a tight bound


def test_the_stacked_transformers_5_layout_loads_as_the_per_expert_one():
    hf = hf_model("v3-q-lora-yarn")
    stacked = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in stacked
    config = deepseek_hf.config_from_hf(hf.config.to_dict())
    per_expert = hf_checkpoint.recipe_to_hf_state_dict(hf_checkpoint.hf_to_recipe_state_dict(stacked, config), config)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in per_expert
    ours, again = (hf_checkpoint.hf_to_recipe_state_dict(sd, config) for sd in (stacked, per_expert))
    assert ours.keys() == again.keys() and all(torch.equal(ours[k], again[k]) for k in ours)
    assert torch.equal(ours["layers.2.feed_forward.router.expert_bias"],
                       stacked["model.layers.2.mlp.gate.e_score_correction_bias"])


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
    ids = tokens(seed=3)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("name", ["v3-q-lora-yarn", "v2-group-limited-yarn"])
def test_convert_and_greedy_generation_from_an_hf_directory_or_a_checkpoint_are_transformers(tmp_path, name):
    assert_convert_and_generation_are_transformers(tmp_path, hf_model(name), tokens(seed=4, batch=2, seq=5), DeepSeek)


def _fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` as DeepSeek-V3's release stores it: float8_e4m3fn codes and one fp32 inverse scale per 128 x 128
    block (each block's max magnitude over e4m3's largest value, 448)."""
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -cols % 128, 0, -rows % 128))
    blocks = padded.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))  # [R, 128, C, 128]
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return (weight / full).to(torch.float8_e4m3fn), scale


def fp8_release_state_dict() -> tuple[DeepSeekConfig, dict[str, torch.Tensor]]:
    """A random DeepSeek-V3 in its release's layout: per-expert tensors, every projection FP8 with block scales."""
    hf = hf_model("v3-q-lora-yarn")
    config = deepseek_hf.config_from_hf(hf.config.to_dict())
    stored = hf_checkpoint.recipe_to_hf_state_dict(hf_checkpoint.hf_to_recipe_state_dict(hf.state_dict(), config), config)
    quantized = dict(stored)
    for name, tensor in stored.items():
        if tensor.dim() == 2 and "proj" in name:
            quantized[name], quantized[name + "_scale_inv"] = _fp8_blocks(tensor)
    return config, quantized


def write_fp8_directory(directory) -> None:
    """``fp8_release_state_dict`` as an HF directory (config.json, one safetensors file)."""
    from safetensors.torch import save_file

    config, quantized = fp8_release_state_dict()
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf_checkpoint.hf_config_dict(config, dtype=torch.bfloat16)))
    save_file(quantized, directory / "model.safetensors")


def test_fp8_block_quantized_weights_are_dequantized_on_import():
    weight = torch.randn(200, 130, generator=torch.Generator().manual_seed(0))
    codes, scale = _fp8_blocks(weight)
    assert scale.shape == (2, 2)
    piece = hf_adapter.Piece("a.weight", (0, 0), (200, 130), scale="a.weight_scale_inv")
    tensors = {"a.weight": codes, "a.weight_scale_inv": scale}
    out = hf_adapter.read_piece(piece, (slice(0, 200), slice(0, 130)), lambda name, index: tensors[name][index])
    assert out.dtype == torch.bfloat16
    # Each block's codes times its own scale: a block-mixup would be off by the ratio of two scales.
    expected = codes.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :130]
    assert torch.equal(out, expected.bfloat16())
    assert (out.float() - weight).abs().max() < 0.1 * weight.abs().max()
    # A slice across block edges reads its own blocks' scales only.
    part = hf_adapter.read_piece(piece, (slice(100, 190), slice(120, 130)), lambda name, index: tensors[name][index])
    assert torch.equal(part, expected.bfloat16()[100:190, 120:130])
    # A whole checkpoint in the release's layout (linear weights FP8, per-expert tensors) converts.
    config, quantized = fp8_release_state_dict()
    ours = hf_checkpoint.hf_to_recipe_state_dict(quantized, config)
    codes, scale = quantized["model.layers.0.self_attn.kv_b_proj.weight"], quantized["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]
    assert torch.equal(ours["layers.0.attention.wkv_b.weight"], (codes.float() * scale).bfloat16())  # one block
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    with pytest.raises(CheckpointError, match=r"needs \(1, 1\)"):
        hf_checkpoint.hf_to_recipe_state_dict({**quantized, name + "_scale_inv": torch.ones(2, 1)}, config)
    with pytest.raises(CheckpointError, match=r"without its block scales 'model\.layers\.0\.self_attn\.kv_b_proj"):
        hf_checkpoint.hf_to_recipe_state_dict({k: v for k, v in quantized.items() if k != name + "_scale_inv"}, config)


def test_multi_token_prediction_exports_at_layer_n_imports_back_and_is_skipped_by_generation(tmp_path, caplog):
    hf = hf_model("v3-q-lora-yarn")
    config = deepseek_hf.config_from_hf(hf.config.to_dict())
    assert config.mtp_layers == 0  # transformers writes num_nextn_predict_layers 1 but saves no MTP layer
    torch.manual_seed(5)
    ours = DeepSeek(DeepSeekConfig.from_dict({**config.to_dict(), "mtp_layers": 1}))
    ours.load_state_dict(hf_checkpoint.hf_to_recipe_state_dict(hf.state_dict(), config), strict=False)
    hf_checkpoint.save_hf_checkpoint(ours.config, ours.state_dict(), tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.norm.weight",
            "model.layers.3.self_attn.kv_b_proj.weight", "model.layers.3.mlp.experts.7.down_proj.weight"} <= set(written)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    again, state_dict = hf_checkpoint.load_hf_checkpoint(tmp_path / "out")
    assert again == ours.config and all(torch.equal(state_dict[k], v) for k, v in ours.state_dict().items())
    # transformers' model ignores the layer; generation through the recipe skips it and decodes as transformers.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    prompt = tokens(seed=4, batch=2, seq=5)
    with torch.no_grad():
        expected = loaded.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(ours.eval(), prompt, 6), expected)
    # A model without MTP drops a checkpoint's MTP layers (and the release's copies of the embedding and head).
    extra = {"model.layers.3.embed_tokens.weight": written["model.embed_tokens.weight"], **written}
    with caplog.at_level(logging.WARNING):
        plain = hf_checkpoint.hf_to_recipe_state_dict(extra, config)
    assert "multi-token-prediction layer(s) [3]" in caplog.text and not any(k.startswith("mtp.") for k in plain)


@pytest.mark.parametrize("packed", [False, True])
def test_the_multi_token_loss_predicts_two_ahead_within_each_row_or_sample(packed):
    """The depth-1 loss is the cross-entropy of the depth run on the trunk's hidden states of positions 0 .. n-2 and
    the embeddings of tokens 1 .. n-1 of each sample alone, against tokens 2 .. n: what rolling and masking must
    give (a roll across a sample boundary would predict the next sample's tokens)."""
    torch.manual_seed(0)
    config = DeepSeekConfig.from_preset("tiny", n_layers=2, mtp_layers=1, mtp_loss_weight=0.5, vocab_size=64)
    model = DeepSeek(config).train()
    ids = torch.randint(0, 64, (1, 12) if packed else (2, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.cat((ids[:, 1:], torch.full((ids.shape[0], 1), -100)), dim=1)
    bounds = [0, 5, 12] if packed else None
    if packed:
        labels[0, 4] = -100  # a sample's last token has no next token
    model(ids, cu_seqlens=bounds)
    loss = model.multi_token_loss(labels)
    loss.backward()
    assert model.mtp[0].eh_proj.weight.grad.abs().sum() > 0
    samples = [(0, 5), (5, 12)] if packed else [(0, 12)]
    rows = range(ids.shape[0])
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            for start, end in samples:
                sample = ids[row:row + 1, start:end]
                h, cos, sin, _ = model.embed(sample, None, 0, None, None)
                model._ahead = None
                for block in model.layers:
                    h = block(h, cos, sin)
                n = end - start
                hidden = model.mtp[0](h[:, : n - 1], model.tok_embeddings(sample[:, 1:]), cos[: n - 1], sin[: n - 1], None)
                logits = model.output(model.mtp[0].norm(hidden)).float()
                target = labels[row, start + 1:end]
                valid = target != -100
                total += torch.nn.functional.cross_entropy(logits[0][valid], target[valid], reduction="sum")
                count += int(valid.sum())
    torch.testing.assert_close(loss.detach(), 0.5 * total / count, rtol=1e-5, atol=1e-6)
    model.eval()
    model(ids, cu_seqlens=bounds)
    assert model.multi_token_loss(labels).item() == 0.0  # evaluation runs no MTP


def test_hf_configs_and_recipe_configs_the_model_cannot_hold_are_refused():
    v3 = hf_model("v3-q-lora-yarn").config.to_dict()
    v2 = hf_model("v2-q-lora-greedy").config.to_dict()
    for base, change, message in [
        (v3, {"attention_bias": True}, r"attention_bias=true"),
        (v3, {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        (v3, {"num_key_value_heads": 2}, r"num_key_value_heads=2"),
        (v3, {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, r"rope_type='dynamic'"),
        (v2, {"topk_method": "noaux_tc"}, r"topk_method='noaux_tc'"),
        (v2, {"mlp_bias": True}, r"mlp_bias=true"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            deepseek_hf.config_from_hf({**base, **change})
    for change, message in [
        (dict(n_group=3), r"n_group=3 does not divide n_experts=8"),
        (dict(top_k=6, topk_group=2), r"top_k=6 exceeds the 4 experts of the topk_group=2 groups"),
        (dict(first_k_dense=3), r"first_k_dense=3 leaves no MoE layer"),
        (dict(router_aux_loss_coef=0.01), r"router_aux_loss_coef=0.01: the sequence-wise auxiliary loss"),
        (dict(architecture="deepseek_v2", norm_topk_prob=False, router_bias_update_rate=0.0, mtp_layers=1),
         r"deepseek_v2 has no multi-token prediction"),
        (dict(architecture="deepseek_v2", norm_topk_prob=True, router_bias_update_rate=0.0), r"never renormalises"),
    ]:
        with pytest.raises(ValueError, match=message):
            DeepSeekConfig.from_preset("tiny", **change)
    assert families.of_hf_model_type("deepseek_v3") is families.of_hf_model_type("deepseek_v2") is families.get("deepseek")


@pytest.mark.parametrize(("preset", "total", "active", "scale"), [
    ("deepseek-v2-lite", 15.71e9, 2.66e9, 0.114721), ("moonlight-16b-a3b", 15.96e9, 2.91e9, 192 ** -0.5),
    ("deepseek-v3-671b", 671.0e9, 37.6e9, 0.135234),
])
def test_real_size_presets_have_transformers_parameter_count_and_the_published_size(preset, total, active, scale):
    config = DeepSeekConfig.from_preset(preset)
    fields = json.loads(json.dumps(deepseek_hf.hf_config_dict(config, dtype=torch.bfloat16)))
    hf_config = transformers.AutoConfig.for_model(**fields)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in hf.parameters()) == config.num_params()
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(config.softmax_scale, rel=1e-12)
    assert abs(config.num_params() / total - 1) < 0.005 and abs(config.active_params() / active - 1) < 0.005
    assert config.softmax_scale == pytest.approx(scale, abs=1e-6)


def test_a_bf16_checkpoint_with_transformers_fp32_router_round_trips_bit_exactly(tmp_path):
    """transformers keeps DeepSeek-V3's router (gate weight, correction bias) in fp32 in a bf16 model; the export
    takes its one dtype from the other tensors (before, it refused the checkpoint for mixing dtypes)."""
    saved(hf_model("v3-q-lora-yarn"), tmp_path / "fp32")
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16)
    saved(bf16, tmp_path / "hf")
    theirs = load_file(tmp_path / "hf" / "model.safetensors")
    assert theirs["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    config, state_dict = hf_checkpoint.load_hf_checkpoint(tmp_path / "hf")
    hf_checkpoint.save_hf_checkpoint(config, state_dict, tmp_path / "out")
    ours = load_file(tmp_path / "out" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype
                                                for k in ours)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


_MLA_LORA = {"v3-q-lora-yarn": ("q_a", "q_b", "kv_a", "kv_b", "o", "expert_gate", "expert_up", "expert_down"),
             "v3-no-q-lora-halves": ("q", "kv_a", "kv_b", "o", "expert_up"),
             "v2-q-lora-greedy": ("q_b", "kv_a", "o", "expert_gate", "expert_down"),
             "v2-group-limited-yarn": ("q", "kv_b", "expert_gate", "expert_up", "expert_down")}


@pytest.mark.parametrize("name", sorted(_MLA_LORA))
def test_lora_on_mla_and_the_experts_exports_a_peft_adapter_and_a_merged_model_with_the_recipe_logits(tmp_path,
                                                                                                       name):
    """Adapters on MLA's projections (the query or its low rank and up-projection, the key/value latent with the
    shared rotary key, its up-projection, the output) and on the routed experts: ``to-peft`` on transformers'
    DeepSeek model and ``to-hf --merge-lora`` give the adapted recipe model's fp32 logits (1e-5)."""
    from recipes.decoder.lora import LoRAConfig
    from tests.hf_models import assert_lora_exports_give_the_recipe_logits, with_random_adapters

    base_dir = saved(hf_model(name), tmp_path / "hf")
    config, state_dict = hf_checkpoint.load_hf_checkpoint(base_dir)
    ours = DeepSeek(config)
    ours.load_state_dict(state_dict)
    lora = LoRAConfig(rank=2, alpha=3.0, dropout=0.1, targets=_MLA_LORA[name])
    _, adapters = with_random_adapters(ours, lora, seed=5, std=0.2)
    adapter_config = assert_lora_exports_give_the_recipe_logits(tmp_path, base_dir, ours, lora, adapters, tokens())
    assert set(adapter_config["target_modules"]) <= {"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                     "kv_b_proj", "o_proj"}


def test_lora_on_a_query_projection_the_config_leaves_out_is_refused_naming_the_ones_it_has():
    from recipes.decoder.lora import LoRAConfig, add_lora

    with_low_rank = DeepSeek(DeepSeekConfig.from_preset("tiny", q_lora_rank=8))
    with pytest.raises(ValueError, match=r"'q', but this model's blocks have no attention\.wq .*'q_a', 'q_b'"):
        add_lora(with_low_rank, LoRAConfig(targets=("q", "kv_a")))
    without = DeepSeek(DeepSeekConfig.from_preset("tiny", q_lora_rank=None))
    with pytest.raises(ValueError, match=r"'q_b', but this model's blocks have no attention\.wq_b"):
        add_lora(without, LoRAConfig(targets=("q_b",)))


def test_multi_token_prediction_under_context_parallelism_is_refused_with_the_reason():
    """train.py refuses it before workers start (tests/parallel/test_context_parallel.py); a model given context parallelism
    another way (Fabric) refuses its first training forward, not trains MTP on the wrong tokens."""
    from lightning_npu.parallel.context import ContextParallel
    from lightning_npu.parallel.context import apply_context_parallel

    assert DeepSeekConfig.from_preset("tiny").context_parallel_refusal() is None
    model = DeepSeek(DeepSeekConfig.from_preset("tiny", n_layers=2, mtp_layers=1))
    apply_context_parallel(model, model.context_parallel_modules(), ContextParallel(None, "ring"))  # refused before the group is asked anything
    with pytest.raises(ValueError, match=r"mtp_layers=1: multi-token prediction reads the tokens up to 1 ahead"):
        model.train()(tokens(seq=8))


def test_lora_flops_take_the_weight_gradient_off_every_weight_pass_the_mtp_depths_included():
    """Under LoRA each frozen weight a token runs through costs 4 FLOPs, not 6, and with multi-token prediction that
    includes each depth's extra pass through the shared head. Before, the correction subtracted 2 x the active
    parameters only, so each depth's head pass stayed at 6 (about 0.8% high on DeepSeek-V3)."""
    from recipes.decoder.module import DecoderLM
    from recipes.models.deepseek.config import DeepSeekConfig

    config = DeepSeekConfig.from_preset("tiny", mtp_layers=2)
    lora = {"rank": 8, "targets": ["o"]}
    full = DecoderLM(family="deepseek", preset="tiny", config={"mtp_layers": 2}).flops_per_token
    adapted = DecoderLM(family="deepseek", preset="tiny", config={"mtp_layers": 2}, init_from="base",
                        lora=lora).flops_per_token
    runs = config.active_params(include_embedding=False) + 2 * config.vocab_size * config.dim
    from recipes.decoder.lora import active_adapter_params
    from recipes.decoder.lora_config import LoRAConfig

    adapters = active_adapter_params(config, LoRAConfig.from_value(lora))
    assert full - adapted == 2 * runs - 6 * adapters


@pytest.mark.parametrize("config_class", [transformers.DeepseekV3Config, transformers.DeepseekV2Config])
def test_keys_a_config_json_leaves_out_are_read_as_transformers_defaults(config_class):
    """A config.json without the routing's scale or groups runs in transformers with its config class's defaults
    (V3: 2.5, 8 groups, top 4). The recipe read 1.0, 1 and 1: logits 2.5 off and greedy decoding another text, and
    an export wrote them back. Every key the recipe takes a default for is checked against transformers'."""
    whole = config_class(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, kv_lora_rank=16,
                         qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, vocab_size=128,
                         num_experts_per_tok=2, max_position_embeddings=64).to_dict()
    for key in deepseek_hf.HF_DEFAULTS[whole["model_type"]]:
        trimmed = {name: value for name, value in whole.items() if name != key}
        assert transformers.AutoConfig.for_model(**trimmed).to_dict().get(key) == whole[key], key
        assert deepseek_hf.config_from_hf(trimmed) == deepseek_hf.config_from_hf(whole), key
