"""The recipe's training loop makes no host sync outside logging steps (reading a loss with ``float()`` or
``.item()`` stalls the NPU's asynchronous dispatch every step).

10 optimizer steps of the tiny recipe on 2 simulated NPUs with logging, validation and checkpoints outside
them; ``tests/recipes/scripts/host_sync_counter.py`` counts, per step, scalar reads (``aten._local_scalar_dense``) and
the runtime's ``synchronize`` by who made them. Breakage caught: the recipe's per-batch
``float(outputs["loss"])`` in RunSummary, and ``self.log(..., prog_bar=True)`` of the training loss (Lightning
converts progress-bar values to Python numbers every step), one read each per step.
"""

import pytest
from tests.helpers import read_json
from tests.recipe_runs import train_tiny


pytestmark = pytest.mark.slow  # every test here starts processes or trains (or shares a fixture that does)


def test_recipe_training_steps_make_no_host_sync_outside_logging_steps(tmp_path):
    out = tmp_path / "syncs.json"
    train_tiny(tmp_path, "--trainer.max_steps", "10", "--trainer.log_every_n_steps", "1000",
               "--trainer.limit_val_batches", "0",
               "--trainer.callbacks+=tests.recipes.scripts.host_sync_counter.HostSyncCounter", f"--trainer.callbacks.out={out}")
    steps = read_json(out)["steps"]
    assert len(steps) == 8  # steps 1..8 of 0..9
    for counts in steps:
        assert counts.get("scalar_reads_ours", 0) == 0 and counts.get("synchronize_ours", 0) == 0, counts
        # Lightning 2.6 reads its SIGTERM flag (broadcast from rank 0) before every batch; under npu strategies
        # that flag never changes (preemption.py's handlers), so the broadcast is skipped. The preemption check
        # reads its agreed flag once per step (check_every_n_steps=1): the one host read of a step.
        assert counts.get("scalar_reads_lightning", 0) == 0, counts
        assert counts.get("scalar_reads_preemption_check", 0) == 1, counts
