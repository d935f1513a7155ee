"""The recipe resumed mid-epoch on 2 simulated NPUs (npu_fsdp, its LR schedule, its data module, a sharded
checkpoint) trains exactly as the uninterrupted run, step by step.

Every rank is killed at the start of step 6 (no teardown, as a crash), then the run resumes from ``last.ckpt``
(step 4). Breakage tried: a data module that forgets its position (``load_state_dict`` a no-op) makes all six
resumed losses differ. A resume that lost the LR schedule's state or the per-rank data split
(``samples_per_step`` with two ranks) would change them too.
"""

import pytest

from tests.recipe_runs import TRAINED_STEPS, last_checkpoint, logged_losses, train_tiny

pytestmark = pytest.mark.slow  # every test here starts processes or trains (or shares a fixture that does)


CRASH_AT_STEP_6 = ["--trainer.callbacks+=tests.recipes.scripts.crash_at_step.CrashAtStep", "--trainer.callbacks.step=6"]


def test_recipe_resumed_mid_epoch_reproduces_uninterrupted_losses(tmp_path, trained_tiny_run):
    """The uninterrupted run is the session's trained run (TRAINED_STEPS: 10 steps, a checkpoint every 4); the
    crashed and the resumed runs train with the same arguments."""
    with pytest.raises(AssertionError, match="exited 3"):  # every rank killed at the start of step 6
        train_tiny(tmp_path / "crashed", *TRAINED_STEPS, *CRASH_AT_STEP_6)
    last = last_checkpoint(tmp_path / "crashed", 0)  # written after step 4
    train_tiny(tmp_path / "crashed", *TRAINED_STEPS, "--ckpt_path", str(last))

    full, resumed = trained_tiny_run.losses(), logged_losses(tmp_path / "crashed", 1)
    assert sorted(full) == list(range(10)) and sorted(resumed) == list(range(4, 10))
    assert [resumed[step] for step in range(4, 10)] == pytest.approx([full[step] for step in range(4, 10)], rel=1e-5)
