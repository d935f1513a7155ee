"""LLaMA-2 and LLaMA-3 architecture hyper-parameters, named presets, and parameter / FLOP counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from recipes.decoder.config_dict import ConfigDict
from recipes.decoder.rope_scaling import normalise_rope_scaling

@dataclass
class LLaMAConfig(ConfigDict):
    """Shape of a LLaMA decoder. ``n_kv_heads`` < ``n_heads`` gives grouped-query attention;
    ``None`` means ``n_heads`` (multi-head attention, as in LLaMA-2 7B and 13B).

    ``rope_theta`` is the rotary base (LLaMA-2 10000, LLaMA-3 500000). ``rope_scaling``, when set, stretches the
    rotary wavelengths by LLaMA-3.1's "llama3" rule: a mapping of ``factor``, ``low_freq_factor``,
    ``high_freq_factor`` and ``original_max_position_embeddings`` (optionally ``rope_type: llama3``), stored
    normalised with ``rope_type``. ``tie_embeddings`` makes the output projection the token embedding matrix
    (one parameter, as in LLaMA-3.2 1B and 3B). The defaults are LLaMA-2's."""

    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    ffn_hidden_dim: int = 11008
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.rope_scaling is not None:
            self.rope_scaling = normalise_rope_scaling(self.rope_scaling, "LLaMAConfig.rope_scaling")
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field, why, and what would work."""
        self.require_positive(
            ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "max_seq_len"),
            ("norm_eps", "rope_theta"),
        )
        if self.dim % self.n_heads:
            raise ValueError(
                f"LLaMAConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}: every head gets "
                f"dim // n_heads channels. Pick n_heads among the divisors of {self.dim}."
            )
        self.require_grouped_heads()
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim // n_heads = {self.head_dim} is odd; rotary embeddings rotate channel pairs, "
                "so head_dim must be even. Change dim or n_heads."
            )
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"LLaMAConfig.tie_embeddings={self.tie_embeddings!r} is invalid: it must be true or false.")

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.dim // self.n_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Number of parameters. ``include_embedding=False`` leaves out the input embedding table (but
        keeps the output projection, which costs FLOPs), the convention for FLOP counts. With tied embeddings the
        one shared matrix is counted once, as the output projection."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = self.dim * self.dim * 2 + self.dim * kv_dim * 2  # wq, wo, wk, wv
        mlp = 3 * self.dim * self.ffn_hidden_dim
        norms = 2 * self.dim
        total = self.n_layers * (attention + mlp + norms) + self.dim + self.vocab_size * self.dim
        if include_embedding and not self.tie_embeddings:  # tied: the output projection is the embedding table
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

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "LLaMAConfig":
        """A named preset (``PRESETS`` or ``LLAMA3_PRESETS``) with some fields replaced, e.g.
        ``from_preset("7b", max_seq_len=2048)``."""
        table = PRESETS if name in PRESETS else LLAMA3_PRESETS
        if name not in table:
            raise ValueError(
                f"Unknown LLaMA preset {name!r}; the presets are {sorted(PRESETS)} (LLaMA-2) and "
                f"{sorted(LLAMA3_PRESETS)} (LLaMA-3 family)."
            )
        values = dict(table[name])
        values.update(overrides)
        return cls.from_dict(values)


# The tiny preset runs on a laptop CPU. Its vocabulary matches the tokenizer shipped in
# recipes/assets/tokenizer (2048 entries) and n_kv_heads < n_heads exercises the GQA paths.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=352, max_seq_len=256),
    "7b": dict(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden_dim=11008, max_seq_len=4096
    ),
    "13b": dict(
        vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_hidden_dim=13824, max_seq_len=4096
    ),
    # LLaMA-2-70B: grouped-query attention (8 KV heads), the published shape (Llama-2-70b-hf config.json:
    # hidden 8192, 80 layers, 64 heads, 8 KV heads, intermediate 28672): 68,976,648,192 parameters.
    "70b": dict(
        vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672, max_seq_len=4096
    ),
}


# LLaMA-3 family presets. The checkpoints' config.json files are not in the installed packages (nothing is
# downloaded), so each number names its source (docs: finetune-facts.md section 2):
#   * vocab_size 128256, n_kv_heads 8 and rope_theta 500000: transformers' Mllama text-model defaults
#     (transformers/models/mllama/configuration_mllama.py), the LLaMA-3.1 text decoder. Verified there.
#   * dim 4096 / 32 layers / 32 heads / ffn 14336 / norm_eps 1e-5 for 8B: the published 8B shape; its parameter
#     count, 8,030,261,248, is what a transformers LlamaForCausalLM of this shape holds (tests/test_llama3.py
#     builds it on the meta device), and matches Meta's "8B". The per-field values: unverified here.
#   * 3.1 scaling factor 8, low 1, high 4, original length 8192, and max_seq_len 131072: third-party copy,
#     unverified (Lightning-AI/litgpt litgpt/config.py).
#   * 3.2-1B: head_dim 64 (2048 / 32 heads), scaling factor 32, tied embeddings: third-party copy, unverified
#     (kevinstephano/thunder_model_blocks hf_llama/llama_config.py); 1,235,814,400 parameters with the tie.
#   * 3.2-3B: 24 heads, dim 3072, tied embeddings: third-party copy, unverified (LocalResearchGroup/llm-foundry
#     llmfoundry/models/llama/config.py); 28 layers and ffn 8192: unverified; 3,212,749,824 parameters.
#   * 3.2 low/high factors 1/4 and original length 8192 (as 3.1): unverified.
#   * LLaMA-3 (3.0) 8B: no scaling, max_seq_len 8192: unverified.
# To check against a downloaded checkpoint: convert.py from-hf reads its config.json, and init_from refuses a
# preset that differs from it, naming both.
_LLAMA3_BASE: dict[str, Any] = dict(vocab_size=128256, n_kv_heads=8, norm_eps=1e-5, rope_theta=500000.0)
_LLAMA31_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA32_SCALING = dict(_LLAMA31_SCALING, factor=32.0)
_LLAMA3_8B = dict(_LLAMA3_BASE, dim=4096, n_layers=32, n_heads=32, ffn_hidden_dim=14336)
LLAMA3_PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(_LLAMA3_8B, max_seq_len=8192),
    "llama3.1-8b": dict(_LLAMA3_8B, max_seq_len=131072, rope_scaling=_LLAMA31_SCALING),
    "llama3.2-1b": dict(
        _LLAMA3_BASE, dim=2048, n_layers=16, n_heads=32, ffn_hidden_dim=8192, max_seq_len=131072,
        rope_scaling=_LLAMA32_SCALING, tie_embeddings=True,
    ),
    "llama3.2-3b": dict(
        _LLAMA3_BASE, dim=3072, n_layers=28, n_heads=24, ffn_hidden_dim=8192, max_seq_len=131072,
        rope_scaling=_LLAMA32_SCALING, tie_embeddings=True,
    ),
}
