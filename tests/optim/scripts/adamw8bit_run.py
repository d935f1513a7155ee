"""The tiny LLaMA-2 recipe (its module and text data) under npu_fsdp with torch's AdamW and with AdamW8bit, for the
loss-parity, state-bytes, resume and resharding tests (tests/optim/test_adamw8bit_recipe.py).

``--phase train`` (2 ranks): for each ``--variants`` entry, a fit of ``--steps`` steps from one seed, recording every
step's loss; the AdamW8bit run also records each rank's optimizer-state bytes and saves a sharded checkpoint
``--resume-at`` steps in, from which a second fit resumes to ``--steps`` (its losses recorded). The variant
``per_tensor`` is AdamW8bit with the quantizer deliberately broken: one absmax for the whole local shard instead of
one per block (the negative control of the parity check).

``--phase reshard`` (run on 1 rank): restores the 2-rank sharded checkpoint ``--ckpt`` (resharded by DCP) and, in
a second fit, the full file ``--full`` (``lightning-npu consolidate``'s output); dumps the restored optimizer state
of each, dequantized to fp32, and saves a ``state_dict_type="full"`` checkpoint after one more step.

Writes ``<out>/<phase>_rank<r>.json`` (and ``.pt`` state dumps from the reshard phase).
"""

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_npu import NPUFSDPStrategy
from lightning_npu.quant import blockwise
from lightning_npu.optim.adamw8bit import full_state
from recipes.decoder.data import TextDataModule
from recipes.decoder.module import DecoderLM


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"].detach()))


class DumpRestoredState(Callback):
    """Saves the optimizer state as restored from the checkpoint before the first step (one rank: local tensors
    are whole), dequantized to fp32 and numbered as ``optimizer.state_dict()`` numbers parameters."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {i: {k: _local(v) for k, v in optimizer.state[p].items()} for i, p in enumerate(params)}
        torch.save(full_state({"state": state, "param_groups": []})["state"], self.path)


def _local(tensor):
    return tensor.to_local().clone() if hasattr(tensor, "to_local") else tensor.clone()


def per_tensor_quantize(values, block_size, signed):
    """The broken quantizer: every block scaled by the shard's absmax (codes and scales stored as the real one)."""
    codes, scales = REAL_QUANTIZE(values.reshape(1, -1), values.numel(), signed)
    return codes.reshape(values.shape), scales.expand(values.numel() // block_size).clone()


REAL_QUANTIZE = blockwise.quantize
RANK = [0]  # this process's rank (the process group is gone once a fit ends)


def module_and_data(optimizer: str, args):
    seed_everything(1234)
    module = DecoderLM(preset="tiny", learning_rate=3e-3, warmup_steps=20, weight_decay=0.1, optimizer=optimizer)
    data = TextDataModule(seq_len=args.seq_len, batch_size=args.batch_size, val_fraction=0.0, cache_dir=args.cache_dir)
    return module, data


def fit(args, optimizer, devices, callbacks, ckpt_path=None, max_steps=None, **strategy):
    module, data = module_and_data(optimizer, args)
    trainer = Trainer(
        accelerator="npu", devices=devices, strategy=NPUFSDPStrategy(**strategy), precision="32-true",
        gradient_clip_val=1.0, max_steps=max_steps or args.steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=callbacks, default_root_dir=args.out, limit_val_batches=0,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    RANK[0] = trainer.global_rank
    return trainer, module


def state_bytes(optimizer) -> dict[str, int]:
    """Bytes of optimizer state on this rank (local shards), and the local elements of the 8-bit parameters."""
    total = quantized_numel = fp32_numel = 0
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if key != "step":
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
        local_numel = (param.to_local() if hasattr(param, "to_local") else param).numel()
        if "exp_avg_codes" in state:
            quantized_numel += local_numel
        else:
            fp32_numel += local_numel
    return {"state_bytes": total, "quantized_numel": quantized_numel, "fp32_numel": fp32_numel}


def train_phase(args) -> dict:
    result = {}
    for variant in args.variants:
        blockwise.quantize = per_tensor_quantize if variant == "per_tensor" else REAL_QUANTIZE
        record = Record()
        callbacks = [record]
        if variant == "adamw8bit":
            callbacks.append(ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=args.resume_at,
                                             save_top_k=-1, filename="step{step}", auto_insert_metric_name=False))
        trainer, module = fit(args, "adamw" if variant == "adamw" else "adamw8bit", 2, callbacks)
        result[variant] = {"losses": record.losses}
        if variant == "adamw8bit":
            result[variant].update(state_bytes(trainer.optimizers[0]))
            ckpt = args.out / "ckpt" / f"step{args.resume_at}.ckpt"
            resumed = Record()
            fit(args, "adamw8bit", 2, [resumed], ckpt_path=str(ckpt))
            result[variant]["resumed_losses"] = resumed.losses
            result[variant]["checkpoint"] = str(ckpt)
    blockwise.quantize = REAL_QUANTIZE
    return result


def reshard_phase(args) -> dict:
    fit(args, "adamw8bit", 1, [DumpRestoredState(args.out / "from_sharded.pt")], ckpt_path=args.ckpt,
        max_steps=args.resume_at + 1)
    trainer, _ = fit(args, "adamw8bit", 1, [DumpRestoredState(args.out / "from_full.pt")], ckpt_path=args.full,
                     max_steps=args.resume_at + 1, state_dict_type="full")
    trainer.save_checkpoint(args.out / "full_after.ckpt")
    return {"optimizer": type(trainer.optimizers[0]).__name__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=("train", "reshard"), required=True)
    parser.add_argument("--variants", nargs="+", default=["adamw", "adamw8bit", "per_tensor"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--resume-at", type=int, default=190)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--cache-dir", required=True, help="a token cache prepared for these --seq-len settings")
    parser.add_argument("--ckpt")
    parser.add_argument("--full")
    args = parser.parse_args()
    result = train_phase(args) if args.phase == "train" else reshard_phase(args)
    (args.out / f"{args.phase}_rank{RANK[0]}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
