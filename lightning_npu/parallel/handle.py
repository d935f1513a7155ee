"""What ``parallelize`` returns and the strategies and the checkpoints hold: the model's parts, the pipeline's
schedule, and where this rank's parameters sit in the whole model's state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_npu.parallel.pipeline import Pipeline


@dataclass(frozen=True)
class StateLayout:
    """Where this rank's parameters sit in the whole model's state, what a checkpoint needs to write and read it as
    without the split: ``order``, every parameter's name in the whole model, in its order (what a checkpoint's param
    groups list); ``group``, the ranks that each hold other parameters (a pipeline's stages; None: this rank holds
    every parameter); ``device``, where tensors travel between those ranks."""

    order: tuple[str, ...]
    group: Any = None
    device: Optional[torch.device] = None

    @property
    def split(self) -> bool:
        """Whether the parameters are split over the ranks of ``group`` (each rank holding its stages')."""
        return self.group is not None


@dataclass(frozen=True)
class ParallelModel:
    """The model as ``parallelize`` left it: ``parts``, what every parallelism was applied to (``[model]``, or this
    rank's pipeline stages); ``schedule``, the pipeline that runs them (None without pipeline parallelism);
    ``layout``, where this rank's parameters sit in the whole model's state."""

    parts: tuple[nn.Module, ...]
    schedule: Optional["Pipeline"]
    layout: StateLayout


__all__ = ["ParallelModel", "StateLayout"]
