"""Optimizers NPU training needs that torch lacks: ``AdamW8bit`` (8-bit moments, eager ops, FSDP2 shards,
DCP-friendly state; ``adamw8bit``), on the block quantizer in ``lightning_npu.quant.blockwise``."""

from lightning_npu.optim.adamw8bit import AdamW8bit

__all__ = ["AdamW8bit"]
