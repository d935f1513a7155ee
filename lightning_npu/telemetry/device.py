"""The training device as ``TokenThroughputMonitor`` sees it: synchronise, peak memory, the chip's peak FLOP/s.

The device calls are the runtime's (``lightning_npu.runtime.Runtime``: ``synchronize``, ``max_memory_allocated``,
``reset_peak_memory_stats``, ``total_memory``, ``chip``). On NPUs, real or simulated, the monitor calls the
plugin's runtime itself. A run on another accelerator has no runtime of ours, so two small stand-ins answer the
same four calls: the CPU (nothing to synchronise; the process's peak RSS) and any other torch device type (CUDA,
XPU, ...) through ``torch.accelerator`` where it has the call, else ``torch.<device type>``.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
from lightning.pytorch import Trainer

from lightning_npu.accelerator import NPUAccelerator
from lightning_npu.runtime import Runtime
from lightning_npu.telemetry.formatting import MemoryReading


class DeviceCalls(Protocol):
    """The calls of ``lightning_npu.runtime.Runtime`` the monitor makes (bytes; ``None`` where a device cannot say)."""

    def synchronize(self, device: Optional[torch.device] = None) -> None: ...

    def max_memory_allocated(self, device: torch.device) -> Optional[int]: ...

    def reset_peak_memory_stats(self, device: torch.device) -> None: ...

    def total_memory(self, device: torch.device) -> Optional[int]: ...


@dataclass(frozen=True)
class TrainingDevice:
    """One training device: its calls, how lines name it (``tokens/s/<label>``), and its peak FLOP/s or why none."""

    calls: DeviceCalls
    device: torch.device
    label: str
    peak_flops: Optional[float]
    no_peak_reason: Optional[str]
    #: Memory is the process's peak RSS (CPU and simulated runs), not device memory of a known capacity.
    process_rss: bool = False

    def synchronize(self) -> None:
        self.calls.synchronize(self.device)

    def reset_peak(self) -> None:
        self.calls.reset_peak_memory_stats(self.device)

    def read_memory(self) -> Optional[MemoryReading]:
        peak = self.calls.max_memory_allocated(self.device)
        if peak is None:
            return None
        total = None if self.process_rss else self.calls.total_memory(self.device)
        return MemoryReading(peak, total, self.process_rss)


def training_device(trainer: Trainer) -> TrainingDevice:
    """The device this rank trains on, looked up once from the Trainer's accelerator."""
    device = trainer.strategy.root_device
    if isinstance(trainer.accelerator, NPUAccelerator):
        return npu_device(trainer.accelerator.runtime, device)
    if device.type == "cpu":
        return cpu_device(device)
    return torch_accelerator_device(device)


def npu_device(runtime: Runtime, device: torch.device) -> TrainingDevice:
    """An NPU of the plugin's runtime; the simulated runtime's "NPUs" are the CPU, with no peak FLOP/s."""
    chip = runtime.chip(device.index or 0)
    if runtime.simulated:
        reason = "the simulated NPU (LIGHTNING_NPU_SIMULATE) runs on the CPU, which has no NPU peak FLOP/s"
    else:
        table = type(chip).__module__.replace(".", "/") + ".py"  # the chip table, wherever it lives
        reason = (
            f"no peak bf16 FLOP/s is known for chip {chip.name!r}"
            + ("" if chip.supports_bf16 else " (it has no bf16 units)")
            + f"; add it to {table} if it is published"
        )
    return TrainingDevice(
        runtime, device, label="npu", peak_flops=chip.peak_bf16_flops,
        no_peak_reason=None if chip.peak_bf16_flops is not None else reason, process_rss=runtime.simulated,
    )


def cpu_device(device: torch.device) -> TrainingDevice:
    """The CPU: work is done when a call returns, memory is the process's peak RSS, no peak FLOP/s is known."""
    return TrainingDevice(
        _HostCalls(), device, label="device", peak_flops=None,
        no_peak_reason="training runs on the CPU, which has no known peak FLOP/s", process_rss=True,
    )


def torch_accelerator_device(device: torch.device) -> TrainingDevice:
    """Any other torch accelerator (no peak FLOP/s is known for it here)."""
    return TrainingDevice(
        _TorchAcceleratorCalls(device.type), device, label="device", peak_flops=None,
        no_peak_reason=f"no peak FLOP/s is known for {device.type!r} devices",
    )


class _HostCalls:
    def synchronize(self, device: Optional[torch.device] = None) -> None:
        pass  # CPU work is done when the call returns

    def max_memory_allocated(self, device: torch.device) -> int:
        # ru_maxrss is in KiB on Linux.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        pass  # a process's peak RSS cannot be reset

    def total_memory(self, device: torch.device) -> None:
        return None


class _TorchAcceleratorCalls:
    """``torch.accelerator``'s function where it has one, else ``torch.<device_type>``'s; a call neither has is a
    no-op (memory: ``None``, unknown)."""

    def __init__(self, device_type: str) -> None:
        owners = (getattr(torch, "accelerator", None), getattr(torch, device_type, None))

        def find(*names: str) -> Optional[Callable[..., Any]]:
            for name in names:
                for owner in owners:
                    function = getattr(owner, name, None)
                    if callable(function):
                        return function
            return None

        self._synchronize = find("synchronize")
        self._reset = find("reset_peak_memory_stats")
        self._max_allocated = find("max_memory_allocated")
        self._memory_info = find("get_memory_info", "mem_get_info")

    def synchronize(self, device: Optional[torch.device] = None) -> None:
        if self._synchronize is not None:
            self._synchronize(device)

    def max_memory_allocated(self, device: torch.device) -> Optional[int]:
        return self._max_allocated(device) if self._max_allocated is not None else None

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        if self._reset is not None:
            self._reset(device)

    def total_memory(self, device: torch.device) -> Optional[int]:
        return self._memory_info(device)[1] if self._memory_info is not None else None
