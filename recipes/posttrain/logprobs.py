"""Per-token log-probabilities of target tokens, the quantity every post-training objective is built from."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """``log p(labels[b, t] | logits[b, t])`` as [B, T] fp32, 0 where ``labels`` is -100. ``labels`` are aligned
    with ``logits`` (already shifted: position t's logits score token t + 1 of the sequence)."""
    batch, length = labels.shape
    flat = logits.reshape(batch * length, -1).float()
    return -F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, reduction="none").view(batch, length)
