"""The real runtime: every ``torch.npu`` call the plugin makes lives here."""

from __future__ import annotations

from typing import Any

import torch

from lightning_npu.facts.chips import ChipFacts, chip_facts
from lightning_npu.runtime.base import Runtime


class NPURuntime(Runtime):
    """Ascend NPUs through torch_npu (imported by the probe before this class is used)."""

    device_type = "npu"
    backend = "hccl"
    simulated = False
    fused_optimizer = True

    def device_count(self) -> int:
        return torch.npu.device_count()

    def device(self, index: int) -> torch.device:
        return torch.device("npu", index)

    def set_device(self, device: torch.device) -> None:
        torch.npu.set_device(device)

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.npu.synchronize(device)

    def empty_cache(self) -> None:
        torch.npu.empty_cache()

    def set_memory_fraction(self, fraction: float, device: torch.device) -> None:
        # torch_npu raises TypeError for anything but a float, so an int from YAML (e.g. 1) is converted here.
        torch.npu.set_per_process_memory_fraction(float(fraction), device)

    def memory_stats(self, device: torch.device) -> dict[str, Any]:
        return dict(torch.npu.memory_stats(device))

    def max_memory_allocated(self, device: torch.device) -> int:
        return torch.npu.max_memory_allocated(device)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        torch.npu.reset_peak_memory_stats(device)

    def total_memory(self, device: torch.device) -> int:
        return torch.npu.mem_get_info(device)[1]

    def device_name(self, index: int = 0) -> str:
        return torch.npu.get_device_name(index)

    def chip(self, index: int = 0) -> ChipFacts:
        # bf16 comes from the runtime, which knows every SocVersion (Ascend910B exactly, SocVersion 104, has none).
        return chip_facts(self.device_name(index), torch.npu.is_bf16_supported())

    def grad_scaler(self, sharded: bool) -> torch.amp.GradScaler:
        if sharded:
            # torch_npu assigns its own scaler to FSDP's ShardedGradScaler name on import. Its default device is the
            # NPU, and 2.6.0's takes no `device` argument at all, so it is built with none (and looked up now,
            # after the swap, not bound at import).
            from torch.distributed.fsdp import sharded_grad_scaler

            return sharded_grad_scaler.ShardedGradScaler()
        return torch.npu.amp.GradScaler()

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        # Pinned (page-locked) memory, which the device fills by DMA while the host goes on (a non_blocking copy
        # into pageable memory is synchronous). torch_npu implements torch's pinned-memory allocator hook and
        # allocates its own device-to-host buffers exactly so (torch_npu/utils/serialization.py).
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)

    def profiler(self, trace_dir: str, *, wait: int, warmup: int, active: int, repeat: int, record_shapes: bool,
                 profile_memory: bool, with_stack: bool) -> Any:
        # torch.profiler cannot see NPU kernels; torch_npu's profiler records CANN activity and writes traces
        # that MindStudio Insight and TensorBoard open.
        import torch_npu.profiler

        return torch_npu.profiler.profile(
            activities=[torch_npu.profiler.ProfilerActivity.CPU, torch_npu.profiler.ProfilerActivity.NPU],
            schedule=torch_npu.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
            on_trace_ready=torch_npu.profiler.tensorboard_trace_handler(trace_dir),
            record_shapes=record_shapes,
            profile_memory=profile_memory,
            with_stack=with_stack,
        )
