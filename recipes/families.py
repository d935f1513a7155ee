"""The model families the recipe knows, by name: the one place that names them.

A config chooses its family with ``model.family`` (``DecoderLM``'s argument), which every checkpoint then records
in its hyper-parameters; Hugging Face directories are matched by their ``config.json`` ``model_type``. A new
family is a folder ``recipes/models/<name>/`` whose ``family.py`` defines ``FAMILY`` (a
``recipes.decoder.family.DecoderFamily``), plus one entry here.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

#: Family name -> the module defining its ``FAMILY``, imported when first asked for.
FAMILIES: dict[str, str] = {
    "llama": "recipes.models.llama.family",  # LLaMA-2, LLaMA-3 / 3.1 / 3.2
    "moe": "recipes.models.moe.family",  # Mixtral, Qwen2-MoE, Qwen3-MoE
    "qwen": "recipes.models.qwen.family",  # Qwen2, Qwen2.5, Qwen3 (dense)
    "deepseek": "recipes.models.deepseek.family",  # DeepSeek-V3 / R1, Moonlight, Kimi-K2, DeepSeek-V2 (MLA + MoE)
}
#: The family of configs and checkpoints that name none: all of those written before families existed.
DEFAULT_FAMILY = "llama"


def get(name: str) -> Any:
    """The ``DecoderFamily`` called ``name``; ``ValueError`` listing the known ones for any other name."""
    if name not in FAMILIES:
        raise ValueError(
            f"model.family={name!r} is not a model family of the recipe; the families are {sorted(FAMILIES)}"
            " (recipes/families.py)."
        )
    return importlib.import_module(FAMILIES[name]).FAMILY


def all_families() -> dict[str, Any]:
    """Every registered family, by name."""
    return {name: get(name) for name in FAMILIES}


def name_of_config(config: Any) -> str:
    """The name of the family whose config class is ``config``'s class (exactly: one family's config class may
    extend another's)."""
    for name, family in all_families().items():
        if type(config) is family.config_class:
            return name
    raise TypeError(f"{type(config).__name__} is the config of no registered model family ({sorted(FAMILIES)})")


def of_config(config: Any) -> Any:
    """The ``DecoderFamily`` of a model config."""
    return get(name_of_config(config))


def of_hf_model_type(model_type: Any) -> Optional[Any]:
    """The ``DecoderFamily`` that reads Hugging Face checkpoints of ``model_type``, or None."""
    for family in all_families().values():
        if model_type in family.hf.model_types:
            return family
    return None


def hf_model_types() -> list[str]:
    """Every Hugging Face ``model_type`` some family reads."""
    return sorted(t for family in all_families().values() for t in family.hf.model_types)
