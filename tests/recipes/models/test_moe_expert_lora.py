"""LoRA on the stacked experts of the MoE family (``lora.targets`` expert_gate, expert_up, expert_down): per-expert
adapters stacked as the experts are, applied inside the grouped matmuls, against a loop of per-expert Linear
layers with their own LoRA; training, and the merged export."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from recipes.decoder.lora import LoRAConfig, add_lora, is_adapter_name, merged_state_dict
from recipes.models.moe.config import MoEConfig
from recipes.models.moe.model import MoE
from tests.hf_models import assert_lora_exports_give_the_recipe_logits, with_random_adapters

EXPERTS = ("expert_gate", "expert_up", "expert_down")


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return MoE(MoEConfig.from_preset("tiny", n_layers=2, **overrides))


def test_fresh_expert_adapters_change_nothing_and_only_adapters_train():
    model = _model()
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        before = model(tokens)
        add_lora(model, LoRAConfig(rank=4, targets=("q", *EXPERTS)))
        assert torch.equal(model(tokens), before)
    trainable = {name: p.shape for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_name(name) for name in trainable)
    config = model.config
    e, d, f = config.n_experts, config.dim, config.expert_hidden_dim
    prefix = "layers.0.feed_forward.experts.adapters."
    assert trainable[prefix + "w_gate_up.lora_a.expert_gate.weight"] == (e, 4, d)
    assert trainable[prefix + "w_gate_up.lora_b.expert_up.weight"] == (e, f, 4)
    assert trainable[prefix + "w_down.lora_a.expert_down.weight"] == (e, 4, f)
    assert trainable[prefix + "w_down.lora_b.expert_down.weight"] == (e, d, 4)
    assert not model.layers[0].feed_forward.experts.w_gate_up.requires_grad


def _loop_reference(experts, adapters, rows, counts, scaling):
    """Each expert its own nn.Linear layers (gate, up, down) with its own LoRA, run one expert after another."""
    f = experts.w_down.shape[-1]
    outs = []
    for e, x in enumerate(rows.split(counts.tolist())):
        gate_w, up_w = experts.w_gate_up[e, :f], experts.w_gate_up[e, f:]
        def lora(name, x):
            return F.linear(F.linear(x, adapters[name][0][e]), adapters[name][1][e]) * scaling
        gate = F.linear(x, gate_w) + lora("expert_gate", x)
        up = F.linear(x, up_w) + lora("expert_up", x)
        hidden = F.silu(gate) * up
        outs.append(F.linear(hidden, experts.w_down[e]) + lora("expert_down", hidden))
    return torch.cat(outs)


def test_expert_adapters_equal_a_per_expert_loop_forward_and_backward_and_an_empty_expert_gets_zero_grads():
    model = _model(n_experts=4)
    add_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=EXPERTS))
    experts = model.layers[0].feed_forward.experts
    torch.manual_seed(1)
    for p in experts.parameters():
        if p.requires_grad:
            with torch.no_grad():
                p.normal_(0, 0.05)  # non-zero B, so the adapters change the output
    counts = torch.tensor([5, 0, 7, 3])  # expert 1 receives no rows
    rows = torch.randn(int(counts.sum()), model.config.dim, requires_grad=True)
    weights = [p for p in experts.parameters() if p.requires_grad]
    out = experts(rows, counts)
    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), [rows, *weights])
    named = dict(zip([n for n, p in experts.named_parameters() if p.requires_grad], grads[1:]))
    adapters = {t: (experts.adapters[w].lora_a[t].weight, experts.adapters[w].lora_b[t].weight)
                for t, w in (("expert_gate", "w_gate_up"), ("expert_up", "w_gate_up"), ("expert_down", "w_down"))}
    reference = _loop_reference(experts, adapters, rows, counts, 2.0)
    ref_grads = torch.autograd.grad((reference * probe).sum(), [rows, *weights])
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert len(named) == 6
    for name, grad in named.items():
        assert grad[1].abs().max() == 0, name  # the expert without rows
        assert grad[0].abs().max() > 0, name


def test_merged_expert_adapters_give_the_adapted_model_s_logits():
    model = _model()
    config = LoRAConfig(rank=4, targets=("v", *EXPERTS))
    base, adapters = with_random_adapters(model, config, seed=3, std=0.05)
    merged = MoE(model.config)
    merged.load_state_dict(merged_state_dict(base, adapters, model.config, config))
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), model(tokens), rtol=0, atol=1e-5)


def test_a_stacked_adapter_sharded_on_its_expert_dimension_initialises_on_this_rank_s_shard():
    """npu_fsdp builds the recipe's model on the meta device and initialises it shard by shard: a stacked A
    [n_experts, rank, in] sharded on the experts (FSDP's Shard(0)) was iterated expert by expert as a whole tensor,
    which DTensor refuses ("Attempted to unbind along the sharded dimension 0"); now each rank draws its own
    experts' matrices, within PEFT's bound 1 / sqrt(in). Rank 0 of 2 through torch's fake process group."""
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from recipes.decoder.lora import init_lora_a

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        weight = distribute_tensor(torch.zeros(8, 4, 16), mesh, [Shard(0)], src_data_rank=None)
        init_lora_a(weight)
        local = weight.to_local()
        assert local.shape == (4, 4, 16) and (local != 0).all() and local.abs().max() <= 1 / math.sqrt(16)
    finally:
        dist.destroy_process_group()


def test_expert_targets_on_a_family_without_experts_are_refused():
    from recipes.models.llama.config import LLaMAConfig
    from recipes.models.llama.model import LLaMA

    with pytest.raises(ValueError, match=r"'expert_gate', which the 'llama' family's blocks do not have"):
        add_lora(LLaMA(LLaMAConfig.from_preset("tiny", n_layers=1)), LoRAConfig(targets=("q", "expert_gate")))


def test_training_with_expert_adapters_lowers_the_loss():
    model = _model()
    add_lora(model, LoRAConfig(rank=8, alpha=16.0, targets=("q", "v", *EXPERTS)))
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(4)
    tokens = torch.randint(0, model.config.vocab_size, (4, 33))
    losses = []
    for _ in range(15):  # sign descent by hand: torch.optim's step asks for the current accelerator (none here)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(1e-2 * g.sign())
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(g.abs().max() > 0 for g in grads)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("targets", [("q", "expert_gate", "expert_up", "expert_down"), ("v", "expert_up")],
                         ids=["all_experts", "up_only"])
def test_peft_export_of_expert_adapters_gives_the_recipe_logits_in_transformers(tmp_path, arch, targets):
    """The PEFT directory (adapters on transformers 5's stacked expert parameters, PEFT's ``target_parameters``)
    on the HF base gives the adapted recipe model's fp32 logits (1e-5); so does the merged HF export."""
    from tests.recipes.models.test_moe import hf_model, recipe_model, saved, tokens

    base_dir = saved(hf_model(arch), tmp_path / "hf")
    ours = recipe_model(base_dir)
    lora = LoRAConfig(rank=2, alpha=3.0, dropout=0.1, targets=targets)
    _, adapters = with_random_adapters(ours, lora, seed=5, std=0.2)
    assert_lora_exports_give_the_recipe_logits(tmp_path, base_dir, ours, lora, adapters, tokens(seed=7))


@pytest.mark.slow
def test_expert_adapters_train_under_expert_parallelism_with_the_losses_of_one_rank_per_expert_set(tmp_path):
    """4 simulated NPUs, adapters on attention and every expert projection: expert_parallel_size 2 gives
    expert_parallel_size 1's per-step losses (fp32, 1e-5), each rank holding its 4 experts' adapters (sharded
    further over the 2 ranks that share them), and the loss falls."""
    from tests.helpers import read_json, room_scripts, run_python

    run_python([str(room_scripts("recipes/models") / "expert_lora_ep_run.py"), "--out", str(tmp_path)], simulate=4, timeout=900)
    result = read_json(tmp_path / "result.json")
    plain, split = torch.tensor(result["ep1"]["losses"]), torch.tensor(result["ep2"]["losses"])
    assert torch.allclose(split, plain, rtol=0, atol=1e-5), (plain, split)
    assert plain[-1] < plain[0] - 0.1  # 7.66 -> 7.44 in 10 steps
    # 8 experts / ep 2 = 4 per rank, FSDP-sharded over the 2 ranks that hold them: 2 experts' A per rank.
    assert result["ep2"]["a_local_shape"] == [2, 4, 64]
