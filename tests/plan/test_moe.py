"""The MoE family's memory profile (recipes/models/moe/memory_profile.py) against the recipe's MoE model itself:
its parameters (stacked experts, router, shared expert, dense layers), what a block's forward leaves saved for
backward (counted through autograd's saved-tensor hooks), and the expert-parallel terms. The end-to-end check
against measured training peaks is tests/plan/test_accuracy.py."""

from __future__ import annotations

import contextlib
import json
from collections import Counter

import pytest
import torch
import yaml

from lightning_npu.plan import PlanError, estimate, load_spec, state_bytes
from recipes.models.moe.config import MoEConfig
from recipes.models.moe.memory_profile import lightning_npu_memory_profile, profile_of
from recipes.models.moe.model import MoE
from tests.helpers import REPO, room_scripts, run_python
from tests.plan.test_plan import _kept_bytes_per_token, _kernels_context, _saved_bytes_per_token

SCRIPTS = room_scripts("plan")

TINY_MOE = REPO / "recipes" / "models" / "moe" / "configs" / "tiny_moe.yaml"
#: Qwen2-MoE on the tiny preset: a shared expert with its gate, a dense first layer, qkv biases, no renormalisation.
QWEN2 = dict(architecture="qwen2_moe", shared_expert_hidden_dim=48, dense_layers=[0], dense_hidden_dim=80,
             qkv_bias=True, norm_topk_prob=False)
#: Mixtral on the tiny preset, with a head_dim other than dim / heads (as Qwen3-30B-A3B's 32 x 128 on 2048).
MIXTRAL = dict(architecture="mixtral", head_dim=48, router_aux_loss_coef=0.0)


@pytest.mark.parametrize("overrides", [{}, QWEN2, MIXTRAL], ids=["qwen3_moe", "qwen2_moe", "mixtral"])
def test_the_profile_holds_each_layer_s_parameters_as_the_model_does(overrides):
    """Per layer, the multiset of parameter shapes FSDP2 shards (the experts as two stacked tensors) is the model's;
    catches the experts as E x 3 small tensors, a missing router or shared-expert gate, the dense layer planned as
    MoE, q/k norms or biases left out, and the queries' width taken as dim."""
    config = MoEConfig.from_preset("tiny", **overrides)
    with torch.device("meta"):
        model = MoE(config)
    profile = profile_of(config, "tiny")
    for i, layer in enumerate(model.layers):
        planned = Counter(tuple(shape) for shape in profile.block_profile(i).block_parameters().shapes)
        assert planned == Counter(tuple(p.shape) for p in layer.parameters()), f"layer {i}"
    assert profile.num_params() == sum(p.numel() for p in model.parameters()) == config.num_params()


def _moe_block(overrides, layer=1, lora=None):
    from recipes.decoder.lora import LoRAConfig, add_lora

    config = MoEConfig.from_preset("tiny", n_layers=2, **overrides)
    torch.manual_seed(0)
    model = MoE(config)
    if lora is not None:
        add_lora(model, LoRAConfig.from_value(lora))
    return config, model.layers[layer]


@pytest.mark.parametrize(("overrides", "layer", "lora"), [
    ({}, 1, None), (QWEN2, 1, None), (QWEN2, 0, None), (MIXTRAL, 1, None),
    ({}, 1, dict(rank=8, targets=["q", "k", "v", "o"])),
], ids=["qwen3_moe", "qwen2_moe_shared_expert", "qwen2_moe_dense_layer", "mixtral_head_dim", "lora_frozen_experts"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_moe_block_activation_count_matches_the_tensors_autograd_saves(overrides, layer, lora, precision):
    """What one MoE (or dense) block keeps for backward on the reference path is the profile's count exactly, plus
    nothing: the router's input and softmax, the top-k ids and probabilities, the permutation's indices, the
    permuted rows and the experts' SwiGLU interiors (top_k rows per token), the unpermute's fp32 rows, the shared
    expert. The router logits are not saved by autograd; the layer keeps them (``router_logits``) and the profile
    counts them with the saved tensors, so they are added to the measurement. Catches the routed rows counted once
    per token instead of top_k times, the frozen experts' inputs counted under LoRA (torch._grouped_mm keeps them
    only for the experts' gradients), a shared expert or the int64 indices left out."""
    config, block = _moe_block(overrides, layer, lora)
    dtype = torch.float32
    if precision == "bf16-mixed":
        block = block.to(torch.bfloat16)
        dtype = torch.bfloat16
    seq, batches = 32, (2, 4)
    measured = _saved_bytes_per_token(block, dtype, _kernels_context(precision, "reference"), batches, seq)
    if layer in config.moe_layers:
        measured += 4 * config.n_experts  # block.feed_forward.router_logits, fp32 [tokens, n_experts]
    act_bytes = 4 if precision == "32-true" else 2
    profile = lightning_npu_memory_profile({"family": "moe", "preset": "tiny", "lora": lora,
                                            "config": dict(n_layers=2, **overrides)})
    assert measured == sum(profile.block_profile(layer).saved_by_block("reference", act_bytes, BLOCK_SEQ).all.values())


def _tiny_moe_config(tmp_path, devices=4, **strategy):
    """tiny_moe.yaml on ``devices`` with more strategy options, written where it names its block by import path."""
    document = yaml.safe_load(TINY_MOE.read_text())
    document["trainer"]["strategy"]["init_args"].update(
        auto_wrap_policy=["recipes.models.moe.model.MoEBlock"], activation_checkpointing_policy=None, **strategy)
    document["trainer"]["devices"] = devices
    path = tmp_path / "tiny_moe_ep.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _tiny_moe_spec(tmp_path, **strategy):
    return load_spec(_tiny_moe_config(tmp_path, **strategy))


def test_expert_parallelism_gathers_the_local_experts_and_adds_all_to_all_buffers(tmp_path):
    """expert_parallel_size=2 on 4 devices: each rank holds 4 of the 8 experts, sharded over the 2 ranks that hold
    the same ones, so the sharded states are unchanged, the gathered copy of a block holds half the experts, the
    experts' all-to-alls hold a send and a receive buffer of the routed rows, and the expert group and FSDP's group
    over the experts' mesh (the 2 ranks that hold the same experts) are two more HCCL communicators."""
    plain, ep = _tiny_moe_spec(tmp_path), _tiny_moe_spec(tmp_path, expert_parallel_size=2)
    assert (plain.profile.expert_parallel_size, ep.profile.expert_parallel_size) == (1, 2)
    assert ep.profile.num_params() == plain.profile.num_params() == MoEConfig.from_preset("tiny").num_params()
    plain_items, ep_items = estimate(plain, zero_stage=2).items, estimate(ep, zero_stage=2).items
    assert ep_items["parameters"] == plain_items["parameters"]
    config = MoEConfig.from_preset("tiny")
    experts = 3 * config.expert_hidden_dim * config.dim * config.n_experts * len(config.moe_layers)
    # ZeRO-2 keeps every block gathered (fp32 here): half the experts fewer per rank.
    assert plain_items["gathered"] - ep_items["gathered"] == experts // 2 * 4
    assert ep_items["comm"] == 3 * plain_items["comm"]
    tokens = config.dim * config.top_k * 4 * 2  # the send and receive buffers, fp32 rows, per token
    assert ep.profile.forward_scratch("fused", 4, 128, False) - plain.profile.forward_scratch("fused", 4, 128, False) \
        == tokens


@pytest.mark.parametrize(("strategy", "message"), [
    (dict(expert_parallel_size=3), r"expert_parallel_size=3 must be a positive integer that divides n_experts=8"),
    (dict(expert_parallel_size=0), r"expert_parallel_size=0 must be a positive integer"),
])
def test_an_expert_parallel_size_that_does_not_split_the_experts_is_refused(tmp_path, strategy, message):
    with pytest.raises(PlanError, match=message):
        _tiny_moe_spec(tmp_path, **strategy)


def test_an_expert_parallel_size_that_does_not_divide_the_devices_is_refused(tmp_path):
    with pytest.raises(PlanError, match=r"expert_parallel_size=8 does not divide the 4 devices"):
        load_spec(_tiny_moe_config(tmp_path, devices=4, expert_parallel_size=8))


def test_a_dense_decoder_refuses_expert_parallelism(tmp_path):
    llama = REPO / "recipes" / "models" / "llama" / "configs" / "llama2_7b.yaml"
    document = yaml.safe_load(llama.read_text())
    document["trainer"]["strategy"]["init_args"]["expert_parallel_size"] = 2
    path = tmp_path / "llama_ep.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(PlanError, match=r"expert_parallel_size=2: LLaMA 7b has no experts to split; use 1"):
        load_spec(path)


def test_lora_on_the_experts_is_refused_as_the_family_refuses_it():
    with pytest.raises(ValueError, match=r"the MoE family adapts attention \(q, k, v, o\) and, expert by expert"):
        lightning_npu_memory_profile({"family": "moe", "lora": dict(rank=8, targets=["q", "gate"])})


def test_mixtral_planned_fully_fine_tuned_beyond_8_devices_shows_the_padded_experts():
    """FSDP2 shards a stacked [8, ...] expert tensor along dim 0: over 16 ranks each holds one expert's rows (half
    of them padding), so the sharded states are those of 16 experts, not 8 (why mixtral_8x7b_lora.yaml is LoRA)."""
    from lightning_npu.plan import PlanSpec

    profile = profile_of(MoEConfig.from_preset("mixtral-8x7b"), "mixtral-8x7b")
    shards = {n: state_bytes(PlanSpec(model=profile.shape, profile=profile, seq_len=4096, micro_batch=1, devices=8,
                                      nodes=n))["parameters"] for n in (1, 2)}
    config = MoEConfig.from_preset("mixtral-8x7b")
    one_expert = 3 * config.dim * config.expert_hidden_dim * config.n_layers * 4  # one expert per layer, fp32
    rest = profile.num_params() * 4 - config.n_experts * one_expert
    assert shards[1] == pytest.approx((rest + config.n_experts * one_expert) / 8, rel=1e-6)
    assert shards[2] == pytest.approx(rest / 16 + one_expert, rel=1e-4)  # not (rest + 8 experts) / 16; the router pads too


@pytest.mark.parametrize("overrides", [{}, QWEN2], ids=["qwen3_moe", "qwen2_moe_shared_expert_dense_layer"])
def test_a_quantized_lora_base_is_planned_quantized_where_the_recipe_quantizes_it(overrides):
    """Under lora.base_quantization the recipe quantizes the family's LoRA sites, attention's four projections:
    the router, the stacked experts, the shared expert and its gate, and a dense layer's MLP stay in the model's
    dtype. Catches the planner counting every block matrix as quantized."""
    from lightning_npu.quant import QuantizedLinear
    from recipes.decoder.lora import LoRAConfig, LoRALinear, add_lora

    lora = dict(rank=4, targets=["q", "v"], base_quantization="int8")
    config = MoEConfig.from_preset("tiny", **overrides)
    with torch.device("meta"):
        model = add_lora(MoE(config), LoRAConfig.from_value(lora))
    profile = profile_of(config, "tiny", lora)
    for i, layer in enumerate(model.layers):
        quantized = Counter(
            (m.out_features, m.in_features) for m in layer.modules()
            if isinstance(m, QuantizedLinear) or isinstance(m, LoRALinear) and m.scheme is not None)
        planned = Counter(shape for shape, scheme in profile.block_profile(i).block_storage() if scheme == "int8")
        assert planned == quantized == Counter(
            [(config.n_heads * config.head_dim, config.dim), (config.n_kv_heads * config.head_dim, config.dim),
             (config.n_kv_heads * config.head_dim, config.dim), (config.dim, config.n_heads * config.head_dim)]
        ), f"layer {i}"


EXPERTS = ["expert_gate", "expert_up", "expert_down"]


def _with_adapters(family: str, overrides: dict, lora: dict, meta: bool = False):
    """The recipe's model of ``family`` on the tiny preset with ``lora``'s adapters (add_lora), and its profile."""
    from recipes.decoder.lora import LoRAConfig, add_lora

    if family == "moe":
        from recipes.models.moe.config import MoEConfig as Config
        from recipes.models.moe.model import MoE as Model
        profile_function = lightning_npu_memory_profile
    else:
        from recipes.models.deepseek.config import DeepSeekConfig as Config
        from recipes.models.deepseek.memory_profile import lightning_npu_memory_profile as profile_function
        from recipes.models.deepseek.model import DeepSeek as Model
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = add_lora(Model(Config.from_preset("tiny", **overrides)), LoRAConfig.from_value(lora))
    return model, profile_function({"family": family, "preset": "tiny", "config": overrides, "lora": lora})


@pytest.mark.parametrize(("family", "overrides", "targets"), [
    ("moe", {}, EXPERTS), ("moe", QWEN2, ["q", "v", "expert_gate", "expert_down"]),
    ("deepseek", {}, ["o", *EXPERTS]),
], ids=["qwen3_moe_experts", "qwen2_moe_attention_and_experts", "deepseek_output_and_experts"])
@pytest.mark.parametrize("ep", [1, 2])
def test_expert_adapters_are_planned_as_the_recipe_stacks_them(family, overrides, targets, ep):
    """Per layer, the adapters' shapes (A [E, rank, in], B [E, rows, rank] per expert target, stacked like the
    experts; none on a dense layer) are the model's, and they are all that trains; under expert parallelism a rank
    holds E / ep experts' adapters, in the experts' own FSDP unit. Fails on the planner before, which refused
    expert targets."""
    from lightning_npu.plan import RankLocalShape

    model, profile = _with_adapters(family, overrides, dict(rank=8, targets=targets), meta=True)
    profile = profile.with_expert_parallelism(ep)
    for i, layer in enumerate(model.layers):
        trainable = [tuple(p.shape) for p in layer.parameters() if p.requires_grad]
        planned = profile.block_profile(i).trainable_parameters().block.shapes
        local = [shape for shape in planned if isinstance(shape, RankLocalShape)]
        assert Counter((shape[0] * getattr(shape, "replicas", 1), *shape[1:]) for shape in planned) \
            == Counter(trainable), f"layer {i}"
        expert_adapters = [shape for shape in trainable if len(shape) == 3]
        assert len(local) == (len(expert_adapters) if ep > 1 else 0)
        assert all(shape[0] == 8 // ep for shape in local)
    assert profile.num_trainable_params() == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert profile.num_params() == sum(p.numel() for p in model.parameters())


BLOCK_SEQ = 32  # the rows' length in _model_block_saved_bytes


def _model_block_saved_bytes(model, layer: int, precision: str, input_grad: bool = True) -> float:
    """Bytes per token ``model.layers[layer]`` keeps for backward on the reference path (``BLOCK_SEQ``-token rows of
    batches 2 and 4, the model's rotary tables)."""
    block, dtype = model.layers[layer], torch.float32
    if precision == "bf16-mixed":
        block, dtype = block.to(torch.bfloat16), torch.bfloat16
    cos_sin = tuple(table[:BLOCK_SEQ] for table in model.rotary_cos_sin())
    return _saved_bytes_per_token(block, dtype, _kernels_context(precision, "reference"), (2, 4), BLOCK_SEQ,
                                  input_grad=input_grad, cos_sin=cos_sin)


@pytest.mark.parametrize(("family", "overrides", "layer", "targets"), [
    ("moe", {}, 1, ["expert_gate"]), ("moe", {}, 1, ["expert_up", "expert_down"]), ("moe", QWEN2, 1, EXPERTS),
    ("moe", QWEN2, 1, ["q", "expert_down"]), ("moe", QWEN2, 0, ["o", "expert_gate"]),
    ("deepseek", {}, 1, ["o", "expert_gate", "expert_up"]), ("deepseek", {}, 0, EXPERTS),
], ids=["gate", "up_down", "qwen2_all_three", "qwen2_q_down", "qwen2_dense_layer", "deepseek_moe_layer",
        "deepseek_dense_layer"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["input_grad", "first_block"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_expert_adapters_keep_what_the_profile_counts(family, overrides, layer, targets, dropout, input_grad,
                                                      precision):
    """A block with adapters on its experts keeps exactly what the profile counts for backward, whether its input
    needs a gradient or not (a block before the first trainable one: then a frozen router keeps its logits only,
    the permute no index, the unpermute no fp32 rows, the shared expert nothing): each adapter's rank-r
    intermediate, the routed rows (or SwiGLU output) its A reads, or with dropout its own dropped-out copy and the
    mask when its input needs a gradient; the experts' SwiGLU interiors whenever a gradient flows through them.
    Fails on the planner before, which refused expert targets."""
    lora = dict(rank=8, targets=targets, dropout=dropout)
    model, profile = _with_adapters(family, overrides, lora)
    measured = _model_block_saved_bytes(model, layer, precision, input_grad=input_grad)
    if layer in model.config.moe_layers:
        measured += 4 * model.config.n_experts  # router_logits, kept by the layer
    layer_profile = profile.block_profile(layer)
    count = layer_profile.saved_by_block if input_grad else layer_profile.saved_by_first_block
    assert measured == sum(count("reference", 4 if precision == "32-true" else 2, BLOCK_SEQ).all.values())


def test_expert_targets_plan_in_families_with_experts_and_are_refused_elsewhere():
    """The MoE and DeepSeek families plan adapters on their experts; a family without experts refuses them, as the
    recipe's add_lora does; DeepSeek's MLA projections but its output are not planned yet."""
    from recipes.models.deepseek.memory_profile import lightning_npu_memory_profile as deepseek_profile
    from recipes.models.llama.memory_profile import lightning_npu_memory_profile as llama_profile

    moe = lightning_npu_memory_profile({"family": "moe", "lora": dict(rank=8, targets=["q", "expert_down"])})
    assert moe.adapters.projections == ("q", "expert_down")
    assert deepseek_profile({"family": "deepseek", "lora": dict(rank=8, targets=["o", "expert_up"])}
                            ).adapters.projections == ("o", "expert_up")
    with pytest.raises(PlanError, match=r"lora.targets \['expert_gate'\]: this model has no experts to adapt"):
        llama_profile({"preset": "tiny", "lora": dict(rank=8, targets=["q", "expert_gate"])})
    for targets in (["kv_a", "o"], ["q_b", "expert_up", "o"]):
        with pytest.raises(PlanError, match=r"does not count these adapters yet"):
            deepseek_profile({"family": "deepseek", "lora": dict(rank=8, targets=targets)})


def test_a_block_before_the_first_adapted_one_keeps_only_what_its_input_less_backward_needs():
    """Adapters on the experts only, with a dense first layer (Qwen2-MoE): neither the dense layer nor the first
    MoE layer has an input that needs a gradient (nothing before them trains), so the replay counts both as a
    first block; the layer after does need one. Catches only layer 0 counted without its input's gradient."""
    from lightning_npu.plan import PlanSpec
    from lightning_npu.plan.replay import _StepReplay

    overrides = dict(QWEN2, n_layers=3)
    _, profile = _with_adapters("moe", overrides, dict(rank=8, targets=EXPERTS))
    spec = PlanSpec(model=profile.shape, profile=profile, seq_len=32, micro_batch=2, precision="32-true",
                    kernels="reference")
    step = _StepReplay(spec, 3, 2)
    tokens = step.tokens
    first = [sum(profile.block_profile(i).saved_by_first_block("reference", 4, 32).all.values()) * tokens
             for i in range(3)]
    later = [sum(profile.block_profile(i).saved_by_block("reference", 4, 32).all.values()) * tokens
             for i in range(3)]
    assert [saved for saved, _ in step.saved] == [first[0], first[1], later[2]]
    assert first[0] == 0 and first[1] < later[1]


@pytest.mark.parametrize("depths", [1, 2])
def test_multi_token_prediction_is_planned_with_the_parameters_and_units_the_model_has(depths):
    """Each depth is one more DeepSeekMoE block (an FSDP unit of its own, after the trunk's) and, in the root unit
    beside the one embedding and head it shares, its two input norms, eh_proj and head norm: per unit, the multiset
    of shapes is the model's, and the total is the model's and the config's. Activation checkpointing picks among
    the trunk's and the depths' blocks, as npu_fsdp's policy does (ratio 0.5 of 4 blocks: layers.1 and mtp.0.block).
    The planner before refused mtp_layers > 0."""
    from lightning_npu.facts.options import evenly_spaced
    from lightning_npu.plan import PlanSpec
    from recipes.models.deepseek.config import DeepSeekConfig
    from recipes.models.deepseek.memory_profile import lightning_npu_memory_profile as deepseek_profile
    from recipes.models.deepseek.model import DeepSeek, DeepSeekBlock

    config = DeepSeekConfig.from_preset("tiny", mtp_layers=depths)
    with torch.device("meta"):
        model = DeepSeek(config)
    profile = deepseek_profile({"family": "deepseek", "config": {"mtp_layers": depths}})
    blocks = [(name, module) for name, module in model.named_modules() if isinstance(module, DeepSeekBlock)]
    assert profile.n_blocks == len(blocks) == config.n_layers + depths
    for i, (_, block) in enumerate(blocks):
        assert Counter(profile.block_profile(i).block_parameters().shapes) == Counter(
            tuple(p.shape) for p in block.parameters())
    in_blocks = {id(p) for _, block in blocks for p in block.parameters()}
    assert Counter(profile.root_parameters().shapes) == Counter(
        tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks)
    assert profile.num_params() == sum(p.numel() for p in model.parameters()) == config.num_params()
    spec = PlanSpec(model=profile.shape, profile=profile, seq_len=64, micro_batch=1, ac_ratio=0.5)
    assert [blocks[i][0] for i in spec.checkpointed_layers] == [
        blocks[i][0] for i in evenly_spaced(len(blocks), 0.5)]
    assert depths > 1 or [blocks[i][0] for i in spec.checkpointed_layers] == ["layers.1", "mtp.0.block"]


@pytest.mark.parametrize("depths", [1, 2])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_multi_token_prediction_keeps_what_the_profile_counts(depths, precision):
    """What a training forward of DeepSeek's head side (``logits``: each depth's embedding of the tokens ahead, its
    norms, eh_proj, block, norm and head; then the final norm and head) and the depths' cross-entropies keep for
    backward on the reference path is the profile's count exactly: ``saved_by_mtp_depth``'s two parts, each depth's
    block (plus its router logits, which the layer keeps), the final norm's tensors and each depth's fp32
    log-softmax (the replay's logits). Catches the hidden state counted again for the depth's norm in fp32 (the
    final norm keeps that tensor already: +512 B per token) and the rolled ids or targets left out (-8 each)."""
    from recipes.models.deepseek.config import DeepSeekConfig
    from recipes.models.deepseek.memory_profile import lightning_npu_memory_profile as deepseek_profile
    from recipes.models.deepseek.model import DeepSeek

    config = DeepSeekConfig.from_preset("tiny", mtp_layers=depths)
    torch.manual_seed(0)
    model, dtype = DeepSeek(config).train(), torch.float32
    if precision == "bf16-mixed":
        model, dtype = model.to(torch.bfloat16), torch.bfloat16
    kernels = _kernels_context(precision, "reference")

    def forward(batch):
        tokens = torch.randint(0, config.vocab_size, (batch, BLOCK_SEQ))
        model.embed(tokens, None, 0, None, None)  # what the depths read: the tokens, the rotary tables
        h = torch.randn(batch, BLOCK_SEQ, config.dim, dtype=dtype, requires_grad=True)  # the trunk's output
        with kernels():
            return model.logits(h), model.multi_token_loss(tokens)

    measured = _kept_bytes_per_token(forward, model, (2, 4), BLOCK_SEQ)
    measured += depths * 4 * config.n_experts  # each depth's router logits, kept by its layer
    profile = deepseek_profile({"family": "deepseek", "config": {"mtp_layers": depths}})
    act_bytes = 4 if precision == "32-true" else 2
    depth = sum(sum(part.values()) for part in profile.saved_by_mtp_depth("reference", act_bytes))
    block = sum(profile.block_profile(config.n_layers).saved_by_block("reference", act_bytes, BLOCK_SEQ).all.values())
    log_softmax = 4 * config.vocab_size
    assert measured == depths * (depth + block + log_softmax) + profile.saved_by_final_norm("reference", act_bytes)


def test_multi_token_prediction_is_refused_where_the_recipe_or_the_planner_cannot_run_it():
    """Context parallelism (the model refuses it: a depth reads tokens another rank holds), tensor parallelism (no
    plan for the depths, nor for MLA), and a LoRA run (the depths stay frozen without adapters, not modelled): each
    refusal names the value, why, and what to plan instead."""
    from lightning_npu.facts.options import FSDPOptions
    from lightning_npu.plan import PlanSpec
    from recipes.models.deepseek.memory_profile import lightning_npu_memory_profile as deepseek_profile

    model = {"family": "deepseek", "config": {"mtp_layers": 1}}
    with pytest.raises(ValueError, match=r"mtp_layers=1 with model.lora: the planner counts multi-token prediction in"
                                         r" full training only .* plan the LoRA run with mtp_layers=0"):
        deepseek_profile({**model, "lora": dict(rank=8, targets=["o"])})
    profile = deepseek_profile(model)
    with pytest.raises(PlanError, match=r"context_parallel_size=2: model.config.mtp_layers=1: multi-token prediction"
                                        r" reads .* train it with context_parallel_size=1, or set mtp_layers=0"):
        PlanSpec(model=profile.shape, profile=profile, seq_len=64, micro_batch=1, devices=2,
                 options=FSDPOptions(context_parallel_size=2))
    with pytest.raises(PlanError, match=r"tensor_parallel_size=2 cannot split .* mtp_layers=1: the"
                                        r" multi-token-prediction modules have no tensor-parallel plan"):
        PlanSpec(model=profile.shape, profile=profile, seq_len=64, micro_batch=1, devices=2,
                 options=FSDPOptions(tensor_parallel_size=2))


def _heavy_experts_spec(ep: int, devices: int = 4, **changes):
    """A tiny MoE whose experts outweigh the rest of each block (16 experts of width 512), fp32, as the CPU runs it."""
    from lightning_npu.plan import PlanSpec

    profile = lightning_npu_memory_profile({"family": "moe", "preset": "tiny",
                                            "config": dict(n_experts=16, expert_hidden_dim=512)})
    settings = dict(model=profile.shape, profile=profile.with_expert_parallelism(ep), seq_len=32, micro_batch=2,
                    devices=devices, precision="32-true", kernels="reference", optimizer="per-tensor",
                    hccl_buffsize_mb=0.0, workspace_gib=0.0, fragmentation=0.0)
    return PlanSpec(**{**settings, **changes})


def _most_gathered(spec) -> float:
    """The most bytes of gathered parameters the replay of ``spec`` holds at any moment."""
    from lightning_npu.plan import replay

    most = [0.0]

    class Tracking(replay._Timeline):
        def alloc(self, item, nbytes, phase):
            super().alloc(item, nbytes, phase)
            most[0] = max(most[0], self.now["gathered"])

    step = replay._StepReplay(spec, spec.zero_stage, spec.micro_batch)
    step.timeline = Tracking()
    step.run()
    return most[0]


def test_under_expert_parallelism_the_experts_are_an_fsdp_unit_of_their_own():
    """npu_fsdp shards each layer's experts as an FSDP unit of their own (on the experts' mesh), nested in the
    block's: under ZeRO-3 they are gathered when the MLP reaches them and freed after it, and backward prefetches the
    previous block's own parameters while a layer's experts compute, so no two layers' experts are ever gathered
    together. Most held: the root, a block's own parameters and its experts, plus the experts' flat all-gather
    buffer (forward) or the previous block's prefetched parameters (backward). Catches the experts gathered with
    their block (two whole blocks at once in backward: the planner before this was +5.0% on this shape under ep 2 and
    +7.5% under ep 2 x cp 2, measured on the CPU)."""
    from lightning_npu.plan.replay import _units

    spec = _heavy_experts_spec(ep=2)
    units = _units(spec)
    root, block, experts = units.root, units.blocks[1], units.experts[1]
    assert experts is not None and experts.group == 2 and block.group == 4  # 4 ranks; 2 hold each half of the experts
    config = MoEConfig.from_preset("tiny", n_experts=16, expert_hidden_dim=512)
    assert experts.exact == 8 * 3 * 512 * config.dim  # the rank's 8 experts, gate/up and down
    gathered = [unit.padded * 4 for unit in (root, block, experts)]
    assert _most_gathered(spec) == gathered[0] + gathered[1] + gathered[2] + max(gathered[1], gathered[2])
    # The sharded states count each unit once: 8 experts over 2 ranks are 16 over 4.
    assert state_bytes(spec)["parameters"] == 4 * sum(unit.shard for unit in units.all) \
        == state_bytes(_heavy_experts_spec(ep=1))["parameters"]


@pytest.mark.parametrize("overrides", [{}, dict(q_lora_rank=None)], ids=["v3_query_low_rank", "no_query_low_rank"])
@pytest.mark.parametrize("layer", [0, 1], ids=["dense_layer", "moe_layer"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_deepseek_block_activation_count_matches_the_tensors_autograd_saves(overrides, layer, precision):
    """What one DeepSeek block (MLA, then its dense MLP or DeepSeekMoE) keeps for backward on the reference path is
    the profile's count exactly. Catches a sigmoid gate counted on DeepSeek's ungated shared experts (+516 B per
    token), the fp32 key/value norm's input counted at kv_lora_rank although it is a view of wkv_a's output, whose
    storage holds the rotary key too (-64), and the group-limited choice's tensors counted as kept (the top-k values
    they feed are dropped, and the nodes with them)."""
    from recipes.models.deepseek.config import DeepSeekConfig
    from recipes.models.deepseek.memory_profile import lightning_npu_memory_profile as deepseek_profile
    from recipes.models.deepseek.model import DeepSeek

    config = DeepSeekConfig.from_preset("tiny", **overrides)
    torch.manual_seed(0)
    model = DeepSeek(config)
    measured = _model_block_saved_bytes(model, layer, precision)
    if layer >= config.first_k_dense:
        measured += 4 * config.n_experts  # router_logits, kept by the layer (as for the MoE family)
    profile = deepseek_profile({"family": "deepseek", "preset": "tiny", "config": overrides})
    act_bytes = 4 if precision == "32-true" else 2
    assert measured == sum(profile.block_profile(layer).saved_by_block("reference", act_bytes, BLOCK_SEQ).all.values())


@pytest.mark.slow  # starts a process
def test_moe_and_deepseek_blocks_under_context_parallelism_keep_what_the_profiles_count():
    """The recipe's DeepSeek block (MLA: dense and MoE layers, with and without the query low rank) and MoE block as
    rank 0 of a context-parallel pair (tests/plan/scripts/plan_moe_saved.py: fake process group, a ContextParallel on
    the attention) keep exactly the bytes per token of the rank's own that the profiles count, Ulysses and ring,
    fp32 and bf16-mixed. Catches MLA's ring planned as its plain kernel (the padded q, k, v, the qk-wide output and
    log-sum-exp in place of the ring's q, k, wkv_b's output, fp32 output and row statistics: +496 B per token of
    the dense layer in fp32, -272 in bf16)."""
    proc = run_python([str(SCRIPTS / "plan_moe_saved.py")], simulate=None)
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 16
    for row in rows:
        assert row["measured"] == row["predicted"], row


@pytest.mark.parametrize("algo", ["ulysses", "ring"])
def test_expert_parallelism_with_context_parallelism_splits_the_experts_and_the_tokens(tmp_path, algo):
    """ep 2 x cp 2 on 4 devices (npu_fsdp: expert parallelism borrows its ranks from dp_shard x cp, ep innermost):
    each rank holds 4 of the 8 experts, FSDP-sharded over the 2 ranks of dp_shard x cp that hold the same ones
    (dp_shard x cp / ep), the rest of each block over all 4; it computes seq / cp tokens of each sequence, whose
    routed rows its all-to-alls send and receive; the communicators are the world's (FSDP's dp_shard x cp here),
    the cp group, the expert group and FSDP's group over the experts' mesh. Fails on the planner before, which
    refused expert parallelism with context parallelism."""
    from lightning_npu.plan.replay import _StepReplay, _units

    ep_cp = _tiny_moe_spec(tmp_path, expert_parallel_size=2, context_parallel_size=2, context_parallel_algo=algo)
    cp = _tiny_moe_spec(tmp_path, context_parallel_size=2, context_parallel_algo=algo)
    plain = _tiny_moe_spec(tmp_path)
    assert (ep_cp.shard_group, ep_cp.local_seq_len, plain.local_seq_len) == (4, 64, 128)
    config = MoEConfig.from_preset("tiny")
    units = _units(ep_cp)
    layer = config.moe_layers[0]
    assert units.experts[layer].group == 2 and units.blocks[layer].group == 4
    assert units.experts[layer].exact == 4 * 3 * config.expert_hidden_dim * config.dim
    assert state_bytes(ep_cp) == state_bytes(cp) == state_bytes(plain)  # 8 experts over 4 ranks = 4 over 2
    ep_step, cp_step = _StepReplay(ep_cp, 3, 8), _StepReplay(cp, 3, 8)
    assert ep_step.tokens == cp_step.tokens == 8 * 64
    assert ep_step.saved == cp_step.saved  # the experts keep the same per token, whoever holds them
    a2a = 2 * 4 * config.top_k * config.dim  # the send and receive buffers of the rank's routed rows, fp32
    assert (ep_step.layers[layer].forward_scratch("reference", 4, 128, False)
            - cp_step.layers[layer].forward_scratch("reference", 4, 128, False)) == a2a
    buffers = 2 * 200 * 2**20
    assert estimate(ep_cp).items["comm"] == 4 * buffers and estimate(cp).items["comm"] == 2 * buffers


# ------------------------------------------------------------------------------------------- tensor parallelism
# The parallel core's design for MoE under tensor_parallel_size (issue 33; npu_fsdp refuses it until it lands on
# main): attention and dense MLPs split as today; an MoE layer routes the tokens gathered over the TP group on every
# TP rank (router replicated), splits its shared expert like a dense MLP, runs each TP rank's 1/tp share of the routed
# rows on whole experts (expert parallelism borrowing its ranks from dp_shard x cp x tp, ep innermost; the experts
# FSDP-sharded over dp_shard x cp x tp / ep) and all-gathers the rows' outputs over the TP group.


def _tp_spec(tp: int = 2, ep: int = 1, devices: int = 2, overrides: dict = QWEN2, **options):
    from lightning_npu.facts.options import FSDPOptions
    from lightning_npu.plan import PlanSpec

    profile = lightning_npu_memory_profile({"family": "moe", "preset": "tiny", "config": overrides})
    return PlanSpec(model=profile.shape, profile=profile.with_expert_parallelism(ep), seq_len=64, micro_batch=2,
                    devices=devices, precision="32-true", kernels="reference",
                    options=FSDPOptions(tensor_parallel_size=tp, **options))


def test_tensor_parallelism_splits_an_moe_layer_s_attention_and_shared_expert_not_its_routed_experts():
    """tp 2 on 2 devices, a Qwen2-MoE (shared expert, dense first layer): attention's projections and the shared
    expert split like a dense MLP (gate/up rows, down columns), the router and the shared expert's gate whole; the
    routed experts whole (all 8), on the experts' own mesh of dp_shard x cp x tp = 2 ranks; the dense layer's MLP
    split as the decoder's. Fails on the planner before, which refused tensor parallelism on MoE models."""
    from lightning_npu.plan import RankLocalShape
    from lightning_npu.plan.replay import _units

    spec = _tp_spec()
    config = MoEConfig.from_preset("tiny", **QWEN2)
    d, f, q = config.dim, config.expert_hidden_dim, config.n_heads * config.head_dim
    shared = config.shared_expert_hidden_dim
    moe_layer = spec.profile.block_profile(1).block_parameters()
    assert moe_layer.attention[1] == (q // 2, d)  # wq's rows split
    assert moe_layer.mlp_input[:2] == ((d,), (config.n_experts, d))  # ffn_norm and router whole
    experts = [shape for shape in moe_layer.shapes if isinstance(shape, RankLocalShape)]
    assert [tuple(shape) for shape in experts] == [(8, 2 * f, d), (8, d, f)]
    assert {(shape.replicas, shape.spread) for shape in experts} == {(1, 2)}
    assert moe_layer.mlp_input[3:] == ((shared // 2, d), (shared // 2, d), (1, d))
    assert (d, shared // 2) in moe_layer.mlp_output
    dense = spec.profile.block_profile(0).block_parameters()
    assert dense.mlp_input[1:] == ((config.dense_hidden_dim // 2, d),) * 2
    units = _units(spec)
    assert (spec.shard_group, units.experts[1].group, units.experts[0]) == (1, 2, None)
    assert spec.profile.num_params() == config.num_params()


@pytest.mark.parametrize(("devices", "tp", "ep", "cp", "group"), [
    (2, 2, 2, 1, 1),  # ep is the tp group: each rank holds 4 experts, FSDP over 2 x 1 / 2 = 1 rank
    (4, 2, 2, 1, 2),  # dp_shard 2 x tp 2 / ep 2 = 2 ranks hold the same 4 experts
    (4, 2, 4, 1, 1),
    (8, 2, 2, 2, 4),  # dp_shard 2 x cp 2 x tp 2 / ep 2
])
def test_expert_parallelism_under_tensor_parallelism_borrows_the_tensor_parallel_ranks(devices, tp, ep, cp, group):
    """Each rank holds n_experts / ep whole experts, FSDP-sharded over dp_shard x cp x tp / ep ranks, so the
    sharded states equal plain sharding's experts' over the world; its all-to-alls send and receive its 1/tp share
    of the routed rows. Fails on the planner before, which refused tensor parallelism on MoE models."""
    from lightning_npu.plan.replay import _units

    spec = _tp_spec(tp=tp, ep=ep, devices=devices, overrides={}, context_parallel_size=cp)
    config = MoEConfig.from_preset("tiny")
    units = _units(spec)
    layer = config.moe_layers[0]
    assert units.experts[layer].group == group
    assert units.experts[layer].exact == config.n_experts // ep * 3 * config.expert_hidden_dim * config.dim
    experts = len(config.moe_layers) * 3 * config.n_experts * config.expert_hidden_dim * config.dim
    assert units.experts[layer].shard * devices == experts // len(config.moe_layers)
    assert spec.profile.all_to_all_bytes(4) == 2 * 4 * config.top_k * config.dim / tp


def test_an_moe_layer_under_tensor_parallelism_keeps_its_share_of_the_routed_rows():
    """Per token of a rank's own under tp 2 (sequence parallelism): the norm's tensors split by sequence; the
    router's input (the gathered tokens), logits and top-k, the indices and the unpermute's rows whole (every TP
    rank routes and unpermutes every row); the experts' input and SwiGLU interiors halved (the rank's 1/tp share of
    the rows); the shared expert's interiors halved (split like a dense MLP)."""
    plain, split = (_tp_spec(tp=tp).profile for tp in (1, 2))
    whole = plain.block_profile(1).mlp_saved("reference", 4, True)
    half = split.block_profile(1).mlp_saved("reference", 4, True)
    assert set(whole) == set(half)
    for name, value in whole.items():
        if name.startswith(("ffn_norm", "experts'", "permuted rows", "shared expert gate/up", "shared expert silu",
                            "shared expert swiglu")):
            assert half[name] == value / 2, name
        else:
            assert half[name] == value, name


def test_tensor_parallelism_on_moe_models_is_refused_where_the_design_cannot_split_them():
    """A shared expert or dense width the tensor-parallel ranks cannot split, an expert_parallel_size that does
    not divide dp_shard x cp x tp, hybrid sharding with experts split, and DeepSeek's MLA (no TP plan yet)."""
    from lightning_npu.facts.options import FSDPOptions
    from lightning_npu.plan import PlanSpec
    from recipes.models.deepseek.memory_profile import lightning_npu_memory_profile as deepseek_profile

    with pytest.raises(PlanError, match=r"shared_expert_hidden_dim=50 is not divisible by tensor_parallel_size=4"):
        _tp_spec(tp=4, devices=4, overrides=dict(QWEN2, shared_expert_hidden_dim=50))
    with pytest.raises(PlanError, match=r"expert_parallel_size=4 does not divide dp_shard=1 x context_parallel_size=1"
                                        r" x tensor_parallel_size=2 = 2"):
        _tp_spec(tp=2, ep=4, devices=2, overrides={})
    moe = lightning_npu_memory_profile({"family": "moe", "preset": "tiny"}).with_expert_parallelism(2)
    with pytest.raises(PlanError, match=r"expert_parallel_size=2 works with sharding='full' only"):
        PlanSpec(model=moe.shape, profile=moe, seq_len=64, micro_batch=1, devices=2, nodes=2,
                 options=FSDPOptions(sharding="hybrid", tensor_parallel_size=2))
    deepseek = deepseek_profile({"family": "deepseek", "preset": "tiny"})
    with pytest.raises(PlanError, match=r"its attention is MLA, which the recipe's tensor-parallel plan does not"):
        PlanSpec(model=deepseek.shape, profile=deepseek, seq_len=64, micro_batch=1, devices=2,
                 options=FSDPOptions(tensor_parallel_size=2))


def test_the_plan_names_its_expert_parallelism(tmp_path, capsys):
    """The table's header and the JSON report say expert_parallel_size next to tensor and context parallelism."""
    from lightning_npu.cli import main

    config = _tiny_moe_config(tmp_path, expert_parallel_size=2, tensor_parallel_size=2)
    assert main(["plan", "--config", str(config)]) == 0
    assert "tensor parallel 2 (sequence parallel, loss parallel), expert parallel 2," in capsys.readouterr().out
    assert main(["plan", "--config", str(config), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["expert_parallel_size"], plan["parallel"]["tensor"]) == (2, 2)
