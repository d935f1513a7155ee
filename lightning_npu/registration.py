"""Register the ``"npu"`` accelerator and the NPU strategies with Lightning (Trainer and Fabric), once.

Lightning reads no entry points for accelerators or strategies, so ``import lightning_npu`` calls
``register_with_lightning()``: it registers at once when Lightning is already imported, and otherwise right
after Lightning's import (a post-import hook, ``_after_import``), so that importing the package costs no torch.
Registering touches no device. This module imports Lightning only inside ``register()``.
"""

from __future__ import annotations

from lightning_npu._after_import import call_after_import

ACCELERATOR_DESCRIPTION = "Huawei Ascend NPU (lightning-npu)"
#: Importing this module means Lightning (Trainer and Fabric: ``lightning/__init__`` imports both) is loaded.
LIGHTNING_MODULE = "lightning.pytorch"


def register_with_lightning() -> None:
    """``register()`` now if Lightning is imported, else as soon as it is (and no lightning_npu module is
    half-executed)."""
    call_after_import(LIGHTNING_MODULE, register, package=__name__.split(".")[0])


def register() -> None:
    """Add everything to the four registries and install the patches of Lightning's own code
    (``lightning_patches``: connectors, OOM handling, signal handlers, checkpoint loading); calling it again changes
    nothing."""
    from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_npu import lightning_patches
    from lightning_npu.accelerator import NPUAccelerator
    from lightning_npu.strategies import STRATEGIES

    for registry in (AcceleratorRegistry, ACCELERATOR_REGISTRY):
        if "npu" not in registry:
            registry.register("npu", NPUAccelerator, description=ACCELERATOR_DESCRIPTION)
    for name, (trainer_cls, fabric_cls) in STRATEGIES.items():
        for registry, cls in ((StrategyRegistry, trainer_cls), (STRATEGY_REGISTRY, fabric_cls)):
            if name not in registry:
                registry.register(name, cls, description=f"{cls.__doc__.splitlines()[0]} (lightning-npu)")
    lightning_patches.install()
