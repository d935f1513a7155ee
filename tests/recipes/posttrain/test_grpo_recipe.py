"""GRPO under Trainer.fit: tiny_grpo.yaml on 2 simulated NPUs (npu_fsdp, a KL term against a frozen copy, 2 optimizer
steps per rollout phase) raises the toy task's mean reward from at most 0.2 to at least 0.8, logs rollout and
training tokens/s apart, and resumes mid-run exactly."""

from __future__ import annotations

import csv

import pytest
import torch

from recipes.decoder.checkpoint_layout import read_recipe_metadata
from tests.helpers import REPO, run_python

GRPO_TRAIN = str(REPO / "recipes/posttrain/train_grpo.py")
TINY_GRPO = str(REPO / "recipes/models/llama/configs/tiny_grpo.yaml")
MID_STEP = 25  # between the two iterations of the rollout phase of step 24, mid-epoch (32 steps an epoch)


def _train_grpo(root, *extra):
    run_python([GRPO_TRAIN, "fit", "--config", TINY_GRPO, "--trainer.default_root_dir", str(root),
                "--trainer.logger", "CSVLogger", "--trainer.logger.save_dir", str(root),
                "--trainer.enable_progress_bar", "false", *extra], simulate=2)
    with open(root / "lightning_logs" / "version_0" / "metrics.csv") as metrics:
        return {int(row["step"]): row for row in csv.DictReader(metrics) if row.get("train_loss")}


@pytest.mark.slow
def test_tiny_grpo_raises_the_mean_reward_and_resumes_mid_phase_exactly(tmp_path):
    """The learning run (one launch) also keeps its step-25 checkpoint; the one more launch resumes from it: steps 25
    to 29 repeat the uninterrupted run's losses, rewards and KL, so the data position, the optimizer, the frozen
    reference copy, the kept rollouts with their old and reference log-probs, and the sampling stream all came back
    (the test of the exact mid-run resume, sharing the learning test's run)."""
    mid = tmp_path / "mid"
    keep = ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", "--trainer.callbacks.dirpath",
            str(mid), f"--trainer.callbacks.every_n_train_steps={MID_STEP}", "--trainer.callbacks.save_top_k=-1"]
    full = _train_grpo(tmp_path / "full", *keep)
    rows = [full[step] for step in sorted(full)]
    rewards = [float(row["reward"]) for row in rows]
    assert len(rows) == 30
    assert sum(rewards[:5]) / 5 <= 0.2, rewards
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards
    assert all(float(row["train_tokens_per_s"]) > 0 for row in rows)
    phases = [row for step, row in full.items() if step % 2 == 0]  # rollouts at every other step only
    assert all(float(row["rollout_tokens_per_s"]) > 0 for row in phases)
    assert float(rows[-1]["kl"]) > 0.1  # the policy moved off its reference, and the KL term saw it

    checkpoint = mid / f"epoch=0-step={MID_STEP}.ckpt"
    rollouts = read_recipe_metadata(checkpoint)["grpo_rollouts"]
    assert len(rollouts) == 2  # each rank's own: they rolled out different prompts
    assert all(r["completion_ids"].shape == (16, 4) and r["advantages"].shape == (16,) for r in rollouts)
    assert all(r["old_logps"].shape == r["ref_logps"].shape == (16, 4) for r in rollouts)
    assert not torch.equal(rollouts[0]["completion_ids"], rollouts[1]["completion_ids"])

    resumed = _train_grpo(tmp_path / "resumed", "--ckpt_path", str(checkpoint))
    assert sorted(resumed) == list(range(MID_STEP, 30))
    for name in ("train_loss", "kl"):
        assert [float(resumed[s][name]) for s in resumed] == pytest.approx(
            [float(full[s][name]) for s in resumed], rel=1e-5, abs=1e-7), name
    assert [float(resumed[s]["reward"]) for s in (26, 28)] == pytest.approx([float(full[s]["reward"]) for s in (26, 28)])
