"""lightning-npu plan under tensor and context parallelism (npu_fsdp's tensor_parallel_size, context_parallel_size,
context_parallel_algo, sequence_parallel, loss_parallel): one rank's share of the split weights and of the tokens,
Ulysses' and ring attention's own tensors, the errors for sizes that do not divide, the flags, and the shipped
70B and 128k configs. The end-to-end check against measured training peaks is tests/plan/test_accuracy.py."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import yaml

from lightning_npu.cli import main
from lightning_npu.facts.options import FSDPOptions
from lightning_npu.facts import parallel_rules
from lightning_npu.facts.parallel_rules import BatchShapes
from lightning_npu.plan import (
    GIB,
    PlanError,
    PlanSpec,
    estimate,
    load_spec,
    max_micro_batch,
    state_bytes,
)
from lightning_npu.plan.decoder import FP32_BYTES
from lightning_npu.plan.replay import _StepReplay
from recipes.models.llama.memory_profile import lightning_npu_memory_profile
from tests.helpers import REPO, room_scripts, run_python

SCRIPTS = room_scripts("plan")

CONFIGS = REPO / "recipes" / "models" / "llama" / "configs"
CONFIG_70B = CONFIGS / "llama2_70b.yaml"
CONFIG_128K = CONFIGS / "llama3_8b_128k.yaml"
TINY = lightning_npu_memory_profile({"preset": "tiny"})  # dim 128, 4 heads, 2 kv heads, ffn 352, vocab 2048


def _tiny(devices: int = 2, seq_len: int = 64, ac_ratio: float = 0.0, kernels: str = "reference", **options):
    return PlanSpec(model=TINY.shape, profile=TINY, seq_len=seq_len, micro_batch=2, devices=devices,
                    precision="32-true", ac_ratio=ac_ratio, kernels=kernels, options=FSDPOptions(**options))


def test_tensor_parallelism_halves_each_ranks_block_matrices_and_splits_the_vocabulary():
    """tp=2 on 2 devices (no FSDP sharding left: shard group 1) holds half of every projection and of the
    embedding and head, and the whole norms; catches weights not divided by tp (plain sharding's count) and norms
    divided too."""
    split = _tiny(devices=2, tensor_parallel_size=2)
    assert split.shard_group == 1
    m = TINY.shape
    kv = m.n_kv_heads * m.head_dim
    matrices = 2 * m.dim * m.dim + 2 * kv * m.dim + 3 * m.ffn_hidden_dim * m.dim
    per_rank = m.n_layers * (matrices // 2 + 2 * m.dim) + 2 * m.vocab_size * m.dim // 2 + m.dim
    assert state_bytes(split)["parameters"] == FP32_BYTES * per_rank
    whole = state_bytes(_tiny(devices=1))["parameters"]
    assert whole == FP32_BYTES * (m.n_layers * (matrices + 2 * m.dim) + 2 * m.vocab_size * m.dim + m.dim)
    shapes = split.profile.block_parameters().shapes
    assert shapes[:5] == [(m.dim,), (m.dim // 2, m.dim), (kv // 2, m.dim), (kv // 2, m.dim), (m.dim, m.dim // 2)]
    assert split.profile.num_params() == TINY.num_params()  # the header still names the whole model


def test_the_70b_config_shards_one_tensor_parallel_slice_over_the_four_nodes():
    """llama2_70b.yaml: tp 8 inside each node, FSDP over the 4 ranks (one per node) holding the same slice. Hand
    count of LLaMA-2-70B's parameters per rank: every local dimension divides by 4, so no padding."""
    spec = load_spec(CONFIG_70B)
    assert (spec.world_size, spec.parallel.tensor, spec.shard_group) == (32, 8, 4)
    d, kv, f, v, layers = 8192, 1024, 28672, 32000, 80
    block = (2 * d * d + 2 * kv * d + 3 * f * d) // 8 + 2 * d  # projections split, the two norms replicated
    per_rank = (layers * block + 2 * v * d // 8 + d) // 4
    assert state_bytes(spec) == {"parameters": 4 * per_rank, "gradients": 4 * per_rank, "optimizer": 8 * per_rank}
    assert spec.profile.num_params() == 68_976_648_192


def test_context_parallelism_plans_each_rank_for_its_part_of_every_sequence():
    """The replay's per-rank tensors: cp=2 halves the tokens, so the residual stream (what a checkpointed block
    keeps), every block's saved activations (but for Ulysses' extra head-split output) and the logits; tp=2 halves
    the residual stream only with sequence parallelism (replicated over the tensor-parallel ranks without) and
    the logits only with loss_parallel. Catches activations counted at the whole sequence, or at the whole width."""
    def replayed(**parallel) -> _StepReplay:
        return _StepReplay(_tiny(ac_ratio=1.0, **parallel), 3, 2)

    plain = replayed()
    ring, ulysses = replayed(context_parallel_size=2, context_parallel_algo="ring"), replayed(context_parallel_size=2)
    assert (plain.tokens, ring.tokens, ulysses.tokens) == (128, 64, 64)
    for split in (ring, ulysses, replayed(tensor_parallel_size=2)):
        assert split.residual == plain.residual / 2
    assert replayed(tensor_parallel_size=2, sequence_parallel=False).residual == plain.residual
    for split in (ring, ulysses, replayed(tensor_parallel_size=2)):
        assert split.logits_fp32 == plain.logits_fp32 / 2
    assert replayed(tensor_parallel_size=2, loss_parallel=False).logits_fp32 == plain.logits_fp32
    extra = FP32_BYTES * TINY.shape.q_dim * ulysses.tokens  # the kernel's head-split output beside wo's input
    assert [saved for saved, _ in ulysses.saved] == [saved / 2 + extra for saved, _ in plain.saved]
    no_overheads = dict(hccl_buffsize_mb=0.0, workspace_gib=0.0, fragmentation=0.0)
    totals = [estimate(dataclasses.replace(replay.spec, **no_overheads)).total for replay in (plain, ring)]
    assert totals[1] < totals[0]


def test_loss_parallel_keeps_the_logits_split_by_vocabulary():
    """[batch, seq, vocab / tp] fp32 logits with loss_parallel, the whole vocabulary without; at the peak (the
    log-softmax, the previous step's gradients still alive) loss_parallel's log-softmax holds the logits, its
    shifted copy and the result, aten's the logits and the result. Catches the logits counted at full width under
    loss_parallel, and loss_parallel's shifted copy left out."""
    fp32_logits = FP32_BYTES * 2 * 64 * TINY.shape.vocab_size
    split, whole = (estimate(_tiny(tensor_parallel_size=2, **options)) for options in ({}, {"loss_parallel": False}))
    assert split.peak_phase == whole.peak_phase == "forward: log-softmax"
    assert split.items["logits"] == 3 * fp32_logits / 2
    assert whole.items["logits"] == 2 * fp32_logits


def test_ulysses_and_ring_keep_their_own_tensors():
    """Per token of a rank's own: Ulysses keeps the plain kernel's tensors plus its head-split output (the kernel's)
    beside wo's input, and its all-to-alls hold a send and a receive buffer of the largest of q, k, v; ring keeps
    q, k, v at kv heads, its fp32 output and the merged fp32 row max / sum, and holds two KV blocks in flight (plus
    the fp32 dq and dK/dV in backward). Key/value heads are repeated where cp does not divide them."""
    m, a = TINY.shape, FP32_BYTES
    q, kv = m.q_dim, m.n_kv_heads * m.head_dim
    plain = sum(TINY.saved_by_block("reference", a, 64).all.values())
    ulysses = _tiny(context_parallel_size=2, context_parallel_algo="ulysses").profile
    ring = _tiny(context_parallel_size=2, context_parallel_algo="ring").profile
    assert sum(ulysses.saved_by_block("reference", a, 64).all.values()) == plain + a * q
    kept = ring.saved_by_block("reference", a, 64).attention
    assert kept["ring attention q, k, v"] == a * (q + 2 * kv)
    assert kept["ring attention output (fp32)"] == FP32_BYTES * q  # also wo's input in fp32: not counted twice
    assert "attention output (wo input)" not in kept
    assert kept["ring attention row max + sum (fp32)"] == 2 * FP32_BYTES * m.n_heads
    assert ulysses.parallel_scratch("fused", 2, 64) == (2 * 2 * q, 2 * 2 * q)
    forward, backward = ring.parallel_scratch("fused", 2, 64)
    assert forward == 2 * 2 * 2 * kv + 2 * q + 2 * 8 * FP32_BYTES * m.n_heads
    assert backward == forward + FP32_BYTES * (q + 4 * kv)
    # tp 2 x cp 2: one kv head per rank, repeated to 2 for Ulysses' two ranks.
    assert _tiny(devices=4, tensor_parallel_size=2, context_parallel_size=2).profile.ulysses_kv_repeat == 2
    assert _tiny(context_parallel_size=2).profile.ulysses_kv_repeat == 1


def test_each_new_communicator_holds_two_hccl_buffers():
    """Plain sharding: one communicator (the world's); tp adds its group and FSDP's dp_shard x cp group, cp its own."""
    def comm(**parallel) -> float:
        spec = dataclasses.replace(_tiny(devices=4, **parallel), hccl_buffsize_mb=100.0)
        return estimate(spec).items["comm"] / (2 * 100 * 2**20)

    assert (comm(), comm(tensor_parallel_size=2), comm(context_parallel_size=2),
            comm(tensor_parallel_size=2, context_parallel_size=2)) == (1, 3, 2, 4)


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=3), r"tensor_parallel_size=3 does not divide the 6 devices|n_heads=4 is not divisible"),
    (dict(tensor_parallel_size=8), r"n_heads=4 is not divisible by tensor_parallel_size=8.*n_kv_heads=2 is not"
                                   r" divisible.*Use a tensor_parallel_size that divides them \(1, 2\)"),
    (dict(tensor_parallel_size=2, context_parallel_size=4, context_parallel_algo="ulysses"),
     r"heads % \(tp x cp\) == 0 \(4 % 8 = 4\).*or context_parallel_algo='ring'"),
    (dict(context_parallel_size=8, context_parallel_algo="ring"),
     r"seq_len=72 does not split into 2 x context_parallel_size = 16"),
])
def test_sizes_that_do_not_divide_are_refused_with_the_numbers_and_the_fix(options, message):
    devices = {3: 6, 8: 8}.get(options.get("tensor_parallel_size"), 8)
    with pytest.raises(PlanError, match=message):
        _tiny(devices=devices, seq_len=72, **options)


@pytest.mark.parametrize("options, message", [
    (dict(context_parallel_size=3, context_parallel_algo="sideways"),
     r"context_parallel_algo='sideways' is not supported; use 'ulysses'"),
    (dict(tensor_parallel_size=0), r"tensor_parallel_size=0 must be a positive integer"),
])
def test_option_values_the_strategy_refuses_the_planner_refuses_with_its_message(options, message):
    """The planner checks its options as npu_fsdp does (``FSDPOptions``): a PlanError with the strategy's words."""
    with pytest.raises(PlanError, match=message):
        load_spec(model_shape=TINY.shape, devices=8, seq_len=72, micro_batch=2, **options)


def test_lora_is_refused_under_tensor_parallelism_and_tied_embeddings_and_experts_plan_under_tp_and_cp(tmp_path):
    """What the recipe's tensor-parallel plan refuses (recipes/train.py check_run) the planner refuses too, with the
    reason; a tied embedding and head split by vocabulary rows is one [vocab / tp, dim] matrix per rank; context
    parallelism splits only attention, so an MoE model plans under it, with expert parallelism too; an MoE model
    plans under tensor parallelism as the parallel core splits it."""
    tied = lightning_npu_memory_profile({"preset": "llama3.2-1b"})
    split_tied = PlanSpec(model=tied.shape, profile=tied, seq_len=512, micro_batch=1, devices=2,
                          options=FSDPOptions(tensor_parallel_size=2))
    vocab, dim = tied.shape.vocab_size, tied.shape.dim
    assert split_tied.profile.root_parameters().shapes == [(vocab // 2, dim), (dim,)]
    lora = lightning_npu_memory_profile({"preset": "tiny", "lora": {"rank": 8, "targets": ["q", "v"]}})
    with pytest.raises(PlanError, match=r"LoRA adapters have no tensor-parallel plan"):
        PlanSpec(model=lora.shape, profile=lora, seq_len=64, micro_batch=1, devices=2,
                 options=FSDPOptions(tensor_parallel_size=2))
    from recipes.models.moe.memory_profile import lightning_npu_memory_profile as moe_profile

    moe = moe_profile({"family": "moe", "preset": "tiny"})
    # An MoE model plans under tensor parallelism as the parallel core's design splits it (tests/plan/test_moe.py).
    split = PlanSpec(model=moe.shape, profile=moe, seq_len=64, micro_batch=1, devices=2,
                     options=FSDPOptions(tensor_parallel_size=2))
    assert split.profile.parallel.tensor == 2
    plain = PlanSpec(model=moe.shape, profile=moe, seq_len=64, micro_batch=2, devices=2)
    cp = dataclasses.replace(plain, options=FSDPOptions(context_parallel_size=2, context_parallel_algo="ring"))
    assert estimate(cp).items["activations"] < estimate(plain).items["activations"]
    # With expert parallelism too (ep borrows its ranks from dp_shard x cp): see tests/plan/test_moe.py.
    ep = PlanSpec(model=moe.shape, profile=moe.with_expert_parallelism(2), seq_len=64, micro_batch=1, devices=4,
                  options=FSDPOptions(context_parallel_size=2))
    assert (ep.shard_group, ep.local_seq_len, ep.profile.expert_parallel_size) == (4, 32, 2)


def test_the_config_s_strategy_values_are_read_and_the_flags_override_them(tmp_path, capsys):
    """Fails on the planner before TP / CP, which refused these configs (it would have reported plain sharding)."""
    config = tmp_path / "run.yaml"
    config.write_text(
        "model:\n  preset: tiny\ndata:\n  seq_len: 128\n  batch_size: 2\n"
        "trainer:\n  devices: 4\n  strategy:\n    class_path: lightning_npu.NPUFSDPStrategy\n    init_args:\n"
        "      auto_wrap_policy: [recipes.models.llama.model.TransformerBlock]\n      tensor_parallel_size: 2\n"
        "      sequence_parallel: false\n      loss_parallel: false\n"
    )
    spec = load_spec(config)
    assert spec.parallel.report() == {"tensor": 2, "context": 1, "context_algo": "ulysses", "sequence_parallel": False,
                                      "loss_parallel": False}
    assert spec.shard_group == 2
    flagged = load_spec(config, tensor_parallel_size=1, context_parallel_size=4, context_parallel_algo="ring")
    assert flagged.parallel.report() == {"tensor": 1, "context": 4, "context_algo": "ring", "sequence_parallel": False,
                                         "loss_parallel": False}
    assert (flagged.shard_group, flagged.local_seq_len) == (4, 32)
    assert main(["plan", "--config", str(config), "--tp", "2", "--cp", "2", "--cp-algo", "ulysses", "--json"]) == 0
    printed = capsys.readouterr().out
    plan = json.loads(printed)
    assert plan["parallel"]["tensor"] == 2 and plan["parallel"]["context"] == 2 and plan["shard_group"] == 2
    assert main(["plan", "--config", str(config), "--cp", "3"]) == 2
    assert "does not divide the world size 4" in capsys.readouterr().err


@pytest.mark.parametrize("config", [CONFIG_70B, CONFIG_128K], ids=lambda path: path.name)
def test_the_parallel_configs_fit_on_64_gib_npus_and_pass_the_recipes_checks(config):
    """``lightning-npu plan --config`` says the 70B (tp 8 x FSDP 4 on 4 x 8) and the 128k-token (ring cp 8 on 8)
    configs fit on the default 64 GiB 910B, under the recipe's own shape checks (what check_run runs before
    workers start)."""
    from recipes.decoder.tensor_parallel import model_shapes
    from recipes.models.llama.config import LLaMAConfig

    spec = load_spec(config)
    planned = estimate(spec)
    assert planned.fits and planned.total < 60 * GIB, f"{config.name}: {planned.total / GIB:.2f} GiB"
    document = yaml.safe_load(config.read_text())
    options = document["trainer"]["strategy"]["init_args"]
    model = LLaMAConfig.from_preset(document["model"]["preset"])
    seq_len = document["data"]["seq_len"]
    tp, cp = options.get("tensor_parallel_size", 1), options.get("context_parallel_size", 1)
    parallel_rules.check(FSDPOptions(**options), model_shapes(model), BatchShapes(seq_len=seq_len))
    assert seq_len <= model.max_seq_len and (tp, cp) == (spec.parallel.tensor, spec.parallel.context)
    if config == CONFIG_128K:
        assert (seq_len, spec.parallel.context_algo, spec.local_seq_len) == (131072, "ring", 16384)
        assert not estimate(load_spec(config, context_parallel_size=1)).fits  # why it needs CP
    else:
        # Plain 32-way sharding fits 70B only just (ZeRO-3, a micro-batch of 1 or 2; ZeRO-2 not at all); tp 8 leaves
        # room for far larger micro-batches (and each FSDP all-gather crosses the nodes with 1/8 of the bytes).
        plain = load_spec(config, tensor_parallel_size=1)
        assert estimate(plain).total > planned.total + 10 * GIB and not estimate(plain, 2).fits
        assert max_micro_batch(plain) <= 2 < 10 < max_micro_batch(spec)
        assert math.prod((spec.nodes, spec.devices)) == 32


@pytest.mark.slow  # starts a process
def test_a_split_block_keeps_what_the_profile_counts():
    """The recipe's LLaMA block as rank 0 of a TP or CP pair (tests/plan/scripts/plan_parallel_saved.py: fake process
    group, the recipe's TP plan or a ContextParallel) keeps exactly the bytes per token the profile counts, tensor by
    tensor through autograd's saved-tensor hooks: tp 2 with and without sequence parallelism, cp 2 Ulysses and ring.
    Catches the projections' inputs counted split (they are all-gathered: tp2 -1024 B per token), the norms left
    whole under sequence parallelism (tp2 +1028), Ulysses' head-split output left out (-512) and ring's fp32 output
    counted again as wo's input (+512)."""
    proc = run_python([str(SCRIPTS / "plan_parallel_saved.py")], simulate=None)
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [row["case"] for row in rows] == ["tp2", "tp2_no_sp", "cp2_ulysses", "cp2_ring"]
    for row in rows:
        assert row["measured"] == row["predicted"], row
