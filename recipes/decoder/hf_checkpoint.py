"""Hugging Face ``*ForCausalLM`` checkpoints in and out of the recipe, for every model family: renaming (and fusing)
tensors by the family's name map, ``config.json`` through the family's converters (``DecoderFamily.hf``; the family
of a directory is the one reading its ``model_type``), safetensors / ``pytorch_model.bin`` directories, and the two
conversions (``convert.py`` is their command line).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from lightning_npu.progress import progress_over
from recipes.decoder.checkpoint_layout import (
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
from recipes import families
from recipes.decoder.hf_adapter import (  # noqa: F401  (HF_EMBEDDING, HF_HEAD: what the families' name maps use)
    HF_EMBEDDING, HF_HEAD, Piece, Plan, ReadSlice, StoredTensor, check_tied, export_plan, import_plan, read_region, read_whole,
)
from recipes.decoder.rope_scaling import ROPE_SCALING_KEYS, ROPE_SCALING_TYPE, normalise_rope_scaling
from recipes.decoder.tokenizer import has_tokenizer, load_tokenizer

_HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


# --------------------------------------------------------------------------------------------------
# The family's formats
# --------------------------------------------------------------------------------------------------


#: The ``hidden_act`` names transformers runs as the SiLU of the recipes' SwiGLU MLPs (its ACT2FN maps both to it).
SWIGLU_ACTIVATIONS = ("silu", "swish")
#: LoRA target -> the HF decoder layer submodule PEFT adapts for the shared ``Attention`` (its ``target_modules``
#: name is the last part).
PEFT_ATTENTION_TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                          "o": "self_attn.o_proj"}
#: The same for a layer of the shared ``Attention`` and SwiGLU ``FeedForward`` (LLaMA's, Qwen's dense layers).
PEFT_DECODER_TARGETS = {**PEFT_ATTENTION_TARGETS, "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
# transformers' rotary base when config.json names none (modeling_rope_utils.py).
DEFAULT_HF_ROPE_THETA = 10000.0

def hf_feed_forward_names(ours: str, theirs: str) -> dict[str, tuple[str, ...]]:
    """The name map of a ``FeedForward`` at ``ours`` (``"layers.0.feed_forward."``) whose HF MLP is at ``theirs``
    (``"model.layers.0.mlp."``): gate, up and down projections, one HF tensor each."""
    return {
        ours + "w_gate.weight": (theirs + "gate_proj.weight",),
        ours + "w_up.weight": (theirs + "up_proj.weight",),
        ours + "w_down.weight": (theirs + "down_proj.weight",),
    }


def hf_attention_names(ours: str, theirs: str, *, qkv_bias: bool = False,
                       qk_norm: bool = False) -> dict[str, tuple[str, ...]]:
    """The name map of an ``Attention`` at ``ours`` (``"layers.0.attention."``) whose HF attention is at ``theirs``
    (``"model.layers.0.self_attn."``): q, k, v, o projections, the q/k/v biases with ``qkv_bias`` and the per-head
    q/k norm gains with ``qk_norm``, one HF tensor each."""
    names: dict[str, tuple[str, ...]] = {}
    for mine, hf in {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}.items():
        names[f"{ours}{mine}.weight"] = (f"{theirs}{hf}.weight",)
        if qkv_bias and mine != "wo":
            names[f"{ours}{mine}.bias"] = (f"{theirs}{hf}.bias",)
    if qk_norm:
        for norm in ("q_norm", "k_norm"):
            names[f"{ours}{norm}.weight"] = (f"{theirs}{norm}.weight",)
    return names


def rope_from_hf(hf_config: Mapping[str, Any], *, source: str = "config.json") -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling) of an HF ``config.json``: transformers 5 writes ``rope_parameters`` (theta and
    the scaling in one mapping), older ones ``rope_theta`` and ``rope_scaling`` (``type`` before ``rope_type``),
    which is what Meta's LLaMA-3.1/3.2 downloads carry (the scaling: ``rope_scaling.py``'s rule); transformers 5 converts those at load, and so does this."""
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
    top = hf_config.get("original_max_position_embeddings")  # transformers reads it before rope_parameters' own
    if top is not None:
        if rope.setdefault("original_max_position_embeddings", top) != top:
            raise CheckpointError(
                f"{source}: original_max_position_embeddings={top} at the top level but"
                f" {rope['original_max_position_embeddings']} in rope_parameters; transformers takes the top-level"
                " one, so make the two agree (or drop one)"
            )
    try:
        return theta, normalise_rope_scaling({key: rope[key] for key in ROPE_SCALING_KEYS if key in rope},
                                             "rope_parameters")
    except ValueError as error:
        raise CheckpointError(f"{source}: {error}") from None


def rope_to_hf(config: Any) -> dict[str, Any]:
    """The config.json entries of the rotary embedding of ``config`` (``rope_theta``, ``rope_scaling``): ``rope_parameters`` (transformers 5) and the
    ``rope_theta`` / ``rope_scaling`` pair older transformers read."""
    scaling = dict(config.rope_scaling) if config.rope_scaling is not None else None
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": config.rope_theta}
    return {"rope_theta": config.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}


def hf_decoder_fields(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The config fields every family with grouped-query attention reads alike from an HF ``config.json``:
    vocabulary, width, depth, heads, KV heads (default: one per head), head_dim (default: hidden / heads) and tied
    embeddings. (Defaults that differ by family, as the RMSNorm epsilon's, stay with the family.)"""
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    return dict(
        vocab_size=hf_config["vocab_size"],
        dim=hidden,
        n_layers=hf_config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or heads,
        head_dim=hf_config.get("head_dim") or hidden // heads,
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
    )


def hf_name_map(config: Any) -> dict[str, tuple[str, ...]]:
    """Recipe parameter name -> the Hugging Face names it is made of, by the family of ``config``."""
    return families.of_config(config).hf.name_map(config)


def config_from_hf(hf_config: Mapping[str, Any], *, source: str = "config.json") -> Any:
    """The model config of an HF ``config.json``, read by the family of its ``model_type``."""
    family = families.of_hf_model_type(hf_config.get("model_type"))
    if family is None:
        raise CheckpointError(
            f"{source}: model_type={hf_config.get('model_type')!r}; the recipe's model families convert"
            f" {families.hf_model_types()} (recipes/families.py)."
        )
    try:
        return family.hf.config_from_hf(hf_config, source=source)
    except KeyError as error:  # a key the family reads without a default
        raise CheckpointError(
            f"{source}: no {error.args[0]!r}, which the recipe reads to build a {hf_config['model_type']} model; add it"
            " to config.json with the value the checkpoint was trained with"
        ) from None


def hf_config_dict(config: Any, *, dtype: torch.dtype, extra: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The ``config.json`` of the HF model equal to the recipe's model of ``config``."""
    return families.of_config(config).hf.config_dict(config, dtype=dtype, extra=extra)


def hf_decoder_entries(config: Any, *, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` entries every family's decoder writes alike: its shape (``vocab_size``, ``dim``,
    ``n_layers``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``max_seq_len``, ``norm_eps``), the SwiGLU (silu)
    activation, the embedding tie, and the dtype under both the transformers 4 and 5 names."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def hf_to_recipe_state_dict(hf_state_dict: Mapping[str, Tensor], config: Any) -> dict[str, Tensor]:
    """An in-memory HF state dict in the recipe's layout, by the import plan of ``config``'s family
    (``hf_adapter.import_plan``, which raises ``CheckpointError`` naming an unknown, missing or misshapen tensor)."""
    stored = {name: StoredTensor(tuple(t.shape), t.dtype) for name, t in hf_state_dict.items()}
    plan = import_plan(config, stored)
    read = _in_memory(hf_state_dict)
    check_tied(plan, stored, read)
    return {name: read_whole(name, plan, stored, read) for name in plan.tensors}


def recipe_to_hf_state_dict(state_dict: Mapping[str, Tensor], config: Any) -> dict[str, Tensor]:
    """Inverse of ``hf_to_recipe_state_dict``, after ``check_state_dict``: the tensors an export writes
    (``hf_adapter.export_plan``), each a copy (safetensors refuses tensors that share a buffer)."""
    check_state_dict(state_dict, config, source="The recipe checkpoint")
    plan = export_plan(config)
    return {piece.hf_name: hf_tensor(piece, state_dict[ours])
            for ours, pieces in plan.tensors.items() for piece in pieces}


def hf_tensor(piece: Piece, recipe_tensor: Tensor) -> Tensor:
    """The HF tensor ``piece`` of ``recipe_tensor`` (its own copy when it is a part)."""
    if piece.shape == tuple(recipe_tensor.shape):
        return recipe_tensor.contiguous()
    region = recipe_tensor[tuple(slice(o, o + n) for o, n in zip(piece.offset, piece.shape))]
    return region.reshape(piece.hf_shape).clone()


def _in_memory(tensors: Mapping[str, Tensor]) -> ReadSlice:
    return lambda name, index: tensors[name][index]


# --------------------------------------------------------------------------------------------------
# Hugging Face directories
# --------------------------------------------------------------------------------------------------


def is_hf_directory(path: PathLike) -> bool:
    """Whether ``path`` looks like a Hugging Face model directory (has ``config.json``)."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


#: safetensors' dtype names (``get_dtype()``) -> torch dtypes.
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class HFWeights:
    """The weight files of an HF directory, opened lazily: their headers are read (and checked) at once, tensor
    data only as slices are asked for (safetensors' ``pread`` backend: no file mapped into the process, so only
    what is read is held). ``stored``: every tensor's name -> shape and dtype. ``pytorch_model.bin`` files are
    memory-mapped whole (their format has no slices)."""

    def __init__(self, hf_dir: PathLike) -> None:
        self.directory = existing_path(hf_dir, "Hugging Face directory")
        self.files = _weight_files(self.directory)
        self.stored: dict[str, StoredTensor] = {}
        self.file_of: dict[str, str] = {}
        self._open: dict[str, Any] = {}
        for file_name in self.files:
            for name, (shape, dtype) in self._header(file_name).items():
                self.stored[name] = StoredTensor(shape, dtype)
                self.file_of[name] = file_name
        self._check_index()

    def _header(self, file_name: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        path = self.directory / file_name
        if path.suffix != ".safetensors":
            tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            self._open[file_name] = tensors
            return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
        from safetensors import safe_open

        handle = safe_open(str(path), framework="pt", device="cpu", backend="pread")
        self._open[file_name] = handle
        header = {}
        for name in handle.keys():
            part = handle.get_slice(name)
            header[name] = (tuple(part.get_shape()), _SAFETENSORS_DTYPES[part.get_dtype()])
        return header

    def _check_index(self) -> None:
        for index_name in _HF_INDEX_FILES:
            index_path = self.directory / index_name
            if index_path.is_file():
                for name, file_name in json.loads(index_path.read_text())["weight_map"].items():
                    if self.file_of.get(name) != file_name:
                        raise CheckpointError(
                            f"{index_path} places {name!r} in {file_name!r}, but that file does not hold it"
                            f" ({'it is in ' + repr(self.file_of[name]) if name in self.file_of else 'no file does'})."
                            " Is a shard truncated or from another download? Download the model again."
                        )
                return

    def read(self, name: str, index: tuple[slice, ...]) -> Tensor:
        """The slice ``index`` of the stored tensor ``name`` (only those bytes are read)."""
        handle = self._open[self.file_of[name]]
        if isinstance(handle, dict):
            return handle[name][index]
        return handle.get_slice(name)[index]

    def read_all(self, name: str) -> Tensor:
        return self.read(name, tuple(slice(0, n) for n in self.stored[name].shape))


def open_hf_checkpoint(hf_dir: PathLike) -> tuple[Any, HFWeights, Plan]:
    """A local HF directory as its model config, its weight files (headers read) and the plan that reads the
    recipe's tensors from them, checked against the config (``hf_adapter.import_plan``): nothing read yet."""
    hf_dir = existing_path(hf_dir, "Hugging Face directory")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{hf_dir} has no config.json; it is not a Hugging Face model directory.")
    config = config_from_hf(json.loads(config_path.read_text()), source=str(config_path))
    weights = HFWeights(hf_dir)
    from_weights = families.of_config(config).hf.config_from_weights
    if from_weights is not None:  # what config.json leaves open, the weights say (DeepSeek-V3's MTP layers)
        config = from_weights(config, weights.stored.keys())
    plan = import_plan(config, weights.stored, source=f"The Hugging Face checkpoint {hf_dir}")
    return config, weights, plan


def tensors_by_file(weights: HFWeights, plan: Plan, names: Optional[Any] = None) -> list[tuple[str, list[str]]]:
    """The recipe tensors of ``plan`` (those in ``names``, default all) grouped by the file of their first stored
    piece, in file order: a load reads them file by file, one progress line each."""
    groups: dict[str, list[str]] = {file_name: [] for file_name in weights.files}
    for name, pieces in plan.tensors.items():
        if names is None or name in names:
            groups[weights.file_of[pieces[0].hf_name]].append(name)
    return [(file_name, group) for file_name, group in groups.items() if group]


def load_hf_state_dict(hf_dir: PathLike) -> dict[str, Tensor]:
    """Every tensor of an HF directory, names as stored, on the CPU."""
    weights = HFWeights(hf_dir)
    return {name: weights.read_all(name) for name in weights.stored}


def _weight_files(hf_dir: Path) -> list[str]:
    for index_name in _HF_INDEX_FILES:
        index_path = hf_dir / index_name
        if index_path.is_file():
            shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
            missing = [shard for shard in shards if not (hf_dir / shard).is_file()]
            if missing:
                raise CheckpointError(f"{index_path} lists shard {missing[0]!r}, which is missing from {hf_dir}.")
            return shards
    for name in _HF_WEIGHT_FILES:
        if (hf_dir / name).is_file():
            return [name]
    raise CheckpointError(
        f"{hf_dir} has no weights: expected one of {list(_HF_WEIGHT_FILES + _HF_INDEX_FILES)}. "
        "Download the full model (e.g. `huggingface-cli download <repo> --local-dir DIR`)."
    )


def local_region(tensor: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """The part of ``tensor`` this process holds and where it starts in the whole tensor: a DTensor's local shard
    and its offset (as DCP plans its reads: ``__create_chunk_list__``), a plain tensor whole at 0."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, (0,) * tensor.dim()
    local = tensor.to_local()
    chunks = tensor.__create_chunk_list__()
    return local, tuple(chunks[0].offsets) if chunks else (0,) * tensor.dim()


#: The most bytes of a shard ``read_into`` fills from one read (a larger shard is read in blocks of rows).
READ_BLOCK_BYTES = 16 * 2**20


def read_into(tensors: Mapping[str, Tensor], weights: HFWeights, plan: Plan) -> None:
    """Fill this process's part of each of ``tensors`` (recipe names, plain or DTensors: a model's state dict, in
    place) from the stored slices that cover it, file by file (one progress line each): a rank holding a shard of
    every tensor reads only its shards' bytes, at most ``READ_BLOCK_BYTES`` of one at a time."""
    with torch.no_grad():
        for _, names in progress_over(tensors_by_file(weights, plan, tensors.keys()), f"read {weights.directory}",
                                      name=lambda item: item[0]):
            for name in names:
                local, offset = local_region(tensors[name])
                if not local.numel() or not local.dim():
                    if local.numel():
                        read_region(local, offset, plan.tensors[name], weights.read)
                    continue
                rows = max(1, READ_BLOCK_BYTES * local.shape[0] // (local.numel() * local.element_size()))
                for start in range(0, local.shape[0], rows):  # a large shard in blocks of rows: smaller slices
                    read_region(local[start:start + rows], (offset[0] + start, *offset[1:]), plan.tensors[name],
                                weights.read)


def load_hf_checkpoint(hf_dir: PathLike) -> tuple[Any, dict[str, Tensor]]:
    """A local HF directory as ``(model config, recipe state dict)``, each file shown as it is read; weights keep
    their dtype (FP8 ones are dequantized to bf16)."""
    config, weights, plan = open_hf_checkpoint(hf_dir)
    check_tied(plan, weights.stored, weights.read)
    state_dict: dict[str, Tensor] = {}
    for _, names in progress_over(tensors_by_file(weights, plan), f"read {weights.directory}",
                                  name=lambda item: item[0]):
        state_dict.update({name: read_whole(name, plan, weights.stored, weights.read) for name in names})
    return config, {name: state_dict[name] for name in plan.tensors}


def save_hf_checkpoint(
    config: Any,
    state_dict: Mapping[str, Tensor],
    out_dir: PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_path: Optional[PathLike] = None,
) -> Path:
    """Write a recipe state dict as an HF directory that ``AutoModelForCausalLM.from_pretrained`` loads:
    ``config.json`` and safetensors (sharded with an index beyond ``max_shard_bytes``). With
    ``tokenizer_path``, the tokenizer is saved alongside and its bos/eos ids go into the config."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    hf_state_dict = recipe_to_hf_state_dict(state_dict, config)
    fp32 = families.of_config(config).hf.fp32_names  # kept in fp32 by transformers in a model of any dtype
    dtypes = {t.dtype for name, t in hf_state_dict.items() if not name.endswith(fp32)} or {torch.float32}
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
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for file_name, shard in progress_over(zip(names, shards), f"write {out_dir}", name=lambda item: item[0]):
        save_file(shard, out_dir / file_name, metadata=metadata)
    if len(shards) > 1:
        weight_map = {name: file_name for file_name, shard in zip(names, shards) for name in shard}
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

