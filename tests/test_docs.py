"""README.md and the pages under docs/ cannot rot: their runnable shell blocks run, their Python blocks compile and
import what they name, their YAML blocks parse, their generated blocks match the code, and the README's two commands
are the ones CI runs. The conventions are in docs/contributing/testing.md ("Docs that cannot rot").

A fenced block is marked by an HTML comment on the line before it:

- ``<!-- docs: run -->``: run here with bash from the repository root (quick tier; ``run slow``: slow tier);
- ``<!-- docs: covered-by tests/FILE.py::TEST -->``: an existing test already runs that command; checked to exist.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO
from tools.generate_docs import BLOCKS, raised, stale

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
_MARK = re.compile(r"^\s*<!-- docs: (?P<what>run(?: slow)?|covered-by (?P<test>\S+)) -->\s*$")
_SLOW_S = 300


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mark: str  # "", "run", "run slow" or "covered-by tests/...::..."

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page`` with its language and the mark on the line before it."""
    lines, found, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, end = len(opening["indent"]), i + 1
        while not lines[end].startswith(" " * indent + "```"):
            end += 1
        mark = _MARK.match(lines[i - 1]) if i else None
        text = "\n".join(line[indent:] for line in lines[i + 1:end])
        found.append(Block(page, i + 1, opening["lang"], text, mark["what"] if mark else ""))
        i = end + 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]


def _of(lang: str, marks: tuple[str, ...] = ()) -> list[Block]:
    return [b for b in ALL if b.lang == lang and (not marks or b.mark.startswith(marks))]


def _params(selected: list[Block]):
    """One test per distinct block text (a walkthrough may repeat a command another page explains)."""
    unique = {(b.text, b.mark): b for b in reversed(selected)}.values()
    return [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.mark == "run slow" else [])
            for b in sorted(unique, key=lambda b: (str(b.page), b.line))]


def test_every_mark_sits_on_a_fenced_block():
    """Catches a mark separated from its block (it would silently stop testing it)."""
    marked = {(b.page, b.line - 1) for b in ALL if b.mark}
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("<!-- docs:"):
                assert _MARK.match(line), f"{page}:{number}: unknown mark {line.strip()!r}"
                assert (page, number) in marked, f"{page}:{number}: {line.strip()} is not on the line before a fence"


@pytest.mark.parametrize("block", _params(_of("bash", ("run",))))
def test_runnable_shell_blocks_run(block):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=_SLOW_S if block.mark == "run slow" else 60)
    assert done.returncode == 0, f"{block.id} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("block", _params(_of("bash", ("covered-by",))))
def test_covered_blocks_name_a_test_that_exists(block):
    path, _, name = block.mark.removeprefix("covered-by ").partition("::")
    tree = ast.parse((REPO / path).read_text())
    assert name in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, block.id


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                yield node.module, alias.name


@pytest.mark.parametrize("block", _params(_of("python")))
def test_python_blocks_compile_and_their_imports_resolve(block):
    tree = ast.parse(block.text, block.id)  # a SyntaxError names the page and line
    compile(tree, block.id, "exec")
    for module, name in _imports(tree):
        assert importlib.util.find_spec(module) is not None, f"{block.id}: no module {module}"
        if name is not None:
            found = hasattr(importlib.import_module(module), name) or importlib.util.find_spec(f"{module}.{name}")
            assert found, f"{block.id}: {module} has no {name}"


@pytest.mark.parametrize("block", _params(_of("yaml")))
def test_yaml_blocks_parse(block):
    # A block that includes a repository file (pymdownx.snippets, base path the checkout) is that file's text.
    include = re.fullmatch(r'--8<-- "([^"]+)"', block.text.strip())
    text = (Path(__file__).resolve().parents[1] / include.group(1)).read_text() if include else block.text
    assert isinstance(yaml.safe_load(text), dict), block.id


def test_generated_blocks_are_current():
    """The options table and the error catalogue are what ``python tools/generate_docs.py`` writes now."""
    assert BLOCKS and not stale(), f"stale: {stale()}; run python tools/generate_docs.py"


def test_the_error_catalogue_reads_an_error_helper_in_the_callers_words(tmp_path):
    """``raise self.fail(field, value, why, fix)``: the row is the error the helper returns (class and message) with
    the caller's arguments in place of the helper's parameter names, not a row for an error named ``self.fail``."""
    module = tmp_path / "lightning_npu" / "table.py"
    module.parent.mkdir()
    module.write_text(textwrap.dedent('''
        class Reader:
            def fail(self, field, value, why, fix):
                return SettingError(Problem(f"table: {field}={value!r} {why}", fix))

            def read(self, version):
                raise self.fail("version", version, "is not a version this reads", "give the file the scheduler wrote")
    '''))
    (row,) = raised(tmp_path)
    assert (row.error, row.cause, row.fix, row.where) == (
        "SettingError", "table: version={version} is not a version this reads", "Give the file the scheduler wrote",
        "lightning_npu/table.py:read")
    names_of_errors = {item.error for item in raised()}
    assert all(re.fullmatch(r"[A-Za-z_][\w.]*", name) and not name.startswith("self.") for name in names_of_errors), \
        sorted(names_of_errors)


def test_the_readme_commands_are_what_ci_runs_and_the_tests_train():
    """The README's two commands for a fresh machine: its install is .ci/run's (same torch pin, same extras), its
    test command is .ci/run's, and its training command is the recipe run the slow tier trains once per session
    (``trained_tiny_run``: the same script, config and simulated runtime, with a shorter schedule), so it is not
    run a second time here."""
    from tests import recipe_runs

    readme = REPO / "README.md"
    main, tests = [b.text for b in blocks(readme) if b.mark.startswith("covered-by tests/test_docs.py::")]
    ci = [shlex.split(line) for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("python ")]
    steps = [shlex.split(step) for step in main.split("&&")]
    assert steps[:2] == [["python3", "-m", "venv", ".venv"], [".", ".venv/bin/activate"]]
    assert ["python", "-m", "pip", "install", "--quiet", *steps[2][2:]] in ci  # the torch pin
    editable = [words for words in ci if words[:6] == ["python", "-m", "pip", "install", "--quiet", "-e"]]
    assert steps[3][:3] == ["pip", "install", "-e"] and len(editable) == 1
    extras = lambda spec: set(re.fullmatch(r"\.\[(.*)\]", spec)[1].split(","))  # noqa: E731
    assert extras(steps[3][3]) <= extras(editable[0][6])
    assert steps[4] == ["LIGHTNING_NPU_SIMULATE=2", "python", str(Path(recipe_runs.TRAIN).relative_to(REPO)), "fit",
                        "--config", str(Path(recipe_runs.TINY).relative_to(REPO))]
    assert inspect.signature(recipe_runs.train_tiny).parameters["simulate"].default == 2  # LIGHTNING_NPU_SIMULATE=2
    assert tests == "python -m pytest tests -q" and shlex.split(tests) in ci


def test_readme_links_point_at_files_and_stay_short():
    """The front page links into the docs (mkdocs checks the docs' own links; nothing checks README's but this)
    and stays a front page."""
    text = (REPO / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"
    assert len(text) <= 12_000


class _MkDocsConfigLoader(yaml.SafeLoader):
    """mkdocs.yml as mkdocs reads it, the Python objects it names (``!!python/name:...``) kept as their names."""


_MkDocsConfigLoader.add_multi_constructor("tag:yaml.org,2002:python/name:", lambda loader, suffix, node: suffix)


def test_every_page_is_in_the_site_navigation():
    """mkdocs --strict (in .ci/run) fails on it too; this says so in the quick tier, without mkdocs installed."""
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=_MkDocsConfigLoader)

    def pages(nav):
        for entry in nav:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from pages(value) if isinstance(value, list) else [value]

    listed = set(pages(config["nav"]))
    present = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert listed == present
