"""Tensor parallelism under npu_fsdp on 4 simulated NPUs: several Trainer runs in one launch, the same global batch.

- ``dp``: plain npu_fsdp (4 data-parallel ranks), a full checkpoint at the end;
- ``tp_user``: a LightningModule written for Lightning's ModelParallelStrategy (its ``configure_model`` calls
  ``parallelize_module`` on ``device_mesh["tensor_parallel"]`` and ``fully_shard`` on ``device_mesh["data_parallel"]``)
  with tensor_parallel_size=2 (a 2 x 2 mesh), a sharded checkpoint after epoch 0;
- ``tp_plan``: the same model with its plan given to the strategy (``parallel_plan=``, an import path), a full
  checkpoint;
- ``tp_resume``: ``tp_user`` resumed from its epoch-0 checkpoint;
- ``tp1_user``: the ModelParallelStrategy module under plain npu_fsdp (tensor_parallel_size=1: its
  ``device_mesh["tensor_parallel"]`` has one rank);
- ``fabric_dp`` / ``fabric_tp``: the same training in a Fabric loop, plain and with tensor_parallel_size=2 and the
  plan (a function) given to the strategy.

Every rank draws its own first weights in ``configure_model``; rank 0's must reach all. Rank 0 writes
``<out>/result.json``: each run's per-step losses (averaged over data-parallel ranks), the warnings torch's device
mesh raised during it, and per rank the sum of its first batch (ranks of a tensor-parallel group must share it) and
its weights' placements.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_npu
from lightning_npu.parallel import ParallelPlan
from tests.strategies.scripts.trainer_run import SaveAfterFirstEpoch

WIDTH, HIDDEN, DEPTH = 16, 32, 2
DP_BATCH = 4  # per rank with 4 data-parallel ranks; 8 per tensor-parallel group of 2: 16 a step either way


class FeedForward(nn.Module):
    """A SwiGLU block as in Lightning's ModelParallelStrategy docs."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, WIDTH)
        self.w3 = nn.Linear(WIDTH, HIDDEN, bias=False)

    def forward(self, x):
        return x + self.w2(F.silu(self.w1(x)) * self.w3(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(FeedForward() for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def feed_forward_plan(module: nn.Module) -> ParallelPlan:
    """The strategy's ``parallel_plan``: every FeedForward of ``module`` gate and up columnwise, down rowwise (its
    output replicated); names relative to ``module`` (the LightningModule, or the Net given to Fabric)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def tensor_parallel(tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> dict:
        plan = {}
        for name, layer in module.named_modules():
            if isinstance(layer, FeedForward):
                plan.update({f"{name}.w1": ColwiseParallel(), f"{name}.w3": ColwiseParallel(),
                             f"{name}.w2": RowwiseParallel()})
        return plan

    return ParallelPlan(tensor_parallel=tensor_parallel)


class FeedForwardModule(LightningModule):
    """Builds its model in configure_model; with ``shard_itself`` it shards it there as ModelParallelStrategy wants."""

    def __init__(self, shard_itself: bool) -> None:
        super().__init__()
        self.shard_itself = shard_itself
        self.net = None
        self.losses: list[float] = []
        self.first_batch_sum = None

    def configure_model(self):
        if self.net is not None:
            return
        # Each rank draws different first weights: only rank 0's (the same in every run) may reach training, so
        # the weights a rank splits for itself are replaced by rank 0's after sharding (initial_state).
        torch.manual_seed(1234 + self.global_rank)
        self.net = Net()
        if not self.shard_itself:
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for layer in self.net.layers:
            parallelize_module(layer, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel(),
                                                "w3": ColwiseParallel()})
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.net, mesh=dp_mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.first_batch_sum is None:
            self.first_batch_sum = float(x.sum())
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(batch_size: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, WIDTH, generator=generator)
    y = torch.sin(x.cumsum(dim=1))
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def fit(out: Path, name: str, *, tp: int, shard_itself: bool, state_dict_type: str = "sharded", plan=None,
        save_after_epoch0: bool = False, resume: str | None = None, save_at_end: bool = False) -> dict:
    seed_everything(7)
    strategy = lightning_npu.NPUFSDPStrategy(
        auto_wrap_policy=[FeedForward], tensor_parallel_size=tp, parallel_plan=plan,
        state_dict_type=state_dict_type, timeout=180,
    )
    callbacks = [SaveAfterFirstEpoch(str(out / f"{name}_epoch0"))] if save_after_epoch0 else []
    trainer = Trainer(
        accelerator="npu", devices=4, strategy=strategy, precision="32-true", max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        callbacks=callbacks,
    )
    module = FeedForwardModule(shard_itself)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=data(DP_BATCH * tp), ckpt_path=resume)
    mesh_warnings = sorted({str(w.message) for w in caught if "device_mesh" in w.filename})
    if save_at_end:
        trainer.save_checkpoint(out / f"{name}.ckpt")
    mesh = trainer.strategy.device_mesh
    weight = module.net.layers[0].w2.weight
    placements = [str(p) for p in weight.placements]
    # A full optimizer state exists on global rank 0 only, as Lightning's ModelParallelStrategy returns it.
    full_state = trainer.strategy.optimizer_state(trainer.optimizers[0]) if state_dict_type == "full" else None
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"first_batch_sum": module.first_batch_sum, "w2_placements": placements,
                                   "optimizer_state_entries": None if full_state is None else sorted(full_state)})
    return {"losses": module.losses, "mesh_dims": list(mesh.mesh_dim_names), "ranks": ranks,
            "mesh_warnings": mesh_warnings}


def fabric_fit(tp: int) -> dict:
    """The same training in a Fabric loop under NPUFabricFSDPStrategy, the plan given to the strategy."""
    from lightning.fabric import Fabric

    seed_everything(7)
    strategy = lightning_npu.NPUFabricFSDPStrategy(
        auto_wrap_policy=[FeedForward], tensor_parallel_size=tp, parallel_plan=feed_forward_plan, timeout=180,
    )
    fabric = Fabric(accelerator="npu", devices=4, strategy=strategy, precision="32-true")
    fabric.launch()
    torch.manual_seed(1234 + fabric.global_rank)  # as configure_model does: only rank 0's weights may count
    net = fabric.setup(Net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(data(DP_BATCH * tp))
    losses = []
    for _ in range(2):
        for x, y in loader:
            loss = F.mse_loss(net(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return {"losses": losses, "mesh_dims": list(fabric.strategy.device_mesh.mesh_dim_names),
            "w2_placements": [str(p) for p in net.layers[0].w2.weight.placements]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    results = {
        "dp": fit(out, "dp", tp=1, shard_itself=False, state_dict_type="full", save_at_end=True),
        "tp_user": fit(out, "tp_user", tp=2, shard_itself=True, save_after_epoch0=True),
        "tp_plan": fit(out, "tp_plan", tp=2, shard_itself=False, state_dict_type="full", save_at_end=True,
                       plan="tests.parallel.scripts.tensor_parallel_run.feed_forward_plan"),
    }
    results["tp_resume"] = fit(out, "tp_resume", tp=2, shard_itself=True, resume=str(out / "tp_user_epoch0"))
    results["tp1_user"] = fit(out, "tp1_user", tp=1, shard_itself=True)
    results["fabric_dp"] = fabric_fit(tp=1)
    results["fabric_tp"] = fabric_fit(tp=2)
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    # Run the imported module's main, so the classes the plan's import path sees are the ones trained here.
    from tests.parallel.scripts import tensor_parallel_run

    tensor_parallel_run.main()
