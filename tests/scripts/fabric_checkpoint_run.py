"""Fabric checkpoint round trips on 2 simulated NPUs, in one launch (driven by tests/test_checkpoints.py).

1. state_dict_type="full", plain SGD (an optimizer with no state): 6 steps saving at step 3, then a fresh model and
   optimizer load that file and redo steps 4-6.
2. async_save=True, sharded, AdamW: the same with a background save, loaded after ``wait_for_checkpoint()``.
3. ``fabric.load_raw`` of the sharded directory into a bare module: the error message.
4. ``fabric.save(..., filter=...)`` with the sharded strategy: the error message, and what exists at the path.
Rank 0 writes ``<out>/result.json`` with the per-step losses of each part and the error texts.
"""

import argparse
import json
from pathlib import Path

import torch
from lightning.fabric import Fabric, seed_everything

import lightning_npu
from tests.scripts.fabric_run import train
from tests.scripts.trainer_run import Block, Net


def round_trip(fabric, make_optimizer, path):
    """Losses of steps 4-6: uninterrupted (saving at step 3), then resumed from the step-3 checkpoint."""
    seed_everything(7)
    model = fabric.setup(Net())
    optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    for losses in train(fabric, model, optimizer, state, 6):
        if state["step"] == 3:
            fabric.save(path, state)
    reference = losses[3:]

    seed_everything(8)  # different initial weights: only the checkpoint can bring the step-3 ones back
    model = fabric.setup(Net())
    optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    assert state["step"] == 3, state["step"]
    for losses in train(fabric, model, optimizer, state, 6):
        pass
    return reference, losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    result = {}

    full = lightning_npu.NPUFabricFSDPStrategy(auto_wrap_policy=[Block], state_dict_type="full", timeout=60)
    fabric = Fabric(accelerator="npu", devices=2, strategy=full)
    fabric.launch()
    result["full_sgd_reference"], result["full_sgd_resumed"] = round_trip(
        fabric, lambda params: torch.optim.SGD(params, lr=1e-2), out / "full.ckpt")

    sharded = lightning_npu.NPUFabricFSDPStrategy(auto_wrap_policy=[Block], async_save=True, timeout=60)
    fabric = Fabric(accelerator="npu", devices=2, strategy=sharded)
    fabric.launch()
    result["async_reference"], result["async_resumed"] = round_trip(
        fabric, lambda params: torch.optim.AdamW(params, lr=1e-2), out / "sharded.ckpt")

    try:
        fabric.load_raw(out / "sharded.ckpt", fabric.setup(Net()))
    except IsADirectoryError as error:
        result["load_raw_error"] = str(error)
    fabric.strategy.wait_for_checkpoint()

    try:
        fabric.save(out / "filtered.ckpt", {"model": fabric.setup(Net())}, filter={"model": lambda key, _: "head" in key})
    except NotImplementedError as error:
        result["filtered_error"] = str(error)
    fabric.barrier()
    result["filtered_written"] = sorted(p.name for p in out.iterdir() if "filtered" in p.name)  # temporaries too
    if fabric.global_rank == 0:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
