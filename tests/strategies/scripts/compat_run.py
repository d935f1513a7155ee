"""The npu_fsdp compatibility suite's run: every model of ``compat_models`` fitted a few steps under npu_ddp and
under npu_fsdp in the same 2 processes (started by torchrun, so several Trainers share one process group).

Writes ``<out>/rank<r>.json``: per model and strategy, this rank's per-step losses, the loss of the freshly built
model on this rank's first batch, whether tied parameters are still one tensor with equal values, the buffers'
sums (to compare across ranks), the BatchNorm running statistics and how many modules are SyncBatchNorm (with
the batches of that run, to recompute them), the warnings that name npu_fsdp; then the messages of the runs that
must fail (``errors``).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch.utils.data import DataLoader, Subset

import lightning_npu
from tests.strategies.scripts.compat_models import (
    MODELS,
    SPECIAL_MODELS,
    ConfigureModelNet,
    CustomInitNet,
    FSDP1EnableWrapNet,
    FSDP1UnitNet,
    L2PenaltyNet,
    Shift,
    UserShardedNet,
)

BATCH = 4
STEPS = 4


class LossRecorder(Callback):
    """This rank's per-step losses and batches."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[list[torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append([t.clone() for t in batch])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        # Lightning hands over the loss divided by the number of micro-batches it accumulates.
        self.losses.append(float(loss) * trainer.accumulate_grad_batches)


def strategy(name: str):
    if name == "npu_ddp":
        return lightning_npu.NPUDDPStrategy(timeout=120)
    return lightning_npu.NPUFSDPStrategy(timeout=120)


def trainer(strategy_name: str, max_steps: int = STEPS, **kwargs) -> Trainer:
    return Trainer(accelerator="npu", devices=2, strategy=strategy(strategy_name), precision="32-true",
                   max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def fresh_loss(name: str, out: str, batch) -> float:
    """The loss of the model as its own code builds it (outside any Trainer) on ``batch``."""
    seed_everything(0)
    model = {**MODELS, **SPECIAL_MODELS}[name](out)
    model.configure_model()
    with torch.no_grad():
        return float(model.loss(batch))


def fit(name: str, strategy_name: str, out: str, build=None, **trainer_kwargs) -> dict:
    seed_everything(0)
    recorder = LossRecorder()
    run = trainer(strategy_name, callbacks=[recorder], **trainer_kwargs)
    model = build(run) if build else {**MODELS, **SPECIAL_MODELS}[name](out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(model, train_dataloaders=DataLoader(model.dataset(), batch_size=BATCH))
    result = {"losses": recorder.losses, "batches": recorder.batches,
              "npu_fsdp_warnings": [str(w.message) for w in caught if "npu_fsdp" in str(w.message)]}
    if hasattr(model, "tied"):
        first, second = model.tied()
        full = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in (first, second)]
        result["tied_same_tensor"] = first is second
        result["tied_max_difference"] = float((full[0] - full[1]).abs().max())
    result["buffers"] = {n: float(b.double().sum()) for n, b in model.named_buffers() if b.is_floating_point()}
    result["running_stats"] = {n: b.tolist() for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var"))}
    result["sync_batchnorm_modules"] = sum(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())
    return result


def expect_failure(strategy_name: str, build, out: str, callbacks=()) -> str:
    seed_everything(0)
    run = trainer(strategy_name, callbacks=list(callbacks))
    model = build(run)
    try:
        run.fit(model, train_dataloaders=DataLoader(model.dataset(), batch_size=BATCH))
    except Exception as error:  # noqa: BLE001 -- the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return "no error"


class MetaShiftNet(CustomInitNet):
    """A model built with ``trainer.init_module(empty_init=True)`` holding a module without reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = Shift()


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        ConfigureModelNet.write_weights(str(Path(out) / "encoder.pt"))
    dist.barrier()

    results: dict = {}
    for name in MODELS:
        results[name] = {strategy_name: fit(name, strategy_name, out) for strategy_name in ("npu_ddp", "npu_fsdp")}

    # Built under trainer.init_module(): the custom initialisation of __init__ is kept.
    def under_init_module(run):
        with run.init_module():
            return CustomInitNet()

    results["init_module"] = {strategy_name: fit("init_module", strategy_name, out, build=under_init_module)
                              for strategy_name in ("npu_ddp", "npu_fsdp")}
    # Gradient accumulation: 2 optimizer steps of 2 micro-batches each.
    results["gradient_accumulation"] = {
        strategy_name: fit("module_list", strategy_name, out, max_steps=STEPS // 2, accumulate_grad_batches=2)
        for strategy_name in ("npu_ddp", "npu_fsdp")
    }
    for name, result in results.items():
        for run in result.values():
            built_as = {"init_module": "custom_init", "gradient_accumulation": "module_list"}.get(name, name)
            run["fresh_loss"] = fresh_loss(built_as, out, run.pop("batches")[0])
    # sync_batchnorm=True: the statistics of every step are those of both ranks' batches (kept, to recompute them).
    results["sync_batchnorm"] = {strategy_name: fit("batch_norm", strategy_name, out, sync_batchnorm=True)
                                 for strategy_name in ("npu_ddp", "npu_fsdp")}
    for run in results["sync_batchnorm"].values():
        run["batches"] = [[t.tolist() for t in batch] for batch in run["batches"]]

    def meta_init(run):
        with run.init_module(empty_init=True):
            return MetaShiftNet()

    errors = {
        "swa": expect_failure("npu_fsdp", lambda run: MODELS["module_list"](out), out,
                              callbacks=[StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)]),
        "l2_penalty": expect_failure("npu_fsdp", lambda run: L2PenaltyNet(), out),
        "meta_without_reset_parameters": expect_failure("npu_fsdp", meta_init, out),
        "user_sharded_changed_after_sharding": expect_failure(
            "npu_fsdp", lambda run: UserShardedNet(change_after_sharding=True), out),
        "fsdp1_unit": expect_failure("npu_fsdp", lambda run: FSDP1UnitNet(), out),
        "fsdp1_enable_wrap": expect_failure("npu_fsdp", lambda run: FSDP1EnableWrapNet(), out),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps({"results": results, "errors": errors}))


if __name__ == "__main__":
    main()
