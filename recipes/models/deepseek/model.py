"""The DeepSeek-V3 / V2 decoder (see ``config.py``): Multi-head Latent Attention and DeepSeekMoE on the shared norms,
SwiGLU MLP and trunk of ``recipes/decoder/transformer.py`` and the MoE layers of ``recipes/decoder/moe.py`` (stacked
experts on grouped matmuls, the fp32 router, ``RoutedDecoder``'s balancing and logging).

Rotary embeddings rotate the ``qk_rope_head_dim`` channels only. DeepSeek checkpoints lay them out as interleaved
pairs (x0, x1), (x2, x3), ...; with ``rope_interleave`` (V2 always) they are de-interleaved into halves first and
rotated by the kernels' "half" rule, which gives transformers' result channel for channel in V3 (its
``apply_rotary_pos_emb_interleave`` outputs the halves) and a permutation of it in V2 (which keeps the pairs),
applied to queries and keys alike, so every q.k is the same. The weights stay in the checkpoint's layout.

Parameter names (``hf.py`` maps them to Hugging Face's)::

    tok_embeddings.weight                                   [vocab, dim]
    layers.{i}.attention_norm.weight                        [dim]
    layers.{i}.attention.wq.weight                          [n_heads * qk_head_dim, dim]   (q_lora_rank None)
    layers.{i}.attention.wq_a.weight                        [q_lora_rank, dim]             (else, and:)
    layers.{i}.attention.q_norm.weight                      [q_lora_rank]
    layers.{i}.attention.wq_b.weight                        [n_heads * qk_head_dim, q_lora_rank]
    layers.{i}.attention.wkv_a.weight                       [kv_lora_rank + qk_rope_head_dim, dim]
    layers.{i}.attention.kv_norm.weight                     [kv_lora_rank]
    layers.{i}.attention.wkv_b.weight                       [n_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    layers.{i}.attention.wo.weight                          [dim, n_heads * v_head_dim]
    layers.{i}.ffn_norm.weight                              [dim]
  an MoE layer (i >= first_k_dense):
    layers.{i}.feed_forward.router.weight                   [n_experts, dim]
    layers.{i}.feed_forward.router.expert_bias              [n_experts]  (deepseek_v3: e_score_correction_bias)
    layers.{i}.feed_forward.experts.w_gate_up               [n_experts, 2 * expert_hidden_dim, dim]
    layers.{i}.feed_forward.experts.w_down                  [n_experts, dim, expert_hidden_dim]
    layers.{i}.feed_forward.shared_expert.w_gate.weight ... [n_shared_experts * expert_hidden_dim, dim]
  a dense layer:
    layers.{i}.feed_forward.w_gate.weight, w_up.weight      [ffn_hidden_dim, dim]
    layers.{i}.feed_forward.w_down.weight                   [dim, ffn_hidden_dim]
    norm.weight, output.weight                              as LLaMA's
  multi-token prediction depth k (mtp_layers > 0; HF: model.layers.{n_layers + k}.*):
    mtp.{k}.enorm.weight, hnorm.weight, norm.weight         [dim]  (norm: HF shared_head.norm)
    mtp.{k}.eh_proj.weight                                  [dim, 2 * dim]
    mtp.{k}.block.*                                         an MoE layer's, as above
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_npu.kernels import apply_rotary
from lightning_npu.parallel import ParallelPlan
from recipes.decoder.layers import Linear
from recipes.decoder.moe import MoEFeedForward, RoutedDecoder
from recipes.decoder.tensor_parallel import decoder_parallel_plan
from recipes.decoder.transformer import DecoderBlock, FeedForward, KVCache, RMSNorm, attend
from recipes.models.deepseek.config import DeepSeekConfig
from recipes.models.deepseek.tensor_parallel import mla_attention_plan

#: The eps of MLA's latent norms: transformers builds them with its RMSNorm's default, whatever rms_norm_eps is.
LATENT_NORM_EPS = 1e-6


def deinterleave(x: Tensor) -> Tensor:
    """Channels (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): interleaved rotary pairs as halves."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """Causal Multi-head Latent Attention (see ``config.py``): queries (optionally through a normalised low rank),
    keys and values up-projected from a normalised latent, plus one rotary key head shared by all heads; the softmax
    scale of the config (YaRN's mscale included). Decoding caches the per-head keys and values (``KVCache``, its
    values ``v_head_dim`` wide). Under context parallelism (``context_parallel``, as the decoder's ``Attention``)
    every head's q, k (the shared rotary key expanded) and v go through ``context_parallel.attention`` with the
    config's scale: Ulysses splits the heads, ring sends k and v around (v narrower than q and k)."""

    #: Set by npu_fsdp under context parallelism (``lightning_npu.parallel.context.ContextParallel``).
    context_parallel = None

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.interleaved = config.rope_interleave
        self.scale = config.softmax_scale
        q_out = config.n_heads * config.qk_head_dim
        if config.q_lora_rank is None:
            self.wq = Linear(config.dim, q_out)
        else:
            self.wq_a = Linear(config.dim, config.q_lora_rank)
            self.q_norm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = Linear(config.q_lora_rank, q_out)
        self.wkv_a = Linear(config.dim, config.kv_lora_rank + config.qk_rope_head_dim)
        self.kv_norm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = Linear(config.kv_lora_rank, config.n_heads * (config.qk_nope_head_dim + config.v_head_dim))
        self.wo = Linear(config.n_heads * config.v_head_dim, config.dim)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: Optional[KVCache] = None,
        layer: int = 0,
        start_pos: int = 0,
        cu_seqlens: Optional[list[int]] = None,
    ) -> Tensor:
        batch, seq, _ = x.shape
        rows, length = (1, batch * seq) if cu_seqlens is not None else (batch, seq)
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        # Heads as -1: under tensor parallelism each rank holds n_heads / tp of them (wq / wq_b, wkv_b split by heads).
        q_nope, q_rot = q.view(rows, length, -1, self.nope + self.rope).split((self.nope, self.rope), dim=-1)
        latent, k_rot = self.wkv_a(x).view(rows, length, -1).split((self.kv_rank, self.rope), dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(rows, length, -1, self.nope + self.v_dim)
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
        k_rot = k_rot.view(rows, length, 1, self.rope)
        if self.interleaved:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q = torch.cat((q_nope, apply_rotary(q_rot, cos, sin)), dim=-1)
        k_rot = apply_rotary(k_rot, cos, sin)
        k = torch.cat((k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        if cache is not None:
            k, v = cache.update(layer, k, v, start_pos)
            k, v = k.to(q.dtype), v.to(q.dtype)  # a cache from the parameters is fp32 under autocast
        out = attend(q, k, v, batch, seq, cu_seqlens=cu_seqlens, context_parallel=self.context_parallel,
                     scale=self.scale)
        return self.wo(out.reshape(batch, seq, -1))


class DeepSeekBlock(DecoderBlock):
    """One layer: MLA, then a dense SwiGLU MLP (the first ``first_k_dense`` layers) or DeepSeekMoE."""

    def __init__(self, config: DeepSeekConfig, layer_id: int) -> None:
        if layer_id >= config.first_k_dense:  # the trunk's MoE layers and the multi-token-prediction ones
            feed_forward: nn.Module = MoEFeedForward(
                config.dim, config.n_experts, config.expert_hidden_dim, config.routing,
                shared_hidden_dim=config.shared_expert_hidden_dim, shared_gate=False,
                balancing_bias=config.architecture == "deepseek_v3",
            )
        else:
            feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)
        super().__init__(layer_id, config.dim, config.norm_eps, MLAttention(config), feed_forward)


def yarn_frequencies(config: DeepSeekConfig, device: Optional[torch.device] = None) -> Tensor:
    """The rotary inverse frequency of each channel pair [qk_rope_head_dim // 2], fp32, by YaRN when
    ``config.rope_scaling`` is set (transformers' ``_compute_yarn_parameters``, step for step): the interpolated
    ``1 / (factor * base ** (2i / d))`` below the correction range, the plain ones above, a linear ramp between."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    if config.rope_scaling is None:
        return 1.0 / pos_freqs
    s = config.rope_scaling
    factor, length = s["factor"], s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class MultiTokenPrediction(nn.Module):
    """One depth of DeepSeek-V3's multi-token prediction: ``block(eh_proj([enorm(embedded); hnorm(h)]))`` for the
    previous depth's hidden state ``h`` and the embedding of the tokens one step further ahead; ``norm`` precedes
    the shared output head (HF ``shared_head.norm``)."""

    def __init__(self, config: DeepSeekConfig, depth: int) -> None:
        super().__init__()
        self.enorm = RMSNorm(config.dim, config.norm_eps)
        self.hnorm = RMSNorm(config.dim, config.norm_eps)
        self.eh_proj = Linear(2 * config.dim, config.dim)
        # layer_id past the trunk's: it is never given a KV cache (generation does not run it).
        self.block = DeepSeekBlock(config, config.n_layers + depth)
        self.norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, h: Tensor, embedded: Tensor, cos: Tensor, sin: Tensor, bounds: Optional[list[int]]) -> Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(h)), dim=-1))
        return self.block(x, cos, sin, None, 0, bounds)


class DeepSeek(RoutedDecoder):
    """DeepSeek-V3 / V2 decoder: token ids [batch, seq] -> next-token logits [batch, seq, vocab] (fp32).

    With ``mtp_layers`` a training forward also runs the multi-token-prediction depths on the trunk's last hidden
    state (inputs rolled ahead by the depth, positions not), keeping their logits for ``multi_token_loss``."""

    #: Set by npu_fsdp under context parallelism (``lightning_npu.parallel.context.ContextParallel``): the depths read
    #: tokens ahead, which a context-parallel rank's part lacks, so a training forward with them refuses it.
    context_parallel = None

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__(config, (DeepSeekBlock(config, i) for i in range(config.n_layers)))
        if config.mtp_layers:
            self.mtp = nn.ModuleList(MultiTokenPrediction(config, k) for k in range(config.mtp_layers))
        self._ahead: Optional[tuple] = None
        #: The last training forward's logits of each MTP depth [batch, seq, vocab] and the sample ends of its tokens.
        self.mtp_logits: Optional[list[Tensor]] = None
        self._sample_ends: Optional[Tensor] = None

    def parallel_plan(self) -> ParallelPlan:
        """``CausalDecoder.parallel_plan`` with MLA's tensor-parallel plan (``tensor_parallel.py``)."""
        return decoder_parallel_plan(self, mla_attention_plan)

    def rotary_cos_sin(self, device: Optional[torch.device] = None) -> tuple[Tensor, Tensor]:
        """fp32 cos/sin [max_seq_len, qk_rope_head_dim] (halves layout), times YaRN's attention factor."""
        positions = torch.arange(self.config.max_seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(positions, yarn_frequencies(self.config, device))
        angles = torch.cat((angles, angles), dim=-1)
        factor = self.config.rope_attention_factor
        return angles.cos() * factor, angles.sin() * factor

    def embed(self, tokens, cache, start_pos, cu_seqlens, position_ids):
        """``CausalDecoder.embed``; a training forward with MTP keeps what the depths take for ``logits``."""
        trains_mtp = self.training and self.config.mtp_layers and cache is None
        if trains_mtp and self.context_parallel is not None:
            raise ValueError(self.config.context_parallel_refusal())
        out = super().embed(tokens, cache, start_pos, cu_seqlens, position_ids)
        self._ahead = (tokens, *out[1:]) if trains_mtp else None
        return out

    def logits(self, h: Tensor) -> Tensor:
        if self._ahead is not None:
            tokens, cos, sin, bounds = self._ahead
            self._ahead = None
            self.mtp_logits = []
            hidden, flat = h, tokens.flatten()
            for k, depth in enumerate(self.mtp, start=1):
                # Token i + k at position i; the last k of each row or sample are masked in the loss.
                ahead = self.tok_embeddings(flat.roll(-k).view_as(tokens))
                hidden = depth(hidden, ahead, cos, sin, bounds)
                self.mtp_logits.append(self.output(depth.norm(hidden)).float())
            self._sample_ends = _sample_ends(tokens, bounds)
        return super().logits(h)

    def multi_token_loss(self, labels: Tensor) -> Tensor:
        """``mtp_loss_weight`` x the mean over depths of each depth's cross-entropy against ``labels`` (the
        next-token labels of the last forward, -100 ignored) moved k ahead, its targets past the end of a row or
        sample ignored; 0 when the last forward ran no MTP (evaluation, or ``mtp_layers`` 0)."""
        if not self.mtp_logits:
            return self.no_loss()
        flat, index = labels.flatten(), torch.arange(labels.numel(), device=labels.device)
        losses = []
        for k, logits in enumerate(self.mtp_logits, start=1):
            target = flat.roll(-k).masked_fill(index + k >= self._sample_ends, -100)
            losses.append(F.cross_entropy(logits.flatten(0, 1), target))
        self.mtp_logits = None
        return self.config.mtp_loss_weight * torch.stack(losses).mean()


def _sample_ends(tokens: Tensor, bounds: Optional[list[int]]) -> Tensor:
    """The flat index one past the end of each token's row (or, for packed rows, its sample) [batch * seq]."""
    batch, seq = tokens.shape
    index = torch.arange(batch * seq, device=tokens.device)
    if bounds is None:
        return (index // seq + 1) * seq
    lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=tokens.device)
    return torch.tensor(bounds[1:], device=tokens.device).repeat_interleave(lengths)
