"""A LoRA fine-tune of the tiny recipe model on 2 simulated NPUs, for tests/test_lora.py.

    python lora_run.py OUT BASE_CKPT STRATEGY      (STRATEGY: npu_ddp or npu_fsdp; 32-true)

Trains 2 epochs of 3 steps from ``BASE_CKPT`` (``init_from``) with adapters on every target, a checkpoint after
each epoch, then resumes a second run from the first checkpoint (step 3) to step 6. Rank 0 writes ``OUT/result.json``: per-step losses
(averaged over ranks) of both runs, whether the base weights are bit-identical to ``BASE_CKPT`` after training,
whether every adapter moved, what the step-3 checkpoint holds and its size, and what the optimizer holds.
"""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader

import lightning_npu  # noqa: F401  (registers the npu accelerator and strategies)
from recipes.decoder.checkpoint_layout import read_model_tensors
from recipes.decoder.lora import initial_adapter_state, is_adapter_name
from recipes.decoder.module import DecoderLM

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}
SEED = 11


class Losses(Callback):
    def __init__(self) -> None:
        self.losses = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
        self.losses[trainer.global_step - 1] = loss.item()


def batches(vocab: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (12, 33), generator=generator)  # 3 steps per epoch on 2 ranks
    samples = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    return DataLoader(samples, batch_size=2)


def fit(out: Path, base: str, strategy: str, ckpt_path=None):
    seed_everything(SEED)
    model = DecoderLM(preset="tiny", learning_rate=1e-2, warmup_steps=0, weight_decay=0.0, init_from=base, lora=LORA)
    losses = Losses()
    checkpoints = ModelCheckpoint(dirpath=out / "checkpoints", every_n_epochs=1, save_top_k=-1)
    trainer = Trainer(
        accelerator="npu", devices=2, strategy=strategy, precision="32-true", max_epochs=2,
        callbacks=[losses, checkpoints], logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, train_dataloaders=batches(model.config.vocab_size), ckpt_path=ckpt_path)
    return trainer, model, losses.losses


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def main() -> None:
    out, base, strategy = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    trainer, model, losses = fit(out, base, strategy)
    weights = get_model_state_dict(model.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    optimizer = trainer.optimizers[0]
    trainable = {id(p) for p in model.model.parameters() if p.requires_grad}
    optimizer_params = [p for group in optimizer.param_groups for p in group["params"]]
    step3 = out / "checkpoints" / "epoch=0-step=3.ckpt"
    trainer.strategy.barrier()
    _, resumed_model, resumed = fit(out / "resumed", base, strategy, ckpt_path=str(step3))
    if trainer.global_rank != 0:
        return

    reference = read_model_tensors(base)[1]
    initial = initial_adapter_state(model.config, model.lora, SEED)
    saved_metadata, saved = read_model_tensors(step3)
    result = {
        "losses": [losses[s] for s in sorted(losses)],
        "resumed_losses": {str(s): v for s, v in resumed.items()},
        "base_identical": sorted(k for k in reference if torch.equal(weights[k], reference[k])) == sorted(reference),
        "base_keys": len(reference),
        "adapters_moved": all(not torch.equal(weights[k], initial[k]) for k in initial),
        "adapter_keys": len(initial),
        "trained_keys": sorted(k for k in weights if k not in reference) == sorted(initial),
        "optimizer_holds_only_adapters": len(optimizer_params) == len(trainable)
        and all(id(p) in trainable for p in optimizer_params),
        "checkpoint_keys": sorted(saved),
        "checkpoint_bytes": size_of(step3),
        "checkpoint_lora": saved_metadata["hyper_parameters"]["lora"],
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
