"""Hugging Face LLaMA checkpoints in and out of the recipe, and the recipe checkpoint layout.

    python recipes/llama2/convert.py from-hf HF_DIR OUT.ckpt     # HF directory -> recipe checkpoint file
    python recipes/llama2/convert.py to-hf CKPT OUT_DIR          # recipe checkpoint (file or DCP dir) -> HF directory

Recipe checkpoint layout (defined here and nowhere else)
--------------------------------------------------------
A recipe checkpoint is a Lightning checkpoint of the recipe's LightningModule, which holds the
``LLaMA`` as ``self.model``:

* ``checkpoint["state_dict"]``: the LightningModule's state dict, so the model's weights are the keys
  starting with ``STATE_DICT_PREFIX`` (``"model."``); other keys are not the model's and are ignored.
* ``checkpoint["hyper_parameters"][CONFIG_HPARAM]`` (``"config"``): the ``LLaMAConfig`` as a dict of its
  fields (``LLaMAConfig.to_dict()``), a ``LLaMAConfig``, or a preset name such as ``"tiny"``.
* The tokenizer directory, optional: the first of ``TOKENIZER_HPARAMS`` found in
  ``checkpoint["hyper_parameters"]``, then in ``checkpoint["datamodule_hyper_parameters"]``.

It is stored either as one file (``torch.save`` of that dict: a consolidated checkpoint) or as a
Lightning sharded directory: ``torch.distributed.checkpoint`` files holding ``"state_dict"`` (and
optimizer states), plus ``meta.pt`` with everything else, hyper-parameters included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

if __package__ in (None, ""):
    # Run as a script: make `recipes.llama2` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import Tensor

from recipes.llama2.config import LLaMAConfig
from recipes.llama2.model import LLaMA

PathLike = Union[str, os.PathLike]
_REPO_ROOT = Path(__file__).resolve().parents[2]

STATE_DICT_PREFIX = "model."
CONFIG_HPARAM = "config"
TOKENIZER_HPARAMS = ("tokenizer_path", "tokenizer")
LIGHTNING_METADATA_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
DCP_METADATA_FILE = ".metadata"
# Wrappers that prefix parameter names: torch.compile's OptimizedModule and activation checkpointing.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")

# Buffers that old HF LLaMA checkpoints saved and that the recipe recomputes.
_HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


class CheckpointError(ValueError):
    """A checkpoint does not match the recipe; the message names the tensor or file, why, and the fix."""


# --------------------------------------------------------------------------------------------------
# Name map and shape checks
# --------------------------------------------------------------------------------------------------


def hf_name_map(config: LLaMAConfig) -> dict[str, tuple[str, ...]]:
    """Recipe parameter name -> the Hugging Face ``LlamaForCausalLM`` names it is made of (two for
    the fused gate/up projection: gate rows first, then up rows)."""
    names: dict[str, tuple[str, ...]] = {"tok_embeddings.weight": ("model.embed_tokens.weight",)}
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
    names["output.weight"] = ("lm_head.weight",)
    return names


def expected_shapes(config: LLaMAConfig) -> dict[str, torch.Size]:
    """Parameter name -> shape of a ``LLaMA(config)``, computed on the meta device (no memory)."""
    with torch.device("meta"):
        model = LLaMA(config)
    return {name: p.shape for name, p in model.state_dict().items()}


def check_state_dict(state_dict: Mapping[str, Tensor], config: LLaMAConfig, *, source: str) -> None:
    """Raise ``CheckpointError`` unless ``state_dict`` has exactly the parameters of ``LLaMA(config)``
    with the right shapes. ``source`` names where the weights came from, for the message."""
    shapes = expected_shapes(config)
    missing = [name for name in shapes if name not in state_dict]
    unknown = [name for name in state_dict if name not in shapes]
    if unknown:
        raise CheckpointError(
            f"{source} has {len(unknown)} tensor(s) that a LLaMA of this config does not have: {_some(unknown)}. "
            f"Expected names like {_some(list(shapes), 3)}; is this a LLaMA-2 checkpoint of the recipe?"
        )
    if missing:
        raise CheckpointError(
            f"{source} lacks {len(missing)} tensor(s) of the model: {_some(missing)}. "
            f"Check that its config (n_layers={config.n_layers}) matches the weights."
        )
    for name, shape in shapes.items():
        if state_dict[name].shape != shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(state_dict[name].shape)} but the config "
                f"({_describe(config)}) needs {tuple(shape)}. The weights and the config disagree."
            )


def hf_to_recipe_state_dict(
    hf_state_dict: Mapping[str, Tensor], config: LLaMAConfig, *, tie_word_embeddings: bool = False
) -> dict[str, Tensor]:
    """Rename (and fuse gate/up of) a ``LlamaForCausalLM`` state dict into the recipe's layout.

    Rotary buffers (``rotary_emb.inv_freq``) are dropped; any other unknown name, a missing tensor or
    a shape that disagrees with ``config`` raises ``CheckpointError`` naming the Hugging Face tensor.
    """
    name_map = hf_name_map(config)
    shapes = expected_shapes(config)
    hf_state_dict = dict(hf_state_dict)
    if tie_word_embeddings and "lm_head.weight" not in hf_state_dict and "model.embed_tokens.weight" in hf_state_dict:
        # Tied checkpoints omit lm_head; the recipe keeps an untied output layer, initialised equal. A copy,
        # not the same tensor: safetensors refuses to write tensors that share memory.
        hf_state_dict["lm_head.weight"] = hf_state_dict["model.embed_tokens.weight"].clone()
    known = {hf for parts in name_map.values() for hf in parts}
    unknown = [k for k in hf_state_dict if k not in known and not k.endswith(_HF_IGNORED_SUFFIXES)]
    if unknown:
        raise CheckpointError(
            f"The Hugging Face checkpoint has {len(unknown)} tensor(s) that LlamaForCausalLM with this config.json "
            f"does not: {_some(unknown)}. Only LLaMA-architecture checkpoints (no biases, untied or tied "
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
                    f"({_describe(config)}) implies {tuple(want)}. The weights and config.json disagree."
                )
        tensors = [hf_state_dict[hf] for hf in theirs]
        out[ours] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
    return out


def recipe_to_hf_state_dict(state_dict: Mapping[str, Tensor], config: LLaMAConfig) -> dict[str, Tensor]:
    """Inverse of ``hf_to_recipe_state_dict``: split gate/up and rename, after ``check_state_dict``.
    The gate/up halves are copies, not views: safetensors refuses tensors that share a buffer."""
    check_state_dict(state_dict, config, source="The recipe checkpoint")
    out: dict[str, Tensor] = {}
    for ours, theirs in hf_name_map(config).items():
        tensor = state_dict[ours]
        if len(theirs) == 1:
            out[theirs[0]] = tensor.contiguous()
        else:
            for hf, part in zip(theirs, tensor.chunk(len(theirs), dim=0), strict=True):
                out[hf] = part.clone()
    return out


# --------------------------------------------------------------------------------------------------
# Recipe checkpoints
# --------------------------------------------------------------------------------------------------


def make_recipe_checkpoint(
    config: LLaMAConfig, model_state_dict: Mapping[str, Tensor], *, tokenizer_path: Optional[PathLike] = None
) -> dict[str, Any]:
    """A consolidated checkpoint dict in the layout above, from the ``LLaMA``'s own state dict.
    It loads with the LightningModule's ``load_state_dict`` and holds no optimizer or loop state."""
    import lightning

    hparams: dict[str, Any] = {CONFIG_HPARAM: config.to_dict()}
    if tokenizer_path is not None:
        hparams[TOKENIZER_HPARAMS[0]] = str(tokenizer_path)
    return {
        "state_dict": {STATE_DICT_PREFIX + name: tensor for name, tensor in model_state_dict.items()},
        "hyper_parameters": hparams,
        "pytorch-lightning_version": lightning.__version__,
    }


def save_recipe_checkpoint(
    path: PathLike,
    config: LLaMAConfig,
    model_state_dict: Mapping[str, Tensor],
    *,
    tokenizer_path: Optional[PathLike] = None,
) -> Path:
    """``torch.save`` a consolidated recipe checkpoint to ``path`` (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(make_recipe_checkpoint(config, model_state_dict, tokenizer_path=tokenizer_path), path)
    return path


def is_sharded_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` is a Lightning sharded (DCP) checkpoint directory."""
    path = Path(path)
    return path.is_dir() and (path / LIGHTNING_METADATA_FILE).is_file()


def read_recipe_metadata(path: PathLike) -> dict[str, Any]:
    """The non-weight part of a recipe checkpoint (hyper-parameters etc.). For a sharded directory it
    reads only ``meta.pt``; a file is memory-mapped, so its tensors are not read."""
    path = _existing(path, "recipe checkpoint")
    if path.is_dir():
        _check_sharded_dir(path)
        return _torch_load(path / LIGHTNING_METADATA_FILE)
    checkpoint = _torch_load(path, mmap=True)
    _check_is_checkpoint(checkpoint, path)
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    return checkpoint


def load_recipe_checkpoint(path: PathLike) -> tuple[LLaMAConfig, dict[str, Tensor]]:
    """Read a recipe checkpoint (a consolidated file or a sharded DCP directory) on the CPU, without a
    process group. Returns its ``LLaMAConfig`` and the ``LLaMA``'s own state dict (prefix removed),
    checked against the config."""
    path = _existing(path, "recipe checkpoint")
    if path.is_dir():
        _check_sharded_dir(path)
        metadata = _torch_load(path / LIGHTNING_METADATA_FILE)
        full_state_dict = _load_dcp_state_dict(path)
    else:
        checkpoint = _torch_load(path, mmap=True)
        _check_is_checkpoint(checkpoint, path)
        full_state_dict = checkpoint["state_dict"]
        metadata = checkpoint
    config = config_from_hparams(metadata.get("hyper_parameters"), source=str(path))
    state_dict = _model_state_dict(full_state_dict, source=str(path))
    check_state_dict(state_dict, config, source=f"Recipe checkpoint {path}")
    return config, state_dict


def config_from_hparams(hparams: Optional[Mapping[str, Any]], *, source: str = "the checkpoint") -> LLaMAConfig:
    """The ``LLaMAConfig`` stored under ``hyper_parameters[CONFIG_HPARAM]`` (dict, config or preset name)."""
    if not hparams or CONFIG_HPARAM not in hparams:
        raise CheckpointError(
            f"{source} has no hyper_parameters[{CONFIG_HPARAM!r}], so the model's shape is unknown. Save the "
            f"LightningModule's LLaMAConfig there (self.save_hyperparameters() with a `{CONFIG_HPARAM}` argument)."
        )
    value = hparams[CONFIG_HPARAM]
    if isinstance(value, LLaMAConfig):
        return value
    if isinstance(value, str):
        return LLaMAConfig.from_preset(value)
    if isinstance(value, Mapping):
        return LLaMAConfig.from_dict(value)
    raise CheckpointError(
        f"{source}: hyper_parameters[{CONFIG_HPARAM!r}] is a {type(value).__name__}; expected a dict of "
        "LLaMAConfig fields, a LLaMAConfig, or a preset name."
    )


def tokenizer_from_metadata(metadata: Mapping[str, Any]) -> Optional[str]:
    """The tokenizer path stored in a checkpoint's hyper-parameters (see the layout above), or None.

    A relative path that does not exist from the working directory is taken relative to the repository
    root, where the recipe's configs name it (``recipes/llama2/assets/tokenizer``).
    """
    for section in ("hyper_parameters", "datamodule_hyper_parameters"):
        hparams = metadata.get(section) or {}
        for key in TOKENIZER_HPARAMS:
            value = hparams.get(key) if isinstance(hparams, Mapping) else getattr(hparams, key, None)
            if isinstance(value, (str, os.PathLike)):
                path = Path(value)
                if not path.is_absolute() and not path.exists() and (_REPO_ROOT / path).exists():
                    path = _REPO_ROOT / path
                return str(path)
    return None


def _model_state_dict(full_state_dict: Mapping[str, Any], *, source: str) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for key, tensor in full_state_dict.items():
        for wrapper in _WRAPPER_PREFIXES:
            key = key.replace(wrapper, "")
        if key.startswith(STATE_DICT_PREFIX):
            out[key[len(STATE_DICT_PREFIX) :]] = tensor
    if not out:
        raise CheckpointError(
            f"{source} holds no tensor under {STATE_DICT_PREFIX!r} (its state_dict keys look like "
            f"{_some(list(full_state_dict), 3)}). The recipe's LightningModule keeps the LLaMA as `self.model`."
        )
    return out


def _load_dcp_state_dict(path: Path) -> dict[str, Tensor]:
    # Only "state_dict": a sharded checkpoint also holds optimizer states, twice the weights' size.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    loaded: dict[str, Any] = {}
    _load_state_dict(
        loaded,
        storage_reader=FileSystemReader(path),
        planner=_EmptyStateDictLoadPlanner(keys={"state_dict"}),
        no_dist=True,
    )
    if "state_dict" not in loaded:
        raise CheckpointError(
            f"Sharded checkpoint {path} holds no 'state_dict' entry; it is not a Lightning checkpoint."
        )
    return loaded["state_dict"]


def _check_sharded_dir(path: Path) -> None:
    if not (path / DCP_METADATA_FILE).is_file() or not (path / LIGHTNING_METADATA_FILE).is_file():
        raise CheckpointError(
            f"{path} is a directory but not a Lightning sharded checkpoint: it needs the DCP index "
            f"{DCP_METADATA_FILE!r} and Lightning's {LIGHTNING_METADATA_FILE!r}. For a Hugging Face directory "
            "use from-hf / pass it as an HF model."
        )


def _check_is_checkpoint(checkpoint: Any, path: Path) -> None:
    is_dict = isinstance(checkpoint, Mapping)
    if not is_dict or "state_dict" not in checkpoint:
        raise CheckpointError(
            f"{path} is not a Lightning checkpoint: it has no 'state_dict' entry "
            f"(found {type(checkpoint).__name__}{' keys ' + str(list(checkpoint)[:5]) if is_dict else ''})."
        )


def _torch_load(path: Path, *, mmap: bool = False) -> Any:
    # weights_only=False: Lightning hyper-parameters may hold arbitrary objects. Load only trusted files.
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)


# --------------------------------------------------------------------------------------------------
# Hugging Face directories
# --------------------------------------------------------------------------------------------------


def is_hf_directory(path: PathLike) -> bool:
    """Whether ``path`` looks like a Hugging Face model directory (has ``config.json``)."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def config_from_hf(hf_config: Mapping[str, Any], *, source: str = "config.json") -> LLaMAConfig:
    """``LLaMAConfig`` from the fields of an HF ``config.json``; architectures the recipe cannot hold exactly
    (biases, scaled rotary, other activations, head_dim != hidden_size / heads) are refused."""
    model_type = hf_config.get("model_type")
    if model_type != "llama":
        raise CheckpointError(f"{source}: model_type={model_type!r}; only 'llama' checkpoints can be converted.")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act={hf_config['hidden_act']!r}; the recipe's MLP is SwiGLU (silu).")
    for flag in ("attention_bias", "mlp_bias"):
        if hf_config.get(flag):
            raise CheckpointError(f"{source}: {flag}=true; the recipe's projections have no bias.")
    rope = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise CheckpointError(
            f"{source}: rope_type={rope_type!r}; the recipe implements plain rotary embeddings (rope_type 'default')."
        )
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
        rope_theta=float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))),
    )


def hf_config_dict(
    config: LLaMAConfig, *, dtype: torch.dtype, extra: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to ``LLaMA(config)``. Rotary theta and dtype are
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
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    out.update(extra or {})
    return out


def load_hf_state_dict(hf_dir: PathLike) -> dict[str, Tensor]:
    """Every tensor of an HF directory: ``model.safetensors``, ``pytorch_model.bin``, or their sharded
    forms (``*.index.json`` + shards), on the CPU, names as stored."""
    hf_dir = _existing(hf_dir, "Hugging Face directory")
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
    hf_dir = _existing(hf_dir, "Hugging Face directory")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{hf_dir} has no config.json; it is not a Hugging Face model directory.")
    hf_config = json.loads(config_path.read_text())
    config = config_from_hf(hf_config, source=str(config_path))
    state_dict = hf_to_recipe_state_dict(
        load_hf_state_dict(hf_dir), config, tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False))
    )
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
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(_existing(tokenizer_path, "tokenizer directory")), local_files_only=True
    )
    tokenizer.save_pretrained(str(out_dir))
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}


def _load_weight_file(path: Path) -> dict[str, Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def has_tokenizer(path: PathLike) -> bool:
    """Whether ``path`` is a directory holding a Hugging Face tokenizer."""
    return Path(path).is_dir() and any((Path(path) / name).is_file() for name in _TOKENIZER_FILES)


# --------------------------------------------------------------------------------------------------
# Conversions and CLI
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
        stored = tokenizer_from_metadata(read_recipe_metadata(checkpoint_path))
        if stored is not None and has_tokenizer(stored):
            tokenizer_path = stored
        elif stored is not None:
            warnings.warn(
                f"The tokenizer recorded in {checkpoint_path} ({stored}) is gone; exporting without one.", stacklevel=2
            )
    return save_hf_checkpoint(
        config, state_dict, out_dir, max_shard_bytes=max_shard_bytes, tokenizer_path=tokenizer_path
    )


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    from_hf = commands.add_parser("from-hf", help="HF LLaMA directory -> recipe checkpoint file")
    from_hf.add_argument("hf_dir", type=Path)
    from_hf.add_argument("out", type=Path)
    to_hf = commands.add_parser("to-hf", help="recipe checkpoint (file or sharded dir) -> HF directory")
    to_hf.add_argument("checkpoint", type=Path)
    to_hf.add_argument("out_dir", type=Path)
    to_hf.add_argument(
        "--tokenizer", type=Path, default=None, help="tokenizer dir to save alongside (default: the checkpoint's)"
    )
    to_hf.add_argument("--max-shard-gib", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1024**3)
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        if args.command == "from-hf":
            out = convert_hf_to_recipe(args.hf_dir, args.out)
        else:
            out = convert_recipe_to_hf(
                args.checkpoint,
                args.out_dir,
                tokenizer_path=args.tokenizer,
                max_shard_bytes=int(args.max_shard_gib * 1024**3),
            )
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _existing(path: PathLike, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"The {what} {str(path)!r} does not exist; check the path.")
    return path


def _some(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _describe(config: LLaMAConfig) -> str:
    return (
        f"vocab_size={config.vocab_size}, dim={config.dim}, n_layers={config.n_layers}, n_heads={config.n_heads}, "
        f"n_kv_heads={config.n_kv_heads}, ffn_hidden_dim={config.ffn_hidden_dim}"
    )


if __name__ == "__main__":
    sys.exit(main())
