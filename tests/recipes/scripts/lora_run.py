"""A LoRA fine-tune of the tiny recipe model on 2 simulated NPUs, for tests/recipes/test_lora.py.

    python lora_run.py OUT BASE_CKPT STRATEGY [BASE_QUANTIZATION]
        (STRATEGY: npu_ddp or npu_fsdp; 32-true; with BASE_QUANTIZATION, int8 or nf4: that base, under bf16-mixed)

Trains 2 epochs of 3 steps from ``BASE_CKPT`` (``init_from``) with adapters on every target, a checkpoint after
each epoch, then resumes a second run from the first checkpoint (step 3) to step 6. Rank 0 writes ``OUT/result.json``: per-step losses
(averaged over ranks) of both runs, whether the base weights are bit-identical to ``BASE_CKPT`` after training,
whether every adapter moved, what the step-3 checkpoint holds and its size, and what the optimizer holds. With a
quantized base the base is compared with ``quantized_base_state`` of ``BASE_CKPT``, and the result also holds each
rank's bytes of the quantized weights' local shards (codes + scales) next to the bf16 bytes of the same weights, and
the dtypes and shapes the codes and scales had inside forward (the gathered tensors).
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
from recipes.decoder.lora import initial_adapter_state, is_adapter_name, quantized_base_state
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


class GatheredDtypes(Callback):
    """The dtype and shape of block 0's wq codes and scales as its forward sees them (a quantized base only)."""

    def __init__(self) -> None:
        self.seen = {}

    def on_train_start(self, trainer, pl_module) -> None:
        wq = pl_module.model.layers[0].attention.wq
        if not hasattr(wq, "weight_codes"):
            return

        def record(module, args) -> None:
            for name in ("weight_codes", "weight_scales"):
                tensor = getattr(module, name)
                self.seen[name] = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]

        wq.register_forward_pre_hook(record)


def quantized_bytes(model) -> dict:
    """This rank's bytes of the quantized weights' local shards, the bf16 bytes of those weights' shards, and the
    bytes of all its parameter shards."""
    codes = scales = bf16 = every = 0
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        every += local.numel() * local.element_size()
        if name.endswith(".weight_codes"):
            codes += local.numel() * local.element_size()
            columns = param.shape[1] * (2 if local.dtype == torch.uint8 else 1)  # nf4: two codes per byte
            bf16 += local.shape[0] * columns * 2
        elif name.endswith(".weight_scales"):
            scales += local.numel() * local.element_size()
    return {"codes": codes, "scales": scales, "bf16": bf16, "all": every}


def fit(out: Path, base: str, strategy: str, quantization=None, ckpt_path=None):
    seed_everything(SEED)
    lora = {**LORA, "base_quantization": quantization}
    model = DecoderLM(preset="tiny", learning_rate=1e-2, warmup_steps=0, weight_decay=0.0, init_from=base, lora=lora)
    losses, gathered = Losses(), GatheredDtypes()
    checkpoints = ModelCheckpoint(dirpath=out / "checkpoints", every_n_epochs=1, save_top_k=-1)
    trainer = Trainer(
        accelerator="npu", devices=2, strategy=strategy, precision="bf16-mixed" if quantization else "32-true",
        max_epochs=2, callbacks=[losses, checkpoints, gathered], logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, train_dataloaders=batches(model.config.vocab_size), ckpt_path=ckpt_path)
    return trainer, model, losses.losses, gathered.seen


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def main() -> None:
    out, base, strategy = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    quantization = sys.argv[4] if len(sys.argv) > 4 else None
    trainer, model, losses, gathered = fit(out, base, strategy, quantization)
    shard_bytes = [None] * trainer.world_size
    torch.distributed.all_gather_object(shard_bytes, quantized_bytes(model.model))
    weights = get_model_state_dict(model.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    optimizer = trainer.optimizers[0]
    trainable = {id(p) for p in model.model.parameters() if p.requires_grad}
    optimizer_params = [p for group in optimizer.param_groups for p in group["params"]]
    step3 = out / "checkpoints" / "epoch=0-step=3.ckpt"
    trainer.strategy.barrier()
    _, resumed_model, resumed, _ = fit(out / "resumed", base, strategy, quantization, ckpt_path=str(step3))
    if trainer.global_rank != 0:
        return

    reference = quantized_base_state(read_model_tensors(base)[1], model.config, model.lora)
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
        "shard_bytes": shard_bytes,
        "gathered": gathered,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
