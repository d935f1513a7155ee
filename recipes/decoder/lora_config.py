"""The LoRA configuration of the recipe (``LoRAConfig``) and the names of the projections it can target (``TARGETS``).

Torch-free, so that ``memory_profile.py`` (which ``lightning-npu plan`` imports to read a config) validates a
config's ``lora:`` exactly as training does; ``lora.py`` (the adapters themselves) re-exports both names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from lightning_npu.facts.weight_quant import check_scheme

#: The projections LoRA can adapt, by the names PEFT configs use for a decoder layer's: attention query, key, value
#: and output, MLA's query low rank and up-projection (q_a, q_b) and key/value latent and up-projection (kv_a, kv_b),
#: and the SwiGLU MLP's gate, up and down. Each family says where they sit in its blocks
#: (``DecoderFamily.lora_sites``).
PROJECTION_TARGETS: tuple[str, ...] = ("q", "q_a", "q_b", "k", "v", "kv_a", "kv_b", "o", "gate", "up", "down")
#: The stacked experts' gate, up and down projections (an MoE layer's): one adapter per expert, stacked as the
#: experts' weights are (``DecoderFamily.expert_lora_sites``).
EXPERT_TARGETS: tuple[str, ...] = ("expert_gate", "expert_up", "expert_down")
TARGETS: tuple[str, ...] = PROJECTION_TARGETS + EXPERT_TARGETS


#: ``model.lora``'s keys.
FIELDS = ("rank", "alpha", "dropout", "targets", "base_quantization")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA hyper-parameters: ``rank`` (r), ``alpha`` (the update is scaled by alpha / rank), ``dropout`` on the
    adapters' input, ``targets`` among ``TARGETS`` (q, k, v, o, gate, up, down, MLA's q_a, q_b, kv_a, kv_b, and an
    MoE layer's expert_gate, expert_up, expert_down), and ``base_quantization``: how the frozen base's block
    projections (not the stacked experts, which stay in the model's dtype) are stored, ``int8`` (per output channel),
    ``nf4`` (QLoRA's 4-bit NormalFloat, blocks of 64) or None (the model's dtype; see ``lora.py``)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")
    base_quantization: Optional[str] = None

    def __post_init__(self) -> None:
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora.rank={self.rank!r} must be an integer >= 1 (the adapters' inner dimension)")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise ValueError(f"lora.alpha={self.alpha!r} must be a number > 0 (the update is scaled by alpha / rank)")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout!r} must lie in [0, 1): the drop probability of the input")
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"lora.targets has unknown name(s) {unknown}; choose among {list(TARGETS)}")
        if not targets:
            raise ValueError(f"lora.targets is empty; name at least one of {list(TARGETS)}")
        check_scheme(self.base_quantization, "lora.base_quantization")
        if len(set(targets)) != len(targets):
            raise ValueError(f"lora.targets={list(targets)} names a target twice; list each once")
        # Canonical order, so equal configs compare (and are saved) equal.
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["targets"] = list(self.targets)
        return out

    @classmethod
    def from_value(cls, value: Any) -> Optional["LoRAConfig"]:
        """A ``LoRAConfig`` from a dict of its fields (the LightningCLI / checkpoint form), a config, or None."""
        if value is None or isinstance(value, LoRAConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"model.lora={value!r} must be a mapping {{{', '.join(FIELDS)}}} or null")
        unknown = set(value) - set(FIELDS)
        if unknown:
            raise ValueError(f"model.lora has unknown key(s) {sorted(unknown)}; it takes {', '.join(FIELDS)}")
        return cls(**value)
