"""What each Ascend chip is: its product series (which fused kernels it runs), bf16 support and peak throughput.

Chip names are the exact strings ``torch.npu.get_device_name()`` returns: the names of torch_npu's
``c10_npu::SocVersion`` enum (``torch_npu/include/torch_npu/csrc/core/npu/NpuVariables.h``, identical in the
2.6.0, 2.13.0 and 2.14.0 wheels). Names are matched exactly, never by prefix: ``"Ascend910B"`` (SocVersion 104)
is a first-generation part like ``"Ascend910A"``, while the Atlas A2 parts are ``"Ascend910B1"`` .. ``"Ascend910B4_1"``
(torch_npu itself tests ``"Ascend910B" < name`` for A2 in ``torch_npu/utils/_optim.py``).

bf16 support is not read from this table: the runtime asks ``torch.npu.is_bf16_supported()``, which knows
chips this table does not. The peaks are the Cube-unit dense bf16 figures published for A2 and A3 parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TFLOPS = 1e12

#: SocVersion 100..104: the Atlas training series (Ascend 910 first generation; fp16 only, no A2 fused kernels).
ATLAS_TRAINING = ("Ascend910PremiumA", "Ascend910ProA", "Ascend910A", "Ascend910ProB", "Ascend910B")
#: SocVersion 220..225: Atlas A2 training series. The last one's enum name is Ascend910B4_1; torch_npu's name map
#: (NpuVariables.cpp) spells the runtime's name "Ascend910B4-1", so both spellings are listed.
ATLAS_A2 = ("Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "Ascend910B4-1", "Ascend910B4_1")
#: SocVersion 250..256: Atlas A3 training series.
ATLAS_A3 = (
    "Ascend910_9391", "Ascend910_9392", "Ascend910_9381", "Ascend910_9382",
    "Ascend910_9372", "Ascend910_9362", "Ascend910_9363",
)

_PEAK_BF16_FLOPS = {
    "Ascend910B1": 373.9 * TFLOPS,
    "Ascend910B2": 353.9 * TFLOPS,
    "Ascend910B2C": 353.9 * TFLOPS,  # a 910B2 variant
    "Ascend910B3": 294.9 * TFLOPS,
    "Ascend910B4": 245.8 * TFLOPS,
    "Ascend910B4-1": 245.8 * TFLOPS,  # a 910B4 variant
    "Ascend910B4_1": 245.8 * TFLOPS,
    **dict.fromkeys(ATLAS_A3, 353.9 * TFLOPS),
}


@dataclass(frozen=True)
class ChipFacts:
    """Facts about one chip. ``peak_bf16_flops`` is in FLOP/s per chip, ``None`` where unknown.

    ``series`` is ``"A2"``, ``"A3"``, ``"training"`` (first-generation 910) or ``None`` for a chip this table
    does not know (an inference part such as Ascend310P3, or a newer one such as Ascend950).
    """

    name: str
    supports_bf16: bool
    peak_bf16_flops: Optional[float]
    series: Optional[str] = None


def chip_series(name: str) -> Optional[str]:
    """The product series of the chip named ``name`` exactly, or None when it is not in torch_npu's A2/A3/910 lists."""
    if name in ATLAS_A2:
        return "A2"
    if name in ATLAS_A3:
        return "A3"
    if name in ATLAS_TRAINING:
        return "training"
    return None


def runs_a2_a3_kernels(name: str) -> bool:
    """Whether torch_npu documents its A2/A3 training kernels (npu_fusion_attention, ...) for the chip ``name``."""
    return chip_series(name) in ("A2", "A3")


def chip_facts(name: str, supports_bf16: bool) -> ChipFacts:
    """Facts for the chip ``torch.npu.get_device_name()`` calls ``name``; ``supports_bf16`` comes from the runtime.

    An unknown chip has no peak, so MFU is reported as unavailable rather than guessed.
    """
    return ChipFacts(
        name=name, supports_bf16=supports_bf16, peak_bf16_flops=_PEAK_BF16_FLOPS.get(name), series=chip_series(name)
    )
