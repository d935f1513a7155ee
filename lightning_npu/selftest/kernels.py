"""Kernel checks: each fused op the plugin calls against its PyTorch reference on the same device.

For every case (the recipe's shapes and edge shapes, see ``kernel_cases``) and dtype, the kernel's forward and
backward run on the fused path and on the reference path with fp32 copies of the same inputs; each output and
gradient is compared: ``max_err`` and ``mean_err`` are the largest and the mean absolute difference divided by
the reference's RMS, checked against ``TOLERANCES``. Both paths are timed in the case's dtype (forward + backward,
median of a few runs, the device synchronised through the runtime before and after each). A kernel that would not
run fused here (the simulated runtime's CPU tensors, a chip without the op, a switch that turns it off) is reported
``not available`` with the reason, and only its reference time.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_npu import kernels
from lightning_npu.kernels import blockwise_attention, packed_attention
from lightning_npu.quant import quantize
from lightning_npu.selftest.report import FAIL, NOT_AVAILABLE, PASS, CheckResult

FAMILY = "kernels"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Tolerance:
    """Largest and mean absolute error, relative to the reference's RMS."""

    max_err: float
    mean_err: float


#: A few units of each dtype's rounding (2**-8 for bf16, 2**-11 for fp16): the fused ops compute in fp32 inside and
#: round their results once, so a larger error is a wrong kernel, not rounding. fp32 allows for another summation
#: order over sequences of thousands of keys.
TOLERANCES = {
    torch.float32: Tolerance(max_err=1e-4, mean_err=1e-5),
    torch.bfloat16: Tolerance(max_err=16 * 2**-8, mean_err=2 * 2**-8),
    torch.float16: Tolerance(max_err=16 * 2**-11, mean_err=2 * 2**-11),
}


@dataclass(frozen=True)
class KernelCase:
    """One shape of one kernel. ``make(dtype, device)`` returns the kernel's arguments (tensors that need a gradient
    have requires_grad set); ``fused`` and ``reference`` take them and return the output. ``why_not_fused`` (the
    arguments -> the reason the fused op would not run, or None) defaults to ``kernels.why_not_fused(op, ...)``; a
    second kernel on the same torch_npu op (packed attention) gives its own."""

    op: str
    name: str
    make: Callable[[torch.dtype, torch.device], tuple[Any, ...]]
    fused: Callable[..., Tensor]
    reference: Callable[..., Tensor]
    why_not_fused: Optional[Callable[..., Optional[str]]] = None

    def unavailable(self, *args: Any) -> Optional[str]:
        return (self.why_not_fused or (lambda *a: kernels.why_not_fused(self.op, *a)))(*args)


def _randn(generator: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=generator)


def _head_dims(d: int, dv: Optional[int]) -> str:
    """``d128``, or ``d192/128`` for v heads smaller than q/k's (MLA)."""
    return f"d{d}" if dv is None else f"d{d}/{dv}"


def _attention_case(name: str, b: int, sq: int, skv: int, hq: int, hkv: int, d: int,
                    dv: Optional[int] = None) -> KernelCase:
    """``dv``: v's head dim where it is smaller than q/k's ``d`` (MLA; None: ``d``)."""
    def make(dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(0)
        q, k, v = _randn(g, b, sq, hq, d), _randn(g, b, skv, hkv, d), _randn(g, b, skv, hkv, dv or d)
        return tuple(t.to(device=device, dtype=dtype).requires_grad_(True) for t in (q, k, v))

    return KernelCase("attention", f"{name} b{b} q{sq} kv{skv} h{hq}/{hkv} {_head_dims(d, dv)}", make,
                      kernels.causal_attention, kernels.reference_attention)


def _packed_attention_case(name: str, lengths: Sequence[int], hq: int, hkv: int, d: int,
                           dv: Optional[int] = None) -> KernelCase:
    """Samples of ``lengths`` packed end to end (TND), each attending only to itself: a kernel that lets one sample
    see another's tokens differs from the reference, which runs each alone."""

    def make(dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(5)
        total = sum(lengths)
        q, k, v = _randn(g, total, hq, d), _randn(g, total, hkv, d), _randn(g, total, hkv, dv or d)
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        return (*(t.to(device=device, dtype=dtype).requires_grad_(True) for t in (q, k, v)), bounds)

    label = f"{name} packed {len(lengths)} samples T{sum(lengths)} h{hq}/{hkv} {_head_dims(d, dv)}"
    return KernelCase("attention", label, make, kernels.packed_causal_attention, kernels.reference_packed_attention,
                      packed_attention.why_not_fused)


def _ring_step_case(name: str, b: int, s: int, hq: int, hkv: int, d: int, dv: Optional[int] = None) -> KernelCase:
    """One ring-attention step's kernels (context parallelism): queries over a received block of ``s`` earlier keys
    and their own ``s`` (causal), merged through the blocks' softmax statistics; the reference is causal attention
    over all ``2 s`` keys (bottom-right aligned)."""

    def make(dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(6)
        q, k_before, v_before, k, v = (_randn(g, b, s, heads, dim) for heads, dim in
                                       ((hq, d), (hkv, d), (hkv, dv or d), (hkv, d), (hkv, dv or d)))
        return tuple(t.to(device=device, dtype=dtype).requires_grad_(True) for t in (q, k_before, v_before, k, v))

    def reference(q: Tensor, k_before: Tensor, v_before: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return kernels.reference_attention(q, torch.cat((k_before, k), 1), torch.cat((v_before, v), 1))

    return KernelCase("attention", f"{name} ring step b{b} q{s} kv{2 * s} h{hq}/{hkv} {_head_dims(d, dv)}", make,
                      blockwise_attention.ring_step_attention, reference,
                      lambda q, k_before, v_before, k, v: blockwise_attention.why_not_fused_ring(q, k, v))


def _rms_norm_case(name: str, b: int, s: int, dim: int) -> KernelCase:
    def make(dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(1)
        x = _randn(g, b, s, dim).to(device=device, dtype=dtype).requires_grad_(True)
        # An fp32 master weight, as under mixed precision (the kernel casts it to x's dtype for npu_rms_norm).
        weight = (1 + 0.1 * _randn(g, dim)).to(device).requires_grad_(True)
        return x, weight

    return KernelCase("rms_norm", f"{name} b{b} s{s} dim{dim}", make, kernels.rms_norm, kernels.reference_rms_norm)


def _rotary_case(name: str, b: int, s: int, h: int, d: int, start: int = 0) -> KernelCase:
    def make(dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(2)
        x = _randn(g, b, s, h, d).to(device=device, dtype=dtype).requires_grad_(True)
        cos, sin = kernels.rotary_tables(s, d, start=start, device=device)
        return x, cos, sin

    label = f"{name} b{b} s{s} h{h} d{d}" + (f" from position {start}" if start else "")
    return KernelCase("rotary", label, make, kernels.apply_rotary, kernels.reference_rotary)


def _swiglu_case(name: str, b: int, s: int, ffn: int) -> KernelCase:
    def make(dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(3)
        return (_randn(g, b, s, 2 * ffn).to(device=device, dtype=dtype).requires_grad_(True),)

    return KernelCase("swiglu", f"{name} b{b} s{s} ffn{ffn}", make, kernels.swiglu, kernels.reference_swiglu)


def _quantized_matmul_case(name: str, tokens: int, k: int, n: int) -> KernelCase:
    """A LoRA base projection stored int8 (``lightning_npu.quant``): the input's gradient is checked too."""
    def make(dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(7)
        codes, scales = quantize(_randn(g, n, k) / k**0.5, "int8")
        x = _randn(g, tokens, k).to(device=device, dtype=dtype).requires_grad_(True)
        return x, codes.to(device), scales.to(device), "int8"

    return KernelCase("weight_quant_matmul", f"{name} M{tokens} K{k} N{n} int8", make, kernels.quantized_linear,
                      kernels.reference_quantized_linear)


def _expert_counts(generator: torch.Generator, tokens: int, experts: int) -> list[int]:
    """Tokens per expert for ``tokens`` routed rows: random, with expert 1 receiving none (its weight gradient must
    be zero, which some grouped-matmul backends have got wrong)."""
    ids = torch.randint(0, experts, (tokens,), generator=generator)
    ids[ids == 1] = 0
    return torch.bincount(ids, minlength=experts).tolist()


def _grouped_matmul_case(name: str, tokens: int, experts: int, k: int, n: int) -> KernelCase:
    def make(dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(6)
        counts = torch.tensor(_expert_counts(g, tokens, experts), device=device)
        x = _randn(g, tokens, k).to(device=device, dtype=dtype).requires_grad_(True)
        weight = (_randn(g, experts, k, n) / k**0.5).to(device=device, dtype=dtype).requires_grad_(True)
        return x, weight, counts

    return KernelCase("grouped_matmul", f"{name} T{tokens} E{experts} K{k} N{n}", make, kernels.grouped_matmul,
                      kernels.reference_grouped_matmul)


def _token_permute_case(name: str, tokens: int, hidden: int, experts: int, top_k: int) -> KernelCase:
    """permute -> each expert scales its rows by (expert + 1) -> unpermute: a row sent to the wrong expert, or
    brought back to the wrong token, differs from the reference."""

    def make(dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(7)
        x = _randn(g, tokens, hidden).to(device=device, dtype=dtype).requires_grad_(True)
        ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices.to(device)
        probs = torch.rand(tokens, top_k, generator=g).softmax(-1).to(device=device, dtype=dtype).requires_grad_(True)
        return x, ids, probs, experts

    def why_not_fused(x: Tensor, ids: Tensor, probs: Tensor, experts: int) -> Optional[str]:
        return kernels.why_not_fused("token_permute", x, ids, probs)

    return KernelCase("token_permute", f"{name} T{tokens} H{hidden} E{experts} top{top_k}", make, _fused_routing,
                      _reference_routing, why_not_fused)


def _fused_routing(x: Tensor, ids: Tensor, probs: Tensor, experts: int) -> Tensor:
    permuted, counts, permutation = kernels.permute_tokens(x, ids, probs, experts)
    return kernels.unpermute_tokens(permuted * _expert_scale(counts, permuted), permutation)


def _reference_routing(x: Tensor, ids: Tensor, probs: Tensor, experts: int) -> Tensor:
    permuted, sorted_indices = kernels.reference_permute_tokens(x, ids)
    counts = torch.bincount(ids.flatten(), minlength=experts)
    return kernels.reference_unpermute_tokens(permuted * _expert_scale(counts, permuted), sorted_indices, probs)


def _expert_scale(counts: Tensor, permuted: Tensor) -> Tensor:
    experts = torch.arange(1, counts.numel() + 1, device=permuted.device, dtype=permuted.dtype)
    return torch.repeat_interleave(experts, counts)[:, None]


def kernel_cases(quick: bool) -> list[KernelCase]:
    """The shapes checked: the tiny recipe's (GQA 4/2 heads of 32, dim 128, ffn 352), LLaMA-2-7B's per-head and
    per-token shapes (32 heads of 128, dim 4096, ffn 11008) at a small batch, and edge shapes (GQA, head_dim 64,
    decoding against a KV cache, rotary far into the sequence, SFT rows of packed samples, a ring-attention step),
    MoE experts and routing at a tiny and at Qwen3-30B-A3B's shapes (experts of 2048 -> 768, 16 of its 128 with
    ``quick``; routing over 128, top-8), each with an expert that gets no tokens, and int8 LoRA base projections
    (tiny's; 7B's gate-sized one in the full run), and MLA attention (v heads smaller than q/k's: DeepSeek's 192 / 128
    head dims with tiny's and DeepSeek-V2-Lite's 16 heads, plain, packed and as a ring step); long sequences in the
    full run only."""
    seq = 512 if quick else 4096
    experts = 16 if quick else 128  # Qwen3-30B-A3B's 128 experts hold 200M weights per projection
    cases = [
        _attention_case("tiny", 2, 128, 128, 4, 2, 32),
        _packed_attention_case("tiny", (50, 7, 71), 4, 2, 32),
        _ring_step_case("tiny", 2, 64, 4, 2, 32),
        _attention_case("7b", 1, seq, seq, 32, 32, 128),
        _packed_attention_case("7b", (seq // 2, 3, seq // 4, seq // 4 - 3), 32, 32, 128),
        _attention_case("gqa", 2, 256, 256, 8, 2, 64),
        _attention_case("decode", 2, 4, 4 + seq, 32, 8, 128),
        _ring_step_case("7b", 1, seq // 2, 32, 8, 128),
        _attention_case("tiny mla", 2, 64, 64, 4, 4, 192, dv=128),
        _packed_attention_case("tiny mla", (40, 5, 19), 4, 4, 192, dv=128),
        _ring_step_case("tiny mla", 1, 32, 4, 4, 192, dv=128),
        _attention_case("deepseek-v2-lite mla", 1, seq, seq, 16, 16, 192, dv=128),
        _rms_norm_case("tiny", 2, 128, 128),
        _rms_norm_case("7b", 1, seq, 4096),
        _rotary_case("tiny", 2, 128, 4, 32),
        _rotary_case("7b", 1, seq, 32, 128),
        _rotary_case("decode", 2, 4, 8, 64, start=seq),
        _swiglu_case("tiny", 2, 128, 352),
        _swiglu_case("7b", 1, seq, 11008),
        _grouped_matmul_case("tiny", 2 * 128, 8, 128, 352),
        _grouped_matmul_case("qwen3-30b-a3b", seq * 2, experts, 2048, 768),
        _token_permute_case("tiny", 128, 128, 8, 2),
        _token_permute_case("qwen3-30b-a3b", seq, 2048, 128, 8),
        _quantized_matmul_case("tiny", 2 * 128, 128, 352),
    ]
    if not quick:  # the 7B projection's reference decodes 45M weights, minutes in fp16 on a CPU
        cases += [_attention_case("long", 1, 2 * seq, 2 * seq, 32, 8, 128),
                  _quantized_matmul_case("7b", seq, 4096, 11008)]
    return cases


def kernel_checks(runtime: Any, device: torch.device, *, quick: bool,
                  cases: Optional[Sequence[KernelCase]] = None) -> list[tuple[str, Callable[[], CheckResult]]]:
    """Each kernel and dtype's check, not run yet, by its label: the worst case's errors, and the time of its
    largest case."""
    cases = kernel_cases(quick) if cases is None else cases
    repeats = 3 if quick else 10
    checks = []
    for op, spec in kernels.FUSED_OPS.items():
        op_cases = [case for case in cases if case.op == op]
        if op_cases:
            checks += [(f"{FAMILY}/{spec.name} {dtype_name}",
                        functools.partial(_check_kernel, spec, op_cases, dtype_name, runtime, device, repeats))
                       for dtype_name in DTYPES]
    return checks


def _check_kernel(spec: kernels.FusedOp, cases: Sequence[KernelCase], dtype_name: str, runtime: Any,
                  device: torch.device, repeats: int) -> CheckResult:
    dtype = DTYPES[dtype_name]
    if dtype is torch.bfloat16 and not runtime.chip().supports_bf16:
        return CheckResult(FAMILY, f"{spec.name} {dtype_name}", NOT_AVAILABLE, f"{runtime.chip().name} has no bf16"
                           " support")
    return _summarise(spec, dtype_name, dtype, [_run_case(case, dtype, device, runtime, repeats) for case in cases])


@dataclass
class _CaseRun:
    case: KernelCase
    unavailable: Optional[str]
    reference_s: float
    fused_s: Optional[float] = None
    max_err: float = 0.0
    mean_err: float = 0.0
    worst: str = ""


def _run_case(case: KernelCase, dtype: torch.dtype, device: torch.device, runtime: Any, repeats: int) -> _CaseRun:
    args = case.make(dtype, device)
    # Asked with the inputs as the kernel sees them (gradients on), since some limits apply to backward only.
    unavailable = case.unavailable(*args)
    grad_out = _grad_output(case.reference(*args))
    reference_s = _time(lambda: _forward_backward(case.reference, args, grad_out), runtime,
                        repeats if unavailable is None else 1)
    run = _CaseRun(case, unavailable, reference_s)
    if unavailable is not None:
        return run
    fused = _forward_backward(case.fused, args, grad_out)
    exact_args = tuple(_fp32_leaf(a) for a in args)
    exact = _forward_backward(case.reference, exact_args, grad_out.float())
    for name, got, want in zip(_names(args), fused, exact):
        scale = want.float().pow(2).mean().sqrt().clamp_min(1e-12)
        # NaN or inf anywhere must fail, and a NaN would compare false against any tolerance.
        diff = torch.nan_to_num((got.float() - want.float()).abs() / scale, nan=float("inf"))
        if diff.max().item() >= run.max_err:
            run.max_err, run.worst = diff.max().item(), name
        run.mean_err = max(run.mean_err, diff.mean().item())
    run.fused_s = _time(lambda: _forward_backward(case.fused, args, grad_out), runtime, repeats)
    return run


def _names(args: tuple[Any, ...]) -> list[str]:
    return ["output"] + [f"grad of input {i}" for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]


def _fp32_leaf(value: Any) -> Any:
    if not isinstance(value, Tensor) or not value.is_floating_point():
        return value  # expert counts and ids stay integers
    return value.detach().float().requires_grad_(value.requires_grad)


def _grad_output(out: Tensor) -> Tensor:
    g = torch.Generator().manual_seed(4)
    return torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)


def _forward_backward(fn: Callable[..., Tensor], args: tuple[Any, ...], grad_out: Tensor) -> list[Tensor]:
    """The output and the gradient of every input that needs one (for a fixed output gradient)."""
    leaves = [a for a in args if isinstance(a, Tensor) and a.requires_grad]
    out = fn(*args)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    # A kernel whose output does not depend on an input gives it no gradient: zeros, which the comparison fails.
    return [out.detach(), *(torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves))]


def _time(fn: Callable[[], Any], runtime: Any, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up run, the device synchronised around each run."""
    if repeats > 1:
        fn()
    times = []
    for _ in range(repeats):
        runtime.synchronize()
        start = time.perf_counter()
        fn()
        runtime.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _summarise(spec: kernels.FusedOp, dtype_name: str, dtype: torch.dtype, runs: list[_CaseRun]) -> CheckResult:
    name = f"{spec.name} {dtype_name}"
    largest = max(runs, key=lambda r: r.reference_s)
    cases = {run.case.name: _case_figures(run) for run in runs}
    unavailable = [run for run in runs if run.unavailable is not None]
    if len(unavailable) == len(runs):
        figures = {"reference_s": largest.reference_s, "cases": cases}
        return CheckResult(FAMILY, name, NOT_AVAILABLE, f"{spec.npu_op}: {unavailable[0].unavailable}", figures)
    tolerance = TOLERANCES[dtype]
    checked = [run for run in runs if run.unavailable is None]
    worst = max(checked, key=lambda r: r.max_err / tolerance.max_err)
    figures = {
        "max_err": worst.max_err,
        "mean_err": max(run.mean_err for run in checked),
        "fused_s": largest.fused_s,
        "reference_s": largest.reference_s,
        "cases": cases,
    }
    bad = [run for run in checked if run.max_err > tolerance.max_err or run.mean_err > tolerance.mean_err]
    if bad:
        run = bad[0]
        detail = (f"{spec.npu_op} differs from the PyTorch reference at {run.case.name}: {run.worst} max error"
                  f" {run.max_err:.3g} (tolerance {tolerance.max_err:.3g}), mean {run.mean_err:.3g} (tolerance"
                  f" {tolerance.mean_err:.3g}), relative to the reference's RMS")
        return CheckResult(FAMILY, name, FAIL, detail, figures, fallback=spec.switch)
    detail = f"{spec.npu_op} matches the reference in {len(checked)} case(s)"
    if unavailable:
        detail += f"; {len(unavailable)} case(s) ran the reference: {unavailable[0].unavailable}"
    return CheckResult(FAMILY, name, PASS, detail, figures)


def _case_figures(run: _CaseRun) -> dict[str, Any]:
    if run.unavailable is not None:
        return {"fused": NOT_AVAILABLE, "reason": run.unavailable, "reference_s": run.reference_s}
    return {"max_err": run.max_err, "mean_err": run.mean_err, "worst": run.worst, "fused_s": run.fused_s,
            "reference_s": run.reference_s}
