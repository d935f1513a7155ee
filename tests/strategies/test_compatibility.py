"""npu_fsdp takes ordinary LightningModules unchanged: the same per-step losses as npu_ddp on the same data, from
the weights the user's code made, with tied parameters kept tied.

One torchrun launch (2 simulated NPUs) fits every model of ``tests/strategies/scripts/compat_models.py`` under both
strategies (``tests/strategies/scripts/compat_run.py``). Each test below failed on the code before npu_fsdp sharded whole
module trees: a ModuleList child or a parameter of the LightningModule stopped setup, custom initialisation was
replaced by ``reset_parameters()``, a tied embedding and head became two parameters, SWA failed mid-run.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_npu.strategies import fsdp1
from tests.helpers import read_json, room_scripts, run_python
from tests.strategies.scripts.compat_models import MODELS, BatchNormNet
from tests.prefetch import PREFETCHED

SCRIPTS = room_scripts("strategies")

pytestmark = pytest.mark.slow  # every test here starts processes or trains (or shares a fixture that does)


PATTERNS = [*MODELS, "init_module", "gradient_accumulation"]


@PREFETCHED.fixture(seconds=9)
def compatibility_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compat")
    run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(SCRIPTS / "compat_run.py"), str(out)], timeout=480)
    return [read_json(out / f"rank{rank}.json") for rank in (0, 1)]


@pytest.mark.parametrize("pattern", [*PATTERNS, "sync_batchnorm"])
def test_fsdp_losses_equal_ddp_losses_step_by_step(compatibility_runs, pattern):
    """Catches any difference in what is trained: a parameter left out of every unit, a tie broken, a root
    parameter not gathered in a step, or gradients not reduced."""
    for rank in compatibility_runs:
        ddp, fsdp = rank["results"][pattern]["npu_ddp"], rank["results"][pattern]["npu_fsdp"]
        assert len(fsdp["losses"]) == len(ddp["losses"]) == 4
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
        assert len(set(fsdp["losses"])) > 1  # it trained


@pytest.mark.parametrize("pattern", PATTERNS)
def test_first_loss_is_the_loss_of_the_model_as_built(compatibility_runs, pattern):
    """Catches a lost initialisation: weights replaced by reset_parameters(), left on the meta device, buffers
    of uninitialised memory, or rank 1's own random weights instead of rank 0's."""
    for rank in compatibility_runs:
        for strategy in ("npu_ddp", "npu_fsdp"):
            run = rank["results"][pattern][strategy]
            assert run["losses"][0] == pytest.approx(run["fresh_loss"], rel=1e-6)


@pytest.mark.parametrize("pattern", ["tied_embedding_head", "hf_gpt2"])
def test_tied_parameters_stay_one_parameter(compatibility_runs, pattern):
    for rank in compatibility_runs:
        run = rank["results"][pattern]["npu_fsdp"]
        assert run["tied_same_tensor"] is True
        assert run["tied_max_difference"] == 0.0


def test_buffers_are_identical_on_every_rank(compatibility_runs):
    """A buffer of a module without reset_parameters, built in configure_model, holds rank 0's value everywhere."""
    first, second = (rank["results"]["configure_model"]["npu_fsdp"]["buffers"] for rank in compatibility_runs)
    assert first == second == {"shift.offset": 4.0}  # 16 x 0.25, as configure_model filled it


def test_what_cannot_run_sharded_fails_first_with_the_fix(compatibility_runs):
    for rank in compatibility_runs:
        errors = rank["errors"]
        assert errors["swa"].startswith("ValueError: StochasticWeightAveraging cannot run under strategy='npu_fsdp'")
        assert "strategy='npu_ddp'" in errors["swa"]
        assert errors["l2_penalty"].startswith("RuntimeError: the step combined parameters of different FSDP units")
        assert "weight_decay" in errors["l2_penalty"]
        assert errors["meta_without_reset_parameters"].startswith(
            "MaterializationError: npu_fsdp cannot initialise shift (Shift)")
        assert errors["user_sharded_changed_after_sharding"].startswith(
            "MaterializationError: npu_fsdp cannot give blocks.0.linear.weight its first values")
        assert "before calling fully_shard" in errors["user_sharded_changed_after_sharding"]


def _one_process_on_both_ranks_batches(runs: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
    """BatchNormNet trained in one process with plain BatchNorm on the union of both ranks' batches: its per-step
    losses (the mean of the two ranks' losses, which hold half the samples each) and running statistics."""
    model = BatchNormNet()
    model.configure_model()
    optimizer = model.configure_optimizers()
    losses = []
    for step in range(len(runs[0]["batches"])):
        x, y = (torch.cat([torch.tensor(run["batches"][step][i]) for run in runs]) for i in (0, 1))
        loss = model.loss((x, y))
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    stats = {name: buffer.tolist() for name, buffer in model.named_buffers()
             if name.endswith(("running_mean", "running_var"))}
    return losses, stats


@pytest.mark.parametrize("strategy", ["npu_ddp", "npu_fsdp"])
def test_sync_batchnorm_normalises_with_both_ranks_batches(compatibility_runs, strategy):
    """Trainer(sync_batchnorm=True), BatchNorm built in configure_model: every step equals one process training on
    both ranks' batches, and the running statistics are those batches' on both ranks. Catches the flag ignored
    under npu_fsdp (each rank normalised its own batch: other losses, running statistics unequal across ranks) and
    SyncBatchNorm refused on the simulated NPU's CPU tensors (npu_ddp failed at setup)."""
    runs = [rank["results"]["sync_batchnorm"][strategy] for rank in compatibility_runs]
    losses, stats = _one_process_on_both_ranks_batches(runs)
    assert [(a + b) / 2 for a, b in zip(runs[0]["losses"], runs[1]["losses"])] == pytest.approx(losses, rel=1e-5)
    assert runs[0]["losses"] != runs[1]["losses"]  # each rank's loss is over its own half
    assert sorted(stats) == sorted(runs[0]["running_stats"]) == ["net.0.running_mean", "net.0.running_var",
                                                                "net.2.running_mean", "net.2.running_var"]
    for run in runs:
        for name, values in stats.items():
            assert run["running_stats"][name] == pytest.approx(values, rel=1e-5, abs=1e-6)


def test_sync_batchnorm_modules_are_what_npu_fsdp_shards(compatibility_runs):
    for rank in compatibility_runs:
        assert rank["results"]["sync_batchnorm"]["npu_fsdp"]["sync_batchnorm_modules"] == 2


def test_fsdp1_wrap_in_configure_model_is_reported_and_the_model_trains(compatibility_runs):
    """FSDP1's wrap() does nothing under FSDP2: rank 0 says so, naming auto_wrap_policy; the losses equal npu_ddp's
    (test_fsdp_losses_equal_ddp_losses_step_by_step[fsdp1_wrap])."""
    first, second = (rank["results"]["fsdp1_wrap"]["npu_fsdp"]["npu_fsdp_warnings"] for rank in compatibility_runs)
    assert len(first) == 1 and second == []  # rank 0 only
    assert first[0].startswith("FSDP1's wrap() was called in configure_model on 2 modules (Residual) and does nothing")
    assert "auto_wrap_policy=['Residual']" in first[0] and "fully_shard" in first[0]
    assert all(rank["results"]["fsdp1_wrap"]["npu_ddp"]["npu_fsdp_warnings"] == [] for rank in compatibility_runs)


def test_fsdp1_units_are_refused_before_sharding(compatibility_runs):
    """Catches FSDP1 units silently mixed with FSDP2's, and torch's bare "nested autowrap" error."""
    for rank in compatibility_runs:
        errors = rank["errors"]
        assert errors["fsdp1_unit"].startswith("TypeError: the model holds FSDP1 FullyShardedDataParallel modules"
                                               " (blocks.0): strategy='npu_fsdp' shards with FSDP2")
        assert errors["fsdp1_enable_wrap"].startswith(
            "RuntimeError: configure_model entered FSDP1's enable_wrap(), which builds FSDP1 units")
        assert "auto_wrap_policy" in errors["fsdp1_unit"] and "auto_wrap_policy" in errors["fsdp1_enable_wrap"]


def test_fsdp1_wrap_is_reported_once_per_process(monkeypatch):
    """Fabric's init_module() (as Lightning's FSDPStrategy enters enable_wrap there) reports wrap() too."""
    from lightning.fabric.plugins import Precision
    from torch.distributed.fsdp.wrap import wrap

    from lightning_npu import NPUFabricFSDPStrategy

    monkeypatch.setattr(fsdp1, "_wrap_reported", False)
    strategy = NPUFabricFSDPStrategy()
    strategy.precision = Precision()
    with pytest.warns(UserWarning, match=r"FSDP1's wrap\(\) was called in fabric.init_module\(\) on 1 modules \(Linear\)"):
        with strategy.module_init_context():
            layer = nn.Linear(2, 2)
            assert wrap(layer) is layer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fsdp1.fsdp1_wrap_reported("fabric.init_module()"):
            wrap(nn.Linear(2, 2))
        with fsdp1.fsdp1_wrap_reported("configure_model"):
            nn.Linear(2, 2)  # no wrap(): nothing to say
