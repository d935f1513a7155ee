"""The modules of ``lightning_npu/`` and ``recipes/`` import one another without a circle: every import statement
(at module level or inside a function, absolute or relative) is an arrow from its module to the module it names, and
no set of modules reaches itself along those arrows."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

ROOTS = ("lightning_npu", "recipes")


def _modules(repo: Path) -> dict[str, tuple[Path, str]]:
    """Each module's dotted name -> (its file, the package its relative imports start from)."""
    modules = {}
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            parts = path.relative_to(repo).with_suffix("").parts
            package = ".".join(parts[:-1])
            modules[package if parts[-1] == "__init__" else ".".join(parts)] = (path, package)
    return modules


def _imported(node: ast.Import | ast.ImportFrom, package: str, modules: dict) -> set[str]:
    """The modules of ``modules`` one import statement names: ``from a import b`` names ``a.b`` when that is a
    module, else ``a``. The parent packages an import runs on the way are not counted (a package that imports its
    own submodules would otherwise close a circle with each of them)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(filter(None, [*anchor, base]))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:  # `import a.b.c` of an attribute path, or a name outside the roots
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def import_graph(repo: Path) -> dict[str, set[str]]:
    """Module -> the modules it imports, over every import statement in ``repo``'s ``ROOTS``."""
    modules = _modules(repo)
    graph = {}
    for name, (path, package) in modules.items():
        tree = ast.parse(path.read_text())
        imports = (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))
        graph[name] = set().union(*(_imported(node, package, modules) for node in imports)) - {name}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` reaches along one or more arrows (itself only if it is on a circle)."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    return seen


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that reach one another (a strongly connected component of more than one module)."""
    reach = {name: _reachable(graph, name) for name in graph}
    return sorted({tuple(sorted(other for other in reach[name] if name in reach[other]))
                   for name in graph if name in reach[name]})


def test_import_graph_resolves_relative_function_level_and_submodule_imports(tmp_path):
    """The graph sees the arrows the circle check depends on: a relative import, one inside a function, and
    ``from package import submodule`` as an arrow to the submodule, not to the package."""
    package = tmp_path / "lightning_npu"
    (package / "sub").mkdir(parents=True)
    (tmp_path / "recipes").mkdir()
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import a\n")
    (package / "sub" / "a.py").write_text("from .b import thing\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..top import other\n")
    (package / "top.py").write_text("from lightning_npu.sub import a\nimport lightning_npu.sub.b\n")
    (tmp_path / "recipes" / "__init__.py").write_text("import lightning_npu.top.attribute\nimport torch\n")
    assert import_graph(tmp_path) == {
        "lightning_npu": set(),
        "lightning_npu.sub": {"lightning_npu.sub.a"},
        "lightning_npu.sub.a": {"lightning_npu.sub.b"},
        "lightning_npu.sub.b": {"lightning_npu.top"},
        "lightning_npu.top": {"lightning_npu.sub.a", "lightning_npu.sub.b"},
        "recipes": {"lightning_npu.top"},
    }
    assert circles(import_graph(tmp_path)) == [("lightning_npu.sub.a", "lightning_npu.sub.b", "lightning_npu.top")]


def test_no_modules_of_the_package_or_the_recipes_import_each_other_in_a_circle():
    """Catches a circle such as the doctor's probe <-> _probe_child or the planner's spec <-> decoder (each imported
    the other, one of them inside a function): a circle's modules cannot be read, tested or moved one at a time, and
    which one finishes importing first depends on which a user imports first."""
    assert circles(import_graph(REPO)) == []


def _family(module: str) -> str | None:
    """The family folder ``module`` belongs to (``recipes.models.<family>...``), or None for a shared module."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["recipes", "models"] and len(parts) > 2 else None


def arrows_between_families(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Each arrow from a family folder into another family's folder, or from a shared module of ``recipes/`` (the
    decoder room, the scripts) into any family's: shared model code lives in ``recipes/decoder/``, and only
    ``recipes/families.py`` names the families (by string, to import them on demand)."""
    found = []
    for module, imported in graph.items():
        if not module.startswith("recipes"):
            continue
        for other in imported:
            theirs = _family(other)
            if theirs is not None and theirs != _family(module):
                found.append((module, other))
    return sorted(found)


def test_arrows_between_families_sees_an_import_of_another_family_and_from_shared_code(tmp_path):
    for folder in ("recipes/models/llama", "recipes/models/qwen", "recipes/decoder", "lightning_npu"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "recipes" / "models" / "llama" / "rotary.py").write_text("import torch\n")
    (tmp_path / "recipes" / "models" / "llama" / "model.py").write_text("from .rotary import torch\n")
    (tmp_path / "recipes" / "models" / "qwen" / "model.py").write_text("from recipes.models.llama.rotary import x\n")
    (tmp_path / "recipes" / "decoder" / "lora.py").write_text("def f():\n    import recipes.models.qwen.model\n")
    assert arrows_between_families(import_graph(tmp_path)) == [
        ("recipes.decoder.lora", "recipes.models.qwen.model"),
        ("recipes.models.qwen.model", "recipes.models.llama.rotary"),
    ]


def test_no_family_folder_imports_another_family_and_no_shared_module_imports_a_family():
    """Catches DeepSeek importing the MoE family's layers or Qwen LLaMA's rotary helpers: what two families share
    (MoE layers, router, rotary and its scaling, their HF and memory-profile parts) lives in ``recipes/decoder/``,
    so a family folder holds only its own model, HF name map, presets, plan, memory profile and configs, and can be
    changed or removed without touching another."""
    assert arrows_between_families(import_graph(REPO)) == []
