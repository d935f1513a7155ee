"""Expert parallelism under npu_fsdp: the option checked before workers start, and on 4 simulated NPUs the MoE
recipe's model training with expert_parallel_size 2 and 4 exactly as with 1, sharded checkpoints resuming across
sizes, full checkpoints holding every expert, and a rank that receives no tokens finishing its steps."""

import re

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from torch import nn

from lightning_npu import NPUFabricFSDPStrategy, NPUFSDPStrategy
from lightning_npu.parallel.expert import check_experts
from lightning_npu.parallel.protocol import find_modules
from recipes.models.moe.config import MoEConfig
from recipes.decoder.moe import Experts
from recipes.models.moe.model import MoE
from tests.helpers import SCRIPTS, read_json, run_python
from tests.prefetch import PREFETCHED


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"expert_parallel_size": 0}, r"expert_parallel_size=0 must be a positive integer"),
        ({"expert_parallel_size": 2.0}, r"expert_parallel_size=2.0 must be a positive integer"),
    ],
)
def test_expert_parallel_size_is_checked_when_the_strategy_is_made(kwargs, message):
    for strategy in (NPUFSDPStrategy, NPUFabricFSDPStrategy):
        with pytest.raises(ValueError, match=message):
            strategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"expert_parallel_size": 3}, r"expert_parallel_size=3 does not divide dp_shard=4 x context_parallel_size=1 x"
                                      r" tensor_parallel_size=1 = 4: .*use a divisor of 4 \(1, 2, 4\)"),
        ({"expert_parallel_size": 8}, r"expert_parallel_size=8 does not divide dp_shard=4 x"),
        # The expert-parallel ranks come from dp_shard x cp x tp (2 x 2 x 1, and 2 x 1 x 2 here).
        ({"expert_parallel_size": 3, "context_parallel_size": 2},
         r"expert_parallel_size=3 does not divide dp_shard=2 x context_parallel_size=2 x tensor_parallel_size=1 = 4:"
         r" expert-parallel groups are carved out of those ranks .*; use a divisor of 4 \(1, 2, 4\)"),
        ({"expert_parallel_size": 8, "tensor_parallel_size": 2},
         r"expert_parallel_size=8 does not divide dp_shard=2 x context_parallel_size=1 x tensor_parallel_size=2 = 4"),
        ({"expert_parallel_size": 2, "sharding": "hybrid"}, r"got sharding='hybrid'"),
    ],
)
def test_expert_parallel_sizes_the_devices_cannot_form_fail_before_workers_start(simulate, kwargs, message):
    simulate(4)
    with pytest.raises(ValueError, match=message):
        Trainer(accelerator="npu", devices=4, strategy=NPUFSDPStrategy(**kwargs), logger=False)
    with pytest.raises(ValueError, match=message):
        Fabric(accelerator="npu", devices=4, strategy=NPUFabricFSDPStrategy(**kwargs))
    # Sizes that fit are accepted, and the sampler still splits over every rank (experts split, batches do not).
    trainer = Trainer(accelerator="npu", devices=4, strategy=NPUFSDPStrategy(expert_parallel_size=4), logger=False)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 0}
    # ep may take every rank of dp_shard x cp x tp; the sampler splits over the 2 data-parallel ranks only.
    for other in ({"context_parallel_size": 2}, {"tensor_parallel_size": 2}):
        trainer = Trainer(accelerator="npu", devices=4, logger=False,
                          strategy=NPUFSDPStrategy(expert_parallel_size=4, **other))
        assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_a_model_without_experts_or_with_an_indivisible_expert_count_is_refused():
    """Raised on every rank alike, before any expert-parallel collective: a dense model would silently train the
    same weights on every rank of a group, and a remainder of experts would belong to no rank."""
    with pytest.raises(ValueError, match=r"expert_parallel_size=2, but the model's ParallelPlan names no experts"):
        check_experts([], 2)
    model = MoE(MoEConfig.from_preset("tiny", n_layers=1, dim=32, n_heads=2, n_kv_heads=1, n_experts=6,
                                      expert_hidden_dim=8))
    experts = find_modules(model, model.expert_modules(), "experts")
    assert [name for name, _ in experts] == ["layers.0.feed_forward.experts"]
    assert isinstance(model.layers[0].feed_forward.experts, Experts)
    with pytest.raises(ValueError, match=r"expert_parallel_size=4 does not divide the 6 experts of"
                                         r" layers.0.feed_forward.experts: .*use a divisor of 6"):
        check_experts(experts, 4)
    check_experts(experts, 3)


@PREFETCHED.fixture(seconds=19)
def expert_parallel_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert_parallel")
    run_python([str(SCRIPTS / "expert_parallel_run.py"), "--out", str(out)], simulate=4, timeout=1200)
    return out, read_json(out / "result.json")


@pytest.mark.slow
def test_expert_parallel_sizes_2_and_4_train_with_the_losses_of_1(expert_parallel_runs):
    """The tiny MoE recipe's model (8 experts, top-2, aux loss, gradient clipping) for 20 steps on 4 simulated
    NPUs: expert_parallel_size 2 and 4 give expert_parallel_size 1's per-step losses (fp32, 1e-5), and the loss
    falls. Each rank holds 8 / ep experts, sharded further over the 4 / ep ranks that share them."""
    _, result = expert_parallel_runs
    plain = torch.tensor(result["ep1"]["losses"])
    assert len(plain) == 20 and plain[-5:].mean() < plain[:5].mean() - 0.5
    for ep in (2, 4):
        split = torch.tensor(result[f"ep{ep}"]["losses"])
        assert torch.allclose(split, plain, rtol=0, atol=1e-5), (ep, split - plain)
    assert result["ep1"]["placements"] == ["S(0)"]
    # (dp_shard_mod_ep, ep): experts split on ep, each rank's block sharded by FSDP on the other dimension.
    assert result["ep2"]["placements"] == ["_S(0, 2)", "S(0)"]
    assert result["ep4"]["placements"] == ["_S(0, 4)", "S(0)"]
    assert all(result[f"ep{ep}"]["local_shape"] == [2, 64, 64] for ep in (1, 2, 4))


@pytest.mark.slow
def test_a_sharded_checkpoint_saved_at_one_expert_parallel_size_resumes_at_another(expert_parallel_runs):
    """The DCP checkpoint written by the expert_parallel_size=2 run after epoch 0, resumed under 4 and under 1:
    each reproduces the uninterrupted run's epoch-1 losses (expert weights and their AdamW moments resharded)."""
    _, result = expert_parallel_runs
    uninterrupted = torch.tensor(result["ep2"]["losses"][10:])
    for ep in (4, 1):
        resumed = torch.tensor(result[f"ep2_to_ep{ep}"]["losses"])
        assert len(resumed) == 10
        assert torch.allclose(resumed, uninterrupted, rtol=0, atol=1e-5), (ep, resumed - uninterrupted)


@pytest.mark.slow
def test_a_full_checkpoint_of_an_expert_parallel_run_holds_every_expert(expert_parallel_runs):
    """state_dict_type='full' under expert_parallel_size=4 writes whole tensors [8 experts, ...], equal to the
    expert_parallel_size=1 run's after the same 20 steps (what HF export reads)."""
    out, _ = expert_parallel_runs
    plain = torch.load(out / "ep1.ckpt", weights_only=False)["state_dict"]
    split = torch.load(out / "ep4.ckpt", weights_only=False)["state_dict"]
    assert split.keys() == plain.keys()
    experts = [name for name in plain if ".experts." in name]
    assert len(experts) == 4 and all(split[name].shape[0] == 8 for name in experts)
    for name, tensor in plain.items():
        assert type(split[name]) is torch.Tensor and split[name].shape == tensor.shape, name
        assert torch.allclose(split[name], tensor, rtol=0, atol=1e-4), name


@pytest.mark.slow
def test_fabric_trains_with_expert_parallelism_like_plain_sharding(expert_parallel_runs):
    """NPUFabricFSDPStrategy(expert_parallel_size=2) in a Fabric loop with fabric.clip_gradients (parameters on two
    meshes) has the losses of expert_parallel_size=1."""
    _, result = expert_parallel_runs
    plain, split = torch.tensor(result["fabric_ep1"]["losses"]), torch.tensor(result["fabric_ep2"]["losses"])
    assert len(plain) == 6
    assert torch.allclose(split, plain, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_rank_that_receives_no_tokens_still_runs_its_experts(tmp_path):
    """Every token routed to rank 0's experts (one expert per rank, then two): rank 1 receives no rows yet takes
    part in every all_to_all and reduce-scatter (a rank skipping them would hang the other until the timeout),
    its experts get zero gradients, and the losses, gradients and clipped gradient norms equal
    expert_parallel_size=1's."""
    run_python([str(SCRIPTS / "expert_parallel_skew_run.py"), "--out", str(tmp_path)], simulate=2, timeout=600)
    result = read_json(tmp_path / "result.json")
    for case, idle in (("one_per_rank", [1]), ("two_per_rank", [2, 3])):
        plain, split = result[case]["ep1"], result[case]["ep2"]
        assert torch.allclose(torch.tensor(split["losses"]), torch.tensor(plain["losses"]), rtol=0, atol=1e-6)
        # fabric.clip_gradients over parameters on two meshes: the same total norm, clipped alike (above 0.05).
        assert torch.allclose(torch.tensor(split["grad_norms"]), torch.tensor(plain["grad_norms"]), rtol=1e-5)
        assert min(plain["grad_norms"]) > 0.05
        grad, plain_grad = torch.tensor(split["w_gate_up_grad"]), torch.tensor(plain["w_gate_up_grad"])
        assert torch.allclose(grad, plain_grad, rtol=0, atol=1e-7), case
        assert torch.count_nonzero(grad[idle]) == 0 and torch.count_nonzero(grad[0]) > 0, case


@pytest.mark.slow
def test_tiny_moe_recipe_trains_with_expert_parallelism_and_exports_every_expert(tmp_path):
    """tiny_moe.yaml with --trainer.strategy.init_args.expert_parallel_size 2 on 2 simulated NPUs (each rank holds 4
    of the 8 experts of each layer): the loss falls, and the sharded checkpoint converts to a Hugging Face directory
    holding all 8 experts that transformers decodes as generate.py does from the checkpoint."""
    from transformers import AutoModelForCausalLM

    from recipes.decoder.tokenizer import load_tokenizer
    from recipes.generate import generate, load_model
    from tests.helpers import REPO
    from tests.test_moe_recipe_e2e import SMALL, TINY_MOE

    out = run_python([str(REPO / "recipes/train.py"), "fit", "--config", TINY_MOE, *SMALL,
                      "--trainer.strategy.init_args.expert_parallel_size", "2", "--trainer.max_steps", "8",
                      "--trainer.default_root_dir", str(tmp_path)], simulate=2)
    assert "expert parallelism over 2 ranks: the experts of 4 modules split" in out.stdout + out.stderr
    first, last = map(float, re.search(r"train loss: first ([\d.]+) -> last ([\d.]+)", out.stdout).groups())
    assert last < first - 0.5
    ckpt = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    run_python([str(REPO / "recipes/convert.py"), "to-hf", str(ckpt), str(tmp_path / "hf")], simulate=None)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8
    model, tokenizer_path = load_model(ckpt)
    prompt = torch.tensor([load_tokenizer(tokenizer_path)("Return the")["input_ids"]])
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, prompt, 12), expected)


@PREFETCHED.fixture(seconds=38)
def expert_parallel_mesh_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert_parallel_mesh")
    run_python([str(SCRIPTS / "expert_parallel_mesh_run.py"), "--out", str(out)], simulate=4, timeout=1500)
    result = read_json(out / "result.json")
    return {name: torch.tensor(run["losses"]) for name, run in result.items()}, result


@pytest.mark.slow
def test_expert_parallelism_with_context_parallelism_shards_the_experts_on_the_one_mesh(expert_parallel_mesh_runs):
    """context_parallel_size=2 x expert_parallel_size=2 on 4 simulated NPUs: each expert-parallel pair is a cp pair
    (the ranks borrowed from dp_shard x cp), the experts FSDP-sharded over the other 2 (dp_shard x cp / ep); the
    first two steps (the same weights: warm-up) give plain npu_fsdp's losses (fp32, 1e-5), the load-balancing loss
    in them (coefficient 0.1) counted over the whole batch as plain sharding counts it, and the loss falls."""
    losses, result = expert_parallel_mesh_runs
    assert result["cp_ep"]["placements"] == ["_S(0, 2)", "S(0)"]
    assert result["cp_ep"]["local_shape"] == [2, 64, 64]
    for run in ("cp", "cp_ep"):
        assert len(losses[run]) == 20
        assert torch.allclose(losses[run][:2], losses["dp"][:2], rtol=0, atol=1e-5), run
        assert losses[run][-5:].mean() < losses[run][:5].mean() - 0.5, run


@pytest.mark.slow
def test_deepseek_trains_under_ring_and_ulysses_context_parallelism_with_the_losses_of_plain_sharding(
        expert_parallel_mesh_runs):
    """The tiny DeepSeek (MLA: q/k heads wider than v, the shared rotary key; DeepSeekMoE with every token routed to
    all experts) on 4 simulated NPUs, context_parallel_size=2 by ring and by Ulysses attention: plain npu_fsdp's
    10 per-step losses from the same first weights and rows (fp32, 1e-5), and the loss falls."""
    losses, _ = expert_parallel_mesh_runs
    assert len(losses["deepseek_dp"]) == 10
    assert losses["deepseek_dp"][-3:].mean() < losses["deepseek_dp"][:3].mean() - 0.5
    for algo in ("ring", "ulysses"):
        torch.testing.assert_close(losses[f"deepseek_cp_{algo}"], losses["deepseek_dp"], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_the_balancing_bias_moves_by_the_whole_batch_s_counts_under_context_parallelism(expert_parallel_mesh_runs):
    """After the first step the routers' balancing biases under cp 2 and cp 2 x ep 2 are plain npu_fsdp's, bit for
    bit: each moved by the tokens every data-parallel and context-parallel rank routed (the strategy's reduce group,
    dp x cp), each token counted once whichever rank holds it."""
    _, result = expert_parallel_mesh_runs
    plain = result["dp"]["first_biases"]
    assert len(plain) == 2 and any(value != 0 for layer in plain for value in layer)
    for run in ("cp", "cp_ep"):
        assert result[run]["first_biases"] == plain, run


@pytest.mark.slow
def test_a_checkpoint_saved_under_context_and_expert_parallelism_resumes_with_its_weights(expert_parallel_mesh_runs):
    """The sharded checkpoint of cp 2 x ep 2 after epoch 0, resumed under cp 2 x ep 1 and under plain npu_fsdp:
    the first resumed step's loss is the uninterrupted run's (the expert weights resharded across meshes)."""
    losses, _ = expert_parallel_mesh_runs
    for run in ("cp_ep_to_cp", "cp_ep_to_dp"):
        assert len(losses[run]) == 10
        assert torch.allclose(losses[run][:1], losses["cp_ep"][10:11], rtol=0, atol=1e-5), run


@pytest.mark.slow
def test_expert_parallelism_with_context_parallelism_trains_with_the_losses_of_plain_sharding(
        expert_parallel_mesh_runs):
    """cp 2 x ep 2 gives plain npu_fsdp's 20 per-step losses within 1e-5 when every token goes to every expert
    (top_k = n_experts: the tokens still travel to both ranks of each expert-parallel pair). With top-2 routing the
    two layouts part after the first update, cp 2 with ep 1 as much (rounding differences flip near-tied expert
    choices; see expert_parallel_mesh_run.py): what is compared there is the first steps, above."""
    losses, _ = expert_parallel_mesh_runs
    assert len(losses["dp_all_experts"]) == 20
    assert torch.allclose(losses["cp_ep_all_experts"], losses["dp_all_experts"], rtol=0, atol=1e-5)
    assert losses["dp_all_experts"][-5:].mean() < losses["dp_all_experts"][:5].mean() - 0.5


@pytest.mark.slow
def test_moe_under_tensor_parallelism_trains_with_the_losses_of_plain_sharding(layout_parity_runs):
    """tiny MoE with tensor_parallel_size 2, and 2 x expert_parallel_size 2, on 4 simulated NPUs against plain
    npu_fsdp on 2 (as many data-parallel replicas: the same rows on each replica), every token routed to every
    expert, the load-balancing loss and the balancing bias on: the 20 per-step losses agree within 1e-5, and the
    loss falls. Each tensor-parallel rank runs half the routed rows; under ep 2 the pair splits the experts."""
    losses, result = layout_parity_runs
    plain = losses["moe_all"]
    assert len(plain) == 20 and plain[-5:].mean() < plain[:5].mean() - 0.5
    for run in ("moe_tp2_all", "moe_tp2_ep2_all"):
        torch.testing.assert_close(losses[run], plain, rtol=0, atol=1e-5, msg=run)
        assert result[run]["first_biases"] == result["moe_all"]["first_biases"], run
    # Under tp 2 x ep 2 each rank holds 4 of the 8 experts, FSDP-shards them over the 2 ranks holding the same.
    assert result["moe_tp2_ep2_all"]["placements"] == ["_S(0, 2)", "S(0)"]


@pytest.mark.slow
def test_moe_under_tensor_parallelism_with_top_2_routing_follows_plain_sharding_over_the_first_steps(
        layout_parity_runs):
    """With top-2 routing the first 6 steps agree within 1e-4. The router sees the whole tokens on every
    tensor-parallel rank, but they come out of split attention and MLPs whose sums run in another order (1e-7
    apart), which can flip a near-tied expert choice once training has moved the weights; measured (2026-12-05,
    fp32): no flip in 20 steps, every step within 1e-6 of plain sharding."""
    losses, _ = layout_parity_runs
    plain = losses["moe_top2"]
    assert len(plain) == 20 and plain[-5:].mean() < plain[:5].mean() - 0.5
    for run in ("moe_tp2_top2", "moe_tp2_ep2_top2"):
        assert len(losses[run]) == 20, run
        torch.testing.assert_close(losses[run][:6], plain[:6], rtol=0, atol=1e-4, msg=run)


@pytest.mark.slow
def test_a_checkpoint_resumes_across_tensor_and_expert_parallel_meshes_at_the_first_step(layout_parity_runs):
    """plain (2 replicas) -> tp 2 x ep 2 and tp 2 x ep 2 -> plain: the sharded checkpoint after epoch 0 resumed on
    the other mesh gives, at its first step, the loss the uninterrupted run had there."""
    losses, _ = layout_parity_runs
    torch.testing.assert_close(losses["moe_plain_to_tp2_ep2"][:1], losses["moe_all"][10:11], rtol=0, atol=1e-5)
    torch.testing.assert_close(losses["moe_tp2_ep2_to_plain"][:1], losses["moe_tp2_ep2_all"][10:11], rtol=0,
                               atol=1e-5)
    assert len(losses["moe_plain_to_tp2_ep2"]) == len(losses["moe_tp2_ep2_to_plain"]) == 10
