"""packed_causal_attention: packed samples give exactly what each sample gives alone through causal_attention (forward
and backward, with GQA), on the reference path and on the npu_fusion_attention TND path run against the strict fake of
each recorded torch_npu release; the fake accepts the varlen arguments only as each release documents them."""

from __future__ import annotations

import importlib
import logging
import math

import pytest
import torch

from lightning_npu.kernels import _dispatch, causal_attention, packed_causal_attention, reference_attention
# path: the reference path (None) and the NPU branch against each release's fake; npu: the NPU branch only.
from tests.kernels.test_kernels import _take_npu_branch, npu, path  # noqa: F401 -- fixtures

packed_mod = importlib.import_module("lightning_npu.kernels.packed_attention")

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
COMPRESSED_MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)

# Uneven lengths, a one-token sample, and a sample longer than the others put together: an off-by-one boundary, a
# shared position counter or a mask aligned to the packed row instead of the sample each change some output row.
CASES = {
    "mha": ([0, 5, 6, 9, 17], 2, 2, 8),  # cu_seqlens, q_heads, kv_heads, head_dim
    "gqa": ([0, 3, 10, 12], 4, 2, 8),
    "one_sample": ([0, 7], 4, 1, 8),
}


def _packed_qkv(cu_seqlens, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = cu_seqlens[-1]
    return torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)


def _leaves(*tensors):
    return [x.detach().clone().requires_grad_(True) for x in tensors]


def _check_matches_samples_alone(packed_fn, q, k, v, cu_seqlens):
    """packed_fn(q, k, v, cu_seqlens) equals causal_attention on each sample's slice alone: outputs and the gradients
    of q, k, v (fp32, 1e-5)."""
    packed = _leaves(q, k, v)
    out = packed_fn(*packed, cu_seqlens)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * grad_out).sum().backward()
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        alone = _leaves(q[start:end], k[start:end], v[start:end])
        expected = causal_attention(*(x[None] for x in alone))[0]
        (expected * grad_out[start:end]).sum().backward()
        torch.testing.assert_close(out[start:end], expected, **FP32_TOL)
        for got, want in zip(packed, alone):
            torch.testing.assert_close(got.grad[start:end], want.grad, **FP32_TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_packed_samples_attend_exactly_as_each_sample_alone(path, case):
    """Catches any attention across a sample boundary or a wrong in-sample mask, forward or backward; on the NPU branch
    also a call of npu_fusion_attention that is not the documented varlen one (ends without the leading 0, as host
    ints, the compressed causal mask, an explicit scale)."""
    cu_seqlens, hq, hkv, d = CASES[case]
    _check_matches_samples_alone(packed_causal_attention, *_packed_qkv(cu_seqlens, hq, hkv, d), cu_seqlens)
    if path is not None:
        (call,) = [c for c in path.calls_to("npu_fusion_attention") if c["input_layout"] == "TND"]
        assert call["actual_seq_qlen"] == cu_seqlens[1:] and call["actual_seq_kvlen"] == cu_seqlens[1:]
        assert all(type(end) is int for end in call["actual_seq_qlen"] + call["actual_seq_kvlen"])
        assert call["head_num"] == hq and call["sparse_mode"] == 3
        assert call["scale"] == pytest.approx(1 / math.sqrt(d))
        assert torch.equal(call["atten_mask"], COMPRESSED_MASK)


def _causal_over_the_whole_row(q, k, v, cu_seqlens, scale=None):
    """The leak: one causal mask over the packed row, so every sample also sees the samples before it."""
    return reference_attention(q[None], k[None], v[None], scale=scale)[0]


def test_a_causal_mask_over_the_whole_packed_row_fails_the_equality_check():
    """Shows the equality check can fail: a kernel that leaks across samples (plain causal over the packed row) is
    rejected by it, while the kernel passes it on the same inputs."""
    cu_seqlens, hq, hkv, d = CASES["gqa"]
    inputs = _packed_qkv(cu_seqlens, hq, hkv, d)
    _check_matches_samples_alone(packed_causal_attention, *inputs, cu_seqlens)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        _check_matches_samples_alone(_causal_over_the_whole_row, *inputs, cu_seqlens)


def test_a_leaky_reference_path_fails_the_equality_check(monkeypatch):
    """Catches a reference path that attends across samples: with it swapped in, the equality test fails."""
    monkeypatch.setattr(packed_mod, "reference_packed_attention", _causal_over_the_whole_row)
    cu_seqlens, hq, hkv, d = CASES["mha"]
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        _check_matches_samples_alone(packed_causal_attention, *_packed_qkv(cu_seqlens, hq, hkv, d), cu_seqlens)


def test_cu_seqlens_as_a_tensor_gives_the_same_result_and_host_ints_to_the_op(path):
    """Catches a tensor cu_seqlens reaching npu_fusion_attention as a tensor (its actual_seq arguments are int[])."""
    cu_seqlens, hq, hkv, d = CASES["gqa"]
    q, k, v = _packed_qkv(cu_seqlens, hq, hkv, d)
    from_list = packed_causal_attention(q, k, v, cu_seqlens)
    from_tensor = packed_causal_attention(q, k, v, torch.tensor(cu_seqlens, dtype=torch.int32))
    torch.testing.assert_close(from_tensor, from_list, atol=0, rtol=0)
    if path is not None:
        first, second = path.calls_to("npu_fusion_attention")
        assert second["actual_seq_qlen"] == first["actual_seq_qlen"] == cu_seqlens[1:]
        assert all(type(end) is int for end in second["actual_seq_qlen"])


# ---------------------------------------------------------------- wrong varlen calls the fake must catch


def _call(q, k, v, bounds, scale, **overrides):
    import torch_npu

    ends = bounds[1:]
    args = dict(head_num=q.shape[1], input_layout="TND", atten_mask=COMPRESSED_MASK, scale=scale,
                actual_seq_qlen=ends, actual_seq_kvlen=ends, sparse_mode=3)
    args.update(overrides)
    return torch_npu.npu_fusion_attention(q, k, v, **args)[0]


def _with_cu_seqlens_as_is(q, k, v, bounds, scale):
    return _call(q, k, v, bounds, scale, actual_seq_qlen=bounds, actual_seq_kvlen=bounds)


def _with_a_tensor(q, k, v, bounds, scale):
    ends = torch.tensor(bounds[1:])
    return _call(q, k, v, bounds, scale, actual_seq_qlen=ends, actual_seq_kvlen=ends)


def _with_sample_starts(q, k, v, bounds, scale):
    return _call(q, k, v, bounds, scale, actual_seq_qlen=bounds[:-1], actual_seq_kvlen=bounds[:-1])


def _with_sample_lengths(q, k, v, bounds, scale):
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    return _call(q, k, v, bounds, scale, actual_seq_qlen=lengths, actual_seq_kvlen=lengths)


def _with_one_sample(q, k, v, bounds, scale):
    return _call(q, k, v, bounds, scale, actual_seq_qlen=[bounds[-1]], actual_seq_kvlen=[bounds[-1]])


def _with_sparse_mode_5(q, k, v, bounds, scale):
    return _call(q, k, v, bounds, scale, sparse_mode=5)


def _with_sparse_mode_0_and_no_mask(q, k, v, bounds, scale):
    return _call(q, k, v, bounds, scale, sparse_mode=0, atten_mask=None)


def _with_sparse_mode_0_and_a_packed_row_mask(q, k, v, bounds, scale):
    return _call(q, k, v, bounds, scale, sparse_mode=0, atten_mask=COMPRESSED_MASK[: bounds[-1], : bounds[-1]])


def _without_the_mask(q, k, v, bounds, scale):
    return _call(q, k, v, bounds, scale, atten_mask=None)


def _with_an_sdpa_polarity_mask(q, k, v, bounds, scale):
    return _call(q, k, v, bounds, scale, atten_mask=~COMPRESSED_MASK)


def _without_kvlen(q, k, v, bounds, scale):
    return _call(q, k, v, bounds, scale, actual_seq_kvlen=None)


def _with_misspelt_keyword(q, k, v, bounds, scale):
    return _call(q, k, v, bounds, scale, actual_seq_len=bounds[1:])


WRONG_CALLS = {
    # 2.6.0 refuses the leading 0 first; 2.13.0 / 2.14.0 take it as an empty sample, then refuse the last end.
    "sample_starts": (_with_sample_starts, ValueError, "ends at 10, but the TND tensor holds T=12 tokens|at entry 0"),
    "tensor_not_host_list": (_with_a_tensor, TypeError, r"'actual_seq_qlen' must be int\[\]\?, not Tensor"),
    "lengths_not_cumulative": (_with_sample_lengths, ValueError, "is not (strictly increasing|non-decreasing)"),
    "sparse_mode_5": (_with_sparse_mode_5, ValueError, "sparse_mode=5 .* is not supported with varlen TND"),
    "sparse_mode_0_ss_mask_of_the_row": (_with_sparse_mode_0_and_a_packed_row_mask, ValueError, r"\[maxSq, maxSkv\]"),
    "causal_mode_without_mask": (_without_the_mask, ValueError, "sparse_mode=3 without atten_mask"),
    "sdpa_polarity_mask": (_with_an_sdpa_polarity_mask, ValueError, "needs the compressed mask"),
    "kvlen_missing": (_without_kvlen, ValueError, "input_layout='TND' needs actual_seq_kvlen"),
    "misspelt_keyword": (_with_misspelt_keyword, TypeError, "unexpected keyword argument 'actual_seq_len'"),
    # Accepted by the op, but not this kernel's attention: the fake computes what torch_npu documents.
    "one_sample_over_the_row": (_with_one_sample, "mismatch", None),
    "sparse_mode_0_no_mask": (_with_sparse_mode_0_and_no_mask, "mismatch", None),
}


@pytest.mark.parametrize(("wrong_call", "caught_by", "message"), WRONG_CALLS.values(), ids=WRONG_CALLS.keys())
def test_the_fake_catches_wrong_varlen_calls(npu, monkeypatch, wrong_call, caught_by, message):
    """Each wrong call is refused with the rule it breaks, or (where torch_npu documents a result) gives attention that
    differs from the per-sample result: a kernel making that call could not pass the equality test."""
    cu_seqlens, hq, hkv, d = CASES["gqa"]
    q, k, v = _packed_qkv(cu_seqlens, hq, hkv, d)
    right = packed_causal_attention(q, k, v, cu_seqlens)  # the documented call (matches per sample: the first test)
    monkeypatch.setattr(packed_mod, "_npu_packed_attention", wrong_call)
    if caught_by == "mismatch":
        assert not torch.allclose(packed_causal_attention(q, k, v, cu_seqlens), right, atol=1e-3)
    else:
        with pytest.raises(caught_by, match=message):
            packed_causal_attention(q, k, v, cu_seqlens)


def test_a_leading_zero_is_refused_where_the_release_documents_no_empty_sample(npu, monkeypatch):
    """cu_seqlens passed as is ([0, 3, 10, 12]): torch_npu 2.6.0 documents sample lengths of 1 or more, so its fake
    refuses the leading 0; 2.13.0 and 2.14.0 document empty samples ("某个Batch上的S长度为0"), so there it is an empty
    first sample and the result is unchanged. Catches a fake stricter or looser than each release's documentation."""
    cu_seqlens, hq, hkv, d = CASES["gqa"]
    q, k, v = _packed_qkv(cu_seqlens, hq, hkv, d)
    right = packed_causal_attention(q, k, v, cu_seqlens)
    monkeypatch.setattr(packed_mod, "_npu_packed_attention", _with_cu_seqlens_as_is)
    if npu.release == "2.6.0":
        with pytest.raises(ValueError, match=r"not strictly increasing .* at entry 0 \(a leading 0 is cu_seqlens' start"):
            packed_causal_attention(q, k, v, cu_seqlens)
    else:
        torch.testing.assert_close(packed_causal_attention(q, k, v, cu_seqlens), right, **FP32_TOL)


def test_the_fake_refuses_more_varlen_samples_than_the_release_takes(npu):
    """torch_npu 2.13.0 / 2.14.0 take at most 1K samples in TND, 2.6.0 2K: one more is refused."""
    import torch_npu

    limit = 2048 if npu.release == "2.6.0" else 1024
    q = torch.randn(limit + 1, 1, 4)
    ends = list(range(1, limit + 2))
    with pytest.raises(ValueError, match=f"holds {limit + 1} samples; torch_npu {npu.release} takes 1..{limit}"):
        torch_npu.npu_fusion_attention(q, q, q, 1, "TND", atten_mask=COMPRESSED_MASK, scale=0.5,
                                       actual_seq_qlen=ends, actual_seq_kvlen=ends, sparse_mode=3)


# ---------------------------------------------------------------- fallbacks and bad input


@pytest.mark.slow
def test_more_than_1k_samples_fall_back_to_the_reference_and_say_so_once(monkeypatch, caplog):
    """Catches the fused call made past the documented 1K-sample varlen limit (2.13.0 / 2.14.0), and a silent or
    repeated fallback."""
    npu = _take_npu_branch(monkeypatch)
    cu_seqlens = list(range(0, 1026))  # 1025 one-token samples
    q, k, v = _packed_qkv(cu_seqlens, 2, 1, 4)
    with caplog.at_level(logging.WARNING, logger="lightning_npu.kernels"):
        out = packed_causal_attention(q, k, v, cu_seqlens)
        packed_causal_attention(q, k, v, cu_seqlens)
    # A one-token sample attends only to itself: its output is its own value row (GQA: kv head 0 for both q heads).
    torch.testing.assert_close(out, v.expand(-1, 2, -1), **FP32_TOL)
    assert npu.calls_to("npu_fusion_attention") == []
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["packed_causal_attention falls back to the PyTorch reference path on NPU: 1025 packed samples"
                        " exceed npu_fusion_attention's varlen limit of 1024"]


def test_other_chips_and_the_attention_switch_take_the_reference_path(monkeypatch, caplog):
    """Catches the TND call on a chip the op is not documented for (910A), and LIGHTNING_NPU_DISABLE_FUSED=attention
    leaving the packed kernel's fused op on (it is the same torch_npu op)."""
    cu_seqlens, hq, hkv, d = CASES["gqa"]
    inputs = _packed_qkv(cu_seqlens, hq, hkv, d)
    fake = _take_npu_branch(monkeypatch, device_name="Ascend910A")
    with caplog.at_level(logging.WARNING, logger="lightning_npu.kernels"):
        _check_matches_samples_alone(packed_causal_attention, *inputs, cu_seqlens)
    assert fake.calls_to("npu_fusion_attention") == []
    assert any(r.getMessage().startswith("packed_causal_attention falls back") and "not Ascend910A" in r.getMessage()
               for r in caplog.records)

    fake = _take_npu_branch(monkeypatch)
    monkeypatch.setenv(_dispatch.DISABLE_FUSED_ENV, "attention")
    _check_matches_samples_alone(packed_causal_attention, *inputs, cu_seqlens)
    assert fake.calls_to("npu_fusion_attention") == []


@pytest.mark.parametrize(
    ("cu_seqlens", "why"),
    [
        ([3, 7, 12], "must start at 0 and end at the token count T=12"),
        ([0, 3, 10], "must start at 0 and end at the token count T=12"),
        ([0, 3, 3, 12], "must rise strictly: sample 1 has length 0. Drop empty samples"),
        ([0, 7, 3, 12], "must rise strictly: sample 1 has length -4"),
        (torch.tensor([0.0, 3.0, 12.0]), "must be a 1-D integer tensor or a list of ints"),
        ([0, 3.5, 12], "must hold ints"),
    ],
    ids=["no_leading_zero", "short_of_T", "empty_sample", "decreasing", "float_tensor", "float_entry"],
)
def test_bad_cu_seqlens_are_refused_with_the_fix(cu_seqlens, why):
    q, k, v = _packed_qkv([0, 12], 2, 2, 4)
    with pytest.raises(ValueError, match=why):
        packed_causal_attention(q, k, v, cu_seqlens)


def test_bad_shapes_are_refused_with_the_fix():
    q, k, v = _packed_qkv([0, 6], 3, 2, 4)
    with pytest.raises(ValueError, match="not a multiple of kv_heads"):
        packed_causal_attention(q, k, v, [0, 6])
    with pytest.raises(ValueError, match=r"expects 3-D TND tensors .* \.flatten\(0, 1\)"):
        packed_causal_attention(q[None], k[None], v[None], [0, 6])
    with pytest.raises(ValueError, match="q holds 6 tokens but k 5"):
        packed_causal_attention(q, k[:5], v[:5], [0, 6])
