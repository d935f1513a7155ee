"""GRPO learns under Trainer.fit: tiny_grpo.yaml on 2 simulated NPUs (npu_fsdp) raises the toy task's mean reward
from at most 0.2 to at least 0.8, logs rollout and training tokens/s apart, and checkpoints the rollout state."""

from __future__ import annotations

import csv

import pytest
import torch

from recipes.decoder.checkpoint_layout import read_recipe_metadata
from tests.helpers import REPO, run_python

GRPO_TRAIN = str(REPO / "recipes/posttrain/train_grpo.py")
TINY_GRPO = str(REPO / "recipes/models/llama/configs/tiny_grpo.yaml")


@pytest.mark.slow
def test_tiny_grpo_raises_the_mean_reward_from_under_0_2_to_over_0_8(tmp_path):
    run_python([GRPO_TRAIN, "fit", "--config", TINY_GRPO, "--trainer.default_root_dir", str(tmp_path),
                "--trainer.logger", "CSVLogger", "--trainer.logger.save_dir", str(tmp_path),
                "--trainer.enable_progress_bar", "false"], simulate=2)
    version = tmp_path / "lightning_logs" / "version_0"
    with open(version / "metrics.csv") as metrics:
        rows = [row for row in csv.DictReader(metrics) if row.get("reward")]
    rewards = [float(row["reward"]) for row in rows]
    assert len(rewards) == 30
    assert sum(rewards[:5]) / 5 <= 0.2, rewards
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards
    assert all(float(row["rollout_tokens_per_s"]) > 0 and float(row["train_tokens_per_s"]) > 0 for row in rows)
    rollouts = read_recipe_metadata(version / "checkpoints" / "last.ckpt")["grpo_rollouts"]
    assert len(rollouts) == 2  # each rank's own: they rolled out different prompts
    assert all(r["completion_ids"].shape == (16, 4) and r["advantages"].shape == (16,) for r in rollouts)
    assert not torch.equal(rollouts[0]["completion_ids"], rollouts[1]["completion_ids"])
