"""Lightning on Huawei Ascend NPUs.

``import lightning_npu`` registers ``accelerator="npu"`` and the strategies ``"npu_single"``, ``"npu_ddp"``
and ``"npu_fsdp"`` with Lightning's Trainer and Fabric. Importing touches no device and never fails on a
machine without NPUs; asking for ``accelerator="npu"`` there raises an error that names the cause.

If ``import lightning.pytorch`` (and so ``import torch``) fails -- typically torch_npu installed without CANN,
which torch >= 2.5 loads on import -- this package still imports, so that ``lightning-npu doctor`` can diagnose
it; using any of the names below then raises ImportError naming the failure.
"""

import os as _os

__version__ = "0.1.0"

__all__ = [
    "GracefulPreemption",
    "NPUAccelerator",
    "NPUDDPStrategy",
    "NPUFSDPStrategy",
    "NPUFabricDDPStrategy",
    "NPUFabricFSDPStrategy",
    "NPUFabricSingleStrategy",
    "NPUProfiler",
    "NPUSingleStrategy",
    "NPUUnavailableError",
    "NonFiniteLossGuard",
    "TokenThroughputMonitor",
    "get_runtime",
    "register",
]

_AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"
_autoload_before = _os.environ.get(_AUTOLOAD_ENV)
try:
    import lightning.pytorch as _lightning_pytorch  # noqa: F401 -- imports torch, which autoloads torch_npu
except Exception as _error:  # noqa: BLE001 -- kept, and raised when the plugin is used (see __getattr__)
    _IMPORT_ERROR = _error
    # A failed torch_npu autoload leaves TORCH_DEVICE_BACKEND_AUTOLOAD=0 behind (torch_npu sets it before its
    # own `import torch` and restores it only on success): put back what the user had.
    if _autoload_before is None:
        _os.environ.pop(_AUTOLOAD_ENV, None)
    else:
        _os.environ[_AUTOLOAD_ENV] = _autoload_before
else:
    _IMPORT_ERROR = None

if _IMPORT_ERROR is None:
    from lightning_npu.accelerator import NPUAccelerator
    from lightning_npu.profiler import NPUProfiler
    from lightning_npu.registration import register
    from lightning_npu.runtime import NPUUnavailableError, get_runtime
    from lightning_npu.strategies import (
        NPUDDPStrategy,
        NPUFabricDDPStrategy,
        NPUFabricFSDPStrategy,
        NPUFabricSingleStrategy,
        NPUFSDPStrategy,
        NPUSingleStrategy,
    )

    from lightning_npu.guards import NonFiniteLossGuard
    from lightning_npu.preemption import GracefulPreemption
    from lightning_npu.telemetry import TokenThroughputMonitor

    register()
else:

    def __getattr__(name: str):
        if name not in __all__:
            raise AttributeError(f"module 'lightning_npu' has no attribute {name!r}")
        raise ImportError(
            f"lightning_npu.{name} cannot be used: `import lightning.pytorch` failed with"
            f" {type(_IMPORT_ERROR).__name__}: {str(_IMPORT_ERROR).rstrip('.')}."
            " Run `lightning-npu doctor` for the cause and the fix."
        ) from _IMPORT_ERROR
