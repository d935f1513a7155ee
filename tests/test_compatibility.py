"""npu_fsdp takes ordinary LightningModules unchanged: the same per-step losses as npu_ddp on the same data, from
the weights the user's code made, with tied parameters kept tied.

One torchrun launch (2 simulated NPUs) fits every model of ``tests/scripts/compat_models.py`` under both
strategies (``tests/scripts/compat_run.py``). Each test below failed on the code before npu_fsdp sharded whole
module trees: a ModuleList child or a parameter of the LightningModule stopped setup, custom initialisation was
replaced by ``reset_parameters()``, a tied embedding and head became two parameters, SWA failed mid-run.
"""

from __future__ import annotations

import pytest

from tests.helpers import SCRIPTS, read_json, run_python
from tests.scripts.compat_models import MODELS

PATTERNS = [*MODELS, "init_module", "gradient_accumulation"]


@pytest.fixture(scope="module")
def compat(tmp_path_factory):
    out = tmp_path_factory.mktemp("compat")
    run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(SCRIPTS / "compat_run.py"), str(out)], timeout=480)
    return [read_json(out / f"rank{rank}.json") for rank in (0, 1)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_fsdp_losses_equal_ddp_losses_step_by_step(compat, pattern):
    """Catches any difference in what is trained: a parameter left out of every unit, a tie broken, a root
    parameter not gathered in a step, or gradients not reduced."""
    for rank in compat:
        ddp, fsdp = rank["results"][pattern]["npu_ddp"], rank["results"][pattern]["npu_fsdp"]
        assert len(fsdp["losses"]) == len(ddp["losses"]) == 4
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
        assert len(set(fsdp["losses"])) > 1  # it trained


@pytest.mark.parametrize("pattern", PATTERNS)
def test_first_loss_is_the_loss_of_the_model_as_built(compat, pattern):
    """Catches a lost initialisation: weights replaced by reset_parameters(), left on the meta device, buffers
    of uninitialised memory, or rank 1's own random weights instead of rank 0's."""
    for rank in compat:
        for strategy in ("npu_ddp", "npu_fsdp"):
            run = rank["results"][pattern][strategy]
            assert run["losses"][0] == pytest.approx(run["fresh_loss"], rel=1e-6)


@pytest.mark.parametrize("pattern", ["tied_embedding_head", "hf_gpt2"])
def test_tied_parameters_stay_one_parameter(compat, pattern):
    for rank in compat:
        run = rank["results"][pattern]["npu_fsdp"]
        assert run["tied_same_tensor"] is True
        assert run["tied_max_difference"] == 0.0


def test_buffers_are_identical_on_every_rank(compat):
    """A buffer of a module without reset_parameters, built in configure_model, holds rank 0's value everywhere."""
    first, second = (rank["results"]["configure_model"]["npu_fsdp"]["buffers"] for rank in compat)
    assert first == second == {"shift.offset": 4.0}  # 16 x 0.25, as configure_model filled it


def test_what_cannot_run_sharded_fails_first_with_the_fix(compat):
    for rank in compat:
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
