"""The precision settings NPU runs accept, Lightning's older spellings of them, and the dtypes each one means.

Names follow Lightning 2.x (``lightning/fabric/plugins/precision/precision.py``: ``_PRECISION_INPUT_STR`` and
``_PRECISION_INPUT_STR_ALIAS_CONVERSION``); the NPU plugins, the launcher and the planner all read them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PrecisionDtypes:
    """The torch dtype names one setting uses: ``master`` for the parameters the optimizer updates (and their
    gradients and states), ``compute`` for the working copy and activations, ``reduce`` for gradient reduction."""

    master: str
    compute: str
    reduce: str

    @property
    def mixed(self) -> bool:
        """Whether parameters are cast for compute (autocast / FSDP2's param_dtype) rather than stored so."""
        return self.master != self.compute


#: Every precision an NPU run accepts (canonical names), with its dtypes.
PRECISION_DTYPES = {
    "32-true": PrecisionDtypes("float32", "float32", "float32"),
    "bf16-mixed": PrecisionDtypes("float32", "bfloat16", "float32"),
    "bf16-true": PrecisionDtypes("bfloat16", "bfloat16", "bfloat16"),
    "16-mixed": PrecisionDtypes("float32", "float16", "float32"),
    "16-true": PrecisionDtypes("float16", "float16", "float16"),
}
PRECISIONS = tuple(PRECISION_DTYPES)
#: Lightning's historical spellings (ints from Python or YAML included) and the canonical name each stands for.
ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
#: Lightning precisions NPUs cannot run, and why.
UNSUPPORTED = {
    "64-true": "HCCL cannot reduce float64 tensors",
    "transformer-engine": "transformer-engine fp8 kernels exist only for NVIDIA GPUs; Ascend 910B/910_93 chips have no fp8 units",
    "transformer-engine-float16": "transformer-engine fp8 kernels exist only for NVIDIA GPUs",
}


#: Why no precision computes in int8 (``"int8"``, ``"int8-mixed"``, ``"int8-true"``, ...), and what saves memory
#: instead.
INT8_COMPUTE = (
    "torch_npu's int8 matmuls (npu_quant_matmul, npu_weight_quant_batchmatmul) are documented for inference and have"
    " no backward, so int8 compute cannot train. To save memory in training keep a bf16/fp16 precision and store the"
    " optimizer's moments in 8 bits (lightning_npu.optim.AdamW8bit; the LLaMA recipe: --model.optimizer adamw8bit),"
    " or, for LoRA, quantize the frozen base (lightning_npu.quant; the LLaMA recipe:"
    " --model.lora.base_quantization int8 or nf4)"
)


def is_int8_compute(text: str) -> bool:
    """Whether a precision setting asks for int8 compute (any spelling starting ``int8``, e.g. ``int8-mixed``)."""
    return text.strip().lower().startswith("int8")


def canonical_precision(value: Any) -> str:
    """The canonical name (one of ``PRECISIONS``) of a precision setting such as ``"bf16"``, ``16`` or
    ``"bf16-mixed"``; ValueError naming the value, why it cannot run, and the choices otherwise."""
    text = str(value)
    text = ALIASES.get(text, text)
    if text in PRECISION_DTYPES:
        return text
    if is_int8_compute(text):
        raise ValueError(f"precision={value!r} is not supported on NPUs: {INT8_COMPUTE}.")
    if text in UNSUPPORTED:
        raise ValueError(
            f"precision={value!r} is not supported on NPUs: {UNSUPPORTED[text]}."
            f" Use one of {', '.join(repr(p) for p in PRECISIONS)} (usually 'bf16-mixed')."
        )
    raise ValueError(f"precision={value!r} is not supported on NPUs; use one of {', '.join(PRECISIONS)}")


def precision_dtypes(value: Any) -> PrecisionDtypes:
    """The dtypes of a precision setting (any spelling ``canonical_precision`` accepts)."""
    return PRECISION_DTYPES[canonical_precision(value)]


def uses_bf16(value: Any) -> bool:
    """Whether a precision setting needs bf16 units on the chip."""
    return "bfloat16" in (precision_dtypes(value).master, precision_dtypes(value).compute)
