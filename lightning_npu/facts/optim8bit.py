"""Which tensors ``lightning_npu.optim.AdamW8bit`` keeps 8-bit and what its state costs, from shapes alone: the
optimizer decides with ``quantizes`` and the planner counts bytes with ``state_bytes``, so they cannot disagree.

A tensor's moments are 8-bit when it has at least ``MIN_QUANTIZED_NUMEL`` elements (norm gains and biases save little
and are left fp32), its numel is a multiple of the block size, and, sharded on dim 0 over ``shards`` ranks as
DTensor's ``Shard(0)`` splits it (torch.chunk: ceil(rows / shards) rows per rank, the last ones fewer or none), every
rank's shard holds whole blocks, exactly as many as a ``Shard(0)`` split of the per-block scales gives that rank.
Then the blocks are the row-major blocks of the whole tensor however it is sharded, which is what lets the codes and
scales reshard as plain DTensor shards.
"""

from __future__ import annotations

import functools
import math

#: Elements per fp32 scale by default: 2 x 1 byte + 2 x 4 / 256 bytes = 2.03 bytes of state per element.
DEFAULT_BLOCK_SIZE = 256
#: Smaller tensors keep fp32 moments.
MIN_QUANTIZED_NUMEL = 4096
CODE_BYTES, SCALE_BYTES = 1, 4
#: AdamW's two moments.
MOMENTS = 2


def _chunk(size: int, shards: int, rank: int) -> int:
    step = -(-size // shards)
    return max(0, min(step, size - rank * step))


@functools.lru_cache(maxsize=None)
def quantizes(shape: tuple[int, ...], shards: int = 1, block_size: int = DEFAULT_BLOCK_SIZE) -> bool:
    """Whether a tensor of ``shape``, sharded on dim 0 over ``shards`` ranks (1: not sharded), has 8-bit moments.
    Cached: a planner replay asks it for every tensor of every block, and a model repeats a few shapes (the check
    walks every rank's chunk, which for a 671B MoE took most of a plan)."""
    numel = math.prod(shape)
    if numel < MIN_QUANTIZED_NUMEL or numel % block_size:
        return False
    rows, blocks = shape[0], numel // block_size
    row_numel = numel // rows
    return all(_chunk(rows, shards, r) * row_numel == _chunk(blocks, shards, r) * block_size for r in range(shards))


def state_bytes(local_numel: int, quantized: bool, fp32_bytes: int = 4, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Bytes of AdamW8bit state for a local shard of ``local_numel`` elements: codes plus one fp32 scale per block
    for each moment if ``quantized``, else two moments of ``fp32_bytes`` (the parameter's dtype) per element."""
    if quantized:
        return MOMENTS * local_numel * (CODE_BYTES + SCALE_BYTES / block_size)
    return MOMENTS * local_numel * fp32_bytes
