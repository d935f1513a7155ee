"""What does the plugin (and Lightning) cost? Tokens/s of the Trainer against a hand-written FSDP2 loop.

    python benchmarks/plugin_overhead.py               # 5 repeats of each, ~5 min on 2 cores
    python benchmarks/plugin_overhead.py --repeats 5 --steps 80 --out /tmp/overhead.json

Both sides train the recipe's tiny LLaMA-2 (32-true) on 2 CPU processes over gloo with the same shapes and steps:

- Lightning: ``Trainer(accelerator="npu", devices=2, strategy=NPUFSDPStrategy(auto_wrap_policy=[TransformerBlock]))``
  on the simulated runtime (LIGHTNING_NPU_SIMULATE=2) fitting ``recipes.decoder.module.DecoderLM``: the auto-wrap policy
  gives the same FSDP units as the raw loop (``strategy="npu_fsdp"`` alone would shard the model as one unit);
- raw: ``torch.multiprocessing`` spawns 2 processes that ``fully_shard`` every TransformerBlock and then the model
  (torch's default: the root keeps its parameters gathered from forward to backward, as npu_fsdp's root does),
  and run forward, cross-entropy, backward, AdamW (the module's parameter groups and hyper-parameters), the
  LR schedule and ``zero_grad`` by hand.

Each process uses one thread. The first ``--warmup`` steps are not timed; tokens/s = timed steps x micro-batch x
sequence x 2 processes / the wall time from the start of the first timed step to the end of the last (data loading
included on both sides). Runs alternate between the two sides; the table reports every run, the ratio of each
repeat's pair and the median of those ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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

WORLD = 2
SEED = 1234


def _dataset(length: int, seq: int, vocab: int) -> Any:
    import torch
    from torch.utils.data import Dataset

    class Tokens(Dataset):
        """Deterministic random token blocks: the same samples on both sides."""

        def __len__(self) -> int:
            return length

        def __getitem__(self, index: int) -> dict[str, Any]:
            block = torch.randint(0, vocab, (seq + 1,), generator=torch.Generator().manual_seed(index))
            return {"input_ids": block[:-1].clone(), "labels": block[1:].clone()}

    return Tokens()


def _tokens_per_s(marks: list[float], args: argparse.Namespace) -> dict[str, Any]:
    """marks[i]: the clock when step i ended; marks[warmup - 1] is when the first timed step started."""
    timed = marks[args.warmup - 1:]
    seconds = timed[-1] - timed[0]
    steps = len(timed) - 1
    return {"tokens_per_s": steps * args.batch * args.seq * WORLD / seconds, "seconds": seconds, "steps": steps,
            "median_step_ms": 1000 * statistics.median(b - a for a, b in zip(timed, timed[1:], strict=False))}


# ------------------------------------------------------------------------------------------------------ Lightning


def lightning_worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_npu import NPUFSDPStrategy
    from recipes.models.llama.model import TransformerBlock
    from recipes.decoder.module import DecoderLM

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    module = DecoderLM(preset="tiny", warmup_steps=args.warmup)
    total = args.warmup + args.steps

    class Clock(Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.marks.append(time.perf_counter())

    clock = Clock()
    trainer = Trainer(
        accelerator="npu", devices=WORLD, strategy=NPUFSDPStrategy(auto_wrap_policy=[TransformerBlock]),
        precision="32-true", max_steps=total, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
    )
    data = _dataset(total * args.batch * WORLD, args.seq, module.config.vocab_size)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=args.batch))
    result = _tokens_per_s(clock.marks, args)
    Path(f"{args.result}.rank{trainer.global_rank}").write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------------------ raw


def raw_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn import functional as F
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from recipes.models.llama.config import LLaMAConfig
    from recipes.models.llama.model import LLaMA
    from recipes.decoder.module import warmup_cosine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    config = LLaMAConfig.from_preset("tiny")
    model = LLaMA(config)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    # The LightningModule's defaults: lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices.
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    total = args.warmup + args.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, total, 0.1))
    data = _dataset(total * args.batch * WORLD, args.seq, config.vocab_size)
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=False)  # as Lightning's
    marks = []
    model.train()
    for batch in DataLoader(data, batch_size=args.batch, sampler=sampler):
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        if len(marks) == total:
            break
    Path(f"{args.result}.rank{rank}").write_text(json.dumps(_tokens_per_s(marks, args)))
    dist.destroy_process_group()


def raw_worker(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(raw_rank, args=(args, port), nprocs=WORLD)


# --------------------------------------------------------------------------------------------------------- driver


def run_side(side: str, args: argparse.Namespace, workdir: Path, index: int) -> dict[str, Any]:
    result = workdir / f"{side}{index}"
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_NPU_SIMULATE"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if side == "lightning":
        env["LIGHTNING_NPU_SIMULATE"] = str(WORLD)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--result", str(result),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--seq", str(args.seq)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    ranks = [json.loads(Path(f"{result}.rank{r}").read_text()) for r in range(WORLD)]
    # The slower rank sets the pace of a synchronous data-parallel job.
    return min(ranks, key=lambda r: r["tokens_per_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per process")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    parser.add_argument("--worker", choices=("lightning", "raw"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 2:
        parser.error("--warmup must be >= 1 and --steps >= 2")
    if args.worker == "lightning":
        lightning_worker(args)
        return 0
    if args.worker == "raw":
        raw_worker(args)
        return 0

    runs: dict[str, list[dict[str, Any]]] = {"lightning": [], "raw": []}
    print(f"{'run':<5}{'side':<11}{'tokens/s':>11}{'step ms':>9}")
    with tempfile.TemporaryDirectory() as workdir:
        for index in range(args.repeats):
            order = ("lightning", "raw") if index % 2 == 0 else ("raw", "lightning")
            for side in order:
                result = run_side(side, args, Path(workdir), index)
                runs[side].append(result)
                print(f"{index:<5}{side:<11}{result['tokens_per_s']:>11.0f}{result['median_step_ms']:>9.1f}",
                      flush=True)
    medians = {side: statistics.median(r["tokens_per_s"] for r in results) for side, results in runs.items()}
    # Each repeat's two runs are neighbours in time, so their ratio cancels most of the machine's drift.
    paired = [ours["tokens_per_s"] / raw["tokens_per_s"] for ours, raw in zip(runs["lightning"], runs["raw"])]
    ratio = statistics.median(paired)
    print(f"\nmedian tokens/s: Lightning + lightning-npu {medians['lightning']:.0f}, raw FSDP2 {medians['raw']:.0f};"
          f" paired ratios {', '.join(f'{r:.3f}' for r in paired)}; median {ratio:.3f} (target >= 0.98)")
    summary = {"median_tokens_per_s": medians, "paired_ratios": paired, "ratio": ratio, "target": 0.98,
               "setup": {"model": "tiny", "precision": "32-true", "world": WORLD, "batch": args.batch,
                         "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats},
               "runs": runs}
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
