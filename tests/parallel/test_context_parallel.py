"""Context parallelism under npu_fsdp (``lightning_npu.parallel.context``, its blocks ``lightning_npu.kernels.blockwise_attention``): Ulysses and ring attention equal
full causal attention forward and backward (packed rows under Ulysses; the ring's NPU blocks against the strict fake
of each recorded torch_npu release), the tiny recipe trains with plain sharding's per-step losses with
context_parallel_size=2, and sizes that cannot split the heads or the sequence fail before workers start."""

import importlib

import pytest
import torch

from lightning_npu.facts.parallel_rules import check_context_parallel_shapes
from tests.helpers import REPO, read_json, room_scripts, run_python
from tests.recipe_runs import train_tiny
from tests.kernels.test_kernels import _take_npu_branch, install_cann
from tests.recipes.test_e2e import STRATEGY, _assert_fails_before_workers
from tests.prefetch import PREFETCHED

SCRIPTS = room_scripts("parallel")

blockwise = importlib.import_module("lightning_npu.kernels.blockwise_attention")
RELEASES = ("2.6.0", "2.13.0", "2.14.0")


@pytest.mark.parametrize(
    ("cp", "algo", "heads", "seq_len", "tp", "message"),
    [
        (4, "ulysses", 6, 64, 1, r"splits each rank's 6 / tensor_parallel_size=1 attention heads over"
                                 r" context_parallel_size=4 ranks, which needs heads % \(tp x cp\) == 0 \(6 % 4 = 2\)"),
        (2, "ulysses", 8, 64, 8, r"8 / tensor_parallel_size=8 attention heads .* \(8 % 16 = 8\).*or"
                                 r" context_parallel_algo='ring'"),
        (2, "ulysses", 8, 63, 1, r"seq_len=63 does not split into context_parallel_size=2 equal chunks"),
        (2, "ring", 6, 66, 1, r"seq_len=66 does not split into 2 x context_parallel_size = 4 equal chunks .* a"
                              r" multiple of 4"),
        (2, "zigzag", 8, 64, 1, r"context_parallel_algo='zigzag' is not supported"),
    ],
)
def test_sizes_that_cannot_split_the_heads_or_the_sequence_are_refused_with_the_numbers(cp, algo, heads, seq_len, tp,
                                                                                       message):
    with pytest.raises(ValueError, match=message):
        check_context_parallel_shapes(cp, algo, heads=heads, seq_len=seq_len, tp=tp)
    check_context_parallel_shapes(1, algo, heads=heads, seq_len=seq_len, tp=tp)  # no context parallelism: no rule


@pytest.mark.parametrize(("dv", "cann"), [(8, None), (6, "8.1.RC1"), (6, "8.2.RC1")],
                         ids=["dv=dk", "mla-cann8.1-padded", "mla-cann8.2-unpadded"])
@pytest.mark.parametrize("release", RELEASES)
def test_the_ring_npu_block_merges_and_differentiates_like_the_exact_block(monkeypatch, tmp_path, release, dv, cann):
    """One query block against two key/value blocks (the causal diagonal, then a full one), merged through their
    softmax statistics, and each block's backward from the merged statistics: npu_fusion_attention and
    npu_fusion_attention_grad (strict fake) give the exact fp32 block's outputs and gradients, called as documented
    (sparse_mode 3 with the compressed mask on the diagonal only; [B, N, Sq, 8] fp32 statistics). With v heads
    smaller than q/k's (MLA), on a CANN before 8.2.RC1 (whose fake refuses Dv < Dk) v, out and dout reach both ops
    zero-padded; from 8.2.RC1 on unpadded."""
    install_cann(monkeypatch, tmp_path, cann)
    fake = _take_npu_branch(monkeypatch, release=release, cann_version=cann)
    generator = torch.Generator().manual_seed(0)
    b, s, h, hkv, d = 2, 6, 4, 2, 8
    q = torch.randn(b, s, h, d, generator=generator)
    blocks = [(torch.randn(b, s, hkv, d, generator=generator), torch.randn(b, s, hkv, dv, generator=generator))
              for _ in range(2)]
    dout = torch.randn(b, s, h, dv, generator=generator)

    def run(block):
        out = torch.zeros(b, s, h, dv)
        row_max, row_sum = torch.full((b, h, s), float("-inf")), torch.zeros(b, h, s)
        for (k, v), causal in zip(blocks, (True, False)):
            blockwise.merge(out, row_max, row_sum, slice(None), block.forward(q, k, v, causal, 0.3))
        grads = [block.backward(q, k, v, dout, out, row_max, row_sum, causal, 0.3)
                 for (k, v), causal in zip(blocks, (True, False))]
        return out, grads

    exact_out, exact_grads = run(blockwise.REFERENCE_BLOCK)
    npu_out, npu_grads = run(blockwise.NPU_BLOCK)
    assert torch.allclose(npu_out, exact_out, atol=1e-5)
    for exact, npu in zip(exact_grads, npu_grads):
        for a, b_ in zip(exact, npu):
            assert torch.allclose(b_.float(), a, atol=1e-5)
    forward = fake.calls_to("npu_fusion_attention")
    assert [call.get("sparse_mode") for call in forward] == [3, None]
    assert forward[0]["atten_mask"].shape == (2048, 2048) and "atten_mask" not in forward[1]
    grad = fake.calls_to("npu_fusion_attention_grad")
    assert len(grad) == 2 and grad[0]["softmax_max"].shape == (b, h, s, 8) and grad[0]["sparse_mode"] == 3
    sent = d if cann == "8.1.RC1" else dv
    assert {call["value"].shape[-1] for call in forward + grad} == {sent}
    assert {call[name].shape[-1] for call in grad for name in ("dy", "attention_in")} == {sent}


def test_the_exact_block_merged_over_key_blocks_is_attention_over_all_keys():
    """Catches a wrong merge (statistics or weights): two non-causal blocks merged equal softmax over their keys."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    k2, v2 = (torch.randn(1, 4, 2, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    out = torch.zeros(1, 4, 2, 8, dtype=torch.float64)
    row_max = torch.full((1, 2, 4), float("-inf"), dtype=torch.float64)
    row_sum = torch.zeros(1, 2, 4, dtype=torch.float64)
    for keys, values in ((k, v), (k2, v2)):
        blockwise.merge(out, row_max, row_sum, slice(None), blockwise.REFERENCE_BLOCK.forward(q, keys, values, False, 0.5))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, torch.cat((k, k2), 1)) * 0.5
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), torch.cat((v, v2), 1))
    assert torch.allclose(out, expected, atol=1e-6)


@PREFETCHED.fixture(seconds=13)
def attention_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_attention")
    runs = {}
    for fake in (None, *RELEASES):
        path = out / f"{fake or 'reference'}.json"
        run_python([str(SCRIPTS / "context_parallel_attention_run.py"), "--out", str(path),
                    *(["--fake", fake] if fake else [])], simulate=None, timeout=900)
        runs[fake or "reference"] = read_json(path)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("path", ["reference", *RELEASES])
def test_ulysses_and_ring_attention_equal_full_causal_attention_forward_and_backward(attention_runs, path):
    """On 4 gloo processes (cp = 4, and cp = 2 in two groups): Ulysses (GQA with key/value heads repeated, packed
    rows crossing the chunk boundaries) and ring attention (head-tail chunks, GQA) give each rank its shard of full
    causal attention and of its q/k/v gradients, also with v heads smaller than q/k's (MLA: Dk 24, Dv 16, cp 2); on the NPU branch through the fake's npu_fusion_attention and
    npu_fusion_attention_grad. The tiny LLaMA and DeepSeek (MLA) give the same logits and parameter gradients
    through them, and a
    loss over unevenly placed labelled tokens averages (token_mean) to the mean over the whole sequences."""
    result = attention_runs[path]
    cases = ["ulysses_gqa_repeat", "ulysses_mha", "ulysses_packed", "ring_cp4_gqa", "ring_cp2", "ulysses_cp2_mla",
             "ulysses_cp2_packed_mla", "ring_cp2_mla"]
    if path == "reference":
        cases += ["model_ulysses_packed", "model_ring", "deepseek_ulysses_packed", "deepseek_ring", "token_mean"]
    else:
        # Ulysses' 3 + 2 (MLA) causal calls, then 4 + 2 + 2 (MLA) ring steps forward, and each ring step's backward.
        assert result["npu_calls"] == {"npu_fusion_attention": 13, "npu_fusion_attention_grad": 8}
    for case in cases:
        assert max(result[case].values()) < 1e-5, (case, result[case])
    refusals = result["refusals"]
    assert "splits the 6 attention heads of each rank over context_parallel_size=4" in refusals["ulysses_heads"]
    assert "context_parallel_algo='ring' does not take packed rows" in refusals["ring_packed"]
    assert "12 tokens does not split into 8 equal parts" in refusals["ring_split"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([STRATEGY + "context_parallel_size", "2", STRATEGY + "context_parallel_algo", "ring", "--data.seq_len", "62"],
         "seq_len=62 does not split into 2 x context_parallel_size = 4 equal chunks"),
        ([STRATEGY + "context_parallel_size", "4", "--model.config", "{dim: 192, n_heads: 6, n_kv_heads: 2}"],
         "splits each rank's 6 / tensor_parallel_size=1 attention heads over context_parallel_size=4 ranks"),
        ([STRATEGY + "context_parallel_algo", "zigzag"],
         "error: trainer.strategy (NPUFSDPStrategy): context_parallel_algo='zigzag' is not supported"),
        (["--config", str(REPO / "recipes/models/deepseek/configs/tiny_deepseek.yaml"), "--model.config",
          "{mtp_layers: 1}", STRATEGY + "context_parallel_size", "2"],
         "context_parallel_size=2: model.config.mtp_layers=1: multi-token prediction reads the tokens up to 1 ahead"),
    ],
    ids=["ring-seq-len", "ulysses-heads", "unknown-algo", "deepseek-mtp"],
)
def test_context_parallel_sizes_the_model_cannot_take_fail_before_workers_start(tmp_path, args, message):
    _assert_fails_before_workers(
        tmp_path, lambda: train_tiny(tmp_path / "run", "--trainer.devices", "4", "--trainer.max_steps", "2", *args,
                                     simulate=4), message)
