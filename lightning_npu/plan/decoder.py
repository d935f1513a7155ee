"""How a pre-norm decoder built on ``lightning_npu.kernels`` spends memory: its parameter layout and the tensors
its forward saves for backward, per token.

The block is RMSNorm -> wq/wk/wv -> rotary -> causal attention (grouped-query) -> wo -> residual -> RMSNorm ->
w_gate and w_up (their outputs concatenated) -> SwiGLU -> w_down -> residual; the root unit is the token embedding,
the final RMSNorm and an untied output projection, and the model returns fp32 logits. That is LLaMA's layout (and
that of the decoders copied from it), with Qwen's options (qkv biases, per-head q/k norms, a head width other
than dim / heads); a model that differs subclasses ``DecoderProfile`` and overrides what differs (see
``lightning_npu.plan.profile``): the MLP half (``mlp_parameters``, ``mlp_saved``, the scratch), or a layer's whole
profile (``block_profile``), as the MoE recipe's profile does for its experts and dense layers.

What trains is part of the profile: every parameter (full fine-tuning), or, with ``adapters``
(``LowRankAdapters``: LoRA), a frozen base with trainable low-rank adapters beside some of the block's
projections. ``trainable_parameters`` tells the replay which tensors get gradients, reduce-scatters and AdamW
moments; the saved activations follow from what autograd needs for those gradients.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Iterable, Optional

from lightning_npu.facts import weight_quant
from lightning_npu.facts.parallel_rules import ModelShapes
from lightning_npu.plan.shape import ModelShape, Parallelism, PlanError

Shape = tuple[int, ...]

FP32_BYTES = 4
#: An int64 index (token ids, cross-entropy targets).
INT64_BYTES = 8
#: npu_fusion_attention keeps its softmax max and sum for backward, 8 fp32 values per query row and head each.
SOFTMAX_STATS = 2
SOFTMAX_STAT_LANES = 8
#: The rotary cos and sin tables are kept in fp32, plus half-precision copies (half the size) under bf16/fp16.
ROTARY_TABLES = 2
HALF_PRECISION_COPY = 0.5
#: The block's projections, in forward order: the attention's four, then gate, up and down. Low-rank adapters name the ones they sit beside.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION_PROJECTIONS = ("q", "k", "v", "o")
#: The stacked experts' projections of an MoE layer (its gate, up and down for every expert at once): adapters there
#: are per expert, stacked as the experts are (the recipe's ``lora.targets`` of the same names). A profile with
#: experts counts them (``DecoderProfile`` has none: a dense layer of an MoE model leaves them out).
EXPERT_PROJECTIONS = ("expert_gate", "expert_up", "expert_down")
#: A dropout mask's bytes per element on the fused (NPU) path: torch's native_dropout keeps a bool mask. The CPU
#: paths (reference, eager) run torch's unfused dropout, which keeps its scaled noise in the input's dtype.
FUSED_DROPOUT_MASK_BYTES = 1


class RankLocalShape(tuple):
    """The shape one rank holds of a parameter on a mesh of its own (an MoE layer's experts under expert or tensor
    parallelism, which npu_fsdp shards as an FSDP unit of their own, nested in the block's): ``replicas`` groups of
    ranks each hold a different part ([n_experts / expert_parallel_size, ...] on an expert-parallel rank), and FSDP2
    shards it over the ranks of the shard group times ``spread`` that hold the same part (the group times
    ``spread``, divided by ``replicas``). ``spread``: the tensor-parallel ranks, which hold the same routed experts
    (not split by tensor parallelism) and lend their ranks to the experts' mesh. The model has ``replicas`` x its
    numel. The replay gathers, frees and reduce-scatters a block's rank-local parameters as that nested unit."""

    replicas: int
    spread: int

    def __new__(cls, shape: Shape, replicas: int, spread: int = 1) -> "RankLocalShape":
        made = super().__new__(cls, shape)
        made.replicas = replicas
        made.spread = spread
        return made

    def shard_group(self, group: int) -> int:
        """The ranks FSDP2 shards it over, for a block whose other parameters are sharded over ``group``."""
        return group * self.spread // self.replicas


@dataclass(frozen=True)
class BlockParameters:
    """Parameter shapes of one block, grouped in the order backward produces their gradients: ``mlp_output``
    first (w_down), then the rest of the MLP (``mlp_input``: ffn_norm, w_gate, w_up), then ``attention``
    (attention_norm, wq, wk, wv, wo); adapters join the group of the projection they sit beside."""

    attention: tuple[Shape, ...]
    mlp_input: tuple[Shape, ...]
    mlp_output: tuple[Shape, ...]

    @property
    def shapes(self) -> list[Shape]:
        """All of them, in module order."""
        return [*self.attention, *self.mlp_input, *self.mlp_output]


@dataclass(frozen=True)
class RootParameters:
    """Parameters outside the blocks: token embeddings, final norm, output projection. ``tied``: the output
    projection is the token embedding (``tie_embeddings``), so the unit (its shards, gathered copy and gradient)
    holds that matrix once; the planner allocates the shared gradient at the output projection's backward, and the
    embedding's backward adds a second transient [vocab, dim] gradient that autograd sums into it. ``mtp``: the
    multi-token-prediction depths' parameters outside their blocks (``DecoderProfile.mtp_parameters``)."""

    embedding: Shape
    final_norm: Shape
    output: Shape
    tied: bool = False
    mtp: tuple[Shape, ...] = ()

    @property
    def shapes(self) -> list[Shape]:
        own = [self.embedding, self.final_norm] if self.tied else [self.embedding, self.final_norm, self.output]
        return [*own, *self.mtp]


@dataclass(frozen=True)
class TrainableParameters:
    """The parameters that get gradients (hence reduce-scatters and AdamW moments): ``block``, one block's, in
    backward's groups; ``root``, the root unit's shapes; ``head`` and ``embedding``, the numel of the root
    gradients produced by the output projection's (output + final norm) and by the embedding's backward; ``mtp``,
    those produced by the multi-token-prediction depths' own parameters (all depths together)."""

    block: BlockParameters
    root: tuple[Shape, ...]
    head: int
    embedding: int
    mtp: int = 0


@dataclass(frozen=True)
class LowRankAdapters:
    """Low-rank adapters (LoRA) on a frozen decoder: every base parameter, embeddings and norms included, is
    frozen, and beside each projection named in ``projections`` (among PROJECTIONS, and EXPERT_PROJECTIONS for a
    profile with experts: one adapter per expert, stacked) a trainable A [rank, in] and B [rows, rank] add
    ``B(A(dropout(x)))`` to its output. ``dropout``: whether each adapter drops out its own
    copy of the input (it then keeps that copy and a mask instead of sharing the projection's input).
    ``base_quantization``: how every projection of the blocks (adapted or not) is stored, ``int8`` or ``nf4``
    (``lightning_npu.facts.weight_quant``; codes plus scales), or None (the master dtype)."""

    rank: int
    projections: tuple[str, ...]
    dropout: bool = False
    base_quantization: Optional[str] = None

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise PlanError(f"adapter rank={self.rank!r} is invalid: it must be a positive integer")
        known = PROJECTIONS + EXPERT_PROJECTIONS
        unknown = [name for name in self.projections if name not in known]
        if unknown or not self.projections or len(set(self.projections)) != len(self.projections):
            raise PlanError(f"adapter projections {list(self.projections)} must name each of some of"
                            f" {', '.join(known)} once")
        object.__setattr__(self, "projections", tuple(p for p in known if p in self.projections))
        try:
            weight_quant.check_scheme(self.base_quantization, "adapter base_quantization")
        except ValueError as error:
            raise PlanError(str(error)) from None

    def describe(self) -> str:
        dropout = ", dropout" if self.dropout else ""
        base = (f"; block projections stored {self.base_quantization} (codes + fp32 scales)"
                if self.base_quantization else "")
        return f"low-rank adapters (rank {self.rank}{dropout}) on {', '.join(self.projections)}{base}"


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
    policies name it (``"TransformerBlock"``), ``None`` when the model comes from shapes alone. ``adapters``:
    a LoRA run (frozen base, trainable adapters); ``None`` trains every parameter. ``qkv_bias``: the query, key
    and value projections have biases (Qwen2); ``qk_norm``: an RMSNorm over each query and key head, before
    rotary (Qwen3); ``tie_embeddings``: the output projection is the token embedding (``RootParameters.tied``).

    Every block is alike unless a subclass says otherwise in ``block_profile(layer)`` (an MoE model's dense
    layers); the replay asks it for each layer's parameters, saved tensors and scratch.

    ``parallel`` (``with_parallelism``): under tensor parallelism every count is one rank's, as the recipe's plan
    (recipes/decoder/tensor_parallel.py) splits the model: q/k/v, gate and up column-parallel (their rows / tp), o
    and down row-parallel (their columns / tp), norms replicated, embedding and head split by vocabulary; inside
    attention and the MLP each rank holds heads / tp and ffn / tp channels of every token, while the norms'
    tensors (and the residual stream the replay counts) are split by sequence with ``sequence_parallel``, and the
    projections' inputs are the all-gathered [tokens, dim]. Under context parallelism the counts are per token of
    the rank's part of each sequence, plus what Ulysses or ring attention keep.

    ``mtp_depths``: multi-token prediction (DeepSeek-V3's MTP) in training. After the trunk, depth k embeds the
    tokens k ahead, normalises them and the previous depth's hidden state (the trunk's last block output for the
    first), projects their concatenation [2 dim -> dim] into one more block (an FSDP unit and a candidate for
    activation checkpointing after the trunk's: ``block_profile(n_layers + k - 1)`` describes it), and normalises
    its output into the shared output head: fp32 logits of their own, kept until the depth's cross-entropy after
    the main loss. The norms and the projection are the root unit's (``mtp_parameters``). Full training only: a
    LoRA run freezes the depths without adapting them, which is not modelled.
    """

    shape: ModelShape
    name: str = "decoder"
    block_class: Optional[str] = None
    adapters: Optional[LowRankAdapters] = None
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    parallel: Parallelism = dataclasses.field(default_factory=Parallelism)
    mtp_depths: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.mtp_depths, bool) or not isinstance(self.mtp_depths, int) or self.mtp_depths < 0:
            raise PlanError(f"mtp_depths={self.mtp_depths!r} is invalid: it must be an integer >= 0 (0: no"
                            " multi-token prediction)")
        if self.mtp_depths and self.adapters is not None:
            raise PlanError(
                f"mtp_depths={self.mtp_depths} with LoRA adapters: the planner counts multi-token prediction in full"
                " training only (a LoRA run keeps the depths frozen and unadapted, which it does not model); plan the"
                " LoRA run with mtp_depths=0 (an underestimate by the depths' frozen blocks, their saved tensors and"
                " logits) or plan full training"
            )

    @property
    def router_aux_loss_coef(self) -> float:
        """The weight of an MoE load-balancing loss (none here; ``MoEProfile`` sets it)."""
        return 0.0

    @property
    def n_blocks(self) -> int:
        """The blocks FSDP wraps and activation checkpointing chooses from, in forward order: the trunk's layers,
        then one per multi-token-prediction depth."""
        return self.shape.n_layers + self.mtp_depths

    def block_profile(self, layer: int) -> "DecoderProfile":
        """The profile whose block methods describe layer ``layer``: this one, for a decoder of identical blocks."""
        return self

    def with_expert_parallelism(self, size: int) -> "DecoderProfile":
        """This profile with its experts split over ``size`` ranks (``expert_parallel_size``); a decoder without
        experts takes only 1."""
        if size != 1:
            raise PlanError(f"expert_parallel_size={size}: {self.name} has no experts to split; use 1")
        return self

    @property
    def expert_parallel_size(self) -> int:
        """Ranks each layer's experts are split over; 1 for a decoder without experts."""
        return 1

    def with_parallelism(self, parallel: Parallelism) -> "DecoderProfile":
        """This profile counting one rank's share under ``parallel`` (``PlanSpec`` checks first that it can split:
        ``facts.parallel_rules`` with ``parallel_shapes``)."""
        return dataclasses.replace(self, parallel=parallel)

    def parallel_shapes(self) -> ModelShapes:
        """What the parallel rules read of this model (``lightning_npu.facts.parallel_rules``, the recipe's too):
        the sizes tensor parallelism splits (``tensor_parallel_sizes``), the parts no plan splits (``unsplit_parts``,
        and a root unit other than the decoder's embedding, final norm and head), the features a layout refuses."""
        unsplit = self.unsplit_parts()
        if type(self).root_parameters is not DecoderProfile.root_parameters:
            unsplit.append("its root unit is not the decoder's embedding, final norm and output head, which the"
                           " recipe's plan splits by vocabulary")
        return ModelShapes(name=self.name, n_layers=self.shape.n_layers, n_heads=self.shape.n_heads,
                           tensor_parallel_sizes=tuple(self.tensor_parallel_sizes()), unsplit_parts=tuple(unsplit),
                           tie_embeddings=self.tie_embeddings, mtp_layers=self.mtp_depths,
                           router_aux_loss_coef=self.router_aux_loss_coef, lora=self.adapters is not None)

    def tensor_parallel_sizes(self) -> list[tuple[str, int]]:
        """The model's sizes the tensor-parallel ranks split (each must divide by tp): heads, kv heads, vocabulary
        and the MLP's width."""
        m = self.shape
        return [("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads), ("vocab_size", m.vocab_size),
                ("ffn_hidden_dim", m.ffn_hidden_dim)]

    def unsplit_parts(self) -> list[str]:
        """The parts of the block the recipe's tensor-parallel plan does not split (a problem each): an MLP other
        than the decoder's dense SwiGLU, unless the subclass says how tensor parallelism splits it."""
        if type(self).mlp_parameters is not DecoderProfile.mlp_parameters:
            return ["its MLP is not the decoder's dense SwiGLU (experts), which the recipe's tensor-parallel plan"
                    " does not split; train it with data parallelism (tensor_parallel_size: 1) and, for long"
                    " sequences, context_parallel_size"]
        return []

    def unsplit(self) -> "DecoderProfile":
        """This profile without tensor or context parallelism (the whole model's counts)."""
        return dataclasses.replace(self, parallel=Parallelism())

    # ------------------------------------------------------------------------------------------- parameters

    def projection_shapes(self) -> dict[str, Shape]:
        """Each projection's [rows, in] on one rank: column-parallel ones (q, k, v, gate, up) hold rows / tp,
        row-parallel ones (o, down) columns / tp."""
        m, tp = self.shape, self.parallel.tensor
        q, kv, f = m.q_dim // tp, m.n_kv_heads * m.head_dim // tp, m.ffn_hidden_dim // tp
        return {"q": (q, m.dim), "k": (kv, m.dim), "v": (kv, m.dim), "o": (m.dim, q), "gate": (f, m.dim),
                "up": (f, m.dim), "down": (m.dim, f)}

    def base_block_parameters(self) -> BlockParameters:
        """The block's own parameters (without adapters)."""
        p = self.projection_shapes()
        biases = tuple((p[name][0],) for name in ("q", "k", "v")) if self.qkv_bias else ()
        head_norms = ((self.shape.head_dim,),) * 2 if self.qk_norm else ()
        mlp_input, mlp_output = self.mlp_parameters()
        return BlockParameters(
            attention=((self.shape.dim,), p["q"], p["k"], p["v"], p["o"], *biases, *head_norms),
            mlp_input=mlp_input,
            mlp_output=mlp_output,
        )

    def mlp_parameters(self) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
        """The MLP half's (mlp_input, mlp_output) parameters: ffn_norm, w_gate and w_up, then w_down."""
        p = self.projection_shapes()
        return ((self.shape.dim,), p["gate"], p["up"]), (p["down"],)

    def adapter_parameters(self) -> BlockParameters:
        """One block's adapter shapes (A [rank, in], B [rows, rank] per adapted projection), in backward's groups;
        empty without adapters."""
        groups: dict[str, list[Shape]] = {"attention": [], "mlp_input": [], "mlp_output": []}
        if self.adapters is not None:
            r = self.adapters.rank
            for name in self._adapted(PROJECTIONS):  # the experts' adapters are the profile with experts' to count
                rows, columns = self.projection_shapes()[name]
                group = "attention" if name in ATTENTION_PROJECTIONS else "mlp_output" if name == "down" else "mlp_input"
                groups[group] += [(r, columns), (rows, r)]
        return BlockParameters(**{group: tuple(shapes) for group, shapes in groups.items()})

    def block_parameters(self) -> BlockParameters:
        """Every parameter of one block (FSDP shards and gathers them all): its own, then its adapters'."""
        base, adapters = self.base_block_parameters(), self.adapter_parameters()
        return BlockParameters(*(getattr(base, f.name) + getattr(adapters, f.name) for f in fields(BlockParameters)))

    def block_storage(self) -> list[tuple[Shape, Optional[str]]]:
        """``block_parameters().shapes`` (in that order), each with how it is stored: the adapters'
        ``base_quantization`` for the base projections (the matrices of the ``quantized_groups``), None (the master
        dtype) otherwise."""
        base, adapters = self.base_block_parameters(), self.adapter_parameters()
        scheme = self.adapters.base_quantization if self.adapters is not None else None
        storage: list[tuple[Shape, Optional[str]]] = []
        for group in fields(BlockParameters):
            quantized = scheme if group.name in self.quantized_groups() else None
            storage += [(shape, quantized if len(shape) == 2 else None) for shape in getattr(base, group.name)]
            storage += [(shape, None) for shape in getattr(adapters, group.name)]
        return storage

    def quantized_groups(self) -> tuple[str, ...]:
        """The ``BlockParameters`` groups whose matrices a quantized LoRA base stores quantized: all of this
        decoder's (its projections); a model that quantizes fewer says which."""
        return tuple(group.name for group in fields(BlockParameters))

    def root_parameters(self) -> RootParameters:
        """Embedding, final norm and output head; under tensor parallelism the embedding (row-parallel) and the
        head (column-parallel) hold vocab / tp rows each, the norm is replicated."""
        m, vocab = self.shape, self.shape.vocab_size // self.parallel.tensor
        return RootParameters(embedding=(vocab, m.dim), final_norm=(m.dim,), output=(vocab, m.dim),
                              tied=self.tie_embeddings, mtp=self.mtp_parameters())

    def mtp_parameters(self) -> tuple[Shape, ...]:
        """The multi-token-prediction depths' parameters outside their blocks, depth after depth: the norms of the
        embedded tokens and of the hidden state [dim], the projection of their concatenation [dim, 2 dim] and the
        norm before the shared head [dim]. No block holds them, so they are the root unit's."""
        d = self.shape.dim
        return ((d,), (d,), (d, 2 * d), (d,)) * self.mtp_depths

    def trainable_parameters(self) -> TrainableParameters:
        """What trains: everything, or (with adapters) the adapters only."""
        if self.adapters is not None:
            return TrainableParameters(block=self.adapter_parameters(), root=(), head=0, embedding=0)
        root = self.root_parameters()
        return TrainableParameters(block=self.block_parameters(), root=tuple(root.shapes),
                                   head=math.prod(root.output) + math.prod(root.final_norm),
                                   embedding=math.prod(root.embedding), mtp=_numel(root.mtp))

    def num_params(self) -> int:
        if self.parallel.tensor > 1:
            return self.unsplit().num_params()
        blocks = sum(_numel(self.block_profile(i).block_parameters().shapes) for i in range(self.n_blocks))
        return _numel(self.root_parameters().shapes) + blocks

    def num_trainable_params(self) -> int:
        if self.parallel.tensor > 1:
            return self.unsplit().num_trainable_params()
        blocks = sum(_numel(self.block_profile(i).trainable_parameters().block.shapes)
                     for i in range(self.n_blocks))
        return _numel(self.trainable_parameters().root) + blocks

    # ------------------------------------------------------------------------------------------ activations

    def block_activations(self, kernels: str, act_bytes: int, seq_len: int) -> dict[str, float]:
        """Bytes per token that one block's forward leaves saved for its backward (see ``saved_by_block``)."""
        return self.saved_by_block(kernels, act_bytes, seq_len).all

    def saved_by_block(self, kernels: str, act_bytes: int, seq_len: int) -> BlockActivations:
        """Each entry is a tensor autograd (or a fused kernel's backward) keeps, from the block's code, for a block
        whose input needs a gradient (every block after the first; the first too when the embedding trains).

        ``reference``: the PyTorch paths of lightning_npu.kernels; RMSNorm upcasts its input and keeps the fp32
        copy, the fp32 rstd and (for its weight's gradient) the fp32 normalised tensor; rotary keeps nothing but
        the tables (its multiplicands need no gradient); grouped-query keys/values are expanded to all heads before
        SDPA, which keeps q, k, v, its output and an fp32 log-sum-exp per head (no S x S matrix). ``fused``:
        npu_rms_norm keeps its input and an fp32 rstd, npu_rotary_mul its input, npu_fusion_attention q, k, v (at
        kv heads), its output and softmax max/sum (8 fp32 per head each), npu_swiglu its input. ``eager``: as
        reference, but attention keeps scaled fp32 q, k, v and the fp32 [heads, seq, seq] probabilities.

        A projection keeps its input only for its weight's gradient: a frozen one keeps none, its adapter's A
        keeps the same input (or, with dropout, its own dropped-out copy and the mask), its B the rank-r
        intermediate. A kernel whose inputs need no gradient keeps nothing.
        """
        return self._saved(kernels, act_bytes, seq_len, input_grad=True)

    def saved_by_first_block(self, kernels: str, act_bytes: int, seq_len: int) -> BlockActivations:
        """``saved_by_block`` for a block whose input needs no gradient: the first, whose input is the embedding's
        output, when the embedding is frozen (and under LoRA every block before the first one with adapters):
        nothing before the block's first trainable parameter needs a gradient, so nothing there is kept."""
        if self.trainable_parameters().embedding > 0:
            return self.saved_by_block(kernels, act_bytes, seq_len)  # so a subclass's count serves every block
        return self._saved(kernels, act_bytes, seq_len, input_grad=False)

    def _saved(self, kernels: str, a: int, seq_len: int, input_grad: bool) -> BlockActivations:
        m, p = self.shape, self.parallel
        n, q, kv = self.local_heads, m.q_dim // p.tensor, m.n_kv_heads * m.head_dim // p.tensor
        base_trains = self.adapters is None
        fused = kernels == "fused"
        attention: dict[str, float] = {}
        # Attention half.
        if input_grad:
            attention.update(self._between_blocks_norm("attention_norm", kernels, a, base_trains))
        normed_grad = input_grad or base_trains
        if self._keeps_input("q", "k", "v"):
            attention["wq/wk/wv input"] = a * m.dim
        q_grad, k_grad, v_grad = (self._needs_grad(normed_grad, p) for p in ("q", "k", "v"))
        if self.qk_norm:  # per-head RMSNorms of the queries and keys, one rstd per head
            for name, width, heads, grad in (("q_norm", q, n, q_grad), ("k_norm", kv, m.n_kv_heads, k_grad)):
                if grad:
                    attention.update(self._norm_saved(name, kernels, a, base_trains, width, heads))
        if fused and (q_grad or k_grad):
            attention["rotary inputs (q, k)"] = a * (q * q_grad + kv * k_grad)
        attention_grad = q_grad or k_grad or v_grad
        ring = p.context > 1 and p.context_algo == "ring"
        if attention_grad and ring:
            # _RingAttention keeps q, k, v as given (kv heads), its fp32 output and the merged fp32 row max / sum.
            attention["ring attention q, k, v"] = a * (q + 2 * kv)
            attention["ring attention output (fp32)"] = FP32_BYTES * q
            attention["ring attention row max + sum (fp32)"] = SOFTMAX_STATS * FP32_BYTES * n
        elif attention_grad:
            if p.context > 1:  # Ulysses: per rank H / cp heads of every token, the same bytes per own token
                kv *= self.ulysses_kv_repeat
            if fused:
                attention["attention q, k, v"] = a * (q + 2 * kv)
                attention["attention softmax max + sum"] = SOFTMAX_STATS * SOFTMAX_STAT_LANES * FP32_BYTES * n
            elif kernels == "reference":
                attention["attention q, k, v (kv expanded to all heads)"] = 3 * a * q
                attention["attention log-sum-exp"] = FP32_BYTES * n
            else:  # its matmuls keep q and k (and v) only for the gradients of q or k, the probabilities always
                if q_grad or k_grad:
                    attention["attention scaled q, k and v (fp32)"] = 3 * FP32_BYTES * q
                attention["attention probabilities (fp32, S x S)"] = FP32_BYTES * n * seq_len
        # The fused and SDPA kernels keep their output, which is also wo's input; eager attention's output is kept
        # by wo alone. Under Ulysses wo's input is the output's all-to-all (another tensor), under ring the fp32
        # output cast (the output itself in fp32).
        if attention_grad and not ring and kernels != "eager" and p.context > 1:
            attention["Ulysses attention output (head-split, kept by the kernel)"] = a * q
        if (self._keeps_input("o") or (attention_grad and kernels != "eager")) and not (ring and a == FP32_BYTES):
            attention["attention output (wo input)"] = a * q
        residual_grad = input_grad or self._needs_grad(attention_grad, "o")
        # Whether each attention adapter's input needs a gradient (its dropout then keeps the mask).
        input_grads = {"q": normed_grad, "k": normed_grad, "v": normed_grad, "o": attention_grad}
        for name in self._adapted(ATTENTION_PROJECTIONS):
            attention.update(self._adapter_saved(name, kernels, a, input_grads[name]))
        return BlockActivations(attention, self.mlp_saved(kernels, a, residual_grad))

    def mlp_saved(self, kernels: str, a: int, residual_grad: bool) -> dict[str, float]:
        """Bytes per token the MLP half keeps for backward (ffn_norm, the SwiGLU MLP, its adapters), given
        whether its input (the residual after attention) needs a gradient."""
        saved: dict[str, float] = {}
        if residual_grad:
            saved.update(self._between_blocks_norm("ffn_norm", kernels, a, self.adapters is None))
        if self._keeps_input("gate", "up"):
            saved["w_gate/w_up input"] = a * self.shape.dim
        gate_up_grad = self._needs_grad(residual_grad, "gate", "up")
        saved.update(self._swiglu_saved("", kernels, a, self.shape.ffn_hidden_dim // self.parallel.tensor,
                                        gate_up_grad, self._keeps_input("down")))
        input_grads = {"gate": residual_grad, "up": residual_grad, "down": gate_up_grad}
        for name in self._adapted(("gate", "up", "down")):
            saved.update(self._adapter_saved(name, kernels, a, input_grads[name]))
        return saved

    def _adapted(self, projections: tuple[str, ...]) -> list[str]:
        """Which of ``projections`` carry adapters."""
        return [p for p in (self.adapters.projections if self.adapters else ()) if p in projections]

    def _keeps_input(self, *projections: str) -> bool:
        """Whether these projections' shared input is kept for a weight gradient (theirs, or an adapter's A that
        reads it undropped)."""
        adapters = self.adapters
        return adapters is None or bool(set(adapters.projections).intersection(projections)) and not adapters.dropout

    def _needs_grad(self, upstream: bool, *projections: str) -> bool:
        """Whether a projection's output needs a gradient: its input does, its weight trains, or it is adapted."""
        return upstream or self.adapters is None or bool(self._adapted(projections))

    @staticmethod
    def _swiglu_saved(prefix: str, kernels: str, a: int, width: float, gate_up_grad: bool,
                      keeps_down_input: bool) -> dict[str, float]:
        """What a SwiGLU of ``width`` channels per token keeps (``width`` x rows per token for experts): its gate/up
        input to the gate (fused), or the gate/up projection and silu(gate) (reference paths), when it needs a
        gradient; the product, w_down's input, when w_down keeps it."""
        saved: dict[str, float] = {}
        if gate_up_grad:
            if kernels == "fused":
                saved[f"{prefix}swiglu input (gate, up)"] = 2 * a * width
            else:
                saved[f"{prefix}gate/up projection"] = 2 * a * width
                saved[f"{prefix}silu(gate)"] = a * width
        if keeps_down_input:
            saved[f"{prefix}swiglu output (w_down input)"] = a * width
        return saved

    @property
    def local_heads(self) -> int:
        """Query heads per rank (each tensor-parallel rank computes n_heads / tp of them for its tokens)."""
        return self.shape.n_heads // self.parallel.tensor

    @property
    def ulysses_kv_repeat(self) -> int:
        """How often Ulysses repeats each key/value head so that the context-parallel ranks divide them (1 when
        they already do): ``cp / gcd(kv heads per rank, cp)``, as ``ulysses_attention`` does."""
        cp = self.parallel.context
        return cp // math.gcd(self.shape.n_kv_heads // self.parallel.tensor, cp) if cp > 1 else 1

    def _between_blocks_norm(self, norm: str, kernels: str, a: int, weight_trains: bool) -> dict[str, float]:
        """What a norm of the residual stream (attention_norm, ffn_norm, the final norm) keeps per token: split by
        sequence over the tensor-parallel ranks with sequence parallelism, replicated over them without."""
        share = self.parallel.between_blocks
        return {name: value / share for name, value in self._norm_saved(norm, kernels, a, weight_trains).items()}

    def _norm_saved(self, norm: str, kernels: str, a: int, weight_trains: bool, width: Optional[int] = None,
                    rows: int = 1) -> dict[str, float]:
        """What an RMSNorm over ``width`` channels (default: the model's width) whose input needs a gradient keeps
        per token, for ``rows`` normalised rows per token (heads, for q/k norms): the reference path's normalised
        tensor only for its weight's gradient."""
        d = self.shape.dim if width is None else width
        if kernels == "fused":
            return {f"{norm} input + rstd": a * d + FP32_BYTES * rows}
        if weight_trains:
            return {f"{norm} (fp32 input, rstd, normalised)": 2 * FP32_BYTES * d + FP32_BYTES * rows}
        return {f"{norm} (fp32 input, rstd)": FP32_BYTES * d + FP32_BYTES * rows}

    def _adapter_saved(self, name: str, kernels: str, a: int, input_grad: bool) -> dict[str, float]:
        """An adapter's B keeps the rank-r intermediate; with dropout its A keeps the dropped-out input, and the
        dropout its mask when its input needs a gradient."""
        adapters = self.adapters
        saved = {f"{name} adapter rank-{adapters.rank} intermediate": a * adapters.rank}
        if adapters.dropout:
            columns = self.projection_shapes()[name][1]
            mask = (FUSED_DROPOUT_MASK_BYTES if kernels == "fused" else a) if input_grad else 0
            saved[f"{name} adapter dropped-out input{' + mask' if mask else ''}"] = (a + mask) * columns
        return saved

    def saved_by_final_norm(self, kernels: str, act_bytes: int) -> float:
        """Bytes per token saved by the final RMSNorm and (when it trains) the output projection's input."""
        return sum(self._head_saved("norm", kernels, act_bytes).values())

    def _head_saved(self, norm: str, kernels: str, a: int) -> dict[str, float]:
        """What a norm of the residual stream and the output head after it keep per token: the norm's tensors and,
        when the head trains, its input (all-gathered under sequence parallelism)."""
        trains = self.adapters is None
        saved = self._between_blocks_norm(norm, kernels, a, trains)
        if trains:
            saved[f"output head input ({norm}'s output)"] = a * self.shape.dim
        return saved

    def saved_by_mtp_depth(self, kernels: str, act_bytes: int) -> tuple[dict[str, float], dict[str, float]]:
        """Bytes per token one multi-token-prediction depth keeps for backward outside its block (``mtp_depths``;
        full training), as (what the way into the block keeps, what the way into the head keeps): the embedding's
        backward reads the ids of the tokens ahead (a rolled copy, int64); the norms of the embedded tokens and of
        the hidden state keep their tensors, except the hidden state itself where the norm keeps its input as it
        is (fused kernels, or an fp32 run's reference path): that tensor is the one the norm before the previous
        head (the final norm, or the previous depth's) keeps already; the projection keeps its input, the
        concatenated norms [2 dim]; then the depth's norm and the head's input, as the final norm's; and the depth's
        cross-entropy its own targets (the labels rolled ahead and masked, int64)."""
        a, d = act_bytes, self.shape.dim
        into_block = {"tokens ahead (int64 ids, the embedding's backward)": INT64_BYTES}
        into_block.update(self._between_blocks_norm("enorm", kernels, a, True))
        shared_input = kernels == "fused" or a == FP32_BYTES
        for name, value in self._between_blocks_norm("hnorm", kernels, a, True).items():
            into_block[name + (" less its input, the previous head's norm's" if shared_input else "")] = (
                value - a * d if shared_input else value)
        into_block["eh_proj input (the two norms' outputs concatenated)"] = 2 * a * d
        into_head = self._head_saved("mtp norm", kernels, a)
        into_head["cross-entropy targets ahead (int64)"] = INT64_BYTES
        return into_block, into_head

    def mtp_forward_scratch(self, kernels: str, act_bytes: int) -> float:
        """Bytes per token alive together inside a multi-token-prediction depth's way into its block beyond what it
        saves: the embedded tokens and the two norms' outputs before their concatenation, the reference norm's fp32
        square."""
        d = self.shape.dim
        return 3 * act_bytes * d + (0 if kernels == "fused" else FP32_BYTES * d)

    def forward_scratch(self, kernels: str, act_bytes: int, seq_len: int, checkpointed: bool) -> float:
        """Bytes per token of short-lived tensors inside one block's forward beyond what it saves."""
        m, tp = self.shape, self.parallel.tensor
        # The block output; the reference RMSNorm's fp32 square.
        scratch = (act_bytes * m.dim + (0 if kernels == "fused" else FP32_BYTES * m.dim)) / self.parallel.between_blocks
        if kernels == "eager":
            scratch += FP32_BYTES * self.local_heads * seq_len  # the scores before softmax
        if checkpointed:  # nothing is kept, but the MLP's gate/up (2 x ffn), silu and product exist together
            scratch += 4 * act_bytes * m.ffn_hidden_dim // tp
        return scratch

    def backward_scratch(self, kernels: str, act_bytes: int, seq_len: int) -> tuple[float, float]:
        """Bytes per token of gradient temporaries alive together inside one block's backward, beyond its saved
        tensors: (MLP half, attention half). In the MLP the gradient of the SwiGLU output and those of its two
        inputs coexist while the saved output is already released (2 x ffn); in attention the q, k and v gradients
        (plus, for eager attention, the fp32 gradients of the probabilities and scores)."""
        m, a, tp = self.shape, act_bytes, self.parallel.tensor
        kv = m.n_kv_heads * m.head_dim if kernels == "fused" else m.q_dim  # reference paths expand kv to all heads
        attention = a * (m.q_dim + 2 * kv) / tp
        if kernels == "eager":
            attention += 2 * FP32_BYTES * self.local_heads * seq_len
        return 2 * a * m.ffn_hidden_dim / tp, attention

    def parallel_scratch(self, kernels: str, act_bytes: int, seq_len: int) -> tuple[float, float]:
        """Bytes per token (of the rank's own) of the transient buffers tensor and context parallelism add inside
        one block: (forward, backward). Tensor parallelism: wo's and w_down's full [tokens, dim] partial sums and
        the copy their all-reduce (or, with sequence parallelism, the reduce-scatter's staging) makes; the reverse
        collectives in backward. Ulysses: the contiguous send buffer and the receive buffer of an all-to-all of the
        largest of q, k, v (and of the output, and of their gradients). Ring: the stacked keys/values and the
        next block in flight, and each block's: on NPUs its output and softmax max/sum ([.., 8] lanes, fp32), in
        the exact CPU block the contiguous q/k/v rows and three fp32 [heads, local seq] score tensors per query; in
        backward also the fp32 dq and the stacked dk/dv with the one in flight."""
        m, p, a = self.shape, self.parallel, act_bytes
        forward = backward = 2.0 * a * m.dim if p.tensor > 1 else 0.0
        if p.context == 1:
            return forward, backward
        q, kv = m.q_dim // p.tensor, m.n_kv_heads * m.head_dim // p.tensor
        if p.context_algo == "ulysses":
            largest = max(q, kv * self.ulysses_kv_repeat)
            return forward + 2 * a * largest, backward + 2 * a * largest
        n, local = self.local_heads, seq_len // p.context
        if kernels == "fused":
            block = a * q + SOFTMAX_STATS * SOFTMAX_STAT_LANES * FP32_BYTES * n
        else:
            block = a * (q + 2 * kv) + 3 * FP32_BYTES * n * local
        ring = 2 * 2 * a * kv  # the stacked k/v and the received block
        return forward + ring + block, backward + ring + block + FP32_BYTES * (q + 2 * 2 * kv)

    def rotary_table_bytes(self, act_bytes: int) -> float:
        """The rotary cos/sin tables (fp32, plus half-precision copies when activations are half precision)."""
        m = self.shape
        copies = 1.0 + (HALF_PRECISION_COPY if act_bytes < FP32_BYTES else 0.0)
        return ROTARY_TABLES * m.max_seq_len * m.head_dim * FP32_BYTES * copies


def _numel(shapes: Iterable[Shape]) -> int:
    """Parameters of the model with these shapes (a rank-local one counts each part)."""
    return sum(math.prod(shape) * getattr(shape, "replicas", 1) for shape in shapes)
