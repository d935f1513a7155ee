"""Training stall per checkpoint save, blocking vs ``async_save=True``, npu_fsdp on 2 simulated NPUs.

Model: a stack of ``--layers`` Linear(``--width``, ``--width``) layers (default 60 x 4096^2 = 1.007 B parameters, fp32,
a 4.0 GB checkpoint), each its own FSDP unit, built on the meta device and materialised shard by shard; plain SGD, so
the checkpoint is the weights (an optimizer state would add its size to both the checkpoint and the host copy).
Each mode runs in its own process pair: 1 warm-up step, ``--steps`` baseline steps, then ``--saves`` rounds of
(one sharded save of the same path, ``--steps`` steps).

Reported per mode (seconds):
  save_call_s    the stall: how long ``fabric.save`` blocks the training loop (async: host copy + planning; the wait
                 for the previous save in flight is included)
  step_s         median step time before any save
  after_save_s   median step time of the steps following a save (async: the background write competes for the CPU;
                 on a shared 2-core CPU the step-to-step noise is several seconds, so compare medians)
  stall_s        save_call_s + the excess of each following step over step_s (an upper bound: positive noise counts)
  drain_s        time still waited for the last save at the end (not a stall of training)
The headline ``stall_ratio_async_over_blocking`` compares the mean save_call_s.

Run: ``flock /tmp/lnpu-tests.lock python benchmarks/checkpoint_stall.py`` (writes checkpoint_stall.json next to it).
Host memory: about 2 GB of weights per rank plus one 2 GB host copy during a save; the disk needs twice the
checkpoint (the previous one stays until the new one is complete).
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


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.fabric import Fabric
    from torch import nn

    import lightning_npu

    strategy = lightning_npu.NPUFabricFSDPStrategy(auto_wrap_policy=[nn.Linear], async_save=args.mode == "async",
                                                   timeout=1800)
    fabric = Fabric(accelerator="npu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1e-6))
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

    step()  # warm-up
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
    if fabric.global_rank == 0:
        step_s = statistics.median(baseline)
        stalls = [call + sum(max(0.0, t - step_s) for t in following) for call, following in zip(calls, after)]
        result = {
            "mode": args.mode, "parameters": parameters, "checkpoint_gb": round(parameters * 4 / 1e9, 2),
            "save_call_s": [round(c, 2) for c in calls], "step_s": round(step_s, 2),
            "after_save_s": round(statistics.median(t for following in after for t in following), 2),
            "mean_save_call_s": round(statistics.mean(calls), 2),
            "stall_s": [round(s, 2) for s in stalls], "drain_s": round(drain, 2),
        }
        Path(args.result).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--mode", choices=["blocking", "async"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        worker(args)
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="lnpu-stall-") as scratch:
        for mode in ("blocking", "async"):
            result = Path(scratch) / f"{mode}.json"
            command = [sys.executable, __file__, "--mode", mode, "--checkpoint", str(Path(scratch) / "ckpt"),
                       "--result", str(result), "--layers", str(args.layers), "--width", str(args.width),
                       "--batch", str(args.batch), "--steps", str(args.steps), "--saves", str(args.saves)]
            env = {**os.environ, "LIGHTNING_NPU_SIMULATE": "2",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            subprocess.run(command, check=True, env=env, cwd=REPO)
            results[mode] = json.loads(result.read_text())
            print(json.dumps(results[mode]))
    summarize(results)
    OUTPUT.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {OUTPUT}: training blocked per save {results['blocking']['mean_save_call_s']} s blocking,"
          f" {results['async']['mean_save_call_s']} s async")


def summarize(results: dict) -> None:
    blocking, background = results["blocking"]["mean_save_call_s"], results["async"]["mean_save_call_s"]
    results["stall_ratio_async_over_blocking"] = round(background / blocking, 3) if blocking else None


if __name__ == "__main__":
    main()
