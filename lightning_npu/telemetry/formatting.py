"""The monitor's text (no torch): one progress line per report and the end-of-training summary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, TypedDict

from lightning_npu.telemetry.arithmetic import GIB, TERA

if TYPE_CHECKING:
    from typing_extensions import Unpack


@dataclass(frozen=True)
class MemoryReading:
    """Peak memory in bytes; ``total_bytes`` is the device's capacity where known.

    ``process_rss`` marks a reading of the process's peak resident set size (CPU and simulated runs), which
    is not device memory and is labelled as such.
    """

    peak_bytes: float
    total_bytes: Optional[float] = None
    process_rss: bool = False

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def describe(self) -> str:
        if self.process_rss:
            return f"peak RSS {self.peak_gib:.1f} GiB (process)"
        if self.total_bytes:
            return f"mem {self.peak_gib:.1f}/{self.total_bytes / GIB:.1f} GiB"
        return f"mem {self.peak_gib:.1f} GiB"


class Rates(TypedDict, total=False):
    """What a line reports per device besides steps and loss; a part whose number is ``None`` is left out."""

    tokens_per_s: Optional[float]  # tokens/s per device
    flops_per_s: Optional[float]  # achieved FLOP/s per device
    mfu_fraction: Optional[float]  # of the chip's peak, 0..1
    memory: Optional[MemoryReading]
    device_label: str  # the device in "tokens/s/<label>": "npu", or "device" elsewhere (default "npu")


def format_tflops(flops_per_s: float) -> str:
    """FLOP/s as a TFLOP/s number with about three significant digits (``212``, ``21.2``, ``0.0212``)."""
    tflops = flops_per_s / TERA
    if tflops >= 100:
        return f"{tflops:.0f}"
    if tflops >= 1:
        return f"{tflops:.1f}"
    return f"{tflops:.3g}"


def format_duration(seconds: float) -> str:
    """``12.3 s``, ``2m 05s`` or ``1h 02m 05s``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def format_line(
    *, step: int, max_steps: Optional[int], step_time_s: float, loss: Optional[float] = None,
    lr: Optional[float] = None, **rates: Unpack[Rates],
) -> str:
    """One progress line; parts whose number is unknown (``None``) are left out."""
    parts = [f"step {step}/{max_steps}" if max_steps else f"step {step}"]
    if loss is not None:
        parts.append(f"loss {loss:.3f}")
    if lr is not None:
        parts.append(f"lr {lr:.1e}")
    parts += _rate_parts(rates)
    memory = rates.get("memory")
    if memory is not None:
        parts.append(memory.describe())
    parts.append(f"{step_time_s:.2f} s/step")
    return " | ".join(parts)


def format_summary(*, steps: int, total_s: float, validation_s: float = 0.0, **rates: Unpack[Rates]) -> str:
    """The end-of-training line: wall time, and averages over the training time (validation excluded)."""
    head = f"training done: {steps} steps in {format_duration(total_s)}"
    if validation_s > 0:
        head += f" ({format_duration(validation_s)} of it validation)"
    parts = [head, *_rate_parts(rates, prefix="avg ")]
    memory = rates.get("memory")
    if memory is not None:
        parts.append(memory.describe() if memory.process_rss else f"peak {memory.describe()}")
    return " | ".join(parts)


def _rate_parts(rates: Rates, prefix: str = "") -> list[str]:
    unknown = sorted(set(rates) - set(Rates.__annotations__))
    if unknown:  # what a misspelt keyword would otherwise silently drop from the line
        raise TypeError(f"unknown rate(s) {unknown}; a line reports {sorted(Rates.__annotations__)}")
    tokens_per_s, flops_per_s, mfu_fraction = (rates.get(k) for k in ("tokens_per_s", "flops_per_s", "mfu_fraction"))
    parts = []
    if tokens_per_s is not None:
        parts.append(f"{prefix}{tokens_per_s:,.0f} tokens/s/{rates.get('device_label', 'npu')}")
    if flops_per_s is not None:
        parts.append(f"{format_tflops(flops_per_s)} TFLOP/s")
    if mfu_fraction is not None:
        parts.append(f"MFU {100 * mfu_fraction:.1f}%")
    return parts
