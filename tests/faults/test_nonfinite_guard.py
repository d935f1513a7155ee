"""NonFiniteLossGuard on 2 simulated NPUs (npu_fsdp): a NaN loss stops the run naming its step, every rank agrees,
no checkpoint is written from the weights it produced, and skipping leaves the optimizer step unapplied; the same for
a Fabric loop with FabricNonFiniteLossGuard."""

import json

import pytest

from tests.helpers import read_json, room_scripts, run_python
from tests.recipe_runs import SMALL, TINY, TRAIN

SCRIPTS = room_scripts("faults")

pytestmark = pytest.mark.slow  # every test here starts processes or trains (or shares a fixture that does)


SCRIPT = str(SCRIPTS / "nonfinite_run.py")


def _run(tmp_path, *args, fails):
    if fails:
        with pytest.raises(AssertionError) as failure:
            run_python([SCRIPT, "--out", str(tmp_path), *args], timeout=180)
        output = str(failure.value)
        assert "exited 1" in output  # a non-zero exit, not a hang (run_python's timeout) nor a crash signal
    else:
        run_python([SCRIPT, "--out", str(tmp_path), *args], timeout=180)
    return json.loads((tmp_path / "result.json").read_text())


@pytest.mark.parametrize("nan_ranks", [["0", "1"], ["1"]], ids=["every-rank", "one-rank"])
def test_nan_loss_stops_naming_the_step_and_nothing_is_saved_after_it(tmp_path, nan_ranks):
    """Catches: training on after a NaN loss, ModelCheckpoint saving NaN weights (its save at step 9 comes before the
    guard's next logging-step read at 10), a wrong step in the message, and (one-rank) ranks disagreeing, which
    would leave one rank raising while the other hangs in the next collective."""
    result = _run(tmp_path, "--nan-steps", "7", "--nan-ranks", *nan_ranks, fails=True)
    assert result["error"].startswith("NonFiniteLossError: The training loss was NaN or Inf at step 7 ")
    assert result["saved"] == ["step=3.ckpt", "step=6.ckpt"]
    assert result["global_step"] == 9  # stopped at the first read point after the bad step (the save at step 9)


def test_skipped_steps_are_not_applied_and_training_finishes(tmp_path):
    """Catches: a 'skipped' step that still updates the weights or AdamW's moments (updates would count 12), and
    NaN weights after skipping."""
    result = _run(tmp_path, "--nan-steps", "4", "5", "--max-skipped-steps", "2", fails=False)
    assert result["error"] is None
    assert result["skipped"] == [4, 5]
    assert result["updates"] == [10]  # 12 optimizer steps, 2 of them not applied
    assert result["finite"] is True
    assert result["saved"] == ["step=12.ckpt", "step=3.ckpt", "step=6.ckpt", "step=9.ckpt"]


def test_more_bad_steps_than_allowed_stops_at_the_one_over(tmp_path):
    """Catches: max_skipped_steps not enforced, or the error naming the first skipped step instead of the last."""
    result = _run(tmp_path, "--nan-steps", "4", "5", "--max-skipped-steps", "1", fails=True)
    assert result["error"].startswith("NonFiniteLossError: The training loss was NaN or Inf at step 5 (trainer.global_step)"
                                      " after skipping steps [4];")
    assert result["saved"] == ["step=3.ckpt"]


def test_recipe_with_a_diverging_learning_rate_stops_without_a_nan_checkpoint_or_generate_line(tmp_path):
    """Catches: the recipe training on with a diverged model, saving it (last.ckpt), and printing its 'generate'
    command for it."""
    from recipes.decoder.checkpoint_layout import load_recipe_checkpoint

    with pytest.raises(AssertionError) as failure:
        run_python([TRAIN, "fit", "--config", TINY, *SMALL, "--trainer.max_steps", "40", "--model.learning_rate", "1e9",
                    "--trainer.gradient_clip_val", "null", "--trainer.default_root_dir", str(tmp_path)])
    output = str(failure.value)
    assert "NonFiniteLossError: The training loss was NaN or Inf at step" in output
    assert "generate:" not in output
    for checkpoint in (tmp_path / "lightning_logs").rglob("*.ckpt"):
        _, state = load_recipe_checkpoint(checkpoint)
        assert all(t.isfinite().all() for t in state.values()), checkpoint


def test_fabric_loop_nan_loss_stops_naming_the_step_skips_within_budget_and_nothing_is_saved_after_it(tmp_path):
    """The three cases above in a Fabric loop with FabricNonFiniteLossGuard (tests/faults/scripts/fabric_faults_run.py, one
    launch). Catches: training on after a NaN loss; a fabric.save at step 9 writing the NaN weights of step 7 (the
    flag's next periodic read is at step 10); a wrong step in the message; ranks disagreeing when only rank 1's loss
    is NaN (one rank raising, the other hanging in the next collective); a skipped step still applied (AdamW would
    count 12 updates); the budget not enforced."""
    run_python([str(SCRIPTS / "fabric_faults_run.py"), "nonfinite", "--out", str(tmp_path)])
    ranks = [read_json(tmp_path / f"nonfinite_rank{rank}.json") for rank in (0, 1)]
    assert ranks[0] == ranks[1]
    stop, skip, over_budget = ranks[0]["stop"], ranks[0]["skip"], ranks[0]["over_budget"]

    assert stop["error"].startswith("NonFiniteLossError: The training loss was NaN or Inf at step 7 (the step passed"
                                    " to skip()); training stopped")
    assert stop["saved"] == ["step=3", "step=6"]
    assert stop["step"] == 9  # stopped by the save at step 9, before its periodic read at 10

    assert skip["error"] is None
    assert skip["skipped"] == [4, 5]
    assert skip["updates"] == [10]  # 12 optimizer steps, 2 of them not applied
    assert skip["finite"] is True
    assert skip["saved"] == ["step=12", "step=3", "step=6", "step=9"]

    assert over_budget["error"].startswith("NonFiniteLossError: The training loss was NaN or Inf at step 5 (the step"
                                           " passed to skip()) after skipping steps [4];")
    assert over_budget["saved"] == ["step=3"]
