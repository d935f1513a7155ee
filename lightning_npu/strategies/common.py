"""What the NPU strategies share, for the Trainer and Fabric alike."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_npu import compat
from lightning_npu.facts.env import HCCL_TIMEOUTS
from lightning_npu.facts.options import Timeout, check_timeout
from lightning_npu.strategies.clean_exit import destroy_at_exit
from lightning_npu.strategies.sync_batchnorm import HostSyncBatchNormDDP, host_sync_batchnorm
from lightning_npu.timeouts import default_timeout_s, timeout_problem


def as_timedelta(timeout: Timeout) -> timedelta:
    """A process-group timeout given in seconds (YAML) or as a timedelta (Python). None: 30 min, or more when
    the HCCL timeouts in the environment need it (see lightning_npu/timeouts.py)."""
    if timeout is None:
        return timedelta(seconds=default_timeout_s(os.environ))
    check_timeout(timeout)
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def wrap_ddp(module: torch.nn.Module, root_device: torch.device, ddp_kwargs: dict[str, Any]) -> DistributedDataParallel:
    """Wrap in DDP without Lightning's CUDA side stream (``torch.cuda.stream`` fails on NPU machines); on the
    simulated NPU, SyncBatchNorm modules run ``sync_batchnorm``'s host implementation, which DDP is told to accept."""
    if root_device.type == "cpu":  # the simulated NPU
        host_sync_batchnorm(module, root_device)
        return HostSyncBatchNormDDP(module=module, device_ids=None, **ddp_kwargs)
    return DistributedDataParallel(module=module, device_ids=[root_device.index], **ddp_kwargs)


def check_timeouts(timeout: timedelta, backend: str) -> None:
    """Warn (once per process) when the process-group timeout is not above the HCCL timeouts: on hccl, or
    whenever the user set an HCCL timeout (so a simulated run shows what the real one would say)."""
    if backend != "hccl" and not any(name in os.environ for name in HCCL_TIMEOUTS):
        return
    problem = timeout_problem(timeout.total_seconds(), os.environ)
    if problem:
        message = str(problem)
        rank_zero_warn(message[0].upper() + message[1:])


class BackendFromRuntime:
    """Mixin for distributed strategies: the process-group backend comes from the NPU runtime (hccl, or gloo
    when simulated) rather than from the device-type map torch_npu may or may not have filled in; the process
    groups are destroyed at exit (``lightning_npu.strategies.clean_exit``)."""

    accelerator: Any
    root_device: torch.device

    def _get_process_group_backend(self) -> str:
        backend = self._resolve_process_group_backend()
        # Lightning asks for the backend right before it creates (or joins) the process group, in every DDP and
        # FSDP2 strategy of the Trainer and Fabric: the moment to register the exit hook and compare the timeouts.
        destroy_at_exit()
        timeout = compat.process_group_timeout(self)
        if not getattr(self, "_timeouts_checked", False) and timeout is not None:
            self._timeouts_checked = True
            check_timeouts(timeout, backend)
        return backend

    def _resolve_process_group_backend(self) -> str:
        given = compat.process_group_backend_given(self)
        if given:
            return given
        runtime = getattr(self.accelerator, "runtime", None)
        if runtime is not None:
            return runtime.backend
        return compat.default_process_group_backend_for_device(self.root_device)


def with_host_backend(backend: str, device_type: str) -> str:
    """The process-group backend when some collectives run on host tensors (CPU offload: gradient-norm clipping
    and the fp16 scaler's overflow check reduce CPU DTensors). hccl is bound to NPU tensors, so gloo is added for
    the CPU (``"cpu:gloo,npu:hccl"``); gloo alone, or a backend already given per device, serves as it is."""
    if backend == "gloo" or ":" in backend:
        return backend
    return f"cpu:gloo,{device_type}:{backend}"


class SingleDeviceFromConnector:
    """Mixin for single-device strategies: take the device from ``devices=`` when none was given.

    Lightning's connectors hand ``parallel_devices`` to any strategy that has the attribute, so
    ``Trainer(accelerator="npu", devices=[3], strategy="npu_single")`` runs on npu:3.
    """

    root_device: torch.device

    def _init_device(self, device: Optional[Union[int, str, torch.device]]) -> None:
        self._device_given = device is not None
        if device is not None:
            compat.set_root_device(self, _as_device(device))

    @property
    def parallel_devices(self) -> list[torch.device]:
        return [self.root_device] if self._device_given else []

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device]) -> None:
        if len(devices) != 1:
            raise ValueError(
                f"the single-device strategy got {len(devices)} devices; use strategy='npu_ddp' or 'npu_fsdp' for several"
            )
        compat.set_root_device(self, devices[0])
        self._device_given = True


def _as_device(device: Union[int, str, torch.device]) -> torch.device:
    if isinstance(device, int):
        from lightning_npu.runtime import get_runtime

        return get_runtime().device(device)
    return torch.device(device)
