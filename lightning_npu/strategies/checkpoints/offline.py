"""Reading a sharded checkpoint without the strategy (one process, no process group): whole, weights only, or
consolidated into one file."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Union

import torch

from lightning_npu import compat
# No optimizer exists here to convert its own state: AdamW8bit's codes are recognised by their keys.
from lightning_npu.optim.adamw8bit import full_state
from lightning_npu.progress import Progress
from lightning_npu.strategies.checkpoints.layout import DCP_METADATA_FILENAME, is_sharded_checkpoint
from lightning_npu.strategies.checkpoints.optimizer_state import keyed_by_index
from lightning_npu.strategies.checkpoints.publish import new_token, temporary_path

_TRAINER_VERSION_KEY = "pytorch-lightning_version"


def read_sharded(path: Union[str, Path]) -> dict[str, Any]:
    """The whole sharded checkpoint at ``path`` as one in-memory dict, unsharded, on the CPU.

    A Trainer checkpoint comes back in the layout of a normal Lightning checkpoint file (``state_dict``,
    ``optimizer_states`` keyed like ``optimizer.state_dict()``, counters, hyper-parameters); a Fabric checkpoint with
    the keys it was saved with.
    """
    path = Path(path)
    if not is_sharded_checkpoint(path):
        missing = "does not exist" if not path.exists() else f"holds no {DCP_METADATA_FILENAME}"
        raise FileNotFoundError(f"{path} is not a sharded checkpoint directory: it {missing}")
    checkpoint = compat.load_distributed_checkpoint(path)
    for key, value in checkpoint.items():  # optimizer states: AdamW8bit's moments dequantized, as in a full save
        if isinstance(value, dict) and {"state", "param_groups"} <= value.keys():
            checkpoint[key] = full_state(value)
    if _TRAINER_VERSION_KEY in checkpoint and "state_dict" in checkpoint:
        numbered = sorted((int(k.split("_")[1]), k) for k in checkpoint if re.fullmatch(r"optimizer_\d+", k))
        if numbered:
            checkpoint["optimizer_states"] = [keyed_by_index(checkpoint.pop(k)) for _, k in numbered]
    return checkpoint


def read_sharded_state_dict(path: Union[str, Path]) -> dict[str, Any]:
    """Only the model weights (``state_dict``) of the sharded Trainer checkpoint at ``path``, unsharded, on the CPU,
    in one process: the optimizer states a sharded checkpoint also holds (about twice the weights) are not read."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    if not is_sharded_checkpoint(path):
        missing = "does not exist" if not path.exists() else f"holds no {DCP_METADATA_FILENAME}"
        raise FileNotFoundError(f"{path} is not a sharded checkpoint directory: it {missing}")
    loaded: dict[str, Any] = {}
    compat.dcp_load_state_dict(loaded, storage_reader=FileSystemReader(path),
                               planner=compat.EmptyStateDictLoadPlanner(keys={"state_dict"}), no_dist=True)
    if "state_dict" not in loaded:
        raise KeyError(f"the sharded checkpoint {path} holds no 'state_dict' entry: it is not a Trainer checkpoint")
    return loaded["state_dict"]


def consolidate(directory: Union[str, Path], output: Union[str, Path]) -> Path:
    """Write the sharded checkpoint ``directory`` as one checkpoint file ``output`` (atomically), the reading and
    the writing each shown as they start and end (``lightning_npu.progress``)."""
    output = Path(output)
    if output.exists() and output.is_dir():
        raise IsADirectoryError(f"the output {output} is a directory; give a file name, e.g. {output}/model.ckpt")
    with Progress("consolidate", total=2) as progress:
        with progress.step(f"read {directory}") as step:
            checkpoint = read_sharded(directory)
            files = [path for path in Path(directory).iterdir() if path.is_file()]
            step.outcome = f"{sum(path.stat().st_size for path in files) / 2**20:.1f} MiB in {len(files)} files"
        with progress.step(f"write {output}") as step:
            output.parent.mkdir(parents=True, exist_ok=True)
            temporary = temporary_path(output, new_token())
            torch.save(checkpoint, temporary)
            os.replace(temporary, output)
            step.outcome = f"{output.stat().st_size / 2**20:.1f} MiB"
    return output
