"""Teach Lightning's Trainer and Fabric connectors the NPU choices they cannot make themselves.

Lightning 2.6 has no hook for third-party accelerators beyond its registries, and its connectors assume
CUDA in three places that matter here. Each is wrapped so it behaves as before for every other accelerator:

- ``_choose_strategy``: with ``accelerator="npu"`` and no strategy, pick ``npu_single`` (Lightning would put a
  one-device run on the CPU) or ``npu_ddp`` (Lightning's ``ddp`` enters a CUDA stream).
- ``_check_strategy_and_fallback``: reject Lightning's own strategies with the NPU accelerator, naming the NPU one to use;
  reject precision settings NPUs cannot run before any worker starts.
- ``_check_and_init_precision``: build autocast for the runtime's device type (Lightning builds CUDA autocast
  for unknown accelerators, which does nothing on an NPU, and drops fp16 loss scaling), with the sharded
  loss scaler under npu_fsdp.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable

import torch

from lightning_npu.accelerator import NPUAccelerator
from lightning_npu.precision import build_precision, check_precision, needs_rebuild, precision_name
from lightning_npu.runtime import get_runtime
from lightning_npu.runtime.base import torch_grad_scaler
from lightning_npu.strategies import NPU_STRATEGY_TYPES, SHARDED_STRATEGY_TYPES, STRATEGIES

_PATCHED = "_lightning_npu_patched"


def is_npu(accelerator: Any) -> bool:
    return accelerator == "npu" or isinstance(accelerator, NPUAccelerator)


def choose_strategy(connector: Any) -> str:
    several = connector._num_nodes_flag > 1 or len(connector._parallel_devices) > 1
    return "npu_ddp" if several else "npu_single"


def validate(connector: Any, precision: str) -> None:
    if not is_npu(connector._accelerator_flag):
        return
    flag = connector._strategy_flag
    if not (flag in STRATEGIES if isinstance(flag, str) else isinstance(flag, NPU_STRATEGY_TYPES)):
        shown = flag if isinstance(flag, str) else type(flag).__name__
        raise ValueError(
            f"strategy={shown!r} cannot run on accelerator='npu': Lightning's own strategies assume CUDA"
            " (streams, NCCL, FSDP1 APIs NPUs lack). Use strategy='npu_single', 'npu_ddp' or 'npu_fsdp'"
            " (or leave strategy='auto')."
        )
    if not precision.startswith("bf16"):
        check_precision(precision)
        return
    # Reading the chip initialises the device (torch.npu.is_bf16_supported), so only a bf16 run asks.
    chip = get_runtime().chip()
    check_precision(precision, chip.name, chip.supports_bf16)


def device_type(connector: Any) -> str:
    if isinstance(connector.accelerator, NPUAccelerator):
        return connector.accelerator.runtime.device_type
    return torch.device(connector._parallel_devices[0]).type if connector._parallel_devices else "cpu"


def npu_precision(connector: Any, precision: str, explicit: Any, plugins_namespace: ModuleType) -> Any:
    """The precision plugin for a run on an NPU accelerator or with an NPU strategy."""
    kind = device_type(connector)
    if explicit is not None and not needs_rebuild(explicit, kind):
        return explicit
    name = precision_name(explicit) if explicit is not None else precision
    sharded = isinstance(connector.strategy, SHARDED_STRATEGY_TYPES)
    scaler = None
    if name == "16-mixed":
        npu = is_npu(connector._accelerator_flag)
        scaler = get_runtime().grad_scaler(sharded) if npu else torch_grad_scaler(kind, sharded)
    return build_precision(name, device_type=kind, scaler=scaler, plugins_namespace=plugins_namespace)


def install(connector_cls: type, precision_attr: str, plugin_attr: str, plugins_namespace: ModuleType) -> None:
    """Wrap one connector class (idempotent)."""
    if getattr(connector_cls, _PATCHED, False):
        return

    def wrap(name: str, replacement: Callable[[Any, Callable[[], Any]], Any]) -> None:
        original = getattr(connector_cls, name)

        @functools.wraps(original)
        def wrapped(self: Any) -> Any:
            return replacement(self, functools.partial(original, self))

        setattr(connector_cls, name, wrapped)

    wrap("_choose_strategy", lambda self, original: choose_strategy(self) if is_npu(self._accelerator_flag) else original())

    def check_strategy(self: Any, original: Callable[[], None]) -> None:
        validate(self, getattr(self, precision_attr))
        original()

    wrap("_check_strategy_and_fallback", check_strategy)

    def init_precision(self: Any, original: Callable[[], Any]) -> Any:
        if not (is_npu(self._accelerator_flag) or isinstance(self.strategy, NPU_STRATEGY_TYPES)):
            return original()
        return npu_precision(self, getattr(self, precision_attr), getattr(self, plugin_attr), plugins_namespace)

    wrap("_check_and_init_precision", init_precision)
    setattr(connector_cls, _PATCHED, True)


def install_all() -> None:
    import lightning.fabric.plugins.precision as fabric_precision
    import lightning.pytorch.plugins.precision as trainer_precision
    from lightning.fabric.connector import _Connector
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    install(_AcceleratorConnector, "_precision_flag", "_precision_plugin_flag", trainer_precision)
    install(_Connector, "_precision_input", "_precision_instance", fabric_precision)
