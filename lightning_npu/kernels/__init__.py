"""Fused kernels for LLaMA-style models: torch_npu kernels on NPU tensors, exact PyTorch paths elsewhere.

Every function takes BSND tensors ([batch, seq, heads, head_dim]) where it takes attention heads, picks
its path from the input tensor's device, and logs once whenever an NPU input has to use the reference path.
"""

from lightning_npu.kernels.attention import causal_attention
from lightning_npu.kernels.rms_norm import rms_norm
from lightning_npu.kernels.rotary import apply_rotary, rotary_tables
from lightning_npu.kernels.swiglu import swiglu

__all__ = ["apply_rotary", "causal_attention", "rms_norm", "rotary_tables", "swiglu"]
