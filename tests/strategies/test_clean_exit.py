"""A finished run exits cleanly (``lightning_npu/strategies/clean_exit.py``): no process group is left when Python
finalises, so no gloo worker thread can be releasing a collective's tensors then (the SIGABRT of
pytorch/pytorch#190489), and a rank whose peer died still exits at once with its own status.

One process (``benchmarks/clean_exit.py --cases``, the benchmark's own runner, which collects every rank's exit
status as the child subreaper) runs ``tests/strategies/scripts/clean_exit_run.py`` -- 3 steps on 2 simulated NPUs, no teardown
in the script -- four ways; the tests below read its records.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, read_json, room_scripts, run_python
from tests.prefetch import PREFETCHED

SCRIPTS = room_scripts("strategies")

BENCHMARK = REPO / "benchmarks" / "clean_exit.py"
IN_FLIGHT = SCRIPTS / "collective_in_flight_at_exit.py"
RANKS = [0, 1]

pytestmark = pytest.mark.slow


@PREFETCHED.fixture(seconds=36)
def clean_exit_runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("clean-exit")
    cases = {
        "fabric_run": ["run", []],  # lightning-npu run: torchrun starts both ranks, a no-argument Fabric()
        "fabric_launch_async_save": ["launch", ["--async-save", str(work / "ckpt")]],  # Fabric.launch(), npu_fsdp
        "trainer": ["launch", ["--trainer"]],
        "peer_killed": ["launch", ["--kill-rank", "0", "--sync-dir", str(work / "sync")]],
    }
    out = work / "runs.json"
    # fresh: the benchmark collects its process tree's exit statuses as their subreaper
    run_python([str(BENCHMARK), "--cases", json.dumps(list(cases.values())), "--json", str(out)], timeout=1200,
               fresh=True)
    return {"work": work, **dict(zip(cases, read_json(out)))}


def _teardown(run: dict) -> dict:
    return {t["rank"]: (t["groups_left"], t["gloo_worker_threads"]) for t in run["teardowns"]}


@pytest.mark.parametrize("case", ["fabric_run", "trainer"])
def test_a_finished_run_destroys_its_process_groups_before_python_finalises_and_exits_0(clean_exit_runs, case):
    """Catches process groups left to interpreter teardown (the state in which about one short run in 30-60 here
    ended in SIGABRT after finishing): a Fabric script under ``lightning-npu run`` and a Trainer run must finish on
    every rank, exit 0 (no signal), and reach the end of Python's exit with no process group and no gloo worker
    thread left."""
    run = clean_exit_runs[case]
    assert run["finished_ranks"] == RANKS, run["output"]
    assert len(run["exit_codes"]) == len(RANKS) and not any(run["exit_codes"].values()), run
    assert _teardown(run) == {rank: (False, 0) for rank in RANKS}, run


def test_an_async_save_in_flight_at_exit_completes_then_every_group_is_destroyed(clean_exit_runs):
    """Catches the async-checkpoint gloo group (and npu_fsdp's mesh, which torch's DTensor caches keep alive)
    left to interpreter teardown, and an exit hook that destroys that group under a save still writing: with
    ``Fabric.launch()`` and npu_fsdp, a save started after the last step must be complete under its final name
    (DCP metadata, meta.pt), every rank exit 0, and no group or gloo worker thread be left."""
    run = clean_exit_runs["fabric_launch_async_save"]
    checkpoint = clean_exit_runs["work"] / "ckpt"
    assert (checkpoint / ".metadata").is_file() and (checkpoint / "meta.pt").is_file()
    assert [p.name for p in checkpoint.parent.iterdir() if p.name.startswith(".ckpt.tmp-")] == []
    assert run["finished_ranks"] == RANKS, run["output"]
    assert len(run["exit_codes"]) == len(RANKS) and not any(run["exit_codes"].values()), run
    assert _teardown(run) == {rank: (False, 0) for rank in RANKS}, run


def test_a_rank_whose_peer_was_killed_exits_promptly_with_its_own_status(clean_exit_runs):
    """Catches an exit hook that waits for a dead peer (a barrier, a collective destroy) until the process-group
    timeout (30 min): rank 0 SIGKILLs itself after both ranks finished, and rank 1, exiting only once it is dead,
    must exit 0 within the run's limit with its groups destroyed."""
    run = clean_exit_runs["peer_killed"]
    codes = sorted(run["exit_codes"].values())
    shown = str(run)  # whole, with the run's output: pytest would cut a dict's repr short
    assert codes == [-9, 0], shown
    assert run["finished_ranks"] == [1], shown
    assert _teardown(run) == {1: (False, 0)}, shown


def test_an_exit_with_a_collective_in_flight_that_no_peer_joins_ends_after_the_limit_with_status_1(tmp_path):
    """Catches an exit hook that hangs until the process-group timeout (600 s here) when freeing a group whose
    collective waits for a live peer that never joins it (an exception exit mid-collective): with the hook's limit
    at 3 s, rank 0 must exit 1 within the test's limit, naming the cause."""
    store = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    peer = subprocess.Popen([sys.executable, str(IN_FLIGHT), "1", str(store)], env=env, cwd=REPO)
    try:
        with pytest.raises(AssertionError) as failure:
            run_python([str(IN_FLIGHT), "0", str(store), "--limit", "3"], simulate=None, timeout=180, fresh=True)
    finally:
        peer.kill()
        peer.wait()
    report = str(failure.value)
    assert " exited 1\n" in report, report
    assert "rank 0 exits with an all-reduce in flight" in report
    assert "the process groups were not destroyed within 3 s of exit (a collective is still waiting for a peer)" \
        in report
