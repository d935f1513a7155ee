"""Per-token log-probabilities of labels under logits, the quantity DPO and GRPO losses are built from."""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """``log p(labels[b, t] | logits[b, t])`` [batch, seq], in float32 at least (bf16 logits are upcast, float64 kept);
    positions labelled -100 give 0.

    ``logits`` [batch, seq, vocab] and ``labels`` [batch, seq] are already aligned (the logits at ``t`` score the
    label at ``t``): shift before calling for next-token prediction."""
    keep = labels != -100
    logps = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    picked = logps.gather(-1, labels.masked_fill(~keep, 0).unsqueeze(-1)).squeeze(-1)
    return picked * keep
