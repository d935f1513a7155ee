"""DeepSeek-V3 and DeepSeek-V2 decoder hyper-parameters (Multi-head Latent Attention, DeepSeekMoE), named presets, and
parameter / FLOP counts (total, and active: what one token runs through). Torch-free: the planner reads it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from recipes.decoder.config_dict import ConfigDict

#: The Hugging Face architectures of the family (``DeepSeekConfig.architecture``: their ``config.json``
#: model_type). V3 (also DeepSeek-R1, Moonlight, Kimi-K2) scores experts by sigmoid with a correction bias for the
#: choice and groups scored by their two best experts; V2 by softmax, groups scored by their best expert, never
#: renormalised (transformers ignores V2's ``norm_topk_prob``), and no bias.
ARCHITECTURES = ("deepseek_v3", "deepseek_v2")

#: YaRN rotary scaling (``rope_scaling``), transformers' keys and their defaults (None: not set).
YARN_KEYS: dict[str, Any] = {
    "factor": None, "original_max_position_embeddings": None, "beta_fast": 32.0, "beta_slow": 1.0,
    "mscale": None, "mscale_all_dim": None, "attention_factor": None, "truncate": True,
}


def yarn_mscale(factor: float, mscale: Optional[float] = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1), as transformers' ``yarn_get_mscale``."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class DeepSeekConfig(ConfigDict):
    """Shape of a DeepSeek-V3 or V2 decoder.

    Attention is MLA: queries from ``q_lora_rank`` (None: one projection; else a down-projection, an RMSNorm and an
    up-projection) give each of ``n_heads`` heads ``qk_nope_head_dim`` + ``qk_rope_head_dim`` channels; keys and
    values come from one ``kv_lora_rank`` latent (RMSNorm'd, then up-projected per head to ``qk_nope_head_dim`` key
    and ``v_head_dim`` value channels) plus one rotary key head of ``qk_rope_head_dim`` shared by every head. Rotary
    runs on the rope channels only, read as interleaved pairs with ``rope_interleave`` (V2 always), with YaRN when
    ``rope_scaling`` is set (``YARN_KEYS``), which also scales the softmax (``softmax_scale``). The latent norms use
    eps 1e-6 whatever ``norm_eps`` is (as transformers).

    Layers ``0 .. first_k_dense - 1`` have dense SwiGLU MLPs of width ``ffn_hidden_dim``; the others are DeepSeekMoE:
    ``top_k`` of ``n_experts`` routed experts of width ``expert_hidden_dim`` (``routing``: limited to the
    ``topk_group`` best of ``n_group`` groups, weights renormalised with ``norm_topk_prob`` and times
    ``routed_scaling_factor``), plus ``n_shared_experts`` shared experts every token runs (one SwiGLU MLP of width
    ``n_shared_experts * expert_hidden_dim``). V3's router holds ``e_score_correction_bias`` (the recipe's
    ``expert_bias``), added to the scores for the choice only; ``router_bias_update_rate`` > 0 trains it
    (auxiliary-loss-free balancing, DeepSeek-V3 uses 0.001). ``router_aux_loss_coef`` (the sequence-wise auxiliary
    loss) is not implemented and must stay 0.

    ``mtp_layers`` > 0 (V3's ``num_nextn_predict_layers``) adds that many multi-token-prediction modules: depth k
    predicts the token k + 1 ahead from depth k - 1's hidden state and the embedding of the token k ahead, through
    one more DeepSeekMoE layer and the shared output head; training adds ``mtp_loss_weight`` x their mean
    cross-entropy (DeepSeek-V3: 0.3, later 0.1). Generation does not run them.
    """

    architecture: str = "deepseek_v3"
    vocab_size: int = 129280
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    q_lora_rank: Optional[int] = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    ffn_hidden_dim: int = 18432
    n_experts: int = 256
    n_shared_experts: int = 1
    expert_hidden_dim: int = 2048
    top_k: int = 8
    n_group: int = 8
    topk_group: int = 4
    first_k_dense: int = 3
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    rope_interleave: bool = True
    tie_embeddings: bool = False
    router_bias_update_rate: float = 0.0
    router_aux_loss_coef: float = 0.0
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3

    def __post_init__(self) -> None:
        if self.rope_scaling is not None:
            self.rope_scaling = normalise_yarn(self.rope_scaling)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field, why, and what would work."""
        where = "DeepSeekConfig"
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"{where}.architecture={self.architecture!r} is unknown; choose one of {ARCHITECTURES}.")
        self.require_positive(
            ("vocab_size", "dim", "n_layers", "n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim", "ffn_hidden_dim", "n_experts", "expert_hidden_dim", "top_k", "n_group", "topk_group",
             "max_seq_len"),
            ("norm_eps", "rope_theta", "routed_scaling_factor"),
        )
        if self.q_lora_rank is not None:
            self.require_positive(("q_lora_rank",))
        for name in ("n_shared_experts", "first_k_dense", "mtp_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}.{name}={value!r} is invalid: it must be an integer >= 0.")
        for name in ("norm_topk_prob", "rope_interleave", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{where}.{name}={getattr(self, name)!r} is invalid: it must be true or false.")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{where}.qk_rope_head_dim={self.qk_rope_head_dim} is odd; rotary rotates channel pairs.")
        if self.first_k_dense >= self.n_layers:
            raise ValueError(
                f"{where}.first_k_dense={self.first_k_dense} leaves no MoE layer among n_layers={self.n_layers};"
                " that is a dense model. Lower first_k_dense."
            )
        if self.n_experts % self.n_group:
            raise ValueError(f"{where}.n_group={self.n_group} does not divide n_experts={self.n_experts}: the groups"
                             " are equal. Pick n_group among its divisors (1: no group limit).")
        if self.topk_group > self.n_group:
            raise ValueError(f"{where}.topk_group={self.topk_group} exceeds n_group={self.n_group}.")
        if self.top_k > self.topk_group * (self.n_experts // self.n_group):
            raise ValueError(
                f"{where}.top_k={self.top_k} exceeds the {self.topk_group * (self.n_experts // self.n_group)} experts"
                f" of the topk_group={self.topk_group} groups a token may use; raise topk_group or lower top_k."
            )
        if self.architecture == "deepseek_v3" and self.n_group > 1 and self.n_experts // self.n_group < 2:
            raise ValueError(f"{where}: DeepSeek-V3 scores a group by its two best experts, so each of the"
                             f" n_group={self.n_group} groups needs at least 2 of the n_experts={self.n_experts}.")
        for name in ("router_bias_update_rate", "router_aux_loss_coef", "mtp_loss_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{where}.{name}={value!r} is invalid: it must be a number >= 0.")
        if self.router_aux_loss_coef:
            raise ValueError(
                f"{where}.router_aux_loss_coef={self.router_aux_loss_coef}: the sequence-wise auxiliary loss is not"
                " implemented for DeepSeek; balance with router_bias_update_rate (DeepSeek-V3: 0.001) instead."
            )
        if self.architecture == "deepseek_v2":
            if not self.rope_interleave:
                raise ValueError(f"{where}: deepseek_v2 rotates interleaved channel pairs; set rope_interleave=true.")
            if self.norm_topk_prob:
                raise ValueError(f"{where}: deepseek_v2 never renormalises its top-k weights (transformers ignores"
                                 " norm_topk_prob); set norm_topk_prob=false.")
            if self.router_bias_update_rate:
                raise ValueError(f"{where}: deepseek_v2's router has no correction bias, so router_bias_update_rate"
                                 " must be 0; use architecture deepseek_v3 for auxiliary-loss-free balancing.")
            if self.mtp_layers:
                raise ValueError(f"{where}: deepseek_v2 has no multi-token prediction; set mtp_layers=0 or use"
                                 " architecture deepseek_v3.")

    def context_parallel_refusal(self) -> Optional[str]:
        """Why the model cannot train under context parallelism, or None: multi-token prediction's depth k reads the
        token k ahead of each, which for the last k of a rank's part of a sequence another rank holds."""
        if not self.mtp_layers:
            return None
        return (f"model.config.mtp_layers={self.mtp_layers}: multi-token prediction reads the tokens up to"
                f" {self.mtp_layers} ahead of each, which at the end of a rank's part of a sequence another"
                " context-parallel rank holds; train it with context_parallel_size=1, or set mtp_layers=0")

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads after the latent's up-projection: one per query head."""
        return self.n_heads

    @property
    def qk_head_dim(self) -> int:
        """Channels of each query and key head: the non-rotary and the rotary ones."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The query/key head width (what attention's scale and kernels see)."""
        return self.qk_head_dim

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the DeepSeekMoE layers of the trunk (the multi-token-prediction layers are MoE layers too)."""
        return list(range(self.first_k_dense, self.n_layers))

    @property
    def dense_layer_indices(self) -> list[int]:
        """Indices of the layers with a dense MLP."""
        return list(range(self.first_k_dense))

    @property
    def shared_expert_hidden_dim(self) -> int:
        """Width of the shared experts run as one SwiGLU MLP (0: none)."""
        return self.n_shared_experts * self.expert_hidden_dim

    @property
    def routing(self) -> Any:
        """How the MoE layers pick and weigh experts (``recipes.decoder.router.Routing``)."""
        from recipes.decoder.router import Routing  # here: the planner reads this module without torch

        v3 = self.architecture == "deepseek_v3"
        return Routing(self.top_k, normalise=self.norm_topk_prob, scoring="sigmoid" if v3 else "softmax",
                       n_group=self.n_group, topk_group=self.topk_group, group_score="top2" if v3 else "max",
                       scale=float(self.routed_scaling_factor))

    @property
    def rope_attention_factor(self) -> float:
        """YaRN's factor on the rotary cos/sin tables (1 without ``rope_scaling``), as transformers computes it."""
        s = self.rope_scaling
        if s is None:
            return 1.0
        if s["attention_factor"] is not None:
            return float(s["attention_factor"])
        if s["mscale"] and s["mscale_all_dim"]:
            return yarn_mscale(s["factor"], s["mscale"]) / yarn_mscale(s["factor"], s["mscale_all_dim"])
        return yarn_mscale(s["factor"])

    @property
    def softmax_scale(self) -> float:
        """The attention logits' scale: ``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim)``
        squared when ``rope_scaling`` sets ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``: DeepSeek-V3
        0.135234)."""
        scale = self.qk_head_dim ** (-0.5)
        s = self.rope_scaling
        if s is not None and s["mscale_all_dim"]:
            mscale = yarn_mscale(s["factor"], s["mscale_all_dim"])
            scale = scale * mscale * mscale
        return scale

    def _block_params(self, experts: int) -> tuple[int, int]:
        """(parameters of one MoE layer running ``experts`` routed experts, of one dense layer), norms included."""
        heads, qk = self.n_heads, self.qk_head_dim
        if self.q_lora_rank is None:
            query = self.dim * heads * qk
        else:
            query = self.dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
        latent = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        up = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        attention = query + latent + up + heads * self.v_head_dim * self.dim + 2 * self.dim
        moe = self.n_experts * self.dim + (experts + self.n_shared_experts) * 3 * self.dim * self.expert_hidden_dim
        return attention + moe, attention + 3 * self.dim * self.ffn_hidden_dim

    def _params(self, experts: int, include_embedding: bool) -> int:
        moe, dense = self._block_params(experts)
        total = len(self.moe_layers) * moe + self.first_k_dense * dense + self.dim + self.vocab_size * self.dim
        # Each multi-token-prediction module: an MoE layer, eh_proj [dim, 2 dim] and three norms (head shared).
        total += self.mtp_layers * (moe + 2 * self.dim * self.dim + 3 * self.dim)
        if include_embedding and not self.tie_embeddings:
            total += self.vocab_size * self.dim
        return total

    def num_params(self, include_embedding: bool = True) -> int:
        """Number of parameters, every expert counted (``LLaMAConfig.num_params``'s embedding convention)."""
        return self._params(self.n_experts, include_embedding)

    def active_params(self, include_embedding: bool = True) -> int:
        """Parameters one token runs through: the top_k routed experts of each MoE layer, not all n_experts."""
        return self._params(self.top_k, include_embedding)

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs per token at ``seq_len`` (default ``max_seq_len``): ``6 x`` the active non-embedding
        parameters (and the output head once more per MTP depth) plus ``6 * L * seq_len * n_heads * (qk_head_dim +
        v_head_dim)`` over the L = n_layers + mtp_layers layers for the attention scores and their weighted values
        (``LLaMAConfig``'s ``12 * L * S * H * head_dim`` with unequal q/k and v widths)."""
        seq_len = self.max_seq_len if seq_len is None else seq_len
        layers = self.n_layers + self.mtp_layers
        attention = 6 * layers * seq_len * self.n_heads * (self.qk_head_dim + self.v_head_dim)
        heads = self.mtp_layers * self.vocab_size * self.dim  # each MTP depth runs the shared head once more
        return 6 * (self.active_params(include_embedding=False) + heads) + attention

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "DeepSeekConfig":
        """A named preset (``PRESETS``) with some fields replaced."""
        if name not in PRESETS:
            raise ValueError(f"Unknown DeepSeek preset {name!r}; the presets are {sorted(PRESETS)}.")
        return cls.from_dict({**PRESETS[name], **overrides})


def normalise_yarn(scaling: Any) -> dict[str, Any]:
    """``rope_scaling`` checked and stored with every ``YARN_KEYS`` key (``rope_type: yarn``), so configs from a YAML
    file, a checkpoint or a ``config.json`` compare equal."""
    where = "DeepSeekConfig.rope_scaling"
    if not isinstance(scaling, dict):
        raise ValueError(f"{where}={scaling!r} is invalid: give a mapping of YaRN's {sorted(YARN_KEYS)}, or null.")
    values = dict(scaling)
    rope_type = values.pop("rope_type", values.pop("type", "yarn"))
    if rope_type != "yarn":
        raise ValueError(f"{where}.rope_type={rope_type!r} is not implemented: DeepSeek's scaling is 'yarn'.")
    unknown = sorted(set(values) - set(YARN_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}; YaRN takes {sorted(YARN_KEYS)}.")
    out = {"rope_type": "yarn", **YARN_KEYS, **values}
    for key in ("factor", "original_max_position_embeddings"):
        if not isinstance(out[key], (int, float)) or isinstance(out[key], bool) or out[key] <= 0:
            raise ValueError(f"{where}.{key}={out[key]!r} is invalid: it must be a positive number.")
    out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    for key in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        if out[key] is not None:
            out[key] = float(out[key])
    out["truncate"] = bool(out["truncate"])
    return out


_V3_YARN = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                mscale_all_dim=1.0)

# The tiny preset runs on a laptop CPU: the vocabulary of the tokenizer in recipes/assets/tokenizer (2048 entries),
# MLA with a query low rank, 8 routed experts + 1 shared, 2 of 4 groups, the first layer dense.
# Real sizes: the facts sheet's table (docs: model-families-facts.md section 4), unverified field by field against
# the downloads; tests/test_deepseek_model.py checks that transformers' model of each shape has exactly
# num_params() parameters. convert.py from-hf reads a downloaded config.json.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        architecture="deepseek_v3", vocab_size=2048, dim=128, n_layers=3, n_heads=4, q_lora_rank=64,
        kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, ffn_hidden_dim=256, n_experts=8,
        n_shared_experts=1, expert_hidden_dim=64, top_k=2, n_group=4, topk_group=2, first_k_dense=1,
        routed_scaling_factor=2.5, max_seq_len=256, router_bias_update_rate=0.001,
    ),
    "deepseek-v2-lite": dict(
        architecture="deepseek_v2", vocab_size=102400, dim=2048, n_layers=27, n_heads=16, q_lora_rank=None,
        kv_lora_rank=512, ffn_hidden_dim=10944, n_experts=64, n_shared_experts=2, expert_hidden_dim=1408, top_k=6,
        n_group=1, topk_group=1, first_k_dense=1, norm_topk_prob=False, routed_scaling_factor=1.0,
        max_seq_len=163840, rope_scaling=dict(_V3_YARN, mscale=0.707, mscale_all_dim=0.707),
    ),
    "moonlight-16b-a3b": dict(
        architecture="deepseek_v3", vocab_size=163840, dim=2048, n_layers=27, n_heads=16, q_lora_rank=None,
        kv_lora_rank=512, ffn_hidden_dim=11264, n_experts=64, n_shared_experts=2, expert_hidden_dim=1408, top_k=6,
        n_group=1, topk_group=1, first_k_dense=1, routed_scaling_factor=2.446, max_seq_len=8192, norm_eps=1e-5,
        rope_theta=50000.0,
    ),
    "deepseek-v3-671b": dict(max_seq_len=163840, rope_scaling=dict(_V3_YARN)),
}
