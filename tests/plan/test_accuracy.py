"""The planner's estimate against the measured peak of real training steps, in CI: a small version of
``benchmarks/plan_accuracy.py`` that runs the benchmark's own measurement (``compare``: Trainer + npu_fsdp on the
simulated runtime, one process posing as rank 0 of 2 or 4 over torch's fake process group, peak from the allocator's
reports to the profiler, calibration checked)."""

import json

import pytest

from recipes.decoder.lora_config import EXPERT_TARGETS
from tests.helpers import SUBPROCESS_TIMEOUT_S, read_json, room_scripts, run_python
from tests.prefetch import PREFETCHED

SCRIPTS = room_scripts("plan")

#: The bound plan.py states for the replay against the benchmark ("within 5%"). The measured peaks are
#: deterministic (allocation sizes, not timings), so the margin does not need to absorb noise.
pytestmark = pytest.mark.slow  # every test here starts processes or trains (or shares a fixture that does)


TOLERANCE_PCT = 5.0

# Two optimizer steps: the first is excluded (no AdamW states yet), the second is the steady state measured.
# Short sequences keep the parameter, gradient and AdamW shards a large share of the peak, so an error in the
# states' arithmetic moves the estimate well past the tolerance; the checkpointed ZeRO-2 case keeps every block
# gathered and recomputes activations in backward.
CASES = {
    "zero3": dict(model={}, seq=64, batch=2, devices=2, zero=3, ac=0.0, steps=2),
    "zero2_ac1": dict(model={}, seq=64, batch=2, devices=2, zero=2, ac=1.0, steps=2),
    # LoRA (the recipe's add_lora: frozen base, adapters only in the optimizer): the states are a small share of the
    # peak, so the batch is larger (about 0.7 MiB the planner misses in every tiny case, LoRA or not, stays well
    # under the tolerance); with dropout each adapter keeps its own dropped-out input and mask.
    "lora_zero3": dict(model={}, seq=128, batch=4, devices=2, zero=3, ac=0.0, steps=2,
                       lora=dict(rank=8, targets=["q", "k", "v", "o"])),
    "lora_dropout_zero2": dict(model={}, seq=128, batch=4, devices=2, zero=2, ac=0.0, steps=2,
                               lora=dict(rank=8, dropout=0.1, targets=["q", "k", "v", "o", "gate", "up", "down"])),
    # MoE (recipes/models/moe/memory_profile.py): the tiny Qwen3-MoE (8 stacked experts, top-2, q/k norms,
    # load-balancing loss) with half its blocks checkpointed; a Qwen2-MoE with a shared expert, a dense first layer
    # and qkv biases, LoRA on attention over the frozen experts, under ZeRO-2.
    "moe_zero3_ac05": dict(family="moe", model={}, seq=128, batch=4, devices=2, zero=3, ac=0.5, steps=2),
    "moe_qwen2_lora_zero2": dict(family="moe", model=dict(
        architecture="qwen2_moe", shared_expert_hidden_dim=192, dense_layers=[0], dense_hidden_dim=256, qkv_bias=True,
        norm_topk_prob=False), seq=128, batch=4, devices=2, zero=2, ac=0.0, steps=2,
        lora=dict(rank=8, targets=["q", "k", "v", "o"])),
    # DeepSeek (recipes/models/deepseek/memory_profile.py): the tiny DeepSeek-V3 (MLA with a query low rank, v
    # narrower than q/k and padded for the kernel, 8 routed + 1 shared experts, the first layer dense) with half its
    # blocks checkpointed; without the query low rank under ZeRO-2.
    "deepseek_zero3_ac05": dict(family="deepseek", model={}, seq=128, batch=4, devices=2, zero=3, ac=0.5, steps=2),
    "deepseek_no_q_lora_zero2": dict(family="deepseek", model=dict(q_lora_rank=None), seq=128, batch=4, devices=2,
                                     zero=2, ac=0.0, steps=2),
    # Multi-token prediction (mtp_layers 1): one more DeepSeekMoE block after the trunk, which the ratio 0.5 of four
    # blocks checkpoints (npu_fsdp's policy counts it), the depth's norms and projection in the root unit, its own fp32
    # logits kept until its cross-entropy after the main loss, and its embedding gradient made before the trunk's.
    "deepseek_mtp_zero3_ac05": dict(family="deepseek", model=dict(mtp_layers=1), seq=128, batch=4, devices=2,
                                    zero=3, ac=0.5, steps=2),
    # Tensor and context parallelism (npu_fsdp's tensor_parallel_size / context_parallel_size, the recipe's TP plan
    # with sequence parallelism and loss_parallel): one rank's share of the split weights, of the tokens, of the
    # logits, and what Ulysses' all-to-alls and ring attention keep.
    "tp2": dict(model={}, seq=64, batch=2, devices=2, zero=3, ac=0.0, steps=2, tp=2),
    "cp2_ulysses": dict(model={}, seq=64, batch=2, devices=2, zero=3, ac=0.0, steps=2, cp=2, cp_algo="ulysses"),
    "cp2_ring": dict(model={}, seq=64, batch=2, devices=2, zero=3, ac=0.0, steps=2, cp=2, cp_algo="ring"),
    "tp2_cp2_ulysses": dict(model={}, seq=64, batch=2, devices=4, zero=3, ac=0.0, steps=2, tp=2, cp=2,
                            cp_algo="ulysses"),
    # Expert parallelism with context parallelism (ep 2 x cp 2 on 4 ranks: ep borrows its ranks from dp_shard x cp):
    # each rank's half of the experts as an FSDP unit of their own over the 2 ranks holding them, its seq / cp tokens
    # and their routed rows' all-to-alls; the tiny MoE (Ulysses; and ring with experts that outweigh the rest of each
    # block, ZeRO-3) and the tiny DeepSeek (ring; Ulysses under ZeRO-2).
    "moe_ep2_cp2_ulysses": dict(family="moe", model={}, seq=128, batch=4, devices=4, zero=3, ac=0.0, steps=2, ep=2,
                                cp=2, cp_algo="ulysses"),
    "moe_ep2_cp2_ring_heavy": dict(family="moe", model=dict(n_experts=16, expert_hidden_dim=512), seq=64, batch=2,
                                   devices=4, zero=3, ac=0.0, steps=2, ep=2, cp=2, cp_algo="ring"),
    "deepseek_ep2_cp2_ring": dict(family="deepseek", model={}, seq=128, batch=4, devices=4, zero=3, ac=0.0, steps=2,
                                  ep=2, cp=2, cp_algo="ring"),
    "deepseek_ep2_cp2_ulysses_zero2": dict(family="deepseek", model={}, seq=128, batch=4, devices=4, zero=2, ac=0.0,
                                           steps=2, ep=2, cp=2, cp_algo="ulysses"),
    # LoRA on the experts (per-expert adapters stacked like the experts, the rest frozen): the tiny MoE's three expert
    # projections; a Qwen2-MoE's attention and experts with dropout under ZeRO-2 (its dense first layer and first
    # MoE layer keep only what their input-less backward needs); DeepSeek's under ep 2 x cp 2 ring.
    "moe_expert_lora_zero3": dict(family="moe", model={}, seq=256, batch=4, devices=2, zero=3, ac=0.0, steps=2,
                                  lora=dict(rank=8, targets=["expert_gate", "expert_up", "expert_down"])),
    "moe_qwen2_expert_lora_dropout_zero2": dict(family="moe", model=dict(
        architecture="qwen2_moe", shared_expert_hidden_dim=192, dense_layers=[0], dense_hidden_dim=256, qkv_bias=True,
        norm_topk_prob=False), seq=128, batch=4, devices=2, zero=2, ac=0.0, steps=2,
        lora=dict(rank=8, dropout=0.1, targets=["q", "v", "expert_gate", "expert_down"])),
    "deepseek_expert_lora_ep2_cp2_ring": dict(family="deepseek", model={}, seq=128, batch=4, devices=4, zero=3,
                                              ac=0.0, steps=2, ep=2, cp=2, cp_algo="ring",
                                              lora=dict(rank=8, targets=["o", *EXPERT_TARGETS])),
    # MoE under tensor parallelism: a Qwen2-MoE (shared expert split like a dense MLP, a dense first layer) at tp 2,
    # and the tiny MoE at tp 2 x ep 2 (the pair splits the experts, each rank runs its share of the routed rows).
    "moe_qwen2_tp2": dict(family="moe", model=dict(
        architecture="qwen2_moe", shared_expert_hidden_dim=192, dense_layers=[0], dense_hidden_dim=256, qkv_bias=True,
        norm_topk_prob=False), seq=128, batch=4, devices=2, zero=3, ac=0.0, steps=2, tp=2),
    "moe_tp2_ep2_dev4_zero2": dict(family="moe", model={}, seq=128, batch=4, devices=4, zero=2, ac=0.0, steps=2,
                                   tp=2, ep=2),
    # Pipeline parallelism (real gloo processes, each pipeline rank against its own estimate; the row's error is the
    # worst rank's): ZBV's V-shaped stages and split backward; interleaved 1F1B over dp 2 with half the blocks
    # checkpointed. Two steady steps each: a free that gloo's threads make unseen before a step's peak raises that
    # step's reading, and needs to happen in both for the smaller of them to be off (``steady_peak``).
    "pp2_zbv": dict(model=dict(n_layers=6), seq=128, batch=4, devices=2, zero=3, ac=0.0, steps=3, pp=2,
                    pp_schedule="ZBVZeroBubble", microbatches=4),
    "pp2_dp2_interleaved_ac05": dict(model={}, seq=128, batch=4, devices=4, zero=3, ac=0.5, steps=3, pp=2,
                                     pp_schedule="Interleaved1F1B", microbatches=2),
}


@PREFETCHED.fixture(seconds=50)
def measured_peaks(tmp_path_factory):
    """Every case measured, one worker process each (``compare`` through tests/plan/scripts/plan_accuracy_cases.py)."""
    out = tmp_path_factory.mktemp("plan_accuracy") / "cases.json"
    run_python([str(SCRIPTS / "plan_accuracy_cases.py"), json.dumps(CASES), str(out), str(SUBPROCESS_TIMEOUT_S)],
               simulate=None, timeout=SUBPROCESS_TIMEOUT_S * len(CASES))
    return read_json(out)


@pytest.mark.parametrize("name", list(CASES))
def test_planner_estimate_is_within_the_stated_error_of_the_measured_peak(name, measured_peaks):
    """Fails when the planner's arithmetic breaks. Seen: counting one AdamW moment instead of two (``state_bytes``:
    ``"optimizer": shard``) puts the cases 15.7% and 17.7% low; modelling the ZeRO-3 root unit as resharded after
    forward (the planner before npu_fsdp sharded the root with reshard_after_forward=False) puts zero3 6.5% low.
    LoRA: the planner before LoRA support, which planned a LoRA run as full fine-tuning (gradients and AdamW
    moments for the frozen base, frozen projections' inputs kept, no adapters), is +30.9% (lora_zero3) and -10.8%
    (lora_dropout_zero2) off; ignoring the adapters' dropout puts lora_dropout_zero2 23.3% low. MoE (moe_zero3_ac05,
    moe_qwen2_lora_zero2): the planner before the MoE profile found no profile for the family's configs; planning the
    experts as one dense SwiGLU of top_k x their width (no router, permutation or unpermute tensors) is -8.8% and
    -13.9% off, the routed rows as one per token instead of top_k is -9.8% and -5.9%, and keeping the frozen experts'
    grouped-matmul inputs under LoRA puts moe_qwen2_lora_zero2 6.4% high. DeepSeek (measured -3.0% and +0.0%): the
    planner before its profile found none for the family. TP / CP (tp2, cp2_ulysses, cp2_ring,
    tp2_cp2_ulysses): the planner before them refused tensor_parallel_size and context_parallel_size; planning them
    as plain sharding over the same devices is +25.9%, +17.8%, +19.6% and +67.4% off. EP x CP (moe_ep2_cp2_*,
    deepseek_ep2_cp2_*): the planner before refused expert_parallel_size with context_parallel_size; gathering the
    experts with their block (not as their own unit) puts moe_ep2_cp2_ring_heavy 5.1% high. Expert adapters
    (moe_expert_lora_zero3, moe_qwen2_expert_lora_dropout_zero2, deepseek_expert_lora_ep2_cp2_ring): the planner
    before refused expert targets. Multi-token prediction (deepseek_mtp_zero3_ac05, measured -2.5%): the planner
    before refused mtp_layers > 0, and planning with mtp_layers=0 as it advised is -21.2% off; leaving the depth's
    logits out of the loss's backward (3 fp32 logits' worth at the peak, not 4) puts it 11.7% low. Also fails if the
    benchmark's profiler calibration is off (``compare`` raises)."""
    assert "error" not in measured_peaks[name], measured_peaks[name].get("error")
    row = measured_peaks[name]["row"]
    assert row["check_calibration"]["measured_peak"] == row["check_calibration"]["expected_peak"]
    assert abs(row["error_pct"]) <= TOLERANCE_PCT, (
        f"{name}: planned {row['predicted_mib']:.2f} MiB, measured {row['measured_mib']:.2f} MiB"
        f" ({row['error_pct']:+.1f}%); planned items {row['predicted_items_mib']}"
    )
