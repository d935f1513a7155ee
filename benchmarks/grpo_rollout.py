"""Are GRPO's rollouts slowed by the sharding? Rollout tokens/s per rank on 2 simulated NPUs against generate.py's on
one process, for the same model, batch and lengths.

    python benchmarks/grpo_rollout.py                          # ~1 min on 2 idle cores
    python benchmarks/grpo_rollout.py --prompts 2 --new-tokens 32 --out /tmp/rollout.json

- sharded: a Fabric script under ``NPUFabricFSDPStrategy`` on 2 simulated NPUs (``LIGHTNING_NPU_SIMULATE=2``: 2
  processes over gloo, one thread each), the recipe's LLaMA sharded by FSDP2 (each block and the root a unit), and
  the built-in engine (``recipes.posttrain.rollout.PolicyRolloutEngine``): ``--prompts`` prompts of ``--prompt-len``
  tokens, ``--generations`` completions each, ``--new-tokens`` new tokens each, sampled at temperature 1. Each rank
  rolls out its own prompts, as GRPO's ranks do; its tokens/s is its completion tokens over its rollout's seconds.
- baseline: one process, one thread, ``recipes.generate.decode`` (what ``recipes/generate.py`` runs) on the same
  model unsharded, the same prompts, batch (one prompt's generations) and lengths.

No EOS stops a completion early, so both sides generate exactly ``prompts x generations x new_tokens`` tokens. Each
side runs ``--repeats`` times after one warm-up; the figures are medians. The ratio is sharded / baseline (the target
is >= 0.8). Wall time on shared cores: run it on an otherwise idle machine and read the numbers as such.
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: The recipe's LLaMA at a size where a decode step is more than the host's overhead on one CPU core.
MODEL = dict(vocab_size=4096, dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden_dim=688, max_seq_len=256)


def _model():
    import torch

    from recipes.decoder.module import DecoderLM

    torch.manual_seed(0)
    lm = DecoderLM(preset="tiny", config=MODEL)
    lm.configure_model()
    return lm.model.eval()


def _prompts(args: argparse.Namespace, rank: int) -> list:
    import torch

    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, MODEL["vocab_size"], (args.prompt_len,), generator=generator) for _ in range(args.prompts)]


def _timed(run: Any, repeats: int) -> list[float]:
    run()  # warm-up: first-call allocations, FSDP2's lazy initialisation
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return seconds


def sharded_worker(args: argparse.Namespace) -> None:
    """One rank of the sharded side (Fabric starts the other by re-running this command)."""
    import torch
    from lightning.fabric import Fabric

    import lightning_npu
    from recipes.posttrain.rollout import PolicyRolloutEngine, SamplingOptions

    torch.set_num_threads(1)
    fabric = Fabric(accelerator="npu", devices=2, precision="32-true",
                    strategy=lightning_npu.NPUFabricFSDPStrategy(timeout=600))
    fabric.launch()
    model = fabric.setup_module(_model()).module
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long, device=fabric.device))  # the root's first forward: FSDP2's setup
    prompts = [p.to(fabric.device) for p in _prompts(args, fabric.global_rank)]
    options = SamplingOptions(args.generations, args.new_tokens, temperature=1.0)
    generator = torch.Generator(device=fabric.device).manual_seed(fabric.global_rank)
    engine = PolicyRolloutEngine()
    tokens = []

    def rollout() -> None:
        tokens.append(engine.generate(model, prompts, options, eos_id=None, generator=generator).tokens)

    fabric.barrier()
    seconds = _timed(rollout, args.repeats)
    result = {"rank": fabric.global_rank, "seconds": seconds, "tokens": tokens[-1],
              "sharded_blocks": sum(type(m).__name__.startswith("FSDP") for m in model.modules())}
    Path(f"{args.result}.rank{fabric.global_rank}.json").write_text(json.dumps(result))


def baseline_worker(args: argparse.Namespace) -> None:
    """The baseline: generate.py's decoding on one process."""
    import torch

    from recipes.generate import decode

    torch.set_num_threads(1)
    model = _model()
    prompts = _prompts(args, 0)
    generator = torch.Generator().manual_seed(0)

    def run() -> None:
        with torch.no_grad():
            for prompt in prompts:
                decode(model, prompt.reshape(1, -1).expand(args.generations, -1), args.new_tokens, temperature=1.0,
                       generator=generator)

    seconds = _timed(run, args.repeats)
    tokens = args.prompts * args.generations * args.new_tokens
    Path(f"{args.result}.baseline.json").write_text(json.dumps({"seconds": seconds, "tokens": tokens}))


def _run(role: str, args: argparse.Namespace, result: Path, simulate: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("LIGHTNING_NPU_SIMULATE", None)
    if simulate:
        env["LIGHTNING_NPU_SIMULATE"] = "2"
    command = [sys.executable, __file__, "--role", role, "--result", str(result), "--prompts", str(args.prompts),
               "--prompt-len", str(args.prompt_len), "--generations", str(args.generations), "--new-tokens",
               str(args.new_tokens), "--repeats", str(args.repeats)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"the {role} side failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rank")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (one decode batch)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    parser.add_argument("--role", choices=("sharded", "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is not None:
        {"sharded": sharded_worker, "baseline": baseline_worker}[args.role](args)
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        result = Path(workdir) / "rollout"
        _run("baseline", args, result, simulate=False)
        _run("sharded", args, result, simulate=True)
        baseline = json.loads(Path(f"{result}.baseline.json").read_text())
        ranks = [json.loads(Path(f"{result}.rank{r}.json").read_text()) for r in range(2)]
    per_second = lambda side: side["tokens"] / statistics.median(side["seconds"])
    baseline_rate = per_second(baseline)
    rank_rates = [per_second(rank) for rank in ranks]
    row = {"model": MODEL, "prompts_per_rank": args.prompts, "prompt_len": args.prompt_len,
           "generations": args.generations, "new_tokens": args.new_tokens, "repeats": args.repeats,
           "baseline_tokens_per_s": baseline_rate, "sharded_tokens_per_s_per_rank": rank_rates,
           "fsdp_units_per_rank": ranks[0]["sharded_blocks"],
           "ratio_per_rank": [rate / baseline_rate for rate in rank_rates],
           "baseline_seconds": baseline["seconds"], "sharded_seconds": [rank["seconds"] for rank in ranks]}
    print(f"generate.py, 1 process: {baseline_rate:.0f} tokens/s; PolicyRolloutEngine on 2 simulated NPUs:"
          f" {' / '.join(f'{r:.0f}' for r in rank_rates)} tokens/s per rank; ratio"
          f" {' / '.join(f'{x:.2f}' for x in row['ratio_per_rank'])} (target >= 0.8)", flush=True)
    Path(args.out).write_text(json.dumps(row, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
