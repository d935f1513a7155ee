"""Lightning's Trainer and Fabric connectors, taught the NPU choices they cannot make themselves.

Lightning 2.6 has no hook for third-party accelerators beyond its registries, and its connectors assume
CUDA in three places that matter here, and refuses a precision it does not know before the plugin could say why.
Each is wrapped so it behaves as before for every other accelerator:

- ``_choose_strategy``: with ``accelerator="npu"`` and no strategy, pick ``npu_single`` (Lightning would put a
  one-device run on the CPU) or ``npu_ddp`` (Lightning's ``ddp`` enters a CUDA stream).
- ``_check_strategy_and_fallback``: turn Lightning's ``FSDPStrategy`` / ``"fsdp"`` / ``ModelParallelStrategy`` into
  ``npu_fsdp`` (``strategies/from_lightning.py``), reject its other strategies with the NPU accelerator, naming the
  NPU one to use; reject precision settings NPUs cannot run before any worker starts.
- ``_check_and_init_precision``: build autocast for the runtime's device type (Lightning builds CUDA autocast
  for unknown accelerators, which does nothing on an NPU, and drops fp16 loss scaling), with the sharded
  loss scaler under npu_fsdp.
- ``_check_config_and_set_final_flags``: ``precision="int8"`` (any ``int8...``) with ``accelerator="npu"`` fails
  with why int8 compute cannot train on NPUs and what saves memory instead (Lightning's own error only lists names);
  ``accelerator="gpu"`` / ``"cuda"`` on a machine with NPUs and no CUDA fails naming the NPUs and the fix.
- ``_choose_auto_accelerator``: ``accelerator="auto"`` picks ``"npu"`` where Lightning found nothing but the CPU
  and the runtime sees NPUs (Lightning never picks a third-party accelerator); TPU, MPS and CUDA machines keep
  Lightning's choice and are never probed for NPUs.
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any, Callable

import torch
from lightning.fabric.accelerators import CUDAAccelerator, MPSAccelerator
from lightning.pytorch.utilities import rank_zero_info

from lightning_npu import compat
from lightning_npu.accelerator import NPUAccelerator
from lightning_npu.facts.precisions import canonical_precision, is_int8_compute
from lightning_npu.precision import build_precision, check_precision, needs_rebuild, precision_name
from lightning_npu.facts.env import SIMULATE_ENV
from lightning_npu.runtime import get_runtime, is_available
from lightning_npu.runtime.base import torch_grad_scaler
from lightning_npu.strategies import NPU_STRATEGY_TYPES, SHARDED_STRATEGY_TYPES, STRATEGIES
from lightning_npu.strategies.from_lightning import as_npu_fsdp, lightning_strategy_name

_PATCHED = "_lightning_npu_patched"


def is_npu(accelerator: Any) -> bool:
    return accelerator == "npu" or isinstance(accelerator, NPUAccelerator)


def choose_strategy(connector: Any) -> str:
    state = compat.connector_state(connector)
    several = state.num_nodes > 1 or len(state.parallel_devices) > 1
    return "npu_ddp" if several else "npu_single"


def validate(connector: Any) -> None:
    state = compat.connector_state(connector)
    if not is_npu(state.accelerator):
        return
    flag, precision = state.strategy, state.precision
    trainer = isinstance(connector, compat.TrainerConnector)
    if lightning_strategy_name(flag, trainer) is not None:
        flag = as_npu_fsdp(flag, trainer=trainer, num_nodes=state.num_nodes,
                           devices_per_node=len(state.parallel_devices), precision=precision)
        compat.set_connector_strategy(connector, flag)
    if not (flag in STRATEGIES if isinstance(flag, str) else isinstance(flag, NPU_STRATEGY_TYPES)):
        shown = flag if isinstance(flag, str) else type(flag).__name__
        raise ValueError(
            f"strategy={shown!r} cannot run on accelerator='npu': Lightning's own strategies assume CUDA"
            " (streams, NCCL, FSDP1 APIs NPUs lack); only its FSDPStrategy / 'fsdp' / ModelParallelStrategy run"
            " (as npu_fsdp). Use strategy='npu_single', 'npu_ddp' or 'npu_fsdp' (or leave strategy='auto')."
        )
    if not precision.startswith("bf16"):
        check_precision(precision)
        return
    # Reading the chip initialises the device (torch.npu.is_bf16_supported), so only a bf16 run asks.
    chip = get_runtime().chip()
    check_precision(precision, chip.name, chip.supports_bf16)


def choose_auto_accelerator(lightning_choice: str) -> str:
    """``accelerator="auto"``: the NPUs where Lightning's own choice is the CPU and the runtime sees NPUs, else
    Lightning's choice. Lightning looks for TPUs, MPS and CUDA first, so those machines are never probed; the
    probe itself initialises no device (``lightning_npu.runtime.probe``)."""
    if not auto_finds_npus(lightning_choice):
        return lightning_choice
    rank_zero_info(f"accelerator='auto' chose 'npu': {_npus_seen()}. Pass accelerator='cpu' to train on the CPU.")
    return "npu"


def auto_finds_npus(lightning_choice: str) -> bool:
    """Whether ``accelerator="auto"`` means the NPUs, given what Lightning itself would choose."""
    return lightning_choice == "cpu" and is_available()


def refuse_cuda_without_cuda(accelerator: Any) -> None:
    """``accelerator="gpu"`` / ``"cuda"`` on a machine with NPUs and no CUDA (nor, for ``"gpu"``, MPS): a
    ValueError naming the NPUs and the fix. Elsewhere Lightning's own checks run unchanged."""
    if accelerator not in ("gpu", "cuda") or CUDAAccelerator.is_available():
        return
    if accelerator == "gpu" and MPSAccelerator.is_available():
        return
    if not is_available():
        return
    raise ValueError(
        f"accelerator={accelerator!r} asks for CUDA GPUs, but this machine has none; {_npus_seen()}."
        " Use accelerator='npu', or leave accelerator='auto', which picks the NPUs."
    )


def _npus_seen() -> str:
    runtime = get_runtime()
    simulated = f" (simulated on the CPU: {SIMULATE_ENV}={runtime.device_count()})" if runtime.simulated else ""
    return f"the runtime sees {runtime.device_count()} Ascend NPU(s){simulated}"


def device_type(connector: Any) -> str:
    if isinstance(connector.accelerator, NPUAccelerator):
        return connector.accelerator.runtime.device_type
    devices = compat.connector_state(connector).parallel_devices
    return torch.device(devices[0]).type if devices else "cpu"


def npu_precision(connector: Any, plugins_namespace: ModuleType) -> Any:
    """The precision plugin for a run on an NPU accelerator or with an NPU strategy."""
    state = compat.connector_state(connector)
    explicit = state.precision_plugin
    kind = device_type(connector)
    if explicit is not None and not needs_rebuild(explicit, kind):
        return explicit
    name = precision_name(explicit) if explicit is not None else state.precision
    sharded = isinstance(connector.strategy, SHARDED_STRATEGY_TYPES)
    scaler = None
    if name == "16-mixed":
        npu = is_npu(state.accelerator)
        scaler = get_runtime().grad_scaler(sharded) if npu else torch_grad_scaler(kind, sharded)
    return build_precision(name, device_type=kind, scaler=scaler, plugins_namespace=plugins_namespace)


def install(connector_cls: type, plugins_namespace: ModuleType) -> None:
    """Wrap one connector class (idempotent)."""
    if getattr(connector_cls, _PATCHED, False):
        return

    def wrap(name: str, replacement: Callable[[Any, Callable[[], Any]], Any]) -> None:
        original = getattr(connector_cls, name)

        @functools.wraps(original)
        def wrapped(self: Any) -> Any:
            return replacement(self, functools.partial(original, self))

        setattr(connector_cls, name, wrapped)

    def choose(self: Any, original: Callable[[], Any]) -> Any:
        return choose_strategy(self) if is_npu(compat.connector_state(self).accelerator) else original()

    wrap(compat.CHOOSE_STRATEGY, choose)

    def check_strategy(self: Any, original: Callable[[], None]) -> None:
        validate(self)
        original()

    wrap(compat.CHECK_STRATEGY_AND_FALLBACK, check_strategy)

    def init_precision(self: Any, original: Callable[[], Any]) -> Any:
        if not (is_npu(compat.connector_state(self).accelerator) or isinstance(self.strategy, NPU_STRATEGY_TYPES)):
            return original()
        return npu_precision(self, plugins_namespace)

    wrap(compat.CHECK_AND_INIT_PRECISION, init_precision)

    # Lightning refuses precision="int8" as an unknown name; on an NPU say why int8 cannot train and what to use.
    # Lightning's "no gpu backend" error for accelerator="gpu"/"cuda" does not say that the NPUs are there.
    # It runs before "auto" is resolved, so an "auto" that will pick the NPUs counts as "npu" here.
    check_config = getattr(connector_cls, compat.CHECK_CONFIG)
    signature = inspect.signature(check_config)
    choose_auto = getattr(connector_cls, compat.CHOOSE_AUTO_ACCELERATOR)

    @functools.wraps(check_config)
    def check_arguments(self: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(self, *args, **kwargs).arguments
        accelerator, precision = arguments.get("accelerator"), arguments.get("precision")
        if precision is not None and is_int8_compute(str(precision)) and (
                is_npu(accelerator) or (accelerator == "auto" and auto_finds_npus(choose_auto()))):
            canonical_precision(precision)  # raises, with the reason and the alternatives
        refuse_cuda_without_cuda(accelerator)
        return check_config(self, *args, **kwargs)

    setattr(connector_cls, compat.CHECK_CONFIG, check_arguments)

    # A static method on both connectors: wrapped as one, so ``self._choose_auto_accelerator()`` still works.
    @functools.wraps(choose_auto)
    def auto_with_npus() -> str:
        return choose_auto_accelerator(choose_auto())

    setattr(connector_cls, compat.CHOOSE_AUTO_ACCELERATOR, staticmethod(auto_with_npus))
    setattr(connector_cls, _PATCHED, True)


def install_all() -> None:
    """Wrap the Trainer's and Fabric's connectors (idempotent)."""
    import lightning.fabric.plugins.precision as fabric_precision
    import lightning.pytorch.plugins.precision as trainer_precision

    install(compat.TrainerConnector, trainer_precision)
    install(compat.FabricConnector, fabric_precision)
