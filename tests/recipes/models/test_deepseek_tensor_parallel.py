"""DeepSeek's Multi-head Latent Attention under tensor parallelism (recipes/models/deepseek/tensor_parallel.py): the
plan's styles, the head-count check, an attention holding only its rank's heads, and two gloo ranks against the
unsplit attention (tests/recipes/models/scripts/deepseek_tensor_parallel_check.py)."""

import json

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from recipes.decoder.layers import Linear
from recipes.decoder.transformer import RMSNorm
from recipes.models.deepseek.config import DeepSeekConfig
from recipes.models.deepseek.model import MLAttention
from lightning_npu.parallel.tensor import ReplicatedParallel
from recipes.models.deepseek.tensor_parallel import mla_attention_plan
from tests.helpers import room_scripts, run_python
from tests.recipes.models.scripts.deepseek_tensor_parallel_check import SEQ, SHAPE, rotary
from tests.quick_tier import slow_fixture

SCRIPTS = room_scripts("recipes/models")


def mla(q_lora_rank) -> MLAttention:
    return MLAttention(DeepSeekConfig.from_preset("tiny", q_lora_rank=q_lora_rank, **SHAPE))


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_the_plan_splits_the_up_projections_and_replicates_the_low_ranks_summing_the_rotary_key_gradient(q_lora_rank):
    """Every projection and norm of the attention is named (one left out would meet a DTensor input, or stay whole
    beside split neighbours), by the style of its part; wkv_a's summed channels are exactly the rotary key's."""
    attention = mla(q_lora_rank)
    plan = mla_attention_plan("layers.3.attention.", attention, sequence_parallel=True)
    modules = {"layers.3.attention." + name: module for name, module in attention.named_modules() if name}
    assert set(plan) == {name for name, module in modules.items() if isinstance(module, (Linear, RMSNorm))}
    up = {"wkv_b"} | ({"wq"} if q_lora_rank is None else {"wq_b"})
    for name, style in plan.items():
        short = name.rsplit(".", 1)[1]
        expected = ColwiseParallel if short in up else RowwiseParallel if short == "wo" else ReplicatedParallel
        assert type(style) is expected, name
    assert plan["layers.3.attention.wkv_a"].partial_grad_channels == slice(16, 20)  # [latent 16; k_rot 4]
    assert plan["layers.3.attention.kv_norm"].partial_grad_channels is None
    assert plan["layers.3.attention.wo"].output_layouts == (Shard(1),)  # the residual stream's layout
    plain = mla_attention_plan("", attention, sequence_parallel=False)
    assert plain["wo"].output_layouts == (Replicate(),)


def test_a_head_count_the_tensor_parallel_size_does_not_divide_is_refused_before_workers_start():
    from lightning_npu.facts.options import FSDPOptions
    from lightning_npu.facts.parallel_rules import BatchShapes, check_tensor_parallel
    from recipes.decoder.tensor_parallel import model_shapes

    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot split this model: n_heads=4 is not divisible"
                                         r" by tensor_parallel_size=3"):
        check_tensor_parallel(FSDPOptions(tensor_parallel_size=3, sequence_parallel=False),
                              model_shapes(DeepSeekConfig.from_preset("tiny", **SHAPE)), BatchShapes(seq_len=SEQ))
    with pytest.raises(TypeError, match=r"layers.0.attention \(Linear\) is not an MLAttention"):
        mla_attention_plan("layers.0.attention", Linear(4, 4), sequence_parallel=False)


def test_a_stepped_channel_slice_is_refused():
    with pytest.raises(ValueError, match=r"partial_grad_channels=slice\(0, 8, 2\) must be a contiguous slice"):
        ReplicatedParallel(partial_grad_channels=slice(0, 8, 2))


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_the_attention_reads_its_head_count_from_the_split_projections(q_lora_rank):
    """What each tensor-parallel rank holds, without processes: the attention with the rows of wq / wq_b and wkv_b and
    the columns of wo of half the heads gives its half of the output, and the halves sum to the whole attention's.
    Catches a forward that takes the config's n_heads (a view or expand over heads the rank does not hold)."""
    torch.manual_seed(0)
    whole = mla(q_lora_rank)
    x = torch.randn(2, SEQ, SHAPE["dim"])
    cos, sin = rotary(DeepSeekConfig.from_preset("tiny", q_lora_rank=q_lora_rank, **SHAPE))
    expected = whole(x, cos, sin)
    halves = []
    for rank in range(2):
        part = mla(q_lora_rank)
        part.load_state_dict(whole.state_dict())
        for name in ("wq" if q_lora_rank is None else "wq_b", "wkv_b"):
            rows = getattr(whole, name).weight.chunk(2, dim=0)[rank]
            setattr(part, name, Linear(rows.shape[1], rows.shape[0]))
            getattr(part, name).weight.data.copy_(rows)
        columns = whole.wo.weight.chunk(2, dim=1)[rank]
        part.wo = Linear(columns.shape[1], columns.shape[0])
        part.wo.weight.data.copy_(columns)
        halves.append(part(x, cos, sin))
    torch.testing.assert_close(halves[0] + halves[1], expected, rtol=0, atol=1e-5)


@slow_fixture(scope="module")
def two_ranks() -> list[dict]:
    out = run_python([str(SCRIPTS / "deepseek_tensor_parallel_check.py")], simulate=2, timeout=180)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # two processes
def test_two_ranks_give_the_unsplit_attentions_output_and_every_gradient(two_ranks):
    """q_lora_rank None and set, rotary interleaved or not, sequence parallelism on and off: the output, the block
    input's gradient and every parameter's gradient (split ones gathered whole, replicated ones on each rank) are the
    unsplit attention's within 1e-5 (fp32). The up-projections and wo are split, the low ranks and norms plain."""
    runs = [run for run in two_ranks if run["wkv_a"] is None]
    assert sorted((r["q_lora_rank"] or 0, r["interleaved"], r["sequence_parallel"]) for r in runs) == sorted(
        (q, i, s) for q in (0, 24) for i in (False, True) for s in (False, True))
    for run in runs:
        assert run["output"] <= 1e-5 and run["input_grad"] <= 1e-5, run
        assert max(run["grads"].values()) <= 1e-5, run
        up = ["attention.wq.weight"] if run["q_lora_rank"] is None else ["attention.wq_b.weight"]
        assert run["split"] == sorted(up + ["attention.wkv_b.weight", "attention.wo.weight"])
        low = ["attention.wq_a.weight", "attention.q_norm.weight"] if run["q_lora_rank"] else []
        norm = [] if run["sequence_parallel"] else ["attention_norm.weight"]  # else a Replicate DTensor
        assert run["plain"] == sorted(low + norm + ["attention.wkv_a.weight", "attention.kv_norm.weight"])


@pytest.mark.slow  # two processes
def test_without_the_rotary_key_gradient_sum_or_with_the_latent_summed_too_wkv_a_learns_wrong(two_ranks):
    """The same attention with wkv_a's style swapped: replicated without any gradient sum (each rank's rotary-key
    gradient is its own heads' share), and summing all of wkv_a's output channels (the latent's gradient, already
    whole, counted twice). The forward is still right, so only gradients show it: wkv_a's and, upstream, the block
    input's and the attention norm's are off by far more than the tolerance; the query side's are not."""
    ablations = [run for run in two_ranks if run["wkv_a"] is not None]
    assert sorted((r["wkv_a"], r["sequence_parallel"]) for r in ablations) == sorted(
        (style, s) for style in ("ReplicatedParallel(partial_grad_channels=None)",
                                 "ReplicatedParallel(partial_grad_channels=slice(0, 20, None))") for s in (False, True))
    for run in ablations:
        assert run["output"] <= 1e-5, run
        assert run["grads"]["attention.wkv_a.weight"] > 1e-2, run
        assert run["input_grad"] > 1e-2 and run["grads"]["attention_norm.weight"] > 1e-2, run
        assert run["grads"]["attention.wq_a.weight"] <= 1e-5 and run["grads"]["attention.wkv_b.weight"] <= 1e-5, run
