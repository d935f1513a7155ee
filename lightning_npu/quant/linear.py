"""``QuantizedLinear``: a frozen Linear layer whose weight is stored quantized (int8 or NF4,
``lightning_npu.facts.weight_quant``) and decoded per matmul (``lightning_npu.kernels.quantized_linear``).

Its weight is two frozen parameters, ``weight_codes`` and ``weight_scales``, so FSDP2 shards and all-gathers the
quantized tensors themselves (its mixed precision leaves the integer codes alone and gathers the scales in the working
dtype), state dicts hold them as plain tensors, and meta-device construction works as for any module
(``reset_parameters`` zeroes them: the real values come from a checkpoint, quantized with ``quantize``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lightning_npu.facts import weight_quant as layout
# The module, not its function: the kernel imports this package's quantizer (a cycle Python resolves for modules).
from lightning_npu.kernels import quantized_matmul
from lightning_npu.quant.weights import check_quantizable, dequantize, quantize

CODES_DTYPES = {"int8": torch.int8, "nf4": torch.uint8}
#: The state-dict suffixes of a quantized weight, in place of ``weight``.
CODES, SCALES = "weight_codes", "weight_scales"


class QuantizedLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with a frozen ``W`` [out_features, in_features] stored in ``scheme``."""

    def __init__(self, in_features: int, out_features: int, scheme: str, bias: bool = False,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        layout.check_scheme(scheme, "scheme")
        check_quantizable((out_features, in_features), scheme, f"a Linear({in_features}, {out_features})")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        codes, scales = layout.stored_shapes((out_features, in_features), scheme)
        self.weight_codes = nn.Parameter(torch.zeros(codes, dtype=CODES_DTYPES[scheme], device=device),
                                         requires_grad=False)
        self.weight_scales = nn.Parameter(torch.zeros(scales, dtype=torch.float32, device=device),
                                          requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False)
                     if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str) -> "QuantizedLinear":
        """The frozen, quantized copy of ``linear`` (on the meta device, if it is: values then come later)."""
        weight = linear.weight
        out = cls(linear.in_features, linear.out_features, scheme, bias=linear.bias is not None,
                  device=weight.device, dtype=weight.dtype)
        if not weight.is_meta:
            with torch.no_grad():
                codes, scales = quantize(weight, scheme)
                out.weight_codes.copy_(codes)
                out.weight_scales.copy_(scales)
                if linear.bias is not None:
                    out.bias.copy_(linear.bias)
        return out

    def reset_parameters(self) -> None:
        for param in self.parameters(recurse=False):
            nn.init.zeros_(param)

    def forward(self, x: Tensor) -> Tensor:
        return quantized_matmul.quantized_linear(x, self.weight_codes, self.weight_scales, self.scheme, self.bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight the codes stand for, [out_features, in_features] in ``dtype`` (the local one: gather it first
        under FSDP2)."""
        return dequantize(self.weight_codes, self.weight_scales, self.scheme, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme},"
                f" bias={self.bias is not None}")


def quantized_state(weight: Tensor, scheme: str) -> dict[str, Tensor]:
    """A weight's entries in a ``QuantizedLinear``'s state dict, by suffix (``weight_codes``, ``weight_scales``)."""
    codes, scales = quantize(weight, scheme)
    return {CODES: codes, SCALES: scales}
