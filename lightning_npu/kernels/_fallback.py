"""Shared by the kernel modules: which chips the fused ops serve, and announcing (once) when one is skipped."""

from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger("lightning_npu.kernels")

# npu_fusion_attention, npu_rotary_mul and npu_swiglu are documented for the Atlas A2 (Ascend910B*) and
# A3 (Ascend910_93*) training series only; on Ascend910A-class chips they must not be called.
_A2_A3_NAME_PREFIXES = ("Ascend910B", "Ascend910_93")

_announced: set[str] = set()
_device_name: dict[str, str] = {}


def log_fallback_once(op: str, reason: str) -> None:
    """Log at WARNING that ``op`` ran on the PyTorch reference path instead of its fused NPU kernel.

    A fallback is correct but slower (and uses more memory), so it must never be silent; logging each
    distinct (op, reason) once keeps a training loop from flooding the log.
    """
    key = f"{op}: {reason}"
    if key in _announced:
        return
    _announced.add(key)
    log.warning("%s falls back to the PyTorch reference path on NPU: %s", op, reason)


def chip_unsupported_reason(op: str) -> Optional[str]:
    """Why the current NPU cannot run fused op ``op`` (an A2/A3-only kernel), or None if it can.

    The device name is read once per process; all NPUs of a node are the same chip.
    """
    if "name" not in _device_name:
        import torch_npu

        _device_name["name"] = torch_npu.npu.get_device_name()
    name = _device_name["name"]
    if name.startswith(_A2_A3_NAME_PREFIXES):
        return None
    return f"{op} is documented for Atlas A2/A3 chips (Ascend910B*, Ascend910_93*) only, not {name}"
