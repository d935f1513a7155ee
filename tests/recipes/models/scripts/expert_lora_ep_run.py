"""LoRA on the stacked experts under expert parallelism, 4 simulated NPUs: the tiny MoE model with adapters on
attention and on every expert projection, trained 10 steps in a Fabric loop with expert_parallel_size 1 and 2
(same first weights, data and global batch). Rank 0 writes ``<out>/result.json``: each run's per-step losses
(averaged over ranks) and the local shape of layer 0's expert_gate A."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.fabric import Fabric, seed_everything

import lightning_npu
from recipes.decoder.lora import LoRAConfig, add_lora
from recipes.models.moe.config import MoEConfig
from recipes.models.moe.model import MoE

STEPS, SEQ, BATCH = 10, 32, 2
CONFIG = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=8, top_k=2, expert_hidden_dim=32,
              max_seq_len=SEQ)
LORA = LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "expert_gate", "expert_up", "expert_down"))


def fit(ep: int) -> dict:
    seed_everything(1234)
    fabric = Fabric(accelerator="npu", devices=4, precision="32-true",
                    strategy=lightning_npu.NPUFabricFSDPStrategy(expert_parallel_size=ep, timeout=300))
    fabric.launch()
    torch.manual_seed(0)
    model = add_lora(MoE(MoEConfig.from_preset("tiny", **CONFIG)), LORA)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2))
    rows = torch.randint(0, 2048, (16, SEQ + 1), generator=torch.Generator().manual_seed(0))
    pick = torch.randint(0, 16, (STEPS, 4, BATCH), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(STEPS):
        batch = rows[pick[step, fabric.global_rank]]
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    a = model.layers[0].feed_forward.experts.adapters["w_gate_up"].lora_a["expert_gate"].weight
    local = a.to_local() if hasattr(a, "to_local") else a
    return {"losses": losses, "rank": fabric.global_rank, "a_local_shape": list(local.shape)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    results = {"ep1": fit(1), "ep2": fit(2)}
    if results["ep1"]["rank"] == 0:
        (out / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
