"""The DeepSeek recipe's memory profile for ``lightning-npu plan`` (the protocol: ``lightning_npu.plan.profile``).

Torch-free: the planner imports it to read a config. The MLP half of each layer is the shared MoE profile
(``MoEProfile``: router, stacked experts, shared experts, expert parallelism) or, in the first ``first_k_dense``
layers, the decoder's SwiGLU; the attention half is MLA (``MLAProfile``), as model.py's ``MLAttention`` runs it:

- parameters: ``wq`` [H x qk, dim], or ``wq_a`` [q_rank, dim], ``q_norm`` [q_rank] and ``wq_b`` [H x qk, q_rank];
  ``wkv_a`` [kv_rank + rope, dim], ``kv_norm`` [kv_rank], ``wkv_b`` [H x (nope + v), kv_rank], ``wo`` [dim, H x v];
- saved for backward, per token: the projections' inputs (the normed stream, the normed query and key/value
  latents), the two latent norms' tensors (in fp32 the key/value norm's input is a view of ``wkv_a``'s output,
  whose storage holds the rotary key too), the attention kernel's q, k and v at qk width for every head (v is
  zero-padded to it until the kernel takes Dv != Dk; the reference path keeps them and a log-sum-exp per head),
  its output at qk width and ``wo``'s input, the v_head_dim slice of it. Under Ulysses context parallelism the
  same per token of the rank's own (its all-to-alls move every head's q, k, v between the ranks; the kernel keeps
  its head-split output, ``wo`` the output's all-to-all); under ring attention the ring's own: q and k at qk
  width, v as the view of ``wkv_b``'s output it is (nope + v wide), the fp32 output, its row max and sum, and
  ``wo``'s input in a half-precision run;
- DeepSeekMoE: ``MoEProfile``'s layer, its shared experts without a gate;
- multi-token prediction (``mtp_layers``): the planner's ``mtp_depths``, each depth's block a DeepSeekMoE layer
  (past ``first_k_dense``, which is below ``n_layers``), the head and embedding the model's own, shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lightning_npu.plan import DecoderProfile, ModelShape
from lightning_npu.plan.decoder import FP32_BYTES, SOFTMAX_STAT_LANES, SOFTMAX_STATS, BlockActivations, BlockParameters
from lightning_npu.plan.decoder import ROTARY_TABLES, HALF_PRECISION_COPY, Shape
from recipes.decoder.moe_profile import ATTENTION_QUANTIZED, MoEProfile
from recipes.decoder.plan_profile import adapters, family_config
from recipes.models.deepseek.config import DeepSeekConfig

#: LoRA targets the profile does not count yet: MLA's but its output's.
UNPLANNED_TARGETS = ("q", "q_a", "q_b", "kv_a", "kv_b")
#: The class the recipe's configs shard and checkpoint by (auto_wrap_policy / activation_checkpointing_policy).
BLOCK_CLASS = "recipes.models.deepseek.model.DeepSeekBlock"


@dataclass(frozen=True)
class MLAProfile(DecoderProfile):
    """A decoder whose attention is MLA (``q_lora_rank`` 0: no query low rank); the shape's ``head_dim`` is the
    query/key width ``qk_nope_head_dim + qk_rope_head_dim``. Alone it is a dense layer of a DeepSeek model."""

    q_lora_rank: int = 0
    kv_lora_rank: int = 1
    qk_rope_head_dim: int = 2
    v_head_dim: int = 1

    def projection_shapes(self) -> dict[str, Shape]:
        shapes = dict(super().projection_shapes())
        shapes["o"] = (self.shape.dim, self.shape.n_heads * self.v_head_dim)
        return shapes

    def quantized_groups(self) -> tuple[str, ...]:
        return ATTENTION_QUANTIZED

    def unsplit_parts(self) -> list[str]:
        """MLA has no tensor-parallel plan in the recipe (DeepSeek trains without TP for now)."""
        return [*super().unsplit_parts(), "its attention is MLA, which the recipe's tensor-parallel plan does not"
                " split yet; train it with data, expert and context parallelism (tensor_parallel_size: 1)"]

    def base_block_parameters(self) -> BlockParameters:
        m, heads = self.shape, self.shape.n_heads
        nope = m.head_dim - self.qk_rope_head_dim
        if self.q_lora_rank:
            query: tuple[Shape, ...] = ((self.q_lora_rank, m.dim), (self.q_lora_rank,),
                                        (heads * m.head_dim, self.q_lora_rank))
        else:
            query = ((heads * m.head_dim, m.dim),)
        latent = ((self.kv_lora_rank + self.qk_rope_head_dim, m.dim), (self.kv_lora_rank,),
                  (heads * (nope + self.v_head_dim), self.kv_lora_rank))
        mlp_input, mlp_output = self.mlp_parameters()
        return BlockParameters(attention=((m.dim,), *query, *latent, self.projection_shapes()["o"]),
                               mlp_input=mlp_input, mlp_output=mlp_output)

    def _saved(self, kernels: str, a: int, seq_len: int, input_grad: bool) -> BlockActivations:
        """What MLA keeps (see the module docstring); a frozen attention (LoRA elsewhere) keeps its own tensors
        only when its input needs a gradient, and wo's input only for an adapter on it."""
        m, heads = self.shape, self.shape.n_heads
        trains = self.adapters is None
        attention_grad = input_grad or trains  # whether q, k and v need gradients (MLA's q/kv adapters: unplanned)
        ring = self.parallel.context > 1 and self.parallel.context_algo == "ring"
        keeps_wo_input = self._keeps_input("o")
        qk, v = heads * m.head_dim, heads * self.v_head_dim
        attention: dict[str, float] = {}
        if input_grad:
            attention.update(self._between_blocks_norm("attention_norm", kernels, a, trains))
        if trains:  # the projections keep their inputs for their weights' gradients
            attention["wq/wkv_a input"] = a * m.dim
            attention["wkv_b input"] = a * self.kv_lora_rank
            if self.q_lora_rank:
                attention["wq_b input"] = a * self.q_lora_rank
        if attention_grad:  # the latent norms, for their inputs' gradients (and their weights' when they train)
            if self.q_lora_rank:
                attention.update(self._norm_saved("q_norm", kernels, a, trains, self.q_lora_rank))
            kv_norm = self._norm_saved("kv_norm", kernels, a, trains, self.kv_lora_rank)
            if kernels != "fused" and a == FP32_BYTES:  # the fp32 "copy" is the latent, a view of wkv_a's output
                kv_norm = {f"{name} (input: wkv_a's output)": value + FP32_BYTES * self.qk_rope_head_dim
                           for name, value in kv_norm.items()}
            attention.update(kv_norm)
        if attention_grad and kernels == "fused":
            attention["rotary inputs (q, shared k)"] = a * (heads + 1) * self.qk_rope_head_dim
        if attention_grad and ring:
            # _RingAttention keeps q, k and v as given (v a view of wkv_b's [nope + v] output), its fp32 output
            # (also wo's input in fp32) and the merged row max / sum.
            attention["ring attention q, k (qk wide), v (wkv_b's output)"] = \
                a * (2 * qk + heads * (m.head_dim - self.qk_rope_head_dim + self.v_head_dim))
            attention["ring attention output (fp32)"] = FP32_BYTES * v
            attention["ring attention row max + sum (fp32)"] = SOFTMAX_STATS * FP32_BYTES * heads
        elif attention_grad:  # Ulysses keeps the same per token of the rank's own (heads / cp of every token)
            attention["attention q, k, v (v padded to qk)"] = 3 * a * qk
            if kernels == "fused":
                attention["attention softmax max + sum"] = SOFTMAX_STATS * SOFTMAX_STAT_LANES * FP32_BYTES * heads
            else:
                attention["attention log-sum-exp"] = FP32_BYTES * heads
            attention["attention output (qk wide)"] = a * qk
        if keeps_wo_input and not (ring and attention_grad and a == FP32_BYTES):
            attention["wo input (the v slice)" if not ring else "wo input (the output in the working dtype)"] = a * v
        for name in self._adapted(("o",)):
            attention.update(self._adapter_saved(name, kernels, a, attention_grad))
        residual_grad = input_grad or trains or bool(self._adapted(("o",)))
        return BlockActivations(attention, self.mlp_saved(kernels, a, residual_grad))

    def rotary_table_bytes(self, act_bytes: int) -> float:
        copies = 1.0 + (HALF_PRECISION_COPY if act_bytes < FP32_BYTES else 0.0)
        return ROTARY_TABLES * self.shape.max_seq_len * self.qk_rope_head_dim * FP32_BYTES * copies


@dataclass(frozen=True)
class DeepSeekProfile(MLAProfile, MoEProfile):
    """A DeepSeek model: MLA in every layer, DeepSeekMoE outside ``dense_layers`` (whose shared experts have no
    gate), the decoder's SwiGLU inside."""

    def block_profile(self, layer: int) -> DecoderProfile:
        if layer in self.dense_layers:
            return MLAProfile(self.shape, self.name, self.block_class, self.adapters, parallel=self.parallel,
                              q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                              qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
        return self

    def mlp_parameters(self) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
        """``MoEProfile``'s, without the shared expert's [1, dim] gate (the last of its input group)."""
        mlp_input, mlp_output = super().mlp_parameters()
        return (mlp_input[:-1] if self.shared_expert_hidden_dim else mlp_input), mlp_output


def profile_of(config: DeepSeekConfig, name: str, lora: Any = None) -> DeepSeekProfile:
    """The profile of the recipe's DeepSeek model of ``config`` (``lora``: a config's ``model.lora`` value)."""
    shape = ModelShape(vocab_size=config.vocab_size, dim=config.dim, n_layers=config.n_layers,
                       n_heads=config.n_heads, n_kv_heads=config.n_heads, ffn_hidden_dim=config.ffn_hidden_dim,
                       max_seq_len=config.max_seq_len, head_dim=config.qk_head_dim)
    if config.mtp_layers and lora is not None:
        raise ValueError(f"model.config.mtp_layers={config.mtp_layers} with model.lora: the planner counts"
                         " multi-token prediction in full training only (add_lora freezes the depths without"
                         " adapters, which it does not model); plan the LoRA run with mtp_layers=0 (an underestimate"
                         " by the depths' frozen MoE blocks, saved tensors and logits), or plan full training")
    if config.tie_embeddings:
        raise ValueError("model.config.tie_embeddings=true is not planned for DeepSeek models; plan with false (an"
                         " upper bound: one more [vocab, dim] matrix)")
    return DeepSeekProfile(
        shape, name=name, block_class=BLOCK_CLASS, adapters=adapters(lora, UNPLANNED_TARGETS, experts=True), n_experts=config.n_experts,
        top_k=config.top_k, expert_hidden_dim=config.expert_hidden_dim,
        shared_expert_hidden_dim=config.shared_expert_hidden_dim, shared_expert_gate=False,
        dense_layers=tuple(config.dense_layer_indices), norm_topk_prob=config.norm_topk_prob,
        q_lora_rank=config.q_lora_rank or 0,
        kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
        mtp_depths=config.mtp_layers,
    )


def lightning_npu_memory_profile(model: Mapping[str, Any]) -> DeepSeekProfile:
    """The profile of the DecoderLM module a config's ``model:`` section (``family: deepseek``, ``preset``,
    ``config``, ``lora``) builds."""
    preset, config = family_config(model, __name__, DeepSeekConfig)
    return profile_of(config, f"DeepSeek {preset} ({config.n_experts}+{config.n_shared_experts} experts,"
                              f" top-{config.top_k})", model.get("lora"))
