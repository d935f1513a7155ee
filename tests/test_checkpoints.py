"""npu_fsdp checkpoints: atomic saves survive a rank dying at any moment of a save, asynchronous saves, the
stateless-optimizer and lr_find round trips, and reading a sharded checkpoint without the strategy
(``load_from_checkpoint``, ``lightning-npu consolidate``). Multi-process cases run 2 simulated NPUs in subprocesses."""

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, SCRIPTS, SUBPROCESS_TIMEOUT_S, WARM_PYTHON, read_json, run_python
from tests.prefetch import PREFETCHED

SCRIPT = str(SCRIPTS / "checkpoint_run.py")
FABRIC_SCRIPT = str(SCRIPTS / "fabric_checkpoint_run.py")
LEFTOVER = re.compile(r"\.(tmp|old)-[0-9a-f]{12}$")


def _run(out, ckpt_dir, *args):
    run_python([SCRIPT, "--out", str(out), "--ckpt-dir", str(ckpt_dir), *args])
    return read_json(out / "result.json")


def _run_to_crash(out, ckpt_dir, *args):
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_NPU_SIMULATE"}
    env.update(LIGHTNING_NPU_SIMULATE="2", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    proc = subprocess.run([WARM_PYTHON.command(env), SCRIPT, "--out", str(out), "--ckpt-dir", str(ckpt_dir), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    return proc


@PREFETCHED.fixture(seconds=3)
def uninterrupted(tmp_path_factory):
    """Two epochs (6 steps), blocking sharded saves after each epoch: the reference losses."""
    root = tmp_path_factory.mktemp("uninterrupted")
    return _run(root / "out", root / "ckpts", "--epochs", "2")


@pytest.mark.parametrize(
    ("point", "extra"),
    [("data", []), ("metadata", []), ("meta", []), ("publish", []), ("data", ["--async-save"])],
    ids=["mid-shard", "before-dcp-metadata", "before-meta-pt", "between-renames", "async-mid-shard"],
)
@pytest.mark.slow
def test_crash_during_save_keeps_last_checkpoint_resumable(tmp_path, uninterrupted, point, extra):
    """A rank dies during the 4th save (last.ckpt after epoch 2); resuming from last.ckpt then reproduces the
    uninterrupted run's losses. Catches in-place rewrites of last.ckpt (truncated shards beside an old `.metadata`,
    new weights under an old step counter) and a lost checkpoint when the process dies between the two renames."""
    ckpts = tmp_path / "ckpts"
    crashed = _run_to_crash(tmp_path / "crashed", ckpts, "--epochs", "2", "--crash", point, "--crash-save", "4", *extra)
    assert crashed.returncode != 0, crashed.stdout[-2000:]
    assert any((tmp_path / "crashed").glob("crashed-rank*")), f"the crash hook never fired\n{crashed.stderr[-3000:]}"

    resumed = _run(tmp_path / "resumed", ckpts, "--epochs", "2", "--resume", str(ckpts / "last.ckpt"), *extra)
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][3:], abs=1e-6)
    # The resumed run cleaned what the crash left (temporary and set-aside names).
    assert "last.ckpt" in resumed["entries"]
    assert not [e for e in resumed["entries"] if LEFTOVER.search(e)], resumed["entries"]


@pytest.mark.slow
def test_async_save_trains_identically_and_leaves_complete_checkpoints(tmp_path, uninterrupted):
    """async_save=True: the same losses as blocking saves, the final last.ckpt is complete (written before fit()
    returns) and top-k rotation deleted the older checkpoint only once the newer one existed."""
    from recipes.decoder.checkpoint_layout import read_recipe_metadata

    result = _run(tmp_path / "out", tmp_path / "ckpts", "--epochs", "2", "--async-save")
    assert result["losses"] == pytest.approx(uninterrupted["losses"], abs=1e-6)
    assert result["entries"] == ["epoch=1-step=6.ckpt", "last.ckpt"]
    assert read_recipe_metadata(tmp_path / "ckpts" / "last.ckpt")["global_step"] == 6


@pytest.mark.slow
def test_failed_background_save_raises(tmp_path):
    """A background shard write that fails (disk full) stops the run with an error naming the checkpoint, instead
    of a log line; the checkpoint it would have replaced stays loadable."""
    proc = _run_to_crash(tmp_path / "out", tmp_path / "ckpts", "--epochs", "2", "--async-save", "--fail-save", "2")
    assert proc.returncode != 0
    assert "background checkpoint save to" in proc.stderr and "last.ckpt failed" in proc.stderr, proc.stderr[-3000:]
    assert "No space left on device (injected)" in proc.stderr


@pytest.mark.slow
def test_full_checkpoint_with_stateless_optimizer_resumes_and_evaluates(tmp_path):
    """state_dict_type='full' with plain SGD (no optimizer state): resume, validate/test/predict(ckpt_path=...) work
    (Lightning's rekeying indexed the first state entry and raised IndexError)."""
    common = ["--optimizer", "sgd", "--state-dict-type", "full"]
    full = _run(tmp_path / "full", tmp_path / "ckpts", "--epochs", "2", "--save-top-k", "-1", *common)
    ckpt = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    assert ckpt.is_file()
    resumed = _run(tmp_path / "resumed", tmp_path / "ckpts2", "--epochs", "2", "--resume", str(ckpt),
                   "--evaluate", str(ckpt), *common)
    assert resumed["losses"] == pytest.approx(full["losses"][3:], abs=1e-6)
    assert all(torch.isfinite(torch.tensor([resumed["validate"], resumed["test"], resumed["predict"]])))
    assert resumed["validate"] == pytest.approx(resumed["test"])  # same data, same restored weights


@pytest.mark.slow
def test_lr_find_restores_the_model_under_npu_fsdp(tmp_path):
    """Tuner.lr_find saves a sharded checkpoint, trains, then restores it through the strategy (which failed with
    "Missing key ... initial_lr"): the weights afterwards equal the initial weights and fit() runs on."""
    result = _run(tmp_path / "out", tmp_path / "ckpts", "--epochs", "1", "--lr-find")
    assert result["lr_find_points"] == 3
    assert result["restored_parameter_sum"] == pytest.approx(result["initial_parameter_sum"], abs=1e-4)
    assert len(result["losses"]) == 3 + 3  # lr_find's 3 steps, then the real epoch


@pytest.mark.slow
def test_sharded_checkpoint_loads_without_the_strategy(tmp_path, uninterrupted):
    """A sharded directory goes into an unsharded module through LightningModule.load_from_checkpoint, and
    `lightning-npu consolidate` writes one normal Lightning checkpoint file with the same weights (Lightning's own
    consolidation tool expects a 'model' key and fails; load_from_checkpoint raised IsADirectoryError)."""
    import lightning_npu  # noqa: F401 -- teaches Lightning's loader the sharded layout
    from tests.scripts.trainer_run import Regression

    ckpt = tmp_path / "ckpts" / "last.ckpt"
    _run(tmp_path / "out", tmp_path / "ckpts", "--epochs", "1")
    assert ckpt.is_dir()
    model = Regression.load_from_checkpoint(ckpt)
    assert not any(hasattr(p, "to_local") for p in model.parameters())

    output = tmp_path / "consolidated.ckpt"
    proc = subprocess.run([sys.executable, "-m", "lightning_npu.cli", "consolidate", str(ckpt), str(output)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    # Its two steps, each a line as it starts and as it ends (stderr is a pipe here).
    assert f"consolidate [1/2] read {ckpt} ...\n" in proc.stderr, proc.stderr
    assert re.search(rf"^consolidate \[1/2\] read {re.escape(str(ckpt))} \.\.\. [\d.]+ MiB in \d+ files [\d.]+ s\n"
                     rf"consolidate \[2/2\] write {re.escape(str(output))} \.\.\.\n", proc.stderr, re.MULTILINE)
    checkpoint = torch.load(output, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 3 and checkpoint["epoch"] == 0
    plain = Regression()
    plain.load_state_dict(checkpoint["state_dict"])  # strict: every name and shape of the unsharded model
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, checkpoint["state_dict"][name])
    # The optimizer state is numbered like optimizer.state_dict(), so a plain torch optimizer takes it...
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    assert len(optimizer.state) == len(list(plain.parameters()))
    # ... and a Trainer on another strategy resumes from the directory itself (one CPU process: 6 steps an epoch).
    # In a fresh process: the strict fake renames PrivateUse1 to "npu" in this one for good, which trips torch.optim's
    # accelerator check once the fake is gone.
    resume = (
        "import sys; import lightning_npu; from lightning.pytorch import Trainer;"
        " from tests.scripts.trainer_run import Regression, data;"
        " trainer = Trainer(accelerator='cpu', devices=1, max_epochs=2, logger=False, enable_checkpointing=False,"
        " enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0);"
        " trainer.fit(Regression(), train_dataloaders=data(), ckpt_path=sys.argv[1]); print('global_step', trainer.global_step)"
    )
    assert "global_step 9" in run_python(["-c", resume, str(ckpt)], simulate=None).stdout  # 3 + 6


def test_host_staging_refills_its_buffers_and_reallocates_only_what_changed():
    """The async save's host copy: a second stage of the same state refills the first one's buffers; a tensor whose
    shape or dtype changed gets a new buffer, a removed key's buffer is dropped, and a tensor under two keys (tied
    weights) is copied once. The staged copy keeps the values of the call, tensors and plain values alike. A first
    save inside inference mode (ModelCheckpoint after validation) does not leave buffers that a save outside it
    cannot refill."""
    from lightning_npu.runtime.simulated import SimulatedRuntime, SimulationWarning
    from lightning_npu.strategies.checkpoints.staging import HostStaging

    with pytest.warns(SimulationWarning):
        staging = HostStaging(SimulatedRuntime(1))
    weight = torch.arange(6.0).reshape(2, 3)
    live = {"model": {"weight": weight, "tied": weight, "bias": torch.ones(3)},
            "optimizer": {"state": {"weight": {"step": torch.tensor(3.0)}},
                          "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["weight"]}]}}
    with torch.inference_mode():
        first = staging.stage(live)
    assert first["model"]["tied"] is first["model"]["weight"]
    assert first["model"]["weight"].data_ptr() != weight.data_ptr()
    pointers = {key: first["model"][key].data_ptr() for key in ("weight", "bias")}
    step = first["optimizer"]["state"]["weight"]["step"].data_ptr()

    weight.add_(1.0)  # training goes on after the call
    live["optimizer"]["param_groups"][0]["lr"] = 0.2
    assert torch.equal(first["model"]["weight"], torch.arange(6.0).reshape(2, 3))
    assert first["optimizer"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["weight"]}]

    second = staging.stage(live)
    assert {key: second["model"][key].data_ptr() for key in ("weight", "bias")} == pointers
    assert second["optimizer"]["state"]["weight"]["step"].data_ptr() == step
    assert torch.equal(second["model"]["weight"], weight) and second["optimizer"]["param_groups"][0]["lr"] == 0.2

    live["model"] = {"weight": weight.double(), "bias": torch.ones(4)}  # dtype and shape changed, "tied" gone
    third = staging.stage(live)
    assert third["model"]["weight"].dtype == torch.float64 and torch.equal(third["model"]["weight"], weight.double())
    assert third["model"]["bias"].shape == (4,) and torch.equal(third["model"]["bias"], torch.ones(4))
    assert third["model"]["weight"].data_ptr() != pointers["weight"]
    assert third["optimizer"]["state"]["weight"]["step"].data_ptr() == step
    assert "tied" not in third["model"]


def test_consolidate_explains_a_path_that_is_not_a_sharded_checkpoint(tmp_path, capsys):
    """`lightning-npu consolidate` on a missing path exits 2 with the reason, not a traceback."""
    from lightning_npu.cli import main

    assert main(["consolidate", str(tmp_path / "nope"), str(tmp_path / "out.ckpt")]) == 2
    assert f"{tmp_path / 'nope'} does not exist" in capsys.readouterr().err


@PREFETCHED.fixture(seconds=3)
def fabric_checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric_checkpoints")
    run_python([FABRIC_SCRIPT, "--out", str(out)])
    return read_json(out / "result.json")


@pytest.mark.slow
def test_fabric_full_sgd_and_async_sharded_round_trip(fabric_checkpoints):
    """Fabric: a full checkpoint of a stateless SGD optimizer loads back (IndexError before) and its save takes no
    optimizer step (torch's state-dict API stepped it with zero gradients on every save), an asynchronous sharded
    save resumes to the same losses, and fabric.load_raw of a sharded directory names the consolidate command.

    Async staging: two saves write from the same host buffers (each save allocated a new copy before; the first
    one's buffers are kept alive, so new ones cannot reuse their addresses), and each checkpoint holds the values
    of the save call although every weight and AdamW state tensor changed in place right after the call returned,
    before the background write began (a stager that aliased the live tensors would write the changed values)."""
    result = fabric_checkpoints
    assert result["full_sgd_resumed"] == pytest.approx(result["full_sgd_reference"], abs=1e-6)
    assert result["full_sgd_steps"] == 6  # the 6 training steps: the save at step 3 took none
    assert result["async_resumed"] == pytest.approx(result["async_reference"], abs=1e-6)
    first, second = result["staged_pointers"]
    assert len(first) > 0 and first == second
    assert result["staged_differences"] == [0.0, 0.0]
    assert "lightning-npu consolidate" in result["load_raw_error"]


@pytest.mark.slow
def test_a_filtered_sharded_fabric_save_says_what_to_do_and_writes_nothing(fabric_checkpoints):
    """Catches an error that named no concrete way out: it must give the strategy argument for a filtered file and
    the ways to keep part of a sharded one, and nothing may be written at the path (not even a temporary)."""
    error = fabric_checkpoints["filtered_error"]
    assert error.startswith("fabric.save(..., filter=...) cannot write a sharded checkpoint (nothing was written to")
    assert "NPUFabricFSDPStrategy(state_dict_type='full')" in error
    assert "lightning-npu consolidate DIR FILE" in error and "fabric.load(DIR, state)" in error
    assert fabric_checkpoints["filtered_written"] == []


def test_publish_and_recover_never_lose_the_previous_checkpoint(tmp_path):
    """The rename protocol on its own: a new directory replaces an old one; a crash between moving the old one aside
    and renaming the new one in is repaired by putting the old one back; stale temporaries are deleted."""
    from lightning_npu.strategies.checkpoints.publish import aside_path, publish, recover, temporary_path

    target = tmp_path / "last.ckpt"
    target.mkdir()
    (target / "meta.pt").write_text("old")
    new = temporary_path(target, "0123456789ab")
    new.mkdir()
    (new / "meta.pt").write_text("new")
    publish(new, target, "0123456789ab")
    assert (target / "meta.pt").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]

    # Crash between the renames: the old checkpoint is aside, the new one still temporary.
    os.replace(target, aside_path(target, "ba9876543210"))
    temporary_path(target, "ba9876543210").mkdir()
    recover(tmp_path)
    assert (target / "meta.pt").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


@pytest.mark.slow
def test_every_checkpoint_form_lightning_writes_evaluates_and_resumes_under_npu_fsdp(tmp_path):
    """Lightning's checkpoint contract under npu_fsdp (2 simulated NPUs, one torchrun launch):
    - test / validate / predict(ckpt_path=...) from a weights-only checkpoint (save_checkpoint(weights_only=True),
      ModelCheckpoint(save_weights_only=True)), on a new Trainer and on the one that trained: KeyError
      'optimizer_states' before; fit from one fails naming the cause;
    - a sharded directory evaluated from inside torch.inference_mode() ("Cannot set version_counter for inference
      tensor" before);
    - full checkpoints and strategy.optimizer_state() number the parameters as optimizer.state_dict() does (they were
      keyed by name), and npu_fsdp resumes from npu_ddp's standard checkpoint and from a name-keyed one of its own
      as npu_ddp resumes from its checkpoint."""
    run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(SCRIPTS / "trainer_checkpoint_forms_run.py"), str(tmp_path)], timeout=400)
    for rank in range(2):
        result = read_json(tmp_path / f"rank{rank}.json")
        assert result["fsdp_losses"] == pytest.approx(result["ddp_losses"], rel=1e-5)
        expected = result["ddp_test_loss_at_save"]
        for key in ("test_loss_from_weights_only", "test_loss_from_model_checkpoint",
                    "test_loss_from_weights_only_after_fit", "val_loss_from_weights_only",
                    "test_loss_from_sharded_in_inference_mode"):
            assert result[key] == pytest.approx(expected, rel=1e-5), key
        assert result["predictions"] == 1  # 16 samples / 2 ranks / batch 8
        assert "holds no optimizer state for 'optimizer_0'" in result["fit_from_weights_only"]
        assert "weights_only=True" in result["fit_from_weights_only"]
        assert result["full_checkpoint_state_keys"] == list(range(10))
        # A full state is gathered on rank 0 (the one that writes the file).
        assert result["optimizer_state_keys"] == (list(range(10)) if rank == 0 else [])
        # The other ranks get {} (as from Lightning's FSDPStrategy) from AdamW, SGD without state and AdamW8bit:
        # {'state': {}} and SGD's whole state_dict() before.
        whole = ["param_groups", "state"] if rank == 0 else []
        assert result["optimizer_state_entries"] == whole
        assert result["stateless_optimizer_state_entries"] == whole
        assert result["adamw8bit_optimizer_state_entries"] == whole
        assert result["adamw8bit_optimizer_state_keys"] == (list(range(10)) if rank == 0 else [])
        assert len(result["ddp_resumed"]) == 3
        assert result["resumed_from_ddp"] == pytest.approx(result["ddp_resumed"], rel=1e-5)
        assert result["resumed_from_name_keyed"] == pytest.approx(result["ddp_resumed"], rel=1e-5)
