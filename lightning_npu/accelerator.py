"""The ``"npu"`` accelerator, one class for both the Trainer and Fabric."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
from lightning.pytorch.accelerators import Accelerator
from typing_extensions import override

from lightning_npu.facts.devices import ALL_DEVICES, DEVICES, devices_request
from lightning_npu.facts.env import VISIBLE_DEVICES_ENV
from lightning_npu.facts.options import check_memory_fraction
from lightning_npu.runtime import get_runtime, is_available


class NPUAccelerator(Accelerator):
    """Ascend NPU accelerator (Lightning's Trainer accelerator base also satisfies Fabric's)."""

    def __init__(self, memory_fraction: Optional[float] = None) -> None:
        """``memory_fraction``: the share (0 < f <= 1) of each device's memory this process may allocate."""
        super().__init__()
        check_memory_fraction(memory_fraction)
        self.memory_fraction = memory_fraction
        # Raises the probe's reason right where the user asked for the accelerator.
        self.runtime = get_runtime()

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != self.runtime.device_type:
            raise ValueError(f"NPUAccelerator got device {device}, expected a {self.runtime.device_type!r} device")
        self.runtime.set_device(device)
        if self.memory_fraction is not None:
            self.runtime.set_memory_fraction(self.memory_fraction, device)

    @override
    def teardown(self) -> None:
        self.runtime.empty_cache()

    @staticmethod
    @override
    def parse_devices(devices: DEVICES) -> list[int]:
        return parse_device_ids(devices, get_runtime().device_count())

    @staticmethod
    @override
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        runtime = get_runtime()
        return [runtime.device(index) for index in devices]

    @staticmethod
    @override
    def auto_device_count() -> int:
        return get_runtime().device_count()

    @staticmethod
    @override
    def is_available() -> bool:
        return is_available()

    @staticmethod
    @override
    def name() -> str:
        return "npu"

    @override
    def get_device_stats(self, device: Union[str, torch.device]) -> dict[str, Any]:
        return self.runtime.memory_stats(torch.device(device))


def parse_device_ids(devices: DEVICES, visible: int) -> list[int]:
    """Turn a Trainer/Fabric ``devices`` value into NPU indices, checking each against the ``visible`` count.

    ``int`` n: the first n devices (-1: all); ``"auto"``/``"-1"``: all; ``"2"``: two devices; ``"0,1"`` or
    ``[0, 1]``: those device ids (read by ``facts.devices.devices_request``).
    """
    request = devices_request(devices)
    if isinstance(request, int):
        count = visible if request == ALL_DEVICES else request
        if count < 1:
            raise ValueError(f"devices={count!r} must be a positive number of NPUs, -1 or 'auto' for all")
        if count > visible:
            raise ValueError(f"devices={count} asks for more NPUs than are visible: {_visibility(visible)}")
        return list(range(count))
    shown = request if isinstance(devices, str) else devices
    for index in request:
        if not 0 <= index < visible:
            raise ValueError(f"devices={shown!r} asks for NPU {index}, which is not visible: {_visibility(visible)}")
    return request


def _visibility(visible: int) -> str:
    ids = f"ids 0..{visible - 1}" if visible else "no ids"
    mask = os.environ.get(VISIBLE_DEVICES_ENV)
    relative = f"; ids count from 0 within {VISIBLE_DEVICES_ENV}={mask}" if mask is not None else ""
    return f"{visible} NPU(s) visible ({ids}){relative}"
