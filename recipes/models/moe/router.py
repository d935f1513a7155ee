"""Token-choice top-k routing and the load-balancing loss, in fp32 plain torch (no fused kernel: the router is a
[tokens, experts] matmul and a softmax, and its choices must be exactly Hugging Face's)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from recipes.decoder.layers import INIT_STD


class Router(nn.Module):
    """The gate of an MoE layer: logits [tokens, n_experts] = x . weight^T, computed in fp32 whatever the
    autocast dtype (a bf16 matmul moves near-tied scores, so tokens would pick other experts).

    With ``balancing_bias`` it also holds ``expert_bias`` [n_experts] (fp32, a buffer: no gradient, saved in
    checkpoints), the auxiliary-loss-free balancing bias ``route`` adds to the scores for the top-k choice."""

    def __init__(self, dim: int, n_experts: int, *, balancing_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        if balancing_bias:
            self.register_buffer("expert_bias", torch.zeros(n_experts))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)
        if hasattr(self, "expert_bias"):
            nn.init.zeros_(self.expert_bias)

    @torch.no_grad()
    def balance(self, routed: Tensor, rate: float) -> None:
        """Move ``expert_bias`` by ``rate`` towards balance for the ``routed`` tokens per expert [n_experts]: up for
        the experts below the mean, down for those above, unchanged for those at it."""
        routed = routed.float()
        self.expert_bias.add_(rate * torch.sign(routed.mean() - routed))

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())


def route(logits: Tensor, top_k: int, *, normalise: bool, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """``(probs, expert_ids)`` [tokens, top_k] of router ``logits``: the softmax over all experts (fp32), then the
    top k, renormalised to sum to 1 with ``normalise`` (Mixtral always; Qwen-MoE with ``norm_topk_prob``). With a
    balancing ``bias`` [n_experts] the experts are the top k of ``scores + bias``, their weights still the scores."""
    scores = torch.softmax(logits.float(), dim=-1)
    if bias is None:
        probs, expert_ids = torch.topk(scores, top_k, dim=-1)
    else:
        expert_ids = torch.topk(scores + bias, top_k, dim=-1).indices
        probs = scores.gather(-1, expert_ids)
    if normalise:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, expert_ids


def load_balancing_loss(router_logits: Sequence[Tensor], top_k: int) -> Tensor:
    """The Switch Transformer auxiliary loss as Hugging Face computes it (``load_balancing_loss_func``, no
    attention mask): over the tokens of every MoE layer together, ``n_experts * sum_e f_e * P_e``, where f_e is
    how many of the top_k choices went to expert e per token and P_e the mean softmax probability of e. Only P
    carries a gradient. Counted without a host sync (a scatter, not bincount)."""
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one MoE layer")
    logits = torch.cat([layer.float() for layer in router_logits])
    tokens, n_experts = logits.shape
    scores = torch.softmax(logits, dim=-1)
    chosen = torch.topk(scores, top_k, dim=-1).indices.flatten()
    counts = torch.zeros(n_experts, device=logits.device).scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
    return n_experts * torch.sum(counts / tokens * scores.mean(dim=0))


def expert_load(router_logits: Sequence[Tensor], top_k: int,
                biases: Optional[Sequence[Optional[Tensor]]] = None) -> Tensor:
    """How unevenly the tokens were routed: in the worst-balanced layer, the most loaded expert's share of the top_k
    choices over the mean share (1 when every expert got as many; n_experts / top_k at most). A 0-d fp32 tensor,
    counted without a host sync, with no gradient. ``biases``: each layer's balancing bias (``route``'s), or None."""
    if not router_logits:
        raise ValueError("expert_load needs the router logits of at least one MoE layer")
    loads = []
    for logits, bias in zip(router_logits, biases or [None] * len(router_logits)):
        _, ids = route(logits.detach(), top_k, normalise=False, bias=bias)
        chosen = ids.flatten()
        counts = torch.zeros(logits.shape[-1], device=logits.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
        loads.append(counts.max() / counts.mean())
    return torch.stack(loads).max()
