"""lightning_npu.quant and the quantized matmul kernel: the int8 / NF4 quantizers' layouts and error bounds, the NF4
table built from its definition, the autograd Function's gradients (input through the decoded weight, none for the
base), and the npu_weight_quant_batchmatmul branch against the strict fake of each recorded torch_npu release."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.nn import functional as F

from lightning_npu.facts import weight_quant as layout
from lightning_npu.kernels import _dispatch, quantized_linear, reference_quantized_linear
from lightning_npu.quant import QuantizedLinear, dequantize, nf4_values, quantize
from tests.npu_fake import RELEASES, install_fake_torch_npu

SCHEMES = ("int8", "nf4")
#: Dettmers et al.'s NF4 values (QLoRA, arXiv 2305.14314, appendix E; bitsandbytes' table), to 7 digits.
PUBLISHED_NF4 = (-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734, -0.0910500, 0.0,
                 0.0795803, 0.1609302, 0.2461123, 0.3379152, 0.4407098, 0.5626170, 0.7229568, 1.0)
#: The largest gap between neighbouring NF4 values (-1 .. -0.6961928): a value is at most half of it from its code.
NF4_HALF_GAP = max(b - a for a, b in zip(PUBLISHED_NF4, PUBLISHED_NF4[1:])) / 2


def _weight(rows=96, columns=128, seed=0):
    """A weight whose rows differ in magnitude by 1000x, as real projections' channels do (outlier channels)."""
    generator = torch.Generator().manual_seed(seed)
    row_scale = torch.logspace(-3, 0, rows).unsqueeze(1)
    return torch.randn(rows, columns, generator=generator) * row_scale


def test_nf4_values_are_the_published_normal_float_table():
    """Catches a table that is not NF4's (a uniform 4-bit grid, symmetric 8/8 halves, no exact zero)."""
    values = nf4_values()
    assert len(values) == 16 and values[0] == -1.0 and values[-1] == 1.0 and 0.0 in values
    assert values == pytest.approx(PUBLISHED_NF4, abs=2e-7)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_codes_and_scales_have_the_documented_layout_and_bytes(scheme):
    """Catches codes in a wider dtype than one byte (int8) or half a byte (nf4) per weight, or scales per tensor."""
    w = _weight()
    codes, scales = quantize(w, scheme)
    assert (tuple(codes.shape), tuple(scales.shape)) == layout.stored_shapes(tuple(w.shape), scheme)
    assert codes.dtype == {"int8": torch.int8, "nf4": torch.uint8}[scheme] and scales.dtype == torch.float32
    stored = codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
    assert stored == layout.sharded_bytes(tuple(w.shape), scheme)
    assert stored / (w.numel() * 2) == pytest.approx({"int8": 0.5 + 2 / 128, "nf4": 0.28125}[scheme])


def _per_tensor_int8(w):
    """A deliberately wrong quantizer: one scale for the whole tensor."""
    scale = w.abs().max() / 127
    return torch.round(w / scale).clamp(-127, 127) * scale


def _per_tensor_nf4(w):
    """A deliberately wrong quantizer: NF4 codes with one absmax for the whole tensor."""
    table = torch.tensor(nf4_values())
    scale = w.abs().max()
    return table[(w / scale).unsqueeze(-1).sub(table).abs().argmin(-1)] * scale


def _within_bound(w, decoded, scheme):
    """Whether every element is within half a code step of its row (int8) or block (nf4) absmax: 1/254 of the
    row's absmax for int8, half NF4's largest gap times the block's absmax for nf4."""
    if scheme == "int8":
        bound = w.abs().amax(dim=1, keepdim=True) / 254
    else:
        blocks = w.reshape(-1, layout.NF4_BLOCK_SIZE)
        bound = (blocks.abs().amax(dim=1, keepdim=True) * NF4_HALF_GAP).expand_as(blocks).reshape(w.shape)
    return bool(((decoded - w).abs() <= bound * (1 + 1e-5) + 1e-12).all())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_round_trip_error_is_within_half_a_code_step_of_each_row_or_block(scheme):
    """Catches a wrong scale granularity: one scale per tensor (the negative control) crushes the small rows to
    zero and fails the same bound; also a wrong rounding (truncation doubles the error)."""
    w = _weight()
    decoded = dequantize(*quantize(w, scheme), scheme)
    assert _within_bound(w, decoded, scheme)
    wrong = {"int8": _per_tensor_int8, "nf4": _per_tensor_nf4}[scheme](w)
    assert not _within_bound(w, wrong, scheme)
    # Each row's (block's) absmax is stored exactly: it decodes to itself.
    blocks = w.reshape(-1, w.shape[1] if scheme == "int8" else layout.NF4_BLOCK_SIZE)
    decoded_blocks = decoded.reshape(blocks.shape)
    largest = blocks.abs().argmax(dim=1, keepdim=True)
    torch.testing.assert_close(decoded_blocks.gather(1, largest), blocks.gather(1, largest), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_zero_rows_decode_to_zeros_and_the_dtype_is_the_callers(scheme):
    w = _weight()
    w[:2] = 0.0
    decoded = dequantize(*quantize(w, scheme), scheme, torch.bfloat16)
    assert decoded.dtype == torch.bfloat16 and torch.equal(decoded[:2], torch.zeros_like(decoded[:2]))


def test_nf4_refuses_a_shape_it_cannot_pack_naming_it_and_the_fix():
    with pytest.raises(ValueError, match=r"cannot quantize .* to nf4: .*\(3, 5\).*use int8"):
        quantize(torch.randn(3, 5), "nf4")
    with pytest.raises(ValueError, match=r"lora.base_quantization='int4' is not a base quantization: use one of int8,"):
        layout.check_scheme("int4", "lora.base_quantization")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_gradient_is_through_the_decoded_weight_and_the_base_gets_none(scheme, dtype):
    """Catches a backward that uses the wrong weight (the un-decoded codes, a transposed one), or one that tries to
    give the codes or scales a gradient."""
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(torch.nn.Linear(128, 96, bias=True), scheme)
    x = torch.randn(2, 5, 128, dtype=dtype, requires_grad=True)
    out = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    weight = layer.dequantized_weight(dtype).detach().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    expected = F.linear(x_ref, weight, layer.bias.to(dtype))
    expected.backward(grad)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    assert all(p.grad is None and not p.requires_grad for p in layer.parameters())


def test_a_meta_layer_is_materialised_by_reset_parameters():
    with torch.device("meta"):
        layer = QuantizedLinear.from_linear(torch.nn.Linear(128, 64), "nf4")
    assert layer.weight_codes.is_meta
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert torch.equal(layer(torch.ones(1, 128)), torch.zeros(1, 64))


# ---------------------------------------------------------------- the NPU branch, against the strict fake


def _take_npu_branch(monkeypatch, release, device_name="Ascend910B2"):
    monkeypatch.setattr(_dispatch, "_announced", set())
    monkeypatch.setattr(_dispatch, "_device_name", {})
    fake = install_fake_torch_npu(monkeypatch, release=release, device_name=device_name)
    monkeypatch.setattr(_dispatch, "_on_npu", lambda x: True)
    return fake


def _int8_inputs(dtype=torch.bfloat16):
    codes, scales = quantize(_weight(96, 128), "int8")
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_(True)
    return x, codes, scales


@pytest.mark.parametrize("release", ["2.13.0", "2.14.0"])
def test_int8_forward_calls_npu_weight_quant_batchmatmul_as_documented(monkeypatch, release):
    """The call passes the strict fake of 2.13 and 2.14 (x (M, K), the (K, N) transposed view of the codes, a
    per-channel scale in x's dtype), matches the decode-then-matmul reference, and still trains: the op has no
    autograd node, so the gradient must come from the Function's backward."""
    fake = _take_npu_branch(monkeypatch, release)
    x, codes, scales = _int8_inputs()
    out = quantized_linear(x, codes, scales, "int8")
    (call,) = fake.calls_to("npu_weight_quant_batchmatmul")
    assert tuple(call["x"].shape) == (6, 128) and tuple(call["weight"].shape) == (128, 96)
    assert call["antiquant_scale"].dtype == torch.bfloat16 and set(call) == {"x", "weight", "antiquant_scale"}
    x_ref = x.detach().clone().requires_grad_(True)
    expected = reference_quantized_linear(x_ref, codes, scales, "int8")
    # The op computes in fp32 and rounds once; the reference rounds the decoded weight and the product to bf16.
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-2 * expected.abs().max().item())
    out.float().sum().backward()
    expected.float().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("release", ["2.13.0", "2.14.0"])
@pytest.mark.parametrize(
    ("wrong_call", "error", "match"),
    [
        (lambda npu, x, c, s: npu.npu_weight_quant_batchmatmul(x, c, s.to(x.dtype)), ValueError,
         r"\(M, K\) and \(K, N\)"),
        (lambda npu, x, c, s: npu.npu_weight_quant_batchmatmul(x, c.t(), s), TypeError, "must have x's dtype"),
        (lambda npu, x, c, s: npu.npu_weight_quant_batchmatmul(x, c.t().float(), s.to(x.dtype)), TypeError, "int8"),
        (lambda npu, x, c, s: npu.npu_weight_quant_batchmatmul(x.float(), c.t(), s), TypeError, "float16/bfloat16"),
        (lambda npu, x, c, s: npu.npu_weight_quant_batchmatmul(x, c.t(), s.to(x.dtype)[:5]), ValueError, "per channel"),
        (lambda npu, x, c, s: npu.npu_weight_quant_batchmatmul(x, c.t(), s.to(x.dtype), scale=s), TypeError, "scale"),
    ],
    ids=["untransposed-weight", "fp32-scale", "float-weight", "fp32-x", "short-scale", "invented-keyword"],
)
def test_the_fake_refuses_wrong_uses_of_npu_weight_quant_batchmatmul(monkeypatch, release, wrong_call, error, match):
    fake = _take_npu_branch(monkeypatch, release)
    codes, scales = quantize(_weight(96, 128), "int8")
    x = torch.randn(6, 128, dtype=torch.bfloat16)
    import torch_npu

    with pytest.raises(error, match=match):
        wrong_call(torch_npu, x, codes, scales)
    assert fake.release == release


@pytest.mark.parametrize(
    ("release", "chip", "scheme", "dtype", "reason"),
    [
        ("2.6.0", "Ascend910B2", "int8", torch.bfloat16, "needs torch_npu >= 2.13"),
        ("2.13.0", "Ascend910A", "int8", torch.bfloat16, "documented for Atlas A2/A3 chips"),
        ("2.13.0", "Ascend910B2", "nf4", torch.bfloat16, "nf4 weights have no torch_npu matmul"),
        ("2.13.0", "Ascend910B2", "int8", torch.float32, "takes fp16/bf16 inputs"),
    ],
    ids=["torch_npu-2.6", "910A", "nf4", "fp32"],
)
def test_other_cases_decode_then_matmul_and_say_why_once(monkeypatch, caplog, release, chip, scheme, dtype, reason):
    """Catches a fused call where the docs rule it out (old release, first-generation chip, NF4, fp32 input) and a
    fallback that is silent or floods the log."""
    fake = _take_npu_branch(monkeypatch, release, device_name=chip)
    codes, scales = quantize(_weight(96, 128), scheme)
    x = torch.randn(2, 128, dtype=dtype)
    with caplog.at_level(logging.WARNING, logger="lightning_npu.kernels"):
        out = quantized_linear(x, codes, scales, scheme)
        quantized_linear(x, codes, scales, scheme)
    assert fake.calls_to("npu_weight_quant_batchmatmul") == []
    torch.testing.assert_close(out, reference_quantized_linear(x, codes, scales, scheme))
    said = [r.getMessage() for r in caplog.records if "quantized_linear" in r.getMessage()]
    assert len(said) == 1 and reason in said[0], said


def test_the_switch_turns_the_fused_int8_matmul_off(monkeypatch):
    fake = _take_npu_branch(monkeypatch, "2.13.0")
    monkeypatch.setenv("LIGHTNING_NPU_DISABLE_FUSED", "weight_quant_matmul")
    quantized_linear(*_int8_inputs(), "int8")
    assert fake.calls_to("npu_weight_quant_batchmatmul") == []


def test_every_recorded_release_has_the_op_without_a_backward():
    """low-precision-facts.md section 2: no release registers an autograd node for npu_weight_quant_batchmatmul,
    which is why the kernel wraps it in its own Function."""
    import json

    from tests.npu_fake.fake import API_DIR

    for release in RELEASES:
        ops = json.loads((API_DIR / f"torch_npu_{release.replace('.', '_')}_api.json").read_text())["ops"]
        assert ops["npu_weight_quant_batchmatmul"]["autograd_node"] is None, release
