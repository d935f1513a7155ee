"""How a finished run exits: a 3-step Fabric script with no teardown, run N times each way on 2 simulated NPUs,
counting the processes that ended in a signal.

    python benchmarks/clean_exit.py                                   # 50 runs each way, this tree
    git worktree add --detach /tmp/before <commit before the fix>
    python benchmarks/clean_exit.py --before-root /tmp/before         # the same runs on that tree too
    python benchmarks/clean_exit.py --runs 5 --ways launch --json /tmp/r.json    # a quick look

Ways (``tests/strategies/scripts/clean_exit_run.py``, npu_ddp, a logged all-reduce per step, nothing destroyed by the script):

- ``run``: ``lightning-npu run --devices 2 script.py`` (torchrun starts both ranks; a no-argument ``Fabric()``);
- ``launch``: ``python script.py --launch``: ``Fabric(accelerator="npu", devices=2).launch()`` (Lightning starts
  rank 1 from rank 0).

Every process's exit status is counted: under ``run``, torchrun's report (it names each rank that failed, with its
exit code or signal); under ``launch``, this process waits for rank 0 and, as the child subreaper
(``prctl(PR_SET_CHILD_SUBREAPER)``), for rank 1 too, which rank 0 leaves behind when it exits first. A run counts as
finished when every rank printed the script's finished line; ``signal_exits`` counts runs in which any process
ended in a signal (SIGABRT: "terminate called without an active exception"). Each process also reports, from an
atexit hook that runs after the plugin's, whether process groups were left and how many gloo worker threads were
still running when Python finalised.

Linux only (``/proc``, ``prctl``). Runs one after another; on a shared 2-core CPU a run takes 8-15 s.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCRIPT = REPO / "tests" / "strategies" / "scripts" / "clean_exit_run.py"
OUTPUT = HERE / "clean_exit.json"
WAYS = ("run", "launch")
WORLD = 2
#: One run gets this long: a hang at exit must fail the count, not stall it.
RUN_TIMEOUT_S = 300

_PR_SET_CHILD_SUBREAPER = 36
_FINISHED = re.compile(r"clean-exit: rank (\d+) pid (\d+) finished")
_TEARDOWN = re.compile(r"clean-exit: rank (\d+) pid (\d+) at teardown: process groups left (True|False),"
                       r" gloo worker threads (\d+)")
# torchrun's failure table: "rank      : 1 (local_rank: 1)" then "exitcode  : -6 (pid: 9741)".
_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")


@dataclass
class Run:
    """One run of the script: the exit status of each of its processes (negative: the signal that ended it)."""

    way: str
    exit_codes: dict[str, int]  # pid -> status
    finished_ranks: list[int]
    teardowns: list[dict] = field(default_factory=list)  # per rank: groups_left, gloo_worker_threads
    seconds: float = 0.0
    output: str = ""  # kept only for a run that did not exit cleanly or left something at teardown

    @property
    def signalled(self) -> bool:
        return any(code < 0 for code in self.exit_codes.values())

    @property
    def clean(self) -> bool:
        return (not any(self.exit_codes.values()) and len(self.exit_codes) >= WORLD
                and sorted(self.finished_ranks) == list(range(WORLD)))


def become_subreaper() -> None:
    """Orphaned descendants (rank 1 of a ``launch`` run, once rank 0 has exited) are re-parented to this process,
    so their exit status can be collected here."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def command(way: str, script_args: list[str]) -> list[str]:
    if way == "run":
        return [sys.executable, "-m", "lightning_npu.cli", "run", "--devices", str(WORLD), "--main-port",
                str(_free_port()), str(SCRIPT), *script_args]
    return [sys.executable, str(SCRIPT), "--launch", *script_args]


def run_once(way: str, script_args: list[str] = (), root: Path = REPO) -> Run:
    """Run the script once ``way`` with ``root``'s lightning_npu (this process must be a subreaper)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LT_", "MASTER_", "LOCAL_RANK", "RANK"))}
    env["LIGHTNING_NPU_SIMULATE"] = str(WORLD)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), str(REPO), os.environ.get("PYTHONPATH")]))
    start = time.monotonic()
    # cwd: `python -m` (torchrun's workers) puts it first on sys.path, ahead of PYTHONPATH.
    with subprocess.Popen(command(way, list(script_args)), cwd=root, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    # A rank that printed its finished line and was reaped by its own parent (torchrun, or rank 0's launcher)
    # exited 0: a failure there is in torchrun's report, or makes Lightning's launcher SIGKILL rank 0.
    exit_codes = {pid: 0 for _rank, pid in _FINISHED.findall(output)}
    exit_codes.update({str(pid): code for pid, code in _reap_orphans(start + RUN_TIMEOUT_S).items()})
    if way == "run":
        exit_codes.update({pid: int(code) for _rank, code, pid in _TORCHRUN_FAILURE.findall(output)})
        if proc.returncode and not any(exit_codes.values()):
            exit_codes["launcher"] = proc.returncode  # failed before torchrun's report (an option error)
    else:
        exit_codes[str(proc.pid)] = proc.returncode
    run = Run(
        way=way,
        exit_codes=exit_codes,
        finished_ranks=sorted(int(rank) for rank, _pid in _FINISHED.findall(output)),
        teardowns=[{"rank": int(rank), "groups_left": left == "True", "gloo_worker_threads": int(threads)}
                   for rank, _pid, left, threads in _TEARDOWN.findall(output)],
        seconds=round(time.monotonic() - start, 1),
    )
    left = any(t["groups_left"] or t["gloo_worker_threads"] for t in run.teardowns)
    if not run.clean or len(run.teardowns) < WORLD or left:  # kept to tell what happened
        run.output = output[-6000:]
    return run


def summarize(runs: list[Run]) -> dict:
    return {
        "runs": len(runs),
        "clean": sum(run.clean for run in runs),
        "signal_exits": sum(run.signalled for run in runs),
        "signals": sorted({code for run in runs for code in run.exit_codes.values() if code < 0}),
        "other_failures": sum(not run.clean and not run.signalled for run in runs),
        "groups_left_at_teardown": sum(any(t["groups_left"] for t in run.teardowns) for run in runs),
        "gloo_worker_threads_at_teardown": sum(t["gloo_worker_threads"] for run in runs for t in run.teardowns),
        "median_s": sorted(run.seconds for run in runs)[len(runs) // 2] if runs else None,
    }


def measure(ways: list[str], runs: int, root: Path = REPO, script_args: list[str] = ()) -> dict:
    result = {}
    for way in ways:
        done = []
        for index in range(runs):
            run = run_once(way, script_args, root)
            done.append(run)
            status = "clean" if run.clean else f"NOT CLEAN {run.exit_codes}"
            print(f"{root.name or root} {way} {index + 1}/{runs}: {status} ({run.seconds} s)", flush=True)
        result[way] = {**summarize(done), "failed_runs": [asdict(run) for run in done if not run.clean]}
    return result


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50, help="runs per way (default 50)")
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated among: " + ", ".join(WAYS))
    parser.add_argument("--before-root", type=Path, default=None,
                        help="another checkout whose lightning_npu is measured the same way (before a change)")
    parser.add_argument("--json", type=Path, default=OUTPUT, help=f"where the counts go (default {OUTPUT})")
    parser.add_argument("script_args", nargs="*", help="passed to the script (after --), e.g. --strategy npu_fsdp")
    # For tests: run each [way, [script arguments]] of a JSON list once; --json gets every run's record.
    parser.add_argument("--cases", type=json.loads, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cases is not None:
        become_subreaper()
        runs = [run_once(way, script_args) for way, script_args in args.cases]
        args.json.write_text(json.dumps([{**asdict(run), "clean": run.clean} for run in runs], indent=2))
        return
    ways = [way.strip() for way in args.ways.split(",")]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        parser.error(f"--ways {','.join(unknown)} is not one of {', '.join(WAYS)}")
    become_subreaper()
    results = {"script": str(SCRIPT.relative_to(REPO)), "script_args": args.script_args,
               "after": measure(ways, args.runs, REPO, args.script_args)}
    if args.before_root is not None:
        results["before"] = measure(ways, args.runs, args.before_root.resolve(), args.script_args)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    for label in ("before", "after"):
        for way, counts in results.get(label, {}).items():
            print(f"{label:6} {way:6}: {counts['signal_exits']} of {counts['runs']} runs ended in a signal"
                  f" {counts['signals'] or ''}, {counts['clean']} clean")
    print(f"wrote {args.json}")


def _reap_orphans(deadline: float) -> dict[int, int]:
    """Exit statuses of the descendants re-parented to this process, once all of them have exited."""
    statuses = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return statuses  # no child left
        if pid:
            statuses[pid] = os.waitstatus_to_exitcode(status)
        elif time.monotonic() > deadline:
            raise TimeoutError(f"a process of the run was still alive {RUN_TIMEOUT_S} s after it started")
        else:
            time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
