"""``"npu_single"``: one NPU. Lightning would otherwise put a one-device NPU run on the CPU."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_npu.strategies.common import SingleDeviceFromConnector

_DEVICE = Optional[Union[int, str, torch.device]]


class NPUSingleStrategy(SingleDeviceFromConnector, SingleDeviceStrategy):
    """Trainer strategy for one NPU (``device``: an index, ``"npu:1"``, or taken from ``devices=``)."""

    strategy_name = "npu_single"

    def __init__(self, device: _DEVICE = None, accelerator: Any = None, checkpoint_io: Any = None,
                 precision_plugin: Any = None) -> None:
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._init_device(device)


class NPUFabricSingleStrategy(SingleDeviceFromConnector, FabricSingleDeviceStrategy):
    """Fabric strategy for one NPU."""

    def __init__(self, device: _DEVICE = None, accelerator: Any = None, checkpoint_io: Any = None,
                 precision: Any = None) -> None:
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self._init_device(device)
