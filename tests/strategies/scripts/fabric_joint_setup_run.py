"""Fabric's joint setup, ``model, optimizer = fabric.setup(model, optimizer)`` with the optimizer made from the
unsharded model, under npu_ddp and npu_fsdp in the same 2 processes (started by torchrun; driven by
tests/strategies/test_fabric.py).

Per strategy: 4 AdamW steps with gradient clipping from an optimizer that already took one step (and so holds
moments) before setup, every rank on the same first batch; then under npu_fsdp a sharded and a full checkpoint of
the pair written after step 2 and loaded into a freshly set-up pair, which redoes steps 3-4. Writes
``<out>/rank<r>.json``: the per-step losses (this rank's), the resumed losses, whether the sharded weights changed,
and the keys of the full checkpoint's optimizer state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric, seed_everything
from torch import nn

import lightning_npu
from tests.strategies.scripts.fabric_run import batch
from tests.strategies.scripts.trainer_run import Block, Net

STEPS = 4
SAVE_AT = 2


def strategy(name: str, state_dict_type: str = "sharded"):
    if name == "npu_ddp":
        return lightning_npu.NPUFabricDDPStrategy(timeout=120)
    return lightning_npu.NPUFabricFSDPStrategy(auto_wrap_policy=[Block], state_dict_type=state_dict_type, timeout=120)


def jointly_set_up(fabric: Fabric):
    """A model and an AdamW optimizer made from it, which takes one step before setup (same batch on every rank)."""
    seed_everything(7)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch(100, 0)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    return fabric.setup(model, optimizer)


def train(fabric: Fabric, model, optimizer, start: int, stop: int, save=None) -> list[float]:
    losses = []
    for step in range(start, stop):
        x, y = batch(step, fabric.global_rank)
        loss = nn.functional.mse_loss(model(x.to(fabric.device)), y.to(fabric.device))
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if save is not None and step + 1 == SAVE_AT:
            save(model, optimizer)
    return losses


def full_weights(model) -> list[torch.Tensor]:
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


RUNS = {"npu_ddp": None, "npu_fsdp": "sharded", "npu_fsdp_full": "full"}


def main() -> None:
    out = Path(sys.argv[1])
    result: dict = {}
    for run, layout in RUNS.items():
        fabric = Fabric(accelerator="npu", devices=2, strategy=strategy(run.removesuffix("_full"), layout or "sharded"))
        fabric.launch()
        model, optimizer = jointly_set_up(fabric)
        before = full_weights(model)

        def save(model, optimizer, layout=layout, fabric=fabric):
            if layout is not None:
                fabric.save(out / f"{layout}.ckpt", {"model": model, "optimizer": optimizer})

        losses = train(fabric, model, optimizer, 0, STEPS, save)
        after = full_weights(model)
        result[run] = {"losses": losses, "weights_changed": all(not torch.equal(a, b) for a, b in zip(before, after))}
        fabric.barrier()
    # Resume from each checkpoint into a freshly (jointly) set-up pair with other initial weights.
    for run, layout in RUNS.items():
        if layout is None:
            continue
        fabric = Fabric(accelerator="npu", devices=2, strategy=strategy("npu_fsdp", layout))
        fabric.launch()
        seed_everything(8)
        model = Net()
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        fabric.load(out / f"{layout}.ckpt", {"model": model, "optimizer": optimizer})
        result[run]["resumed"] = train(fabric, model, optimizer, SAVE_AT, STEPS)
    full = torch.load(out / "full.ckpt", map_location="cpu", weights_only=False)
    result["full_optimizer_state_keys"] = sorted(full["optimizer"]["state"])
    result["full_optimizer_group_params"] = [group["params"] for group in full["optimizer"]["param_groups"]]
    plain = Net()
    plain.load_state_dict(full["model"])
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_optimizer.load_state_dict(full["optimizer"])  # a regular model's optimizer takes it as it is
    result["plain_optimizer_state_size"] = len(plain_optimizer.state)
    Path(out, f"rank{fabric.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
