"""Shared by the kernel modules: which chips the fused ops serve, and announcing (once) when one is skipped."""

from __future__ import annotations

import logging
from typing import Optional

from lightning_npu.facts.chips import runs_a2_a3_kernels

log = logging.getLogger("lightning_npu.kernels")

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

    npu_fusion_attention, npu_rotary_mul and npu_swiglu are documented for the Atlas A2 and A3 training series
    only. The chip is matched by its exact name (facts/chips.py): "Ascend910B" itself is a first-generation
    part, and a chip torch_npu added later (Ascend950, Ascend310P*) is not assumed to run them. The device name
    is read once per process; all NPUs of a node are the same chip.
    """
    if "name" not in _device_name:
        import torch_npu

        _device_name["name"] = torch_npu.npu.get_device_name()
    name = _device_name["name"]
    if runs_a2_a3_kernels(name):
        return None
    return f"{op} is documented for Atlas A2/A3 chips (Ascend910B1..B4, Ascend910_93xx) only, not {name}"
