"""Lightning's checkpoint file loader (``LightningModule.load_from_checkpoint``, ``TorchCheckpointIO``), taught to read
a sharded checkpoint directory of npu_fsdp as if it were one file: Lightning's loader is ``torch.load``, which
cannot open a DCP directory. Anything else loads as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from lightning_npu import compat
from lightning_npu.strategies.checkpoints.layout import DCP_METADATA_FILENAME, is_sharded_checkpoint
from lightning_npu.strategies.checkpoints.offline import read_sharded

_PATCHED = "_lightning_npu_reads_sharded"


def install() -> None:
    """Let Lightning's checkpoint file loader (``load_from_checkpoint``, ``TorchCheckpointIO``) read a sharded
    checkpoint directory as if it were one file; anything else loads as before. Idempotent."""
    import lightning.fabric.plugins.io.torch_io as torch_io
    import lightning.pytorch.core.saving as saving

    original = compat.lightning_file_loader()
    if getattr(original, _PATCHED, False):
        return

    def load(path_or_url: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> Any:
        directory = _local_directory(path_or_url)
        if directory is not None:
            return _read_for_lightning(directory, map_location)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    load.__doc__ = original.__doc__
    setattr(load, _PATCHED, True)
    # Each module bound the name at import (`from ... import _load as pl_load`): rebind every binding.
    compat.set_lightning_file_loader(load)
    for module in (saving, torch_io):
        if getattr(module, "pl_load", None) is original:
            module.pl_load = load


def _local_directory(path: Any) -> Optional[Path]:
    if not isinstance(path, (str, Path)):
        return None
    text = str(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        return None
    return Path(text) if Path(text).is_dir() else None


def _read_for_lightning(path: Path, map_location: Any) -> dict[str, Any]:
    if not is_sharded_checkpoint(path):
        raise IsADirectoryError(
            f"{path} is a directory but not a sharded checkpoint (no {DCP_METADATA_FILENAME} inside); pass a"
            " checkpoint file, or a sharded checkpoint directory written by npu_fsdp"
        )
    checkpoint = read_sharded(path)
    if isinstance(map_location, (str, torch.device)):
        checkpoint = _map_tensors(checkpoint, torch.device(map_location))
    return checkpoint


def _map_tensors(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {key: _map_tensors(value, device) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(value, device) for value in obj)
    return obj
