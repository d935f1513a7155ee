"""Mixture-of-Experts decoder hyper-parameters (Mixtral, Qwen2-MoE, Qwen3-MoE), named presets, and parameter / FLOP
counts (total, and active: what one token runs through)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from recipes.decoder.config_dict import ConfigDict

#: The Hugging Face architectures the family follows (``MoEConfig.architecture``: their ``config.json``
#: model_type), and what each fixes: Mixtral always renormalises the top-k gates and has neither shared experts,
#: dense layers nor biases; Qwen3-MoE adds per-head q/k norms and has no shared expert; Qwen2-MoE may have all.
ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass
class MoEConfig(ConfigDict):
    """Shape of a decoder whose MLPs are token-choice top-k Mixtures of Experts.

    Attention is LLaMA's (grouped-query, rotary with base ``rope_theta``), with ``head_dim`` free (None:
    ``dim // n_heads``), query/key/value biases with ``qkv_bias`` (Qwen2-MoE) and per-head q/k RMSNorms for the
    ``qwen3_moe`` architecture. Each MoE layer routes every token to ``top_k`` of ``n_experts`` SwiGLU experts of
    width ``expert_hidden_dim``: softmax over all experts (fp32), the top k, renormalised to sum to 1 with
    ``norm_topk_prob`` (always, in Mixtral). ``shared_expert_hidden_dim`` > 0 adds Qwen2-MoE's shared expert, a
    SwiGLU MLP every token runs, scaled by ``sigmoid(x . w)``. Layer i is an MoE layer unless it is in
    ``dense_layers`` (HF ``mlp_only_layers``) or ``(i + 1) % sparse_step != 0`` (HF ``decoder_sparse_step``);
    the others are dense SwiGLU MLPs of width ``dense_hidden_dim``. ``router_aux_loss_coef`` > 0 adds that
    multiple of the load-balancing loss to the training loss (HF: ``router_aux_loss_coef`` with
    ``output_router_logits``). ``router_bias_update_rate`` > 0 balances the load without a loss instead, or beside it
    (DeepSeek-V3's auxiliary-loss-free balancing): each MoE layer's router keeps a per-expert bias that is added to
    the scores for the top-k choice only (the gate weights stay the softmax's), and after every optimizer step moves
    by that rate towards balance (up for experts that got fewer than the mean tokens, down for the others).
    """

    architecture: str = "qwen3_moe"
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    n_experts: int = 8
    top_k: int = 2
    expert_hidden_dim: int = 14336
    norm_topk_prob: bool = True
    shared_expert_hidden_dim: int = 0
    dense_hidden_dim: Optional[int] = None
    dense_layers: list[int] = field(default_factory=list)
    sparse_step: int = 1
    qkv_bias: bool = False
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    tie_embeddings: bool = False
    router_aux_loss_coef: float = 0.0
    router_bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None and isinstance(self.dim, int) and isinstance(self.n_heads, int) and self.n_heads > 0:
            self.head_dim = self.dim // self.n_heads
        if isinstance(self.dense_layers, (list, tuple)):
            self.dense_layers = sorted(set(self.dense_layers))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field, why, and what would work."""
        where = "MoEConfig"
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"{where}.architecture={self.architecture!r} is unknown; choose one of {ARCHITECTURES}.")
        self.require_positive(
            ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts", "top_k",
             "expert_hidden_dim", "sparse_step", "max_seq_len"),
            ("norm_eps", "rope_theta"),
        )
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
            raise ValueError(f"{where}.router_aux_loss_coef={coef!r} is invalid: it must be a number >= 0 (0: no loss).")
        rate = self.router_bias_update_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate < 0:
            raise ValueError(f"{where}.router_bias_update_rate={rate!r} is invalid: it must be a number >= 0 (0: no"
                             " balancing bias; DeepSeek-V3 uses 0.001).")
        for name in ("norm_topk_prob", "qkv_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{where}.{name}={getattr(self, name)!r} is invalid: it must be true or false.")
        shared = self.shared_expert_hidden_dim
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(f"{where}.shared_expert_hidden_dim={shared!r} is invalid: give its width, or 0 for none.")
        if self.top_k > self.n_experts:
            raise ValueError(
                f"{where}.top_k={self.top_k} exceeds n_experts={self.n_experts}: each token picks top_k distinct "
                "experts. Lower top_k or add experts."
            )
        self.require_grouped_heads()
        if self.head_dim % 2:
            raise ValueError(f"{where}.head_dim={self.head_dim} is odd; rotary embeddings rotate channel pairs.")
        layers = self.dense_layers
        if not isinstance(layers, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
            raise ValueError(f"{where}.dense_layers={layers!r} is invalid: give a list of layer indices.")
        if any(not 0 <= i < self.n_layers for i in layers):
            raise ValueError(f"{where}.dense_layers={layers} holds indices outside 0 .. n_layers - 1 = {self.n_layers - 1}.")
        if not self.moe_layers:
            raise ValueError(
                f"{where}: dense_layers={layers} and sparse_step={self.sparse_step} leave no MoE layer among the "
                f"{self.n_layers}; that is a dense model."
            )
        dense = self.dense_hidden_dim
        if len(self.moe_layers) < self.n_layers and (isinstance(dense, bool) or not isinstance(dense, int) or dense <= 0):
            raise ValueError(
                f"{where}.dense_hidden_dim={dense!r}: layers {self.dense_layer_indices} are dense (dense_layers, "
                "sparse_step), so give their MLP width as a positive integer."
            )
        self._check_architecture()

    def _check_architecture(self) -> None:
        arch, where = self.architecture, f"MoEConfig (architecture={self.architecture!r})"
        if arch == "mixtral":
            fixed = {"norm_topk_prob": True, "shared_expert_hidden_dim": 0, "dense_layers": [], "sparse_step": 1,
                     "qkv_bias": False}
        elif arch == "qwen3_moe":
            fixed = {"shared_expert_hidden_dim": 0, "qkv_bias": False}
        else:
            fixed = {}
        for name, value in fixed.items():
            if getattr(self, name) != value:
                raise ValueError(
                    f"{where}: {name}={getattr(self, name)!r}, but {arch} models have {name}={value!r}. Set it so, or"
                    f" pick the architecture that has it (qwen2_moe: shared experts, dense layers, qkv biases)."
                )

    @property
    def qk_norm(self) -> bool:
        """Whether attention normalises each query and key head (Qwen3-MoE)."""
        return self.architecture == "qwen3_moe"

    @property
    def routing(self) -> Any:
        """How the MoE layers pick and weigh experts (``router.Routing``): softmax top_k, renormalised with
        ``norm_topk_prob``."""
        from recipes.decoder.router import Routing  # here: the planner reads this module without torch

        return Routing(self.top_k, normalise=self.norm_topk_prob)

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers whose MLP is a Mixture of Experts (HF's rule)."""
        return [i for i in range(self.n_layers) if i not in self.dense_layers and (i + 1) % self.sparse_step == 0]

    @property
    def dense_layer_indices(self) -> list[int]:
        """Indices of the layers whose MLP is dense."""
        return [i for i in range(self.n_layers) if i not in self.moe_layers]

    def _block_params(self, experts: int) -> tuple[int, int]:
        """(parameters of one MoE layer running ``experts`` routed experts, of one dense layer), norms included."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * q_dim + 2 * self.dim * kv_dim
        attention += (q_dim + 2 * kv_dim) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        norms = 2 * self.dim
        shared = 3 * self.dim * self.shared_expert_hidden_dim + (self.dim if self.shared_expert_hidden_dim else 0)
        moe = self.n_experts * self.dim + experts * 3 * self.dim * self.expert_hidden_dim + shared
        dense = 3 * self.dim * (self.dense_hidden_dim or 0)
        return attention + norms + moe, attention + norms + dense

    def _params(self, experts: int, include_embedding: bool) -> int:
        moe, dense = self._block_params(experts)
        total = len(self.moe_layers) * moe + len(self.dense_layer_indices) * dense
        total += self.dim + self.vocab_size * self.dim  # final norm, output projection
        if include_embedding and not self.tie_embeddings:
            total += self.vocab_size * self.dim
        return total

    def num_params(self, include_embedding: bool = True) -> int:
        """Number of parameters, every expert counted. ``include_embedding=False`` leaves out the input embedding
        table (as ``LLaMAConfig.num_params``); tied embeddings count once, as the output projection."""
        return self._params(self.n_experts, include_embedding)

    def active_params(self, include_embedding: bool = True) -> int:
        """Parameters one token runs through: the top_k routed experts of each MoE layer (plus the shared expert
        and the router), not all n_experts."""
        return self._params(self.top_k, include_embedding)

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs per token at ``seq_len`` (default ``max_seq_len``): ``6 x`` the active non-embedding
        parameters plus ``12 * n_layers * seq_len * n_heads * head_dim`` for attention (``LLaMAConfig``'s
        accounting)."""
        seq_len = self.max_seq_len if seq_len is None else seq_len
        attention = 12 * self.n_layers * seq_len * self.n_heads * self.head_dim
        return 6 * self.active_params(include_embedding=False) + attention

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "MoEConfig":
        """A named preset (``PRESETS``) with some fields replaced, e.g. ``from_preset("tiny", n_experts=4)``."""
        if name not in PRESETS:
            raise ValueError(f"Unknown MoE preset {name!r}; the presets are {sorted(PRESETS)}.")
        return cls.from_dict({**PRESETS[name], **overrides})


# The tiny preset runs on a laptop CPU: the vocabulary of the tokenizer in recipes/assets/tokenizer (2048 entries),
# grouped-query attention, 8 experts of which each token takes 2, Qwen3-MoE's q/k norms.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        architecture="qwen3_moe", vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, n_experts=8,
        top_k=2, expert_hidden_dim=96, max_seq_len=256, router_aux_loss_coef=0.001,
    ),
    # Real sizes. The shapes are those of the models' published config.json files as remembered here (nothing is
    # downloaded), unverified field by field; what is checked (tests/test_moe_model.py): transformers' model of
    # each shape has exactly num_params() parameters, and the totals and active counts are the published ones
    # (Mixtral-8x7B: 46.7B total, 12.9B active; Qwen3-30B-A3B: 30.5B total, 3.3B active). convert.py from-hf
    # reads the downloaded config.json, and init_from refuses a preset that differs from it, naming both.
    "mixtral-8x7b": dict(
        architecture="mixtral", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, n_experts=8,
        top_k=2, expert_hidden_dim=14336, max_seq_len=32768, norm_eps=1e-5, rope_theta=1000000.0,
    ),
    "qwen3-30b-a3b": dict(
        architecture="qwen3_moe", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
        n_experts=128, top_k=8, expert_hidden_dim=768, max_seq_len=40960, norm_eps=1e-6, rope_theta=1000000.0,
    ),
}
