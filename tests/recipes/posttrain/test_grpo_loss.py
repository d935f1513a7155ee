"""GRPO's loss and advantages equal TRL 1.16's own code (``GRPOTrainer._compute_loss`` run on the same per-token
log-probs), in value and in gradient, for every loss_type, with and without the KL term and old log-probs."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from recipes.posttrain.grpo_loss import LOSS_TYPES, check_loss_options, group_advantages, grpo_loss
from recipes.posttrain.logprobs import token_logprobs

BATCH, LENGTH, VOCAB, GENERATIONS = 6, 5, 11, 3


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, LENGTH, VOCAB, generator=g, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[0, 3:] = 0  # completions of different lengths (padding after their end)
    mask[4, 1:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    shift = lambda scale: (token_logprobs(logits, labels) + scale * torch.randn(BATCH, LENGTH, generator=g,
                                                                                 dtype=torch.float64)) * mask
    rewards = torch.randint(0, 3, (BATCH,), generator=g).double()
    return logits, labels, mask, shift(0.3).detach(), shift(0.5).detach(), rewards


class _Accelerator:
    num_processes = 1

    def gather(self, tensor):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor


def _trl_loss(logps, inputs, *, loss_type, beta, epsilon_high):
    """TRL's ``_compute_loss`` itself, on a trainer holding only the options it reads, its per-token log-probs
    taken from ``logps``."""
    from trl import GRPOTrainer

    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=epsilon_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=2, max_completion_length=LENGTH + 3, accelerator=_Accelerator(),
        _entropy_bonus_enabled=False, use_adaptive_entropy=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=True, delta=None, steps_per_generation=2),
    )
    return GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
@pytest.mark.parametrize("beta, off_policy, epsilon_high", [(0.0, False, 0.2), (0.04, True, 0.28), (0.1, False, 0.2)])
def test_loss_and_gradients_equal_trl(loss_type, beta, off_policy, epsilon_high):
    logits, labels, mask, old, ref, rewards = _case(seed=3)
    advantages = group_advantages(rewards, GENERATIONS)
    prompt = torch.zeros(BATCH, 2, dtype=torch.long)
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": labels.clamp(min=0),
              "completion_mask": mask, "advantages": advantages, "num_items_in_batch": mask.sum() * 2,
              "old_per_token_logps": old if off_policy else None, "ref_per_token_logps": ref}

    theirs_logits = logits.clone().requires_grad_(True)
    theirs = _trl_loss(token_logprobs(theirs_logits, labels), inputs, loss_type=loss_type, beta=beta,
                       epsilon_high=epsilon_high)
    theirs.backward()
    ours_logits = logits.clone().requires_grad_(True)
    ours = grpo_loss(token_logprobs(ours_logits, labels), old if off_policy else None, advantages, mask,
                     loss_type=loss_type, epsilon=0.2, epsilon_high=epsilon_high, beta=beta, ref_logps=ref,
                     max_completion_length=LENGTH + 3, num_items_in_batch=mask.sum() * 2, accumulation_steps=2,
                     steps_per_generation=2)
    ours.backward()
    # token_logprobs computes in fp32; everything after it in float64, so the two differ by summation order only.
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-8)
    assert ours_logits.grad.abs().sum() > 0
    torch.testing.assert_close(ours_logits.grad, theirs_logits.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_follow_trl_formula(scale_rewards):
    from trl.trainer import utils as trl_utils
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, float("nan"), 0.0, 1.0, 3.0])
    grouped = rewards.view(-1, 3)
    mean = grouped.nanmean(dim=1).repeat_interleave(3)
    std = {"group": trl_utils.nanstd(grouped, dim=1).repeat_interleave(3), "batch": trl_utils.nanstd(rewards),
           "none": None}[scale_rewards]
    expected = rewards - mean if std is None else (rewards - mean) / (std + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 3, scale_rewards), torch.nan_to_num(expected, nan=0.0))


def test_identical_rewards_give_zero_advantage_and_nan_gives_zero():
    advantages = group_advantages(torch.tensor([1.0, 1.0, 0.0, float("nan")]), 2)
    assert advantages.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_token_logprobs_are_zero_at_ignored_labels_and_log_softmax_elsewhere():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, -100, 4], [0, 2, -100]])
    logps = token_logprobs(logits, labels)
    assert logps.shape == (2, 3) and logps[0, 1] == 0 and logps[1, 2] == 0
    assert logps[0, 2].item() == pytest.approx(torch.log_softmax(logits[0, 2], -1)[4].item(), rel=1e-6)


@pytest.mark.parametrize("option, message", [({"loss_type": "ppo"}, "loss_type='ppo'"),
                                             ({"scale_rewards": "global"}, "scale_rewards='global'"),
                                             ({"epsilon": 1.5}, "epsilon=1.5"), ({"beta": -1.0}, "beta=-1.0")])
def test_bad_loss_options_are_named(option, message):
    values = {"loss_type": "dapo", "scale_rewards": "group", "epsilon": 0.2, "epsilon_high": None, "beta": 0.0}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_loss_options(**{**values, **option})
