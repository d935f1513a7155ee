"""Peak tensor memory on the CPU, read from the allocator's own reports to the profiler.

PyTorch's CPU allocator reports the size of every storage allocation and free to the profiler when
``profile_memory=True`` (c10's ``ProfiledCPUMemoryReporter``), including those made inside C++ (autograd, SDPA,
collectives, the optimizer). Summing them in time order gives the live tensor bytes at every instant since the
profiler started, so the maximum is the peak. Only allocations on threads the profiler follows are seen (the
calling thread, autograd's CPU backward); frees of storages allocated before profiling started are ignored.
"""

from __future__ import annotations

from typing import Any, Callable


def memory_curve(prof: Any) -> tuple[list[int], list[int]]:
    """(timestamps ns, live bytes after each CPU allocation event) of a finished profile, in time order."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    times, live, total = [], [], 0
    for event in events:
        if str(event.device_type()).endswith("CPU"):
            total += event.nbytes()
            times.append(event.start_ns())
            live.append(total)
    return times, live


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes of tensor storage ``fn()`` holds at once (above what was live before it ran)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    _, live = memory_curve(prof)
    return max([0, *live])


def calibration() -> dict[str, int]:
    """Known allocations under the profiler: the measured peak must equal their sum exactly."""
    import torch

    def allocate() -> None:
        a = torch.empty(1 << 20, dtype=torch.float32)  # 4 MiB
        b = torch.empty(1 << 21, dtype=torch.bfloat16)  # 4 MiB: a + b = 8 MiB is the peak
        del a
        c = torch.empty(3 << 20, dtype=torch.uint8)  # 3 MiB
        del b, c

    return {"expected_peak": 8 << 20, "measured_peak": peak_bytes(allocate)}
