"""NPU strategies for the Trainer (``NPU*Strategy``) and Fabric (``NPUFabric*Strategy``)."""

from lightning_npu.strategies.ddp import NPUDDPStrategy, NPUFabricDDPStrategy
from lightning_npu.strategies.fsdp import NPUFabricFSDPStrategy, NPUFSDPStrategy
from lightning_npu.strategies.single import NPUFabricSingleStrategy, NPUSingleStrategy

#: Registered name -> (Trainer class, Fabric class).
STRATEGIES = {
    "npu_single": (NPUSingleStrategy, NPUFabricSingleStrategy),
    "npu_ddp": (NPUDDPStrategy, NPUFabricDDPStrategy),
    "npu_fsdp": (NPUFSDPStrategy, NPUFabricFSDPStrategy),
}
NPU_STRATEGY_TYPES = tuple(cls for pair in STRATEGIES.values() for cls in pair)
SHARDED_STRATEGY_TYPES = (NPUFSDPStrategy, NPUFabricFSDPStrategy)

__all__ = [
    "NPUDDPStrategy",
    "NPUFSDPStrategy",
    "NPUFabricDDPStrategy",
    "NPUFabricFSDPStrategy",
    "NPUFabricSingleStrategy",
    "NPUSingleStrategy",
    "NPU_STRATEGY_TYPES",
    "SHARDED_STRATEGY_TYPES",
    "STRATEGIES",
]
