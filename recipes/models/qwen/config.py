"""Qwen2 / Qwen2.5 and Qwen3 dense decoder hyper-parameters, named presets, and parameter / FLOP counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from recipes.decoder.config_dict import ConfigDict
from recipes.decoder.rope_scaling import normalise_rope_scaling

#: The Hugging Face architectures of the family (``QwenConfig.architecture``: their ``config.json`` model_type).
#: Qwen2 (and Qwen2.5, which is Qwen2's architecture) has query/key/value biases; Qwen3 has none, and an RMSNorm
#: over each query and key head before rotary instead.
ARCHITECTURES = ("qwen3", "qwen2")


@dataclass
class QwenConfig(ConfigDict):
    """Shape of a Qwen2 or Qwen3 dense decoder: LLaMA's block (grouped-query attention, rotary with base
    ``rope_theta`` and optionally LLaMA-3.1's ``rope_scaling``, SwiGLU MLP) with a free ``head_dim`` (None:
    ``dim // n_heads``; Qwen3-32B has 64 heads of 128 on a 5120 stream), q/k/v biases (``qwen2``) or per-head q/k
    RMSNorms (``qwen3``), and ``tie_embeddings`` (the small Qwen models tie the output to the embedding)."""

    architecture: str = "qwen3"
    vocab_size: int = 151936
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    ffn_hidden_dim: int = 12288
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: Optional[dict[str, Any]] = None
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None and isinstance(self.dim, int) and isinstance(self.n_heads, int) and self.n_heads > 0:
            self.head_dim = self.dim // self.n_heads
        if self.rope_scaling is not None:
            self.rope_scaling = normalise_rope_scaling(self.rope_scaling, "QwenConfig.rope_scaling")
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field, why, and what would work."""
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"QwenConfig.architecture={self.architecture!r} is unknown; choose one of {ARCHITECTURES} (Qwen2.5 is"
                " 'qwen2')."
            )
        self.require_positive(
            ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden_dim", "max_seq_len"),
            ("norm_eps", "rope_theta"),
        )
        self.require_grouped_heads()
        if self.head_dim % 2:
            raise ValueError(f"QwenConfig.head_dim={self.head_dim} is odd; rotary embeddings rotate channel pairs.")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"QwenConfig.tie_embeddings={self.tie_embeddings!r} is invalid: it must be true or false.")

    @property
    def qkv_bias(self) -> bool:
        """Whether the query, key and value projections have biases (Qwen2)."""
        return self.architecture == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Whether attention normalises each query and key head before rotary (Qwen3)."""
        return self.architecture == "qwen3"

    def num_params(self, include_embedding: bool = True) -> int:
        """Number of parameters; ``include_embedding=False`` leaves out the input embedding table (as
        ``LLaMAConfig.num_params``); tied embeddings count once, as the output projection."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * q_dim + 2 * self.dim * kv_dim
        attention += (q_dim + 2 * kv_dim) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        block = attention + 3 * self.dim * self.ffn_hidden_dim + 2 * self.dim
        total = self.n_layers * block + self.dim + self.vocab_size * self.dim
        if include_embedding and not self.tie_embeddings:
            total += self.vocab_size * self.dim
        return total

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs per token at ``seq_len`` (default ``max_seq_len``): ``6 x`` the non-embedding parameters
        plus ``12 * n_layers * seq_len * n_heads * head_dim`` for attention (``LLaMAConfig``'s accounting)."""
        seq_len = self.max_seq_len if seq_len is None else seq_len
        return 6 * self.num_params(include_embedding=False) + 12 * self.n_layers * seq_len * self.n_heads * self.head_dim

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "QwenConfig":
        """A named preset (``PRESETS``) with some fields replaced, e.g. ``from_preset("qwen3-8b", max_seq_len=2048)``."""
        if name not in PRESETS:
            raise ValueError(f"Unknown Qwen preset {name!r}; the presets are {sorted(PRESETS)}.")
        return cls.from_dict({**PRESETS[name], **overrides})


# The tiny preset runs on a laptop CPU: the vocabulary of the tokenizer in recipes/assets/tokenizer (2048 entries),
# grouped-query attention, Qwen3's q/k norms and a head_dim (48) that is not dim / n_heads (32).
# Real sizes: the shapes of the facts sheet's table (docs: model-families-facts.md section 4, from MindSpeed-LLM's
# scripts), unverified field by field against the downloads; tests/test_qwen_model.py checks that transformers'
# model of each shape has exactly num_params() parameters and that it is the published size. convert.py from-hf
# reads a downloaded config.json, and init_from refuses a preset that differs from it, naming both.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        architecture="qwen3", vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=48,
        ffn_hidden_dim=352, max_seq_len=256, tie_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        architecture="qwen2", vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
        ffn_hidden_dim=18944, max_seq_len=32768, rope_theta=1000000.0,
    ),
    "qwen3-8b": dict(
        architecture="qwen3", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
        ffn_hidden_dim=12288, max_seq_len=40960, rope_theta=1000000.0,
    ),
    "qwen3-32b": dict(
        architecture="qwen3", vocab_size=151936, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
        ffn_hidden_dim=25600, max_seq_len=40960, rope_theta=1000000.0,
    ),
}
