"""SLURM without SLURM: two local processes given the variables srun sets (one task per simulated NPU) train under
npu_fsdp as a Lightning-launched run does; the requeue signal (SIGUSR1, ``sbatch --signal``) saves Lightning's
``hpc_ckpt_N.ckpt``, calls ``scontrol requeue`` (a recording fake on PATH) and exits; the requeued job
(``SLURM_RESTART_COUNT=1``) resumes from it by itself. The sbatch script matches the 2-node config, and the docs show the file itself."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.helpers import REPO, SCRIPTS, outputs_of, read_json, run_python

SCRIPT = str(SCRIPTS / "trainer_run.py")
#: Every SLURM variable a process started by ``srun --nodes 1 --ntasks-per-node 2`` reads here.
TASKS = 2
#: Lightning derives MASTER_PORT from the job id: 15000 + its last 4 digits (SLURMEnvironment.main_port).
SLURM_PORT_BASE = 15000


def _job_id_with_free_port() -> str:
    """A job id whose port (Lightning's rule) is free on the loopback interface now."""
    for last4 in range(4000, 10000, 37):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", SLURM_PORT_BASE + last4))
            except OSError:
                continue
        return f"77{last4:04d}"
    raise AssertionError("no free port in 19000..24999 on 127.0.0.1")


def _fake_scontrol(folder, root):
    """An ``scontrol`` that records its arguments and what ``root`` holds at the moment it is called."""
    folder.mkdir()
    script = folder / "scontrol"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {folder}/calls.txt\nls -A {root} >> {folder}/root_at_call.txt\n")
    script.chmod(0o755)
    return folder


def _srun(args, *, job_id, restart_count, bin_dir):
    """Start one process per task as srun does (no launcher: every process is a rank), and wait for all."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_", "LIGHTNING_NPU_SIMULATE"))}
    base.update(PYTHONPATH=str(REPO), LIGHTNING_NPU_SIMULATE=str(TASKS), PATH=f"{bin_dir}{os.pathsep}{base['PATH']}")
    base.update(SLURM_JOB_ID=job_id, SLURM_JOB_NAME="train", SLURM_NTASKS=str(TASKS),
                SLURM_NTASKS_PER_NODE=str(TASKS), SLURM_NNODES="1", SLURM_NODEID="0", SLURM_NODELIST="localhost",
                SLURM_RESTART_COUNT=str(restart_count))
    procs = [subprocess.Popen([sys.executable, SCRIPT, *args], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)})
             for rank in range(TASKS)]
    return outputs_of(procs)


@pytest.mark.slow
def test_srun_started_ranks_train_and_the_requeue_signal_saves_requeues_and_resumes(tmp_path):
    """Catches: srun-started ranks not training as Lightning-launched ones do (other losses, a hang at the
    rendezvous), the requeue signal requeueing the job without a checkpoint (the plugin's default
    save_on_preemption=False, where Lightning's own handler saves hpc_ckpt_N), ``scontrol requeue`` called while
    the asynchronous save is still in flight (SLURM then kills the job before the checkpoint exists), and the
    requeued job resuming from nowhere or from a wrong path when an interrupted save left its temporary
    ``.hpc_ckpt_N.ckpt.tmp-...`` in the run directory (Lightning reads its digits as the version)."""
    reference = tmp_path / "reference"
    run_python([SCRIPT, "--out", str(reference), "--epochs", "2"])  # Lightning starts the second rank itself
    expected = read_json(reference / "losses.json")
    assert len(expected) == 6  # 48 samples / 2 ranks / batch 8 = 3 steps per epoch

    root, job_id = tmp_path / "run", _job_id_with_free_port()
    bin_dir = _fake_scontrol(tmp_path / "bin", root)
    common = ["--epochs", "2", "--root-dir", str(root), "--async-save"]
    codes, outputs = _srun(["--out", str(tmp_path / "first"), *common, "--signal-at-step", "3"],
                           job_id=job_id, restart_count=0, bin_dir=bin_dir)
    shown = "\n".join(output[-3000:] for output in outputs)
    assert codes == [128 + signal.SIGUSR1] * TASKS, shown
    assert "All distributed processes registered. Starting with 2 processes" in outputs[0]
    assert (bin_dir / "calls.txt").read_text().split("\n") == [f"requeue {job_id}", ""], shown
    # The checkpoint was complete (published under its name) before the job was requeued.
    assert "hpc_ckpt_1.ckpt" in (bin_dir / "root_at_call.txt").read_text().split(), shown
    assert (root / "hpc_ckpt_1.ckpt" / ".metadata").is_file()
    assert read_json(tmp_path / "first" / "losses.json") == pytest.approx(expected[:3], abs=1e-6)

    # A later save killed mid-way (SIGKILL after SLURM's KillWait) leaves its temporary directory behind.
    (root / ".hpc_ckpt_2.ckpt.tmp-0123456789ab").mkdir()
    codes, outputs = _srun(["--out", str(tmp_path / "requeued"), *common], job_id=job_id, restart_count=1,
                           bin_dir=bin_dir)
    shown = "\n".join(output[-3000:] for output in outputs)
    assert codes == [0] * TASKS, shown
    assert f"Restored all states from the checkpoint at {root / 'hpc_ckpt_1.ckpt'}" in outputs[0], shown
    assert read_json(tmp_path / "requeued" / "losses.json") == pytest.approx(expected[3:], abs=1e-6)


SBATCH = REPO / "recipes/slurm/train_2nodes.sbatch"


def _sbatch_options(text):
    """``{option: value}`` of the ``#SBATCH --option[=value]`` lines (``##SBATCH`` lines are comments to sbatch)."""
    options = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            for word in line.split()[1:]:
                if word.startswith("#"):
                    break
                name, _, value = word.partition("=")
                options[name] = value
    return options


def test_the_sbatch_script_matches_the_two_node_config_and_the_docs_show_it():
    """Catches a script that Lightning refuses at start-up (tasks per node or nodes other than trainer.devices /
    trainer.num_nodes), a requeue signal the plugin does not treat as SLURM's (not SIGUSR1) or that comes later
    than the watchdog needs (exit_timeout_s), HCCL timeouts the config's process-group timeout is not above, a
    job that is not requeueable, and docs that stopped showing the file (they include it, so no copy can drift)."""
    import yaml

    from lightning_npu import GracefulPreemption
    from lightning_npu.timeouts import timeout_problem

    text = SBATCH.read_text()
    options = _sbatch_options(text)
    run = [line.split() for line in text.splitlines() if line.startswith("srun ")]
    assert len(run) == 1 and run[0][run[0].index("python") + 1:run[0].index("python") + 3] == [
        "recipes/train.py", "fit"]
    config = yaml.safe_load((REPO / run[0][run[0].index("--config") + 1]).read_text())
    trainer = config["trainer"]
    assert int(options["--ntasks-per-node"]) == trainer["devices"]
    assert int(options["--nodes"]) == trainer["num_nodes"]
    assert int(options["--nodes"]) * int(options["--ntasks-per-node"]) == 16

    signal_name, _, lead_s = options["--signal"].partition("@")
    assert signal.Signals[f"SIG{signal_name}"] == signal.SIGUSR1  # SLURMEnvironment's default requeue signal
    assert int(lead_s) >= GracefulPreemption().exit_timeout_s
    assert "--requeue" in options and "--exclusive" in options

    exports = dict(line[len("export "):].split("#")[0].strip().split("=", 1)
                   for line in text.splitlines() if line.startswith("export "))
    assert timeout_problem(float(trainer["strategy"]["init_args"]["timeout"]), exports) is None
    assert '--8<-- "recipes/slurm/train_2nodes.sbatch"' in (REPO / "docs" / "fault-tolerance.md").read_text()
