"""How a pre-norm decoder built on ``lightning_npu.kernels`` spends memory: its parameter layout and the tensors
its forward saves for backward, per token.

The block is RMSNorm -> wq/wk/wv -> rotary -> causal attention (grouped-query) -> wo -> residual -> RMSNorm ->
w_gate_up (gate and up fused in one matrix) -> SwiGLU -> w_down -> residual; the root unit is the token embedding,
the final RMSNorm and an untied output projection, and the model returns fp32 logits. That is LLaMA's layout (and
that of the decoders copied from it); a model that differs subclasses ``DecoderProfile`` and overrides what
differs (see ``lightning_npu.plan.profile``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from lightning_npu.plan.spec import ModelShape

Shape = tuple[int, ...]

FP32_BYTES = 4
#: npu_fusion_attention keeps its softmax max and sum for backward, 8 fp32 values per query row and head each.
SOFTMAX_STATS = 2
SOFTMAX_STAT_LANES = 8
#: The rotary cos and sin tables are kept in fp32, plus half-precision copies (half the size) under bf16/fp16.
ROTARY_TABLES = 2
HALF_PRECISION_COPY = 0.5


@dataclass(frozen=True)
class BlockParameters:
    """Parameter shapes of one block, grouped in the order backward produces their gradients: ``mlp_output``
    first (w_down), then the rest of the MLP (``mlp_input``: ffn_norm, w_gate_up), then ``attention``
    (attention_norm, wq, wk, wv, wo)."""

    attention: tuple[Shape, ...]
    mlp_input: tuple[Shape, ...]
    mlp_output: Shape

    @property
    def shapes(self) -> list[Shape]:
        """All of them, in module order."""
        return [*self.attention, *self.mlp_input, self.mlp_output]


@dataclass(frozen=True)
class RootParameters:
    """Parameters outside the blocks: token embeddings, final norm, output projection."""

    embedding: Shape
    final_norm: Shape
    output: Shape

    @property
    def shapes(self) -> list[Shape]:
        return [self.embedding, self.final_norm, self.output]


@dataclass(frozen=True)
class BlockActivations:
    """Bytes per token one block's forward leaves saved for its backward, by tensor, split where backward frees
    them: the MLP half's are released once the MLP's backward is done, the attention half's at the block's end."""

    attention: dict[str, float]
    mlp: dict[str, float]

    @property
    def all(self) -> dict[str, float]:
        return {**self.attention, **self.mlp}


@dataclass(frozen=True)
class DecoderProfile:
    """The memory profile of a decoder of shape ``shape`` (see the module docstring for its layout).

    ``name`` heads the plan (``"LLaMA 7b"``); ``block_class`` is the block's class name as a config's FSDP
    policies name it (``"TransformerBlock"``), ``None`` when the model comes from shapes alone.
    """

    shape: ModelShape
    name: str = "decoder"
    block_class: Optional[str] = None

    # ------------------------------------------------------------------------------------------- parameters

    def block_parameters(self) -> BlockParameters:
        m = self.shape
        q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        return BlockParameters(
            attention=((m.dim,), (q, m.dim), (kv, m.dim), (kv, m.dim), (m.dim, q)),
            mlp_input=((m.dim,), (2 * m.ffn_hidden_dim, m.dim)),
            mlp_output=(m.dim, m.ffn_hidden_dim),
        )

    def root_parameters(self) -> RootParameters:
        m = self.shape
        return RootParameters(embedding=(m.vocab_size, m.dim), final_norm=(m.dim,), output=(m.vocab_size, m.dim))

    def num_params(self) -> int:
        block = sum(math.prod(shape) for shape in self.block_parameters().shapes)
        return sum(math.prod(shape) for shape in self.root_parameters().shapes) + self.shape.n_layers * block

    # ------------------------------------------------------------------------------------------ activations

    def block_activations(self, kernels: str, act_bytes: int, seq_len: int) -> dict[str, float]:
        """Bytes per token that one block's forward leaves saved for its backward (see ``saved_by_block``)."""
        return self.saved_by_block(kernels, act_bytes, seq_len).all

    def saved_by_block(self, kernels: str, act_bytes: int, seq_len: int) -> BlockActivations:
        """Each entry is a tensor autograd (or a fused kernel's backward) keeps, from the block's code.

        ``reference``: the PyTorch paths of lightning_npu.kernels; RMSNorm upcasts its input and keeps the fp32
        copy and the fp32 normalised tensor; rotary keeps nothing but the tables (its multiplicands need no
        gradient); grouped-query keys/values are expanded to all heads before SDPA, which keeps q, k, v, its output
        and an fp32 log-sum-exp per head (no S x S matrix). ``fused``: npu_rms_norm keeps its input and an fp32
        rstd, npu_rotary_mul its input, npu_fusion_attention q, k, v (at kv heads), its output and softmax max/sum
        (8 fp32 per head each), npu_swiglu its input. ``eager``: as reference, but attention keeps scaled fp32 q, k,
        v and the fp32 [heads, seq, seq] probabilities.
        """
        m, a = self.shape, act_bytes
        d, f, n = m.dim, m.ffn_hidden_dim, m.n_heads
        kv = m.n_kv_heads * m.head_dim
        if kernels == "fused":
            norm = a * d + FP32_BYTES
            attention = {
                "attention_norm input + rstd": norm,
                "wq/wk/wv input": a * d,
                "rotary inputs (q, k)": a * (d + kv),
                "attention q, k, v": a * (d + 2 * kv),
                "attention softmax max + sum": SOFTMAX_STATS * SOFTMAX_STAT_LANES * FP32_BYTES * n,
                "attention output (wo input)": a * d,
            }
            mlp = {
                "ffn_norm input + rstd": norm,
                "w_gate_up input": a * d,
                "swiglu input (gate, up)": 2 * a * f,
                "swiglu output (w_down input)": a * f,
            }
            return BlockActivations(attention, mlp)
        norm = _upcast_rms_norm_saved(d)
        attention = {"attention_norm (fp32 input, rstd, normalised)": norm, "wq/wk/wv input": a * d}
        if kernels == "reference":
            attention["attention q, k, v (kv expanded to all heads)"] = 3 * a * d
            attention["attention log-sum-exp"] = FP32_BYTES * n
        else:
            attention["attention scaled q, k and v (fp32)"] = 3 * FP32_BYTES * d
            attention["attention probabilities (fp32, S x S)"] = FP32_BYTES * n * seq_len
        attention["attention output (wo input)"] = a * d
        mlp = {
            "ffn_norm (fp32 input, rstd, normalised)": norm,
            "w_gate_up input": a * d,
            "gate/up projection": 2 * a * f,
            "silu(gate)": a * f,
            "swiglu output (w_down input)": a * f,
        }
        return BlockActivations(attention, mlp)

    def saved_by_final_norm(self, kernels: str, act_bytes: int) -> float:
        """Bytes per token saved by the final RMSNorm and the output projection's input."""
        d = self.shape.dim
        norm = act_bytes * d + FP32_BYTES if kernels == "fused" else _upcast_rms_norm_saved(d)
        return norm + act_bytes * d

    def forward_scratch(self, kernels: str, act_bytes: int, seq_len: int, checkpointed: bool) -> float:
        """Bytes per token of short-lived tensors inside one block's forward beyond what it saves."""
        m = self.shape
        # The block output; the reference RMSNorm's fp32 square.
        scratch = act_bytes * m.dim + (0 if kernels == "fused" else FP32_BYTES * m.dim)
        if kernels == "eager":
            scratch += FP32_BYTES * m.n_heads * seq_len  # the scores before softmax
        if checkpointed:  # nothing is kept, but the MLP's gate/up (2 x ffn), silu and product exist together
            scratch += 4 * act_bytes * m.ffn_hidden_dim
        return scratch

    def backward_scratch(self, kernels: str, act_bytes: int, seq_len: int) -> tuple[float, float]:
        """Bytes per token of gradient temporaries alive together inside one block's backward, beyond its saved
        tensors: (MLP half, attention half). In the MLP the gradient of the SwiGLU output and those of its two
        inputs coexist while the saved output is already released (2 x ffn); in attention the q, k and v gradients
        (plus, for eager attention, the fp32 gradients of the probabilities and scores)."""
        m, a = self.shape, act_bytes
        kv = m.n_kv_heads * m.head_dim if kernels == "fused" else m.dim  # reference paths expand kv to all heads
        attention = a * (m.dim + 2 * kv)
        if kernels == "eager":
            attention += 2 * FP32_BYTES * m.n_heads * seq_len
        return 2 * a * m.ffn_hidden_dim, attention

    def rotary_table_bytes(self, act_bytes: int) -> float:
        """The rotary cos/sin tables (fp32, plus half-precision copies when activations are half precision)."""
        m = self.shape
        copies = 1.0 + (HALF_PRECISION_COPY if act_bytes < FP32_BYTES else 0.0)
        return ROTARY_TABLES * m.max_seq_len * m.head_dim * FP32_BYTES * copies


def _upcast_rms_norm_saved(dim: int) -> float:
    """The reference RMSNorm keeps its fp32 input copy, the fp32 rstd and the fp32 normalised tensor."""
    return FP32_BYTES * dim + FP32_BYTES + FP32_BYTES * dim
