"""What does the plugin (and Lightning) cost per step? Host CPU time of the Trainer against a hand-written FSDP2 loop.

    python benchmarks/plugin_overhead.py                     # 8 interleaved runs, ~10 min on 2 cores
    python benchmarks/plugin_overhead.py --out /tmp/again.json --against benchmarks/plugin_overhead.json
    python benchmarks/plugin_overhead.py --profile           # where one step's host time goes, both sides
    python benchmarks/plugin_overhead.py --profile --callbacks recipe   # ... with the recipe's callbacks
    python benchmarks/plugin_overhead.py --separate          # the earlier method: separate processes, tokens/s

Both sides train the recipe's tiny LLaMA-2 (32-true) on 2 CPU processes over gloo, one thread each, with the same
shapes, data and steps:

- Lightning: ``Trainer(accelerator="npu", devices=2, strategy=NPUFSDPStrategy(auto_wrap_policy=[TransformerBlock]))``
  on the simulated runtime (LIGHTNING_NPU_SIMULATE=2) fitting ``recipes.decoder.module.DecoderLM``: the auto-wrap policy
  gives the same FSDP units as the raw loop (``strategy="npu_fsdp"`` alone would shard the model as one unit).
  By default (``--callbacks bare``) its only callbacks are this benchmark's clock and the plugin's own
  ``GracefulPreemption``, which the plugin adds to every Trainer on an npu strategy; ``--callbacks recipe`` adds
  those ``recipes/train.py`` adds (``TokenThroughputMonitor``, ``GracefulPreemption(save_on_preemption=True)``,
  ``NonFiniteLossGuard``);
- raw (``RawLoop``): ``fully_shard`` on every TransformerBlock and then the model (torch's default: the root keeps
  its parameters gathered from forward to backward, as npu_fsdp's root does), then per step the next batch
  (``DistributedSampler`` as Lightning's), forward, cross-entropy, backward, AdamW (the module's parameter groups and
  hyper-parameters), the LR schedule and ``zero_grad``, by hand.

The headline is host CPU time per step: ``time.process_time()`` (user + system time of all the process's threads,
the gloo transport's included), per rank, averaged over the 2 ranks. On a machine whose 2 cores are shared with
other work wall time says little (earlier paired tokens/s ratios of this benchmark ranged 0.80-1.09). CPU time
moves less, since a process waiting for a core, or for the other rank in a collective, spends none; but other work
still slows every instruction (caches, the host's other threads) by several percent from one minute to the next.
So the two sides run interleaved, step by step, in the same 2 processes: the Trainer's first callback (the clock)
runs one raw step on a second model, sharded the same way over the same ranks, after each Trainer step. The
Trainer's step k is the CPU time from the end of raw step k - 1 to the start of raw step k (its data loading,
hooks, callbacks and loop included), raw step k the time it takes. The first ``--warmup`` steps are not measured.
A run's ratio is raw CPU / Lightning CPU per step over its measured steps (>= 1: the Trainer and the plugin cost
nothing measurable); the summary is the median over ``--repeats`` runs, their range, a bootstrap 95% interval of
that median and the ratio of all runs' steps pooled.

glibc's malloc is pinned for both sides (``PINNED_MALLOC``; ``--glibc-defaults`` leaves it alone). With its
defaults, freed tensors' memory goes back to the kernel (unmapped, or trimmed off the heap's top) and the next step
faults it in again: 3,000-7,000 page faults and ~20 ms of system time per step here, 12% of the step, and how much
depends on each process's allocation history. Two processes doing the same work differ by up to 3,000 faults per
step, the Trainer's processes had ~1,400 more than the raw loop's, and in the shared processes of the interleaved
mode one side's frees become the other side's faults. Pinned, a step takes ~60 faults on both sides. On an NPU
the tensors live in the device's caching allocator, so none of this is host cost there.

Each rank also reports its page faults per step (``ru_minflt``), the garbage collector's CPU time and collections,
and each thread's CPU time (``/proc/self/task``: the main thread, gloo's two), so a busy thread, a collector or an
allocation pattern that one side has and the other has not would show. What the interleaving cannot see: anything
the Trainer or the plugin changes for the whole process (torch flags, a global mode) slows both sides alike;
``--separate`` (each side in its own processes, runs alternating, paired CPU time and tokens/s ratios, the same
diagnostics) shows that, at a higher noise.

``--profile`` runs each side once in its own processes, with ``cProfile`` on rank 0 over the measured steps (clock:
the main thread's CPU time, ``time.thread_time``), and groups every function's own time by where its code lives:
Lightning (by subpackage), lightning_npu (by module: telemetry, guards, preemption, strategies, precision, ...),
the recipe's LightningModule, the model, torch's FSDP2, DTensor, c10d, autograd (the backward pass), optim, nn (the
forward's layers), data loading. Built-in functions (torch ops, ``.item()``) and glue code (``torch/_tensor.py``,
the standard library) count for the code that called them, shared by their callers in proportion to their time
under each. It prints ms per step of each group on both sides and the difference, the largest functions of the
Trainer-only groups, and the inclusive time of the plugin's and the recipe's functions that Lightning calls.
cProfile slows Python code (every call is timed, about twice as slow for Lightning's loop), so these attribute the
cost; the headline's CPU times measure it. The two sides' runs are minutes apart, so their torch groups differ by
the machine's load, not by the plugin.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WORLD = 2
SEED = 1234
TARGET = 0.98
#: glibc's malloc for both sides unless ``--glibc-defaults``: blocks up to 32 MiB (every tensor of this model) from
#: the heap, and the heap never handed back to the kernel, so freed memory is reused instead of being unmapped and
#: faulted in again by the next step (see the module docstring).
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}

# ------------------------------------------------------------------------------------------- measurement in a rank


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


class GCClock:
    """CPU time spent in Python's cyclic garbage collector (``gc.callbacks``; the clock of the thread collecting)
    and collections per generation, once ``install``-ed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._start = 0.0

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def __call__(self, phase: str, info: Mapping[str, Any]) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._start
            self.collections[info["generation"]] += 1


GC = GCClock()


def _clocks() -> tuple[float, ...]:
    """Wall clock, this process's CPU time (user + system, all threads), its user and system times apart, the CPU
    time its garbage collector has taken (``GC``), and its page faults (minor: a page the kernel had to provide,
    mostly fresh memory from an allocation)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (time.perf_counter(), time.process_time(), usage.ru_utime, usage.ru_stime, GC.seconds,
            float(usage.ru_minflt))


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, by name (``main`` for the main thread; the
    others' names from ``/proc``, summed over threads of one name); empty where ``/proc`` has no task list."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return seconds
    for tid in tids:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            name = "main" if tid == str(os.getpid()) else Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the name: state, ppid, ...; utime and stime are 12th, 13th
        seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return seconds


def _snapshot() -> dict[str, Any]:
    return {"threads": _thread_cpu(), "gc_collections": list(GC.collections)}


def process_figures(start: Mapping[str, Any], end: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """Between two ``_snapshot``s ``steps`` steps apart: CPU ms per step of each thread name (threads that ended
    meanwhile are missing), and the garbage collector's collections per generation."""
    threads = {name: 1000 * (seconds - start["threads"].get(name, 0.0)) / steps
               for name, seconds in end["threads"].items()}
    return {"threads_cpu_ms_per_step": {name: ms for name, ms in sorted(threads.items(), key=lambda i: -i[1])
                                        if ms > 0},
            "gc_collections": [b - a for a, b in zip(start["gc_collections"], end["gc_collections"])]}


class RawLoop:
    """The hand-written FSDP2 loop on this rank, one optimizer step per ``step()``: forward, cross-entropy,
    backward, AdamW with the LightningModule's groups and hyper-parameters, the LR schedule, ``zero_grad``."""

    def __init__(self, rank: int, args: argparse.Namespace) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.nn import functional as F
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        from recipes.decoder.module import warmup_cosine
        from recipes.models.llama.config import LLaMAConfig
        from recipes.models.llama.model import LLaMA

        mesh = init_device_mesh("cpu", (WORLD,))
        config = LLaMAConfig.from_preset("tiny")
        self.model = LLaMA(config)
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        # The LightningModule's defaults: lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices.
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
        total = args.warmup + args.steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_cosine(args.warmup, total, 0.1))
        data = _dataset(total * args.batch * WORLD, args.seq, config.vocab_size)
        sampler = DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=False)  # as Lightning's
        self.batches = iter(DataLoader(data, batch_size=args.batch, sampler=sampler))
        self.cross_entropy = F.cross_entropy
        self.model.train()

    def step(self) -> None:
        batch = next(self.batches)
        logits = self.model(batch["input_ids"])
        loss = self.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


class StepMeter:
    """For one side per process (``--separate``, ``--profile``): ``mark()`` at the end of every step keeps the
    clocks (``_clocks``); with ``profile_to``, a cProfile of the measured steps (after ``warmup``) of this
    process's main thread, its clock that thread's CPU time."""

    def __init__(self, warmup: int, total: int, profile_to: str | None = None) -> None:
        self.warmup, self.total, self.profile_to = warmup, total, profile_to
        self.ends: list[tuple[float, ...]] = []
        self.snapshots: list[dict[str, Any]] = []
        self.profiler: Any = None

    def mark(self) -> None:
        if self.profiler is not None and len(self.ends) + 1 == self.total:
            self.profiler.disable()
        self.ends.append(_clocks())
        if len(self.ends) in (self.warmup, self.total):
            self.snapshots.append(_snapshot())
        if self.profile_to and len(self.ends) == self.warmup:
            import cProfile

            self.profiler = cProfile.Profile(time.thread_time)
            self.profiler.enable()

    @property
    def done(self) -> bool:
        return len(self.ends) >= self.total

    def summary(self, batch: int, seq: int) -> dict[str, Any]:
        if self.profiler is not None:
            self.profiler.dump_stats(self.profile_to)
        figures = step_summary(self.ends, self.warmup, batch, seq)
        return {**figures, **process_figures(*self.snapshots, figures["steps"])}


def _per_step(intervals: Sequence[tuple[Sequence[float], Sequence[float]]]) -> dict[str, Any]:
    """Figures of steps given as (clocks at the start, clocks at the end) (``_clocks``)."""
    spans = [[b - a for a, b in zip(start, end)] for start, end in intervals]
    steps = len(spans)
    wall, cpu, user, system, collecting, faults = (sum(span[i] for span in spans) for i in range(6))
    return {"steps": steps, "seconds": wall, "cpu_ms_per_step": 1000 * cpu / steps,
            "gc_ms_per_step": 1000 * collecting / steps, "page_faults_per_step": faults / steps,
            "median_step_cpu_ms": 1000 * statistics.median(span[1] for span in spans),
            "user_ms_per_step": 1000 * user / steps, "sys_ms_per_step": 1000 * system / steps,
            "wall_ms_per_step": 1000 * wall / steps,
            "median_step_ms": 1000 * statistics.median(span[0] for span in spans),
            "cpu_share": cpu / wall,  # < 1: the rank waited (for a core, or for the other rank in a collective)
            "step_cpu_ms": [round(1000 * span[1], 3) for span in spans]}


def step_summary(ends: Sequence[Sequence[float]], warmup: int, batch: int, seq: int) -> dict[str, Any]:
    """One rank's figures from the clocks at the end of every step (``ends[warmup - 1]``: when the first measured
    step started)."""
    measured = list(ends[warmup - 1:])
    figures = _per_step(list(zip(measured, measured[1:])))
    figures["tokens_per_s"] = figures["steps"] * batch * seq * WORLD / figures["seconds"]
    return figures


def interleaved_summary(lightning_ends: Sequence[Sequence[float]], raw_ends: Sequence[Sequence[float]],
                        warmup: int) -> dict[str, Any]:
    """One rank's figures of an interleaved run: step k of the Trainer ran from the end of raw step k - 1 to
    ``lightning_ends[k]``, raw step k from there to ``raw_ends[k]``; steps ``warmup`` onwards are measured."""
    steps = range(warmup, len(lightning_ends))
    lightning = _per_step([(raw_ends[k - 1], lightning_ends[k]) for k in steps])
    raw = _per_step([(lightning_ends[k], raw_ends[k]) for k in steps])
    ratios = [r / ours for r, ours in zip(raw["step_cpu_ms"], lightning["step_cpu_ms"])]
    return {"lightning": lightning, "raw": raw, "cpu_ratio": raw["cpu_ms_per_step"] / lightning["cpu_ms_per_step"],
            "median_step_cpu_ratio": statistics.median(ratios)}


# ------------------------------------------------------------------------------------------------------ Lightning


def lightning_worker(args: argparse.Namespace) -> None:
    """The Trainer side; with ``--interleaved``, one raw step after each of its steps, on a model of its own."""
    import torch
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_npu import GracefulPreemption, NonFiniteLossGuard, NPUFSDPStrategy, TokenThroughputMonitor
    from recipes.decoder.module import DecoderLM
    from recipes.models.llama.model import TransformerBlock

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    module = DecoderLM(preset="tiny", warmup_steps=args.warmup)
    total = args.warmup + args.steps
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # the launcher's ranks: 0 is this process, 1 the one it starts
    meter = StepMeter(args.warmup, total, f"{args.result}.prof" if args.profile and rank == 0 else None)
    raw_ends: list[tuple[float, ...]] = []
    snapshots: list[dict[str, Any]] = []  # interleaved: after raw steps warmup - 1 and total - 1
    GC.install()

    class Clock(Callback):
        """First of the callbacks: the Trainer's step ends here (its other callbacks and the module's batch-end
        hook run after it, so they count for its next step)."""

        def __init__(self) -> None:
            self.raw: RawLoop | None = None

        def on_train_start(self, trainer, pl_module) -> None:
            if args.interleaved:
                self.raw = RawLoop(trainer.global_rank, args)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            meter.mark()
            if self.raw is not None:
                self.raw.step()
                raw_ends.append(_clocks())
                if len(raw_ends) in (args.warmup, total):
                    snapshots.append(_snapshot())

    callbacks: list[Any] = [Clock()]
    if args.callbacks == "recipe":  # recipes/train.py's, less its checkpointing and summary print
        callbacks += [TokenThroughputMonitor(), GracefulPreemption(save_on_preemption=True), NonFiniteLossGuard()]
    trainer = Trainer(
        accelerator="npu", devices=WORLD, strategy=NPUFSDPStrategy(auto_wrap_policy=[TransformerBlock]),
        precision="32-true", max_steps=total, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        default_root_dir=os.path.dirname(args.result),
    )
    data = _dataset(total * args.batch * WORLD, args.seq, module.config.vocab_size)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=args.batch))
    if args.interleaved:
        summary = interleaved_summary(meter.ends, raw_ends, args.warmup)
        summary["process"] = process_figures(*snapshots, args.steps)  # per step of each side: one of each
    else:
        summary = meter.summary(args.batch, args.seq)
    Path(f"{args.result}.rank{trainer.global_rank}").write_text(json.dumps(summary))


# ------------------------------------------------------------------------------------------------------------ raw


def raw_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    GC.install()
    loop = RawLoop(rank, args)
    profile_to = f"{args.result}.prof" if args.profile and rank == 0 else None
    meter = StepMeter(args.warmup, args.warmup + args.steps, profile_to)
    while not meter.done:
        loop.step()
        meter.mark()
    Path(f"{args.result}.rank{rank}").write_text(json.dumps(meter.summary(args.batch, args.seq)))
    dist.destroy_process_group()


def raw_worker(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(raw_rank, args=(args, port), nprocs=WORLD)


# ------------------------------------------------------------------------------------------- profile attribution

#: Where a function's own time is counted for the code that called it (see ``bucket_of``).
FOLD = "<caller>"
#: Torch modules that only forward to the real work: their time counts for their caller.
_TORCH_GLUE = ("torch/_tensor.py", "torch/_ops.py", "torch/overrides.py", "torch/utils/_contextlib.py",
               "torch/_jit_internal.py", "torch/_compile.py", "torch/_dynamo/", "torch/_utils.py",
               "torch/functional.py")
#: Torch subpackages that are a group of their own, first match wins.
# c10d's Python functions are a group, not glue: all of them pass through one logging wrapper, so cProfile's
# caller edges cannot tell whose collective (FSDP2's, the preemption check's) a built-in under them ran for.
_TORCH_GROUPS = (("torch/distributed/fsdp/", "torch FSDP2"), ("torch/distributed/tensor/", "torch DTensor"),
                 ("torch/distributed/distributed_c10d.py", "torch.distributed collectives"),
                 ("torch/distributed/c10d_logger.py", "torch.distributed collectives"),
                 ("torch/distributed/", "torch.distributed other"), ("torch/autograd/", "torch autograd (backward)"),
                 ("torch/optim/", "torch optim + LR schedule"), ("torch/nn/", "torch nn (forward layers)"),
                 ("torch/utils/data/", "data loading"))


def bucket_of(path: str, function: str) -> str:
    """The group whose cost a function of ``path`` (as cProfile names files: ``~`` for built-ins) is, or ``FOLD``:
    built-ins, glue code and the standard library count for their caller."""
    path = path.replace("\\", "/")
    if path == "~" or path.startswith("<"):
        return FOLD
    for marker, label in (("/lightning_npu/", "lightning_npu."), ("/lightning/pytorch/", "Lightning ")):
        if marker in path:
            part = path.split(marker, 1)[1].split("/", 1)[0]
            return label + part.removesuffix(".py")
    if "/lightning/fabric/" in path:
        return "Lightning fabric"
    if "/lightning_utilities/" in path:
        return "Lightning lightning_utilities"
    if path.endswith("/recipes/decoder/module.py"):
        return "recipe DecoderLM (LightningModule)"
    if "/recipes/models/" in path or "/recipes/decoder/" in path:
        return "model (recipes)"
    if "/recipes/" in path:
        return "recipes other"
    if path.endswith("benchmarks/plugin_overhead.py"):
        return "data loading" if function in ("__getitem__", "__len__") else "benchmark (raw loop, clock)"
    if "/torch/" in path:
        inside = "torch/" + path.rsplit("/torch/", 1)[1]
        if inside.startswith(_TORCH_GLUE):
            return FOLD
        for prefix, label in _TORCH_GROUPS:
            if inside.startswith(prefix):
                return label
        return "torch other"
    return FOLD  # the standard library and other packages (typing, functools, threading, ...)


def contributions(stats: Mapping[Any, Any], root: str) -> dict[tuple[str, str], float]:
    """Seconds of own time per (group, function), from ``pstats.Stats(...).stats`` (``{(path, line, name): (calls,
    primitive, own, inclusive, callers)}``, ``callers``: ``{caller: (calls, primitive, own, inclusive)}`` of the
    calls from it). A ``FOLD`` function's own time is shared among its callers' groups in proportion to its own time
    under each (the calls' count where no time was recorded); a call with no recorded caller came from a frame
    already running when profiling began (the training loop's), counted as ``root``. cProfile keeps one level of
    callers, so a built-in under glue that several groups call (``torch/_ops.py``) is shared by time, not by
    context."""
    shares: dict[Any, dict[str, float]] = {}

    def share(key: Any, visiting: frozenset = frozenset()) -> dict[str, float]:
        if key in shares:
            return shares[key]
        label = bucket_of(key[0], key[2])
        if label != FOLD:
            result = {label: 1.0}
        else:
            callers = stats[key][4]
            weights = {caller: (edge[2] or 0.0) for caller, edge in callers.items()}
            if not any(weights.values()):
                weights = {caller: float(edge[0]) for caller, edge in callers.items()}
            total = sum(weights.values())
            if not total:
                result = {root: 1.0}
            else:
                result = {}
                for caller, weight in weights.items():
                    if not weight:
                        continue
                    if caller in visiting or caller not in stats:  # a cycle of glue code: count it for the root
                        upstream = {root: 1.0}
                    else:
                        upstream = share(caller, visiting | {key})
                    for group, fraction in upstream.items():
                        result[group] = result.get(group, 0.0) + fraction * weight / total
        if not visiting:
            shares[key] = result
        return result

    parts: dict[tuple[str, str], float] = {}
    for key, (_, _, own, _, _) in stats.items():
        for group, fraction in share(key).items():
            parts[group, function_label(key)] = parts.get((group, function_label(key)), 0.0) + own * fraction
    return parts


def attribute(stats: Mapping[Any, Any], root: str) -> dict[str, float]:
    """Seconds of own time per group (``contributions`` summed over functions)."""
    groups: dict[str, float] = {}
    for (group, _), seconds in contributions(stats, root).items():
        groups[group] = groups.get(group, 0.0) + seconds
    return groups


def function_label(key: tuple[str, int, str]) -> str:
    """``path:line(name)`` with the path from its package down (``~`` for built-ins)."""
    path, line, name = key
    path = path.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/", f"{REPO.as_posix()}/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return name if path == "~" else f"{path}:{line}({name})"


def top_functions(parts: Mapping[tuple[str, str], float], group: str, count: int) -> list[tuple[str, float]]:
    """The ``count`` functions with the most own time in ``group``."""
    mine = [(function, seconds) for (where, function), seconds in parts.items() if where == group]
    return sorted(mine, key=lambda item: -item[1])[:count]


def hook_times(stats: Mapping[Any, Any]) -> dict[str, tuple[float, int]]:
    """Inclusive seconds and calls of the plugin's and the recipe's functions when Lightning calls them (its hooks,
    callbacks and strategy methods), by ``function_label``."""
    hooks: dict[str, tuple[float, int]] = {}
    for key, (_, _, _, _, callers) in stats.items():
        label = bucket_of(key[0], key[2])
        if not label.startswith(("lightning_npu.", "recipe DecoderLM")):
            continue
        edges = [edge for caller, edge in callers.items() if bucket_of(caller[0], caller[2]).startswith("Lightning")]
        if edges:
            hooks[function_label(key)] = (sum(edge[3] for edge in edges), sum(edge[0] for edge in edges))
    return hooks


def lightning_inclusive(stats: Mapping[Any, Any], below: float, count: int) -> list[tuple[str, float, int]]:
    """Lightning's functions with the most inclusive seconds under ``below`` (which leaves out those that wrap the
    forward and backward passes), as (``function_label``, seconds, calls)."""
    rows = [(function_label(key), entry[3], entry[1]) for key, entry in stats.items()
            if bucket_of(key[0], key[2]).startswith("Lightning") and entry[3] < below]
    return sorted(rows, key=lambda row: -row[1])[:count]


# ---------------------------------------------------------------------------------------------------- statistics


def spread(values: Sequence[float], resamples: int = 4000, seed: int = 0) -> dict[str, float]:
    """Median of ``values`` with their range and a bootstrap 95% interval of the median (resampling with
    replacement, fixed seed)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "ci95": [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]}


def side_figures(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A run's figures from its ranks': CPU per step is the ranks' mean (the host cost per process); tokens/s the
    slower rank's (it sets the pace of a synchronous job)."""
    mean = lambda key: statistics.fmean(r[key] for r in ranks)  # noqa: E731
    return {"cpu_ms_per_step": mean("cpu_ms_per_step"), "user_ms_per_step": mean("user_ms_per_step"),
            "sys_ms_per_step": mean("sys_ms_per_step"), "median_step_cpu_ms": mean("median_step_cpu_ms"),
            "gc_ms_per_step": mean("gc_ms_per_step"), "page_faults_per_step": mean("page_faults_per_step"),
            "tokens_per_s": min(r["tokens_per_s"] for r in ranks),
            "median_step_ms": max(r["median_step_ms"] for r in ranks), "cpu_share": mean("cpu_share"),
            "ranks": list(ranks)}


# --------------------------------------------------------------------------------------------------------- driver


def run_worker(side: str, args: argparse.Namespace, workdir: Path, index: int, profile: bool = False,
               interleaved: bool = False) -> list[dict[str, Any]]:
    """One run of ``side`` (2 processes); its ranks' figures (with ``profile``, rank 0's cProfile in
    ``<workdir>/<side><index>.prof``)."""
    result = workdir / f"{side}{index}"
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_NPU_SIMULATE"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if side == "lightning":
        env["LIGHTNING_NPU_SIMULATE"] = str(WORLD)
    for key in PINNED_MALLOC:
        env.pop(key, None)
    if not args.glibc_defaults:
        env.update(PINNED_MALLOC)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--result", str(result),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--seq", str(args.seq), "--callbacks", args.callbacks]
    command += ["--profile"] * profile + ["--interleaved"] * interleaved
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads(Path(f"{result}.rank{r}").read_text()) for r in range(WORLD)]


def run_side(side: str, args: argparse.Namespace, workdir: Path, index: int, profile: bool = False) -> dict[str, Any]:
    figures = side_figures(run_worker(side, args, workdir, index, profile))
    if profile:
        import pstats

        figures["stats"] = pstats.Stats(str(workdir / f"{side}{index}.prof")).stats
    return figures


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    import platform

    return {"model": "tiny", "precision": "32-true", "world": WORLD, "batch": args.batch, "seq": args.seq,
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "callbacks": args.callbacks,
            "mode": "profile" if args.profile else "separate" if args.separate else "interleaved",
            "malloc": "glibc defaults" if args.glibc_defaults else PINNED_MALLOC,
            "cpus": os.cpu_count(), "python": platform.python_version(), "command": " ".join(sys.argv)}


def interleaved_run_figures(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """An interleaved run's figures from its ranks': each side's CPU per step is the ranks' mean, and the run's
    ratio raw / Lightning of those means."""
    sides = {side: {key: statistics.fmean(r[side][key] for r in ranks)
                    for key in ("cpu_ms_per_step", "user_ms_per_step", "sys_ms_per_step", "wall_ms_per_step",
                                "median_step_cpu_ms", "cpu_share", "gc_ms_per_step", "page_faults_per_step")}
             for side in ("lightning", "raw")}
    return {**sides, "cpu_ratio": sides["raw"]["cpu_ms_per_step"] / sides["lightning"]["cpu_ms_per_step"],
            "median_step_cpu_ratio": statistics.fmean(r["median_step_cpu_ratio"] for r in ranks),
            "wall_ratio": sides["raw"]["wall_ms_per_step"] / sides["lightning"]["wall_ms_per_step"],
            "ranks": list(ranks)}


def measure_interleaved(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    print(f"{'run':<5}{'Lightning CPU ms/step':>22}{'(user':>7}{'sys)':>6}{'faults':>7}{'raw CPU ms/step':>17}"
          f"{'(user':>7}{'sys)':>6}{'faults':>7}{'raw/Lightning':>15}{'per-step median':>17}  loadavg", flush=True)
    with _workdir(args.keep) as workdir:
        for index in range(args.repeats):
            run = interleaved_run_figures(run_worker("lightning", args, workdir, index, interleaved=True))
            run["loadavg"] = _loadavg()
            runs.append(run)
            ours, raw = run["lightning"], run["raw"]
            print(f"{index:<5}{ours['cpu_ms_per_step']:>22.2f}{ours['user_ms_per_step']:>7.1f}"
                  f"{ours['sys_ms_per_step']:>6.1f}{ours['page_faults_per_step']:>7.0f}{raw['cpu_ms_per_step']:>17.2f}"
                  f"{raw['user_ms_per_step']:>7.1f}{raw['sys_ms_per_step']:>6.1f}{raw['page_faults_per_step']:>7.0f}"
                  f"{run['cpu_ratio']:>15.4f}{run['median_step_cpu_ratio']:>17.4f}  {run['loadavg']}", flush=True)
    cpu = spread([run["cpu_ratio"] for run in runs])
    wall = spread([run["wall_ratio"] for run in runs])
    # Every measured step of every run and rank at once: the same weight for each step.
    pooled = (sum(sum(rank["raw"]["step_cpu_ms"]) for run in runs for rank in run["ranks"])
              / sum(sum(rank["lightning"]["step_cpu_ms"]) for run in runs for rank in run["ranks"]))
    medians = {side: {key: statistics.median(run[side][key] for run in runs)
                      for key in ("cpu_ms_per_step", "user_ms_per_step", "sys_ms_per_step", "wall_ms_per_step")}
               for side in ("lightning", "raw")}
    extra = medians["lightning"]["cpu_ms_per_step"] - medians["raw"]["cpu_ms_per_step"]
    print(f"\nCPU ms per step and rank (median of runs): Lightning + lightning-npu"
          f" {medians['lightning']['cpu_ms_per_step']:.2f}, raw FSDP2 {medians['raw']['cpu_ms_per_step']:.2f}"
          f" ({extra:+.2f})")
    print(f"CPU ratio raw / Lightning: median {cpu['median']:.4f} (95% interval {cpu['ci95'][0]:.4f}-"
          f"{cpu['ci95'][1]:.4f}, runs {cpu['min']:.4f}-{cpu['max']:.4f}; target >= {TARGET});"
          f" all steps pooled {pooled:.4f}")
    print(f"wall-clock ratio raw / Lightning (step time): median {wall['median']:.4f} (runs {wall['min']:.4f}-"
          f"{wall['max']:.4f}; a rank's wait for the other is counted in whichever side's step it falls)")
    return {"mode": "interleaved", "cpu_ratio": cpu, "pooled_cpu_ratio": pooled, "wall_ratio": wall,
            "medians": medians, "target": TARGET, "runs": runs}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"lightning": [], "raw": []}
    print(f"{'pair':<5}{'side':<11}{'CPU ms/step':>12}{'user':>8}{'sys':>7}{'faults':>7}{'tokens/s':>10}"
          f"{'step ms':>9}{'CPU share':>10}  loadavg", flush=True)
    with _workdir(args.keep) as workdir:
        for index in range(args.repeats):
            order = ("lightning", "raw") if index % 2 == 0 else ("raw", "lightning")
            for side in order:
                result = run_side(side, args, workdir, index)
                result["loadavg"] = _loadavg()
                runs[side].append(result)
                print(f"{index:<5}{side:<11}{result['cpu_ms_per_step']:>12.1f}{result['user_ms_per_step']:>8.1f}"
                      f"{result['sys_ms_per_step']:>7.1f}{result['page_faults_per_step']:>7.0f}"
                      f"{result['tokens_per_s']:>10.0f}"
                      f"{result['median_step_ms']:>9.1f}{result['cpu_share']:>10.2f}  {result['loadavg']}", flush=True)
    pairs = list(zip(runs["lightning"], runs["raw"]))
    cpu = spread([raw["cpu_ms_per_step"] / ours["cpu_ms_per_step"] for ours, raw in pairs])
    tokens = spread([ours["tokens_per_s"] / raw["tokens_per_s"] for ours, raw in pairs])
    medians = {side: {key: statistics.median(r[key] for r in results)
                      for key in ("cpu_ms_per_step", "user_ms_per_step", "sys_ms_per_step", "tokens_per_s")}
               for side, results in runs.items()}
    print(f"\nCPU ms per step and rank (median of runs): Lightning + lightning-npu"
          f" {medians['lightning']['cpu_ms_per_step']:.1f}, raw FSDP2 {medians['raw']['cpu_ms_per_step']:.1f}")
    print(f"paired CPU ratio raw / Lightning: median {cpu['median']:.3f} (95% interval {cpu['ci95'][0]:.3f}-"
          f"{cpu['ci95'][1]:.3f}, pairs {cpu['min']:.3f}-{cpu['max']:.3f}; target >= {TARGET})")
    print(f"paired tokens/s ratio Lightning / raw: median {tokens['median']:.3f} (pairs {tokens['min']:.3f}-"
          f"{tokens['max']:.3f}; wall clock, moved by the machine's load)")
    return {"mode": "separate", "cpu_ratio": cpu,
            "cpu_paired_ratios": [raw["cpu_ms_per_step"] / ours["cpu_ms_per_step"] for ours, raw in pairs],
            "tokens_ratio": tokens, "tokens_paired_ratios": [o["tokens_per_s"] / r["tokens_per_s"] for o, r in pairs],
            "medians": medians, "target": TARGET, "runs": runs}


def profile(args: argparse.Namespace) -> dict[str, Any]:
    sides: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, float]] = {}
    functions: dict[str, dict[str, list[tuple[str, float]]]] = {}
    hooks: dict[str, tuple[float, float]] = {}
    inclusive: list[tuple[str, float, float]] = []
    per_step = 1000 / args.steps
    with _workdir(args.keep) as workdir:
        for side in ("lightning", "raw"):
            result = run_side(side, args, workdir, 0, profile=True)
            stats = result.pop("stats")
            # Calls with no recorded caller come from the frame running when profiling began: the loop.
            root = "Lightning loops" if side == "lightning" else "benchmark (raw loop, clock)"
            parts = contributions(stats, root)
            groups[side] = {}
            for (group, _), seconds in parts.items():
                groups[side][group] = groups[side].get(group, 0.0) + seconds * per_step
            functions[side] = {group: [(name, seconds * per_step) for name, seconds in top_functions(parts, group, 8)]
                               for group in groups[side]}
            if side == "lightning":
                hooks = {name: (seconds * per_step, calls / args.steps)
                         for name, (seconds, calls) in hook_times(stats).items()}
                step_s = sum(parts.values()) / args.steps
                inclusive = [(name, seconds * per_step, calls / args.steps)
                             for name, seconds, calls in lightning_inclusive(stats, 0.1 * step_s * args.steps, 25)]
            result["loadavg"] = _loadavg()
            sides[side] = result
    report = {"steps": args.steps, "clock": "main thread CPU time (time.thread_time), rank 0, under cProfile",
              "groups_ms_per_step": groups, "top_functions_ms_per_step": functions, "hooks_ms_per_step": hooks,
              "lightning_inclusive_ms_per_step": inclusive, "sides": sides}
    print_profile(report)
    return report


def _owned_by_lightning_side(group: str) -> bool:
    """Groups of code that only the Trainer side runs (what the profile is to name)."""
    return group.startswith(("Lightning", "lightning_npu.", "recipe DecoderLM")) and group != "lightning_npu.kernels"


def print_profile(report: Mapping[str, Any]) -> None:
    groups = report["groups_ms_per_step"]
    names = sorted(set(groups["lightning"]) | set(groups["raw"]),
                   key=lambda g: -max(groups["lightning"].get(g, 0.0), groups["raw"].get(g, 0.0)))
    print(f"\nmain thread CPU ms per step on rank 0 under cProfile ({report['steps']} steps; process CPU ms per step"
          f" of rank 0: Lightning {report['sides']['lightning']['ranks'][0]['cpu_ms_per_step']:.1f},"
          f" raw {report['sides']['raw']['ranks'][0]['cpu_ms_per_step']:.1f}):")
    print(f"{'group':<40}{'Lightning':>10}{'raw':>9}{'diff':>9}")
    for name in names:
        ours, raw = groups["lightning"].get(name, 0.0), groups["raw"].get(name, 0.0)
        print(f"{name:<40}{ours:>10.2f}{raw:>9.2f}{ours - raw:>+9.2f}")
    total = {side: sum(values.values()) for side, values in groups.items()}
    print(f"{'total':<40}{total['lightning']:>10.2f}{total['raw']:>9.2f}{total['lightning'] - total['raw']:>+9.2f}")
    only = sum(ms for group, ms in groups["lightning"].items() if _owned_by_lightning_side(group))
    print(f"{'of which Lightning, lightning_npu (less kernels), DecoderLM':<40}{only:>10.2f}")
    print("\ntheir largest functions (own time, built-ins they call included), ms per step:")
    for group in names:
        if _owned_by_lightning_side(group) and groups["lightning"].get(group, 0.0) >= 0.02:
            tops = report["top_functions_ms_per_step"]["lightning"][group][:4]
            print(f"  {group}: " + "; ".join(f"{name} {ms:.3f}" for name, ms in tops))
    print("\nLightning's functions by inclusive ms per step (calls per step), those under 10% of the step (not"
          " wrapping the forward or backward):")
    for name, ms, calls in report["lightning_inclusive_ms_per_step"][:15]:
        print(f"  {name:<90}{ms:>7.3f}  ({calls:g})")
    print("\nthe plugin's and the recipe's functions that Lightning calls, inclusive ms per step (calls per step):")
    for name, (ms, calls) in sorted(report["hooks_ms_per_step"].items(), key=lambda item: -item[1][0]):
        print(f"  {name:<70}{ms:>9.3f}  ({calls:g})")


@contextlib.contextmanager
def _workdir(keep: str | None) -> Iterator[Path]:
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep).resolve()
    else:
        with tempfile.TemporaryDirectory() as workdir:
            yield Path(workdir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--separate", action="store_true",
                      help="each side in its own processes, runs alternating (the earlier method; tokens/s too)")
    mode.add_argument("--profile", action="store_true", help="profile one run of each side (cProfile, rank 0)")
    parser.add_argument("--repeats", type=int, help="runs (interleaved, default 8) or pairs of runs (--separate,"
                                                    " default 10)")
    parser.add_argument("--steps", type=int, default=60, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured steps first")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per process")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--glibc-defaults", action="store_true",
                        help="leave glibc's malloc as it comes (default: PINNED_MALLOC for both sides)")
    parser.add_argument("--callbacks", choices=("bare", "recipe"), default="bare",
                        help="the Lightning side's callbacks: the plugin's own only, or also the recipe's")
    parser.add_argument("--against", metavar="JSON", help="a previous result of the same mode: print how far this"
                                                          " run's CPU ratio is from its")
    parser.add_argument("--keep", metavar="DIR", help="keep the workers' files there (with --profile rank 0's"
                                                      " cProfile dumps, *.prof, for pstats or snakeviz)")
    parser.add_argument("--out", metavar="JSON", help="default: benchmarks/plugin_overhead.json, with --separate"
                        " plugin_overhead_separate.json, with --profile plugin_overhead_profile.json")
    parser.add_argument("--worker", choices=("lightning", "raw"), help=argparse.SUPPRESS)
    parser.add_argument("--interleaved", action="store_true", help=argparse.SUPPRESS)
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
    if args.repeats is None:
        args.repeats = 10 if args.separate else 8
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    started = {"date": time.strftime("%Y-%m-%d %H:%M"), "loadavg_before": _loadavg()}
    if args.profile:
        summary, name = profile(args), "plugin_overhead_profile.json"
    elif args.separate:
        summary, name = measure(args), "plugin_overhead_separate.json"
    else:
        summary, name = measure_interleaved(args), "plugin_overhead.json"
    if args.against and not args.profile:
        before = json.loads(Path(args.against).read_text())["cpu_ratio"]["median"]
        now = summary["cpu_ratio"]["median"]
        summary["against"] = {"file": args.against, "cpu_ratio": before, "relative_difference": now / before - 1}
        print(f"against {args.against}: CPU ratio {before:.4f} there, {now:.4f} here ({now / before - 1:+.2%})")
    summary = {**started, "loadavg_after": _loadavg(), "setup": _setup(args), **summary}
    out = Path(args.out or Path(__file__).with_name(name))
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
