"""Training stall per checkpoint save, blocking vs ``async_save=True``, npu_fsdp on 2 simulated NPUs, against the
floor: one plain copy of the rank's state into host memory allocated (and written) before.

Cases (each a stack of Linear(``--width``, ``--width``) layers, each its own FSDP unit, fp32, built on the meta
device and materialised shard by shard):
  weights  ``--layers`` (default 60 x 4096^2 = 1.007 B parameters, a 4.0 GB checkpoint) with plain SGD: the
           checkpoint is the weights (SGD without momentum keeps no state)
  adamw    a third of the layers (20: 0.336 B parameters) with AdamW: weights + exp_avg + exp_avg_sq, the same
           4.0 GB, as real checkpoints are mostly optimizer state
Each case runs each mode in its own process pair: 1 warm-up step, ``--steps`` baseline steps, then ``--saves``
rounds of (one sharded save of the same path, ``--steps`` steps). The async process then measures the floor:
the rank's local weight shards and optimizer state copied into preallocated host tensors that were written once
before (no page faults), the median of ``--saves`` copies.

Reported per mode (seconds):
  save_call_s        how long each ``fabric.save`` blocks the training loop (async: the copy into the host
                     buffers; the wait for a previous save still in flight would count too)
  first_save_call_s  the first save: async, it also allocates the host buffers the later saves reuse
  stall_s            mean save_call_s of the saves after the first (steady state: what every later save costs)
  step_s             median step time before any save
  after_save_s       median step time of the steps following a save (async: the background write competes for the
                     CPU; on a shared 2-core CPU the step-to-step noise is several seconds, so compare medians)
  stall_upper_s      save_call_s + the excess of each following step over step_s (an upper bound: noise counts)
  drain_s            time still waited for the last save at the end (not a stall of training)
Per case: ``floor_s``, ``stall_over_floor`` (async stall_s / floor_s), ``stall_ratio_async_over_blocking``
(async stall_s / blocking stall_s), and ``first_save_over_floor``.

Run: ``flock /tmp/lnpu-tests.lock python benchmarks/checkpoint_stall.py`` (writes checkpoint_stall.json next to it;
``--cases adamw`` runs one case). Host memory per rank: 2 GB of state, 2 GB of gradients in a step, plus one 2 GB
staging copy that async saves keep from the first save on (and, at the end, the 2 GB floor copy); the disk needs
twice the checkpoint (the previous one stays until the new one is complete).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OUTPUT = HERE / "checkpoint_stall.json"
#: case -> (optimizer, divisor of --layers): AdamW keeps two tensors per parameter, so a third of the layers.
CASES = {"weights": ("sgd", 1), "adamw": ("adamw", 3)}


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.fabric import Fabric
    from torch import nn
    from torch.distributed.tensor import DTensor

    import lightning_npu

    strategy = lightning_npu.NPUFabricFSDPStrategy(auto_wrap_policy=[nn.Linear], async_save=args.mode == "async",
                                                   timeout=1800)
    fabric = Fabric(accelerator="npu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    model = fabric.setup(model)
    make = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
    optimizer = fabric.setup_optimizers(make(model.parameters(), lr=1e-6))
    parameters = sum(p.numel() for p in model.parameters())  # global sizes (DTensors)
    x = torch.randn(args.batch, args.width)

    def step() -> float:
        start = time.perf_counter()
        loss = model(x.to(fabric.device)).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        fabric.barrier()
        return time.perf_counter() - start

    step()  # warm-up (AdamW: creates its state)
    baseline = [step() for _ in range(args.steps)]
    path = Path(args.checkpoint)
    calls, after = [], []
    for _ in range(args.saves):
        fabric.barrier()
        start = time.perf_counter()
        fabric.save(path, {"model": model, "optimizer": optimizer})
        calls.append(time.perf_counter() - start)
        after.append([step() for _ in range(args.steps)])
    start = time.perf_counter()
    fabric.strategy.wait_for_checkpoint()
    fabric.barrier()
    drain = time.perf_counter() - start
    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    state = [local(p) for p in model.parameters()]  # what a save copies: this rank's shards and optimizer state
    state += [local(v) for values in optimizer.state.values() for v in values.values() if isinstance(v, torch.Tensor)]
    floor = measure_floor(state, args.saves, fabric.barrier) if args.mode == "async" else None
    if fabric.global_rank == 0:
        step_s = statistics.median(baseline)
        result = {
            "mode": args.mode, "optimizer": args.optimizer, "parameters": parameters,
            "checkpoint_gb": round(sum(t.numel() * t.element_size() for t in state) * 2 / 1e9, 2),
            "save_call_s": [round(c, 3) for c in calls], "first_save_call_s": round(calls[0], 3),
            "stall_s": round(statistics.mean(calls[1:]), 3), "step_s": round(step_s, 2),
            "after_save_s": round(statistics.median(t for following in after for t in following), 2),
            "stall_upper_s": [round(c + sum(max(0.0, t - step_s) for t in following), 2)
                              for c, following in zip(calls, after)],
            "drain_s": round(drain, 2),
        }
        if floor is not None:
            result["floor_s"] = [round(f, 3) for f in floor]
        Path(args.result).write_text(json.dumps(result))


def measure_floor(state: list, repeats: int, barrier) -> list[float]:
    """Seconds per copy of ``state`` (this rank's tensors) into host tensors allocated and written once before."""
    import torch

    host = [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in state]
    for buffer, tensor in zip(host, state):
        buffer.copy_(tensor)  # the first write faults the pages in: not part of a copy into reused memory
    times = []
    for _ in range(repeats):
        barrier()  # both ranks copy at once, as both ranks stage at once in a save
        start = time.perf_counter()
        for buffer, tensor in zip(host, state):
            buffer.copy_(tensor)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--mode", choices=["blocking", "async"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        worker(args)
        return
    if args.saves < 2:
        parser.error(f"--saves {args.saves}: the steady-state stall needs at least 2 saves (the first allocates)")
    results = json.loads(OUTPUT.read_text()) if OUTPUT.is_file() else {}
    results = {case: results[case] for case in CASES if case in results and case not in args.cases}
    with tempfile.TemporaryDirectory(prefix="lnpu-stall-") as scratch:
        for case in args.cases:
            optimizer, divisor = CASES[case]
            results[case] = {}
            for mode in ("blocking", "async"):
                result = Path(scratch) / f"{case}-{mode}.json"
                command = [sys.executable, __file__, "--mode", mode, "--optimizer", optimizer,
                           "--checkpoint", str(Path(scratch) / f"{case}-ckpt"), "--result", str(result),
                           "--layers", str(max(1, args.layers // divisor)), "--width", str(args.width),
                           "--batch", str(args.batch), "--steps", str(args.steps), "--saves", str(args.saves)]
                env = {**os.environ, "LIGHTNING_NPU_SIMULATE": "2",
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
                subprocess.run(command, check=True, env=env, cwd=REPO)
                results[case][mode] = json.loads(result.read_text())
                print(json.dumps({"case": case, **results[case][mode]}))
            summarize(results[case])
    OUTPUT.write_text(json.dumps(results, indent=2) + "\n")
    for case in args.cases:
        r = results[case]
        print(f"{case}: floor {r['floor_s']} s, stall per save {r['async']['stall_s']} s async (first save"
              f" {r['async']['first_save_call_s']} s) vs {r['blocking']['stall_s']} s blocking:"
              f" stall/floor {r['stall_over_floor']}, stall async/blocking {r['stall_ratio_async_over_blocking']}")
    print(f"wrote {OUTPUT}")


def summarize(case: dict) -> None:
    floor = statistics.median(case["async"]["floor_s"])
    stall, blocking = case["async"]["stall_s"], case["blocking"]["stall_s"]
    case["floor_s"] = round(floor, 3)
    case["stall_over_floor"] = round(stall / floor, 2)
    case["stall_ratio_async_over_blocking"] = round(stall / blocking, 3)
    case["first_save_over_floor"] = round(case["async"]["first_save_call_s"] / floor, 2)


if __name__ == "__main__":
    main()
