"""Lightning on Huawei Ascend NPUs.

``import lightning_npu`` registers ``accelerator="npu"`` and the strategies ``"npu_single"``, ``"npu_ddp"``
and ``"npu_fsdp"`` with Lightning's Trainer and Fabric. Importing touches no device and never fails on a
machine without NPUs; asking for ``accelerator="npu"`` there raises an error that names the cause.

Importing it imports neither torch nor Lightning: the names below load their modules on first use (PEP 562), and
registration happens at once when Lightning is already imported, otherwise right after Lightning's import
(``registration.register_with_lightning``). So the ``lightning-npu`` command starts fast, and ``lightning-npu
doctor`` runs even where ``import torch`` fails or kills the process (it probes torch in a child process).

If ``import lightning.pytorch`` (and so ``import torch``) fails -- typically torch_npu installed without CANN,
which torch >= 2.5 loads on import -- using any of the names below raises ImportError naming the failure.
"""

from __future__ import annotations

import importlib
import os as _os
import sys as _sys
from typing import Any

from lightning_npu.facts.env import AUTOLOAD_ENV as _AUTOLOAD_ENV
from lightning_npu.registration import register_with_lightning as _register_with_lightning

__version__ = "0.1.0"

#: Each public name -> the module that defines it (imported on first use, after Lightning).
_HOMES = {
    "FabricNonFiniteLossGuard": "lightning_npu.guards",
    "FabricPreemption": "lightning_npu.preemption",
    "GracefulPreemption": "lightning_npu.preemption",
    "NPUAccelerator": "lightning_npu.accelerator",
    "NPUDDPStrategy": "lightning_npu.strategies",
    "NPUFSDPStrategy": "lightning_npu.strategies",
    "NPUFabricDDPStrategy": "lightning_npu.strategies",
    "NPUFabricFSDPStrategy": "lightning_npu.strategies",
    "NPUFabricSingleStrategy": "lightning_npu.strategies",
    "NPUProfiler": "lightning_npu.profiler",
    "NPUSingleStrategy": "lightning_npu.strategies",
    "NPUUnavailableError": "lightning_npu.runtime",
    "NonFiniteLossError": "lightning_npu.guards",
    "NonFiniteLossGuard": "lightning_npu.guards",
    "Preempted": "lightning_npu.preemption",
    "TokenThroughputMonitor": "lightning_npu.telemetry",
    "get_runtime": "lightning_npu.runtime",
    "register": "lightning_npu.registration",
}
__all__ = sorted(_HOMES)

#: Why ``import lightning.pytorch`` failed, once it has: a second attempt after a half-done torch import is not
#: reliable, so every later use reports the first failure.
_lightning_error: BaseException | None = None


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'lightning_npu' has no attribute {name!r}")
    _import_lightning(name)
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _import_lightning(name: str) -> None:
    """Import Lightning (which registers the plugin, see the module docstring), or raise ImportError naming why
    ``lightning_npu.<name>`` cannot be used."""
    global _lightning_error
    if _lightning_error is None and "lightning.pytorch" in _sys.modules:
        return
    if _lightning_error is None:
        autoload_before = _os.environ.get(_AUTOLOAD_ENV)
        try:
            importlib.import_module("lightning.pytorch")  # imports torch, which autoloads torch_npu
            return
        except Exception as error:  # noqa: BLE001 -- kept, and raised for every name used
            _lightning_error = error
            # A failed torch_npu autoload leaves TORCH_DEVICE_BACKEND_AUTOLOAD=0 behind (torch_npu sets it before
            # its own `import torch` and restores it only on success): put back what the user had.
            if autoload_before is None:
                _os.environ.pop(_AUTOLOAD_ENV, None)
            else:
                _os.environ[_AUTOLOAD_ENV] = autoload_before
    error = _lightning_error
    raise ImportError(
        f"lightning_npu.{name} cannot be used: `import lightning.pytorch` failed with"
        f" {type(error).__name__}: {str(error).rstrip('.')}."
        " Run `lightning-npu doctor` for the cause and the fix."
    ) from error


_register_with_lightning()
