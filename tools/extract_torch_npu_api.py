"""Record the public torch_npu API that lightning-npu relies on, read from a torch-npu wheel without importing it.

torch_npu cannot be imported (or even installed) on a machine without the CANN toolkit, so the contract
tests check every call against a JSON record of the real package instead. This script writes that record
by parsing the wheel's Python sources with ``ast`` and its op schemas as text:

- ``torch_npu.__version__``;
- every name in ``torch_npu/npu/__init__.py``'s ``__all__``, resolved through the imports that bind it
  (``from .memory import *`` and so on) to the function, class or object that defines it, with the exact
  parameter list of functions and class constructors;
- the names of ``torch_npu.npu.amp``;
- the fused ops lightning-npu calls, from ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``, each with
  the autograd node ``torch_npu/lib/libtorch_npu.so`` registers for it (``NpuRmsNormBackward0``), or None: an op
  without one returns outputs that carry no gradient (npu_grouped_matmul in every release; the MoE token
  permute / unpermute before 2.13);
- every name in ``torch_npu/profiler/__init__.py``'s ``__all__``, classes with their public methods, and the
  members of the C enum ``ProfilerActivity`` as the wheel's Python code uses them (``ProfilerActivity.NPU``);
- torch_npu's own FSDP loss scaler (``_ShardedGradScaler``, its constructor) and the torch name it is assigned to
  on import (``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``), found in the wheel's sources.

Usage::

    pip download --no-deps torch-npu==2.14.0 -d /tmp/npuwheel
    python tools/extract_torch_npu_api.py /tmp/npuwheel/torch_npu-2.14.0-*.whl   # or an unzipped wheel folder

The record goes to ``tests/npu_fake/torch_npu_<version>_api.json`` (``--out`` to change it); the contract tests
run against every release recorded there. Recorded: 2.6.0 (the oldest pip can download for CPython 3.11:
``--platform manylinux2014_x86_64``), 2.13.0 and 2.14.0.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any, Optional

FUSED_OPS = (
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_grouped_matmul",
    "npu_moe_token_permute",
    "npu_moe_token_unpermute",
    "npu_weight_quant_batchmatmul",
)
SHARDED_SCALER_MODULE = "torch_npu.npu.amp.sharded_grad_scaler"
SHARDED_SCALER = "_ShardedGradScaler"
#: The assignment by which torch_npu swaps its scaler into FSDP (torch_npu/__init__.py in 2.6,
#: torch_npu/_init/patches/distributed_patches.py in 2.13 / 2.14).
SHARDED_SCALER_PATCH = re.compile(r"^\s*(?:torch\.distributed\.fsdp\.)?sharded_grad_scaler\.ShardedGradScaler = _ShardedGradScaler\s*$", re.M)
SCHEMA_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
OP_DOCS = "torch_npu/_op_plugin_docs.py"
CUSTOM_OPS = "torch_npu/utils/custom_ops.py"
#: The library holding torch_npu's autograd functions (their node names, ``Npu<Op>Backward0``, are in its strings).
AUTOGRAD_LIB = "torch_npu/lib/libtorch_npu.so"
PROFILER = "torch_npu.profiler"
FAKE_DIR = Path(__file__).resolve().parent.parent / "tests" / "npu_fake"


def default_out(version: str) -> Path:
    """Where the fake looks for a release's record: tests/npu_fake/torch_npu_<2_13_0>_api.json."""
    return FAKE_DIR / f"torch_npu_{version.replace('.', '_')}_api.json"


class WheelSource:
    """Text of the files in a wheel, read from the .whl archive or from an unzipped folder."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        if self._zip is None and not (path / "torch_npu").is_dir():
            raise SystemExit(f"{path} holds no torch_npu/ folder; pass a torch_npu-*.whl or the folder it unzips to.")

    def exists(self, rel: str) -> bool:
        if self._zip is not None:
            try:
                self._zip.getinfo(rel)
                return True
            except KeyError:
                return False
        return (self.path / rel).is_file()

    def names(self) -> list[str]:
        """Every file's path in the wheel, relative to its root, sorted."""
        if self._zip is not None:
            return sorted(self._zip.namelist())
        return sorted(str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file())

    def read(self, rel: str) -> str:
        return self.read_bytes(rel).decode("utf-8")

    def read_bytes(self, rel: str) -> bytes:
        if self._zip is not None:
            return self._zip.read(rel)
        return (self.path / rel).read_bytes()


class ModuleResolver:
    """Finds what a module-level name is bound to, following ``from x import ...`` like Python would."""

    def __init__(self, source: WheelSource) -> None:
        self.source = source
        self._trees: dict[str, Optional[ast.Module]] = {}

    def module_file(self, module: str) -> Optional[str]:
        base = module.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if self.source.exists(rel):
                return rel
        return None

    def tree(self, module: str) -> Optional[ast.Module]:
        if module not in self._trees:
            rel = self.module_file(module)
            self._trees[module] = ast.parse(self.source.read(rel), filename=rel) if rel else None
        return self._trees[module]

    def all_names(self, module: str) -> Optional[list[str]]:
        tree = self.tree(module)
        if tree is None:
            return None
        for node in _top_level(tree):
            if isinstance(node, ast.Assign) and any(_is_name(t, "__all__") for t in node.targets):
                return list(ast.literal_eval(node.value))
        return None

    def resolve(self, module: str, name: str, depth: int = 0) -> dict[str, Any]:
        """Describe what ``module.name`` is. The last top-level binding wins, as at import time."""
        tree = self.tree(module)
        if tree is None or depth > 20:
            return {"kind": "unresolved", "module": module, "note": "module source not in the wheel"}
        found: Optional[dict[str, Any]] = None
        for node in _top_level(tree):
            hit = self._binding(module, node, name, depth)
            if hit is not None:
                found = hit
        if found is None:
            found = {
                "kind": "unresolved",
                "module": module,
                "note": "no Python binding; provided by the C extension (torch_npu._C) at import time",
            }
        return found

    def _binding(self, module: str, node: ast.stmt, name: str, depth: int) -> Optional[dict[str, Any]]:
        rel = self.module_file(module)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return {"kind": "function", "defined_in": rel, "params": _params(node.args, drop_first=False)}
        if isinstance(node, ast.ClassDef) and node.name == name:
            return self._class(module, node)
        if isinstance(node, ast.Assign) and any(_is_name(t, name) for t in node.targets):
            return self._object(module, node.value)
        if isinstance(node, ast.ImportFrom):
            target = _absolute(module, node, is_package=rel is not None and rel.endswith("__init__.py"))
            for alias in node.names:
                if alias.name == "*":
                    exported = self.all_names(target)
                    if exported is not None and name in exported:
                        return self.resolve(target, name, depth + 1)
                elif (alias.asname or alias.name) == name:
                    if self.module_file(f"{target}.{alias.name}") and self._is_submodule_import(target, alias.name):
                        return {"kind": "module", "module": f"{target}.{alias.name}"}
                    return self.resolve(target, alias.name, depth + 1)
        return None

    def _is_submodule_import(self, package: str, name: str) -> bool:
        # `from .mstx import mstx` binds the attribute, not the module, when the module defines that name.
        tree = self.tree(package)
        if tree is None:
            return True
        return not any(self._binding(package, n, name, 99) for n in _top_level(tree) if not isinstance(n, ast.ImportFrom))

    def _class(self, module: str, node: ast.ClassDef) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "kind": "class",
            "defined_in": self.module_file(module),
            "bases": [ast.unparse(b) for b in node.bases],
            "init_params": None,
        }
        # Stream and Event are built in __new__ (their bases are C types); __init__ wins when both exist.
        for method in ("__new__", "__init__"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    entry["init_params"] = _params(item.args, drop_first=True)
        settable, gettable = _attribute_names(node)
        if settable or gettable:
            entry["settable_attributes"] = settable
            entry["gettable_attributes"] = gettable
        return entry

    def _object(self, module: str, value: ast.expr) -> dict[str, Any]:
        entry: dict[str, Any] = {"kind": "object", "defined_in": self.module_file(module), "expr": ast.unparse(value)}
        # `config = npu_config._npuConfig()`: describe the instance by the attributes its class lets you touch.
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and isinstance(value.func.value, ast.Name):
            cls_module = self._imported_module(module, value.func.value.id)
            if cls_module is not None:
                cls = self.resolve(cls_module, value.func.attr)
                if cls.get("kind") == "class":
                    entry["class"] = f"{cls_module}.{value.func.attr}"
                    entry["settable_attributes"] = cls.get("settable_attributes", [])
                    entry["gettable_attributes"] = cls.get("gettable_attributes", [])
        elif isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
            cls_module = self._imported_module(module, value.value.id)
            if cls_module is not None:
                entry["alias_of"] = f"{cls_module}.{value.attr}"
                entry["target"] = self.resolve(cls_module, value.attr)
        return entry

    def _imported_module(self, module: str, local: str) -> Optional[str]:
        """The module a local name refers to when it was bound by ``from . import x`` / ``from .x import *``."""
        tree = self.tree(module)
        rel = self.module_file(module) or ""
        for node in _top_level(tree):
            if isinstance(node, ast.ImportFrom):
                target = _absolute(module, node, is_package=rel.endswith("__init__.py"))
                if any(alias.name == "*" for alias in node.names) and target.rsplit(".", 1)[-1] == local:
                    return target  # `from .npu_config import *` also binds the submodule npu_config on the package
                for alias in node.names:
                    if (alias.asname or alias.name) == local and self.module_file(f"{target}.{alias.name}"):
                        return f"{target}.{alias.name}"
        if self.module_file(f"{module}.{local}") and rel.endswith("__init__.py"):
            return f"{module}.{local}"
        return None


def _top_level(tree: Optional[ast.Module]):
    """Module-level statements, including those inside top-level ``if``/``try`` blocks."""
    if tree is None:
        return
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If):
            stack.extend(reversed(node.body + node.orelse))
        elif isinstance(node, ast.Try):
            stack.extend(reversed(node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody))
        else:
            yield node


def _is_name(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _absolute(module: str, node: ast.ImportFrom, *, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    # For a package's __init__, level 1 is the package itself; for a plain module it is its parent.
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


def _params(args: ast.arguments, *, drop_first: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    positional = [(a, "POSITIONAL_ONLY") for a in args.posonlyargs] + [(a, "POSITIONAL_OR_KEYWORD") for a in args.args]
    first_default = len(positional) - len(args.defaults)
    for i, (arg, kind) in enumerate(positional):
        default = args.defaults[i - first_default] if i >= first_default else None
        out.append(_param(arg, kind, default, has_default=i >= first_default))
    if args.vararg is not None:
        out.append(_param(args.vararg, "VAR_POSITIONAL", None, has_default=False))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append(_param(arg, "KEYWORD_ONLY", default, has_default=default is not None))
    if args.kwarg is not None:
        out.append(_param(args.kwarg, "VAR_KEYWORD", None, has_default=False))
    if drop_first and out and out[0]["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
        out = out[1:]
    return out


def _param(arg: ast.arg, kind: str, default: Optional[ast.expr], *, has_default: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": arg.arg, "kind": kind}
    if arg.annotation is not None:
        entry["annotation"] = ast.unparse(arg.annotation)
    if has_default and default is not None:
        try:
            entry["default"] = ast.literal_eval(default)
        except ValueError:
            # Not a literal (e.g. torch.float16): keep the source so the fake can show it.
            entry["default_expr"] = ast.unparse(default)
    return entry


def _attribute_names(cls: ast.ClassDef) -> tuple[list[str], list[str]]:
    """Names a class's ``__setattr__`` / ``__getattr__`` compare against (``if name == "allow_hf32"``)."""
    found: dict[str, list[str]] = {"__setattr__": [], "__getattr__": []}
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name in found and len(item.args.args) >= 2:
            attr_param = item.args.args[1].arg  # (cls, name, ...) / (self, name, ...)
            for node in ast.walk(item):
                if (
                    isinstance(node, ast.Compare)
                    and _is_name(node.left, attr_param)
                    and len(node.comparators) == 1
                    and isinstance(node.comparators[0], ast.Constant)
                    and isinstance(node.comparators[0].value, str)
                ):
                    found[item.name].append(node.comparators[0].value)
    return sorted(set(found["__setattr__"])), sorted(set(found["__getattr__"]))


# ---------------------------------------------------------------- op schemas

_SCHEMA_RE = re.compile(r"^(?P<name>[A-Za-z0-9_]+)\((?P<args>.*)\)\s*->\s*(?P<returns>.+)$")


def op_schema(yaml_text: str, op: str) -> str:
    """The ``func:`` schema of the exact overload-free op (``npu_rms_norm``, not ``npu_rms_norm_backward``)."""
    matches = [
        line.split("func:", 1)[1].strip()
        for line in yaml_text.splitlines()
        if "func:" in line and line.split("func:", 1)[1].strip().startswith(f"{op}(")
    ]
    if len(matches) != 1:
        raise SystemExit(f"expected exactly one schema for {op} in {SCHEMA_YAML}, found {len(matches)}")
    return matches[0]


def parse_schema(schema: str) -> dict[str, Any]:
    m = _SCHEMA_RE.match(schema)
    if m is None:
        raise SystemExit(f"cannot parse op schema: {schema}")
    params: list[dict[str, Any]] = []
    keyword_only = False
    for raw in _split_top_level(m.group("args")):
        raw = raw.strip()
        if raw == "*":
            keyword_only = True
            continue
        decl, _, default = raw.partition("=")
        type_, name = decl.rsplit(None, 1)
        # The registration renames `self` to `input` (torchnpugen/custom_functions.py), and
        # torch_npu.<op> is torch.ops.npu.<op>, so `input` is the keyword callers see.
        entry: dict[str, Any] = {
            "name": "input" if name == "self" else name,
            "kind": "KEYWORD_ONLY" if keyword_only else "POSITIONAL_OR_KEYWORD",
            "type": type_,
        }
        default = default.strip()
        if re.fullmatch(r"[A-Za-z_]\w*", default) and default not in ("None", "True", "False"):
            # An enum member (`int reduction=Mean`, `MemoryFormat? memory_format=contiguous_format`): no literal.
            entry["default_expr"] = default
        elif default:
            entry["default"] = _schema_default(default)
        params.append(entry)
    return {"name": m.group("name"), "params": params, "returns": m.group("returns").strip()}


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


def _schema_default(text: str) -> Any:
    """A schema default as a Python value: None, bools, strings, ints, floats (``1.``, ``-inf``) and lists of
    them (``int[2] active_expert_range=[]``, ``int[] dims=[0, 1]``)."""
    text = text.strip()
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text[0] in "\"'":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        return [_schema_default(item) for item in _split_top_level(text[1:-1])]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        raise SystemExit(f"cannot parse the op schema default {text!r}; teach _schema_default its syntax") from None


def autograd_node(library: bytes, op: str) -> Optional[str]:
    """The autograd node torch_npu registers for ``op`` (``npu_rms_norm`` -> ``NpuRmsNormBackward0``), found as a
    whole string in its library; None when it has none, so that a call returns outputs without a grad_fn."""
    name = "".join(part.capitalize() for part in op.split("_")) + "Backward0"
    found = re.search(rb"(?<![A-Za-z0-9_])" + name.encode() + rb"(?![A-Za-z0-9_])", library)
    return name if found else None


def doc_signature(docs_text: str, op: str) -> Optional[str]:
    """The signature line ``torch_npu.<op>(...) -> ...`` from _op_plugin_docs.py, for comparison (some, such as
    npu_grouped_matmul's, are written without the ``torch_npu.`` prefix)."""
    m = re.search(rf"^(?:torch_npu\.)?{op}\((.*)\)\s*->\s*(.+)$", docs_text, flags=re.M)
    return m.group(0).strip() if m else None


# ---------------------------------------------------------------- torch_npu.profiler


def public_methods(resolver: ModuleResolver, module: str, class_name: str, depth: int = 0) -> list[str]:
    """Public methods a class defines or inherits from classes of the same module (``profile`` <- ``_KinetoProfile``)."""
    tree = resolver.tree(module)
    node = next((n for n in _top_level(tree) if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if node is None or depth > 5:
        return []
    names = {item.name for item in node.body if isinstance(item, ast.FunctionDef) and not item.name.startswith("_")}
    for base in node.bases:
        if isinstance(base, ast.Name):
            names.update(public_methods(resolver, module, base.id, depth + 1))
    return sorted(names)


def enum_members_defined(resolver: ModuleResolver, module: str, class_name: str) -> list[str]:
    """Members of a Python ``Enum`` class, in definition order (``NONE = 0`` ...)."""
    node = next(n for n in _top_level(resolver.tree(module)) if isinstance(n, ast.ClassDef) and n.name == class_name)
    return [t.id for item in node.body if isinstance(item, ast.Assign) for t in item.targets if isinstance(t, ast.Name)]


def enum_members_used(source: WheelSource, enum: str) -> list[str]:
    """Members of a C-defined enum, as the package's own Python code spells them (``enum.MEMBER`` in code, not strings)."""
    members: set[str] = set()
    names = source._zip.namelist() if source._zip is not None else [
        str(p.relative_to(source.path)) for p in (source.path / "torch_npu").rglob("*.py")]
    for rel in names:
        if not (rel.startswith("torch_npu/") and rel.endswith(".py")):
            continue
        try:
            tree = ast.parse(source.read(rel))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.isupper():
                owner = node.value
                owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
                if owner_name == enum:
                    members.add(node.attr)
    return sorted(members)


def profiler_api(resolver: ModuleResolver, source: WheelSource) -> dict[str, Any]:
    names = resolver.all_names(PROFILER)
    if names is None:
        raise SystemExit("torch_npu/profiler/__init__.py has no __all__")
    out = {}
    for name in names:
        entry = resolver.resolve(PROFILER, name)
        if entry["kind"] == "class":
            module = entry["defined_in"].removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            target = _imported_name(resolver, PROFILER, name)
            entry["methods"] = public_methods(resolver, module, target)
            if entry["bases"] == ["Enum"]:
                entry["members"] = enum_members_defined(resolver, module, target)
        if name == "ProfilerActivity":
            entry["members"] = enum_members_used(source, name)
        out[name] = entry
    return out


def _imported_name(resolver: ModuleResolver, module: str, name: str) -> str:
    """The original name behind ``from .scheduler import Schedule as schedule`` (or ``name`` itself)."""
    for node in _top_level(resolver.tree(module)):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return alias.name
    return name


# ---------------------------------------------------------------- main


def extract(source: WheelSource) -> dict[str, Any]:
    resolver = ModuleResolver(source)
    version_tree = ast.parse(source.read("torch_npu/version.py"))
    version = next(
        ast.literal_eval(n.value)
        for n in version_tree.body
        if isinstance(n, ast.Assign) and any(_is_name(t, "__version__") for t in n.targets)
    )
    npu_all = resolver.all_names("torch_npu.npu")
    if npu_all is None:
        raise SystemExit("torch_npu/npu/__init__.py has no __all__")
    npu = {name: resolver.resolve("torch_npu.npu", name) for name in npu_all}
    amp_all = resolver.all_names("torch_npu.npu.amp") or []
    amp = {name: resolver.resolve("torch_npu.npu.amp", name) for name in amp_all}

    yaml_text = source.read(SCHEMA_YAML)
    docs_text = source.read(OP_DOCS)
    custom_ops = source.read(CUSTOM_OPS)
    if not source.exists(AUTOGRAD_LIB):
        raise SystemExit(f"{source.path} has no {AUTOGRAD_LIB}; unzip the whole wheel (or pass the .whl itself)")
    library = source.read_bytes(AUTOGRAD_LIB)
    ops = {}
    for op in FUSED_OPS:
        schema = op_schema(yaml_text, op)
        entry = parse_schema(schema)
        entry["schema"] = schema
        entry["doc_signature"] = doc_signature(docs_text, op)
        bound = re.search(rf"^torch_npu\.{op} = (.+)$", custom_ops, flags=re.M)
        entry["bound_to"] = bound.group(1).strip() if bound else None
        entry["autograd_node"] = autograd_node(library, op)
        ops[op] = entry

    scaler = resolver.resolve(SHARDED_SCALER_MODULE, SHARDED_SCALER)
    patched_in = [name for name in source.names() if name.endswith(".py") and SHARDED_SCALER_PATCH.search(source.read(name))]
    scaler["replaces"] = "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler" if patched_in else None
    scaler["replaced_in"] = patched_in

    return {
        "torch_npu_version": version,
        "generated_by": "tools/extract_torch_npu_api.py",
        "source": source.path.name,
        "npu": npu,
        "npu_amp": amp,
        "ops": ops,
        "profiler": profiler_api(resolver, source),
        "sharded_grad_scaler": scaler,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path, help="torch_npu-*.whl, or the folder it unzips to")
    parser.add_argument("--out", type=Path, help=f"JSON to write (default {FAKE_DIR}/torch_npu_<version>_api.json)")
    args = parser.parse_args(argv)
    api = extract(WheelSource(args.wheel))
    out = args.out or default_out(api["torch_npu_version"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(api, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    unresolved = sorted(n for n, e in api["npu"].items() if e["kind"] == "unresolved")
    print(
        f"torch_npu {api['torch_npu_version']}: {len(api['npu'])} torch.npu names "
        f"({len(unresolved)} defined in C: {', '.join(unresolved)}), {len(api['npu_amp'])} amp names, "
        f"{len(api['ops'])} ops, {len(api['profiler'])} torch_npu.profiler names -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
