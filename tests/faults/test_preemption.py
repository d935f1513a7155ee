"""Preemption on 2 simulated NPUs: SIGTERM to the whole process group (what SLURM and Kubernetes send) mid-training
stops every rank at the same step, writes a checkpoint, exits 143 within the bound, and the checkpoint resumes; the
same for a Fabric loop with FabricPreemption (and SIGUSR1, SLURM's requeue signal: exit 138)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, read_json, room_scripts, run_python
from tests.recipe_runs import SMALL, TINY, TRAIN, last_checkpoint

SCRIPTS = room_scripts("faults")

#: Every process must be gone this long after the signal (the brief's bound for the tiny recipe).
pytestmark = pytest.mark.slow  # every test here starts processes or trains (or shares a fixture that does)


EXIT_BOUND_S = 60
FABRIC_SCRIPT = str(SCRIPTS / "fabric_faults_run.py")


def _launch(args):
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_NPU_SIMULATE"}
    env.update(LIGHTNING_NPU_SIMULATE="2", PYTHONPATH=str(REPO))
    # A session of its own, so the test can signal the whole process group as a scheduler does.
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _start(root, *extra):
    return _launch([TRAIN, "fit", "--config", TINY, *SMALL, "--trainer.max_steps", "100000",
                    "--trainer.default_root_dir", str(root), *extra])


def _wait_for_training(proc, marker="step 10/"):
    seen = []
    # A run that prints nothing more (hung) would block the read forever: killed at the deadline, it ends the read.
    watchdog = threading.Timer(180, os.killpg, args=(proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        for line in proc.stdout:
            seen.append(line)
            if marker in line:
                return seen
    finally:
        watchdog.cancel()
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("training never reached step 10 in 180 s:\n" + "".join(seen[-40:]))


def _signal_and_wait(proc, target, signum):
    """Send ``signum`` to the process group or the main process only; its output once every process is gone."""
    signalled = time.monotonic()
    if target == "group":
        os.killpg(proc.pid, signum)
    else:
        os.kill(proc.pid, signum)
    try:
        rest, _ = proc.communicate(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        name = signal.Signals(signum).name
        raise AssertionError(f"still running {EXIT_BOUND_S} s after {name}:\n{proc.communicate()[0][-3000:]}")
    deadline = signalled + EXIT_BOUND_S
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(proc.pid), "a rank outlived the main process"
    return rest


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(("target", "workers"), [("group", 0), ("main", 0), ("group", 2)],
                         ids=["group", "main-process-only", "group-with-dataloader-workers"])
def test_sigterm_stops_every_rank_saves_and_exits_143_then_resumes(tmp_path, target, workers):
    """Catches: Lightning's handler running a collective inside the signal handler (ranks hang until the 30 min
    process-group timeout), exit code 0 on SIGTERM, no checkpoint written, a rank left running, (main-process-only)
    the main process not forwarding the signal to the rank it launched, and (dataloader-workers) workers killed by
    the group's SIGTERM failing their rank's next batch."""
    proc = _start(tmp_path, "--data.num_workers", str(workers))
    _wait_for_training(proc)
    rest = _signal_and_wait(proc, target, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, rest[-3000:]
    assert "generate:" not in rest  # the run did not pretend to have finished

    checkpoints = sorted((tmp_path / "lightning_logs" / "version_0" / "checkpoints").glob("preempted-step=*.ckpt"))
    assert len(checkpoints) == 1, rest[-3000:]
    from recipes.decoder.checkpoint_layout import read_recipe_metadata

    step = read_recipe_metadata(checkpoints[0])["global_step"]
    assert checkpoints[0].name == f"preempted-step={step}.ckpt" and step >= 10

    # Validation (and so ModelCheckpoint's last.ckpt) comes every 4 batches (SMALL's val_check_interval).
    target = (step // 4 + 1) * 4
    resumed = run_python([TRAIN, "fit", "--config", TINY, *SMALL, "--trainer.max_steps", str(target),
                          "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", str(checkpoints[0])])
    assert f"Restored all states from the checkpoint at {checkpoints[0]}" in resumed.stdout + resumed.stderr
    assert read_recipe_metadata(last_checkpoint(tmp_path, 1))["global_step"] == target


@pytest.mark.parametrize(("target", "signum", "resume"),
                         [("group", signal.SIGTERM, True), ("main", signal.SIGUSR1, False)],
                         ids=["sigterm-group-then-resume", "sigusr1-main-process-only"])
def test_fabric_loop_stops_every_rank_at_one_step_saves_and_exits_128_plus_signal(tmp_path, target, signum, resume):
    """A Fabric loop with FabricPreemption (tests/faults/scripts/fabric_faults_run.py). Catches: Fabric's default (no
    handler: each rank dies at once, mid-collective, exit -15), ranks stopping at different steps (their collective
    saves would hang), a checkpoint missing or not the sharded npu_fsdp directory, a wrong exit status (SIGUSR1 unhandled
    kills with -10), (main-process-only) the rank the launcher started not stopping with the signalled main process,
    and (resume) a checkpoint that does not hold the weights and step of the stop."""
    proc = _launch([FABRIC_SCRIPT, "preempt", "--out", str(tmp_path)])
    _wait_for_training(proc)
    rest = _signal_and_wait(proc, target, signum)
    assert proc.returncode == 128 + signum, rest[-3000:]

    stops = [read_json(tmp_path / f"stopped_rank{rank}.json") for rank in (0, 1)]
    step = stops[0]["step"]
    assert stops == [{"step": step, "signal": signal.Signals(signum).name, "code": 128 + signum}] * 2, stops
    assert step >= 10
    checkpoint = tmp_path / "ckpts" / f"preempted-step={step}"
    assert [p.name for p in (tmp_path / "ckpts").iterdir()] == [checkpoint.name]  # nothing else, no temporary left
    # The sharded npu_fsdp checkpoint: a DCP directory with both ranks' shards.
    assert sorted(p.name for p in checkpoint.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    if not resume:
        return

    resumed = tmp_path / "resumed"
    run_python([FABRIC_SCRIPT, "preempt", "--out", str(resumed), "--resume", str(checkpoint), "--steps", str(step + 3)])
    assert read_json(resumed / "result.json") == {"resumed_from": step, "step": step + 3}
    at_stop, at_resume = torch.load(tmp_path / "weights-at-stop.pt"), torch.load(resumed / "weights-at-resume.pt")
    assert at_stop.keys() == at_resume.keys() and all(torch.equal(at_stop[k], at_resume[k]) for k in at_stop)


def test_a_rank_exiting_first_with_128_plus_signal_does_not_get_the_main_process_killed():
    """Catches the race that ended the main process with -9 instead of 143 (the main-process-only SIGTERM case, once
    in a fresh-clone run): every rank exits 128 + signum after the agreed step, and Lightning's child-process
    observer, polling the launcher's list every 5 s, SIGKILLs the main process when it finds a child that exited
    non-zero before the main process reaped it. Once the ranks agree to stop, the observer must find no child to
    act on, and ``reap_children`` still waits for every one."""
    from types import SimpleNamespace

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    from lightning_npu.preemption import GracefulPreemption

    child = subprocess.Popen(["sh", "-c", "exit 143"])  # a rank that reached its exit first
    deadline = time.monotonic() + 60
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # exited, not reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stand_in_main = subprocess.Popen(["sleep", "60"])  # the process the observer would kill
    try:
        procs = [child]
        strategy = SimpleNamespace(launcher=SimpleNamespace(procs=procs), world_size=1)
        preemption = GracefulPreemption(exit_timeout_s=None)
        preemption.signum = signal.SIGTERM  # received by this (main) process
        assert preemption.agreed_signal(strategy, step=10) == signal.SIGTERM
        observer = _ChildProcessObserver(main_pid=stand_in_main.pid, child_processes=procs, sleep_period=0)
        observer._run()
        with pytest.raises(subprocess.TimeoutExpired):  # still alive: the observer did not kill it
            stand_in_main.wait(timeout=2)
        preemption.reap_children(strategy)
        assert child.returncode == 143 and procs == []
    finally:
        stand_in_main.kill()
        stand_in_main.wait()
