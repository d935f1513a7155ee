"""Preemption on 2 simulated NPUs: SIGTERM to the whole process group (what SLURM and Kubernetes send) mid-training
stops every rank at the same step, writes a checkpoint, exits 143 within the bound, and the checkpoint resumes."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, run_python
from tests.test_recipe_e2e import SMALL, TINY, TRAIN, _last_checkpoint

#: Every process must be gone this long after the signal (the brief's bound for the tiny recipe).
EXIT_BOUND_S = 60


def _start(root, *extra):
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_NPU_SIMULATE"}
    env.update(LIGHTNING_NPU_SIMULATE="2", PYTHONPATH=str(REPO))
    args = [sys.executable, TRAIN, "fit", "--config", TINY, *SMALL, "--trainer.max_steps", "100000",
            "--trainer.default_root_dir", str(root), *extra]
    # A session of its own, so the test can signal the whole process group as a scheduler does.
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_for_training(proc, marker="step 10/"):
    seen = []
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return seen
        if time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("training never reached step 10:\n" + "".join(seen[-40:]))


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
    signalled = time.monotonic()
    if target == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        rest, _ = proc.communicate(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running {EXIT_BOUND_S} s after SIGTERM:\n{proc.communicate()[0][-3000:]}")
    deadline = signalled + EXIT_BOUND_S
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(proc.pid), "a rank outlived the main process"
    assert proc.returncode == 128 + signal.SIGTERM, rest[-3000:]
    assert "generate:" not in rest  # the run did not pretend to have finished

    checkpoints = sorted((tmp_path / "lightning_logs" / "version_0" / "checkpoints").glob("preempted-step=*.ckpt"))
    assert len(checkpoints) == 1, rest[-3000:]
    from recipes.llama2.checkpoint_layout import read_recipe_metadata

    step = read_recipe_metadata(checkpoints[0])["global_step"]
    assert checkpoints[0].name == f"preempted-step={step}.ckpt" and step >= 10

    # Validation (and so ModelCheckpoint's last.ckpt) comes every 4 batches (SMALL's val_check_interval).
    target = (step // 4 + 1) * 4
    resumed = run_python([TRAIN, "fit", "--config", TINY, *SMALL, "--trainer.max_steps", str(target),
                          "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", str(checkpoints[0])])
    assert f"Restored all states from the checkpoint at {checkpoints[0]}" in resumed.stdout + resumed.stderr
    assert read_recipe_metadata(_last_checkpoint(tmp_path, 1))["global_step"] == target
