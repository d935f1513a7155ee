"""The memory profile of the shared MoE layers (``recipes/decoder/moe.py``) for ``lightning-npu plan`` (the protocol:
``lightning_npu.plan.profile``), which the families with MoE layers build their profiles from (the MoE family's
``memory_profile.py``; DeepSeek's, with its attention).

Torch-free: the planner imports it to read a config. Attention, norms, the root unit and LoRA on attention are the
decoder ``lightning_npu.plan.decoder`` counts (with Qwen2-MoE's qkv biases and Qwen3-MoE's per-head q/k norms and
free head_dim); ``MoEProfile`` replaces the MLP half of each MoE layer by what ``MoEFeedForward`` holds:

- parameters: the router [E, dim], the stacked experts w_gate_up [E, 2F, dim] and w_down [E, dim, F] (two large
  tensors FSDP2 shards along the expert axis), the shared expert and its gate; dense layers (``dense_layers``,
  ``sparse_step``) are the decoder's SwiGLU block of ``dense_hidden_dim``;
- saved for backward, per token: the router's fp32 input (for its weight's gradient) and fp32 logits [E] (which
  the layer also keeps for the load-balancing loss), the softmax [E], the top-k ids and probabilities; the
  permuted rows, top_k per token, and the experts' SwiGLU output [k x F] (the grouped matmuls' inputs: torch's
  ``_grouped_mm`` keeps them for the experts' gradients only, the fused op's Function always), the gate/up
  [k x 2F] interiors, the rows the unpermute weights (fp32 on the reference path) and its indices; the shared
  expert's SwiGLU, its gate and output;
- the load-balancing loss (``router_aux_loss_coef`` > 0) keeps the softmax of every MoE layer's logits and their
  top-k ids until backward (counted with the final norm's tensors);
- under expert parallelism (``expert_parallel_size`` N) each rank holds E / N experts, gathered and given
  gradients as such, sharded over the ranks that hold the same experts as an FSDP unit of their own (npu_fsdp's
  ``shard_experts``); every all-to-all holds a send and a receive buffer of T x k rows, and the expert group and
  FSDP's group over the experts' mesh are HCCL communicators of their own;
- LoRA on the experts (``expert_gate``, ``expert_up``, ``expert_down``): per-expert adapters stacked like the
  experts' weights, what their grouped matmuls keep (the rank-r intermediate, the input A reads or its dropped-out
  copy and mask), and the gradients that then flow through the frozen experts;
- under tensor parallelism (tp), as the parallel core's design for MoE splits a layer (issue 33; npu_fsdp refuses
  it until that lands): the router replicated and fed the tokens gathered over the tp group, the shared expert split
  like a dense MLP, the routed experts whole, each tp rank running a 1/tp share of the routed rows (its own tensor:
  the all-to-all's output under expert parallelism) and all-gathering the rows' outputs; the experts on a mesh of
  dp_shard x cp x tp ranks, expert parallelism borrowing its ranks there.

A layer's logits live until the next forward in the model, the replay frees them at the layer's backward; at
T x E x 4 bytes a layer that is well under the tolerance (tiny configs: 4 KiB; Qwen3-30B-A3B at 4096 tokens: 2 MiB).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_npu.plan import DecoderProfile, PlanError, RankLocalShape
from lightning_npu.plan.decoder import (
    ATTENTION_PROJECTIONS,
    EXPERT_PROJECTIONS,
    FP32_BYTES,
    FUSED_DROPOUT_MASK_BYTES,
    INT64_BYTES,
    BlockParameters,
    Shape,
)
#: Bytes of the fused permute's int32 index (torch.topk's ids and the reference permutation are int64).
INT32_BYTES = 4


@dataclass(frozen=True)
class MoEProfile(DecoderProfile):
    """An MoE decoder: the MLP of every layer outside ``dense_layers`` routes each token to ``top_k`` of
    ``n_experts`` SwiGLU experts of ``expert_hidden_dim`` (softmax, top-k, renormalised with ``norm_topk_prob``),
    plus a shared expert of ``shared_expert_hidden_dim`` (0: none); the shape's ``ffn_hidden_dim`` is the dense
    layers' width. ``shared_expert_gate``: the shared expert's output is scaled by a sigmoid gate (Qwen2-MoE;
    DeepSeek's shared experts have none). ``router_aux_loss_coef`` > 0: the load-balancing loss is trained.
    ``expert_parallel_size``: ranks the experts of a layer are split over. (The choice of experts, group-limited
    or biased, keeps nothing for backward: only its ids reach the gradient, through the gather of the scores.)"""

    n_experts: int = 1
    top_k: int = 1
    expert_hidden_dim: int = 1
    shared_expert_hidden_dim: int = 0
    shared_expert_gate: bool = True
    dense_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        size = self.expert_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or self.n_experts % size:
            raise PlanError(
                f"expert_parallel_size={size!r} must be a positive integer that divides n_experts={self.n_experts}"
                " (each rank holds n_experts / expert_parallel_size experts)"
            )
        sites = ATTENTION_PROJECTIONS + EXPERT_PROJECTIONS
        mlp = [p for p in (self.adapters.projections if self.adapters else ()) if p not in sites]
        if mlp:
            raise PlanError(
                f"lora.targets {list(mlp)}: the MoE family adapts attention (q, k, v, o) and, expert by expert, the"
                " stacked experts (expert_gate, expert_up, expert_down); it has no gate, up or down Linear to adapt"
            )

    @property
    def moe_layers(self) -> int:
        return self.shape.n_layers - len(self.dense_layers)

    def block_profile(self, layer: int) -> DecoderProfile:
        """A dense layer is the decoder's SwiGLU block (of the shape's ``ffn_hidden_dim``); an MoE layer this."""
        if layer in self.dense_layers:
            return DenseLayerProfile(self.shape, self.name, self.block_class, self.adapters, qkv_bias=self.qkv_bias,
                                     qk_norm=self.qk_norm, parallel=self.parallel)
        return self

    def quantized_groups(self) -> tuple[str, ...]:
        """A quantized LoRA base (``lora.base_quantization``) stores the family's LoRA sites quantized, attention's
        four projections: not the router, the stacked experts, the shared expert or its gate."""
        return ATTENTION_QUANTIZED

    def with_expert_parallelism(self, size: int) -> "MoEProfile":
        return replace(self, expert_parallel_size=size)

    # ------------------------------------------------------------------------------------------- parameters

    def mlp_parameters(self) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
        """ffn_norm, the router, the local experts' w_gate_up, the shared expert's w_gate, w_up and gate; then the
        experts' and the shared expert's w_down."""
        d, f = self.shape.dim, self.expert_hidden_dim
        shared = self.shared_expert_hidden_dim // self.parallel.tensor  # split like a dense MLP
        mlp_input: tuple[Shape, ...] = ((d,), (self.n_experts, d), self.experts_shape(2 * f, d))
        mlp_output: tuple[Shape, ...] = (self.experts_shape(d, f),)
        if shared:
            mlp_input += ((shared, d), (shared, d), (1, d))
            mlp_output += ((d, shared),)
        return mlp_input, mlp_output

    def adapter_parameters(self) -> BlockParameters:
        """Attention's adapters (the decoder's), and the experts' (``expert_gate``, ``expert_up``, ``expert_down``):
        per expert A [rank, in] and B [rows, rank], stacked on dim 0 as the experts' weights (the recipe's
        ``StackedLoRA``), in the experts module (its FSDP unit under expert parallelism); gate and up with the MLP's
        input group, down with its output."""
        base = super().adapter_parameters()
        if self.adapters is None:
            return base
        r, d, f = self.adapters.rank, self.shape.dim, self.expert_hidden_dim
        sides = {"expert_gate": (d, f), "expert_up": (d, f), "expert_down": (f, d)}
        mlp_input, mlp_output = list(base.mlp_input), list(base.mlp_output)
        for name in self._adapted(EXPERT_PROJECTIONS):
            columns, rows = sides[name]
            group = mlp_output if name == "expert_down" else mlp_input
            group += [self.experts_shape(r, columns), self.experts_shape(rows, r)]
        return BlockParameters(attention=base.attention, mlp_input=tuple(mlp_input), mlp_output=tuple(mlp_output))

    def experts_shape(self, rows: int, columns: int) -> Shape:
        """A stacked [experts, rows, columns] parameter of the experts module (a weight or an adapter) as one rank
        holds it: all the experts, in the block's FSDP unit; under expert or tensor parallelism its E / N experts
        (unsplit by tensor parallelism), on the experts' own mesh (``RankLocalShape``: npu_fsdp shards the experts
        module as a unit of its own over the ranks that hold the same experts, dp_shard x cp x tp / N)."""
        ep, tp = self.expert_parallel_size, self.parallel.tensor
        shape = (self.n_experts // ep, rows, columns)
        return RankLocalShape(shape, ep, tp) if ep > 1 or tp > 1 else shape

    def tensor_parallel_sizes(self) -> list[tuple[str, int]]:
        """Attention's and the vocabulary's, the dense layers' width and the shared expert's (split like a dense
        MLP); not the routed experts' (each tensor-parallel rank runs whole experts on a share of the rows)."""
        m = self.shape
        sizes = [("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads), ("vocab_size", m.vocab_size)]
        if self.dense_layers:
            sizes.append(("dense_hidden_dim", m.ffn_hidden_dim))
        if self.shared_expert_hidden_dim:
            sizes.append(("shared_expert_hidden_dim", self.shared_expert_hidden_dim))
        return sizes

    def unsplit_parts(self) -> list[str]:
        """None: under tensor parallelism an MoE layer routes the tokens gathered over the tensor-parallel group on
        every rank (router replicated), splits the shared expert like a dense MLP, runs each rank's 1/tp share of
        the routed rows on whole experts (expert parallelism borrowing its ranks from dp_shard x cp x tp) and
        all-gathers the rows' outputs over the group (the parallel core's design for MoE, issue 33)."""
        return []

    @property
    def routed_share(self) -> int:
        """How many ranks split the routed rows of a rank's tokens: the tensor-parallel ranks (1 without)."""
        return self.parallel.tensor

    # ------------------------------------------------------------------------------------------ activations

    def mlp_saved(self, kernels: str, a: int, residual_grad: bool) -> dict[str, float]:
        """What ``MoEFeedForward`` keeps per token (see the module docstring): nothing when its input needs no
        gradient, its weights do not train and no adapter sits on its experts. A frozen router keeps its softmax
        and the top-k's ids and probabilities only when its input needs a gradient (the layer keeps its logits
        anyway); the experts' adapters keep what ``_expert_adapters_saved`` says, and the grouped matmuls and
        the SwiGLU between them what the gradients that flow through them need."""
        trains = self.adapters is None
        expert_adapters = self._adapted(EXPERT_PROJECTIONS)
        if not (residual_grad or trains or expert_adapters):
            return {}
        d, k, experts, tp = self.shape.dim, self.top_k, self.n_experts, self.routed_share
        shared = self.shared_expert_hidden_dim // self.parallel.tensor
        fused = kernels == "fused"
        dropout = self.adapters is not None and self.adapters.dropout
        probs_grad = residual_grad or trains  # the router's logits need a gradient
        # The routed rows' values reach the experts' (or gate/up adapters') weight gradients; their gradient flows
        # back through the permute when the tokens need one.
        gate_up_grad = residual_grad or trains or bool({"expert_gate", "expert_up"}.intersection(expert_adapters))
        saved: dict[str, float] = {}
        if residual_grad:
            saved.update(self._between_blocks_norm("ffn_norm", kernels, a, trains))
        # Under tensor parallelism the router sees the tokens gathered over the group (the MLP's input, as a dense
        # MLP's), and the indices and the unpermute cover every routed row; the experts run a 1/tp share of them.
        if trains:  # the router's fp32 copy of the tokens (the tokens themselves in fp32), the shared expert's input
            if a == FP32_BYTES:
                saved["router (and shared expert) input"] = a * d
            else:
                saved["router input (fp32 copy)"] = FP32_BYTES * d
                if shared:
                    saved["shared expert input"] = a * d
        if probs_grad:
            saved["router logits (fp32) + softmax"] = 2 * FP32_BYTES * experts
            saved["top-k expert ids (int64)"] = INT64_BYTES * k
            if self.norm_topk_prob:
                saved["top-k probabilities + their sum (fp32)"] = FP32_BYTES * (k + 1)
        else:
            saved["router logits (fp32, kept by the layer)"] = FP32_BYTES * experts
        if fused:
            saved["permute sorted_indices (int32)"] = INT32_BYTES * k
        else:  # the permute's gather index for the tokens' gradient, the unpermute's for the experts' output's
            saved["permute gather and unpermute indices (int64)"] = (1 + residual_grad) * INT64_BYTES * k
        # The grouped matmuls keep their inputs for the experts' gradients; the fused op's Function keeps them
        # whenever it records a graph. The gate/up and down adapters' A read the same inputs (undropped).
        keeps_rows = trains or (fused and residual_grad) or (
            bool({"expert_gate", "expert_up"}.intersection(expert_adapters)) and not dropout)
        if keeps_rows:
            saved["permuted rows (gate/up grouped matmul input)"] = a * k * d / tp
        keeps_down_input = trains or (fused and gate_up_grad) or ("expert_down" in expert_adapters and not dropout)
        saved.update(self._swiglu_saved("experts' ", kernels, a, k * self.expert_hidden_dim / tp, gate_up_grad,
                                        keeps_down_input))
        saved.update(self._expert_adapters_saved(kernels, a, residual_grad, gate_up_grad))
        if fused:
            saved["unpermute input rows + probs"] = a * k * (d + 1)
        else:  # the weighted sum keeps the fp32 probs for the rows' gradient, the fp32 rows for the probs'
            saved["unpermute probs (fp32)"] = FP32_BYTES * k
            if probs_grad:
                saved["unpermute gathered rows (fp32)"] = FP32_BYTES * k * d
        if shared and (residual_grad or trains):
            saved.update(self._swiglu_saved("shared expert ", kernels, a, shared, True, trains))
            if self.shared_expert_gate:
                saved["shared expert output + sigmoid gate"] = a * (d + 1)
        return saved

    def _expert_adapters_saved(self, kernels: str, a: int, rows_grad: bool, hidden_grad: bool) -> dict[str, float]:
        """What each expert adapter keeps per token (top_k rows of it): its B the rank-r intermediate; with dropout
        its A the dropped-out copy of its input (the routed rows, or the SwiGLU output for expert_down) and the
        dropout its mask when that input needs a gradient (``rows_grad``, ``hidden_grad``)."""
        saved: dict[str, float] = {}
        if self.adapters is None:
            return saved
        k, r = self.top_k, self.adapters.rank
        for name in self._adapted(EXPERT_PROJECTIONS):
            saved[f"{name} adapters' rank-{r} intermediate"] = a * k * r
            if self.adapters.dropout:
                width, input_grad = ((self.expert_hidden_dim, hidden_grad) if name == "expert_down"
                                     else (self.shape.dim, rows_grad))
                mask = (FUSED_DROPOUT_MASK_BYTES if kernels == "fused" else a) if input_grad else 0
                saved[f"{name} adapters' dropped-out input{' + mask' if mask else ''}"] = (a + mask) * k * width
        return saved

    def saved_by_final_norm(self, kernels: str, act_bytes: int) -> float:
        """The final norm's tensors, plus the load-balancing loss's: the softmax of every MoE layer's logits (fp32)
        and their top-k ids (int64)."""
        aux = self.moe_layers * (FP32_BYTES * self.n_experts + INT64_BYTES * self.top_k) if self.router_aux_loss_coef else 0
        return super().saved_by_final_norm(kernels, act_bytes) + aux

    def forward_scratch(self, kernels: str, act_bytes: int, seq_len: int, checkpointed: bool) -> float:
        """The decoder's, with the routed rows in place of a dense MLP: the experts' output rows and (reference
        path) their fp32 weighted copy exist together before the sum over choices; a checkpointed block holds its
        routed interiors at once; each all-to-all of expert parallelism its send and receive buffers. Under tensor
        parallelism the experts' interiors and the all-to-alls are the rank's 1/tp share of the rows, the rows
        before the unpermute every rank's (the all-gather's output, beside the rank's own)."""
        a, d, k, tp = act_bytes, self.shape.dim, self.top_k, self.routed_share
        shared = self.shared_expert_hidden_dim / self.parallel.tensor
        scratch = (a * d + (0 if kernels == "fused" else FP32_BYTES * d)) / self.parallel.between_blocks
        if kernels == "eager":
            scratch += FP32_BYTES * self.local_heads * seq_len
        scratch += a * k * d + (0 if kernels == "fused" else FP32_BYTES * k * d)
        if tp > 1:
            scratch += a * k * d / tp  # the rank's own experts' output, all-gathered into the rows above
        if checkpointed:
            scratch += 4 * a * (k * self.expert_hidden_dim / tp + shared) + a * k * d / tp
        # An adapted stacked weight: its base output, the adapters' update and its scaled copy before their sum.
        scratch += 3 * a * k * sum(self._adapted_widths())
        return scratch + self.all_to_all_bytes(act_bytes)

    def backward_scratch(self, kernels: str, act_bytes: int, seq_len: int) -> tuple[float, float]:
        """The MLP half: the gradients of the SwiGLU outputs and inputs (routed rows and shared expert), of the
        routed rows entering the unpermute and leaving the permute (and, under tensor parallelism, of the rank's
        share the all-gather's backward keeps), and the all-to-all buffers; attention's is the decoder's."""
        a, d, k, tp = act_bytes, self.shape.dim, self.top_k, self.routed_share
        shared = self.shared_expert_hidden_dim / self.parallel.tensor
        mlp = 2 * a * (k * self.expert_hidden_dim / tp + shared) + 2 * a * k * d + (a * k * d / tp if tp > 1 else 0)
        mlp += a * k * sum(self._adapted_widths())  # the gradient of an adapted weight's scaled update
        return mlp + self.all_to_all_bytes(act_bytes), super().backward_scratch(kernels, act_bytes, seq_len)[1]

    def all_to_all_bytes(self, act_bytes: int) -> float:
        """Per token, the send and receive buffers of an expert-parallel all-to-all of the rank's routed rows (its
        1/tp share under tensor parallelism; none without expert parallelism)."""
        if self.expert_parallel_size == 1:
            return 0.0
        return 2 * act_bytes * self.top_k * self.shape.dim / self.routed_share

    def _adapted_widths(self) -> list[int]:
        """The output width of each stacked expert weight an adapter sits on (w_gate_up: 2F, w_down: dim)."""
        adapted = set(self._adapted(EXPERT_PROJECTIONS))
        return ([2 * self.expert_hidden_dim] if adapted & {"expert_gate", "expert_up"} else []) + (
            [self.shape.dim] if "expert_down" in adapted else [])


#: The block groups a family with MoE layers quantizes under ``lora.base_quantization`` (its ``lora_sites``: attention's).
ATTENTION_QUANTIZED = ("attention",)


@dataclass(frozen=True)
class DenseLayerProfile(DecoderProfile):
    """A dense layer of an MoE model (``dense_layers``): the decoder's SwiGLU block, whose MLP a quantized LoRA
    base leaves in the model's dtype (the MoE family's LoRA sites are attention's)."""

    def quantized_groups(self) -> tuple[str, ...]:
        return ATTENTION_QUANTIZED
