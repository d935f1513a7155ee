"""Quantizing a frozen weight and decoding it again, in the layouts ``lightning_npu.facts.weight_quant`` defines:
``int8`` (symmetric, one scale per output channel) and ``nf4`` (QLoRA's NormalFloat-4 on blocks of 64).

NF4 (Dettmers et al., "QLoRA", arXiv 2305.14314, section 3) is built from its definition: the 16 values are
quantiles of the standard normal distribution, normalised to [-1, 1], with an exact zero. The positive half takes
8 quantiles at probabilities evenly spaced from ``offset`` down to 0.5 (0.5 itself, the zero, left out), the
negative half 7 the same way, so the code is asymmetric (8 positive, 7 negative values, and 0) and both ends are +-1.
``offset`` is the mean of 1 - 1/(2 * 15) and 1 - 1/(2 * 16): the extreme quantile of a 15- and of a 16-value grid,
so that the largest entry is a finite quantile rather than the infinite one at probability 1. Blocks are
quantized with the shared block quantizer (``lightning_npu.quant.blockwise.quantize_to``: absmax scale, nearest
table entry); two 4-bit codes share a byte.

Eager torch only: it runs on every chip and on the CPU.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from lightning_npu.facts import weight_quant as layout
from lightning_npu.quant import blockwise

NF4_VALUES = 16
#: The extreme quantile's probability, between a 15- and a 16-value grid's (see the module docstring).
NF4_OFFSET = (1 - 1 / (2 * 15) + 1 - 1 / (2 * 16)) / 2


@functools.lru_cache(maxsize=None)
def nf4_values() -> tuple[float, ...]:
    """The 16 NF4 values, ascending, from -1 to 1 with an exact 0."""
    positive = torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([positive, negative, torch.zeros(1, dtype=torch.float64)]).sort().values
    values = values / values.max()
    assert values.numel() == NF4_VALUES, values
    return tuple(values.tolist())


def check_quantizable(shape: tuple[int, ...], scheme: str, name: str) -> None:
    """Raise ``ValueError`` naming weight ``name`` if its ``shape`` cannot be stored in ``scheme``."""
    reason = layout.unsupported_reason(tuple(shape), scheme)
    if reason is not None:
        raise ValueError(f"cannot quantize {name} to {scheme}: {reason}")


def quantize(weight: Tensor, scheme: str) -> tuple[Tensor, Tensor]:
    """(codes, scales) of a 2-D ``weight`` [out, in] in ``scheme`` (shapes: ``facts.weight_quant.stored_shapes``)."""
    check_quantizable(tuple(weight.shape), scheme, "the weight")
    w = weight.detach().float()
    if scheme == "int8":
        scales = w.abs().amax(dim=1) / layout.INT8_MAX
        codes = torch.round(w / scales.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1))
        return codes.clamp(-layout.INT8_MAX, layout.INT8_MAX).to(torch.int8), scales
    codes, scales = blockwise.quantize_to(w, layout.NF4_BLOCK_SIZE, blockwise.codebook(nf4_values(), w.device))
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales


def dequantize(codes: Tensor, scales: Tensor, scheme: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """The [out, in] weight that ``codes`` and ``scales`` stand for, in ``dtype``. The decode runs in the scales'
    dtype for int8 (one multiply per element, as the fused NPU matmul does) and in fp32 for NF4."""
    if scheme == "int8":
        return (codes.to(scales.dtype) * scales.unsqueeze(1)).to(dtype)
    unpacked = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(codes.shape[0], -1)
    return blockwise.dequantize_from(unpacked, scales.float(), blockwise.codebook(nf4_values(), codes.device)).to(dtype)
