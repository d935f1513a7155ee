"""Gradient accumulation with ``fabric.no_backward_sync`` on two simulated NPUs, checked against a reference.

Every process also trains an unsharded copy of the model on *every* rank's micro-batches: its gradient,
summed over micro-batches and averaged over ranks, is what a correctly synchronised step must hold.
Four optimizer steps (SGD), each ending in a backward that must reduce gradients:

0. Lightning's documented loop: two micro-batches under ``no_backward_sync(enabled=True)``, one under
   ``enabled=False``;
1. one plain backward (no context) right after that ``enabled=False`` context;
2. nested contexts: a backward inside the outer context after the inner one closed must stay local,
   then a plain backward reduces the whole accumulation;
3. one plain backward.

Rank 0 writes ``<out>/result.json``: per step the largest gradient error against the reference (inf when a
gradient is missing), the model's and the reference's losses (mean over micro-batches and ranks), and under
npu_fsdp whether any gradient had been reduced inside the outer context of step 2.
"""

import argparse
import copy
import json
from pathlib import Path

import torch
from lightning.fabric import Fabric, seed_everything
from torch import nn

import lightning_npu
from tests.strategies.scripts.fabric_run import batch
from tests.strategies.scripts.trainer_run import Block, Net

LR = 0.01


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", choices=["npu_fsdp", "npu_ddp"], default="npu_fsdp")
    args = parser.parse_args()

    if args.strategy == "npu_fsdp":
        strategy = lightning_npu.NPUFabricFSDPStrategy(auto_wrap_policy=[Block], zero_stage=3, timeout=120)
    else:
        strategy = lightning_npu.NPUFabricDDPStrategy(timeout=120)
    fabric = Fabric(accelerator="npu", devices=2, strategy=strategy)
    fabric.launch()
    seed_everything(7)
    net = Net()
    reference = copy.deepcopy(net)
    model = fabric.setup(net)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    world = fabric.world_size
    event = 0
    losses: list[list[float]] = [[]]
    reference_losses: list[list[float]] = [[]]

    def micro_batch() -> None:
        """One forward/backward on this rank's micro-batch, and on every rank's for the reference."""
        nonlocal event
        x, y = batch(event, fabric.global_rank)
        loss = nn.functional.mse_loss(model(x.to(fabric.device)), y.to(fabric.device))
        fabric.backward(loss)
        losses[-1].append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        for rank in range(world):
            x, y = batch(event, rank)
            reference_loss = nn.functional.mse_loss(reference(x), y)
            reference_loss.backward()
            reference_losses[-1].append(reference_loss.item())
        event += 1

    def finish_step() -> float:
        """Compare gradients with the reference's rank average, then step both; the largest error."""
        error = 0.0
        for param, expected in zip(model.parameters(), reference.parameters()):
            expected.grad /= world
            grad = param.grad
            if grad is None:
                error = float("inf")
                continue
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            assert grad.shape == expected.shape, (grad.shape, expected.shape)
            error = max(error, (grad.detach().cpu() - expected.grad).abs().max().item())
        error = fabric.all_reduce(torch.tensor(error, device=fabric.device), reduce_op="max").item()
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append([])
        reference_losses.append([])
        return error

    errors = []
    # 0: Lightning's documented accumulation loop.
    for enabled in (True, True, False):
        with fabric.no_backward_sync(model, enabled=enabled):
            micro_batch()
    errors.append(finish_step())
    # 1: a plain backward after an enabled=False context.
    micro_batch()
    errors.append(finish_step())
    # 2: nested contexts, then a plain backward.
    with fabric.no_backward_sync(model, enabled=True):
        micro_batch()
        with fabric.no_backward_sync(model, enabled=True):
            micro_batch()
        micro_batch()
        # FSDP2 writes a (sharded) .grad only when it reduces; DDP accumulates local grads there.
        reduced_inside = any(p.grad is not None for p in model.parameters())
    micro_batch()
    errors.append(finish_step())
    # 3: a plain backward.
    micro_batch()
    errors.append(finish_step())

    if fabric.global_rank == 0:
        result = {
            "strategy": type(fabric.strategy).__name__,
            "grad_errors": errors,
            "losses": [sum(step) / len(step) for step in losses if step],
            "reference_losses": [sum(step) / len(step) for step in reference_losses if step],
            "fsdp_reduced_inside_outer_context": reduced_inside if args.strategy == "npu_fsdp" else None,
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
