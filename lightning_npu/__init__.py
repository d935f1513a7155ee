"""Lightning on Huawei Ascend NPUs.

``import lightning_npu`` registers ``accelerator="npu"`` and the strategies ``"npu_single"``, ``"npu_ddp"``
and ``"npu_fsdp"`` with Lightning's Trainer and Fabric. Importing touches no device and never fails on a
machine without NPUs; asking for ``accelerator="npu"`` there raises an error that names the cause.
"""

from lightning_npu.accelerator import NPUAccelerator
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

__version__ = "0.1.0"

register()

__all__ = [
    "NPUAccelerator",
    "NPUDDPStrategy",
    "NPUFSDPStrategy",
    "NPUFabricDDPStrategy",
    "NPUFabricFSDPStrategy",
    "NPUFabricSingleStrategy",
    "NPUSingleStrategy",
    "NPUUnavailableError",
    "get_runtime",
    "register",
]
