"""What the families' memory profiles (``recipes/models/<family>/memory_profile.py``, read by ``lightning-npu
plan``) share: a config's ``model:`` section as the family's config, and the planner's adapters for its ``lora``.

Torch-free, like the profiles that import it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from lightning_npu.plan import LowRankAdapters, PlanError
from recipes import families
from recipes.decoder.lora_config import EXPERT_TARGETS, LoRAConfig

#: DecoderLM's default preset (module.py), used when a config's model: section names none.
DEFAULT_PRESET = "tiny"


def family_config(model: Mapping[str, Any], profile_module: str, config_class: Any) -> tuple[str, Any]:
    """(preset, config) of the DecoderLM a ``model:`` section (``family``, ``preset``, ``config``) builds, for the
    profile module ``profile_module`` (its ``__name__``) of the family whose config class is ``config_class``;
    ``ValueError`` for a section of another family or with bad fields."""
    family = str(model.get("family", families.DEFAULT_FAMILY))
    package = profile_module.rpartition(".")[0]
    if families.FAMILIES.get(family) != f"{package}.family":
        raise ValueError(
            f"model.family={family!r} is not the family of {profile_module} (the families: {sorted(families.FAMILIES)})"
        )
    preset = str(model.get("preset", DEFAULT_PRESET))
    overrides = model.get("config") or {}
    if not isinstance(overrides, Mapping):
        raise ValueError(f"model.config must be a mapping of {config_class.__name__} fields, not {overrides!r}")
    return preset, config_class.from_preset(preset, **dict(overrides))


def adapters(lora: Any, unplanned: tuple[str, ...] = (), experts: bool = False) -> Optional[LowRankAdapters]:
    """The planner's adapters for a config's ``model.lora`` value (None: full fine-tuning), validated by the
    recipe's own ``LoRAConfig``; ``PlanError`` if it targets any of ``unplanned`` (targets the family's profile does
    not count yet), or the experts' projections in a family without experts (``experts`` False), which the recipe
    refuses too."""
    config = LoRAConfig.from_value(lora)
    if config is None:
        return None
    on_experts = [target for target in config.targets if target in EXPERT_TARGETS]
    if on_experts and not experts:
        raise PlanError(f"lora.targets {on_experts}: this model has no experts to adapt; adapt its projections instead")
    refused = [target for target in config.targets if target in unplanned]
    if refused:
        raise PlanError(
            f"lora.targets {refused}: the planner does not count these adapters yet (their parameters, gradients,"
            f" moments and saved activations); plan the run with targets among"
            f" {[t for t in config.targets if t not in unplanned] or 'the others'} only, which underestimates it by"
            " those adapters"
        )
    return LowRankAdapters(rank=config.rank, projections=config.targets, dropout=config.dropout > 0,
                           base_quantization=config.base_quantization)
