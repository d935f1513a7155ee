"""Token-choice top-k routing (softmax or sigmoid scores, optionally group-limited and scaled: Mixtral, Qwen-MoE,
DeepSeek-V2 / V3) and the load-balancing loss, in fp32 plain torch (no fused kernel: the router is a [tokens, experts]
matmul and a softmax, and its choices must be exactly Hugging Face's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

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


#: How ``route`` scores the experts (``Routing.scoring``): a softmax over them (Mixtral, Qwen-MoE, DeepSeek-V2) or
#: each one's sigmoid (DeepSeek-V3).
SCORINGS = ("softmax", "sigmoid")
#: How ``route`` scores a group of experts for group-limited routing (``Routing.group_score``): the sum of its two
#: best choice scores (DeepSeek-V3) or its best one (DeepSeek-V2's ``group_limited_greedy``).
GROUP_SCORES = ("top2", "max")
# DeepSeek-V3 renormalises by (sum + 1e-20); for softmax scores the top-k sum is >= top_k / n_experts, where adding
# 1e-20 leaves every fp32 sum as it is, so Mixtral's and Qwen-MoE's weights stay bit-identical.
_NORM_EPS = 1e-20


@dataclass(frozen=True)
class Routing:
    """How an MoE layer picks each token's experts and weighs them (``route``): ``top_k`` of them by ``scoring``
    (fp32), within the ``topk_group`` best of ``n_group`` equal groups of experts (by ``group_score``; 1 group: no
    limit), their weights the unbiased scores, renormalised to sum to 1 with ``normalise``, times ``scale``
    (DeepSeek's ``routed_scaling_factor``)."""

    top_k: int
    normalise: bool
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2"
    scale: float = 1.0

    def __call__(self, logits: Tensor, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """``route`` with these settings."""
        return route(logits, self.top_k, normalise=self.normalise, bias=bias, scoring=self.scoring,
                     n_group=self.n_group, topk_group=self.topk_group, group_score=self.group_score, scale=self.scale)


def route(
    logits: Tensor,
    top_k: int,
    *,
    normalise: bool,
    bias: Optional[Tensor] = None,
    scoring: str = "softmax",
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = "top2",
    scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``(probs, expert_ids)`` [tokens, top_k] of router ``logits``: the scores (``scoring``: softmax over all
    experts or each one's sigmoid, fp32), then the top k, renormalised to sum to 1 with ``normalise`` (Mixtral
    always; Qwen-MoE with ``norm_topk_prob``; DeepSeek-V3 dividing by the sum + 1e-20), times ``scale``. With a
    balancing ``bias`` [n_experts] the experts are the top k of ``scores + bias``, their weights still the scores.
    With ``n_group`` > 1 the experts form that many equal groups, each scored by ``group_score`` of its choice
    scores, and a token picks only among the experts of its ``topk_group`` best groups (as transformers'
    DeepSeek-V3 and V2 ``group_limited_greedy`` routers do)."""
    scores = torch.softmax(logits.float(), dim=-1) if scoring == "softmax" else torch.sigmoid(logits.float())
    if bias is None and n_group == 1:
        probs, expert_ids = torch.topk(scores, top_k, dim=-1)
    else:
        choice = scores if bias is None else scores + bias
        if n_group > 1:
            groups = choice.unflatten(-1, (n_group, -1))
            if group_score == "top2":
                group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = groups.amax(dim=-1)
            kept = torch.zeros_like(group_scores, dtype=torch.bool)
            kept.scatter_(-1, group_scores.topk(topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~kept.repeat_interleave(groups.shape[-1], dim=-1), float("-inf"))
        expert_ids = torch.topk(choice, top_k, dim=-1).indices
        probs = scores.gather(-1, expert_ids)
    if normalise:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + _NORM_EPS)
    if scale != 1.0:
        probs = probs * scale
    return probs, expert_ids


def load_balancing_loss(router_logits: Sequence[Tensor], top_k: int,
                        sum_over_ranks: Optional[Callable[[Tensor], Tensor]] = None) -> Tensor:
    """The Switch Transformer auxiliary loss as Hugging Face computes it (``load_balancing_loss_func``, no
    attention mask): over the tokens of every MoE layer together, ``n_experts * sum_e f_e * P_e``, where f_e is
    how many of the top_k choices went to expert e per token and P_e the mean softmax probability of e. Only P
    carries a gradient. Counted without a host sync (a scatter, not bincount).

    ``sum_over_ranks`` sums a tensor over the ranks whose tokens differ (data-parallel x context-parallel; one
    all-reduce of 2 n_experts + 2 numbers): f and P then count the tokens of them all, so the loss is the same
    under any split of the batch (whole rows, or each rank a part of every sequence) and on every rank. Its gradient
    is this rank's part times the number of ranks, since the strategy averages gradients over them (as the
    cross-entropy's ``token_mean``). None: this rank's tokens alone."""
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one MoE layer")
    logits = torch.cat([layer.float() for layer in router_logits])
    tokens, n_experts = logits.shape
    scores = torch.softmax(logits, dim=-1)
    chosen = torch.topk(scores, top_k, dim=-1).indices.flatten()
    counts = torch.zeros(n_experts, device=logits.device).scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
    summed = scores.sum(dim=0)
    local = torch.cat([counts, summed.detach(), counts.new_tensor([tokens, 1.0])])
    total = local if sum_over_ranks is None else sum_over_ranks(local)
    all_counts, all_summed, (all_tokens, ranks) = total[:n_experts], total[n_experts:-2], total[-2:]
    fraction = all_counts / all_tokens
    loss = n_experts * torch.sum(fraction * all_summed) / all_tokens
    own = ranks * n_experts * torch.sum(fraction * summed) / all_tokens
    return loss + (own - own.detach())


def expert_load(router_logits: Sequence[Tensor], top_k: int,
                biases: Optional[Sequence[Optional[Tensor]]] = None, *, routing: Optional[Routing] = None) -> Tensor:
    """How unevenly the tokens were routed: in the worst-balanced layer, the most loaded expert's share of the top_k
    choices over the mean share (1 when every expert got as many; n_experts / top_k at most). A 0-d fp32 tensor,
    counted without a host sync, with no gradient. ``biases``: each layer's balancing bias (``route``'s), or None;
    ``routing``: how the layers choose (default: softmax top_k)."""
    if not router_logits:
        raise ValueError("expert_load needs the router logits of at least one MoE layer")
    routing = Routing(top_k, normalise=False) if routing is None else routing
    loads = []
    for logits, bias in zip(router_logits, biases or [None] * len(router_logits)):
        _, ids = routing(logits.detach(), bias)
        chosen = ids.flatten()
        counts = torch.zeros(logits.shape[-1], device=logits.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
        loads.append(counts.max() / counts.mean())
    return torch.stack(loads).max()
