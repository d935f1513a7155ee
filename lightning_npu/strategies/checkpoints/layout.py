"""What a checkpoint of the ``npu_fsdp`` strategies looks like on disk, and how to name the command that turns a
sharded one into one file.

The layout is Lightning's ``ModelParallelStrategy``'s: a sharded checkpoint is a directory with torch distributed
checkpoint (DCP) files -- ``__<rank>_0.distcp`` shards and ``.metadata`` -- plus ``meta.pt`` with everything else (step
counters, hyper-parameters, callback states); a full checkpoint is one ``torch.save`` file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from lightning_npu.compat import LIGHTNING_METADATA_FILENAME

#: DCP's index file inside a sharded checkpoint directory.
DCP_METADATA_FILENAME = ".metadata"
#: ``meta.pt``: the non-tensor part of a sharded checkpoint.
META_FILENAME = LIGHTNING_METADATA_FILENAME
CONSOLIDATE_HINT = "lightning-npu consolidate {path} consolidated.ckpt"


def is_sharded_checkpoint(path: Union[str, Path]) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (what a sharded save of these strategies writes)."""
    path = Path(path)
    return path.is_dir() and (path / DCP_METADATA_FILENAME).is_file()


def consolidate_hint(path: Union[str, Path]) -> str:
    """The one-line command that turns the sharded checkpoint ``path`` into one file."""
    return CONSOLIDATE_HINT.format(path=str(path).rstrip("/"))


def directory_error(path: Path, what: str) -> IsADirectoryError:
    """The error for a sharded directory met where only a file works; names the command that makes the file."""
    return IsADirectoryError(
        f"{path} is a sharded checkpoint directory, but {what} needs one checkpoint file. Consolidate it first:"
        f" `{consolidate_hint(path)}`"
    )
