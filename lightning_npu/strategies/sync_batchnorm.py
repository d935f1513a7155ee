"""SyncBatchNorm on the simulated NPU: torch's ``SyncBatchNorm`` trains only on GPU/NPU tensors, so on the host
(``LIGHTNING_NPU_SIMULATE``: CPU + gloo) its modules get ``HostSyncBatchNorm``'s forward, which normalises with
the same statistics over every rank's batch, computed with differentiable all-reduces.

``Trainer(sync_batchnorm=True)`` converts BatchNorm to SyncBatchNorm under ``npu_ddp`` (Lightning's DDPStrategy
does it) and ``npu_fsdp`` (before sharding, so FSDP shards the SyncBatchNorm modules); Fabric has no such flag
(convert with ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` before ``fabric.setup``). Either way, the NPU
strategies hand the model to ``host_sync_batchnorm`` before wrapping it, and wrap it for DDP with
``HostSyncBatchNormDDP`` on the host. On an NPU torch's own SyncBatchNorm and DDP run, unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel


class HostSyncBatchNorm(nn.SyncBatchNorm):
    """``SyncBatchNorm`` that also trains on host (CPU) tensors, with the statistics torch's computes on a GPU/NPU:
    mean and biased variance over the batches of every rank of ``process_group`` for normalising, the unbiased
    variance for ``running_var``. Gradients flow through the all-reduced sums to every rank, as in torch's."""

    def forward(self, input: Tensor) -> Tensor:
        if not (self.training and input.device.type == "cpu" and dist.is_available() and dist.is_initialized()):
            return super().forward(input)  # evaluation never synchronises; torch's forward runs on NPUs
        if input.dim() < 2 or input.shape[1] == 0:
            raise ValueError(f"SyncBatchNorm expects input of shape (N, C, ...) with C > 0, got {tuple(input.shape)}")
        factor = self._running_stats_factor()
        group = self.process_group or dist.group.WORLD
        x = input.float()
        dims = [dim for dim in range(x.dim()) if dim != 1]
        per_channel = [1, -1] + [1] * (x.dim() - 2)
        sums = _AllReduceSum.apply(torch.cat([x.sum(dims), x.new_tensor([x.numel() // x.shape[1]])]), group)
        count, mean = sums[-1], sums[:-1] / sums[-1]
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {input.size()}")
        centred = x - mean.view(per_channel)
        variance = _AllReduceSum.apply(centred.square().sum(dims), group) / count
        out = centred * torch.rsqrt(variance + self.eps).view(per_channel)
        if self.weight is not None:
            out = out * self.weight.view(per_channel)
        if self.bias is not None:
            out = out + self.bias.view(per_channel)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                unbiased = variance * count / (count - 1)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        return out.to(input.dtype)

    def _running_stats_factor(self) -> float:
        """The weight of this batch in the running statistics (counting the batch), as ``_BatchNorm`` computes it."""
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                return 1.0 / float(self.num_batches_tracked)
        return 0.0 if self.momentum is None else self.momentum


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks of ``group``; the gradient of every rank's input is the sum of all ranks' gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Optional[Any]) -> Tensor:
        ctx.group = group
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class HostSyncBatchNormDDP(DistributedDataParallel):
    """DDP on the simulated NPU: torch's DDP refuses any SyncBatchNorm in a CPU module (torch's own implementation
    has no CPU kernels), so it is told about the others only."""

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        if any(isinstance(m, nn.SyncBatchNorm) and not isinstance(m, HostSyncBatchNorm) for m in module.modules()):
            super()._passing_sync_batchnorm_handle(module)


def host_sync_batchnorm(model: nn.Module, device: torch.device) -> None:
    """Let every SyncBatchNorm of ``model`` train on ``device`` when it is the host (the simulated NPU); on an NPU,
    torch's SyncBatchNorm runs as it is. Call before the model is wrapped or sharded (FSDP2 subclasses a unit's
    class)."""
    if device.type != "cpu":
        return
    converted = [module for module in model.modules() if type(module) is nn.SyncBatchNorm]
    for module in converted:
        module.__class__ = HostSyncBatchNorm  # the same module (its parameters, buffers and references) kept
    if converted:
        rank_zero_info(
            f"{len(converted)} SyncBatchNorm modules run lightning_npu's host implementation on the simulated NPU"
            " (torch's trains on GPU/NPU tensors only)"
        )


__all__ = ["HostSyncBatchNorm", "HostSyncBatchNormDDP", "host_sync_batchnorm"]
