"""Every checkpoint form Lightning writes, read back by npu_fsdp, in 2 processes started by torchrun (driven by
tests/strategies/test_checkpoints.py).

1. npu_ddp trains 6 steps and saves a standard checkpoint at step 3; npu_fsdp (state_dict_type="full") does the
   same, and also saves a weights-only checkpoint there (``save_checkpoint(..., weights_only=True)``) and one through
   ``ModelCheckpoint(save_weights_only=True)``.
2. test / validate / predict from the weights-only checkpoints; fit from one (it must fail, naming the cause).
3. npu_fsdp resumes steps 4-6 from npu_ddp's standard checkpoint and from a full checkpoint whose optimizer state is
   keyed by parameter name (as npu_fsdp wrote them before), as npu_ddp resumes from its own.
4. A sharded checkpoint evaluated with ``trainer.test(ckpt_path=...)`` inside ``torch.inference_mode()``.
Writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import lightning_npu
from lightning_npu.optim import AdamW8bit
from tests.strategies.scripts.trainer_run import Block, Regression, data

STEPS = 6
SAVE_AT = 3


class Evaluated(Regression):
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x).float(), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()


class SaveAt(Callback):
    """``trainer.save_checkpoint`` of each (path, weights_only) once ``SAVE_AT`` optimizer steps are done."""

    def __init__(self, *saves: tuple[Path, bool]) -> None:
        self.saves = saves

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == SAVE_AT:
            for path, weights_only in self.saves:
                trainer.save_checkpoint(path, weights_only=weights_only)


def trainer(strategy: str, state_dict_type: str = "full", **kwargs) -> Trainer:
    if strategy == "npu_fsdp":
        chosen = lightning_npu.NPUFSDPStrategy(auto_wrap_policy={Block}, state_dict_type=state_dict_type, timeout=120)
    else:
        chosen = lightning_npu.NPUDDPStrategy(timeout=120)
    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(accelerator="npu", devices=2, strategy=chosen, max_steps=STEPS, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2, limit_test_batches=2,
                   limit_predict_batches=2, num_sanity_val_steps=0, **kwargs)


def fit(strategy: str, ckpt_path=None, state_dict_type: str = "full", **kwargs) -> tuple[Trainer, Evaluated]:
    seed_everything(7 if ckpt_path is None else 8)  # a resumed run gets its step-3 weights from the checkpoint only
    run = trainer(strategy, state_dict_type, **kwargs)
    model = Evaluated()
    run.fit(model, train_dataloaders=data(), val_dataloaders=data(16), ckpt_path=ckpt_path)
    return run, model


def test_loss(run: Trainer, ckpt_path) -> float:
    return run.test(Evaluated(), dataloaders=data(16), ckpt_path=ckpt_path, verbose=False)[0]["test_loss"]


def main() -> None:
    out = Path(sys.argv[1])
    result: dict = {}
    ddp, model = fit("npu_ddp", callbacks=[SaveAt((out / "ddp.ckpt", False))])
    result["ddp_losses"] = model.losses
    result["ddp_test_loss_at_save"] = test_loss(trainer("npu_ddp"), out / "ddp.ckpt")

    weights_dir = out / "weights_only"
    fsdp, model = fit("npu_fsdp", enable_checkpointing=True, callbacks=[
        SaveAt((out / "full.ckpt", False), (out / "weights.ckpt", True)),
        ModelCheckpoint(dirpath=weights_dir, filename="w-{step}", save_weights_only=True, every_n_train_steps=SAVE_AT,
                        save_top_k=-1),
    ])
    result["fsdp_losses"] = model.losses
    state = fsdp.strategy.optimizer_state(fsdp.optimizers[0])
    result["optimizer_state_keys"] = sorted(state.get("state", {}))
    result["optimizer_state_entries"] = sorted(state)
    # An optimizer without state (SGD without momentum) takes another path through optimizer_state; AdamW8bit
    # converts its state to the full form (its moments dequantized) after one step on zero gradients.
    parameters = list(fsdp.strategy.model.parameters())
    stateless = torch.optim.SGD(parameters, lr=0.1)
    result["stateless_optimizer_state_entries"] = sorted(fsdp.strategy.optimizer_state(stateless))
    eight_bit = AdamW8bit(parameters, lr=1e-3)
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    eight_bit.step()
    eight_bit_state = fsdp.strategy.optimizer_state(eight_bit)
    fsdp.strategy.model.zero_grad(set_to_none=True)
    result["adamw8bit_optimizer_state_entries"] = sorted(eight_bit_state)
    result["adamw8bit_optimizer_state_keys"] = sorted(eight_bit_state.get("state", {}))

    # Evaluation from weights-only checkpoints, on a new Trainer and on the one that trained.
    evaluate = trainer("npu_fsdp")
    result["test_loss_from_weights_only"] = test_loss(evaluate, out / "weights.ckpt")
    result["test_loss_from_model_checkpoint"] = test_loss(evaluate, weights_dir / f"w-step={SAVE_AT}.ckpt")
    result["test_loss_from_weights_only_after_fit"] = test_loss(fsdp, out / "weights.ckpt")
    result["val_loss_from_weights_only"] = evaluate.validate(
        Evaluated(), dataloaders=data(16), ckpt_path=out / "weights.ckpt", verbose=False)[0]["val_loss"]
    result["predictions"] = len(evaluate.predict(Evaluated(), dataloaders=data(16), ckpt_path=out / "weights.ckpt"))
    try:
        fit("npu_fsdp", ckpt_path=out / "weights.ckpt")
        result["fit_from_weights_only"] = "no error"
    except KeyError as error:
        result["fit_from_weights_only"] = str(error)

    # Resume from a standard (index-keyed) checkpoint and from a name-keyed one.
    # Lightning's own reference: npu_ddp resuming from its checkpoint (saved in the last batch of epoch 0).
    result["ddp_resumed"] = fit("npu_ddp", ckpt_path=out / "ddp.ckpt")[1].losses
    result["resumed_from_ddp"] = fit("npu_fsdp", ckpt_path=out / "ddp.ckpt")[1].losses
    checkpoint = torch.load(out / "full.ckpt", map_location="cpu", weights_only=False)
    result["full_checkpoint_state_keys"] = sorted(checkpoint["optimizer_states"][0]["state"])
    names = [name for name, _ in Evaluated().named_parameters()]
    by_index = checkpoint["optimizer_states"][0]
    checkpoint["optimizer_states"][0] = {
        "state": {names[index]: value for index, value in by_index["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in by_index["param_groups"]],
    }
    if fsdp.global_rank == 0:
        torch.save(checkpoint, out / "by_name.ckpt")
    fsdp.strategy.barrier()
    result["resumed_from_name_keyed"] = fit("npu_fsdp", ckpt_path=out / "by_name.ckpt")[1].losses

    # A sharded checkpoint evaluated from inside torch.inference_mode().
    fit("npu_fsdp", state_dict_type="sharded", callbacks=[SaveAt((out / "sharded.ckpt", False))])
    with torch.inference_mode():
        result["test_loss_from_sharded_in_inference_mode"] = test_loss(trainer("npu_fsdp", "sharded"), out / "sharded.ckpt")
    Path(out, f"rank{fsdp.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
