"""Which path each kernel takes: its torch_npu fused op, or its PyTorch reference, and saying (once) why not fused.

A fused op runs when the input is an NPU tensor, the user has not turned the op off, its dtype is one torch_npu
takes, and the op's own limits, torch_npu release and chip allow it. ``LIGHTNING_NPU_DISABLE_FUSED`` turns ops off
by name (``LIGHTNING_NPU_DISABLE_FUSED=rms_norm,rotary``; names in ``FUSED_OPS``, or ``all``): the escape hatch for
a user whose ``lightning-npu selftest`` fails on one kernel, who can still train on the reference path.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_npu.facts.chips import runs_a2_a3_kernels
from lightning_npu.facts.env import DISABLE_FUSED_ENV
from lightning_npu.runtime.probe import release

log = logging.getLogger("lightning_npu.kernels")

DISABLE_ALL = "all"
#: The dtypes every torch_npu fused op the kernels call accepts.
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class FusedOp:
    """One kernel: its switch name (in DISABLE_FUSED_ENV), its lightning_npu.kernels function, its torch_npu op(s)."""

    name: str
    function: str
    npu_op: str

    @property
    def switch(self) -> str:
        """The setting that makes this kernel run its PyTorch reference path instead."""
        return f"{DISABLE_FUSED_ENV}={self.name}"


FUSED_OPS = {
    op.name: op
    for op in (
        FusedOp("attention", "causal_attention", "npu_fusion_attention"),
        FusedOp("rms_norm", "rms_norm", "npu_rms_norm"),
        FusedOp("rotary", "apply_rotary", "npu_rotary_mul"),
        FusedOp("swiglu", "swiglu", "npu_swiglu"),
        FusedOp("grouped_matmul", "grouped_matmul", "npu_grouped_matmul"),
        # One switch for the pair: permute_tokens decides the path, unpermute_tokens follows it.
        FusedOp("token_permute", "permute_tokens", "npu_moe_token_permute/npu_moe_token_unpermute"),
        FusedOp("weight_quant_matmul", "quantized_linear", "npu_weight_quant_batchmatmul"),
    )
}

_announced: set[str] = set()
_device_name: dict[str, str] = {}


def _on_npu(x: Tensor) -> bool:
    return x.device.type == "npu"


def note_fallback(op: str, x: Tensor, reason: str) -> None:
    """Kernel ``op`` runs its reference path on ``x`` for ``reason``: log it once if ``x`` is an NPU tensor."""
    if _on_npu(x):
        log_fallback_once(FUSED_OPS[op].function, reason)


def unavailable_reason(op: str, x: Tensor, limits: Callable[[], Optional[str]]) -> Optional[str]:
    """Why kernel ``op`` would not run its fused op on ``x``, None when it would.

    ``limits`` returns why the op's documented limits or chip rule out these inputs (None if they do not); it is
    asked only about NPU tensors of a supported dtype that the user has not turned the op off for. The switch is
    read (and checked) on every call, whatever the device, so a misspelt name fails at once, on the CPU too.
    """
    disabled = disabled_ops(os.environ.get(DISABLE_FUSED_ENV, ""))
    if not _on_npu(x):
        return f"{x.device.type} tensors run the PyTorch reference path (the fused op needs an NPU tensor)"
    if op in disabled:
        return f"turned off by {DISABLE_FUSED_ENV}={os.environ[DISABLE_FUSED_ENV]}"
    if x.dtype not in FUSED_DTYPES:
        return f"dtype {x.dtype} is not one of fp16/bf16/fp32"
    return limits()


@functools.lru_cache(maxsize=8)
def disabled_ops(value: str) -> frozenset[str]:
    """The FUSED_OPS names a DISABLE_FUSED_ENV value turns off; a name that is not one raises ValueError."""
    names = {name.strip() for name in value.split(",") if name.strip()}
    if DISABLE_ALL in names:
        return frozenset(FUSED_OPS)
    unknown = sorted(names - set(FUSED_OPS))
    if unknown:
        raise ValueError(
            f"{DISABLE_FUSED_ENV}={value!r} names {', '.join(map(repr, unknown))}, which is not a fused kernel;"
            f" use comma-separated names from {', '.join(FUSED_OPS)} (or {DISABLE_ALL!r}), e.g."
            f" {DISABLE_FUSED_ENV}=rms_norm,rotary"
        )
    return frozenset(names)


def log_fallback_once(function: str, reason: str) -> None:
    """Log at WARNING that ``function`` ran on the PyTorch reference path instead of its fused NPU kernel.

    A fallback is correct but slower (and uses more memory), so it must never be silent; logging each
    distinct (function, reason) once keeps a training loop from flooding the log.
    """
    key = f"{function}: {reason}"
    if key in _announced:
        return
    _announced.add(key)
    log.warning("%s falls back to the PyTorch reference path on NPU: %s", function, reason)


def release_unsupported_reason(npu_op: str, minimum: tuple[int, int], why: str) -> Optional[str]:
    """Why the installed torch_npu is too old for fused op ``npu_op`` (``why``: what older releases lack), or None."""
    import torch_npu

    if release(torch_npu.__version__) >= minimum:
        return None
    wanted = ".".join(map(str, minimum))
    return f"{npu_op} needs torch_npu >= {wanted} ({why}); this is torch_npu {torch_npu.__version__}"


def chip_unsupported_reason(npu_op: str) -> Optional[str]:
    """Why the current NPU cannot run fused op ``npu_op`` (an A2/A3-only kernel), or None if it can.

    npu_fusion_attention, npu_rotary_mul, npu_swiglu and the MoE ops (npu_grouped_matmul, npu_moe_token_permute /
    unpermute) are documented for the Atlas A2 and A3 series only. The chip is matched by its exact name
    (facts/chips.py): "Ascend910B" itself is a first-generation part, and a chip torch_npu added later (Ascend950,
    Ascend310P*) is not assumed to run them. The device name is read once per process; all NPUs of a node are the
    same chip.
    """
    if "name" not in _device_name:
        import torch_npu

        _device_name["name"] = torch_npu.npu.get_device_name()
    name = _device_name["name"]
    if runs_a2_a3_kernels(name):
        return None
    return f"{npu_op} is documented for Atlas A2/A3 chips (Ascend910B1..B4, Ascend910_93xx) only, not {name}"
