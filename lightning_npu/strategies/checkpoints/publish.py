"""Atomic publication of a checkpoint, and the repair of an interrupted one.

Every save is written under a hidden temporary name next to its target (``.<name>.tmp-<token>``) and made visible by
one rename on global rank 0 once every rank's part is on disk. A directory that replaces an existing checkpoint first
moves the old one aside (``.<name>.old-<token>``), then renames the new one in, then deletes the old one; a crash
between the two renames is repaired by :func:`recover` (the next save into that directory, or a load of that path,
puts the old checkpoint back). Leftover temporary names are never read: Lightning's ``ckpt_path="last"`` only matches
``last*.ckpt``.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

_TMP, _OLD = ".tmp-", ".old-"
_LEFTOVER = re.compile(r"^\.(?P<name>.+)(?P<kind>\.tmp-|\.old-)(?P<token>[0-9a-f]{12})$")


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def temporary_path(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}{_TMP}{token}"


def aside_path(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}{_OLD}{token}"


def publish(temporary: Path, path: Path, token: str) -> None:
    """Make the complete checkpoint at ``temporary`` visible as ``path`` (one rename; the old one is removed after)."""
    if path.is_dir() or (temporary.is_dir() and path.exists()):
        # A directory cannot atomically replace a non-empty directory: move the old one aside, rename the new one
        # in, then delete the old one. `recover` repairs a crash between the two renames.
        old = aside_path(path, token)
        os.replace(path, old)
        os.replace(temporary, path)
        _sync_directory(path.parent)
        _remove(old)
    else:
        os.replace(temporary, path)  # a file replaces a file atomically
        _sync_directory(path.parent)


def recover(directory: Path) -> None:
    """Repair what an interrupted save left in ``directory``: put back a checkpoint that was moved aside and never
    replaced, delete temporary checkpoints and old ones already replaced. Run on one rank, with no save in flight."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        match = _LEFTOVER.match(entry.name)
        if match is None:
            continue
        target = directory / match["name"]
        if match["kind"] == _OLD and not target.exists():
            os.replace(entry, target)
        else:
            _remove(entry)


def remove_checkpoint_path(path: Path) -> None:
    if path.exists() or path.is_symlink():
        _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=False)
    else:
        path.unlink(missing_ok=True)


def _sync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
