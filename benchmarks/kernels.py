"""The kernels' reference paths against naive PyTorch, forward + backward, at LLaMA-2-7B shapes on the CPU.

    python benchmarks/kernels.py                       # seq 512, 1024, 2048; ~2 min on 2 cores
    python benchmarks/kernels.py --seqs 512 --repeats 2 --out /tmp/kernels.json

lightning_npu.kernels runs torch_npu's fused kernels on NPU tensors and PyTorch reference paths elsewhere. This
measures the reference paths (what CPUs, and NPUs without a fused kernel, run) against the naive formulations
the kernels replace, with 32 heads of 128 channels (7B), batch 1, fp32:

- causal_attention (SDPA, no S x S matrix kept) vs explicit softmax attention (scores, mask, softmax, matmul);
- rms_norm vs the unfused expression in the input dtype;
- apply_rotary (rotate-half, HF layout) vs the complex-number rotation of the original LLaMA code;
- swiglu vs silu spelled out as a * sigmoid(a) * b.

Time is the median of ``--repeats`` timed forward + backward passes after one warm-up; peak memory is the most tensor
storage alive at once during one pass (inputs excluded), read from the CPU allocator's reports to the profiler
(see benchmarks/_memory.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks._memory import calibration, peak_bytes  # noqa: E402
from lightning_npu.kernels import apply_rotary, causal_attention, rms_norm, rotary_tables, swiglu  # noqa: E402

HEADS, HEAD_DIM, DIM, FFN = 32, 128, 4096, 11008  # LLaMA-2-7B
MIB = 1024**2


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention written out: keeps the [heads, seq, seq] probabilities for backward."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scores = qt @ kt.transpose(-1, -2) / math.sqrt(q.shape[-1])
    seq = q.shape[1]
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    return (probs @ vt).transpose(1, 2)


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def naive_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Original LLaMA: rotate interleaved channel pairs as complex numbers (a different pairing, same cost class)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * freqs[None, :, None, :]).flatten(3)
    return rotated.type_as(x)


def naive_swiglu(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b


def _cases(batch: int, seq: int) -> dict[str, tuple[Callable, Callable, Callable[[], tuple]]]:
    """op -> (reference, naive, make inputs). Inputs that need gradients are leaf tensors."""
    def qkv() -> tuple:
        return tuple(torch.randn(batch, seq, HEADS, HEAD_DIM, requires_grad=True) for _ in range(3))

    cos, sin = rotary_tables(seq, HEAD_DIM)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32),
                         1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.polar(torch.ones_like(angles), angles)
    return {
        "causal_attention": (causal_attention, naive_attention, qkv),
        "rms_norm": (lambda x, w: rms_norm(x, w, eps=1e-5), naive_rms_norm,
                     lambda: (torch.randn(batch, seq, DIM, requires_grad=True), torch.ones(DIM, requires_grad=True))),
        "apply_rotary": (lambda x: apply_rotary(x, cos, sin), lambda x: naive_rotary(x, freqs),
                         lambda: (torch.randn(batch, seq, HEADS, HEAD_DIM, requires_grad=True),)),
        "swiglu": (swiglu, naive_swiglu, lambda: (torch.randn(batch, seq, 2 * FFN, requires_grad=True),)),
    }


def _pass(fn: Callable, inputs: tuple, grad: torch.Tensor) -> None:
    out = fn(*inputs)
    out.backward(grad)


def measure(fn: Callable, make_inputs: Callable[[], tuple], repeats: int) -> dict[str, float]:
    inputs = make_inputs()
    grad = torch.randn_like(fn(*inputs).detach())
    _pass(fn, inputs, grad)  # warm-up
    times = []
    for _ in range(repeats):
        for t in inputs:
            t.grad = None
        started = time.perf_counter()
        _pass(fn, inputs, grad)
        times.append(time.perf_counter() - started)
    for t in inputs:
        t.grad = None
    peak = peak_bytes(lambda: _pass(fn, inputs, grad))
    return {"ms": 1000 * statistics.median(times), "peak_mib": peak / MIB}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="512,1024,2048", help="sequence lengths, comma-separated")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    check = calibration()
    if check["measured_peak"] != check["expected_peak"]:
        raise SystemExit(f"memory measurement calibration failed: {check}")
    rows = []
    print(f"{'op':<18}{'seq':>6}{'ref ms':>10}{'naive ms':>10}{'speedup':>9}{'ref MiB':>10}{'naive MiB':>11}"
          f"{'mem ratio':>10}")
    for seq in (int(s) for s in args.seqs.split(",")):
        for op, (reference, naive, make_inputs) in _cases(args.batch, seq).items():
            ref = measure(reference, make_inputs, args.repeats)
            nai = measure(naive, make_inputs, args.repeats)
            row = {"op": op, "seq": seq, "batch": args.batch, "reference": ref, "naive": nai,
                   "speedup": nai["ms"] / ref["ms"], "memory_ratio": nai["peak_mib"] / max(ref["peak_mib"], 1e-9)}
            rows.append(row)
            print(f"{op:<18}{seq:>6}{ref['ms']:>10.1f}{nai['ms']:>10.1f}{row['speedup']:>8.2f}x"
                  f"{ref['peak_mib']:>10.1f}{nai['peak_mib']:>11.1f}{row['memory_ratio']:>9.2f}x", flush=True)
    result = {"shapes": {"heads": HEADS, "head_dim": HEAD_DIM, "dim": DIM, "ffn": FFN, "dtype": "fp32"},
              "threads": args.threads, "torch": torch.__version__, "calibration": check, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"(speedup and mem ratio: naive / reference; forward + backward; wrote {args.out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
