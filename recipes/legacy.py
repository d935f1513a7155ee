"""The names of the recipe before it held several model families, kept working for what users already have.

Until the family layout every recipe file lived in ``recipes/llama2/``. Configs (``recipes.llama2.model.
TransformerBlock`` in ``auto_wrap_policy``, ``recipes.llama2.sft_data.SFTDataModule`` as ``data.class_path``),
the ``config.yaml`` LightningCLI saved next to each run and user code name those modules, and checkpoints record
the tokenizer as ``<repo>/recipes/llama2/assets/tokenizer``. This module maps both to their new homes:

* ``MODULES``: old module name -> new one. ``install()`` (run by ``recipes/__init__.py``) puts a finder on
  ``sys.meta_path`` that answers an import of an old name with the new module itself, imported on demand (so the
  torch-free planner still imports ``recipes.llama2.memory_profile`` without torch, and ``recipes.llama2.model.
  TransformerBlock is recipes.models.llama.model.TransformerBlock``);
* ``OLD_ASSETS``: the old assets directory, which ``moved_path`` rewrites to the new one in recorded paths.

Checkpoints of that era store no class paths and no family: the family registry's ``DEFAULT_FAMILY`` is theirs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path
from typing import Optional, Sequence, Union

from recipes import families

#: The old package itself, an empty namespace whose submodules are the aliases below.
PACKAGE = "recipes.llama2"
#: The package of the family the old recipe was: the default family, that of checkpoints naming none.
_FAMILY_PACKAGE = families.FAMILIES[families.DEFAULT_FAMILY].rpartition(".")[0]
MODULES: dict[str, str] = {
    **{f"{PACKAGE}.{name}": f"{_FAMILY_PACKAGE}.{name}" for name in ("model", "config", "memory_profile")},
    **{
        f"{PACKAGE}.{name}": f"recipes.decoder.{name}"
        for name in ("data", "sft_data", "tokenizer", "lora", "lora_config", "lora_export", "checkpoint_layout",
                     "hf_checkpoint", "module")
    },
    **{f"{PACKAGE}.{name}": f"recipes.{name}" for name in ("train", "convert", "generate")},
}
#: The old assets directory (as path parts) and the new one, relative to the repository root.
OLD_ASSETS = ("recipes", "llama2", "assets")
NEW_ASSETS = Path("recipes", "assets")
_REPO_ROOT = Path(__file__).resolve().parents[1]


class _Alias(importlib.abc.Loader):
    """Loads an old name as the new module (or, for the old package, as an empty package)."""

    def __init__(self, target: Optional[str]) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.target is None:
            package = types.ModuleType(spec.name, f"Old name of the recipe modules; see {__name__}.")
            package.__path__ = []
            return package
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the new module ran when it was imported."""


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Optional[Sequence[str]] = None,
                  target: Optional[types.ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if name == PACKAGE:
            return importlib.machinery.ModuleSpec(name, _Alias(None), is_package=True)
        if name in MODULES:
            return importlib.machinery.ModuleSpec(name, _Alias(MODULES[name]))
        return None


def install() -> None:
    """Answer imports of the old module names (once per process)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def moved_path(path: Union[str, os.PathLike]) -> str:
    """A recorded path that no longer exists and lies in the old assets directory (of any checkout: data.py
    records it absolute), as the same file in this checkout's new one if that exists; any other path as given."""
    parts = Path(path).parts
    for i in range(len(parts) - len(OLD_ASSETS) + 1):
        if parts[i:i + len(OLD_ASSETS)] == OLD_ASSETS and not Path(path).exists():
            moved = _REPO_ROOT / NEW_ASSETS / Path(*parts[i + len(OLD_ASSETS):])
            return str(moved) if moved.exists() else os.fspath(path)
    return os.fspath(path)
