"""A stand-in for N NPUs on the CPU, so the plugin's own code paths (strategies, sharding, checkpoints,
precision) run for real on machines without Ascend hardware. Enabled only by LIGHTNING_NPU_SIMULATE."""

from __future__ import annotations

import os
import resource
import warnings
from typing import Any

import torch

from lightning_npu.facts.chips import ChipFacts
from lightning_npu.facts.devices import simulated_count
from lightning_npu.facts.env import SIMULATE_ENV
from lightning_npu.runtime.base import Runtime, torch_grad_scaler

# simulated_count is re-exported for the doctor's probe, which imports it from here.
__all__ = ["SIMULATED_NAME", "SIMULATE_ENV", "SimulatedRuntime", "SimulationWarning", "simulated_count"]

SIMULATED_NAME = "SimulatedNPU(cpu)"


class SimulationWarning(UserWarning):
    """Emitted once per process when the simulated runtime stands in for real NPUs."""


class SimulatedRuntime(Runtime):
    """``count`` NPUs that are all this process's CPU; collectives go over gloo."""

    device_type = "cpu"
    backend = "gloo"
    simulated = True
    fused_optimizer = False

    def __init__(self, count: int) -> None:
        self.count = count
        self._warned_cpu_profile = False
        warnings.warn(
            f"{SIMULATE_ENV}={count}: accelerator='npu' runs on the CPU with gloo, simulating {count} NPU(s)."
            " Nothing runs on an NPU; unset it to use real devices.",
            SimulationWarning,
            stacklevel=2,
        )

    def device_count(self) -> int:
        return self.count

    def device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device: torch.device) -> None:
        pass

    def synchronize(self, device: torch.device | None = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def set_memory_fraction(self, fraction: float, device: torch.device) -> None:
        pass

    def memory_stats(self, device: torch.device) -> dict[str, Any]:
        return {"rss_bytes": _rss_bytes(), "peak_rss_bytes": self.max_memory_allocated(device)}

    def max_memory_allocated(self, device: torch.device) -> int:
        # ru_maxrss is in KiB on Linux, and the kernel updates it lazily: it can lag the current RSS.
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, _rss_bytes())

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        pass  # the process's peak RSS cannot be reset

    def total_memory(self, device: torch.device) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def device_name(self, index: int = 0) -> str:
        return SIMULATED_NAME

    def chip(self, index: int = 0) -> ChipFacts:
        return ChipFacts(name=SIMULATED_NAME, supports_bf16=True, peak_bf16_flops=None)

    def grad_scaler(self, sharded: bool) -> torch.amp.GradScaler:
        return torch_grad_scaler(self.device_type, sharded)

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu")  # the "device" is host memory already

    def profiler(self, trace_dir: str, *, wait: int, warmup: int, active: int, repeat: int, record_shapes: bool,
                 profile_memory: bool, with_stack: bool) -> Any:
        if not self._warned_cpu_profile:
            self._warned_cpu_profile = True
            warnings.warn(
                f"{SIMULATE_ENV} is set: the NPU profiler records with torch.profiler, profiling the CPU only"
                " (no NPU activity exists to record).",
                SimulationWarning,
                stacklevel=2,
            )
        return torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir),
            record_shapes=record_shapes,
            profile_memory=profile_memory,
            with_stack=with_stack,
        )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
