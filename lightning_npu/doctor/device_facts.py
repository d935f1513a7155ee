"""The NPU facts the doctor reports (``probe_devices``), read through lightning_npu's runtime from this process's
torch: in the doctor's process when torch is imported there, otherwise in ``_probe_child.py``'s fresh interpreter.
Both callers import this module; it imports neither."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from lightning_npu.facts.env import SIMULATE_ENV, VISIBLE_DEVICES_ENV

GIB = 1024**3


def probe_devices() -> dict[str, Any]:
    """NPU facts from this process's torch through lightning_npu's runtime (JSON-serialisable); problems are
    ``{"cause": ..., "fix": ...}``. Imports torch."""
    import torch

    from lightning_npu.facts.chips import TFLOPS
    from lightning_npu.facts.devices import simulated_count, visible_devices_problem
    from lightning_npu.facts.problem import SettingError
    from lightning_npu.runtime.probe import probe_npu

    visible = visible_devices_problem(os.environ.get(VISIBLE_DEVICES_ENV))
    facts: dict[str, Any] = {
        "torch_version": torch.__version__,
        "visible_devices_problem": visible and asdict(visible),
        "simulated_devices": 0,
        "simulate_problem": None,
    }
    try:
        facts["simulated_devices"] = simulated_count(os.environ.get(SIMULATE_ENV))
    except SettingError as error:
        facts["simulate_problem"] = asdict(error.problem)
    result = probe_npu()
    facts.update(available=result.available, device_count=result.device_count, cause=result.cause, fix=result.fix)
    if result.available:
        from lightning_npu.runtime.npu import NPURuntime

        runtime = NPURuntime()
        chip = runtime.chip(0)
        facts.update(
            device_names=[runtime.device_name(index) for index in range(result.device_count)],
            supports_bf16=chip.supports_bf16,
            peak_bf16_tflops=None if chip.peak_bf16_flops is None else chip.peak_bf16_flops / TFLOPS,
            memory_gib=runtime.total_memory(runtime.device(0)) / GIB,
            hccl_backend=torch.distributed.is_available()
            and torch.distributed.Backend.default_device_backend_map.get(runtime.device_type) == "hccl",
        )
    return facts
