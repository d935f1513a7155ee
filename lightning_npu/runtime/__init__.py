"""Device runtime: the one place (with ``kernels``) that touches torch_npu.

``get_runtime()`` returns the simulated runtime when ``LIGHTNING_NPU_SIMULATE`` asks for it, the real NPU
runtime when the probe finds usable NPUs, and otherwise raises ``NPUUnavailableError`` carrying the reason.

Importing this package imports no torch: its names load their modules on first use. The facts the runtime
reads (chips, device ids, the simulator's variable) live in the torch-free ``lightning_npu.facts``.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import TYPE_CHECKING, Any

from lightning_npu.facts.devices import simulated_count
from lightning_npu.facts.env import SIMULATE_ENV

if TYPE_CHECKING:
    from lightning_npu.runtime.base import Runtime
    from lightning_npu.runtime.probe import ProbeResult

__all__ = [
    "NPUUnavailableError",
    "ProbeResult",
    "Runtime",
    "active_runtime",
    "SIMULATE_ENV",
    "SimulationWarning",
    "get_runtime",
    "is_available",
    "probe_npu",
]

# Names re-exported from the submodules, imported when first asked for (PEP 562).
_LAZY = {
    "Runtime": "base",
    "ProbeResult": "probe",
    "probe_npu": "probe",
    "SimulatedRuntime": "simulated",
    "SimulationWarning": "simulated",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class NPUUnavailableError(RuntimeError):
    """No usable NPU; the message names the cause and the fix."""


@functools.lru_cache(maxsize=1)
def _probe() -> ProbeResult:
    from lightning_npu.runtime.probe import probe_npu

    return probe_npu()


@functools.lru_cache(maxsize=1)
def get_runtime() -> Runtime:
    """The runtime of this process (cached; ``get_runtime.cache_clear()`` re-reads the environment)."""
    from lightning_npu.runtime.simulated import SimulatedRuntime

    count = simulated_count(os.environ.get(SIMULATE_ENV))
    if count:
        return SimulatedRuntime(count)
    result = _probe()
    if not result.available:
        raise NPUUnavailableError(
            f"accelerator='npu' cannot be used: {result.reason}."
            f" (To run the NPU code paths on the CPU instead, set {SIMULATE_ENV}=<number of devices>.)"
        )
    from lightning_npu.runtime.npu import NPURuntime

    return NPURuntime()


def active_runtime() -> Runtime | None:
    """The runtime if this process already created it (``get_runtime()`` succeeded), else None; never probes."""
    return get_runtime() if get_runtime.cache_info().currsize else None


def is_available() -> bool:
    """Whether ``get_runtime()`` would succeed; never raises for a missing NPU."""
    try:
        get_runtime()
    except NPUUnavailableError:
        return False
    return True


def reset() -> None:
    """Forget cached probe and runtime results (after changing the environment, e.g. in tests)."""
    _probe.cache_clear()
    get_runtime.cache_clear()
