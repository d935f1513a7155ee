"""Fabric checkpoint round trips on 2 simulated NPUs, in one launch (driven by tests/strategies/test_checkpoints.py).

1. state_dict_type="full", plain SGD (an optimizer with no state): 6 steps saving at step 3, then a fresh model and
   optimizer load that file and redo steps 4-6.
2. async_save=True, sharded, AdamW: the same with a background save, loaded after ``wait_for_checkpoint()``.
3. ``fabric.load_raw`` of the sharded directory into a bare module: the error message.
4. ``fabric.save(..., filter=...)`` with the sharded strategy: the error message, and what exists at the path.
5. async_save=True, two saves, each followed at once by an in-place change of every weight and optimizer state
   tensor, which the background write waits for: what DCP writes from (the host buffers' addresses) and what
   the checkpoints hold.
Rank 0 writes ``<out>/result.json`` with the per-step losses of each part, the optimizer steps part 1 took, the
error texts and part 5's findings.
"""

import argparse
import json
import threading
from pathlib import Path

import torch
from lightning.fabric import Fabric, seed_everything
from torch.distributed.checkpoint import filesystem
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

import lightning_npu
from lightning_npu.strategies.checkpoints.offline import read_sharded
from tests.strategies.scripts.fabric_run import train
from tests.strategies.scripts.trainer_run import Block, Net


def round_trip(fabric, make_optimizer, path, steps_taken=None):
    """Losses of steps 4-6: uninterrupted (saving at step 3), then resumed from the step-3 checkpoint.
    ``steps_taken`` (a list) gets one entry per step of the uninterrupted run's optimizer, the save included."""
    seed_everything(7)
    model = fabric.setup(Net())
    optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))
    if steps_taken is not None:
        optimizer.optimizer.register_step_pre_hook(lambda *args: steps_taken.append(1))
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


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def staged_saves(fabric, path):
    """Part 5: [data_ptrs DCP wrote from, per save], [max |checkpoint - values at the save call|, per save]."""
    seed_everything(9)
    model = fabric.setup(Net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    for _ in train(fabric, model, optimizer, state, 2):
        pass
    pointers, held, changed = [], [], threading.Event()
    original = filesystem._FileSystemWriter.write_data

    def write_data(self, plan, planner):
        tensors = [_local(t) for t in tree_leaves(planner.state_dict) if isinstance(t, torch.Tensor)]
        pointers.append(sorted(t.data_ptr() for t in tensors))
        held.append(tensors)  # alive: a fresh host copy for the next save cannot land on these addresses
        if not changed.wait(timeout=120):
            raise TimeoutError("the training loop never changed the weights")
        return original(self, plan, planner)

    filesystem._FileSystemWriter.write_data = write_data
    differences = []
    try:
        for _ in range(2):
            parameters = dict(model.module.named_parameters())  # the names without Fabric's wrapper
            named = {f"model.{n}": p for n, p in parameters.items()}
            named.update({f"optimizer.{n}.{k}": v for n, p in parameters.items() for k, v in optimizer.state[p].items()})
            expected = {name: _full(t).detach().clone() for name, t in named.items()}
            changed.clear()
            fabric.save(path, state)
            with torch.no_grad():  # the training loop changes every tensor in place once the call returns
                for tensor in named.values():
                    _local(tensor).add_(1.0)
            changed.set()
            fabric.strategy.wait_for_checkpoint()
            if fabric.global_rank == 0:
                saved = read_sharded(path)
                found = {f"model.{n}": t for n, t in saved["model"].items()}
                found.update({f"optimizer.{n}.{k}": v for n, values in saved["optimizer"]["state"].items()
                              for k, v in values.items()})
                assert found.keys() == expected.keys(), (sorted(found), sorted(expected))
                differences.append(max(float((found[n].float() - t.float()).abs().max()) for n, t in expected.items()))
            fabric.barrier()
    finally:
        filesystem._FileSystemWriter.write_data = original
    return pointers, differences


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    result = {}

    full = lightning_npu.NPUFabricFSDPStrategy(auto_wrap_policy=[Block], state_dict_type="full", timeout=60)
    fabric = Fabric(accelerator="npu", devices=2, strategy=full)
    fabric.launch()
    result["full_sgd_steps"] = []
    result["full_sgd_reference"], result["full_sgd_resumed"] = round_trip(
        fabric, lambda params: torch.optim.SGD(params, lr=1e-2), out / "full.ckpt", result["full_sgd_steps"])
    result["full_sgd_steps"] = len(result["full_sgd_steps"])

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
    result["staged_pointers"], result["staged_differences"] = staged_saves(fabric, out / "staged.ckpt")
    if fabric.global_rank == 0:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
