"""Pipeline parallelism under npu_fsdp against plain npu_fsdp with as many data-parallel replicas, from one checkpoint
of first weights, the same rows a step (8; 30 % of the labels -100, so microbatches hold unequal label counts),
gradient clipping at 1.0 and half the blocks recomputed (not under the V schedule, which refuses it), in four
launches:

- ``--stage one`` (1 simulated NPU, 1 replica): the first weights (``init_<model>.ckpt``: a 4-block tiny LLaMA, and
  a 4-block MoE balanced by its routing bias); ``plain``:
  2 epochs of 5 steps with validation (3 batches, the last of 3 rows), a sharded checkpoint after epoch 0;
  ``plain_epoch``: one epoch (the learning-rate schedule spans the run); ``plain_accumulate``: 5 steps of 2 accumulated batches; ``fabric_plain``: a Fabric loop of 4 steps of 2 accumulated
  batches, then ``fabric.load_raw`` of the first weights; ``moe_plain``, ``qwen3_plain``, ``deepseek_plain``: the MoE, an
  untied Qwen3 and a DeepSeek (MLA, DeepSeekMoE) for one epoch; ``user_plain``: a user's own LightningModule, not
  the recipes' (a sequence classifier with its own projection, residual blocks of ``x`` alone, pooling under a
  keyword mask, head and loss: tests/parallel/scripts/pipeline_user_model.py) for one epoch; ``predict_plain``:
  ``trainer.predict`` of the first weights (logits to ``predict_plain_rank0.pt``); ``guard_plain``: NaNs injected
  under the non-finite-loss guard (``guarded``); ``lora_plain``: LoRA adapters on the first weights, saving a full
  file after epoch 0, which ``lora_full_to_plain`` resumes;
- ``--stage two`` (2 simulated NPUs): ``pp2`` (1F1B, 4 microbatches) as ``plain``, a sharded checkpoint after epoch
  0; ``pp2_gpipe``, ``pp2_interleaved`` (2 stages a rank), ``pp2_zbv`` (V schedule) for epoch 0;
  ``pp2_accumulate``; ``plain_to_pp2``: ``plain``'s checkpoint resumed under pp 2; ``plain2``: plain with 2 replicas
  (the reference of ``pp2_dp2``); ``moe_plain2``: the MoE with 2 replicas (the reference of ``moe_pp2_ep2``); ``pp2_full``: ``pp2``'s first epoch, saving one full file
  (``state_dict_type="full"``), which ``pp2_full_to_pp2`` resumes; ``fabric_pp2``; ``moe_pp2``, ``qwen3_pp2``,
  ``deepseek_pp2``, ``user_pp2``; ``predict_pp2``, ``predict_pp2_zbv``: ``predict_plain`` under pp 2 (each rank's
  logits to ``<name>_rank<r>.pt``); ``predict_cp2``: ``predict_plain`` under cp 2 (Ulysses), no pipeline;
  ``guard_pp2``: ``guard_plain``'s NaNs, where only the first stage sees them; ``preempt_pp2``: SIGTERM to rank 1 alone, a save on preemption (``preempted``); ``lora_pp2``: ``lora_plain``
  under pp 2, a sharded checkpoint after epoch 0, which ``lora_pp2_to_pp2`` resumes;
- ``--stage four`` (4 simulated NPUs): ``pp2_dp2``: pp 2 x 2 replicas as ``plain2``; ``pp2_dp2_full``: its first
  epoch saving one full file (the pipeline without global rank 0 sends its stage from its replica-0 rank), which
  ``pp2_dp2_full_to_pp2_dp2`` resumes; ``moe_pp2_ep2``: the MoE under
  pp 2 x expert_parallel_size 2 (over the 2 replicas) as ``moe_plain2``; ``pp2_to_pp2_tp2``: ``pp2``'s checkpoint
  resumed under pp 2 x tensor_parallel_size 2 (sequence parallel: the stages exchange each sequence's halves);
  ``deepseek_pp2_tp2``: the DeepSeek under pp 2 x tp 2 (one replica, as ``deepseek_plain``); ``pp2_cp2_ring`` (ZBV)
  and ``pp2_cp2_ulysses`` (1F1B): pp 2 x context_parallel_size 2 (one replica, as ``plain_epoch``);
  ``predict_pp2_cp2``: ``predict_plain`` under pp 2 x cp 2 (ring);
- ``--stage back`` (1 simulated NPU): ``pp2_to_plain``: ``pp2``'s checkpoint resumed under plain npu_fsdp, which
  saves it again before its first step (``pp2_weights_plain``: pp 2's weights and optimizer state, written without
  the pipeline); ``pp2_full_to_plain``: ``pp2_full``'s file resumed under plain npu_fsdp.

Each stage's results go to ``<out>/<stage>.json`` (rank 0): per run the per-step losses and the validation losses
(one per epoch), and the P2P batches torch sent through ``batch_isend_irecv`` that HCCL would refuse.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import LambdaCallback
from torch.utils.data import DataLoader, Dataset

import lightning_npu
from lightning_npu.guards import NonFiniteLossError, NonFiniteLossGuard
from lightning_npu.parallel.tensor import local_tensor
from lightning_npu.preemption import GracefulPreemption, Preempted
from recipes.decoder.module import DecoderLM
from recipes.decoder.pretrained import load_pretrained
from tests.npu_fake.hccl import P2PRecorder
from tests.parallel.scripts.expert_parallel_run import FAMILIES, module, save_first_weights
from tests.parallel.scripts.pipeline_user_model import Classify, Sequences
from tests.strategies.scripts.trainer_run import SaveAfterFirstEpoch

SEQ, ROWS, STEPS = 32, 8, 5  # 8 rows of 32 tokens a step (all replicas together), 5 steps an epoch
LORA = dict(rank=4, alpha=8, dropout=0.0, targets=["q", "k", "v", "o", "gate", "up", "down"])
#: Each model: (family, config fields over the tiny preset, its block). The MoE one balances its experts by the
#: routing bias (moved after each step by the tokens every replica routed), without the load-balancing loss.
MODELS = {"llama": ("llama", dict(n_layers=4, max_seq_len=SEQ), "TransformerBlock"),
          "moe": ("moe", dict(n_layers=4, max_seq_len=SEQ, dim=64, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2,
                              expert_hidden_dim=32, router_aux_loss_coef=0.0,
                              router_bias_update_rate=0.01), "MoEBlock"),
          # Qwen3 untied (per-head q/k norms); DeepSeek: MLA, a dense first layer, then DeepSeekMoE, no MTP.
          "qwen3": ("qwen", dict(n_layers=4, max_seq_len=SEQ, tie_embeddings=False), "QwenBlock"),
          "deepseek": ("deepseek", dict(n_layers=4, max_seq_len=SEQ, mtp_layers=0), "DeepSeekBlock")}


def recompute(block: str) -> dict:
    """Half the blocks recompute their activations in backward."""
    return dict(auto_wrap_policy=[block], activation_checkpointing_policy=[block], activation_checkpointing_ratio=0.5)


class Rows(Dataset):
    """``count`` rows drawn from 16 random ones (so the loss falls), 30 % of their labels -100."""

    def __init__(self, count: int, seed: int) -> None:
        rows = torch.randint(0, 2048, (16, SEQ + 1), generator=torch.Generator().manual_seed(0))
        self.ids = rows[torch.randint(0, 16, (count,), generator=torch.Generator().manual_seed(seed))]
        self.masked = torch.rand(count, SEQ, generator=torch.Generator().manual_seed(seed + 1)) < 0.3

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:].masked_fill(self.masked[i], -100)}


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach() * trainer.accumulate_grad_batches  # Lightning hands over loss / accumulate
        self.losses.append(trainer.strategy.reduce(loss, reduce_op="mean").item())

    def on_validation_epoch_end(self, trainer, module) -> None:
        if not trainer.sanity_checking:
            self.val.append(trainer.callback_metrics["val_loss"].item())


def fit(out: Path, name: str, *, devices: int, model: str = "llama", epochs: int = 2, accumulate: int = 1,
        resume: Optional[str] = None, save: bool = False, callbacks: Sequence[Callback] = (),
        stops: tuple[type[BaseException], ...] = (), **options) -> dict:
    """``epochs`` epochs of ``STEPS`` optimizer steps (a resumed run: the second) of ``model`` on ``devices`` under
    npu_fsdp with ``options``; the global batch is the same rows on any layout (each data-parallel replica takes its
    share). ``callbacks`` join the run's; an exception of ``stops`` ends it early, and its ``str`` is recorded
    (``stopped``)."""
    seed_everything(1234)
    if model == "user":  # a user's own LightningModule (tests/parallel/scripts/pipeline_user_model.py), built in __init__
        lm, dataset, block = Classify(), Sequences, "Residual"
    else:  # "lora": adapters on every projection of the LLaMA's first weights, the base frozen
        base = "llama" if model == "lora" else model
        family, config, block = MODELS[base]
        lora = LORA if model == "lora" else None
        lm, dataset = module(family, str(out / f"init_{base}.ckpt"), lora=lora, **config), Rows
    strategy = lightning_npu.NPUFSDPStrategy(**{**recompute(block), "timeout": 300, **options})
    losses = Losses()
    callbacks = [losses, *callbacks]
    if save:
        callbacks.append(SaveAfterFirstEpoch(str(out / f"{name}_epoch0")))
    trainer = Trainer(
        accelerator="npu", devices=devices, strategy=strategy, precision="32-true", max_epochs=epochs,
        limit_train_batches=STEPS * accumulate, accumulate_grad_batches=accumulate, num_sanity_val_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True, gradient_clip_val=1.0, callbacks=callbacks, default_root_dir=out / name,
    )
    replicas = devices // (options.get("pipeline_parallel_size", 1) * options.get("tensor_parallel_size", 1)
                           * options.get("context_parallel_size", 1))
    train = DataLoader(dataset(STEPS * ROWS * accumulate, seed=1), batch_size=ROWS // replicas)
    val = DataLoader(dataset(11 * replicas, seed=5), batch_size=4)  # each replica: 4, 4 and 3 rows
    stopped = None
    with P2PRecorder() as p2p:
        try:
            trainer.fit(lm, train_dataloaders=train, val_dataloaders=val, ckpt_path=resume)
        except stops as error:
            stopped = f"{type(error).__name__}: {error}"
    return {"losses": losses.losses, "val": losses.val, "stopped": stopped,
            "refused_by_hccl": p2p.refused_by_hccl()}


class StopAfterEpoch(Callback):
    """End the run after its first epoch, its learning-rate schedule still spanning every epoch (as a run that is
    resumed from there)."""

    def on_train_epoch_end(self, trainer, module) -> None:
        trainer.should_stop = True


class Predicting(DecoderLM):
    """The recipe's module with a ``predict_step`` that returns the model's logits (the model called without
    labels: under pipeline parallelism the forward-only schedule, its last stage's logits on every rank)."""

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.inference_mode_seen = torch.is_inference_mode_enabled()
        return self(batch["input_ids"])


def predict(out: Path, name: str, *, devices: int, **options) -> dict:
    """``trainer.predict`` of the first weights (``init_llama.ckpt``) on 11 rows in batches of 4 (the last of 3,
    which a pipeline pads to its 4 microbatches); every rank's logits, concatenated, go to ``<name>_rank<r>.pt``."""
    seed_everything(1234)
    family, config, _ = MODELS["llama"]
    trainer = Trainer(accelerator="npu", devices=devices, precision="32-true", logger=False,
                      strategy=lightning_npu.NPUFSDPStrategy(timeout=300, **options), enable_progress_bar=False,
                      enable_model_summary=False, deterministic=True, inference_mode=True)
    lm = Predicting(family=family, preset="tiny", config={**FAMILIES[family][0], **config},
                    init_from=str(out / "init_llama.ckpt"))
    logits = trainer.predict(lm, DataLoader(Rows(11, seed=5), batch_size=4))
    torch.save(torch.cat(logits).cpu(), out / f"{name}_rank{trainer.global_rank}.pt")
    loops = (trainer.validate_loop, trainer.test_loop, trainer.predict_loop, trainer.fit_loop.epoch_loop.val_loop)
    return {"ranks": trainer.world_size, "batches": [list(batch.shape) for batch in logits],
            "loops_inference_mode": [loop.inference_mode for loop in loops],
            "predict_step_inference_mode": lm.inference_mode_seen}


def every_rank(record: dict) -> list[dict]:
    """Every rank's ``record``, by global rank (a collective)."""
    if not dist.is_initialized():
        return [record]
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


class Poison(Callback):
    """NaN at one step each, where only the first stage sees it: block 0's output (``activation``, on the rank that
    holds block 0; under pipeline parallelism the last stage's loss is NaN, and so the loss broadcast to every rank),
    the loss ``training_step`` returns on global rank 0 (``loss``; under pipeline parallelism after the broadcast, so
    the other stage's rank sees a finite loss: what the guard's agreement must reach), and a gradient of block 0
    before the optimizer step (``gradient``: every loss finite; clipping spreads the non-finite norm to every
    stage, so every weight and the next loss turn NaN)."""

    def __init__(self, activation: int, loss: int, gradient: int) -> None:
        self.activation, self.loss, self.gradient = activation, loss, gradient

    def on_train_start(self, trainer, lm) -> None:
        blocks = dict(lm.model.layers.named_children())
        self.first = blocks.get("0")  # None on a rank without the first stage
        if self.first is not None:
            self.first.register_forward_hook(
                lambda block, args, output: output * float("nan")
                if trainer.training and trainer.global_step == self.activation else None)
        step = lm.training_step

        def training_step(batch, batch_idx):
            loss = step(batch, batch_idx)
            return loss * float("nan") if trainer.global_step == self.loss and trainer.global_rank == 0 else loss

        lm.training_step = training_step

    def on_before_optimizer_step(self, trainer, lm, optimizer) -> None:
        if self.first is not None and trainer.global_step == self.gradient:
            local_tensor(next(self.first.parameters()).grad).view(-1)[0] = float("nan")


def guarded(out: Path, name: str, *, devices: int, **options) -> dict:
    """One epoch under ``NonFiniteLossGuard(max_skipped_steps=2)`` with ``Poison(activation=1, loss=2,
    gradient=3)``: steps 1 and 2 skipped, step 3 applied with a NaN gradient, step 4's loss NaN on every rank, one
    skip over the budget: NonFiniteLossError. Each rank's skipped steps and error (``ranks``), gathered."""
    guard = NonFiniteLossGuard(max_skipped_steps=2)
    # A short timeout: ranks that disagree wait in mismatched collectives, which then fail instead of hanging.
    run = fit(out, name, devices=devices, epochs=1, callbacks=[guard, Poison(activation=1, loss=2, gradient=3)],
              stops=(NonFiniteLossError,), timeout=120, **options)
    mine = {"skipped": guard.skipped_steps, "stopped": run.pop("stopped")}
    return {**run, "ranks": every_rank(mine)}


class SignalOnRank(Callback):
    """SIGTERM to this process on global rank ``rank`` only, once ``global_step`` reaches ``step``: a preemption
    one rank sees (its node's agent signalled it alone)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def preempted(out: Path, name: str, *, devices: int, **options) -> dict:
    """A run SIGTERMed on global rank 1 alone at step 2, saving on preemption: every rank's ``Preempted`` (step,
    checkpoint) and the largest difference between its stages' live weights and the checkpoint's (``ranks``)."""
    from lightning_npu.strategies.checkpoints.offline import read_sharded_state_dict

    modules: list = []
    callbacks = [SignalOnRank(rank=1, step=2), GracefulPreemption(save_on_preemption=True, exit_timeout_s=None),
                 LambdaCallback(on_train_start=lambda trainer, module: modules.append(module))]
    run = fit(out, name, devices=devices, epochs=1, callbacks=callbacks, stops=(Preempted,), timeout=120, **options)
    checkpoint = out / name / "checkpoints" / "preempted-step=2.ckpt"
    saved = read_sharded_state_dict(checkpoint) if checkpoint.is_dir() else {}
    live = {f"model.{key}": local_tensor(value) for key, value in modules[0].model.state_dict().items()}
    mine = {"stopped": run.pop("stopped"), "held": sorted(live),
            "difference": max(float((saved[key] - value).abs().max()) if key in saved else float("inf")
                              for key, value in live.items())}
    return {**run, "ranks": every_rank(mine), "checkpoint": str(checkpoint)}


def fabric_fit(out: Path, devices: int, steps: int = 4, **options) -> dict:
    """A Fabric loop written for one device: 2 accumulated batches a step (``fabric.backward(loss / 2)``), clipped
    by ``fabric.clip_gradients``; the model's call with labels gives the loss."""
    from lightning.fabric import Fabric

    seed_everything(1234)
    fabric = Fabric(accelerator="npu", devices=devices, precision="32-true",
                    strategy=lightning_npu.NPUFabricFSDPStrategy(timeout=300, **options))
    fabric.launch()
    family, config, _ = MODELS["llama"]
    lm = module(family, None, **config)
    lm.configure_model()
    load_pretrained(lm.model, str(out / "init_llama.ckpt"), lm.config)
    raw = out / "init_llama_raw.pt"  # the first weights as a bare module's state dict, for fabric.load_raw
    if fabric.global_rank == 0 and not raw.exists():
        torch.save(lm.model.state_dict(), raw)
    fabric.barrier()
    model = fabric.setup(lm.model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    loader = DataLoader(Rows(steps * 2 * ROWS, seed=1), batch_size=ROWS)
    losses = []
    for index, batch in enumerate(loader):
        loss = model(batch["input_ids"].to(fabric.device), labels=batch["labels"].to(fabric.device))
        fabric.backward(loss / 2)
        if index % 2:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    # The first weights again, into the trained (sharded, split) model: the first batch's loss is the first step's.
    fabric.load_raw(raw, model)
    first = next(iter(loader))
    with torch.no_grad():
        reloaded = model(first["input_ids"].to(fabric.device), labels=first["labels"].to(fabric.device)).item()
    return {"losses": losses, "reloaded_first_loss": reloaded}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", choices=("one", "two", "four", "back"), required=True)
    args = parser.parse_args()
    out = Path(args.out)
    pp2 = dict(pipeline_parallel_size=2, pipeline_microbatches=4)
    if args.stage == "one":
        for model, (family, config, _) in MODELS.items():
            save_first_weights(out / f"init_{model}.ckpt", family, **config)
        results = {
            "plain": fit(out, "plain", devices=1, save=True),
            "plain_epoch": fit(out, "plain_epoch", devices=1, epochs=1),
            "plain_accumulate": fit(out, "plain_accumulate", devices=1, epochs=1, accumulate=2),
            "fabric_plain": fabric_fit(out, 1),
            "predict_plain": predict(out, "predict_plain", devices=1),
            "guard_plain": guarded(out, "guard_plain", devices=1),
            "lora_plain": fit(out, "lora_plain", devices=1, model="lora", save=True, state_dict_type="full"),
            "lora_full_to_plain": fit(out, "lora_full_to_plain", devices=1, model="lora",
                                      resume=str(out / "lora_plain_epoch0")),
            **{f"{model}_plain": fit(out, f"{model}_plain", devices=1, model=model, epochs=1)
               for model in ("moe", "qwen3", "deepseek", "user")},
        }
    elif args.stage == "two":
        results = {
            "pp2": fit(out, "pp2", devices=2, save=True, **pp2),
            "pp2_gpipe": fit(out, "pp2_gpipe", devices=2, epochs=1, pipeline_schedule="GPipe", **pp2),
            "pp2_interleaved": fit(out, "pp2_interleaved", devices=2, epochs=1, pipeline_schedule="Interleaved1F1B",
                                   **pp2),
            "pp2_zbv": fit(out, "pp2_zbv", devices=2, epochs=1, pipeline_schedule="ZBVZeroBubble",
                           activation_checkpointing_policy=None, **pp2),
            "pp2_accumulate": fit(out, "pp2_accumulate", devices=2, epochs=1, accumulate=2, **pp2),
            "plain_to_pp2": fit(out, "plain_to_pp2", devices=2, resume=str(out / "plain_epoch0"), **pp2),
            "pp2_full": fit(out, "pp2_full", devices=2, save=True, state_dict_type="full", callbacks=[StopAfterEpoch()],
                            **pp2),
            "pp2_full_to_pp2": fit(out, "pp2_full_to_pp2", devices=2, resume=str(out / "pp2_full_epoch0"), **pp2),
            "plain2": fit(out, "plain2", devices=2),
            "moe_plain2": fit(out, "moe_plain2", devices=2, model="moe", epochs=1),
            "fabric_pp2": fabric_fit(out, 2, **pp2),
            **{f"{model}_pp2": fit(out, f"{model}_pp2", devices=2, model=model, epochs=1, **pp2)
               for model in ("moe", "qwen3", "deepseek", "user")},
            "predict_pp2": predict(out, "predict_pp2", devices=2, **pp2),
            "predict_pp2_zbv": predict(out, "predict_pp2_zbv", devices=2, pipeline_schedule="ZBVZeroBubble", **pp2),
            "predict_cp2": predict(out, "predict_cp2", devices=2, context_parallel_size=2),
            "guard_pp2": guarded(out, "guard_pp2", devices=2, **pp2),
            "preempt_pp2": preempted(out, "preempt_pp2", devices=2, **pp2),
            "lora_pp2": fit(out, "lora_pp2", devices=2, model="lora", save=True, **pp2),
            "lora_pp2_to_pp2": fit(out, "lora_pp2_to_pp2", devices=2, model="lora",
                                   resume=str(out / "lora_pp2_epoch0"), **pp2),
        }
    elif args.stage == "back":
        # pp 2's checkpoint resumed under plain, saved again before its first step (``pp2_weights_plain``): the same
        # weights, written without the pipeline.
        save = LambdaCallback(on_train_start=lambda trainer, module: trainer.save_checkpoint(out / "pp2_weights_plain"))
        results = {"pp2_to_plain": fit(out, "pp2_to_plain", devices=1, resume=str(out / "pp2_epoch0"),
                                       callbacks=[save]),
                   "pp2_full_to_plain": fit(out, "pp2_full_to_plain", devices=1, resume=str(out / "pp2_full_epoch0"))}
    else:
        results = {
            "pp2_dp2": fit(out, "pp2_dp2", devices=4, **pp2),
            "pp2_dp2_full": fit(out, "pp2_dp2_full", devices=4, save=True, state_dict_type="full",
                                callbacks=[StopAfterEpoch()], **pp2),
            "pp2_dp2_full_to_pp2_dp2": fit(out, "pp2_dp2_full_to_pp2_dp2", devices=4,
                                           resume=str(out / "pp2_dp2_full_epoch0"), **pp2),
            "moe_pp2_ep2": fit(out, "moe_pp2_ep2", devices=4, model="moe", epochs=1, expert_parallel_size=2, **pp2),
            "pp2_to_pp2_tp2": fit(out, "pp2_to_pp2_tp2", devices=4, resume=str(out / "pp2_epoch0"),
                                  tensor_parallel_size=2, **pp2),
            "deepseek_pp2_tp2": fit(out, "deepseek_pp2_tp2", devices=4, model="deepseek", epochs=1,
                                    tensor_parallel_size=2, **pp2),
            "pp2_cp2_ring": fit(out, "pp2_cp2_ring", devices=4, epochs=1, context_parallel_size=2,
                                context_parallel_algo="ring", pipeline_schedule="ZBVZeroBubble",
                                activation_checkpointing_policy=None, **pp2),
            "pp2_cp2_ulysses": fit(out, "pp2_cp2_ulysses", devices=4, epochs=1, context_parallel_size=2, **pp2),
            "predict_pp2_cp2": predict(out, "predict_pp2_cp2", devices=4, context_parallel_size=2,
                                       context_parallel_algo="ring", **pp2),
        }
    if not dist.is_initialized() or dist.get_rank() == 0:
        (out / f"{args.stage}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
