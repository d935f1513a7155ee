"""``lightning-npu run``: launches a no-argument ``Fabric()`` script on N simulated NPUs, and refuses bad options
before starting anything."""


import pytest

from lightning_npu.cli import main
from tests.helpers import free_port, read_json, room_scripts, run_python

SCRIPTS = room_scripts("cli")

SCRIPT = str(SCRIPTS / "fabric_launched.py")


@pytest.mark.slow
def test_run_starts_one_process_per_device_with_fabric_configured_from_the_launcher(tmp_path):
    """Catches a launcher that is missing or refuses the NPU accelerator (Lightning's ``fabric run`` does), or whose
    processes do not see its options: each of the two processes must build ``Fabric()`` with no arguments (and
    without importing lightning_npu) as world size 2 on NPUAccelerator with the chosen strategy and precision, join
    one process group (an all-reduce of rank + 1 gives 3), and get the script's own arguments."""
    out = tmp_path / "out"
    run_python(["-m", "lightning_npu.cli", "run", "--devices", "2", "--main-port", str(free_port()),
                "--strategy", "npu_fsdp", "--precision", "bf16-mixed", SCRIPT, "--out", str(out)])
    reports = [read_json(out / f"rank{rank}.json") for rank in range(2)]
    assert [r["global_rank"] for r in reports] == [0, 1]
    assert [r["local_rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["world_size"] == 2
        assert report["accelerator"] == "NPUAccelerator"
        assert report["strategy"] == "NPUFabricFSDPStrategy"
        assert report["precision"] == "bf16-mixed"
        assert report["rank_sum"] == 3.0
        assert report["argv"] == ["--out", str(out)]
        assert report["main_module"] == "__main__"


@pytest.mark.slow
def test_a_failing_script_makes_run_exit_1_with_the_failed_rank_and_its_exit_code(tmp_path):
    """Catches a launcher that reports success (or hides which process failed) when the script fails."""
    script = tmp_path / "fails.py"
    script.write_text("import sys\nraise SystemExit(3 if sys.argv[1:] == ['--code', '3'] else 0)\n")
    with pytest.raises(AssertionError) as failure:
        run_python(["-m", "lightning_npu.cli", "run", "--devices", "2", "--main-port", str(free_port()),
                    str(script), "--code", "3"])
    report = str(failure.value)
    assert " exited 1\n" in report
    assert f"lightning-npu run: {script} failed:" in report
    assert "exitcode  : 3" in report


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--devices", "0"], "devices=0 must be a positive number of NPUs"),
        (["--devices", "3"], "devices=3 asks for more NPUs than are visible: 2 NPU(s) visible"),
        (["--devices", "two"], "devices='two' is not understood"),
        (["--num-nodes", "2", "--node-rank", "2"], "--node-rank 2 must lie in 0 .. 1 (--num-nodes 2)"),
        (["--main-port", "70000"], "--main-port 70000 is not a TCP port"),
        (["--strategy", "ddp"], "--strategy 'ddp' cannot run on NPUs; use one of npu_ddp, npu_fsdp, npu_single"),
        (["--devices", "2", "--strategy", "npu_single"], "--strategy npu_single runs one process"),
        (["--precision", "64-true"], "precision='64-true' is not supported on NPUs: HCCL cannot reduce float64"),
        (["--precision", "int8-mixed"], "precision='int8-mixed' is not supported on NPUs: torch_npu's int8 matmuls"),
    ],
)
def test_bad_options_fail_with_a_clear_message_and_launch_nothing(tmp_path, capsys, simulate, options, message):
    """Catches an option error that reaches the workers (or a hang waiting for them) instead of a one-line reason
    from the launcher with exit status 2 while no process ran the script."""
    simulate(2)
    out = tmp_path / "out"
    if "--main-port" not in options:  # should validation let a case through, its launch collides with nothing
        options = [*options, "--main-port", str(free_port())]
    status = main(["run", *options, SCRIPT, "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 2
    assert "lightning-npu run: error: " in err and message in err, err
    assert not out.exists()


def test_a_missing_script_fails_with_its_path_and_launches_nothing(tmp_path, capsys, simulate):
    """Catches a launcher that starts torchrun (which then fails in every process) for a script that is not there."""
    simulate(2)
    missing = tmp_path / "missing.py"
    status = main(["run", "--devices", "2", str(missing)])
    assert status == 2
    assert f"lightning-npu run: error: script {str(missing)!r} does not exist" in capsys.readouterr().err
