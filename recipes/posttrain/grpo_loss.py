"""GRPO's advantages and loss as pure functions, equal to TRL 1.16's ``GRPOTrainer`` (``_generate_and_score_completions``
for the advantages, ``_compute_loss`` for the loss, token-level importance sampling, no vLLM correction).

Per completion ``i`` and token ``t`` with ``rho = exp(logp - old_logp)``::

    loss_it = -min(rho * A_i, clip(rho, 1 - epsilon, 1 + epsilon_high) * A_i) + beta * rho * k3_it
    k3_it   = exp(ref_logp - logp) - (ref_logp - logp) - 1        (only when beta > 0)

then reduced over the completion tokens by ``loss_type`` (``LOSS_TYPES``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

#: How the token losses reduce to one number (TRL's ``loss_type``), with the normaliser each divides by.
LOSS_TYPES = {
    "grpo": "each completion's token mean, then the mean over completions",
    "bnpo": "the sum over this rank's completion tokens / their count",
    "dr_grpo": "the sum / (completions x max_completion_length)",
    "dapo": "the sum / the generation batch's completion tokens over every rank, per rank and optimizer step",
}
#: How rewards are scaled into advantages (TRL's ``scale_rewards``).
SCALE_REWARDS = ("group", "batch", "none")
#: Added to the standard deviation before dividing (TRL's constant).
STD_EPSILON = 1e-4


def check_loss_options(loss_type: str, scale_rewards: str, epsilon: float, epsilon_high: Optional[float],
                       beta: float) -> None:
    """ValueError naming the bad option and the choices."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)} (TRL's; dapo is the default)")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}: divide the"
                         " advantages by the group's or the batch's reward std, or not at all")
    for name, value in (("epsilon", epsilon), ("epsilon_high", epsilon_high)):
        if value is not None and not 0 < value < 1:
            raise ValueError(f"{name}={value} must lie in (0, 1): the ratio is clipped to [1 - epsilon, 1 + epsilon_high]")
    if beta < 0:
        raise ValueError(f"beta={beta} must be >= 0 (the KL weight; 0 = no reference model)")


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group") -> Tensor:
    """Advantages [n] of ``rewards`` [n] (consecutive groups of ``num_generations`` completions of one prompt):
    ``r - mean_group(r)``, divided by ``std + 1e-4`` (Bessel's std of the group, or of the whole batch; not at all
    for ``"none"``). NaN rewards (unscorable) are left out of the means and get advantage 0."""
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    grouped = rewards.view(-1, num_generations)
    advantages = (grouped - grouped.nanmean(dim=1, keepdim=True)).view(-1)
    if scale_rewards == "group":
        std = _nanstd(grouped, dim=1).repeat_interleave(num_generations) if num_generations > 1 else 0 * rewards
        advantages = advantages / (std + STD_EPSILON)
    elif scale_rewards == "batch":
        std = _nanstd(rewards, dim=0) if rewards.numel() > 1 else 0 * rewards
        advantages = advantages / (std + STD_EPSILON)
    elif scale_rewards != "none":
        check_loss_options("dapo", scale_rewards, 0.2, None, 0.0)
    return torch.nan_to_num(advantages, nan=0.0)


def _nanstd(values: Tensor, dim: int) -> Tensor:
    """Bessel-corrected standard deviation over ``dim``, NaNs left out."""
    count = (~values.isnan()).sum(dim=dim)
    squares = (values - values.nanmean(dim=dim, keepdim=True)) ** 2
    return (squares.nansum(dim=dim) / (count - 1)).sqrt()


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """The k3 estimate of KL(policy || reference) per token, ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_loss(
    logps: Tensor,
    old_logps: Optional[Tensor],
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: Optional[float] = None,
    beta: float = 0.0,
    ref_logps: Optional[Tensor] = None,
    max_completion_length: Optional[int] = None,
    num_items_in_batch: Optional[Tensor] = None,
    num_processes: int = 1,
    accumulation_steps: int = 1,
    steps_per_generation: int = 1,
) -> Tensor:
    """The GRPO loss of one micro-batch of completions.

    Args:
        logps: the policy's per-token log-probs [batch, completion_len] (with gradient).
        old_logps: the rollout policy's [batch, completion_len]; None when the batch is on-policy (``logps``
            detached: the ratio is 1, the gradient is not).
        advantages: one per completion [batch] (``group_advantages``).
        mask: 1 on completion tokens, 0 on padding [batch, completion_len].
        loss_type, epsilon, epsilon_high (None = epsilon), beta: as TRL's options of the same names.
        ref_logps: the reference model's per-token log-probs, required when ``beta > 0``.
        max_completion_length: dr_grpo's fixed length.
        num_items_in_batch: dapo's count: the completion tokens of the whole generation batch over every rank.
        num_processes, accumulation_steps, steps_per_generation: dapo's rescaling of that count to one rank's
            optimizer step; grpo, bnpo and dr_grpo divide by ``accumulation_steps``.
    """
    old_logps = logps.detach() if old_logps is None else old_logps
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    token_loss = -torch.min(ratio * advantages, clipped * advantages)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError(f"beta={beta} needs ref_logps (the reference model's log-probs); beta=0 needs none")
        token_loss = token_loss + beta * k3_kl(logps, ref_logps) * ratio
    summed = token_loss * mask
    if loss_type == "grpo":
        return (summed.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation_steps
    if loss_type == "bnpo":
        return summed.sum() / mask.sum().clamp(min=1.0) / accumulation_steps
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length; pass it")
        return summed.sum() / (logps.shape[0] * max_completion_length) / accumulation_steps
    if loss_type == "dapo":
        count = mask.sum() if num_items_in_batch is None else num_items_in_batch
        normalizer = count.clamp(min=1.0) / num_processes * accumulation_steps / steps_per_generation
        return summed.sum() / normalizer
    raise ValueError(f"loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
