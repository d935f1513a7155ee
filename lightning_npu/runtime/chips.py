"""What each Ascend chip can do: bf16 support and peak dense bf16 throughput (for MFU).

The numbers are the Cube-unit dense bf16 peaks published for Atlas A2 (910B) and A3 (910_93xx) parts.
910A-class chips have no bf16 units (fp16 only), so they carry no bf16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TFLOPS = 1e12


@dataclass(frozen=True)
class ChipFacts:
    """Facts about one chip. ``peak_bf16_flops`` is in FLOP/s per chip, ``None`` where unknown."""

    name: str
    supports_bf16: bool
    peak_bf16_flops: Optional[float]


# Longest prefix wins: "Ascend910B2C" is a 910B2 variant, "Ascend910_9391" an A3 part.
_PEAKS_BY_PREFIX = {
    "Ascend910B1": 373.9 * TFLOPS,
    "Ascend910B2": 353.9 * TFLOPS,
    "Ascend910B3": 294.9 * TFLOPS,
    "Ascend910B4": 245.8 * TFLOPS,
    "Ascend910_93": 353.9 * TFLOPS,
}
_NO_BF16_PREFIXES = ("Ascend910A", "Ascend910ProA", "Ascend910ProB", "Ascend910PremiumA")


def chip_facts(name: str) -> ChipFacts:
    """Look a chip up by the name ``torch.npu.get_device_name()`` returns (e.g. ``"Ascend910B2"``).

    An unknown chip is assumed to support bf16 (every current training part does) but has no peak,
    so MFU is reported as unavailable rather than guessed.
    """
    if name.startswith(_NO_BF16_PREFIXES):
        return ChipFacts(name=name, supports_bf16=False, peak_bf16_flops=None)
    matches = [prefix for prefix in _PEAKS_BY_PREFIX if name.startswith(prefix)]
    peak = _PEAKS_BY_PREFIX[max(matches, key=len)] if matches else None
    return ChipFacts(name=name, supports_bf16=True, peak_bf16_flops=peak)
