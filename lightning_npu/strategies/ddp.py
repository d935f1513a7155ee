"""``"npu_ddp"``: data parallel over HCCL (gloo when simulated).

Both strategies own the model wrap (the Trainer's ``_setup_model``, Fabric's ``setup_module``): Lightning's enters
``torch.cuda`` streams whenever it passes ``device_ids`` (2.6: a side stream; its main branch, PR 21746: the default
stream after ``torch.cuda.is_current_stream_capturing()``), which fail on NPU machines.
``tests/test_ddp_cuda_guard.py`` runs both bodies under a guard that fails on any ``torch.cuda`` call.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_npu import compat
from lightning_npu.facts.options import Timeout
from lightning_npu.strategies.common import BackendFromRuntime, as_timedelta, wrap_ddp


def ddp_options(find_unused_parameters: bool, gradient_as_bucket_view: bool, static_graph: bool) -> dict[str, Any]:
    return {
        "find_unused_parameters": find_unused_parameters,
        "gradient_as_bucket_view": gradient_as_bucket_view,
        "static_graph": static_graph,
    }


class NPUDDPStrategy(BackendFromRuntime, DDPStrategy):
    """Trainer DDP on NPUs. The process-group backend follows the device (hccl for npu, gloo for cpu)."""

    strategy_name = "npu_ddp"

    def __init__(self, timeout: Timeout = None, process_group_backend: Optional[str] = None,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, accelerator: Any = None, parallel_devices: Any = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None) -> None:
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=as_timedelta(timeout),
            **ddp_options(find_unused_parameters, gradient_as_bucket_view, static_graph),
        )

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        return wrap_ddp(model, self.root_device, compat.ddp_kwargs(self))


class NPUFabricDDPStrategy(BackendFromRuntime, FabricDDPStrategy):
    """Fabric DDP on NPUs."""

    def __init__(self, timeout: Timeout = None, process_group_backend: Optional[str] = None,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, accelerator: Any = None, parallel_devices: Any = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision: Any = None) -> None:
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision=precision, process_group_backend=process_group_backend,
            timeout=as_timedelta(timeout),
            **ddp_options(find_unused_parameters, gradient_as_bucket_view, static_graph),
        )

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        return wrap_ddp(module, self.root_device, compat.ddp_kwargs(self))
