"""Collective checks: all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single (context
parallelism's Ulysses exchange; with uneven split sizes, expert parallelism's token exchange), all_gather of a list
(the experts' row shares under tensor parallelism), broadcast, and a send to the next rank with a receive from the
previous in one ``batch_isend_irecv`` (pipeline parallelism's exchange) over the process group the strategy built
(hccl on NPUs, gloo when simulated), checked for exact results and timed per size.

Every rank fills its tensors with small integers times (rank + 1), so every correct result is an exact
float32 integer (sums stay below 2**24 up to 64 ranks) and is compared bit for bit. Bus bandwidth follows
nccl-tests (doc/PERFORMANCE.md): algbw = S / t, with S the size of the full buffer (the gathered output, the
scattered input, the all-to-all's input), and busbw = algbw x 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
reduce_scatter and all_to_all (each rank keeps 1/n of its buffer), and 1 for broadcast and the send/receive (S: one
rank's buffer): what each link carries, comparable with the hardware's bandwidth whatever the number of ranks.

``ops`` is the module whose collectives run (``torch.distributed``); tests pass a wrong one to see the check fail.
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_npu.selftest.report import FAIL, NOT_AVAILABLE, PASS, CheckResult

FAMILY = "collectives"
MIB = 1024**2
QUICK_SIZES = (1 * MIB, 8 * MIB)
FULL_SIZES = (1 * MIB, 16 * MIB, 256 * MIB)
# Values 0..60: 60 x n x n(n+1)/2 (reduce_scatter's largest) stays below 2**24 up to n = 64.
_VALUE_RANGE = 61


@dataclass(frozen=True)
class _Prepared:
    """One collective at one size: ``run`` issues it once; ``result`` and ``expected`` are compared after it."""

    run: Callable[[], Any]
    result: Tensor
    expected: Tensor


def _base(numel: int, device: torch.device) -> Tensor:
    return (torch.arange(numel, device=device) % _VALUE_RANGE).float()


def _all_reduce(ops: Any, group: Any, n: int, rank: int, numel: int, device: torch.device) -> _Prepared:
    base = _base(numel, device)
    tensor = base * (rank + 1)
    return _Prepared(lambda: ops.all_reduce(tensor, group=group), tensor, base * (n * (n + 1) // 2))


def _all_gather(ops: Any, group: Any, n: int, rank: int, numel: int, device: torch.device) -> _Prepared:
    chunk = _base(numel // n, device)
    output = torch.empty(n * chunk.numel(), device=device)
    expected = torch.cat([chunk * (r + 1) for r in range(n)])
    source = chunk * (rank + 1)
    return _Prepared(lambda: ops.all_gather_into_tensor(output, source, group=group), output, expected)


def _reduce_scatter(ops: Any, group: Any, n: int, rank: int, numel: int, device: torch.device) -> _Prepared:
    chunk = _base(numel // n, device)
    source = torch.cat([chunk * (rank + 1) * (c + 1) for c in range(n)])
    output = torch.empty_like(chunk)
    expected = chunk * (rank + 1) * (n * (n + 1) // 2)
    return _Prepared(lambda: ops.reduce_scatter_tensor(output, source, group=group), output, expected)


def _all_to_all(ops: Any, group: Any, n: int, rank: int, numel: int, device: torch.device) -> _Prepared:
    chunk = _base(numel // n, device)
    # Chunk c goes to rank c; rank r receives chunk r of every rank s, in the order of s.
    source = torch.cat([chunk * (rank + 1) + c for c in range(n)])
    output = torch.empty_like(source)
    expected = torch.cat([chunk * (s + 1) + rank for s in range(n)])
    return _Prepared(lambda: ops.all_to_all_single(output, source, group=group), output, expected)


def _all_to_all_uneven(ops: Any, group: Any, n: int, rank: int, numel: int, device: torch.device) -> _Prepared:
    """Expert parallelism's exchange: rank r sends rank c ``(r + c) % n + 1`` units (uneven split sizes)."""
    unit = max(1, numel // (n * n))

    def sizes(source: int) -> list[int]:
        return [((source + c) % n + 1) * unit for c in range(n)]

    source = torch.cat([_base(size, device) * (rank + 1) + c for c, size in enumerate(sizes(rank))])
    receive = [sizes(s)[rank] for s in range(n)]
    output = torch.empty(sum(receive), device=device)
    expected = torch.cat([_base(size, device) * (s + 1) + rank for s, size in enumerate(receive)])
    return _Prepared(lambda: ops.all_to_all_single(output, source, output_split_sizes=receive,
                                                   input_split_sizes=sizes(rank), group=group), output, expected)


def _all_gather_list(ops: Any, group: Any, n: int, rank: int, numel: int, device: torch.device) -> _Prepared:
    """The list form the experts' row shares are gathered with under tensor parallelism (one tensor per rank)."""
    chunk = _base(numel // n, device)
    outputs = [torch.empty_like(chunk) for _ in range(n)]
    source = chunk * (rank + 1)
    expected = torch.cat([chunk * (r + 1) for r in range(n)])
    result = torch.empty(n * chunk.numel(), device=device)

    def run() -> None:
        ops.all_gather(outputs, source, group=group)
        torch.cat(outputs, out=result)

    return _Prepared(run, result, expected)


def _broadcast(ops: Any, group: Any, n: int, rank: int, numel: int, device: torch.device) -> _Prepared:
    base = _base(numel, device)
    tensor = base * (rank + 1)
    # The group's first rank is the source; ``group_src`` would need torch >= 2.7's keyword on every backend.
    src = 0 if group is None else ops.get_global_rank(group, 0)
    return _Prepared(lambda: ops.broadcast(tensor, src=src, group=group), tensor, base)


def _send_recv(ops: Any, group: Any, n: int, rank: int, numel: int, device: torch.device) -> _Prepared:
    """Pipeline parallelism's exchange: a send to the next rank and a receive from the previous in one
    ``batch_isend_irecv`` (one ``HcclBatchSendRecv`` under torch_npu). On 2 ranks both have one peer, as in 1F1B's
    batches, which pair a stage's send with its receive from the same neighbour."""
    base = _base(numel, device)
    source = base * (rank + 1)
    output = torch.empty_like(base)

    def peer(offset: int) -> int:
        local = (rank + offset) % n
        return local if group is None else ops.get_global_rank(group, local)

    def run() -> None:
        batch = [ops.P2POp(ops.isend, source, peer(1), group), ops.P2POp(ops.irecv, output, peer(-1), group)]
        for work in ops.batch_isend_irecv(batch):
            work.wait()

    return _Prepared(run, output, base * ((rank - 1) % n + 1))


@dataclass(frozen=True)
class Collective:
    name: str
    prepare: Callable[..., _Prepared]
    busbw_factor: Callable[[int], float]
    min_ranks: int = 1


COLLECTIVES = (
    Collective("all_reduce", _all_reduce, lambda n: 2 * (n - 1) / n),
    Collective("all_gather_into_tensor", _all_gather, lambda n: (n - 1) / n),
    Collective("reduce_scatter_tensor", _reduce_scatter, lambda n: (n - 1) / n),
    Collective("all_to_all_single", _all_to_all, lambda n: (n - 1) / n),
    Collective("all_to_all_single uneven", _all_to_all_uneven, lambda n: (n - 1) / n),
    Collective("all_gather", _all_gather_list, lambda n: (n - 1) / n),
    Collective("broadcast", _broadcast, lambda n: 1.0),
    Collective("send/recv (batch_isend_irecv)", _send_recv, lambda n: 1.0, min_ranks=2),
)


def collective_checks(runtime: Any, device: torch.device, *, sizes: Sequence[int] = QUICK_SIZES, iterations: int = 5,
                      ops: Any = None, group: Any = None) -> list[tuple[str, Callable[[], CheckResult]]]:
    """Each collective's check on this rank, not run yet, by its label: exact at every size (``sizes`` in bytes of
    fp32), and its bus bandwidth in GB/s (1e9 bytes/s) per size, from ``iterations`` back-to-back runs after the
    checked one. Every rank runs the same checks in the same order."""
    ops = torch.distributed if ops is None else ops
    n, rank = ops.get_world_size(group), ops.get_rank(group)
    return [(f"{FAMILY}/{collective.name}",
             functools.partial(_check, collective, runtime, device, sizes, iterations, ops, group, n, rank))
            for collective in COLLECTIVES]


def _check(collective: Collective, runtime: Any, device: torch.device, sizes: Sequence[int], iterations: int,
           ops: Any, group: Any, n: int, rank: int) -> CheckResult:
    figures: dict[str, Any] = {"ranks": n}
    if n < collective.min_ranks:
        return CheckResult(FAMILY, collective.name, NOT_AVAILABLE, f"needs {collective.min_ranks} ranks; {n} here",
                           figures)
    with warnings.catch_warnings():
        # torch 2.13 renames them all_gather_single / reduce_scatter_single (what its FSDP2 calls); the old names
        # forward to those with a FutureWarning, and are the only ones older torch releases have.
        warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+_tensor` is deprecated", FutureWarning)
        wrong: Optional[str] = None
        for size in sizes:
            numel = max(n, size // 4 // n * n)  # a whole number of fp32 elements per rank
            prepared = collective.prepare(ops, group, n, rank, numel, device)
            prepared.run()
            runtime.synchronize()
            if wrong is None and not torch.equal(prepared.result, prepared.expected):
                mismatched = int((prepared.result != prepared.expected).sum())
                wrong = (f"rank {rank}: {mismatched} of {prepared.result.numel()} elements differ from the exact"
                         f" result at {_size_label(size)}")
            seconds = _time(prepared.run, runtime, ops, group, iterations, n)
            algbw = numel * 4 / seconds / 1e9
            figures[f"busbw_{_size_label(size)}_gbps"] = algbw * collective.busbw_factor(n)
            figures.setdefault("seconds", {})[_size_label(size)] = seconds
        if wrong is None:
            return CheckResult(FAMILY, collective.name, PASS, f"exact on {n} rank(s)", figures)
        return CheckResult(FAMILY, collective.name, FAIL, wrong, figures)


def _time(run: Callable[[], Any], runtime: Any, ops: Any, group: Any, iterations: int, n: int) -> float:
    """Seconds per call: ranks start together (barrier), the device is synchronised before and after."""
    if n > 1:  # nobody to wait for otherwise
        ops.barrier(group=group)
    runtime.synchronize()
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    runtime.synchronize()
    return (time.perf_counter() - start) / iterations


def _size_label(size: int) -> str:
    return f"{size // MIB}MiB" if size % MIB == 0 else f"{size // 1024}KiB"
