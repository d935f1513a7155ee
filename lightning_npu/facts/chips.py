"""What each Ascend chip is: its product series (which fused kernels it runs), peak throughput and device memory.

Chip names are the exact strings ``torch.npu.get_device_name()`` returns: the names of torch_npu's
``c10_npu::SocVersion`` enum (``torch_npu/include/torch_npu/csrc/core/npu/NpuVariables.h``, identical in the
2.6.0, 2.13.0 and 2.14.0 wheels). Names are matched exactly, never by prefix: ``"Ascend910B"`` (SocVersion 104)
is a first-generation part like ``"Ascend910A"``, while the Atlas A2 parts are ``"Ascend910B1"`` .. ``"Ascend910B4_1"``
(torch_npu itself tests ``"Ascend910B" < name`` for A2 in ``torch_npu/utils/_optim.py``).

bf16 support is not read from this table: the runtime asks ``torch.npu.is_bf16_supported()``, which knows
chips this table does not. The peaks are the Cube-unit dense bf16 figures published for A2 and A3 parts; the
memory is the HBM per device as the runtime sees it (what ``lightning-npu plan`` plans against).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TFLOPS = 1e12


@dataclass(frozen=True)
class _Row:
    series: str
    peak_bf16_tflops: Optional[float] = None
    memory_gib: Optional[float] = None


# The one chip table, in SocVersion order. None: not published (or not known here).
_CHIPS = {
    # SocVersion 100..104: the Atlas training series (Ascend 910 first generation; fp16 only, no A2 fused kernels).
    "Ascend910PremiumA": _Row("training"),
    "Ascend910ProA": _Row("training", memory_gib=32.0),
    "Ascend910A": _Row("training", memory_gib=32.0),
    "Ascend910ProB": _Row("training", memory_gib=32.0),
    "Ascend910B": _Row("training"),
    # SocVersion 220..225: Atlas A2 training series. The last one's enum name is Ascend910B4_1; torch_npu's name map
    # (NpuVariables.cpp) spells the runtime's name "Ascend910B4-1", so both spellings are listed.
    "Ascend910B1": _Row("A2", 373.9, 64.0),
    "Ascend910B2": _Row("A2", 353.9, 64.0),
    "Ascend910B2C": _Row("A2", 353.9, 64.0),  # a 910B2 variant
    "Ascend910B3": _Row("A2", 294.9, 64.0),
    "Ascend910B4": _Row("A2", 245.8, 32.0),
    "Ascend910B4-1": _Row("A2", 245.8, 32.0),  # a 910B4 variant
    "Ascend910B4_1": _Row("A2", 245.8, 32.0),
    # SocVersion 250..256: Atlas A3 training series.
    **dict.fromkeys(
        ("Ascend910_9391", "Ascend910_9392", "Ascend910_9381", "Ascend910_9382", "Ascend910_9372", "Ascend910_9362",
         "Ascend910_9363"),
        _Row("A3", 353.9, 64.0),
    ),
}

ATLAS_TRAINING = tuple(name for name, row in _CHIPS.items() if row.series == "training")
ATLAS_A2 = tuple(name for name, row in _CHIPS.items() if row.series == "A2")
ATLAS_A3 = tuple(name for name, row in _CHIPS.items() if row.series == "A3")
#: Every chip whose device memory is known (GiB), in table order.
CHIP_MEMORY_GIB = {name: row.memory_gib for name, row in _CHIPS.items() if row.memory_gib is not None}
#: The chip ``lightning-npu plan`` assumes when given neither a chip nor a device memory.
DEFAULT_PLAN_CHIP = "Ascend910B2"

#: Devices per server HCCL accepts for collectives on the Atlas training series (first-generation 910, whose 8
#: chips form two 4-chip rings). CANN's distributed-training notes name that series alone: "针对Atlas 训练系列产品，
#: 如果使用1台训练服务器(Server)，要求实际参与集合通信的昇腾AI处理器数目只能为1/2/4/8，且0-3卡和4-7卡各为一个组网"
#: (and 1*n/2*n/4*n/8*n across n servers), while Atlas A2 takes "(1~8)*n" (HCCL create_group: no limit in
#: one A2 server). torch_npu's API support list (Ascend/pytorch docs/zh/native_apis/pytorch_2-10-0/
#: torch-distributed.md, all_gather_into_tensor / reduce_scatter_tensor: "world size不支持3，5，6，7") names no
#: chip; it is that first-generation rule, so it applies to those chips only.
ATLAS_TRAINING_DEVICES_PER_SERVER = (1, 2, 4, 8)


@dataclass(frozen=True)
class ChipFacts:
    """Facts about one chip. ``peak_bf16_flops`` is in FLOP/s per chip, ``memory_gib`` in GiB per device;
    ``None`` where unknown.

    ``series`` is ``"A2"``, ``"A3"``, ``"training"`` (first-generation 910) or ``None`` for a chip this table
    does not know (an inference part such as Ascend310P3, or a newer one such as Ascend950).
    """

    name: str
    supports_bf16: bool
    peak_bf16_flops: Optional[float]
    series: Optional[str] = None
    memory_gib: Optional[float] = None


def chip_series(name: str) -> Optional[str]:
    """The product series of the chip named ``name`` exactly, or None when it is not in torch_npu's A2/A3/910 lists."""
    row = _CHIPS.get(name)
    return row.series if row is not None else None


def runs_a2_a3_kernels(name: str) -> bool:
    """Whether torch_npu documents its A2/A3 training kernels (npu_fusion_attention, ...) for the chip ``name``."""
    return chip_series(name) in ("A2", "A3")


def peak_bf16_flops(name: str) -> Optional[float]:
    """Dense bf16 peak of the chip named ``name`` exactly, in FLOP/s per chip; None when not published."""
    row = _CHIPS.get(name)
    return row.peak_bf16_tflops * TFLOPS if row is not None and row.peak_bf16_tflops is not None else None


def device_memory_gib(name: str) -> Optional[float]:
    """Device memory of the chip named ``name`` exactly, in GiB; None for a chip this table does not know."""
    row = _CHIPS.get(name)
    return row.memory_gib if row is not None else None


def chip_facts(name: str, supports_bf16: bool) -> ChipFacts:
    """Facts for the chip ``torch.npu.get_device_name()`` calls ``name``; ``supports_bf16`` comes from the runtime.

    An unknown chip has no peak, so MFU is reported as unavailable rather than guessed.
    """
    return ChipFacts(
        name=name,
        supports_bf16=supports_bf16,
        peak_bf16_flops=peak_bf16_flops(name),
        series=chip_series(name),
        memory_gib=device_memory_gib(name),
    )
