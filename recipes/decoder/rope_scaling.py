"""Rotary scaling as a config holds it: LLaMA-3.1's "llama3" rule, which the LLaMA-3 and Qwen families' configs
take as ``rope_scaling`` (the tables it gives: ``rotary.py``). Torch-free: the planner reads the configs that use it.
Shared here (``recipes/decoder/``, beside the trunk) rather than in the LLaMA folder: a family folder imports no
other family's (``tests/test_import_graph.py``)."""

from __future__ import annotations

from typing import Any, Mapping

#: The rotary scaling rule the recipe implements: LLaMA-3.1's "llama3" (a config's ``rope_scaling``).
ROPE_SCALING_TYPE = "llama3"
#: Its parameters (Hugging Face's names) and the type each is stored as.
ROPE_SCALING_KEYS = {
    "factor": float,
    "low_freq_factor": float,
    "high_freq_factor": float,
    "original_max_position_embeddings": int,
}


def normalise_rope_scaling(scaling: Any, where: str = "rope_scaling") -> dict[str, Any]:
    """``rope_scaling`` checked and stored as ``{"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}`` (floats, and an int for the length), so configs read from a YAML file, a
    checkpoint or an HF ``config.json`` compare equal. Raises ``ValueError`` naming the bad entry (``where``: the field, e.g.
    ``LLaMAConfig.rope_scaling``) and the fix."""
    if not isinstance(scaling, Mapping):
        raise ValueError(
            f"{where}={scaling!r} is invalid: give a mapping of {sorted(ROPE_SCALING_KEYS)} (LLaMA-3.1's rule), "
            "or null for plain rotary embeddings."
        )
    values = dict(scaling)
    rope_type = values.pop("rope_type", ROPE_SCALING_TYPE)
    if rope_type != ROPE_SCALING_TYPE:
        raise ValueError(
            f"{where}.rope_type={rope_type!r} is not implemented: the recipe implements {ROPE_SCALING_TYPE!r} "
            "(LLaMA-3.1/3.2) scaling only. Drop rope_scaling for plain rotary embeddings."
        )
    unknown = sorted(set(values) - set(ROPE_SCALING_KEYS))
    missing = sorted(set(ROPE_SCALING_KEYS) - set(values))
    if unknown or missing:
        raise ValueError(
            f"{where} has unknown key(s) {unknown} and lacks {missing}; {ROPE_SCALING_TYPE!r} scaling takes exactly "
            f"{sorted(ROPE_SCALING_KEYS)} (e.g. LLaMA-3.1: factor 8, low_freq_factor 1, high_freq_factor 4, "
            "original_max_position_embeddings 8192)."
        )
    out: dict[str, Any] = {"rope_type": ROPE_SCALING_TYPE}
    for key, kind in ROPE_SCALING_KEYS.items():
        value = values[key]
        integral = kind is int and isinstance(value, int)
        if isinstance(value, bool) or not (integral or (kind is float and isinstance(value, (int, float)))) or value <= 0:
            what = "a positive integer" if kind is int else "a positive number"
            raise ValueError(f"{where}.{key}={value!r} is invalid: it must be {what}.")
        out[key] = kind(value)
    if out["factor"] < 1:
        raise ValueError(
            f"{where}.factor={out['factor']!r} is invalid: the factor divides the low frequencies, stretching their "
            "wavelengths, so it must be >= 1 (LLaMA-3.1 uses 8, LLaMA-3.2 32)."
        )
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(
            f"{where}: high_freq_factor={out['high_freq_factor']!r} must exceed low_freq_factor="
            f"{out['low_freq_factor']!r}; the band between them is blended with weight 1 / (high - low)."
        )
    return out
