"""The device primitives the plugin needs, behind one interface with a real and a simulated implementation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable

import torch

from lightning_npu.facts.chips import ChipFacts


class Runtime(ABC):
    """Device primitives for one kind of device. Memory numbers are in bytes."""

    #: torch device type of the tensors this runtime trains on ("npu", or "cpu" when simulated).
    device_type: str
    #: torch.distributed backend for those devices.
    backend: str
    simulated: bool
    #: Whether optimizers should use torch's fused implementation (``torch.optim.AdamW(fused=True)``): one kernel
    #: per step on NPUs, where torch_npu implements ``_fused_adamw_``; off on the CPU simulation, which keeps
    #: torch's default (foreach) path.
    fused_optimizer: bool

    @abstractmethod
    def device_count(self) -> int:
        """Number of devices this process can see."""

    @abstractmethod
    def device(self, index: int) -> torch.device:
        """The torch device for a visible device index."""

    @abstractmethod
    def set_device(self, device: torch.device) -> None:
        """Make ``device`` the current device of this process."""

    @abstractmethod
    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for all queued work on ``device`` (so timings read after it are real)."""

    @abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused device memory to the driver."""

    @abstractmethod
    def set_memory_fraction(self, fraction: float, device: torch.device) -> None:
        """Cap this process's share of ``device`` memory (0 < fraction <= 1)."""

    @abstractmethod
    def memory_stats(self, device: torch.device) -> dict[str, Any]:
        """Allocator statistics for ``device`` (what DeviceStatsMonitor logs)."""

    @abstractmethod
    def max_memory_allocated(self, device: torch.device) -> int:
        """Peak bytes allocated on ``device`` since the last reset."""

    @abstractmethod
    def reset_peak_memory_stats(self, device: torch.device) -> None:
        """Start a new peak-memory window."""

    @abstractmethod
    def total_memory(self, device: torch.device) -> int:
        """Total bytes of ``device`` memory."""

    @abstractmethod
    def device_name(self, index: int = 0) -> str:
        """Chip name, e.g. ``"Ascend910B2"``."""

    @abstractmethod
    def chip(self, index: int = 0) -> ChipFacts:
        """Series, bf16 support and peak throughput of the chip at ``index``.

        On NPUs this initialises the device (``torch.npu.is_bf16_supported()`` does), so call it only where the
        answer is needed, and not in a process that forks workers afterwards.
        """

    @abstractmethod
    def grad_scaler(self, sharded: bool) -> torch.amp.GradScaler:
        """A dynamic loss scaler for fp16 training; the sharded one under FSDP."""

    @abstractmethod
    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised host tensor with ``like``'s shape and dtype that copies from the device can fill at full
        speed and asynchronously (pinned memory on NPUs). Allocating one is slow: keep it and reuse it."""

    def copy_to_host(self, copies: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy every ``(buffer, source)`` pair's source into its buffer (from :meth:`host_buffer`); the copies are
        complete when this returns. Queued back to back (``non_blocking``), then waited for once."""
        for buffer, source in copies:
            buffer.copy_(source, non_blocking=True)
        self.synchronize()

    @abstractmethod
    def profiler(self, trace_dir: str, *, wait: int, warmup: int, active: int, repeat: int, record_shapes: bool,
                 profile_memory: bool, with_stack: bool) -> Any:
        """An unstarted profiler of host and device activity with ``start()``, ``step()`` (once per batch) and
        ``stop()``: it skips ``wait`` steps, warms up for ``warmup``, records ``active``, ``repeat`` times (0 =
        until stopped), and writes each recorded window as a trace into ``trace_dir``."""


def torch_grad_scaler(device_type: str, sharded: bool) -> torch.amp.GradScaler:
    """PyTorch's own loss scaler for ``device_type``; FSDP's sharded one (which agrees on inf/nan across ranks)."""
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device_type)
    return torch.amp.GradScaler(device_type)
