"""How a model tells the planner its memory profile, without the package importing the model.

The protocol. A model's package holds a module named ``memory_profile`` next to the module that defines the
model's classes (``recipes/models/llama/memory_profile.py`` next to ``recipes/models/llama/model.py``), importable without
torch, defining::

    def lightning_npu_memory_profile(model: Mapping[str, Any]) -> lightning_npu.plan.DecoderProfile

It receives the config's ``model:`` section (its ``init_args`` when the section is a ``class_path`` +
``init_args`` pair) and returns the model's ``DecoderProfile``: its shape, name and block class (a model whose
block saves other tensors returns a subclass that overrides the counting). It raises ``ValueError`` for a
``model:`` section it cannot build; the planner reports the message.

Where the planner looks, first match wins:

1. ``--profile MODULE`` (a dotted module name or a ``.py`` file);
2. the config's class paths (``model.class_path``, the dotted entries of the strategy's ``auto_wrap_policy`` /
   ``activation_checkpointing_policy``): ``a.b.model.Block`` -> module ``a.b.memory_profile``. The directory that
   holds package ``a`` is found by walking up from the config file and put first on ``sys.path``, so a checkout's
   configs find their own recipe from any working directory; if none holds it, ``a`` is imported as installed;
3. the nearest ``memory_profile.py`` in the config's directory or above (for configs that name classes bare).

A model with no profile is planned from its shapes: ``--model-shape`` (``ModelShape.parse``).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from lightning_npu.plan.decoder import DecoderProfile
from lightning_npu.plan.shape import PlanError

PROFILE_MODULE = "memory_profile"
PROFILE_FUNCTION = "lightning_npu_memory_profile"


def class_paths(document: Mapping[str, Any]) -> list[str]:
    """The dotted class paths a config names: ``model.class_path`` and the npu_fsdp strategy's policies."""
    paths = []
    model = document.get("model")
    if isinstance(model, Mapping) and isinstance(model.get("class_path"), str):
        paths.append(model["class_path"])
    trainer = document.get("trainer")
    strategy = trainer.get("strategy") if isinstance(trainer, Mapping) else None
    strategy = strategy.get("init_args") if isinstance(strategy, Mapping) else None
    if not isinstance(strategy, Mapping):
        return paths
    for option in ("auto_wrap_policy", "activation_checkpointing_policy"):
        policy = strategy.get(option)
        entries = [policy] if isinstance(policy, str) else list(policy) if isinstance(policy, (list, tuple)) else []
        paths += [str(entry) for entry in entries if "." in str(entry)]
    return paths


def find_profile(config: Optional[Path], paths: Iterable[str], explicit: Optional[str] = None) -> tuple[str, Any]:
    """(where it was found, the ``lightning_npu_memory_profile`` function) for a config, per the module docstring."""
    if explicit:
        return explicit, _function(_import_explicit(explicit), explicit)
    start = config.resolve().parent if config is not None else None
    for path in paths:
        module, _, _ = path.rpartition(".")
        package = module.rpartition(".")[0]
        if not package:
            continue
        name = f"{package}.{PROFILE_MODULE}"
        _put_on_path(_holder_of(package.partition(".")[0], start))
        try:
            found = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is not None and name.startswith(error.name):
                continue  # no profile next to this class: try the next path
            raise PlanError(f"importing {name} (the memory profile of {path}) failed: {error}") from None
        return name, _function(found, name)
    if start is not None:
        for directory in (start, *start.parents):
            if (directory / f"{PROFILE_MODULE}.py").is_file():
                file = directory / f"{PROFILE_MODULE}.py"
                return str(file), _function(_import_file(file), str(file))
    where = f" {config}" if config is not None else ""
    raise PlanError(
        f"no memory profile for the model of config{where}: it names no model class by import path with a"
        f" {PROFILE_MODULE}.py next to it (e.g. auto_wrap_policy: [recipes.models.llama.model.TransformerBlock]);"
        f" pass --profile MODULE, or give the model's shapes with --model-shape"
    )


def class_arguments(section: Mapping[str, Any]) -> Mapping[str, Any]:
    """A config section's arguments: its ``init_args`` when it is a ``class_path`` + ``init_args`` pair (LightningCLI's
    form for a subclass, e.g. ``data: {class_path: recipes.decoder.sft_data.SFTDataModule, init_args: {...}}``), else
    the section itself."""
    if isinstance(section.get("class_path"), str):
        arguments = section.get("init_args") or {}
        if not isinstance(arguments, Mapping):
            raise PlanError(f"init_args of {section['class_path']} must be a mapping, not {arguments!r}")
        return arguments
    return section


def load_profile(function: Any, where: str, model: Mapping[str, Any]) -> DecoderProfile:
    """Call a profile function on the config's ``model:`` section; its ValueError becomes a PlanError."""
    model = class_arguments(model)
    try:
        profile = function(model)
    except (ValueError, TypeError) as error:
        raise PlanError(f"model: {error}") from None
    if not isinstance(profile, DecoderProfile):
        raise PlanError(f"{where}.{PROFILE_FUNCTION} returned {type(profile).__name__}, not a DecoderProfile")
    return profile


def _holder_of(top: str, start: Optional[Path]) -> Optional[Path]:
    """The nearest directory at or above ``start`` that contains package (or module) ``top``."""
    if start is None:
        return None
    for directory in (start, *start.parents):
        if (directory / top / "__init__.py").is_file() or (directory / f"{top}.py").is_file():
            return directory
    return None


def _put_on_path(directory: Optional[Path]) -> None:
    if directory is not None and str(directory) not in sys.path:
        sys.path.insert(0, str(directory))


def _import_file(file: Path) -> Any:
    """Import ``file`` under its dotted name: its package directories (those with ``__init__.py``) above it name
    it, and the first directory that is no package goes on ``sys.path``, so its absolute imports work."""
    parts, directory = [file.stem], file.parent
    while (directory / "__init__.py").is_file():
        parts.insert(0, directory.name)
        directory = directory.parent
    _put_on_path(directory)
    name = ".".join(parts)
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise PlanError(f"importing {name} from {file} failed: {error}") from None


def _import_explicit(where: str) -> Any:
    if where.endswith(".py"):
        file = Path(where)
        if not file.is_file():
            raise PlanError(f"--profile {where!r} does not exist; give a memory_profile.py or a module name")
        return _import_file(file.resolve())
    try:
        return importlib.import_module(where)
    except ImportError as error:
        raise PlanError(f"--profile {where!r} cannot be imported ({error}); give an importable module or a .py file")


def _function(module: Any, where: str) -> Any:
    function = getattr(module, PROFILE_FUNCTION, None)
    if not callable(function):
        raise PlanError(f"{where} defines no {PROFILE_FUNCTION}(model) function; see lightning_npu.plan.profile")
    return function
