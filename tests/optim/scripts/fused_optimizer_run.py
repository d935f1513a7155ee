"""The LLaMA-2 recipe module under npu_fsdp (2 simulated NPUs, bf16-mixed, gradient clipping) with the runtime's
fused-optimizer choice turned on, as on real NPUs: fused AdamW must step FSDP2's DTensor parameters.

Writes ``<out>/result_rank<r>.json``: the optimizer's ``fused`` setting, parameter / state types, steps, losses.
"""

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_npu.runtime.simulated import SimulatedRuntime
from recipes.decoder.module import DecoderLM


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"].detach()))


def batches(n: int, seq_len: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, seq_len + 1), generator=g)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    SimulatedRuntime.fused_optimizer = True  # what NPURuntime says; the simulation itself keeps torch's default
    seed_everything(0)
    module = DecoderLM(preset="tiny", config={"n_layers": 2, "max_seq_len": 32}, warmup_steps=1, learning_rate=1e-3)
    record = Record()
    trainer = Trainer(
        accelerator="npu", devices=2, strategy="npu_fsdp", precision="bf16-mixed", gradient_clip_val=1.0,
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[record],
    )
    data = DataLoader(batches(3, 16, module.config.vocab_size), batch_size=None)
    trainer.fit(module, data)
    optimizer = trainer.optimizers[0]
    param = next(module.model.parameters())
    state = optimizer.state[param]
    result = {
        "fused": optimizer.defaults["fused"],
        "param_type": type(param).__name__,
        "exp_avg_type": type(state["exp_avg"]).__name__,
        "step": float(state["step"]),
        "losses": record.losses,
    }
    (args.out / f"result_rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
