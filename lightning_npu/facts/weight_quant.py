"""How a frozen weight is stored quantized (``lightning_npu.quant``), from shapes alone: the quantizer, the modules and
the planner read the layouts and bytes here, so they cannot disagree.

- ``int8``: symmetric per output channel. Codes int8 shaped like the weight [out, in]; one fp32 scale per row
  (absmax / 127), so a row decodes as ``code * scale``. That is the layout torch_npu's ``npu_weight_quant_batchmatmul``
  takes (per-channel ``antiquant_scale`` of shape (N,)), about 1 byte per weight.
- ``nf4``: QLoRA's 4-bit NormalFloat (Dettmers et al., arXiv 2305.14314) on blocks of ``NF4_BLOCK_SIZE`` consecutive
  elements in row-major order, each with an fp32 absmax scale. Two codes per byte (the even column in the low
  nibble): codes uint8 [out, in / 2], scales fp32 [out * in / 64]; 0.5 + 4 / 64 = 0.5625 bytes per weight.

Under FSDP2 the codes and scales are parameters (frozen) sharded on dim 0 like any other: the codes are gathered as
they are (FSDP2's mixed precision leaves integer parameters alone), the scales in the working dtype (bf16 under
``bf16-mixed``). Torch-free (the planner imports it).
"""

from __future__ import annotations

import math
from typing import Any, Optional

SCHEMES = ("int8", "nf4")
NF4_BLOCK_SIZE = 64
INT8_MAX = 127
SCALE_BYTES = 4


def check_scheme(value: Any, setting: str) -> Optional[str]:
    """``value`` if it names a scheme (or None: no quantization); else ``ValueError`` naming ``setting``."""
    if value is None or value in SCHEMES:
        return value
    raise ValueError(f"{setting}={value!r} is not a base quantization: use one of {', '.join(SCHEMES)}, or null to"
                     " keep the frozen base in the model's dtype")


def unsupported_reason(shape: tuple[int, ...], scheme: str) -> Optional[str]:
    """Why a weight of ``shape`` cannot be stored in ``scheme``, or None."""
    if len(shape) != 2:
        return f"only 2-D Linear weights are quantized, not shape {tuple(shape)}"
    if scheme == "nf4" and (shape[1] % 2 or math.prod(shape) % NF4_BLOCK_SIZE):
        return (f"nf4 packs two codes per byte along a row and scales blocks of {NF4_BLOCK_SIZE} elements, so a weight"
                f" needs an even row length and a multiple of {NF4_BLOCK_SIZE} elements; {tuple(shape)} does not"
                " (use int8 for this model)")
    return None


def stored_shapes(shape: tuple[int, int], scheme: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(codes shape, scales shape) of a weight of ``shape`` [out, in] stored in ``scheme``."""
    rows, columns = shape
    if scheme == "int8":
        return (rows, columns), (rows,)
    return (rows, columns // 2), (rows * columns // NF4_BLOCK_SIZE,)


def sharded_bytes(shape: tuple[int, int], scheme: str, shards: int = 1, scale_bytes: float = SCALE_BYTES) -> float:
    """Bytes one rank holds of a weight of ``shape`` stored in ``scheme`` when FSDP2 shards its codes and its scales
    on dim 0 over ``shards`` ranks (each padded to a multiple of ``shards`` rows; 1: the whole weight). Codes take a
    byte per stored element, scales ``scale_bytes`` (4: the fp32 shards; the working dtype's size when gathered)."""
    codes, scales = stored_shapes(shape, scheme)
    return -(-codes[0] // shards) * codes[1] + -(-scales[0] // shards) * scale_bytes
