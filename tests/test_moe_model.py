"""The MoE family against Hugging Face transformers: tiny random Mixtral, Qwen2-MoE (a shared expert, a dense layer
through mlp_only_layers, qkv biases) and Qwen3-MoE (q/k norms, head_dim != hidden / heads, decoder_sparse_step)
models imported into the recipe's model give transformers' fp32 logits, router logits, weight gradients, load-balancing
loss and greedy tokens; the per-expert (saved) and stacked (in-memory) layouts import to the same weights; exports
are what save_pretrained writes and load back."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch.nn import functional as F
from safetensors.torch import load_file, save_file

from recipes import families
from recipes.decoder import hf_checkpoint
from recipes.decoder.checkpoint_layout import CheckpointError
from recipes.decoder.module import DecoderLM
from recipes.generate import generate, load_model
from recipes.models.moe import hf as moe_hf
from recipes.models.moe.config import MoEConfig
from recipes.models.moe.model import MoE
from recipes.decoder.router import load_balancing_loss
from tests.hf_models import random_hf_model, random_tokens, saved

_COMMON = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               rms_norm_eps=1e-6, num_experts_per_tok=2)
HF_MODELS = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_hidden_layers=2, intermediate_size=24, num_local_experts=4)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                       shared_expert_intermediate_size=40, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_hidden_layers=4, head_dim=16, intermediate_size=48, moe_intermediate_size=24, num_experts=5,
                       decoder_sparse_step=2, norm_topk_prob=True)),
}
# A layer index past the dense ones of each model, and the layers whose MLP is an MoE.
MOE_LAYERS = {"mixtral": [0, 1], "qwen2_moe": [0, 2], "qwen3_moe": [1, 3]}


def hf_model(arch: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_class, model_class, fields = HF_MODELS[arch]
    return random_hf_model(config_class, model_class, {**_COMMON, **fields}, seed=seed)


def tokens(seed: int = 1, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return random_tokens(_COMMON["vocab_size"], seed=seed, batch=batch, seq=seq)


def recipe_model(path) -> MoE:
    config, state_dict = hf_checkpoint.load_hf_checkpoint(path)
    model = MoE(config)
    model.load_state_dict(state_dict)
    return model.eval()


@pytest.mark.parametrize("arch", sorted(HF_MODELS))
def test_imported_model_gives_transformers_logits_router_logits_and_gradients(tmp_path, arch):
    hf = hf_model(arch)
    ours = recipe_model(saved(hf, tmp_path / "hf"))
    assert ours.config.architecture == arch and ours.config.moe_layers == MOE_LAYERS[arch]
    ids = tokens()
    theirs = hf(ids, output_router_logits=True)
    logits, router_logits = ours(ids, output_router_logits=True)
    torch.testing.assert_close(logits, theirs.logits, rtol=0, atol=1e-5)
    assert len(router_logits) == len(theirs.router_logits) == len(MOE_LAYERS[arch])
    for mine, hf_logits in zip(router_logits, theirs.router_logits):
        torch.testing.assert_close(mine, hf_logits, rtol=0, atol=1e-5)
    # Training parity: the stacked experts' and router's gradients are transformers' (its per-expert loop).
    theirs.logits.square().mean().backward()
    logits.square().mean().backward()
    for layer in MOE_LAYERS[arch]:
        hf_mlp, mlp = hf.model.layers[layer].mlp, ours.layers[layer].feed_forward
        torch.testing.assert_close(mlp.experts.w_gate_up.grad, hf_mlp.experts.gate_up_proj.grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(mlp.experts.w_down.grad, hf_mlp.experts.down_proj.grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(mlp.router.weight.grad, hf_mlp.gate.weight.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", sorted(HF_MODELS))
def test_stacked_and_per_expert_checkpoints_import_to_the_same_weights(tmp_path, arch):
    """save_pretrained (transformers 5.24, like 4.x) writes one tensor per expert; the in-memory modules (and
    checkpoints written from them) hold them stacked. Both read to the same weights."""
    hf = hf_model(arch)
    per_expert_dir = saved(hf, tmp_path / "per_expert")
    stored = load_file(per_expert_dir / "model.safetensors")
    assert any(".experts.0." in key for key in stored) and not any("gate_up_proj" in key for key in stored)
    _, from_per_expert = hf_checkpoint.load_hf_checkpoint(per_expert_dir)
    stacked_dir = tmp_path / "stacked"
    stacked_dir.mkdir()
    hf.config.to_json_file(stacked_dir / "config.json")
    save_file({key: t.contiguous() for key, t in hf.state_dict().items()}, stacked_dir / "model.safetensors")
    _, from_stacked = hf_checkpoint.load_hf_checkpoint(stacked_dir)
    assert from_stacked.keys() == from_per_expert.keys()
    for name in from_stacked:
        assert torch.equal(from_stacked[name], from_per_expert[name]), name
    # An expert missing from a shard is named, not read as a smaller layer.
    del stored[next(key for key in stored if ".experts.3." in key)]
    save_file(stored, per_expert_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"of experts \[0, 1, 2(, 4)?\] in model\.layers\.\d\.mlp\.experts, but"):
        hf_checkpoint.load_hf_checkpoint(per_expert_dir)


@pytest.mark.parametrize("arch", sorted(HF_MODELS))
def test_export_loads_back_into_transformers_with_the_same_logits(tmp_path, arch):
    hf = hf_model(arch)
    config, state_dict = hf_checkpoint.load_hf_checkpoint(saved(hf, tmp_path / "hf"))
    hf_checkpoint.save_hf_checkpoint(config, state_dict, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == arch
    # The tensors save_pretrained writes, by the same names (one per expert: what transformers 4 and 5 load).
    ours, theirs = (load_file(tmp_path / d / "model.safetensors") for d in ("out", "hf"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(hf)
    ids = tokens(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)
    # The recipe's config survives the round trip exactly.
    assert hf_checkpoint.load_hf_checkpoint(tmp_path / "out")[0] == config


@pytest.mark.parametrize("arch", sorted(HF_MODELS))
def test_load_balancing_loss_is_transformers_aux_loss(tmp_path, arch):
    hf = hf_model(arch)
    # Training with the aux loss (the model copies the coefficient from its config when built).
    hf.config.output_router_logits = True
    hf.config.router_aux_loss_coef = hf.router_aux_loss_coef = 0.25
    ours = recipe_model(saved(hf, tmp_path / "hf"))
    assert ours.config.router_aux_loss_coef == 0.25
    ids = tokens(seed=3, batch=3, seq=10)
    with torch.no_grad():
        theirs = hf(ids, labels=ids)
        _, router_logits = ours(ids, output_router_logits=True)
    aux = load_balancing_loss(router_logits, ours.config.top_k)
    torch.testing.assert_close(aux, theirs.aux_loss, rtol=0, atol=1e-6)
    # What training adds to the cross-entropy is what transformers adds to its loss.
    cross_entropy = F.cross_entropy(theirs.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(ours.auxiliary_loss(), theirs.loss - cross_entropy, rtol=0, atol=1e-6)


def test_the_training_loss_adds_the_weighted_load_balancing_loss():
    module = DecoderLM(family="moe", preset="tiny", config={"n_layers": 2, "router_aux_loss_coef": 0.5})
    module.configure_model()
    ids = tokens(seed=5, batch=2, seq=16) % module.config.vocab_size
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    loss = module._loss(batch)
    logits, router_logits = module.model(batch["input_ids"], output_router_logits=True)
    cross_entropy = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    aux = load_balancing_loss(router_logits, module.config.top_k)
    assert aux > 0.9  # n_experts * sum f * P is 1 when balanced, more when not
    torch.testing.assert_close(loss, cross_entropy + 0.5 * aux, rtol=0, atol=1e-6)
    loss.backward()
    assert module.model.layers[0].feed_forward.router.weight.grad.abs().sum() > 0


def test_the_load_balancing_loss_summed_over_ranks_is_the_whole_batch_s_value_and_gradient():
    """Two ranks each route a part of the tokens (the halves of every sequence, as under context parallelism), and
    their counts are summed as the strategy's all-reduce sums them: each rank's loss is the whole batch's, and the
    mean of their gradients (what FSDP averages) is the whole batch's gradient. On its own tokens a rank's loss
    differs: the loss is a product of two token means, so the mean of the parts' losses is not the whole's."""
    logits = torch.randn(2, 24, 8, generator=torch.Generator().manual_seed(0)) * 2
    whole_logits = logits.flatten(0, 1).requires_grad_()
    whole = load_balancing_loss([whole_logits], top_k=2)
    whole.backward()
    parts = [part.flatten(0, 1).detach().requires_grad_() for part in logits.chunk(2, dim=1)]
    sent: list[torch.Tensor] = []
    for part in parts:  # what each rank contributes to the all-reduce
        load_balancing_loss([part], top_k=2, sum_over_ranks=lambda local: sent.append(local) or local)
    summed = sent[0] + sent[1]
    losses = [load_balancing_loss([part], top_k=2, sum_over_ranks=lambda local: summed) for part in parts]
    for loss in losses:
        torch.testing.assert_close(loss, whole.detach(), rtol=0, atol=1e-6)
        loss.backward()
    averaged = torch.cat([part.grad for part in parts]) / 2
    order = torch.arange(48).view(2, 24).chunk(2, dim=1)  # the parts' tokens in the whole batch's order
    torch.testing.assert_close(averaged, whole_logits.grad[torch.cat([o.flatten() for o in order])], rtol=0,
                               atol=1e-7)
    own = sum(load_balancing_loss([part.detach()], top_k=2) for part in parts) / 2
    assert abs(own - whole.detach()) > 1e-3


@pytest.mark.parametrize("arch", sorted(HF_MODELS))
def test_greedy_generation_from_an_hf_directory_is_transformers(tmp_path, arch):
    hf = hf_model(arch)
    model, _ = load_model(saved(hf, tmp_path / "hf"))
    prompt = tokens(seed=4, batch=2, seq=5)
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, prompt, 8), expected)


def test_hf_configs_the_model_cannot_hold_are_refused():
    base = json.loads(hf_model("mixtral").config.to_json_string())
    for change, message in [
        ({"sliding_window": 16}, r"sliding_window=16; the recipe's attention is full causal"),
        ({"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, r"rope_type='yarn'"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            moe_hf.config_from_hf({**base, **change})
    qwen3 = json.loads(hf_model("qwen3_moe").config.to_json_string())
    with pytest.raises(CheckpointError, match=r"attention_bias=true"):
        moe_hf.config_from_hf({**qwen3, "attention_bias": True})


def test_config_rules_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"norm_topk_prob=False, but mixtral models have norm_topk_prob=True"):
        MoEConfig.from_preset("tiny", architecture="mixtral", norm_topk_prob=False)
    with pytest.raises(ValueError, match=r"shared_expert_hidden_dim=64, but qwen3_moe models"):
        MoEConfig.from_preset("tiny", shared_expert_hidden_dim=64)
    with pytest.raises(ValueError, match=r"top_k=9 exceeds n_experts=8"):
        MoEConfig.from_preset("tiny", top_k=9)
    with pytest.raises(ValueError, match=r"layers \[1\] are dense .* give their MLP width"):
        MoEConfig.from_preset("tiny", dense_layers=[1])
    with pytest.raises(ValueError, match=r"leave no MoE layer"):
        MoEConfig.from_preset("tiny", dense_layers=[0, 1, 2, 3], dense_hidden_dim=64)
    with pytest.raises(ValueError, match=r"'moe' is not a model family|architecture='moe' is unknown"):
        MoEConfig.from_preset("tiny", architecture="moe")


def test_stacked_experts_are_one_parameter_per_projection_and_the_counts_agree():
    config = MoEConfig.from_preset("tiny")
    model = MoE(config)
    expert_params = [name for name, _ in model.named_parameters() if ".experts." in name]
    assert len(expert_params) == 2 * len(config.moe_layers)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    per_layer_experts = 3 * config.dim * config.expert_hidden_dim * len(config.moe_layers)
    assert config.num_params() - config.active_params() == (config.n_experts - config.top_k) * per_layer_experts
    assert families.of_config(config) is families.get("moe")
    assert families.of_hf_model_type("qwen2_moe") is families.get("moe")


def test_lora_on_attention_keeps_the_qkv_biases_and_refuses_the_experts(tmp_path):
    from recipes.decoder.lora import add_lora
    from recipes.decoder.lora_config import LoRAConfig

    ours = recipe_model(saved(hf_model("qwen2_moe"), tmp_path / "hf"))
    ids = tokens(seed=6)
    with torch.no_grad():
        before = ours(ids)
        add_lora(ours, LoRAConfig(targets=("q", "k", "v", "o")))
        after = ours(ids)  # fresh adapters (B = 0) change nothing: the base, biases included, is intact
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert not ours.layers[0].attention.wq.bias.requires_grad
    with pytest.raises(ValueError, match=r"gate"):
        add_lora(recipe_model(tmp_path / "hf"), LoRAConfig(targets=("q", "gate")))


@pytest.mark.parametrize(("preset", "total", "active"), [("mixtral-8x7b", 46.7e9, 12.9e9),
                                                         ("qwen3-30b-a3b", 30.5e9, 3.3e9)])
def test_real_size_presets_have_transformers_parameter_count_and_the_published_sizes(preset, total, active):
    config = MoEConfig.from_preset(preset)
    hf_config = transformers.AutoConfig.for_model(**moe_hf.hf_config_dict(config, dtype=torch.bfloat16))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in hf.parameters()) == config.num_params()
    # The published figures, given to one decimal of a billion (3.35B active is Qwen's "3.3B").
    assert abs(config.num_params() - total) < 0.06e9 and abs(config.active_params() - active) < 0.06e9


def test_activation_checkpointing_recompute_keeps_the_forward_s_router_logits(monkeypatch):
    """The recompute of a checkpointed MoE block inside backward must not replace the layer's ``router_logits``:
    the recomputed tensor would keep the block's recomputed graph, and every tensor it saved, alive until the next
    forward (4.6 MiB per tiny layer, the attention half's activations: lightning-npu plan was 21% low on a fully
    checkpointed tiny MoE before)."""
    from torch.utils.checkpoint import DefaultDeviceType, checkpoint

    # CPU tensors: checkpoint saves the RNG state of its default device, cached from the first current accelerator
    # (another test's simulated NPU, whose torch.npu module is gone by now).
    monkeypatch.setattr(DefaultDeviceType, "_default_device_type", "cpu")
    config = MoEConfig.from_preset("tiny", n_layers=2)
    model = MoE(config)
    for block in model.layers:
        block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(block.forward)
    logits = model(tokens(batch=2, seq=16))
    forward_logits = [layer.feed_forward.router_logits for layer in model.layers]
    (logits.float().mean() + model.auxiliary_loss()).backward()
    assert all(layer.feed_forward.router_logits is kept for layer, kept in zip(model.layers, forward_logits))
    assert model.layers[0].feed_forward.experts.w_gate_up.grad is not None


def test_flops_per_token_count_the_active_experts_and_lora_leaves_them_positive():
    """MFU's FLOPs per token: 6 x the active non-embedding parameters (top_k routed experts, router; not all 128)
    plus attention, and under LoRA 2 FLOPs less per *active* frozen weight. Catches the LoRA correction subtracting
    2 x every parameter, which made Qwen3-30B-A3B's FLOPs per token negative (telemetry then reports no MFU)."""
    config = MoEConfig.from_preset("qwen3-30b-a3b")
    active = config.active_params(include_embedding=False)
    attention = 12 * config.n_layers * 4096 * config.n_heads * config.head_dim
    assert config.flops_per_token(4096) == 6 * active + attention
    assert active < config.num_params(include_embedding=False) / 8
    lora = {"rank": 16, "targets": ["q", "k", "v", "o"]}
    full = DecoderLM(family="moe", preset="qwen3-30b-a3b").flops_per_token
    adapted = DecoderLM(family="moe", preset="qwen3-30b-a3b", init_from="base", lora=lora).flops_per_token
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    adapters = config.n_layers * 16 * ((config.dim + q) + 2 * (config.dim + kv) + (q + config.dim))
    assert full - adapted == 2 * active - 6 * adapters
    assert adapted > 0


def test_expert_load_is_max_over_mean_tokens_per_expert_in_the_worst_layer():
    from recipes.decoder.router import expert_load

    balanced = torch.eye(4).repeat(8, 1)  # 32 tokens, each expert first for 8 of them: top-1 perfectly even
    skewed = torch.tensor([[3.0, 2.0, 0.0, 0.0]]).repeat(32, 1)  # top-2 always experts 0 and 1
    assert expert_load([balanced], 1).item() == 1.0
    assert expert_load([balanced, skewed], 2).item() == 2.0  # counts [32, 32, 0, 0] over their mean 16
    assert expert_load([skewed], 1).item() == 4.0 and not expert_load([skewed.requires_grad_()], 1).requires_grad


# --------------------------------------------------------------------------------------------------------------
# Auxiliary-loss-free balancing (router_bias_update_rate)
# --------------------------------------------------------------------------------------------------------------


def test_a_balancing_bias_changes_which_experts_are_chosen_but_not_their_weights():
    """Catches a bias that also shifts the gate weights (they must stay the softmax's) or that is ignored."""
    from recipes.decoder.router import route

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.5]])
    scores = torch.softmax(logits, dim=-1)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # pushes expert 3 into every token's top 2
    probs, ids = route(logits, 2, normalise=False, bias=bias)
    assert (ids == 3).any(dim=-1).all()
    torch.testing.assert_close(probs, scores.gather(-1, ids))
    plain_probs, plain_ids = route(logits, 2, normalise=False)
    assert not (plain_ids == 3).any()
    normalised, _ = route(logits, 2, normalise=True, bias=bias)
    torch.testing.assert_close(normalised.sum(dim=-1), torch.ones(2))


def test_the_bias_moves_by_the_rate_towards_the_mean_load():
    from recipes.decoder.router import Router

    router = Router(8, 4, balancing_bias=True)
    assert torch.equal(router.expert_bias, torch.zeros(4)) and "expert_bias" in router.state_dict()
    router.balance(torch.tensor([10, 0, 5, 5]), 0.01)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert "expert_bias" not in Router(8, 4).state_dict()  # off: checkpoints keep their old layout


def test_aux_loss_free_balancing_evens_the_load_of_a_skewed_router():
    """Training steps with router_bias_update_rate on a router that sends most tokens to one expert: the load
    (max / mean tokens per expert) falls, and without the rate it does not. Catches an update of the wrong sign, a
    count from the wrong choices, and a bias the forward ignores."""
    def loads(rate: float) -> list[float]:
        torch.manual_seed(0)
        model = MoE(MoEConfig.from_preset("tiny", n_layers=1, router_aux_loss_coef=0.0, router_bias_update_rate=rate))
        router = model.layers[0].feed_forward.router
        with torch.no_grad():
            router.weight[0] += 0.5 * torch.randn(model.config.dim).sign()  # expert 0 scores high for many tokens
        ids = tokens(seed=3, batch=4, seq=32) % model.config.vocab_size
        history = []
        for _ in range(40):
            model(ids)
            history.append(float(model.expert_load()))
            model.balance_experts(lambda routed: routed)
        return history

    balanced, plain = loads(0.005), loads(0.0)
    assert plain[-1] == pytest.approx(plain[0]) and plain[0] > 2.0  # skewed, and nothing moves without the rate
    assert sum(balanced[-10:]) / 10 < 0.9 * balanced[0]


def test_the_balancing_bias_moves_once_per_optimizer_step_on_the_tokens_of_all_its_micro_batches():
    """The recipe's module moves the bias after each batch that ended with an optimizer step, with the tokens of the
    micro-batches it accumulated counted together (not once per micro-batch), and the bias is part of the model's
    state (checkpoints, resume). The Trainer's hooks are called as its fit loop calls them, two micro-batches a step."""
    from types import SimpleNamespace

    module = DecoderLM(family="moe", preset="tiny",
                       config={"n_layers": 2, "router_aux_loss_coef": 0.0, "router_bias_update_rate": 0.01})
    module.configure_model()
    trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(reduce=lambda tensor, reduce_op: tensor))
    module._trainer = trainer
    moves = []
    balance = module.model.balance_experts

    def counted(reduce):
        routed = [module.model.layers[i].feed_forward.routed for i in module.config.moe_layers]
        moves.append((trainer.global_step, [int(r.sum()) for r in routed]))
        balance(reduce)

    module.model.balance_experts = counted
    ids = tokens(seed=4, batch=6, seq=17) % module.config.vocab_size
    for index, row in enumerate(ids):
        batch = {"input_ids": row[None, :-1], "labels": row[None, 1:]}
        module.on_train_batch_start(batch, index)
        module._loss(batch).backward()
        if index % 2 == 1:  # the second micro-batch of each step ends with the optimizer step
            trainer.global_step += 1
        module.on_train_batch_end(None, batch, index)
    choices = 2 * 16 * module.config.top_k  # two micro-batches of 16 tokens, top_k experts each
    assert moves == [(1, [choices] * 2), (2, [choices] * 2), (3, [choices] * 2)]
    bias = module.model.layers[1].feed_forward.router.expert_bias
    assert bias.abs().sum() > 0 and torch.allclose((bias / 0.01).round(), bias / 0.01, atol=1e-4)
    assert torch.equal(module.state_dict()["model.layers.1.feed_forward.router.expert_bias"], bias)


def test_a_model_with_a_balancing_bias_is_not_exported_to_hugging_face():
    config = MoEConfig.from_preset("tiny", router_bias_update_rate=0.001)
    with pytest.raises(CheckpointError, match=r"router_bias_update_rate=0.001: this model picks its experts by score"
                                              r" plus a learned balancing bias.*Keep it as a recipe checkpoint"):
        moe_hf.hf_config_dict(config, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"router_bias_update_rate=-1 is invalid"):
        MoEConfig.from_preset("tiny", router_bias_update_rate=-1)


@pytest.mark.slow
def test_the_balancing_bias_stays_equal_on_every_rank_under_npu_fsdp(tmp_path):
    """Two ranks route different batches; the bias moves by the tokens both routed (summed over the ranks), so it
    stays the same on each. Catches a bias moved by each rank's own counts, which would drift apart silently."""
    from tests.helpers import SCRIPTS, read_json, run_python

    run_python([str(SCRIPTS / "moe_balancing_run.py"), str(tmp_path)], simulate=2)
    ranks = [read_json(tmp_path / f"rank{r}.json") for r in range(2)]
    assert ranks[0]["biases"] == ranks[1]["biases"]
    assert any(value != 0 for layer in ranks[0]["biases"] for value in layer)
    # The last step's moves were taken on the sum of both ranks' counts, which differ rank by rank.
    assert ranks[0]["routed"] != ranks[1]["routed"]
