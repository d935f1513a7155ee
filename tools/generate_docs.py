"""Write the documentation's generated blocks from the code: ``npu_fsdp``'s options table (docs/strategies.md, from
the one declaration ``lightning_npu.facts.options.FSDPOptions``), the error catalogue (docs/troubleshooting.md,
from every ``raise`` with a message in ``lightning_npu/`` and ``recipes/``, read from the source, nothing imported),
and the parallelism page's pictures (docs/parallelism.md): the mesh's ranks as ``MeshLayout`` places them, and each
pipeline schedule's timeline per rank as ``lightning_npu.facts.pipeline.replay`` runs it.

Each block sits between two HTML comments in its page, ``<!-- generated: NAME ... -->`` and
``<!-- end generated: NAME -->``; the text around them is written by hand.

Usage::

    python tools/generate_docs.py            # rewrites the blocks
    python tools/generate_docs.py --check    # exit status 1 if a block is stale (tests/test_docs.py checks it)
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]


def options_block() -> str:
    from lightning_npu.facts.options import options_table

    return options_table()


# --- the error catalogue -----------------------------------------------------------------------------------------

#: The source trees the catalogue reads, and the title of each room (the folder or module under them).
ROOMS = {
    "lightning_npu/facts": "Options, devices, precisions (checked before anything starts)",
    "lightning_npu/accelerator.py": "The accelerator",
    "lightning_npu/runtime": "The NPU runtime (torch_npu, CANN, the simulated runtime)",
    "lightning_npu/lightning_patches": "Lightning's own code paths",
    "lightning_npu/strategies": "Strategies and checkpoints",
    "lightning_npu/parallel": "Parallelism (tensor, context, expert, pipeline)",
    "lightning_npu/precision": "Precision",
    "lightning_npu/kernels": "Fused kernels and their references",
    "lightning_npu/optim": "AdamW8bit",
    "lightning_npu/quant": "Quantized weights",
    "lightning_npu/guards.py": "NaN / Inf guard",
    "lightning_npu/preemption.py": "Preemption",
    "lightning_npu/plan": "lightning-npu plan",
    "lightning_npu/cli": "lightning-npu (run, consolidate and the other commands)",
    "lightning_npu/doctor": "lightning-npu doctor",
    "lightning_npu/selftest": "lightning-npu selftest",
    "lightning_npu": "Other plugin modules",
    "recipes/decoder": "Recipes: the shared decoder (data, SFT data, LoRA, checkpoints, HF conversion, MoE layers, rotary)",
    "recipes/models/llama": "Recipes: LLaMA family",
    "recipes/models/qwen": "Recipes: Qwen family",
    "recipes/models/deepseek": "Recipes: DeepSeek family",
    "recipes/models/moe": "Recipes: MoE family",
    "recipes": "Recipes: train.py, generate.py, convert.py, families",
}
TREES = ("lightning_npu", "recipes")
#: Where a message turns from what went wrong to what to do: "<cause>; <fix>" (the house style, ``facts.problem``),
#: or a sentence or clause that starts with an instruction.
_FIX_VERBS = (
    "use|run|pass|give|set|call|install|reshape|cast|drop|flatten|leave|make|move|name|choose|pick|turn|load|train|"
    "start|add|remove|source|upgrade|import|lower|raise|shorten|configure|resume|plan|generate|decode|export|"
    "list|concatenate|count|build|split|put|check|apply|keep|wrap|convert|declare|define|return|switch|select|restart"
)
_FIX = re.compile(rf"(?:; |[.:] )(?=(?:{_FIX_VERBS})\b)", re.IGNORECASE)


@dataclass(frozen=True)
class Raised:
    room: str
    error: str
    cause: str
    fix: str
    where: str  # path:function


def _shown(node: ast.AST) -> str:
    """A placeholder for an f-string's value: the name it reads, else an ellipsis."""
    if isinstance(node, ast.Name):
        return "{" + node.id + "}"
    if isinstance(node, ast.Attribute):
        return "{" + node.attr + "}"
    return "{…}"


def _text(node: ast.AST, constants: dict[str, str], bound: Optional[dict[str, ast.AST]] = None) -> Optional[str]:
    """The message a string expression builds, with placeholders for the values; None if it is not a string.

    ``bound`` maps a helper's parameter names to the expressions a ``raise helper(...)`` passes (its messages read the
    caller's words, not the parameter's name).
    """
    bound = bound or {}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in bound:
        return _text(bound[node.id], constants)
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value.value, ast.Name) and value.value.id in bound:
                argument = bound[value.value.id]
                parts.append(_text(argument, constants) or _shown(argument))
            elif isinstance(value.value, ast.Name) and value.value.id in constants:
                parts.append(constants[value.value.id])
            else:
                parts.append(_shown(value.value))
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left, constants, bound), _text(node.right, constants, bound)
        if left is not None or right is not None:
            return (left if left is not None else "{…}") + (right if right is not None else "{…}")
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    return None


def _split(message: str) -> tuple[str, str]:
    """(cause, fix) of a message written "<cause>; <fix>" or "<cause>. <Instruction>"; fix "" when it has none."""
    match = _FIX.search(message)
    if match is None:
        return message, ""
    fix = message[match.end():]
    return message[:match.start()] + ("." if message[match.start()] == "." else ""), fix[:1].upper() + fix[1:]


def _room(path: str) -> str:
    return max((room for room in ROOMS if path == room or path.startswith(room + "/")), key=len)


def _constants(modules: list[ast.Module]) -> dict[str, str]:
    """The module-level string constants of ``modules`` (``SIMULATE_ENV = "..."``) whose name has one value."""
    values: dict[str, set[str]] = {}
    for module in modules:
        for node in module.body:
            value = node.value if isinstance(node, ast.Assign) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        values.setdefault(target.id, set()).add(value.value)
    return {name: next(iter(value)) for name, value in values.items() if len(value) == 1}


def raised(root: Path = REPO) -> list[Raised]:
    """Every raise with a message under ``TREES`` (bare re-raises and computed messages left out)."""
    found = []
    paths = [path for tree_name in TREES for path in sorted((root / tree_name).rglob("*.py"))]
    modules = [ast.parse(path.read_text(), str(path)) for path in paths]
    constants = _constants(modules)
    for path, module in zip(paths, modules):
        rel = path.relative_to(root).as_posix()
        helpers = _error_helpers(module)
        for function, node in _raises(module):
            exc = node.exc
            if not isinstance(exc, ast.Call) or not exc.args:
                continue
            bound: dict[str, ast.AST] = {}
            helper = helpers.get(_called_name(exc.func))
            if helper is not None:  # raise self.fail(...): the error its helper returns, in the caller's words
                bound = _bind(helper, exc)
                exc = helper.body[-1].value
            error = ast.unparse(exc.func)
            argument = exc.args[0]
            if isinstance(argument, ast.Call) and ast.unparse(argument.func) == "Problem":  # SettingError(Problem(...))
                cause = _text(argument.args[0], constants, bound) if argument.args else None
                fix = (_text(argument.args[1], constants, bound) if len(argument.args) > 1 else None) or ""
                if cause is None:
                    continue
                fix = fix[:1].upper() + fix[1:]
            else:
                message = _text(argument, constants)
                if message is None or error in ("SystemExit", "AttributeError"):
                    continue
                cause, fix = _split(message)
            found.append(Raised(_room(rel), error, cause.strip(), fix.strip(), f"{rel}:{function}"))
    return found


def _called_name(func: ast.AST) -> str:
    """``fail`` for ``fail(...)`` and ``self.fail(...)``; "" for any other callee."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        return func.attr
    return ""


def _error_helpers(module: ast.Module) -> dict[str, ast.FunctionDef]:
    """The functions and methods of ``module`` whose last statement returns an error built as ``E(Problem(...))``."""
    helpers = {}
    for node in ast.walk(module):
        if not isinstance(node, ast.FunctionDef) or not node.body:
            continue
        last = node.body[-1]
        value = last.value if isinstance(last, ast.Return) else None
        if (isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.Call)
                and ast.unparse(value.args[0].func) == "Problem"):
            helpers[node.name] = node
    return helpers


def _bind(helper: ast.FunctionDef, call: ast.Call) -> dict[str, ast.AST]:
    """The helper's parameter names mapped to what ``call`` passes them (``self`` left out)."""
    names = [arg.arg for arg in helper.args.args if arg.arg != "self"]
    bound = dict(zip(names, call.args))
    bound.update({keyword.arg: keyword.value for keyword in call.keywords if keyword.arg})
    return bound


def _raises(module: ast.Module):
    """(enclosing function name, raise node) for every raise in ``module``."""
    def walk(node, function):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Raise) and child.exc is not None:
                yield function, child
            yield from walk(child, name)

    yield from walk(module, "<module>")


def _cell(text: str) -> str:
    """Table-cell Markdown of a message: pipes escaped, angle brackets as entities outside code spans."""
    pieces = text.replace("|", "\\|").replace("\n", " ").split("`")
    for i in range(0, len(pieces), 2):
        pieces[i] = pieces[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    return "`".join(pieces) if len(pieces) % 2 else "`".join(pieces).replace("`", "'")


def errors_block(root: Path = REPO) -> str:
    """The catalogue: one section per room (in ``ROOMS`` order), one row per distinct error and message."""
    rows: dict[str, dict[tuple[str, str, str], list[str]]] = {}
    for item in raised(root):
        rows.setdefault(item.room, {}).setdefault((item.error, item.cause, item.fix), []).append(item.where)
    out = []
    for room, title in ROOMS.items():
        if room not in rows:
            continue
        out += [f"### {title}", "", f"Raised in `{room}`.", "",
                "| error | cause | fix | raised in |", "|---|---|---|---|"]
        for (error, cause, fix), places in rows[room].items():
            where = ", ".join(f"`{place.split('/')[-1]}`" for place in dict.fromkeys(places))
            out.append(f"| `{error}` | {_cell(cause)} | {_cell(fix) if fix else '-'} | {where} |")
        out.append("")
    return "\n".join(out)


# --- the parallelism page's pictures ------------------------------------------------------------------------------

#: The layout the mesh picture draws: every dimension of ``MESH_DIM_NAMES`` but the replicas split in two.
MESH_EXAMPLE = dict(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2)


def mesh_block() -> str:
    """The ranks of ``MESH_EXAMPLE`` as ``MeshLayout`` places them: a nested diagram (a box per coordinate of each
    dimension of size > 1, outermost first, the innermost's ranks side by side) and every rank's coordinates."""
    from lightning_npu.facts.options import MESH_DIM_NAMES, MeshLayout

    layout = MeshLayout(**MESH_EXAMPLE)
    drawn = [name for name in MESH_DIM_NAMES if layout.sizes[name] > 1]
    at = [layout.coordinates(rank) for rank in range(layout.world_size)]

    def boxes(ranks: list[int], depth: int, prefix: str) -> list[str]:
        indent = "  " * (depth + 1)
        if depth == len(drawn) - 1:
            return [f'{indent}r{rank}["rank {rank}<br>{drawn[-1]} = {at[rank][drawn[-1]]}"]' for rank in ranks]
        name, out = drawn[depth], []
        for value in range(layout.sizes[name]):
            box = f"{prefix}{name}{value}"
            out += [f'{indent}subgraph {box}["{name} = {value}"]', f"{indent}  direction {'TB' if depth == 0 else 'LR'}"]
            out += boxes([rank for rank in ranks if at[rank][name] == value], depth + 1, box + "_")
            out.append(f"{indent}end")
        return out

    sizes = ", ".join(f"{name}={size}" for name, size in layout.sizes.items())
    table = [f"{'rank':<13}" + "".join(f"{rank:>3}" for rank in range(layout.world_size))]
    table += [f"{name:<13}" + "".join(f"{where[name]:>3}" for where in at) for name in MESH_DIM_NAMES]
    return "\n".join([f"{layout.world_size} ranks, {sizes}:", "", "```mermaid", "flowchart TB",
                      *boxes(list(range(layout.world_size)), 0, ""), "```", "", "```text", *table, "```"])


#: The pipelines the timelines draw: schedule -> (pipeline ranks, microbatches). The fewest microbatches that show
#: each schedule's steady state while a row fits a page (DualPipeV needs 2 pp of them: 2 ranks).
TIMELINES = {"GPipe": (4, 8), "1F1B": (4, 8), "Interleaved1F1B": (4, 4), "ZBVZeroBubble": (4, 4), "DualPipeV": (2, 4)}


def timeline(schedule: str, pp: int, microbatches: int) -> str:
    """Each rank's row of ``facts.pipeline.replay``: one column per forward of a stage, a label per column its
    computation fills (``F``, ``B`` for two columns, ``I`` / ``W``, and the microbatch; lower case on the rank's second
    stage), ``.`` where the rank waits."""
    from lightning_npu.facts.pipeline import replay, stage_ids, stages_per_rank

    per_rank = stages_per_rank(schedule)
    rows = replay(schedule, pp, microbatches, per_rank)
    ticks = round(max(timed.start + timed.duration for row in rows for timed in row))
    lines = []
    for rank, row in enumerate(rows):
        stages, cells = stage_ids(schedule, rank, pp, per_rank), ["."] * ticks
        for start, duration, (stage, kind, microbatch) in row:
            label = f"{kind}{microbatch}"
            for tick in range(round(start), round(start + duration)):
                cells[tick] = label if stage == stages[0] else label.lower()
        lines.append((f"rank {rank} | " + " ".join(f"{cell:<2}" for cell in cells)).rstrip())
    return "\n".join(lines)


def schedules_block() -> str:
    """A timeline per schedule (``TIMELINES``), with the stages each rank runs and the share of the step it waits."""
    from lightning_npu.facts.pipeline import replayed_bubble, stage_ids, stages_per_rank

    out = []
    for schedule, (pp, microbatches) in TIMELINES.items():
        per_rank = stages_per_rank(schedule)
        stages = " / ".join("+".join(map(str, stage_ids(schedule, rank, pp, per_rank))) for rank in range(pp))
        bubble = max(replayed_bubble(schedule, pp, microbatches, per_rank))
        out += [f"**{schedule}**: {pp} ranks, {microbatches} microbatches, stages by rank {stages}; the worst rank"
                f" waits {bubble:.1%} of the step.", "", "```text", timeline(schedule, pp, microbatches), "```", ""]
    return "\n".join(out)


def lightning_strategies_block() -> str:
    """How each option of Lightning's FSDPStrategy / ModelParallelStrategy becomes npu_fsdp's (docs/porting.md)."""
    from lightning_npu.strategies.from_lightning import porting_table

    return porting_table()


# --- the blocks and their pages ----------------------------------------------------------------------------------

#: name -> (page, generator)
BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "options": ("docs/strategies.md", options_block),
    "errors": ("docs/troubleshooting.md", errors_block),
    "lightning-strategies": ("docs/porting.md", lightning_strategies_block),
    "mesh": ("docs/parallelism.md", mesh_block),
    "schedules": ("docs/parallelism.md", schedules_block),
}


def markers(name: str) -> tuple[str, str]:
    return (f"<!-- generated: {name} (python tools/generate_docs.py; do not edit by hand) -->\n",
            f"<!-- end generated: {name} -->\n")


def with_block(text: str, name: str, content: Optional[str] = None) -> str:
    """``text`` (a page) with block ``name`` regenerated between its markers; ValueError if they are missing."""
    begin, end = markers(name)
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"no {begin.strip()} ... {end.strip()} block to write the {name} into")
    body = BLOCKS[name][1]() if content is None else content
    return text[: start + len(begin)] + body.rstrip("\n") + "\n" + text[stop:]


def stale(root: Path = REPO) -> list[str]:
    """The pages whose generated blocks differ from what the code gives now."""
    out = []
    for name, (page, _) in BLOCKS.items():
        text = (root / page).read_text()
        if with_block(text, name) != text:
            out.append(f"{page} ({name})")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether a block is stale")
    args = parser.parse_args(argv)
    if args.check:
        pages = stale()
        for page in pages:
            print(f"{page} is stale; run python tools/generate_docs.py", file=sys.stderr)
        return 1 if pages else 0
    for name, (page, _) in BLOCKS.items():
        path = REPO / page
        path.write_text(with_block(path.read_text(), name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
