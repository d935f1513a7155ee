"""The recipe's LLaMA under tensor parallelism on 4 simulated NPUs: several Trainer runs in one launch, each on the
tiny recipe's model, data and strategy options (FSDP by TransformerBlock, half the blocks recomputed), fp32, with
the same global batch of 8 sequences a step, all starting from the same weights (``model.init_from``: a recipe
checkpoint of a freshly built tiny LLaMA, loaded into the shards of each layout).

- ``dp``: plain npu_fsdp, 4 data-parallel ranks of 2 sequences each;
- ``tp``: tensor_parallel_size=2 (a 2 x 2 mesh) with the recipe's plan, sequence parallelism and loss_parallel (the
  defaults), 4 sequences per data-parallel rank, a sharded checkpoint at step ``SAVE_AT``;
  (``dp`` and ``tp`` also save a sharded checkpoint at the end, ``<name>_end``)
- ``tp_plain``: tensor_parallel_size=2 without sequence parallelism and loss_parallel;
- ``tp_to_dp``: plain npu_fsdp resumed from ``tp``'s checkpoint (a sharded checkpoint across meshes);
- ``tp_scratch``: tensor_parallel_size=2 from random weights (no init_from), one step;
- ``tp_cp_ulysses`` / ``tp_cp_ring``: tensor_parallel_size=2 and context_parallel_size=2 (one data-parallel rank of 8
  sequences), Ulysses and ring attention;
- ``cp``: context_parallel_size=2 (ring), a sharded checkpoint at step ``SAVE_AT``; ``cp_to_dp``: plain npu_fsdp
  resumed from it (cp 2 -> 1); ``cp_ulysses``: context_parallel_size=2 by Ulysses. The two cp-only runs validate at
  step ``SAVE_AT`` (2 batches), so evaluation under context parallelism runs too; every run holds out the same
  validation documents, so the training batches are the same.

Every run logs every ``LOG_EVERY`` steps. Rank 0 writes ``<out>/result.json``: each run's per-step losses (averaged
over data-parallel ranks, and each rank's), the ``train_loss`` rank 0 logged, the placements of one MLP weight, and for ``tp_scratch`` whether the two tensor-parallel halves of each weight drew the same
numbers (a degenerate start: duplicated heads).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import Logger

import lightning_npu
from recipes.decoder.checkpoint_layout import save_recipe_checkpoint
from recipes.decoder.data import TextDataModule
from recipes.decoder.module import DecoderLM
from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.model import LLaMA

GLOBAL_BATCH, STEPS, SAVE_AT, LOG_EVERY = 8, 20, 10, 2


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.rank_losses: dict[int, list[float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach()
        self.rank_losses[trainer.global_step - 1] = trainer.strategy.all_gather(loss).tolist()
        self.losses[trainer.global_step - 1] = trainer.strategy.reduce(loss.clone(), reduce_op="mean").item()


class Logged(Logger):
    """The ``train_loss`` values the Trainer writes to its loggers, by step (each rank's own; rank 0's are what a
    CSV or TensorBoard logger records)."""

    def __init__(self) -> None:
        super().__init__()
        self.train_loss: dict[int, float] = {}

    @property
    def name(self) -> str:
        return "logged"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        if "train_loss" in metrics:
            self.train_loss[step] = float(metrics["train_loss"])


class SaveAt(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == SAVE_AT:
            trainer.save_checkpoint(self.path)


def fit(out: Path, name: str, *, tp: int = 1, cp: int = 1, resume: str | None = None, save: bool = False,
        init: bool = True, steps: int = STEPS, validate: bool = False, **options) -> dict:
    seed_everything(1234)
    strategy = lightning_npu.NPUFSDPStrategy(
        auto_wrap_policy=["TransformerBlock"], activation_checkpointing_policy=["TransformerBlock"],
        activation_checkpointing_ratio=0.5, tensor_parallel_size=tp, context_parallel_size=cp, timeout=240,
        **options,
    )
    losses, logged = Losses(), Logged()
    callbacks = [losses] + ([SaveAt(out / f"{name}_step{SAVE_AT}")] if save else [])
    trainer = Trainer(
        accelerator="npu", devices=4, strategy=strategy, precision="32-true", max_steps=steps, logger=logged,
        log_every_n_steps=LOG_EVERY,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        limit_val_batches=2 if validate else 0, val_check_interval=SAVE_AT, gradient_clip_val=1.0,
    )
    data_parallel = 4 // (tp * cp)
    data = TextDataModule(seq_len=64, batch_size=GLOBAL_BATCH // data_parallel, max_documents=80, val_fraction=0.1,
                          cache_dir=str(out / "cache"))
    data.prepare()
    model = DecoderLM(preset="tiny", learning_rate=3e-3, warmup_steps=3,
                      init_from=str(out / "init.ckpt") if init else None)
    trainer.fit(model, datamodule=data, ckpt_path=resume)
    if save:
        trainer.save_checkpoint(out / f"{name}_end")
    weight = model.model.layers[0].feed_forward.w_gate.weight
    result = {"losses": losses.losses, "rank_losses": losses.rank_losses, "logged": logged.train_loss,
              "data_parallel": data_parallel, "placements": [str(p) for p in weight.placements]}
    if not init:
        halves = {name: param.full_tensor().chunk(2) for name, param in model.model.named_parameters()
                  if "tp" in (param.device_mesh.mesh_dim_names or ()) and param.ndim == 2}
        result["equal_halves"] = sorted(name for name, (a, b) in halves.items() if torch.equal(a, b))
        result["split_weights"] = len(halves)
    return result


def write_initial_weights(path: Path) -> None:
    """A recipe checkpoint of a freshly built tiny LLaMA (once: the ranks started later find it)."""
    if not path.exists():
        seed_everything(1234)
        config = LLaMAConfig.from_preset("tiny")
        save_recipe_checkpoint(path, config, LLaMA(config).state_dict())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    out = Path(parser.parse_args().out)
    write_initial_weights(out / "init.ckpt")
    results = {
        "dp": fit(out, "dp", save=True),
        "tp": fit(out, "tp", tp=2, save=True),
        "tp_plain": fit(out, "tp_plain", tp=2, sequence_parallel=False, loss_parallel=False),
    }
    results["tp_to_dp"] = fit(out, "tp_to_dp", resume=str(out / f"tp_step{SAVE_AT}"))
    results["tp_scratch"] = fit(out, "tp_scratch", tp=2, init=False, steps=1)
    for algo in ("ulysses", "ring"):
        results[f"tp_cp_{algo}"] = fit(out, f"tp_cp_{algo}", tp=2, cp=2, context_parallel_algo=algo)
    results["cp"] = fit(out, "cp", cp=2, context_parallel_algo="ring", save=True, validate=True)
    results["cp_ulysses"] = fit(out, "cp_ulysses", cp=2, context_parallel_algo="ulysses", validate=True)
    results["cp_to_dp"] = fit(out, "cp_to_dp", resume=str(out / f"cp_step{SAVE_AT}"))
    import torch.distributed as dist

    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
