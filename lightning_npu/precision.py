"""Precision for NPU runs: which settings exist on Ascend chips, and the plugins that autocast on the
runtime's device type instead of the CUDA autocast Lightning's connectors would build.

Trainer and Fabric have twin precision plugin trees with the same class names; ``plugins_namespace``
picks the tree, and everything else is shared.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Optional

import torch

SUPPORTED = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")
_UNSUPPORTED_REASONS = {
    "64-true": "HCCL cannot reduce float64 tensors",
    "transformer-engine": "transformer-engine fp8 kernels exist only for NVIDIA GPUs; Ascend 910B/910_93 chips have no fp8 units",
    "transformer-engine-float16": "transformer-engine fp8 kernels exist only for NVIDIA GPUs",
}


def check_precision(precision: str, chip_name: Optional[str] = None, supports_bf16: bool = True) -> None:
    """Raise a clear error for precision settings the NPU cannot run."""
    if precision in _UNSUPPORTED_REASONS:
        raise ValueError(
            f"precision={precision!r} is not supported on NPUs: {_UNSUPPORTED_REASONS[precision]}."
            f" Use one of {', '.join(repr(p) for p in SUPPORTED)} (usually 'bf16-mixed')."
        )
    if precision not in SUPPORTED:
        raise ValueError(f"precision={precision!r} is not supported on NPUs; use one of {', '.join(SUPPORTED)}")
    if precision.startswith("bf16") and not supports_bf16:
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
    if precision == "32-true":
        return plugins_namespace.Precision()
    if precision in ("bf16-true", "16-true"):
        return plugins_namespace.HalfPrecision(precision)
    if precision == "bf16-mixed":
        return _unscaled_mixed_precision(plugins_namespace.MixedPrecision)(precision, device=device_type)
    if precision == "16-mixed":
        return plugins_namespace.MixedPrecision(precision, device=device_type, scaler=scaler)
    check_precision(precision)
    raise AssertionError(precision)  # check_precision raised already


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
    """FSDP2's MixedPrecisionPolicy for a precision setting: low-precision params, fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()
