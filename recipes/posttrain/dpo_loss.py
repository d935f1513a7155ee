"""DPO's per-pair losses, as TRL 1.16 defines them (``DPOTrainer._compute_loss``), from summed completion
log-probabilities of the policy and the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

#: ``loss_type`` choices: the Bradley-Terry log-likelihood (DPO's own), IPO's squared margin, the SLiC hinge.
LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def check_loss_type(loss_type: str, beta: float) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}: 'sigmoid' is DPO's"
                         " -log sigmoid(beta * margin), 'ipo' (beta * length-normalised margin - 1/2)^2 as TRL"
                         " normalises it, 'hinge' relu(1 - beta * margin)")
    if not beta > 0:
        raise ValueError(f"beta={beta!r} must be > 0: it scales the log-ratio margin (TRL's default is 0.1)")


def pair_losses(loss_type: str, beta: float, chosen_logratios: Tensor, rejected_logratios: Tensor,
                chosen_tokens: Tensor, rejected_tokens: Tensor) -> Tensor:
    """[B] losses of B pairs: ``*_logratios`` = log pi(y|x) - log pi_ref(y|x) summed over each completion's tokens,
    ``*_tokens`` their completion lengths (IPO divides by them)."""
    margin = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * margin)
    if loss_type == "hinge":
        return torch.relu(1 - beta * margin)
    if loss_type == "ipo":
        normalised = chosen_logratios / chosen_tokens.clamp(min=1) - rejected_logratios / rejected_tokens.clamp(min=1)
        return (normalised - 1 / (2 * beta)) ** 2
    raise ValueError(f"loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
