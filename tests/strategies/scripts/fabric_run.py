"""One Fabric run on the simulated NPUs (driven by the integration tests through a subprocess).

Trains ``--steps`` AdamW steps of the test network, optionally resuming from / saving to a checkpoint,
and writes ``<out>/result.json`` (per-step losses averaged over ranks, Linear output dtypes, the losses of a second
Fabric made in the launched process and trained from the same seed) from rank 0
and ``<out>/fraction_rank<r>.json`` (share of parameter elements held) from each rank.
"""

import argparse
import json
from pathlib import Path

import torch
from lightning.fabric import Fabric, seed_everything
from torch import nn

import lightning_npu
from tests.strategies.scripts.trainer_run import Block, Net, sharded_fraction


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 32, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def train(fabric, model, optimizer, state, steps):
    """AdamW steps from ``state["step"]`` to ``steps``; yields the rank-averaged losses so far after each."""
    losses = []
    for step in range(state["step"], steps):
        x, y = batch(step, fabric.global_rank)
        loss = nn.functional.mse_loss(model(x.to(fabric.device)).float(), y.to(fabric.device))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        state["step"] = step + 1
        yield losses


def setup(precision: str, *, launch: bool):
    """A Fabric on 2 simulated NPUs with the seeded test network and its AdamW set up. A second Fabric in an already
    launched process is made as Lightning's FSDP tests make one: ``_launched = True`` in place of another
    ``launch()``."""
    strategy = lightning_npu.NPUFabricFSDPStrategy(auto_wrap_policy=[Block], zero_stage=3, timeout=120)
    fabric = Fabric(accelerator="npu", devices=2, strategy=strategy, precision=precision)
    if launch:
        fabric.launch()
    else:
        fabric._launched = True
    seed_everything(7)
    model = fabric.setup(Net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    fabric, model, optimizer = setup(args.precision, launch=True)
    dtypes: set[str] = set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda _m, _i, out: dtypes.add(str(out.dtype)))

    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
    losses = []
    for losses in train(fabric, model, optimizer, state, args.steps):
        if args.save and state["step"] == args.save_at:
            fabric.save(args.save, state)

    second_fabric, second_model, second_optimizer = setup(args.precision, launch=False)
    second_losses = []
    for second_losses in train(second_fabric, second_model, second_optimizer, {"step": 0}, args.steps):
        pass

    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"fraction_rank{fabric.global_rank}.json").write_text(json.dumps(sharded_fraction(model)))
    if fabric.global_rank == 0:
        result = {"losses": losses, "linear_dtypes": sorted(dtypes), "strategy": type(fabric.strategy).__name__,
                  "second_fabric_losses": second_losses}
        (Path(args.out) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
