"""Blockwise dynamic 8-bit quantization of optimizer moments (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", arXiv 2110.02861): a tensor is cut into blocks of ``block_size`` consecutive elements (row-major), each
block is divided by its absolute maximum (its fp32 *scale*), and every scaled value is stored as the uint8 index of
the nearest entry of a 256-entry *dynamic map*.

The dynamic map (Dettmers, arXiv 1511.04561) spends its codes logarithmically: values in [10^-k, 10^-(k-1)) get a
linear grid whose size doubles with each decade toward 1, so small moments keep their relative precision. The
signed map (for ``exp_avg``) holds both signs, the unsigned one (for ``exp_avg_sq``, never negative) spends the sign
bit on one more fraction bit. Both maps hold 0 and 1; the signed one's most negative entry is -0.993 (as published,
and as torchao's and bitsandbytes' maps), so a block whose absmax is negative loses up to 0.7% of it.

The same block quantizer serves any table of at most 256 values (a ``Codebook``; ``quantize_to`` /
``dequantize_from``): the frozen LoRA base's NF4 codes (``lightning_npu.quant.weights``) are its 16-entry table on
blocks of 64.

Finding the nearest entry is ``torch.bucketize`` on the midpoints between entries, computed without its binary search:
a value's top 16 bits (sign, exponent, 7 mantissa bits) pick one of 65536 ranges, a table built once per codebook
holds the count of midpoints below each range, and one compare per midpoint a range can hold (one, for both maps and
NF4) finishes the count. The result is bucketize's, bit for bit, for every fp32 value but -inf (which a block
divided by its absmax never holds), in chunks that stay in cache: on one CPU core, 4M values take 13.5 ms against
bucketize's 163 ms.

Everything is plain eager torch (no torch.compile, no custom kernels), so it runs on every NPU and on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

CODES_DTYPE = torch.uint8
SCALES_DTYPE = torch.float32
#: Decades the map covers below 1 (its smallest nonzero magnitude is about 10^-DECADES).
DECADES = 7
#: Elements encoded at a time: bounds the encoder's temporaries (a few bytes each) whatever the tensor's size.
ENCODE_CHUNK = 1 << 20
#: Ranges of fp32 values that share their top 16 bits, and the shift that finds a value's range.
RANGES, RANGE_SHIFT = 1 << 16, 16


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


@dataclass(frozen=True, eq=False)
class Codebook:
    """At most 256 ascending fp32 ``values`` on one device, and what ``encode`` needs to find each value's nearest
    entry: ``bounds`` (the midpoints between neighbours, then NaN, which no value reaches), ``first`` (int32, for each
    range of values sharing their top 16 bits, the count of midpoints at or below its smallest value) and ``steps``
    (the most midpoints inside one finite range). Build one with ``codebook``."""

    values: Tensor
    bounds: Tensor
    first: Tensor
    steps: int

    def encode(self, x: Tensor) -> Tensor:
        """uint8 index of the nearest entry for each element of fp32 ``x`` (shaped like ``x``; ties round up):
        ``torch.bucketize(x, midpoints, right=True)`` for every value but -inf; NaN gets the last index."""
        flat = x.contiguous().reshape(-1)
        codes = torch.empty(flat.shape, dtype=CODES_DTYPE, device=x.device)
        for start in range(0, flat.numel(), ENCODE_CHUNK):
            part = flat[start:start + ENCODE_CHUNK]
            ranges = (part.view(torch.int32) >> RANGE_SHIFT).bitwise_and_(RANGES - 1)
            index = torch.index_select(self.first, 0, ranges)
            for _ in range(self.steps):
                index += part >= torch.index_select(self.bounds, 0, index)
            codes[start:start + ENCODE_CHUNK] = index
        return codes.reshape(x.shape)


@functools.lru_cache(maxsize=None)
def codebook(values: tuple[float, ...], device: torch.device) -> Codebook:
    """The ``Codebook`` of ``values`` (ascending, at most 256) on ``device``, built once per pair."""
    if not 1 <= len(values) <= 256 or list(values) != sorted(values):
        raise ValueError(f"a codebook holds 1 to 256 ascending values, got {len(values)}: {values[:8]}...")
    table = torch.tensor(values, dtype=torch.float32)
    midpoints = (table[:-1] + table[1:]) / 2.0
    # Each range's smallest and largest value: for a negative sign bit the order of the low 16 bits is reversed.
    keys = torch.arange(RANGES, dtype=torch.int64)
    low = RANGES - 1
    negative = keys >= RANGES // 2
    smallest = _fp32_of_bits((keys << RANGE_SHIFT) | torch.where(negative, low, 0))
    largest = _fp32_of_bits((keys << RANGE_SHIFT) | torch.where(negative, 0, low))
    first = torch.bucketize(smallest, midpoints, out_int32=True, right=True)
    finite = torch.isfinite(smallest) & torch.isfinite(largest)
    inside = torch.bucketize(largest, midpoints, out_int32=True, right=True) - first
    return Codebook(values=table.to(device), bounds=torch.cat([midpoints, torch.tensor([float("nan")])]).to(device),
                    first=first.to(device), steps=int(inside[finite].max()))


@functools.lru_cache(maxsize=None)
def _dynamic_codebook(signed: bool, device: torch.device) -> Codebook:
    """The dynamic map's ``Codebook`` on ``device``, found without hashing its 256 values on every call."""
    return codebook(dynamic_map(signed), device)


def _fp32_of_bits(bits: Tensor) -> Tensor:
    """The fp32 values whose bit patterns are ``bits`` (int64 holding unsigned 32-bit patterns)."""
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def quantize(values: Tensor, block_size: int, signed: bool) -> tuple[Tensor, Tensor]:
    """(codes, scales) of ``values`` (any shape, numel divisible by ``block_size``) on the dynamic map: ``codes``
    uint8 shaped like ``values``, ``scales`` fp32 of one absmax per block (see ``quantize_to``)."""
    return quantize_to(values, block_size, _dynamic_codebook(signed, values.device))


def dequantize(codes: Tensor, scales: Tensor, signed: bool) -> Tensor:
    """The fp32 values ``codes`` and ``scales`` stand for on the dynamic map (shaped like ``codes``)."""
    return dequantize_from(codes, scales, _dynamic_codebook(signed, codes.device))


def quantize_to(values: Tensor, block_size: int, book: Codebook) -> tuple[Tensor, Tensor]:
    """(codes, scales) of ``values`` (any shape, numel divisible by ``block_size``) on ``book`` (values in [-1, 1],
    holding 1 or -1): each block is divided by its absmax (its scale) and each scaled value
    becomes the uint8 index of the nearest table entry. ``codes`` is shaped like ``values``, ``scales`` fp32 of one
    absmax per block. Ties round up; an all-zero block gets scale 0 (it decodes to zeros)."""
    blocks = values.detach().float().reshape(-1, block_size)
    scales = blocks.abs().amax(dim=1)
    scaled = blocks / scales.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    return book.encode(scaled).reshape(values.shape), scales


def dequantize_from(codes: Tensor, scales: Tensor, book: Codebook) -> Tensor:
    """The fp32 values ``codes`` and ``scales`` stand for on ``book`` (shaped like ``codes``; block size from their
    ratio)."""
    blocks = book.values[codes.reshape(scales.numel(), -1).long()] * scales.unsqueeze(1)
    return blocks.reshape(codes.shape)
