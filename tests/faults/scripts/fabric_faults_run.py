"""A Fabric loop on 2 simulated NPUs (npu_fsdp, sharded checkpoints) with FabricPreemption and
FabricNonFiniteLossGuard, the loop docs/fault-tolerance.md shows (driven by tests/faults/test_preemption.py and
tests/faults/test_nonfinite_guard.py).

``preempt``: AdamW steps of the test network from ``--resume`` (if given) to ``--steps``, rank 0 printing
``step N/`` after each. On SIGTERM / SIGUSR1 every rank saves ``<out>/ckpts/preempted-step=N`` and exits 128 +
signal; each rank first writes ``<out>/stopped_rank<r>.json`` (its step, the signal, the exit status). Rank 0
writes the full weights at the stop (``<out>/weights-at-stop.pt``) or right after ``--resume``
(``<out>/weights-at-resume.pt``), and ``<out>/result.json`` when the run ends unpreempted.

``nonfinite``: three runs in one launch, each a fresh Fabric, model and guard, saving ``step=N`` every 3 steps;
the loss is made NaN at chosen steps on chosen ranks. ``stop``: NaN at step 7 on rank 1 only, flag read every 5
steps. ``skip``: NaN at steps 4 and 5, ``max_skipped_steps=2``. ``over_budget``: the same with
``max_skipped_steps=1``. Each rank writes ``<out>/nonfinite_rank<r>.json``: per run the error, the checkpoints
saved, the skipped steps, AdamW's update counts, the step reached and whether the weights are finite.
"""

import argparse
import json
import signal
from pathlib import Path

import torch
from lightning.fabric import Fabric, seed_everything
from torch import nn

import lightning_npu
from tests.strategies.scripts.fabric_run import batch
from tests.strategies.scripts.trainer_run import Block, Net

NONFINITE_RUNS = {
    "stop": {"nan_steps": [7], "nan_ranks": [1], "max_skipped_steps": 0},
    "skip": {"nan_steps": [4, 5], "nan_ranks": [0, 1], "max_skipped_steps": 2},
    "over_budget": {"nan_steps": [4, 5], "nan_ranks": [0, 1], "max_skipped_steps": 1},
}


def setup(seed: int = 7):
    strategy = lightning_npu.NPUFabricFSDPStrategy(auto_wrap_policy=[Block], timeout=60)
    fabric = Fabric(accelerator="npu", devices=2, strategy=strategy)
    fabric.launch()
    seed_everything(seed)
    model = fabric.setup(Net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, {"model": model, "optimizer": optimizer, "step": 0}


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (gathering the shards is a collective: every rank calls it)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def train(fabric, state, steps, guard, preemption=None, save_every=None, ckpts=None, nan_steps=(), nan_ranks=()):
    model, optimizer = state["model"], state["optimizer"]
    for step in range(state["step"], steps):
        x, y = batch(step, fabric.global_rank)
        loss = nn.functional.mse_loss(model(x.to(fabric.device)).float(), y.to(fabric.device))
        if step in nan_steps and fabric.global_rank in nan_ranks:
            loss = loss * float("nan")
        fabric.backward(loss)
        if guard.skip(loss, step):
            optimizer.zero_grad()  # this step's update is not applied
        else:
            optimizer.step()
            optimizer.zero_grad()
        state["step"] = step + 1
        if save_every and state["step"] % save_every == 0:
            fabric.save(ckpts / f"step={state['step']}", state)
        if fabric.global_rank == 0:
            print(f"step {state['step']}/{steps}", flush=True)
        if preemption is not None and preemption.should_stop(state["step"]):
            path = ckpts / f"preempted-step={state['step']}"
            fabric.save(path, state)
            weights = full_weights(model)
            if fabric.global_rank == 0:
                torch.save(weights, ckpts.parent / "weights-at-stop.pt")
            preemption.exit(path)
    guard.check()


def preempt(args, out: Path) -> None:
    fabric, state = setup()
    if args.resume:
        fabric.load(args.resume, state)
        weights = full_weights(state["model"])
        if fabric.global_rank == 0:
            torch.save(weights, out / "weights-at-resume.pt")
    resumed_from = state["step"]
    guard = lightning_npu.FabricNonFiniteLossGuard(fabric, check_every_n_steps=5)
    try:
        with lightning_npu.FabricPreemption(fabric, check_every_n_steps=1) as preemption:
            train(fabric, state, args.steps, guard, preemption, ckpts=out / "ckpts")
    except lightning_npu.Preempted as stop:
        record = {"step": stop.step, "signal": signal.Signals(stop.signum).name, "code": stop.code}
        (out / f"stopped_rank{fabric.global_rank}.json").write_text(json.dumps(record))
        raise
    if fabric.global_rank == 0:
        (out / "result.json").write_text(json.dumps({"resumed_from": resumed_from, "step": state["step"]}))


def nonfinite(out: Path) -> None:
    results = {}
    for name, run in NONFINITE_RUNS.items():
        fabric, state = setup()
        ckpts = out / name
        guard = lightning_npu.FabricNonFiniteLossGuard(fabric, max_skipped_steps=run["max_skipped_steps"],
                                                       check_every_n_steps=5)
        error = None
        try:
            train(fabric, state, 12, guard, save_every=3, ckpts=ckpts, nan_steps=run["nan_steps"],
                  nan_ranks=run["nan_ranks"])
        except lightning_npu.NonFiniteLossError as err:
            error = f"{type(err).__name__}: {err}"
        optimizer_state = state["optimizer"].state.values()
        results[name] = {
            "error": error,
            "saved": sorted(p.name for p in ckpts.glob("step=*")),
            "skipped": guard.skipped_steps,
            "updates": sorted({int(s["step"]) for s in optimizer_state if "step" in s}),
            "step": state["step"],
            "finite": all(bool(t.isfinite().all()) for t in full_weights(state["model"]).values()),
        }
    (out / f"nonfinite_rank{fabric.global_rank}.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["preempt", "nonfinite"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.mode == "preempt":
        preempt(args, out)
    else:
        nonfinite(out)


if __name__ == "__main__":
    main()
