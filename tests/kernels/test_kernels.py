"""lightning_npu.kernels: both paths (PyTorch reference, and the torch_npu branch run against the strict fake)
match plain math written here, forward and backward, and the torch_npu calls are made exactly as documented."""

from __future__ import annotations

import ast
import importlib
import logging
import math
from pathlib import Path

import pytest
import torch

import lightning_npu.kernels as kernels
from lightning_npu.kernels import (
    _dispatch,
    apply_rotary,
    causal_attention,
    grouped_matmul,
    packed_causal_attention,
    permute_tokens,
    reference_grouped_matmul,
    rms_norm,
    rotary_tables,
    swiglu,
    unpermute_tokens,
)
from tests.npu_fake import RELEASES, install_fake_torch_npu
from tests.npu_fake.fake import DEFAULT_RELEASE

# The package re-exports functions named like their modules (rms_norm, swiglu), so fetch the modules themselves.
attention_mod = importlib.import_module("lightning_npu.kernels.attention")
rms_norm_mod = importlib.import_module("lightning_npu.kernels.rms_norm")
rotary_mod = importlib.import_module("lightning_npu.kernels.rotary")
swiglu_mod = importlib.import_module("lightning_npu.kernels.swiglu")
packed_attention_mod = importlib.import_module("lightning_npu.kernels.packed_attention")
grouped_matmul_mod = importlib.import_module("lightning_npu.kernels.grouped_matmul")
token_permute_mod = importlib.import_module("lightning_npu.kernels.token_permute")
quantized_matmul_mod = importlib.import_module("lightning_npu.kernels.quantized_matmul")
KERNEL_MODULES = (attention_mod, rms_norm_mod, rotary_mod, swiglu_mod, packed_attention_mod, grouped_matmul_mod,
                  token_permute_mod, quantized_matmul_mod)

# fp32 paths must agree with fp64 plain math to float32 round-off.
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
# bf16 keeps 8 significant bits, so a single rounding of an O(1) value is off by up to 2**-8 (0.4%);
# the kernels round a few intermediates (SDPA's bf16 scores and probabilities, the rotary tables), and
# gradients sum a handful of such terms, which stays within 3% of the fp64 math on these tiny shapes.
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}
TOL = {torch.float32: FP32_TOL, torch.bfloat16: BF16_TOL}


def _take_npu_branch(monkeypatch, release=DEFAULT_RELEASE, **fake_options):
    """Install the fake torch_npu ``release`` and make every kernel treat CPU tensors as NPU tensors."""
    monkeypatch.setattr(_dispatch, "_announced", set())
    monkeypatch.setattr(_dispatch, "_device_name", {})
    monkeypatch.setattr(attention_mod, "_cann", {})
    monkeypatch.setattr(attention_mod, "_announced_value_paths", set())
    fake = install_fake_torch_npu(monkeypatch, release=release, **fake_options)
    monkeypatch.setattr(_dispatch, "_on_npu", lambda x: True)
    return fake


@pytest.fixture(params=["reference", *(f"npu-{release}" for release in RELEASES)])
def path(request, monkeypatch):
    """Run a test on the reference path (None), and on the NPU branch against the fake of each recorded
    torch_npu release (the FakeTorchNPU)."""
    if request.param == "reference":
        return None
    return _take_npu_branch(monkeypatch, release=request.param.removeprefix("npu-"))


@pytest.fixture(params=RELEASES)
def npu(monkeypatch, request):
    return _take_npu_branch(monkeypatch, release=request.param)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _check_forward_backward(kernel_fn, math_fn, inputs, dtype, seed=0):
    """Compare kernel_fn(*inputs) in ``dtype`` with math_fn on the same values in fp64, outputs and gradients."""
    low = _leaves(*(t.to(dtype) for t in inputs))
    high = _leaves(*(t.to(dtype).double() for t in inputs))
    out = kernel_fn(*low)
    expected = math_fn(*high)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (out.double() * grad_out).sum().backward()
    (expected * grad_out).sum().backward()
    for got, want in zip(low, high):
        assert got.grad is not None and got.grad.dtype == dtype
        torch.testing.assert_close(got.grad.double(), want.grad, **TOL[dtype])


# ---------------------------------------------------------------- attention


def attention_math(q, k, v, scale):
    """softmax(Q K^T * scale + M) V per head, BSND; M = -inf where key j > query i + (Skv - Sq); GQA by h // group."""
    sq, skv, hq, hkv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    kv_head = torch.arange(hq) // (hq // hkv)
    k, v = k[:, :, kv_head], v[:, :, kv_head]
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    i = torch.arange(sq)[:, None]
    j = torch.arange(skv)[None, :]
    additive = torch.zeros(sq, skv, dtype=q.dtype).masked_fill(j > i + (skv - sq), float("-inf"))
    probs = torch.softmax(scores + additive, dim=-1)
    return torch.einsum("bhij,bjhd->bihd", probs, v)


ATTENTION_CASES = {
    "mha": (2, 5, 5, 2, 2, 8),  # batch, q_len, kv_len, q_heads, kv_heads, head_dim
    "gqa": (1, 6, 6, 4, 2, 8),
    "decode": (2, 2, 7, 4, 1, 8),  # KV cache: the 2 new tokens attend to all 5 cached ones
    "one_token": (1, 1, 4, 2, 2, 8),
}


def _qkv(b, sq, skv, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, sq, hq, d, generator=g), torch.randn(b, skv, hkv, d, generator=g), torch.randn(b, skv, hkv, d, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_causal_attention_matches_plain_math(path, case, dtype):
    b, sq, skv, hq, hkv, d = ATTENTION_CASES[case]
    scale = 1 / math.sqrt(d)
    _check_forward_backward(causal_attention, lambda q, k, v: attention_math(q, k, v, scale), _qkv(b, sq, skv, hq, hkv, d), dtype)
    if path is not None:
        (call,) = path.calls_to("npu_fusion_attention")
        assert call["head_num"] == hq and call["input_layout"] == "BSND" and call["sparse_mode"] == 3
        assert call["scale"] == pytest.approx(scale)  # always explicit: the op's default is 1.0
        assert torch.equal(call["atten_mask"], torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1))


def test_causal_attention_passes_an_explicit_scale_through(path):
    q, k, v = _qkv(1, 3, 3, 2, 2, 4)
    out = causal_attention(q, k, v, scale=0.7)
    torch.testing.assert_close(out.double(), attention_math(q.double(), k.double(), v.double(), 0.7), **FP32_TOL)


def test_npu_branch_reuses_one_compressed_mask_per_device(npu):
    q, k, v = _qkv(1, 3, 3, 2, 2, 4)
    causal_attention(q, k, v)
    causal_attention(q, k, v)
    first, second = npu.calls_to("npu_fusion_attention")
    assert first["atten_mask"] is second["atten_mask"]


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ((1, 3, 3, 3, 2, 4), "not a multiple of kv_heads"),
        ((1, 4, 3, 2, 2, 4), "exceeds kv_len"),
    ],
)
def test_causal_attention_rejects_bad_shapes_with_the_fix(bad, why):
    with pytest.raises(ValueError, match=why):
        causal_attention(*_qkv(*bad))


# ---------------------------------------------------------------- attention with v heads smaller than q/k's (MLA)

MLA_DK, MLA_DV = 24, 16


def _mla_qkv(b=2, sq=5, skv=5, hq=4, hkv=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, hq, MLA_DK, generator=g), torch.randn(b, skv, hkv, MLA_DK, generator=g),
            torch.randn(b, skv, hkv, MLA_DV, generator=g))


def naive_attention(q, k, v, scale):
    """softmax(Q K^T * scale + causal mask) V, one head at a time in loops of plain matmuls: no SDPA, no einsum."""
    b, sq, hq, _ = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    keep = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + (skv - sq)
    heads = []
    for h in range(hq):
        kv = h // (hq // hkv)
        scores = (q[:, :, h] @ k[:, :, kv].transpose(-1, -2)) * scale
        heads.append(torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v[:, :, kv])
    return torch.stack(heads, dim=2)


def install_cann(monkeypatch, tmp_path, version):
    """A CANN toolkit home of ``version`` on disk, as the installer lays it out (None: a home whose version cannot be
    read), named by ASCEND_HOME_PATH: where the kernels read the installed CANN from."""
    home = tmp_path / "cann"
    (home / "x86_64-linux").mkdir(parents=True)
    if version is not None:
        (home / "x86_64-linux" / "ascend_toolkit_install.info").write_text(f"package_name=Ascend-cann-toolkit\nversion={version}\n")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(home))
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    monkeypatch.setattr("lightning_npu.doctor.cann.DEFAULT_CANN_HOMES", ())


def test_the_reference_path_with_smaller_value_heads_equals_naive_softmax_attention_forward_and_backward():
    """Dk=24, Dv=16, GQA, a KV cache (q_len < kv_len) and an explicit scale: causal_attention on CPU tensors gives
    naive softmax(Q K^T scale) V and its q/k/v gradients within 1e-6 in fp32, the output with v's head dim."""
    for sq in (5, 2):
        inputs = _mla_qkv(sq=sq)
        mine, naive = _leaves(*inputs), _leaves(*inputs)
        out = causal_attention(*mine, scale=0.3)
        expected = naive_attention(*naive, 0.3)
        assert out.shape == (2, sq, 4, MLA_DV)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
        grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(sq))
        (out * grad_out).sum().backward()
        (expected * grad_out).sum().backward()
        for got, want in zip(mine, naive):
            torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("cann", "padded"),
    [("8.1.RC1", True), ("8.0.0", True), (None, True), ("8.2.RC1", False), ("9.0.0-beta.1", False)],
    ids=["8.1.RC1-pads", "8.0.0-pads", "unreadable-pads", "8.2.RC1-unpadded", "9.0-unpadded"],
)
@pytest.mark.parametrize("release", RELEASES)
def test_smaller_value_heads_run_npu_fusion_attention_padded_only_where_the_cann_needs_it(
        monkeypatch, tmp_path, caplog, release, cann, padded):
    """BSND (causal_attention) and TND (packed_causal_attention) with Dk=24 > Dv=16 on the NPU branch: the fake, on a
    CANN before 8.2.RC1, refuses Dv < Dk, so v must reach it zero-padded to 24 (and the output come back sliced); on
    8.2.RC1 and later v goes unpadded. Either way outputs and gradients equal naive attention, the scale is passed,
    and which path ran is logged once."""
    install_cann(monkeypatch, tmp_path, cann)
    fake = _take_npu_branch(monkeypatch, release=release, cann_version=cann or "8.0.RC1")
    q, k, v = _mla_qkv()
    with caplog.at_level(logging.INFO, logger="lightning_npu.kernels"):
        _check_forward_backward(lambda q, k, v: causal_attention(q, k, v, scale=0.3),
                                lambda q, k, v: naive_attention(q, k, v, 0.3), (q, k, v), torch.float32)
        packed = packed_causal_attention(q[0], k[0], v[0], [0, 2, 5], scale=0.3)
    torch.testing.assert_close(packed[2:], naive_attention(q[:1, 2:], k[:1, 2:], v[:1, 2:], 0.3)[0], **FP32_TOL)
    calls = fake.calls_to("npu_fusion_attention")
    assert [call["input_layout"] for call in calls] == ["BSND", "TND"]
    for call in calls:
        assert call["value"].shape[-1] == (MLA_DK if padded else MLA_DV) and call["scale"] == 0.3
        if padded:
            assert torch.equal(call["value"][..., MLA_DV:], torch.zeros_like(call["value"][..., MLA_DV:]))
    messages = [r.getMessage() for r in caplog.records if "head dim 16 < q/k's 24" in r.getMessage()]
    assert len(messages) == 1, messages
    assert ("zero-padded to 24" in messages[0]) == padded and ("unpadded on CANN" in messages[0]) == (not padded)
    assert (f"CANN {cann}" if cann else "could not be read") in messages[0]


def test_the_fake_refuses_unpadded_smaller_value_heads_before_cann_8_2(monkeypatch, tmp_path):
    """Catches a kernel that forgets to pad on an older CANN: the fake rejects Dv < Dk there, as the op may."""
    install_cann(monkeypatch, tmp_path, "8.1.RC1")
    _take_npu_branch(monkeypatch, cann_version="8.1.RC1")
    monkeypatch.setattr(attention_mod, "value_padding", lambda head_dim, v_head_dim: 0)
    with pytest.raises(ValueError, match=r"value head dim 16 < query/key head dim 24: this fake's CANN 8.1.RC1"):
        causal_attention(*_mla_qkv())


def test_value_heads_larger_than_the_query_key_heads_are_refused_with_the_fix():
    q, k, _ = _mla_qkv()
    v = torch.randn(*k.shape[:3], MLA_DK + 8)
    with pytest.raises(ValueError, match=r"v's head_dim=32 exceeds q/k's head_dim=24: npu_fusion_attention takes"
                                         r" Dq == Dk >= Dv only .* zero-pad q and k to v's head dim"):
        causal_attention(q, k, v)
    with pytest.raises(ValueError, match=r"v's head_dim=32 exceeds q/k's head_dim=24"):
        packed_causal_attention(q[0], k[0], v[0], [0, 5])


def _decode_inputs():
    return _qkv(*ATTENTION_CASES["decode"])


def _mask():
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def _call_without_scale(q, k, v, scale):
    import torch_npu

    return torch_npu.npu_fusion_attention(q, k, v, head_num=q.shape[2], input_layout="BSND", atten_mask=_mask(), sparse_mode=3)[0]


def _call_left_up_causal(q, k, v, scale):
    import torch_npu

    return torch_npu.npu_fusion_attention(
        q, k, v, head_num=q.shape[2], input_layout="BSND", atten_mask=_mask(), scale=scale, sparse_mode=2)[0]


def _call_without_mask(q, k, v, scale):
    import torch_npu

    return torch_npu.npu_fusion_attention(q, k, v, head_num=q.shape[2], input_layout="BSND", scale=scale, sparse_mode=3)[0]


def _call_with_sdpa_polarity(q, k, v, scale):
    import torch_npu

    keep = torch.tril(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool), diagonal=k.shape[1] - q.shape[1])
    return torch_npu.npu_fusion_attention(
        q, k, v, head_num=q.shape[2], input_layout="BSND", atten_mask=keep, scale=scale, inner_precise=2)[0]


def _call_with_bnsd_layout(q, k, v, scale):
    import torch_npu

    return torch_npu.npu_fusion_attention(
        q, k, v, head_num=q.shape[2], input_layout="BNSD", atten_mask=_mask(), scale=scale, sparse_mode=3)[0]


def _call_with_misspelt_keyword(q, k, v, scale):
    import torch_npu

    return torch_npu.npu_fusion_attention(
        q, k, v, head_num=q.shape[2], input_layout="BSND", atten_mask=_mask(), scale_value=scale, sparse_mode=3)[0]


@pytest.mark.parametrize(
    ("wrong_call", "caught_by"),
    [
        (_call_without_scale, "mismatch"),
        (_call_left_up_causal, "mismatch"),
        (_call_without_mask, "mismatch"),
        (_call_with_sdpa_polarity, "mismatch"),
        (_call_with_bnsd_layout, ValueError),
        (_call_with_misspelt_keyword, TypeError),
    ],
    ids=["scale_omitted", "left_up_causal", "mask_omitted", "mask_polarity_inverted", "bnsd_layout", "misspelt_keyword"],
)
def test_the_fake_catches_wrong_fusion_attention_calls(npu, monkeypatch, wrong_call, caught_by):
    q, k, v = _decode_inputs()
    expected = attention_math(q.double(), k.double(), v.double(), 1 / math.sqrt(q.shape[-1]))
    torch.testing.assert_close(causal_attention(q, k, v).double(), expected, **FP32_TOL)  # the real call matches

    monkeypatch.setattr(attention_mod, "_npu_attention", wrong_call)
    if caught_by == "mismatch":
        assert not torch.allclose(causal_attention(q, k, v).double(), expected, atol=1e-3)
    else:
        with pytest.raises(caught_by):
            causal_attention(q, k, v)


def test_unsupported_inputs_fall_back_to_the_reference_and_say_so_once(npu, caplog):
    q, k, v = _qkv(1, 2, 2, 1, 1, 776)  # head_dim above npu_fusion_attention's 768
    with caplog.at_level(logging.WARNING, logger="lightning_npu.kernels"):
        out = causal_attention(q, k, v)
        causal_attention(q, k, v)
        rms_norm(torch.randn(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(out.double(), attention_math(q.double(), k.double(), v.double(), 1 / math.sqrt(776)), **FP32_TOL)
    assert npu.calls_to("npu_fusion_attention") == [] and npu.calls_to("npu_rms_norm") == []
    messages = [r.getMessage() for r in caplog.records]
    assert sum("head_dim=776" in m for m in messages) == 1
    assert sum("rms_norm" in m and "float64" in m for m in messages) == 1


@pytest.mark.parametrize(
    ("chip", "bf16"),
    [("Ascend910A", None), ("Ascend910B", None), ("Ascend310P3", None), ("Ascend950", True), ("Ascend910B9", True)],
    ids=["910A", "910B-first-generation", "310P3-inference", "950-newer", "unknown-910B-lookalike"],
)
def test_a2_only_fused_ops_are_not_called_on_other_chips(monkeypatch, caplog, chip, bf16):
    """Catches gating by name prefix: "Ascend910B" (SocVersion 104) and chips torch_npu added after A2/A3
    must not get npu_fusion_attention / npu_rotary_mul / npu_swiglu, which are documented for A2/A3 only."""
    fake = _take_npu_branch(monkeypatch, device_name=chip, bf16_supported=bf16)
    q, k, v = _qkv(1, 3, 3, 2, 2, 4)
    x = torch.randn(1, 3, 2, 4)
    cos, sin = rotary_tables(3, 4)
    with caplog.at_level(logging.WARNING, logger="lightning_npu.kernels"):
        torch.testing.assert_close(
            causal_attention(q, k, v).double(), attention_math(q.double(), k.double(), v.double(), 0.5), **FP32_TOL)
        torch.testing.assert_close(apply_rotary(x, cos, sin), rotary_math(x, cos, sin).float())
        torch.testing.assert_close(swiglu(x), swiglu_math(x))
        rms_norm(x, torch.ones(4))  # npu_rms_norm has no chip restriction
    called = {name for name, _ in fake.calls}
    assert called == {"npu.get_device_name", "npu_rms_norm"}
    assert len(fake.calls_to("npu.get_device_name")) == 1  # read once, not per call
    warned = " ".join(r.getMessage() for r in caplog.records)
    for op in ("npu_fusion_attention", "npu_rotary_mul", "npu_swiglu"):
        assert f"{op} is documented for Atlas A2/A3 chips (Ascend910B1..B4, Ascend910_93xx) only, not {chip}" in warned


@pytest.mark.parametrize("chip", ["Ascend910B1", "Ascend910B2C", "Ascend910B4-1", "Ascend910_9362", "Ascend910_9391"])
def test_a2_and_a3_chips_run_every_fused_op(monkeypatch, chip):
    """Catches an exact-name table that misses an A2/A3 variant (they would silently run the slow path)."""
    fake = _take_npu_branch(monkeypatch, device_name=chip)
    q, k, v = _qkv(1, 3, 3, 2, 2, 4)
    x = torch.randn(1, 3, 2, 4)
    cos, sin = rotary_tables(3, 4)
    causal_attention(q, k, v)
    apply_rotary(x, cos, sin)
    swiglu(x)
    for op in ("npu_fusion_attention", "npu_rotary_mul", "npu_swiglu"):
        assert len(fake.calls_to(op)) == 1, op


# ---------------------------------------------------------------- rms_norm


def rms_norm_math(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_matches_plain_math(path, dtype):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 3, 16, generator=g), torch.randn(16, generator=g)
    _check_forward_backward(lambda x, w: rms_norm(x, w, eps=1e-5), lambda x, w: rms_norm_math(x, w, 1e-5), (x, w), dtype)
    if path is not None:
        (call,) = path.calls_to("npu_rms_norm")
        assert set(call) == {"input", "gamma", "epsilon"} and call["epsilon"] == 1e-5


def test_rms_norm_keeps_x_dtype_with_fp32_weight(path):
    """Catches npu_rms_norm called with (bf16 x, fp32 gamma), which the wheel's docs rule out, and checks that
    the fp32 master weight still gets an fp32 gradient equal to the math's up to bf16 rounding."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 8, generator=g).to(torch.bfloat16).requires_grad_(True)
    weight = (1 + 0.1 * torch.randn(8, generator=g)).requires_grad_(True)
    out = rms_norm(x, weight)
    assert out.dtype == torch.bfloat16
    x64, w64 = x.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    expected = rms_norm_math(x64, w64, 1e-6)
    torch.testing.assert_close(out.double(), expected, **BF16_TOL)
    grad_out = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    (out.double() * grad_out).sum().backward()
    (expected * grad_out).sum().backward()
    assert weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(weight.grad.double(), w64.grad, **BF16_TOL)
    torch.testing.assert_close(x.grad.double(), x64.grad, **BF16_TOL)
    if path is not None:
        (call,) = path.calls_to("npu_rms_norm")
        assert call["input"].dtype == call["gamma"].dtype == torch.bfloat16


def test_rms_norm_rejects_a_weight_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"must be \(8,\)"):
        rms_norm(torch.randn(2, 8), torch.ones(4))


# ---------------------------------------------------------------- rotary


def test_rotary_tables_hold_cos_and_sin_of_position_times_frequency():
    cos, sin = rotary_tables(5, 8, theta=100.0, start=3)
    assert cos.shape == sin.shape == (5, 8)
    for p in range(5):
        for i in range(8):
            angle = (p + 3) * 100.0 ** (-2 * (i % 4) / 8)
            assert cos[p, i].item() == pytest.approx(math.cos(angle), abs=1e-6)
            assert sin[p, i].item() == pytest.approx(math.sin(angle), abs=1e-6)
    bf16_cos, _ = rotary_tables(5, 8, theta=100.0, start=3, dtype=torch.bfloat16)
    assert bf16_cos.dtype == torch.bfloat16 and torch.equal(bf16_cos, cos.to(torch.bfloat16))


def rotary_math(x, cos, sin):
    """Rotate each pair (x[i], x[i + D/2]) by the position's angle."""
    half = x.shape[-1] // 2
    c, s = cos[None, :, None, :half], sin[None, :, None, :half]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_apply_rotary_matches_plain_math(path, dtype):
    cos, sin = rotary_tables(4, 8, start=2)
    x = torch.randn(2, 4, 3, 8, generator=torch.Generator().manual_seed(2))
    c, s = cos.to(dtype).double(), sin.to(dtype).double()
    _check_forward_backward(lambda x: apply_rotary(x, cos, sin), lambda x: rotary_math(x, c, s), (x,), dtype)
    if path is not None:
        (call,) = path.calls_to("npu_rotary_mul")
        assert call["r1"].shape == call["r2"].shape == (1, 4, 1, 8)  # 1S1D for BSND
        assert call["r1"].dtype == dtype and "rotary_mode" not in call


def test_rotary_scores_depend_only_on_relative_position(path):
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)

    def score(q_pos, k_pos):
        qc, qs = rotary_tables(1, 16, start=q_pos)
        kc, ks = rotary_tables(1, 16, start=k_pos)
        return (apply_rotary(q, qc, qs) * apply_rotary(k, kc, ks)).sum().item()

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


def test_rotary_falls_back_when_its_backward_would_exceed_batch_times_heads_1024(npu, caplog):
    """Catches a micro-batch that passes npu_rotary_mul's per-dimension limits (B, N < 1000) but fails in its
    backward (B * N <= 1024 for the cos/sin gradients): 33 x 32 heads must take the reference path when training,
    and may keep the fused kernel when no gradient is needed."""
    cos, sin = rotary_tables(2, 8)
    x = torch.randn(33, 2, 32, 8, generator=torch.Generator().manual_seed(6), requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="lightning_npu.kernels"):
        out = apply_rotary(x, cos, sin)
    out.sum().backward()
    assert npu.calls_to("npu_rotary_mul") == []
    torch.testing.assert_close(out, rotary_math(x.detach(), cos, sin))
    assert any("33 x 32 = 1056 exceeds npu_rotary_mul's backward limit" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        torch.testing.assert_close(apply_rotary(x, cos, sin), out.detach())
    assert len(npu.calls_to("npu_rotary_mul")) == 1
    small = x[:32].detach().requires_grad_(True)  # 32 x 32 = 1024: within the limit, fused forward and backward
    apply_rotary(small, cos, sin).sum().backward()
    assert len(npu.calls_to("npu_rotary_mul")) == 2 and small.grad is not None


def test_apply_rotary_rejects_tables_for_another_length():
    cos, sin = rotary_tables(5, 8)
    with pytest.raises(ValueError, match="rotary_tables\\(seq_len=4"):
        apply_rotary(torch.randn(1, 4, 2, 8), cos, sin)


# ---------------------------------------------------------------- swiglu


def swiglu_math(x):
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return a * torch.sigmoid(a) * b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_matches_plain_math(path, dtype):
    x = torch.randn(2, 3, 12, generator=torch.Generator().manual_seed(4))
    _check_forward_backward(swiglu, swiglu_math, (x,), dtype)
    if path is not None:
        (call,) = path.calls_to("npu_swiglu")
        assert call["dim"] == -1


def test_swiglu_rejects_an_odd_last_dimension():
    with pytest.raises(ValueError, match="odd size 5"):
        swiglu(torch.randn(2, 5))


# ---------------------------------------------------------------- fallback switch


def test_disabled_kernels_run_their_reference_path_and_say_why_once(npu, monkeypatch, caplog):
    """Catches a LIGHTNING_NPU_DISABLE_FUSED that is ignored (the fused op still runs), that turns off more than it
    names, or whose fallback is silent or logged on every call."""
    monkeypatch.setenv(_dispatch.DISABLE_FUSED_ENV, "rms_norm, rotary")
    x = torch.randn(1, 3, 2, 4, generator=torch.Generator().manual_seed(7))
    cos, sin = rotary_tables(3, 4)
    with caplog.at_level(logging.WARNING, logger="lightning_npu.kernels"):
        for _ in range(2):
            torch.testing.assert_close(rms_norm(x, torch.ones(4)).double(), rms_norm_math(x.double(), 1.0, 1e-6))
            torch.testing.assert_close(apply_rotary(x, cos, sin), rotary_math(x, cos, sin).float())
            swiglu(x)
    assert npu.calls_to("npu_rms_norm") == [] and npu.calls_to("npu_rotary_mul") == []
    assert len(npu.calls_to("npu_swiglu")) == 2
    messages = [r.getMessage() for r in caplog.records]
    for function in ("rms_norm", "apply_rotary"):
        said = [m for m in messages if m.startswith(f"{function} falls back")]
        assert said == [f"{function} falls back to the PyTorch reference path on NPU: turned off by"
                        " LIGHTNING_NPU_DISABLE_FUSED=rms_norm, rotary"]


def test_disable_all_turns_off_every_fused_kernel(npu, monkeypatch):
    monkeypatch.setenv(_dispatch.DISABLE_FUSED_ENV, "all")
    q, k, v = _qkv(1, 3, 3, 2, 2, 4)
    x = torch.randn(1, 3, 2, 4)
    causal_attention(q, k, v), rms_norm(x, torch.ones(4)), apply_rotary(x, *rotary_tables(3, 4)), swiglu(x)
    assert {name for name, _ in npu.calls} <= {"npu.get_device_name"}


def test_an_unknown_name_in_the_disable_switch_is_an_error_naming_the_valid_ones(monkeypatch):
    """Catches a misspelt kernel name (rmsnorm) silently disabling nothing: the user would believe the failing
    kernel is off. Raised on CPU tensors too, so the mistake shows before any NPU run."""
    monkeypatch.setenv(_dispatch.DISABLE_FUSED_ENV, "rmsnorm")
    with pytest.raises(ValueError, match=r"names 'rmsnorm', which is not a fused kernel; use comma-separated names"
                                         r" from attention, rms_norm, rotary, swiglu"):
        rms_norm(torch.randn(2, 4), torch.ones(4))


# ---------------------------------------------------------------- MoE: grouped matmul, token permute / unpermute

# torch_npu releases whose MoE ops train (npu_grouped_matmul's dW form, the permute pair's backward).
MOE_RELEASES = [r for r in RELEASES if r != "2.6.0"]


@pytest.fixture(params=MOE_RELEASES)
def moe_npu(monkeypatch, request):
    return _take_npu_branch(monkeypatch, release=request.param)


def grouped_matmul_math(x, w, counts):
    """Row block e of x (counts[e] rows, in order) times w[e]."""
    blocks = x.split(list(counts))
    return torch.cat([rows @ w[e] for e, rows in enumerate(blocks)])


# (counts per expert, K, N): an expert with no tokens (first, middle, last), one expert (count mode refuses a
# one-entry list), K and N whose rows are not 16-byte aligned (torch._grouped_mm's CPU limit: the per-expert loop),
# no tokens at all.
GMM_CASES = {
    "empty-expert": ((3, 0, 4, 1), 8, 8),
    "empty-first-and-last": ((0, 5, 2, 0), 8, 4),
    "one-expert": ((6,), 8, 8),
    "unaligned": ((2, 0, 3), 5, 3),
    "no-tokens": ((0, 0, 0), 8, 8),  # a rank that receives none still runs its experts (expert parallelism)
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(GMM_CASES))
def test_grouped_matmul_gives_every_expert_the_reference_gradient(path, case, dtype):
    """Catches a fused path that calls npu_grouped_matmul without the autograd wrapper (it has no backward in any
    release: the output carries no grad_fn and the experts get no gradient), wrong dX / dW calls, and an expert
    without tokens getting anything but a zero gradient, on each path (reference, and the fakes of every release)."""
    counts, k, n = GMM_CASES[case]
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(sum(counts), k, generator=g), torch.randn(len(counts), k, n, generator=g)
    ids = torch.tensor(counts)
    _check_forward_backward(lambda a, b: grouped_matmul(a, b, ids), lambda a, b: grouped_matmul_math(a, b, counts),
                            (x, w), dtype)
    low = _leaves(x.to(dtype), w.to(dtype))
    out = grouped_matmul(*low, ids)
    assert out.grad_fn is not None
    out.sum().backward()  # an expanded gradient (torch._grouped_mm's own backward rejects one)
    for e, count in enumerate(counts):
        assert (low[1].grad[e].abs().sum() == 0) == (count == 0), e
    if path is None or path.release == "2.6.0":
        return
    calls = path.calls_to("npu_grouped_matmul")
    assert [(c["group_type"], c["split_item"]) for c in calls[:3]] == [(0, 2), (0, 2), (2, 3)]  # forward, dX, dW
    for call in calls:
        assert call["group_list"].dtype == torch.int64 and call["group_list"].tolist() == list(counts)
        assert call["group_list_type"] == (1 if len(counts) > 1 else 0) and "output_dtype" not in call


def test_grouped_matmul_takes_a_transposed_view_of_x(moe_npu):
    """npu_grouped_matmul refuses a non-contiguous x with group_type=0 (only the weight may be a view)."""
    x = torch.randn(8, 5).t()
    w = torch.randn(2, 8, 3).transpose(1, 2).transpose(1, 2)
    torch.testing.assert_close(grouped_matmul(x, w, torch.tensor([4, 1])), grouped_matmul_math(x, w, [4, 1]))
    assert len(moe_npu.calls_to("npu_grouped_matmul")) == 1


def test_grouped_matmul_falls_back_on_torch_npu_2_6_and_says_so_once(monkeypatch, caplog):
    """2.6.0 rejects the dW call's group_type=2: the fused path would fail in backward, so it must not be taken."""
    fake = _take_npu_branch(monkeypatch, release="2.6.0")
    x, w, counts = torch.randn(5, 8), torch.randn(2, 8, 8), torch.tensor([2, 3])
    with caplog.at_level(logging.WARNING, logger="lightning_npu.kernels"):
        for _ in range(2):
            torch.testing.assert_close(grouped_matmul(x, w, counts), grouped_matmul_math(x, w, [2, 3]))
    assert fake.calls_to("npu_grouped_matmul") == []
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("grouped_matmul falls back")]
    assert said == ["grouped_matmul falls back to the PyTorch reference path on NPU: npu_grouped_matmul needs"
                    " torch_npu >= 2.13 (older releases reject the weight gradient's group_type=2); this is torch_npu 2.6.0"]


def test_grouped_matmul_rejects_counts_that_do_not_cover_the_rows():
    with pytest.raises(ValueError, match=r"counts \[2, 2\] must be >= 0 and sum to the 5 rows"):
        reference_grouped_matmul(torch.randn(5, 4), torch.randn(2, 4, 3), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="one entry per expert"):
        grouped_matmul(torch.randn(5, 4), torch.randn(2, 4, 3), torch.tensor([5]))


def _routing(tokens=6, hidden=8, experts=4, top_k=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices  # int64, as from a router
    probs = torch.rand(tokens, top_k, generator=g).softmax(-1).to(dtype)
    return x, ids, probs


def _dispatch_combine(x, ids, probs, experts):
    """permute -> a per-row expert function (row * (expert + 1), so a row sent to the wrong expert shows) -> unpermute."""
    permuted, counts, permutation = permute_tokens(x, ids, probs, experts)
    scale = torch.repeat_interleave(torch.arange(1, experts + 1, dtype=x.dtype), counts)[:, None]
    return unpermute_tokens(permuted * scale, permutation), counts, permutation


def dispatch_combine_math(x, ids, probs):
    return (x[:, None, :] * probs[..., None] * (ids[..., None] + 1).to(x.dtype)).sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_permute_unpermute_round_trip_and_gradients_match_on_both_paths(path, dtype):
    """Catches a wrong index convention (CANN's sorted_indices is the inverse of the reference argsort: mixing
    them sends rows to the wrong tokens), rows not sorted by expert, wrong counts, and wrong gradients."""
    x, ids, probs = _routing(dtype=dtype)
    _check_forward_backward(lambda a, p: _dispatch_combine(a, ids, p, 4)[0], lambda a, p: dispatch_combine_math(a, ids, p),
                            (x, probs), dtype)
    _, counts, permutation = _dispatch_combine(x, ids, probs, 4)
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=4).tolist()
    fused = path is not None and path.release != "2.6.0"
    assert permutation.fused == fused
    assert len(path.calls_to("npu_moe_token_unpermute") if path else []) == (2 if fused else 0)


def test_a_batch_without_tokens_routes_nothing_on_both_paths(path):
    """A rank that receives no tokens (expert parallelism) still runs the pair, and must get empty results."""
    x, ids, probs = _routing(tokens=0)
    out, counts, _ = _dispatch_combine(x.requires_grad_(True), ids, probs, 4)
    out.sum().backward()
    assert out.shape == (0, 8) and counts.tolist() == [0, 0, 0, 0] and x.grad.shape == (0, 8)


def test_fused_and_reference_permutations_agree_row_for_row(moe_npu):
    x, ids, probs = _routing()
    fused_rows, _, fused = permute_tokens(x, ids, probs, 4)
    reference_rows, reference_index = token_permute_mod.reference_permute_tokens(x, ids)
    assert fused.fused and torch.equal(fused_rows, reference_rows)
    assert torch.equal(fused.sorted_indices.long(), reference_index)


def test_an_unpermute_follows_its_permutes_path_whatever_the_switch_says_meanwhile(moe_npu, monkeypatch):
    """The pair is decided once: turning the switch on (or off) between the two calls must not pair a fused half
    with a reference half."""
    x, ids, probs = _routing()
    permuted, _, fused = permute_tokens(x, ids, probs, 4)
    monkeypatch.setenv(_dispatch.DISABLE_FUSED_ENV, "token_permute")
    torch.testing.assert_close(unpermute_tokens(permuted, fused), x)  # probs sum to 1 per token
    assert len(moe_npu.calls_to("npu_moe_token_unpermute")) == 1
    permuted, _, reference = permute_tokens(x, ids, probs, 4)
    monkeypatch.delenv(_dispatch.DISABLE_FUSED_ENV)
    torch.testing.assert_close(unpermute_tokens(permuted, reference), x)
    assert not reference.fused and len(moe_npu.calls_to("npu_moe_token_unpermute")) == 1


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"probs_dtype": torch.float32}, "probs are torch.float32 but tokens torch.bfloat16"),
        ({"top_k": 513}, "top_k=513 exceeds npu_moe_token_permute's limit of 512"),
        ({"release": "2.6.0"}, "npu_moe_token_permute needs torch_npu >= 2.13"),
        ({"chip": "Ascend910A"}, "npu_moe_token_permute is documented for Atlas A2/A3 chips"),
        ({"switch": "token_permute"}, "turned off by LIGHTNING_NPU_DISABLE_FUSED=token_permute"),
    ],
    ids=["fp32-probs-bf16-tokens", "top-k-513", "torch_npu-2.6", "910A", "switch"],
)
def test_the_permute_pair_falls_back_together_and_says_why_once(monkeypatch, caplog, change, reason):
    chip = change.get("chip", "Ascend910B2")
    fake = _take_npu_branch(monkeypatch, release=change.get("release", "2.13.0"), device_name=chip)
    if "switch" in change:
        monkeypatch.setenv(_dispatch.DISABLE_FUSED_ENV, change["switch"])
    top_k = change.get("top_k", 2)
    x, ids, probs = _routing(experts=max(4, top_k), top_k=top_k, dtype=torch.bfloat16)
    probs = probs.to(change.get("probs_dtype", torch.bfloat16))
    with caplog.at_level(logging.WARNING, logger="lightning_npu.kernels"):
        for _ in range(2):
            out, _, permutation = _dispatch_combine(x, ids, probs, max(4, top_k))
    assert not permutation.fused
    assert fake.calls_to("npu_moe_token_permute") == [] and fake.calls_to("npu_moe_token_unpermute") == []
    torch.testing.assert_close(out.double(), dispatch_combine_math(x.double(), ids, probs.double()), **BF16_TOL)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("permute_tokens falls back")]
    assert len(said) == 1 and reason in said[0], said


def test_the_grouped_matmul_switch_forces_its_reference_path(moe_npu, monkeypatch, caplog):
    monkeypatch.setenv(_dispatch.DISABLE_FUSED_ENV, "grouped_matmul")
    x, w = _leaves(torch.randn(5, 8), torch.randn(2, 8, 8))
    with caplog.at_level(logging.WARNING, logger="lightning_npu.kernels"):
        for _ in range(2):
            grouped_matmul(x, w, torch.tensor([2, 3])).sum().backward()
    assert moe_npu.calls_to("npu_grouped_matmul") == []
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("grouped_matmul falls back")]
    assert said == ["grouped_matmul falls back to the PyTorch reference path on NPU: turned off by"
                    " LIGHTNING_NPU_DISABLE_FUSED=grouped_matmul"]


def test_the_moe_routing_inputs_are_checked_with_the_fix():
    x, ids, probs = _routing()
    with pytest.raises(ValueError, match="id >= num_experts=3"):
        permute_tokens(x, ids, probs, 3)
    with pytest.raises(ValueError, match=r"expert_ids\[:, None\]"):
        permute_tokens(x, ids[:, 0], probs[:, 0], 4)
    permuted, _, permutation = permute_tokens(x, ids, probs, 4)
    with pytest.raises(ValueError, match="one row per permuted token"):
        unpermute_tokens(permuted[:-1], permutation)


# ---------------------------------------------------------------- house rules


def test_kernels_import_torch_npu_only_inside_functions_and_never_spell_cuda():
    for module in (kernels, *KERNEL_MODULES, _dispatch):
        source = Path(module.__file__).read_text()
        assert "cuda" not in source.lower(), module.__name__
        tree = ast.parse(source)
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "torch_npu" for n in names), module.__name__
