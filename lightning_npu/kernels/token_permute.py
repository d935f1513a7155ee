"""MoE token dispatch: copy each token once per chosen expert, sorted by expert (permute), and sum the expert
outputs back per token, weighted by the router's probabilities (unpermute).

On NPU tensors this runs torch_npu's npu_moe_token_permute / npu_moe_token_unpermute pair, elsewhere a PyTorch
reference pair. :func:`permute_tokens` decides the path once and records it in the :class:`TokenPermutation` it
returns; :func:`unpermute_tokens` follows that record, so a fused half is never paired with a reference half.
Both paths keep one index convention, CANN's ``sorted_indices``: entry ``t * top_k + j`` is the permuted row that
holds token t's j-th choice (the inverse of the argsort torchtitan and Megatron keep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_npu.kernels._dispatch import (
    chip_unsupported_reason,
    note_fallback,
    release_unsupported_reason,
    unavailable_reason,
)

# npu_moe_token_permute / unpermute's documented limits: top-k <= 512; ids and their count below 16777215 (the
# ids are sorted as floats).
_FUSED_MAX_TOP_K = 512
_FUSED_MAX_INDEX = 16777215
# torch_npu 2.6.0 registers no backward for the pair.
_FUSED_MIN_RELEASE = (2, 13)


@dataclass(frozen=True)
class TokenPermutation:
    """What :func:`unpermute_tokens` needs from :func:`permute_tokens`: the path it took (``fused``), the
    ``sorted_indices`` (int32 on the fused path, int64 on the reference one; the same values) and the probs."""

    fused: bool
    sorted_indices: Tensor
    probs: Tensor


def permute_tokens(tokens: Tensor, expert_ids: Tensor, probs: Tensor,
                   num_experts: int) -> tuple[Tensor, Tensor, TokenPermutation]:
    """Return ``(permuted, counts, permutation)`` for tokens [T, H] routed to ``expert_ids`` [T, top_k].

    ``permuted`` [T * top_k, H] holds each token once per choice, sorted stably by expert (ready for
    :func:`~lightning_npu.kernels.grouped_matmul`); ``counts`` [num_experts] (int64) is how many rows each expert
    got; ``permutation`` goes to :func:`unpermute_tokens` with the experts' output, together with ``probs``
    [T, top_k], the weight of each choice. The fused pair needs probs in the tokens' dtype (mixed dtypes give NaN
    gradients on NPUs); other probs run the reference pair, which weights in fp32.
    """
    _check_inputs(tokens, expert_ids, probs, num_experts)
    counts = torch.bincount(expert_ids.flatten(), minlength=num_experts)
    if counts.numel() != num_experts:
        raise ValueError(f"expert_ids hold an id >= num_experts={num_experts}; ids must lie in 0 .. {num_experts - 1}")
    reason = why_not_fused(tokens, expert_ids, probs)
    if reason is None:
        import torch_npu

        permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, expert_ids)
        return permuted, counts, TokenPermutation(True, sorted_indices, probs)
    note_fallback("token_permute", tokens, reason)
    permuted, sorted_indices = reference_permute_tokens(tokens, expert_ids)
    return permuted, counts, TokenPermutation(False, sorted_indices, probs)


def unpermute_tokens(expert_out: Tensor, permutation: TokenPermutation) -> Tensor:
    """``out[t] = sum_j probs[t, j] * expert_out[row of token t's j-th choice]``: [T, H] in expert_out's dtype,
    on the path :func:`permute_tokens` took."""
    if expert_out.dim() != 2 or expert_out.shape[0] != permutation.sorted_indices.numel():
        raise ValueError(
            f"expert_out {tuple(expert_out.shape)} must have one row per permuted token"
            f" ({permutation.sorted_indices.numel()}), in the order permute_tokens returned them"
        )
    if permutation.fused:
        import torch_npu

        return torch_npu.npu_moe_token_unpermute(expert_out, permutation.sorted_indices, permutation.probs)
    return reference_unpermute_tokens(expert_out, permutation.sorted_indices, permutation.probs)


def why_not_fused(tokens: Tensor, expert_ids: Tensor, probs: Tensor) -> Optional[str]:
    """Why :func:`permute_tokens` would run the reference pair on these inputs; None when it runs the fused pair."""
    return unavailable_reason("token_permute", tokens, lambda: _fused_limits(tokens, expert_ids, probs))


def _check_inputs(tokens: Tensor, expert_ids: Tensor, probs: Tensor, num_experts: int) -> None:
    if tokens.dim() != 2 or expert_ids.dim() != 2 or expert_ids.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"permute_tokens takes tokens [T, H] and expert_ids [T, top_k]; got tokens {tuple(tokens.shape)} and"
            f" expert_ids {tuple(expert_ids.shape)} (route 1-D ids with expert_ids[:, None])"
        )
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids must be int32 or int64 (torch.topk's indices), got {expert_ids.dtype}")
    if probs.shape != expert_ids.shape or not probs.dtype.is_floating_point:
        raise ValueError(
            f"probs must be floating point with expert_ids' shape {tuple(expert_ids.shape)}; got {probs.dtype}"
            f" {tuple(probs.shape)}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts must be at least 1, got {num_experts}")


def _fused_limits(tokens: Tensor, expert_ids: Tensor, probs: Tensor) -> Optional[str]:
    top_k = expert_ids.shape[1]
    if top_k > _FUSED_MAX_TOP_K:
        return f"top_k={top_k} exceeds npu_moe_token_permute's limit of {_FUSED_MAX_TOP_K}"
    if expert_ids.numel() >= _FUSED_MAX_INDEX:
        return f"{expert_ids.numel()} routed tokens reach npu_moe_token_permute's limit ({_FUSED_MAX_INDEX})"
    if probs.dtype != tokens.dtype:
        return (
            f"probs are {probs.dtype} but tokens {tokens.dtype}: npu_moe_token_unpermute's backward gives NaN for"
            " mixed dtypes; pass probs.to(tokens.dtype) to keep the fused pair"
        )
    why = "older releases register no backward for it"
    return release_unsupported_reason("npu_moe_token_permute", _FUSED_MIN_RELEASE, why) or chip_unsupported_reason(
        "npu_moe_token_permute")


def reference_permute_tokens(tokens: Tensor, expert_ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(permuted, sorted_indices)`` on the PyTorch path whatever the device: what npu_moe_token_permute must
    match (``sorted_indices`` int64 here)."""
    top_k = expert_ids.shape[1]
    order = torch.argsort(expert_ids.flatten(), stable=True)  # permuted row r holds choice order[r]
    return tokens[order // top_k], torch.argsort(order)


def reference_unpermute_tokens(expert_out: Tensor, sorted_indices: Tensor, probs: Tensor) -> Tensor:
    """:func:`unpermute_tokens` on the PyTorch path whatever the device; the weighted sum is taken in fp32."""
    tokens, top_k = probs.shape
    rows = expert_out[sorted_indices.long()].float().view(tokens, top_k, expert_out.shape[-1])
    return (rows * probs.float().unsqueeze(-1)).sum(dim=1).to(expert_out.dtype)
