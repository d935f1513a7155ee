"""``lightning_npu.compat`` fences Lightning's and torch's private names: each resolves on the installed versions,
a missing one fails ``import`` with the supported and found versions, and no other module spells one."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import sys
import tomllib
import types
from collections import defaultdict
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import lightning_npu
from lightning_npu import compat
from tests.helpers import REPO, read_json, room_scripts, run_python

SCRIPTS = room_scripts("package")

PACKAGE = REPO / "lightning_npu"
FRAMEWORK_ROOTS = ("torch", "lightning")


def _declared_ranges() -> list[str]:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    requirements = {req.name: req for req in map(Requirement, dependencies)}
    return [f"{name}{requirements[name].specifier}" for name in FRAMEWORK_ROOTS]


def test_every_fenced_private_name_resolves_on_the_installed_versions():
    """Catches a fence entry that names something the installed Lightning/torch lacks (a typo, or a rename that
    the import-time check would report only on the next import)."""
    names = [entry.qualified for entry in compat.FENCED]
    assert len(names) == len(set(names)), "a private name is fenced twice"
    resolved = compat.check(compat.FENCED)
    assert all(value is not None for value in resolved)
    for public, entry in compat.IMPORTED.items():
        assert getattr(compat, public) is entry.resolve()
    assert "lightning.fabric.connector._Connector._choose_strategy" in names
    assert "torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner" in names


def test_a_renamed_lightning_class_fails_import_with_the_supported_and_found_versions(monkeypatch):
    """Catches the bare AttributeError/ImportError a Lightning rename gave before: importing the fence with
    ``lightning.fabric.connector._Connector`` gone must name it, the supported ranges of pyproject.toml and the
    installed versions."""
    import lightning.fabric.connector

    monkeypatch.delattr(lightning.fabric.connector, "_Connector")
    spec = importlib.util.spec_from_file_location("compat_without_connector", PACKAGE / "compat.py")
    fresh = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, fresh)  # a module being imported is in sys.modules
    with pytest.raises(ImportError) as raised:
        spec.loader.exec_module(fresh)
    message = str(raised.value)
    assert "lightning.fabric.connector._Connector" in message
    assert all(declared in message for declared in _declared_ranges()), message
    assert f"lightning {importlib.metadata.version('lightning')}" in message
    assert f"torch {importlib.metadata.version('torch')}" in message


def test_a_missing_instance_attribute_is_reported_with_every_other_missing_name():
    """Catches an instance attribute (set in Lightning's ``__init__``, so absent from the class) that is not
    checked: a stand-in strategy whose code never sets ``_ddp_kwargs`` must be reported, together with a
    missing module attribute, in one error."""

    class DDPStrategy:
        def __init__(self) -> None:
            self._timeout = None

    standin = types.SimpleNamespace(DDPStrategy=DDPStrategy)
    entries = [
        compat.Fenced("standin:DDPStrategy", "_timeout", instance=True),
        compat.Fenced("standin:DDPStrategy", "_ddp_kwargs", instance=True),
        compat.Fenced("standin", "_load"),
    ]
    with pytest.raises(ImportError) as raised:
        compat.check(entries, import_module=lambda name: standin)
    message = str(raised.value)
    assert "standin.DDPStrategy._ddp_kwargs" in message and "standin._load" in message
    assert "standin.DDPStrategy._timeout" not in message
    assert compat.check(entries[:1], import_module=lambda name: standin) == ["_timeout"]


# ---- the fence is the only place ------------------------------------------------------------------------------


def _modules() -> list[types.ModuleType]:
    found = []
    for info in pkgutil.walk_packages(lightning_npu.__path__, "lightning_npu."):
        if not info.name.endswith("__main__"):
            found.append(importlib.import_module(info.name))
    return [lightning_npu, *found]


def _framework_names_by_class(modules: list[types.ModuleType]) -> dict[str, set[str]]:
    """For each class of the package (by qualified name), the names its Lightning/torch bases' code uses; a mixin
    gets those of every package class it is mixed into."""
    names: dict[str, set[str]] = defaultdict(set)
    for module in modules:
        for cls in vars(module).values():
            if not (isinstance(cls, type) and cls.__module__ == module.__name__):
                continue
            framework = set()
            for base in cls.__mro__:
                if base.__module__.split(".")[0] in FRAMEWORK_ROOTS:
                    framework |= compat.code_names(base)
            for base in cls.__mro__:
                if base.__module__.startswith("lightning_npu"):
                    names[f"{base.__module__}.{base.__qualname__}"] |= framework
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, framework: dict[str, set[str]], own: set[str], overridable: set[str]) -> None:
        self.module, self.framework, self.own, self.overridable = module, framework, own, overridable
        self.classes: list[str] = []
        self.found: list[str] = []

    def _where(self, node: ast.AST) -> str:
        return f"{self.module}:{node.lineno}"

    def _check(self, node: ast.AST, target: ast.AST, name: str) -> None:
        if not _private(name):
            return
        itself = isinstance(target, ast.Name) and target.id in ("self", "cls")
        parent = isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super"
        if (itself or parent) and self.classes:
            # A fenced override may call its parent's version; any other inherited private name is unfenced.
            if name in self.framework.get(self.classes[-1], ()) and name not in self.overridable:
                self.found.append(f"{self._where(node)} self.{name}")
        elif isinstance(target, ast.Name) and target.id in sys.stdlib_module_names:
            return  # os._exit and the like: the standard library's documented API
        elif name not in self.own:
            self.found.append(f"{self._where(node)} .{name}")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer = self.classes[-1] if self.classes else self.module
        self.classes.append(f"{outer}.{node.name}")
        self.generic_visit(node)
        self.classes.pop()

    def visit_Name(self, node: ast.Name) -> None:
        # A class-body assignment of an inherited private name (``_registered_strategies = []``) overrides it.
        if isinstance(node.ctx, ast.Store) and self.classes and _private(node.id) \
                and node.id in self.framework.get(self.classes[-1], ()):
            self.found.append(f"{self._where(node)} assigns {node.id}")

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if self.classes and _private(node.name) and node.name in self.framework.get(self.classes[-1], ()):
            if node.name not in self.overridable:
                self.found.append(f"{self._where(node)} overrides {node.name}")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            self._check(node, node.args[0], node.args[1].value)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if module.split(".")[0] in FRAMEWORK_ROOTS:
            private = [part for part in module.split(".") if _private(part)]
            private += [alias.name for alias in node.names if _private(alias.name)]
            if private:
                self.found.append(f"{self._where(node)} from {module} import {private}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in FRAMEWORK_ROOTS and any(map(_private, alias.name.split("."))):
                self.found.append(f"{self._where(node)} import {alias.name}")


class _Definitions(ast.NodeVisitor):
    """Private names the package defines itself: functions, classes, variables, imports of its own modules, and
    attributes its classes assign on ``self`` (an assignment on another object defines nothing)."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.in_class = 0

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.names.add(node.name)
        self.in_class += 1
        self.generic_visit(node)
        self.in_class -= 1

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.names.add(node.name)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.names.add(node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Store) and self.in_class and isinstance(node.value, ast.Name) and node.value.id == "self":
            self.names.add(node.attr)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if (node.module or "").startswith("lightning_npu"):
            self.names.update((node.module or "").split("."))
            self.names.update(alias.asname or alias.name for alias in node.names)


def _own_private_names(trees: dict[str, ast.Module], framework: set[str]) -> set[str]:
    """What the package defines (see ``_Definitions``) and no Lightning/torch base class of it also uses."""
    definitions = _Definitions()
    for tree in trees.values():
        definitions.visit(tree)
    return {name for name in definitions.names if _private(name)} - framework


def test_no_module_but_compat_touches_a_lightning_or_torch_private_name():
    """Catches a private Lightning/torch name used outside the fence (``connector._accelerator_flag``,
    ``from lightning... import _x``, ``self._ddp_kwargs`` on a Lightning subclass, ``torch.distributed._composable``,
    an unfenced override of a private Lightning method): a rename upstream would then fail mid-run, unreported."""
    modules = _modules()
    framework = _framework_names_by_class(modules)
    paths = sorted(p for root in (PACKAGE, REPO / "recipes") for p in root.rglob("*.py") if p != PACKAGE / "compat.py")
    trees = {str(p.relative_to(REPO)): ast.parse(p.read_text()) for p in paths}
    own = _own_private_names(trees, set().union(*framework.values()))
    overridable = {entry.name for entry in compat.OVERRIDDEN}
    found = []
    for path, tree in trees.items():
        module = path[:-3].replace("/", ".").removesuffix(".__init__")
        visitor = _Visitor(module, framework, own, overridable)
        visitor.visit(tree)
        found += visitor.found
    assert not found, "private Lightning/torch names outside lightning_npu/compat.py:\n" + "\n".join(found)


# ---- the explicit-instance path ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_explicit_instances_train_without_the_connector_wraps(tmp_path):
    """Catches an explicit-instance run (``accelerator=NPUAccelerator()``, an ``NPUFSDPStrategy``, a precision
    plugin instance) that silently depends on the private connector wraps: with Lightning's own connector methods
    put back, two simulated NPUs must still train under the NPU strategy with bf16 autocast on the runtime's device
    (a CUDA autocast would leave the fp32 matmul in fp32)."""
    run_python([str(SCRIPTS / "explicit_run.py"), "--out", str(tmp_path)])
    result = read_json(tmp_path / "result.json")
    assert len(result["restored"]) == 6 and result["still_wrapped"] == []
    assert (result["strategy"], result["accelerator"], result["world_size"]) == ("NPUFSDPStrategy", "NPUAccelerator", 2)
    assert result["precision_device"] == "cpu"  # the simulated runtime's device type
    assert result["matmul_dtypes"] == ["torch.bfloat16"]
    assert len(result["losses"]) == 3 and result["losses"][-1] < result["losses"][0]
