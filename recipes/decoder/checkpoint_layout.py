"""The recipe's checkpoint layout: what a recipe checkpoint holds, and reading / writing it on the CPU.

A recipe checkpoint is a Lightning checkpoint of the recipe's LightningModule (``module.DecoderLM``), which holds
the family's model (``LLaMA`` for the LLaMA family) as ``self.model``:

* ``checkpoint["state_dict"]``: the LightningModule's state dict, so the model's weights are the keys
  starting with ``STATE_DICT_PREFIX`` (``"model."``); other keys are not the model's and are ignored.
* ``checkpoint["hyper_parameters"][FAMILY_HPARAM]`` (``"family"``): the model family's name in
  ``recipes/families.py``; checkpoints without it (written before families existed) are ``DEFAULT_FAMILY``'s.
* ``checkpoint["hyper_parameters"][CONFIG_HPARAM]`` (``"config"``): the family's config as a dict of its
  fields (``LLaMAConfig.to_dict()``), a config object, or a preset name such as ``"tiny"``.
* The tokenizer directory, optional: the first of ``TOKENIZER_HPARAMS`` found in
  ``checkpoint["hyper_parameters"]``, then in ``checkpoint["datamodule_hyper_parameters"]``.

Checkpoints written before ``FeedForward`` held separate gate and up layers store one fused ``w_gate_up`` per
MLP; reading them splits it (``transformer.split_fused_gate_up``), so their weights start runs, generate and
convert as before. Their optimizer state follows the old layout, so ``train.py`` refuses to resume one
(``fused_gate_up_names``) and says to start from its weights instead.

It is stored either as one file (``torch.save`` of that dict: a consolidated checkpoint) or as a
Lightning sharded directory: ``torch.distributed.checkpoint`` files holding ``"state_dict"`` (and
optimizer states), plus ``meta.pt`` with everything else, hyper-parameters included.

This module defines that layout and nothing else reads or writes it: the LightningModule's ``init_from``,
``train.py``'s resume check, ``generate.py`` and the Hugging Face conversion (``hf_checkpoint.py``) go through it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import Tensor

from lightning_npu.strategies.checkpoints.offline import read_sharded_state_dict
from recipes import families, legacy
from recipes.decoder.transformer import is_fused_gate_up, split_fused_gate_up

PathLike = Union[str, os.PathLike]
_REPO_ROOT = Path(__file__).resolve().parents[2]

STATE_DICT_PREFIX = "model."
CONFIG_HPARAM = "config"
FAMILY_HPARAM = "family"
TOKENIZER_HPARAMS = ("tokenizer_path", "tokenizer")
LIGHTNING_METADATA_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
DCP_METADATA_FILE = ".metadata"
# Wrappers that prefix parameter names: torch.compile's OptimizedModule and activation checkpointing.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


class CheckpointError(ValueError):
    """A checkpoint does not match the recipe; the message names the tensor or file, why, and the fix."""


# --------------------------------------------------------------------------------------------------
# The model's tensors
# --------------------------------------------------------------------------------------------------


def expected_shapes(config: Any) -> dict[str, torch.Size]:
    """Parameter name -> shape of the family's model of ``config``, computed on the meta device (no memory)."""
    with torch.device("meta"):
        model = families.of_config(config).model_class(config)
    return {name: p.shape for name, p in model.state_dict().items()}


def check_state_dict(state_dict: Mapping[str, Tensor], config: Any, *, source: str) -> None:
    """Raise ``CheckpointError`` unless ``state_dict`` has exactly the parameters of the model of ``config``
    with the right shapes. ``source`` names where the weights came from, for the message."""
    shapes = expected_shapes(config)
    missing = [name for name in shapes if name not in state_dict]
    unknown = [name for name in state_dict if name not in shapes]
    if unknown:
        raise CheckpointError(
            f"{source} has {len(unknown)} tensor(s) that a {type(config).__name__} model does not have:"
            f" {some_names(unknown)}. Expected names like {some_names(list(shapes), 3)}; is this a checkpoint of"
            " the recipe, of that model family?"
        )
    if missing:
        raise CheckpointError(
            f"{source} lacks {len(missing)} tensor(s) of the model: {some_names(missing)}. "
            f"Check that its config ({describe_shape(config)}) matches the weights."
        )
    for name, shape in shapes.items():
        if state_dict[name].shape != shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(state_dict[name].shape)} but the config "
                f"({describe_shape(config)}) needs {tuple(shape)}. The weights and the config disagree."
            )


# --------------------------------------------------------------------------------------------------
# Reading and writing recipe checkpoints
# --------------------------------------------------------------------------------------------------


def make_recipe_checkpoint(
    config: Any, model_state_dict: Mapping[str, Tensor], *, tokenizer_path: Optional[PathLike] = None
) -> dict[str, Any]:
    """A consolidated checkpoint dict in the layout above, from the model's own state dict.
    It loads with the LightningModule's ``load_state_dict`` and holds no optimizer or loop state."""
    import lightning

    hparams: dict[str, Any] = {FAMILY_HPARAM: families.name_of_config(config), CONFIG_HPARAM: config.to_dict()}
    if tokenizer_path is not None:
        hparams[TOKENIZER_HPARAMS[0]] = str(tokenizer_path)
    return {
        "state_dict": {STATE_DICT_PREFIX + name: tensor for name, tensor in model_state_dict.items()},
        "hyper_parameters": hparams,
        "pytorch-lightning_version": lightning.__version__,
    }


def save_recipe_checkpoint(
    path: PathLike,
    config: Any,
    model_state_dict: Mapping[str, Tensor],
    *,
    tokenizer_path: Optional[PathLike] = None,
) -> Path:
    """``torch.save`` a consolidated recipe checkpoint to ``path`` (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(make_recipe_checkpoint(config, model_state_dict, tokenizer_path=tokenizer_path), path)
    return path


def read_recipe_metadata(path: PathLike) -> dict[str, Any]:
    """The non-weight part of a recipe checkpoint (hyper-parameters etc.). For a sharded directory it
    reads only ``meta.pt``; a file is memory-mapped, so its tensors are not read."""
    path = existing_path(path, "recipe checkpoint")
    if path.is_dir():
        _check_sharded_dir(path)
        return _torch_load(path / LIGHTNING_METADATA_FILE)
    checkpoint = _torch_load(path, mmap=True)
    _check_is_checkpoint(checkpoint, path)
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    return checkpoint


def load_recipe_checkpoint(path: PathLike) -> tuple[Any, dict[str, Tensor]]:
    """Read a recipe checkpoint (a consolidated file or a sharded DCP directory) on the CPU, without a
    process group. Returns its model config and the model's own state dict (prefix removed),
    checked against the config."""
    metadata, state_dict = read_model_tensors(path)
    config = config_from_hparams(metadata.get("hyper_parameters"), source=str(path))
    check_state_dict(state_dict, config, source=f"Recipe checkpoint {path}")
    return config, state_dict


def read_model_tensors(path: PathLike) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A recipe checkpoint's metadata (everything but the tensors) and the model's tensors in it (prefix
    removed), unchecked: a LoRA checkpoint holds adapters only (see ``lora.py``)."""
    path = existing_path(path, "recipe checkpoint")
    if path.is_dir():
        _check_sharded_dir(path)
        metadata = _torch_load(path / LIGHTNING_METADATA_FILE)
        full_state_dict = _load_dcp_state_dict(path)
    else:
        metadata = _torch_load(path, mmap=True)
        _check_is_checkpoint(metadata, path)
        full_state_dict = metadata.pop("state_dict")
        metadata.pop("optimizer_states", None)
    return metadata, _model_state_dict(full_state_dict, source=str(path))


def fused_gate_up_names(path: PathLike) -> list[str]:
    """The fused gate/up tensors (the layout before ``FeedForward`` held two layers) that the recipe checkpoint at
    ``path`` stores, read from its index (a sharded directory's DCP metadata, a file's memory map)."""
    path = existing_path(path, "recipe checkpoint")
    if path.is_dir():
        from torch.distributed.checkpoint import FileSystemReader

        names = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    else:
        names = _torch_load(path, mmap=True).get("state_dict", {})
    model_names = [name.split(STATE_DICT_PREFIX, 1)[-1] for name in names if STATE_DICT_PREFIX in name]
    return [name for name in model_names if is_fused_gate_up(name)]


def config_from_hparams(hparams: Optional[Mapping[str, Any]], *, source: str = "the checkpoint") -> Any:
    """The model config stored under ``hyper_parameters[CONFIG_HPARAM]`` (dict, config or preset name), of the
    family named under ``hyper_parameters[FAMILY_HPARAM]`` (``families.DEFAULT_FAMILY`` when absent)."""
    if not hparams or CONFIG_HPARAM not in hparams:
        raise CheckpointError(
            f"{source} has no hyper_parameters[{CONFIG_HPARAM!r}], so the model's shape is unknown. Save the "
            f"LightningModule's model config there (self.save_hyperparameters() with a `{CONFIG_HPARAM}` argument)."
        )
    try:
        config_class = families.get(hparams.get(FAMILY_HPARAM, families.DEFAULT_FAMILY)).config_class
    except ValueError as error:
        raise CheckpointError(f"{source}: hyper_parameters[{FAMILY_HPARAM!r}]: {error}") from None
    value = hparams[CONFIG_HPARAM]
    if isinstance(value, config_class):
        return value
    if isinstance(value, str):
        return config_class.from_preset(value)
    if isinstance(value, Mapping):
        return config_class.from_dict(value)
    raise CheckpointError(
        f"{source}: hyper_parameters[{CONFIG_HPARAM!r}] is a {type(value).__name__}; expected a dict of "
        f"{config_class.__name__} fields, a {config_class.__name__}, or a preset name."
    )


def tokenizer_from_metadata(metadata: Mapping[str, Any]) -> Optional[str]:
    """The tokenizer path stored in a checkpoint's hyper-parameters (see the layout above), or None.

    A relative path that does not exist from the working directory is taken relative to the repository
    root, where the recipe's configs name it (``recipes/assets/tokenizer``); one in the assets directory of the
    recipe's former layout, as the same file in the new one (``legacy.moved_path``).
    """
    for section in ("hyper_parameters", "datamodule_hyper_parameters"):
        hparams = metadata.get(section) or {}
        for key in TOKENIZER_HPARAMS:
            value = hparams.get(key) if isinstance(hparams, Mapping) else getattr(hparams, key, None)
            if isinstance(value, (str, os.PathLike)):
                path = Path(value)
                if not path.is_absolute() and not path.exists() and (_REPO_ROOT / path).exists():
                    path = _REPO_ROOT / path
                return legacy.moved_path(path)
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
            f"{some_names(list(full_state_dict), 3)}). The recipe's LightningModule keeps its model as `self.model`."
        )
    return split_fused_gate_up(out)


def _load_dcp_state_dict(path: Path) -> dict[str, Tensor]:
    try:
        return read_sharded_state_dict(path)
    except KeyError:
        raise CheckpointError(
            f"Sharded checkpoint {path} holds no 'state_dict' entry; it is not a Lightning checkpoint."
        ) from None


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
# Message helpers (shared with hf_checkpoint.py)
# --------------------------------------------------------------------------------------------------


def existing_path(path: PathLike, what: str) -> Path:
    """``path`` as a ``Path``; ``FileNotFoundError`` naming ``what`` it should be when it does not exist."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"The {what} {str(path)!r} does not exist; check the path.")
    return path


def some_names(names: list[str], limit: int = 5) -> str:
    """The first ``limit`` names, quoted, and how many more there are."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def describe_shape(config: Any) -> str:
    """The integer fields of ``config`` (those that set tensor shapes), for messages."""
    integral = [(name, value) for name, value in config.to_dict().items()
                if isinstance(value, int) and not isinstance(value, bool)]
    return ", ".join(f"{name}={value}" for name, value in integral)
