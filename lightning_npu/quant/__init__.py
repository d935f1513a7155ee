"""Frozen weights stored quantized, for LoRA on a quantized base (QLoRA-style): the int8 / NF4 quantizers
(``weights``), and ``QuantizedLinear``, the frozen layer that holds the codes and decodes them per matmul (``linear``;
the matmul itself is the kernel ``lightning_npu.kernels.quantized_linear``). Layouts and bytes:
``lightning_npu.facts.weight_quant``."""

from lightning_npu.quant.linear import QuantizedLinear, quantized_state
from lightning_npu.quant.weights import dequantize, nf4_values, quantize

__all__ = ["QuantizedLinear", "dequantize", "nf4_values", "quantize", "quantized_state"]
