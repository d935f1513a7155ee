"""Hugging Face ``LlamaForCausalLM`` checkpoints in and out of the recipe: the name map, ``config.json``,
safetensors / ``pytorch_model.bin`` directories, and the two conversions (``convert.py`` is their command line).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from recipes.llama2.checkpoint_layout import (
    CheckpointError,
    PathLike,
    check_state_dict,
    describe_shape,
    existing_path,
    expected_shapes,
    load_recipe_checkpoint,
    read_recipe_metadata,
    save_recipe_checkpoint,
    some_names,
    tokenizer_from_metadata,
)
from recipes.llama2.config import ROPE_SCALING_KEYS, ROPE_SCALING_TYPE, LLaMAConfig, normalise_rope_scaling
from recipes.llama2.tokenizer import has_tokenizer, load_tokenizer

# Buffers that old HF LLaMA checkpoints saved and that the recipe recomputes.
_HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_HF_EMBEDDING, _HF_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# transformers' rotary base when config.json names none (modeling_rope_utils.py).
DEFAULT_HF_ROPE_THETA = 10000.0


# --------------------------------------------------------------------------------------------------
# Name map
# --------------------------------------------------------------------------------------------------


def hf_name_map(config: LLaMAConfig) -> dict[str, tuple[str, ...]]:
    """Recipe parameter name -> the Hugging Face ``LlamaForCausalLM`` names it is made of (two for
    the fused gate/up projection: gate rows first, then up rows)."""
    names: dict[str, tuple[str, ...]] = {"tok_embeddings.weight": (_HF_EMBEDDING,)}
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        names.update(
            {
                ours + "attention_norm.weight": (theirs + "input_layernorm.weight",),
                ours + "attention.wq.weight": (theirs + "self_attn.q_proj.weight",),
                ours + "attention.wk.weight": (theirs + "self_attn.k_proj.weight",),
                ours + "attention.wv.weight": (theirs + "self_attn.v_proj.weight",),
                ours + "attention.wo.weight": (theirs + "self_attn.o_proj.weight",),
                ours + "ffn_norm.weight": (theirs + "post_attention_layernorm.weight",),
                ours + "feed_forward.w_gate_up.weight": (
                    theirs + "mlp.gate_proj.weight",
                    theirs + "mlp.up_proj.weight",
                ),
                ours + "feed_forward.w_down.weight": (theirs + "mlp.down_proj.weight",),
            }
        )
    names["norm.weight"] = ("model.norm.weight",)
    names["output.weight"] = (_HF_HEAD,)
    return names


def hf_to_recipe_state_dict(hf_state_dict: Mapping[str, Tensor], config: LLaMAConfig) -> dict[str, Tensor]:
    """Rename (and fuse gate/up of) a ``LlamaForCausalLM`` state dict into the recipe's layout.

    Rotary buffers (``rotary_emb.inv_freq``) are dropped; any other unknown name, a missing tensor or
    a shape that disagrees with ``config`` raises ``CheckpointError`` naming the Hugging Face tensor. With
    ``config.tie_embeddings`` the checkpoint may omit ``lm_head.weight`` (Hugging Face saves tied weights once);
    one that has it must hold the embedding matrix there.
    """
    name_map = hf_name_map(config)
    shapes = expected_shapes(config)
    hf_state_dict = dict(hf_state_dict)
    embedding, head = hf_state_dict.get(_HF_EMBEDDING), hf_state_dict.get(_HF_HEAD)
    if config.tie_embeddings and embedding is not None:
        if head is None:
            # The recipe's state dict names the tied matrix twice (see model.py); loading copies into one parameter.
            hf_state_dict[_HF_HEAD] = embedding
        elif head.shape != embedding.shape or not torch.equal(head, embedding):
            raise CheckpointError(
                f"config.json sets tie_word_embeddings=true but {_HF_HEAD!r} differs from {_HF_EMBEDDING!r}; "
                "a tied model has one matrix. Set tie_word_embeddings=false if the checkpoint is untied."
            )
    known = {hf for parts in name_map.values() for hf in parts}
    unknown = [k for k in hf_state_dict if k not in known and not k.endswith(_HF_IGNORED_SUFFIXES)]
    if unknown:
        raise CheckpointError(
            f"The Hugging Face checkpoint has {len(unknown)} tensor(s) that LlamaForCausalLM with this config.json "
            f"does not: {some_names(unknown)}. Only LLaMA-architecture checkpoints (no biases, untied or tied "
            "embeddings) can be converted."
        )
    out: dict[str, Tensor] = {}
    for ours, theirs in name_map.items():
        missing = [hf for hf in theirs if hf not in hf_state_dict]
        if missing:
            raise CheckpointError(
                f"The Hugging Face checkpoint lacks {missing[0]!r} (needed for {ours!r}). Is a weight shard missing, "
                f"or does num_hidden_layers={config.n_layers} in config.json overstate the layers?"
            )
        want = list(shapes[ours])
        want[0] //= len(theirs)
        for hf in theirs:
            if list(hf_state_dict[hf].shape) != want:
                raise CheckpointError(
                    f"Hugging Face tensor {hf!r} has shape {tuple(hf_state_dict[hf].shape)} but config.json "
                    f"({describe_shape(config)}) implies {tuple(want)}. The weights and config.json disagree."
                )
        tensors = [hf_state_dict[hf] for hf in theirs]
        out[ours] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
    return out


def recipe_to_hf_state_dict(state_dict: Mapping[str, Tensor], config: LLaMAConfig) -> dict[str, Tensor]:
    """Inverse of ``hf_to_recipe_state_dict``: split gate/up and rename, after ``check_state_dict``; a tied model
    gets no ``lm_head.weight``. The gate/up halves are copies, not views: safetensors refuses tensors that share a
    buffer."""
    check_state_dict(state_dict, config, source="The recipe checkpoint")
    out: dict[str, Tensor] = {}
    for ours, theirs in hf_name_map(config).items():
        tensor = state_dict[ours]
        if config.tie_embeddings and theirs == (_HF_HEAD,):
            continue  # tied: Hugging Face stores the matrix once, as the embedding (and ties lm_head at load)
        if len(theirs) == 1:
            out[theirs[0]] = tensor.contiguous()
        else:
            for hf, part in zip(theirs, tensor.chunk(len(theirs), dim=0), strict=True):
                out[hf] = part.clone()
    return out


# --------------------------------------------------------------------------------------------------
# Hugging Face directories
# --------------------------------------------------------------------------------------------------


def is_hf_directory(path: PathLike) -> bool:
    """Whether ``path`` looks like a Hugging Face model directory (has ``config.json``)."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def config_from_hf(hf_config: Mapping[str, Any], *, source: str = "config.json") -> LLaMAConfig:
    """``LLaMAConfig`` from the fields of an HF ``config.json``; architectures the recipe cannot hold exactly
    (biases, rotary scaling other than "llama3", other activations, head_dim != hidden_size / heads) are refused."""
    model_type = hf_config.get("model_type")
    if model_type != "llama":
        raise CheckpointError(f"{source}: model_type={model_type!r}; only 'llama' checkpoints can be converted.")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act={hf_config['hidden_act']!r}; the recipe's MLP is SwiGLU (silu).")
    for flag in ("attention_bias", "mlp_bias"):
        if hf_config.get(flag):
            raise CheckpointError(f"{source}: {flag}=true; the recipe's projections have no bias.")
    rope_theta, rope_scaling = rope_from_hf(hf_config, source=source)
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise CheckpointError(
            f"{source}: head_dim={head_dim} x num_attention_heads={heads} != hidden_size={hidden}; "
            "the recipe needs head_dim = hidden_size / num_attention_heads."
        )
    return LLaMAConfig(
        vocab_size=hf_config["vocab_size"],
        dim=hidden,
        n_layers=hf_config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or heads,
        ffn_hidden_dim=hf_config["intermediate_size"],
        max_seq_len=hf_config.get("max_position_embeddings", 4096),
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
    )


def rope_from_hf(hf_config: Mapping[str, Any], *, source: str = "config.json") -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling) of an HF ``config.json``: transformers 5 writes ``rope_parameters`` (theta and
    the scaling in one mapping), older ones ``rope_theta`` and ``rope_scaling`` (``type`` before ``rope_type``),
    which is what Meta's LLaMA-3.1/3.2 downloads carry; transformers 5 converts those at load, and so does this."""
    rope = dict(hf_config.get("rope_parameters") or {})
    legacy = dict(hf_config.get("rope_scaling") or {})
    if not rope:
        rope = dict(legacy)
        if "type" in rope:
            rope.setdefault("rope_type", rope.pop("type"))
    theta = float(rope.pop("rope_theta", hf_config.get("rope_theta", DEFAULT_HF_ROPE_THETA)))
    rope_type = rope.pop("rope_type", "default")
    if rope_type == "default":
        return theta, None
    if rope_type != ROPE_SCALING_TYPE:
        raise CheckpointError(
            f"{source}: rope_type={rope_type!r}; the recipe implements plain rotary embeddings (rope_type 'default') "
            f"and LLaMA-3.1's {ROPE_SCALING_TYPE!r} scaling."
        )
    try:
        return theta, normalise_rope_scaling({key: rope[key] for key in ROPE_SCALING_KEYS if key in rope})
    except ValueError as error:
        raise CheckpointError(f"{source}: rope_parameters: {error}") from None


def rope_to_hf(config: LLaMAConfig) -> dict[str, Any]:
    """The config.json entries of the rotary embedding: ``rope_parameters`` (transformers 5) and the
    ``rope_theta`` / ``rope_scaling`` pair older transformers read."""
    scaling = dict(config.rope_scaling) if config.rope_scaling is not None else None
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": config.rope_theta}
    return {"rope_theta": config.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}


def hf_config_dict(
    config: LLaMAConfig, *, dtype: torch.dtype, extra: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to ``LLaMA(config)``. The rotary settings and dtype are
    written under both the transformers 4 and 5 names so either version reads them."""
    dtype_name = str(dtype).removeprefix("torch.")
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.ffn_hidden_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        **rope_to_hf(config),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    out.update(extra or {})
    return out


def load_hf_state_dict(hf_dir: PathLike) -> dict[str, Tensor]:
    """Every tensor of an HF directory: ``model.safetensors``, ``pytorch_model.bin``, or their sharded
    forms (``*.index.json`` + shards), on the CPU, names as stored."""
    hf_dir = existing_path(hf_dir, "Hugging Face directory")
    for index_name in _HF_INDEX_FILES:
        index_path = hf_dir / index_name
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text())["weight_map"]
            state_dict: dict[str, Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                shard_path = hf_dir / shard
                if not shard_path.is_file():
                    raise CheckpointError(f"{index_path} lists shard {shard!r}, which is missing from {hf_dir}.")
                state_dict.update(_load_weight_file(shard_path))
            return state_dict
    for name in _HF_WEIGHT_FILES:
        if (hf_dir / name).is_file():
            return _load_weight_file(hf_dir / name)
    raise CheckpointError(
        f"{hf_dir} has no weights: expected one of {list(_HF_WEIGHT_FILES + _HF_INDEX_FILES)}. "
        "Download the full model (e.g. `huggingface-cli download <repo> --local-dir DIR`)."
    )


def load_hf_checkpoint(hf_dir: PathLike) -> tuple[LLaMAConfig, dict[str, Tensor]]:
    """A local HF LLaMA directory as ``(LLaMAConfig, recipe state dict)``; weights keep their dtype."""
    hf_dir = existing_path(hf_dir, "Hugging Face directory")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{hf_dir} has no config.json; it is not a Hugging Face model directory.")
    hf_config = json.loads(config_path.read_text())
    config = config_from_hf(hf_config, source=str(config_path))
    state_dict = hf_to_recipe_state_dict(load_hf_state_dict(hf_dir), config)
    return config, state_dict


def save_hf_checkpoint(
    config: LLaMAConfig,
    state_dict: Mapping[str, Tensor],
    out_dir: PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_path: Optional[PathLike] = None,
) -> Path:
    """Write a recipe state dict as an HF directory that ``LlamaForCausalLM.from_pretrained`` loads:
    ``config.json`` and safetensors (sharded with an index beyond ``max_shard_bytes``). With
    ``tokenizer_path``, the tokenizer is saved alongside and its bos/eos ids go into the config."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    hf_state_dict = recipe_to_hf_state_dict(state_dict, config)
    dtypes = {t.dtype for t in hf_state_dict.values()}
    if len(dtypes) != 1:
        raise CheckpointError(f"The checkpoint mixes dtypes {sorted(map(str, dtypes))}; HF configs carry one dtype.")
    extra: dict[str, Any] = {}
    if tokenizer_path is not None:
        extra = _save_tokenizer(tokenizer_path, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in hf_state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], out_dir / "model.safetensors", metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out_dir / file_name, metadata=metadata)
            weight_map.update(dict.fromkeys(shard, file_name))
        total = sum(t.numel() * t.element_size() for t in hf_state_dict.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config = hf_config_dict(config, dtype=dtypes.pop(), extra=extra)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return out_dir


def _save_tokenizer(tokenizer_path: PathLike, out_dir: Path) -> dict[str, Any]:
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer.save_pretrained(str(out_dir))
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}


def _load_weight_file(path: Path) -> dict[str, Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


# --------------------------------------------------------------------------------------------------
# Conversions
# --------------------------------------------------------------------------------------------------


def convert_hf_to_recipe(hf_dir: PathLike, out_path: PathLike) -> Path:
    """HF directory -> consolidated recipe checkpoint. The HF directory is recorded as the tokenizer
    path when it holds a tokenizer, so ``generate.py`` finds it."""
    config, state_dict = load_hf_checkpoint(hf_dir)
    tokenizer = str(Path(hf_dir).resolve()) if has_tokenizer(hf_dir) else None
    return save_recipe_checkpoint(out_path, config, state_dict, tokenizer_path=tokenizer)


def convert_recipe_to_hf(
    checkpoint_path: PathLike,
    out_dir: PathLike,
    *,
    tokenizer_path: Optional[PathLike] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Recipe checkpoint (file or sharded directory) -> HF directory. The tokenizer defaults to the one
    recorded in the checkpoint, if any and if it still exists."""
    config, state_dict = load_recipe_checkpoint(checkpoint_path)
    if tokenizer_path is None:
        tokenizer_path = recorded_tokenizer(checkpoint_path, read_recipe_metadata(checkpoint_path))
    return save_hf_checkpoint(
        config, state_dict, out_dir, max_shard_bytes=max_shard_bytes, tokenizer_path=tokenizer_path
    )


def recorded_tokenizer(checkpoint_path: PathLike, metadata: dict) -> Optional[str]:
    """The tokenizer a checkpoint's metadata records, if it still exists (a warning says so when it is gone)."""
    stored = tokenizer_from_metadata(metadata)
    if stored is not None and not has_tokenizer(stored):
        warnings.warn(f"The tokenizer recorded in {checkpoint_path} ({stored}) is gone; exporting without one.",
                      stacklevel=3)
        return None
    return stored

