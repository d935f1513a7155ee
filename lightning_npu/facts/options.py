"""The ``npu_fsdp`` options that are facts rather than torch objects: their defaults, the values each accepts
(with the error that names the value, why and the fix), and which blocks a checkpointing ratio selects.

``strategies.fsdp.FSDPOptions`` adds the module-class policies and the torch-side work on top of
``FSDPChoices``; ``lightning-npu plan`` validates the same options here without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

#: What each supported ZeRO stage means under FSDP2 (``reshard_after_forward``), in order of preference.
ZERO_STAGES = {
    3: "parameters resharded after forward, least memory",
    2: "parameters kept gathered until backward, less communication",
}
#: ``"full"``: every parameter sharded over all devices; ``"hybrid"``: sharded within a node, replicated across.
SHARDINGS = ("full", "hybrid")

DEFAULT_ZERO_STAGE = 3
DEFAULT_SHARDING = "full"
#: The share of the ``activation_checkpointing_policy`` blocks that recompute their activations.
DEFAULT_ACTIVATION_CHECKPOINTING_RATIO = 1.0


def check_zero_stage(value: Any) -> int:
    """``value`` if it is a supported ``zero_stage``; ValueError with the choices otherwise."""
    if value not in ZERO_STAGES:
        choices = " or ".join(f"{stage} ({meaning})" for stage, meaning in ZERO_STAGES.items())
        raise ValueError(f"zero_stage={value!r} is not supported; use {choices}")
    return value


def check_sharding(value: Any) -> str:
    """``value`` if it is a supported ``sharding``; ValueError with the choices otherwise."""
    if value not in SHARDINGS:
        raise ValueError(f"sharding={value!r} is not supported; use {' or '.join(repr(s) for s in SHARDINGS)}")
    return value


def check_activation_checkpointing_ratio(value: Any) -> float:
    """``value`` as a float if it lies in [0, 1]; ValueError otherwise."""
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(
            f"activation_checkpointing_ratio={value!r} must lie in [0, 1]:"
            " it is the fraction of matching blocks whose activations are recomputed"
        )
    return float(value)


def check_memory_fraction(value: Any) -> Optional[float]:
    """``value`` as a float if it lies in (0, 1] (None: no limit); ValueError otherwise."""
    if value is None:
        return None
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(
            f"memory_fraction={value!r} must lie in (0, 1]: it is the share of each NPU's memory"
            " this process may allocate (e.g. 0.9)"
        )
    return float(value)


def evenly_spaced(count: int, ratio: float) -> list[int]:
    """Indices of ``round(count * ratio)``-ish items spread evenly over ``count`` (ratio 0.5 of 4 -> [1, 3]):
    the blocks ``activation_checkpointing_ratio`` selects among those the policy matches."""
    return [i for i in range(count) if int((i + 1) * ratio) > int(i * ratio)]


@dataclass(frozen=True)
class FSDPChoices:
    """The ``npu_fsdp`` options that need no torch, with their defaults, validated at construction."""

    zero_stage: int = DEFAULT_ZERO_STAGE
    sharding: str = DEFAULT_SHARDING
    activation_checkpointing_ratio: float = DEFAULT_ACTIVATION_CHECKPOINTING_RATIO
    cpu_offload: bool = False
    memory_fraction: Optional[float] = None

    def __post_init__(self) -> None:
        check_zero_stage(self.zero_stage)
        check_sharding(self.sharding)
        check_activation_checkpointing_ratio(self.activation_checkpointing_ratio)
        check_memory_fraction(self.memory_fraction)

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2's ``reshard_after_forward`` for ``zero_stage``."""
        return self.zero_stage == 3
