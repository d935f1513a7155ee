"""Precision for NPU runs: the check of a setting against the chip (which settings exist is in
``facts.precisions``), and the plugins that autocast on the runtime's device type instead of the CUDA autocast
Lightning's connectors would build.

Trainer and Fabric have twin precision plugin trees with the same class names; ``plugins_namespace``
picks the tree, and everything else is shared.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Optional

import torch

from lightning_npu.facts.precisions import PRECISION_DTYPES, canonical_precision, uses_bf16


def check_precision(precision: str, chip_name: Optional[str] = None, supports_bf16: bool = True) -> None:
    """Raise a clear error for precision settings the NPU cannot run (``facts.precisions`` says which exist)."""
    if uses_bf16(canonical_precision(precision)) and not supports_bf16:
        raise ValueError(
            f"precision={precision!r} is not supported on {chip_name} (no bf16 units); use precision='16-mixed'"
        )


def precision_name(plugin: Any) -> Optional[str]:
    """The precision string a Lightning precision plugin stands for (None for unknown plugins)."""
    return getattr(plugin, "precision", None)


def build_precision(precision: str, *, device_type: str, scaler: Optional[torch.amp.GradScaler], plugins_namespace: ModuleType) -> Any:
    """The precision plugin for ``precision`` whose autocast runs on ``device_type``.

    ``scaler`` is the loss scaler used for '16-mixed' (the runtime's, sharded under FSDP).
    """
    precision = canonical_precision(precision)  # raises for settings NPUs cannot run
    if precision == "32-true":
        return plugins_namespace.Precision()
    if precision in ("bf16-true", "16-true"):
        return plugins_namespace.HalfPrecision(precision)
    if precision == "bf16-mixed":
        return _unscaled_mixed_precision(plugins_namespace.MixedPrecision)(precision, device=device_type)
    assert precision == "16-mixed", precision  # every name canonical_precision returns is handled above
    return plugins_namespace.MixedPrecision(precision, device=device_type, scaler=scaler)


@functools.lru_cache(maxsize=None)
def _unscaled_mixed_precision(base: type) -> type:
    """``base`` (Lightning's MixedPrecision) for bf16, where no loss scaler exists: gradient clipping is allowed
    with optimizers that unscale inside ``step()``.

    Lightning's Trainer plugin refuses to clip for any optimizer with ``_step_supports_amp_scaling`` (fused
    AdamW), even when there is no scaler and so nothing to unscale; the NPU runtime prefers fused AdamW
    (``Runtime.fused_optimizer``) and the recipes clip, so bf16-mixed skips that check. Fabric's plugin has no
    such check (it refuses only with a scaler), and fp16 keeps it: there the gradients must be unscaled first.
    """
    if not hasattr(base, "clip_gradients"):
        return base

    class UnscaledMixedPrecision(base):
        def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
            if self.scaler is not None:
                return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
            parent = super(base, self)  # the plain Precision plugin's clipping, without the fused-optimizer check
            if gradient_clip_algorithm is None:
                return parent.clip_gradients(optimizer, clip_val)
            return parent.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    # Shown (logs, summaries) under Lightning's name: it is that plugin, with one check relaxed.
    UnscaledMixedPrecision.__qualname__ = UnscaledMixedPrecision.__name__ = base.__name__
    return UnscaledMixedPrecision


def needs_rebuild(plugin: Any, device_type: str) -> bool:
    """A mixed-precision plugin built for another device (Lightning builds CUDA autocast for unknown accelerators)."""
    return precision_name(plugin) in ("bf16-mixed", "16-mixed") and getattr(plugin, "device", device_type) != device_type


def mixed_precision_policy(precision: Optional[str]) -> Any:
    """FSDP2's MixedPrecisionPolicy for a precision setting: for the mixed ones, params gathered in the compute
    dtype and gradients reduced in fp32; none for the others (parameters are stored as they compute)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtypes = PRECISION_DTYPES.get(precision)  # None for a plugin the NPU code did not build (a user's instance)
    if dtypes is None or not dtypes.mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=getattr(torch, dtypes.compute), reduce_dtype=getattr(torch, dtypes.reduce))
