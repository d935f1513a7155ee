"""Blockwise dynamic 8-bit quantization of optimizer moments (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", arXiv 2110.02861): a tensor is cut into blocks of ``block_size`` consecutive elements (row-major), each
block is divided by its absolute maximum (its fp32 *scale*), and every scaled value is stored as the uint8 index of
the nearest entry of a 256-entry *dynamic map*.

The dynamic map (Dettmers, arXiv 1511.04561) spends its codes logarithmically: values in [10^-k, 10^-(k-1)) get a
linear grid whose size doubles with each decade toward 1, so small moments keep their relative precision. The
signed map (for ``exp_avg``) holds both signs, the unsigned one (for ``exp_avg_sq``, never negative) spends the sign
bit on one more fraction bit. Both maps hold 0 and 1; the signed one's most negative entry is -0.993 (as published,
and as torchao's and bitsandbytes' maps), so a block whose absmax is negative loses up to 0.7% of it.

The same block quantizer serves any table of at most 256 values (``quantize_to`` / ``dequantize_from``): the
frozen LoRA base's NF4 codes (``lightning_npu.quant.weights``) are its 16-entry table on blocks of 64.

Everything is plain eager torch (no torch.compile, no custom kernels), so it runs on every NPU and on the CPU.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

CODES_DTYPE = torch.uint8
SCALES_DTYPE = torch.float32
#: Decades the map covers below 1 (its smallest nonzero magnitude is about 10^-DECADES).
DECADES = 7


@functools.lru_cache(maxsize=None)
def dynamic_map(signed: bool) -> tuple[float, ...]:
    """The 256 values of the dynamic map, ascending: 0, 1, and for decade i (0 = the smallest) the midpoints of a
    linear grid on [0.1, 1] times 10^(i - DECADES + 1), of 2^i (signed, each with its negative) or 2^(i+1)
    (unsigned) intervals: 2 + 2 * 127 or 2 + 254 codes."""
    values = [0.0, 1.0]

    def decade(i: int, intervals: int) -> list[float]:
        grid = torch.linspace(0.1, 1.0, intervals + 1, dtype=torch.float32)
        midpoints = ((grid[:-1] + grid[1:]) / 2.0 * 10.0 ** (i - DECADES + 1)).tolist()
        return midpoints + ([-m for m in midpoints] if signed else [])

    for i in range(DECADES):
        values += decade(i, 2 ** i if signed else 2 ** (i + 1))
    assert len(values) == 256, len(values)
    return tuple(sorted(values))


@functools.lru_cache(maxsize=None)
def _tables(signed: bool, device: torch.device) -> Tensor:
    """The dynamic map on ``device`` (built once per device)."""
    return torch.tensor(dynamic_map(signed), dtype=torch.float32, device=device)


def quantize(values: Tensor, block_size: int, signed: bool) -> tuple[Tensor, Tensor]:
    """(codes, scales) of ``values`` (any shape, numel divisible by ``block_size``) on the dynamic map: ``codes``
    uint8 shaped like ``values``, ``scales`` fp32 of one absmax per block (see ``quantize_to``)."""
    return quantize_to(values, block_size, _tables(signed, values.device))


def dequantize(codes: Tensor, scales: Tensor, signed: bool) -> Tensor:
    """The fp32 values ``codes`` and ``scales`` stand for on the dynamic map (shaped like ``codes``)."""
    return dequantize_from(codes, scales, _tables(signed, codes.device))


def quantize_to(values: Tensor, block_size: int, table: Tensor) -> tuple[Tensor, Tensor]:
    """(codes, scales) of ``values`` (any shape, numel divisible by ``block_size``) on ``table`` (ascending fp32 values
    in [-1, 1], at most 256, holding 1 or -1): each block is divided by its absmax (its scale) and each scaled value
    becomes the uint8 index of the nearest table entry. ``codes`` is shaped like ``values``, ``scales`` fp32 of one
    absmax per block. Ties round up; an all-zero block gets scale 0 (it decodes to zeros)."""
    blocks = values.detach().float().reshape(-1, block_size)
    scales = blocks.abs().amax(dim=1)
    scaled = blocks / scales.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    midpoints = (table[:-1] + table[1:]) / 2.0
    # The count of midpoints <= value: the index of the nearest entry.
    codes = torch.bucketize(scaled, midpoints, out_int32=True, right=True)
    return codes.to(CODES_DTYPE).reshape(values.shape), scales


def dequantize_from(codes: Tensor, scales: Tensor, table: Tensor) -> Tensor:
    """The fp32 values ``codes`` and ``scales`` stand for on ``table`` (shaped like ``codes``; block size from their
    ratio)."""
    blocks = table[codes.reshape(scales.numel(), -1).long()] * scales.unsqueeze(1)
    return blocks.reshape(codes.shape)
