"""The recipe resumed mid-epoch on 2 simulated NPUs (npu_fsdp, its LR schedule, its data module, a sharded
checkpoint) trains exactly as the uninterrupted run, step by step.

Every rank is killed at the start of step 6 (no teardown, as a crash), then the run resumes from ``last.ckpt``
(step 4). Breakage tried: a data module that forgets its position (``load_state_dict`` a no-op) makes all six
resumed losses differ. A resume that lost the LR schedule's state or the per-rank data split
(``samples_per_step`` with two ranks) would change them too.
"""

import csv

import pytest

from tests.test_recipe_e2e import _last_checkpoint, _train

# 10 steps, a checkpoint every 4 (with validation); the warmup ends inside the run, so the LR changes every step.
pytestmark = pytest.mark.slow  # every test here starts processes or trains (or shares a fixture that does)


STEPS = ["--trainer.max_steps", "10", "--trainer.log_every_n_steps", "1", "--trainer.val_check_interval", "4",
         "--model.warmup_steps", "3"]
CRASH_AT_STEP_6 = ["--trainer.callbacks+=tests.scripts.crash_at_step.CrashAtStep", "--trainer.callbacks.step=6"]


def _losses(root, version):
    with open(root / "lightning_logs" / f"version_{version}" / "metrics.csv") as metrics:
        rows = [row for row in csv.DictReader(metrics) if row.get("train_loss")]
    return {int(row["step"]): float(row["train_loss"]) for row in rows}


def test_recipe_resumed_mid_epoch_reproduces_uninterrupted_losses(tmp_path):
    _train(tmp_path / "full", *STEPS)
    with pytest.raises(AssertionError, match="exited 3"):  # every rank killed at the start of step 6
        _train(tmp_path / "crashed", *STEPS, *CRASH_AT_STEP_6)
    last = _last_checkpoint(tmp_path / "crashed", 0)  # written after step 4
    _train(tmp_path / "crashed", *STEPS, "--ckpt_path", str(last))

    full, resumed = _losses(tmp_path / "full", 0), _losses(tmp_path / "crashed", 1)
    assert sorted(full) == list(range(10)) and sorted(resumed) == list(range(4, 10))
    assert [resumed[step] for step in range(4, 10)] == pytest.approx([full[step] for step in range(4, 10)], rel=1e-5)
