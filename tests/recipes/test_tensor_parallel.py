"""The recipe's LLaMA under tensor parallelism: its plan, the checks before workers start, and 20 training steps on
4 simulated NPUs with plain npu_fsdp's losses (tests/recipes/scripts/recipe_tensor_parallel_run.py)."""

import pytest
import torch

from recipes.decoder.checkpoint_layout import save_recipe_checkpoint
from lightning_npu.facts.options import FSDPOptions
from lightning_npu.facts.parallel_rules import BatchShapes, check_tensor_parallel
from recipes.decoder.tensor_parallel import decoder_plan, model_shapes
from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.model import LLaMA
from recipes.models.moe.config import MoEConfig
from tests.helpers import read_json, room_scripts, run_python
from tests.recipe_runs import SMALL, TINY, TRAIN
from tests.prefetch import PREFETCHED

SCRIPTS = room_scripts("recipes")

TINY_LLAMA = LLaMAConfig.from_preset("tiny")  # 4 heads, 2 KV heads, ffn 352, vocab 2048


def test_the_plan_splits_every_projection_and_the_vocabulary_and_leaves_nothing_else():
    """Catches a projection the plan misses (it would stay whole on every rank: correct but no memory saved, or a
    layout mismatch with its neighbours) and a plan naming modules the model does not have."""
    model = LLaMA(TINY_LLAMA)
    plan = decoder_plan(model, prefix="model.", sequence_parallel=True, loss_parallel=True)
    modules = {"model." + name for name, _ in model.named_modules()}
    assert set(plan) <= modules
    linears = {"model." + name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    assert linears <= set(plan)
    assert {"model.tok_embeddings", "model.norm", "model.layers.0.attention_norm", "model.layers.3.ffn_norm"} <= set(plan)
    without_sp = decoder_plan(model, sequence_parallel=False, loss_parallel=False)
    assert not any(name.endswith("norm") for name in without_sp)


@pytest.mark.parametrize(
    ("config", "tp", "seq_len", "message"),
    [
        (TINY_LLAMA, 8, 64, r"tensor_parallel_size=8 cannot split this model: n_heads=4 is not divisible by"
                            r" tensor_parallel_size=8.*; n_kv_heads=2 is not divisible.*"
                            r"Use a tensor_parallel_size that divides them \(1, 2\)"),
        (TINY_LLAMA, 2, 63, r"data.seq_len=63 is not divisible by tensor_parallel_size=2"),
        # An MoE layer's shared expert splits like a dense MLP: its width must divide too.
        (MoEConfig.from_preset("tiny", architecture="qwen2_moe", shared_expert_hidden_dim=66, qkv_bias=True), 4, 64,
         r"shared_expert_hidden_dim=66 is not divisible by tensor_parallel_size=4"),
    ],
)
def test_a_model_the_plan_cannot_split_is_refused_with_the_numbers(config, tp, seq_len, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(FSDPOptions(tensor_parallel_size=tp), model_shapes(config), BatchShapes(seq_len=seq_len))
    # plain sharding takes any model
    check_tensor_parallel(FSDPOptions(), model_shapes(config), BatchShapes(seq_len=seq_len))


def test_the_plan_of_an_moe_model_splits_attention_and_the_shared_expert_and_leaves_the_experts_and_router():
    """Catches a plan that splits the stacked experts or the router (both run whole on every tensor-parallel rank:
    the experts' rows are shared out instead), or that leaves an MoE layer's input sequence-split (the router must
    see every token of the rows it routes)."""
    from recipes.models.moe.model import MoE

    config = MoEConfig.from_preset("tiny", architecture="qwen2_moe", shared_expert_hidden_dim=64, qkv_bias=True)
    check_tensor_parallel(FSDPOptions(tensor_parallel_size=2), model_shapes(config), BatchShapes(seq_len=64))
    model = MoE(config)
    plan = decoder_plan(model, sequence_parallel=True, loss_parallel=True)
    assert not any(".experts" in name or ".router" in name for name in plan)
    assert {"layers.0.attention.wq", "layers.0.feed_forward.shared_expert.w_gate",
            "layers.0.feed_forward.shared_expert.w_down"} <= set(plan)
    assert type(plan["layers.0.feed_forward"]).__name__ == "PrepareModuleInputOutput"
    assert "layers.0.feed_forward" not in decoder_plan(model, sequence_parallel=False, loss_parallel=False)


@pytest.mark.slow
def test_tensor_parallel_problems_stop_train_py_before_workers_start(tmp_path):
    """Catches a model / size mismatch surfacing inside the 4 workers (a view error in the first forward)."""
    with pytest.raises(AssertionError, match=r"tensor_parallel_size=4 cannot split this model: n_kv_heads=2"):
        run_python([TRAIN, "fit", "--config", TINY, *SMALL, "--trainer.devices", "4",
                    "--trainer.strategy.init_args.tensor_parallel_size", "4",
                    "--trainer.default_root_dir", str(tmp_path)], simulate=4)
    assert not (tmp_path / "lightning_logs").exists()


def test_a_checkpoint_of_the_fused_gate_up_layout_is_not_resumed_but_its_weights_start_a_run(tmp_path):
    """Catches a resume that would load an optimizer state of the old layout (one fused gate/up moment per MLP)
    onto the split layers: it is refused before training, naming init_from as the way to use its weights."""
    from recipes.train import check_resume_checkpoint

    model = LLaMA(TINY_LLAMA)
    state = model.state_dict()
    old = {name: tensor for name, tensor in state.items() if ".w_gate." not in name and ".w_up." not in name}
    for i in range(TINY_LLAMA.n_layers):
        prefix = f"layers.{i}.feed_forward."
        old[prefix + "w_gate_up.weight"] = torch.cat([state[prefix + "w_gate.weight"], state[prefix + "w_up.weight"]])
    save_recipe_checkpoint(tmp_path / "old.ckpt", TINY_LLAMA, old)
    with pytest.raises(ValueError, match=r"fused its gate and up projections .*'layers.0.feed_forward.w_gate_up.weight'"
                                         r".* --model.init_from .*old.ckpt without ckpt_path"):
        check_resume_checkpoint(str(tmp_path / "old.ckpt"), TINY_LLAMA)
    save_recipe_checkpoint(tmp_path / "new.ckpt", TINY_LLAMA, state)
    check_resume_checkpoint(str(tmp_path / "new.ckpt"), TINY_LLAMA)


@PREFETCHED.fixture(seconds=80)
def recipe_tensor_parallel_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe_tensor_parallel")
    run_python([str(SCRIPTS / "recipe_tensor_parallel_run.py"), str(out)], simulate=4, timeout=1200)
    return {**read_json(out / "result.json"), "out": out}


@pytest.mark.slow
def test_the_tiny_recipe_with_tensor_parallelism_trains_with_plain_sharding_losses(recipe_tensor_parallel_runs):
    """tensor_parallel_size=2 on 4 simulated NPUs (a 2 x 2 mesh), with and without sequence parallelism and
    loss_parallel, tensor_parallel_size=2 with context_parallel_size=2 (Ulysses, ring), and context_parallel_size=2
    alone (ring, Ulysses; validating at step 10), from the same init_from weights and global batch: plain npu_fsdp's
    loss at each of 20 steps (fp32, 1e-5). Catches a wrong split (gate and up rows on different ranks), a batch that
    differs inside a TP or CP group, a rank training on the wrong part of a sequence or at the wrong rotary
    positions, a loss averaged over the wrong ranks, and gradient clipping over parameters on two meshes."""
    result = recipe_tensor_parallel_runs
    plain = torch.tensor(list(result["dp"]["losses"].values()))
    assert len(plain) == 20 and plain[-1] < plain[0] - 0.5
    for run in ("tp", "tp_plain", "tp_cp_ulysses", "tp_cp_ring", "cp", "cp_ulysses"):
        split = torch.tensor(list(result[run]["losses"].values()))
        assert torch.allclose(split, plain, rtol=0, atol=1e-5), run
        if not run.startswith("cp"):
            assert result[run]["placements"] == ["_S(0, 2)", "S(0)"]  # FSDP over dp, columns split over tp
    assert result["dp"]["placements"] == ["S(0)"]


@pytest.mark.slow
def test_the_logged_training_loss_is_plain_shardings_with_as_many_data_parallel_replicas(recipe_tensor_parallel_runs):
    """The train_loss rank 0 logs (every 2nd step) is its data-parallel replica's loss under every layout, from the
    same init_from weights: under context parallelism (ring, Ulysses; with tensor parallelism too) the mean of the
    context-parallel ranks' shares, token-weighted, not rank 0's own share. Plain npu_fsdp with D replicas logs its
    rank 0's loss, whose rows are those of plain ranks 0, D, 2D... on 4 devices (the sampler deals rows round-robin,
    every row the same number of tokens), so it is their mean: within 1e-4 at each logged step."""
    result = recipe_tensor_parallel_runs
    plain = result["dp"]["rank_losses"]
    for run in ("dp", "tp", "tp_plain", "tp_cp_ulysses", "tp_cp_ring", "cp", "cp_ulysses"):
        replicas, logged = result[run]["data_parallel"], result[run]["logged"]
        assert sorted(map(int, logged)) == list(range(1, 20, 2)), run
        for step, loss in logged.items():
            same_rows = plain[step][::replicas]
            assert abs(loss - sum(same_rows) / len(same_rows)) <= 1e-4, (run, step)


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "resumed"), [("tp", "tp_to_dp"), ("cp", "cp_to_dp")])
def test_a_tensor_or_context_parallel_checkpoint_resumes_under_plain_sharding(recipe_tensor_parallel_runs, saved,
                                                                             resumed):
    """A sharded checkpoint of the 2 x 2 (dp x tp) run, and of a dp 2 x cp 2 run (ring), at step 10 resumes under
    plain npu_fsdp on 4 (tp 2 -> 1, cp 2 -> 1) with the uninterrupted run's losses for steps 10-19."""
    result = recipe_tensor_parallel_runs
    losses = result[resumed]["losses"]
    assert sorted(map(int, losses)) == list(range(10, 20))
    uninterrupted = result[saved]["losses"]
    for step, loss in losses.items():
        assert abs(loss - uninterrupted[step]) <= 1e-5, step


@pytest.mark.slow
def test_random_first_weights_under_tensor_parallelism_are_drawn_whole(recipe_tensor_parallel_runs):
    """A model built on the meta device and initialised after sharding: each split weight is drawn as on one
    device. Catches the shard-by-shard draw in which both ranks of a TP group draw the same numbers (duplicated
    heads and MLP columns, training from a silently degenerate start)."""
    result = recipe_tensor_parallel_runs
    scratch = result["tp_scratch"]
    assert scratch["split_weights"] == 30 and scratch["equal_halves"] == []
    # The same seed on one device built init_from's weights: the first loss is theirs.
    assert abs(scratch["losses"]["0"] - result["dp"]["losses"]["0"]) <= 1e-5


@pytest.mark.slow
def test_the_checkpoint_and_hf_export_of_a_tensor_parallel_run_equal_plain_sharding(recipe_tensor_parallel_runs):
    """The sharded checkpoint the 2 x 2 run wrote at its end reads back (the recipe's consolidation path, as convert.py
    and generate.py read it) as whole tensors equal to the plain run's, and so does its Hugging Face export. Equal up to
    float noise: after 20 AdamW steps a few entries whose gradients are near zero differ by up to ~1e-4 (the update
    divides by the gradient's own scale), the mean difference is ~1e-8; a misplaced shard differs by ~0.02."""
    from recipes.decoder.checkpoint_layout import load_recipe_checkpoint
    from recipes.decoder.hf_checkpoint import recipe_to_hf_state_dict

    out = recipe_tensor_parallel_runs["out"]
    config, split = load_recipe_checkpoint(out / "tp_end")
    _, plain = load_recipe_checkpoint(out / "dp_end")
    assert split.keys() == plain.keys() and len(plain) == len(LLaMA(config).state_dict())
    def assert_equal(a, b, name):
        assert a.shape == b.shape and (a - b).abs().max() < 5e-4 and (a - b).abs().mean() < 1e-6, name

    for name, tensor in plain.items():
        assert_equal(split[name], tensor, name)
    hf_split, hf_plain = recipe_to_hf_state_dict(split, config), recipe_to_hf_state_dict(plain, config)
    assert hf_split.keys() == hf_plain.keys()
    for name, tensor in hf_plain.items():
        assert_equal(hf_split[name], tensor, name)
