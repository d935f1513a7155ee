"""How long does each pipeline rank wait? The bubble measured on the simulated runtime against the schedule's formula.

    python benchmarks/pipeline_bubble.py                       # 1F1B, GPipe, Interleaved1F1B, ZBV; ~3 min on 2 cores
    python benchmarks/pipeline_bubble.py --schedules 1F1B --microbatches 8 --out /tmp/bubble.json

A Fabric loop trains the recipe's LLaMA (8 blocks, dim 256, fp32) under ``NPUFabricFSDPStrategy`` with pipeline
parallelism 2 on 2 simulated NPUs (``LIGHTNING_NPU_SIMULATE=2``: 2 processes over gloo, one thread each), so each
process computes on a core of its own when nothing else runs. Every forward and backward a stage runs is timed
(torch's ``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``), and so is each step of the
schedule. A rank's bubble is the share of the step it computes nothing: ``1 - busy / step``, over the steps after
the first ``--warmup``. Set beside it:

- the formula (``facts.pipeline.bubble_fraction``: backward = 2 forwards, free communication);
- torch's order replayed at the costs measured here (``facts.pipeline.replayed_bubble`` with each kind's mean time
  on the busiest stage): what the schedule's order leaves with this run's real forward/backward ratio. Measured
  minus replayed is what the replay leaves out: P2P time, the loss broadcast, uneven stages, the host.

The measured numbers are wall time on shared cores: run it on an otherwise idle machine and read them as such.
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
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: The schedules measured by default, with their stages per rank.
SCHEDULES = {"1F1B": 1, "GPipe": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2}
MODEL = dict(dim=256, n_layers=8, n_heads=4, n_kv_heads=4, ffn_hidden_dim=688, max_seq_len=256)
#: The stage methods whose time counts as the rank's work, by the action kind they run.
TIMED = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


def worker(args: argparse.Namespace) -> None:
    """One rank (Fabric starts the other by re-running this command)."""
    import torch
    from lightning.fabric import Fabric
    from torch.distributed.pipelining import stage as torch_stage

    import lightning_npu
    from recipes.decoder.module import DecoderLM

    torch.set_num_threads(1)
    spent: dict[str, list[float]] = defaultdict(list)
    for name, kind in TIMED.items():
        original = getattr(torch_stage._PipelineStageBase, name)

        def timed(self, *a: Any, _original=original, _name=name, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                # A full backward split into its halves counts as input (I) and weight (W) passes.
                kind_ = "I" if _name == "backward_one_chunk" and k.get("full_backward") is False else TIMED[_name]
                spent[kind_].append(time.perf_counter() - started)

        setattr(torch_stage._PipelineStageBase, name, timed)

    fabric = Fabric(accelerator="npu", devices=2, precision="32-true", strategy=lightning_npu.NPUFabricFSDPStrategy(
        pipeline_parallel_size=2, pipeline_schedule=args.schedule, pipeline_microbatches=args.microbatches,
        pipeline_layers_per_stage=json.loads(args.layers) if args.layers else None, timeout=600))
    fabric.launch()
    torch.manual_seed(0)
    lm = DecoderLM(preset="tiny", config=MODEL)
    lm.configure_model()
    config = lm.config
    model = fabric.setup(lm.model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(1)
    steps, busy = [], []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=generator)
        before = sum(map(sum, spent.values()))
        fabric.barrier()  # each step starts together: the wait before it is not the schedule's
        started = time.perf_counter()
        loss = model(tokens[:, :-1].to(fabric.device), labels=tokens[:, 1:].to(fabric.device))
        fabric.backward(loss)
        elapsed = time.perf_counter() - started
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.warmup:
            steps.append(elapsed)
            busy.append(sum(map(sum, spent.values())) - before)
        else:
            spent.clear()
    result = {"rank": fabric.global_rank, "step_s": steps, "busy_s": busy,
              "mean_s": {kind: statistics.mean(times) for kind, times in spent.items()}}
    Path(f"{args.result}.rank{fabric.global_rank}.json").write_text(json.dumps(result))


def measure(schedule: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from lightning_npu.facts import pipeline as facts

    per_rank = SCHEDULES[schedule]
    microbatches = args.microbatches or 2 * 2 * per_rank
    out = workdir / schedule
    env = {**os.environ, "LIGHTNING_NPU_SIMULATE": "2", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, __file__, "--worker", "--schedule", schedule, "--microbatches", str(microbatches),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq",
               str(args.seq), "--result", str(out), *(["--layers", args.layers] if args.layers else [])]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{schedule} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    measured = [1 - sum(rank["busy_s"]) / sum(rank["step_s"]) for rank in ranks]
    # Each kind's cost on the busier rank, relative to its forward: the replay's stage costs.
    busiest = max(ranks, key=lambda rank: sum(rank["busy_s"]))["mean_s"]
    costs = {kind: seconds / busiest["F"] for kind, seconds in busiest.items()}
    replayed = facts.replayed_bubble(schedule, 2, microbatches, per_rank, costs=costs)
    return {"schedule": schedule, "microbatches": microbatches, "stages_per_rank": per_rank,
            "formula": facts.bubble_fraction(schedule, 2, microbatches, per_rank),
            "replayed_at_measured_costs": replayed, "measured": measured, "costs_relative_to_forward": costs,
            "step_ms": [1000 * statistics.mean(rank["step_s"]) for rank in ranks]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=0, help="default: 2 per stage")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", help="pipeline_layers_per_stage as JSON, e.g. [1,3,2,2] (default: the split rule)")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for schedule in args.schedules.split(","):
            row = measure(schedule, args, Path(workdir))
            rows.append(row)
            print(f"{schedule:<16} m {row['microbatches']:>2}  formula {100 * row['formula']:5.1f}%  replayed"
                  f" {'/'.join(f'{100 * x:.1f}' for x in row['replayed_at_measured_costs'])}%  measured"
                  f" {'/'.join(f'{100 * x:.1f}' for x in row['measured'])}%"
                  f"  (B/F {row['costs_relative_to_forward'].get('B', 0):.2f}, step {row['step_ms'][0]:.0f} ms)",
                  flush=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
