"""The telemetry formulas as pure functions of plain numbers (no torch): throughput, FLOP/s and MFU per device."""

from __future__ import annotations

from typing import Optional

GIB = 1024**3
TERA = 1e12


def tokens_per_second(tokens: float, seconds: float) -> float:
    """Throughput in tokens/s of ``tokens`` processed in ``seconds`` of wall time."""
    if seconds <= 0:
        raise ValueError(f"seconds={seconds!r} must be positive to compute a throughput")
    return tokens / seconds


def flops_per_second(tokens_per_s: float, flops_per_token: float) -> float:
    """Achieved training FLOP/s per device from its tokens/s and the model's training FLOPs per token."""
    return tokens_per_s * flops_per_token


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation as a fraction (0.599 = 59.9%): achieved FLOP/s per device over the chip's peak FLOP/s."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops={peak_flops!r} must be a positive FLOP/s figure")
    return flops_per_second(tokens_per_s, flops_per_token) / peak_flops


def training_rates(
    tokens_per_s: Optional[float], flops_per_token: Optional[float], peak_flops: Optional[float]
) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """``(tokens/s, FLOP/s, MFU)`` per device from a measured tokens/s, each ``None`` where an input it needs is
    unknown: FLOP/s needs ``flops_per_token``, MFU also the chip's ``peak_flops``."""
    if tokens_per_s is None or flops_per_token is None:
        return tokens_per_s, None, None
    flops = flops_per_second(tokens_per_s, flops_per_token)
    if peak_flops is None:
        return tokens_per_s, flops, None
    return tokens_per_s, flops, mfu(tokens_per_s, flops_per_token, peak_flops)
