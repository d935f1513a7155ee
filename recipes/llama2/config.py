"""LLaMA-2 architecture hyper-parameters, named presets, and parameter / FLOP counts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional


@dataclass
class LLaMAConfig:
    """Shape of a LLaMA-2 decoder. ``n_kv_heads`` < ``n_heads`` gives grouped-query attention;
    ``None`` means ``n_heads`` (multi-head attention, as in LLaMA-2 7B and 13B)."""

    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    ffn_hidden_dim: int = 11008
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field, why, and what would work."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LLaMAConfig.{name}={value!r} is invalid: it must be a positive integer.")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"LLaMAConfig.{name}={value!r} is invalid: it must be a positive number.")
        if self.dim % self.n_heads:
            raise ValueError(
                f"LLaMAConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}: every head gets "
                f"dim // n_heads channels. Pick n_heads among the divisors of {self.dim}."
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LLaMAConfig.n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}: grouped-query "
                f"attention shares each key/value head among n_heads // n_kv_heads query heads. "
                f"Pick n_kv_heads among the divisors of {self.n_heads}."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim // n_heads = {self.head_dim} is odd; rotary embeddings rotate channel pairs, "
                "so head_dim must be even. Change dim or n_heads."
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.dim // self.n_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Number of parameters. ``include_embedding=False`` leaves out the input embedding table (but
        keeps the output projection, which costs FLOPs), the convention for FLOP counts."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = self.dim * self.dim * 2 + self.dim * kv_dim * 2  # wq, wo, wk, wv
        mlp = 3 * self.dim * self.ffn_hidden_dim
        norms = 2 * self.dim
        total = self.n_layers * (attention + mlp + norms) + self.dim + self.vocab_size * self.dim
        if include_embedding:
            total += self.vocab_size * self.dim
        return total

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs per token (forward + backward) at ``seq_len`` (default ``max_seq_len``).

        ``6 * N`` for the weight matmuls, N = ``num_params(include_embedding=False)``, plus
        ``12 * n_layers * seq_len * dim`` for attention scores and weighted values. This is the PaLM
        (appendix B) and torchtitan accounting: the causal mask's skipped half is still counted, so MFU
        figures compare with published ones.
        """
        seq_len = self.max_seq_len if seq_len is None else seq_len
        return 6 * self.num_params(include_embedding=False) + 12 * self.n_layers * seq_len * self.dim

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (what checkpoints store)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "LLaMAConfig":
        """Inverse of ``to_dict``; unknown keys are an error so typos are not silently dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown LLaMAConfig field(s) {unknown}; the fields are {sorted(known)}.")
        return cls(**dict(values))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "LLaMAConfig":
        """A named preset (see ``PRESETS``) with some fields replaced, e.g. ``from_preset("7b", max_seq_len=2048)``."""
        if name not in PRESETS:
            raise ValueError(f"Unknown LLaMA preset {name!r}; the presets are {sorted(PRESETS)}.")
        values = dict(PRESETS[name])
        values.update(overrides)
        return cls.from_dict(values)


# The tiny preset runs on a laptop CPU. Its vocabulary matches the tokenizer shipped in
# recipes/llama2/assets/tokenizer (2048 entries) and n_kv_heads < n_heads exercises the GQA paths.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=352, max_seq_len=256),
    "7b": dict(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden_dim=11008, max_seq_len=4096
    ),
    "13b": dict(
        vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_hidden_dim=13824, max_seq_len=4096
    ),
}
