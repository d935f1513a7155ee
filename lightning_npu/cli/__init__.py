"""The ``lightning-npu`` command: a small dispatcher of subcommands.

Each subcommand is a module imported only when it is chosen, so one broken subcommand cannot break another,
and ``lightning-npu doctor`` starts even where ``import torch`` fails. A subcommand module defines
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status); register it in ``COMMANDS`` with a one-line
summary. Nothing in this package imports torch at module level.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple, Optional, Sequence

PROG = "lightning-npu"


class Command(NamedTuple):
    module: str
    summary: str


COMMANDS: dict[str, Command] = {
    "consolidate": Command(
        "lightning_npu.cli.consolidate",
        "write a sharded npu_fsdp checkpoint directory as one Lightning checkpoint file",
    ),
    "doctor": Command(
        "lightning_npu.cli.doctor",
        "check that this machine can train on Ascend NPUs; names each problem's cause and fix",
    ),
    "plan": Command(
        "lightning_npu.cli.plan",
        "per-device memory of a model (a recipe config or decoder shapes) under npu_fsdp (ZeRO-2/3): fit and largest micro-batch",
    ),
    "selftest": Command(
        "lightning_npu.cli.selftest",
        "check fused kernels, collectives and a short sharded training on this machine's NPUs, with a report",
    ),
    "run": Command(
        "lightning_npu.cli.run",
        "launch a Lightning Fabric script on N NPUs per node (fabric run with accelerator npu, through torchrun)",
    ),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``lightning-npu <command> [options]``; returns the exit status (2 for a usage error)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"{PROG}: unknown command {name!r}; choose one of: {', '.join(sorted(COMMANDS))}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    command = COMMANDS[name]
    module = importlib.import_module(command.module)
    parser = argparse.ArgumentParser(prog=f"{PROG} {name}", description=module.__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    module.add_arguments(parser)
    try:
        options = parser.parse_args(rest)
    except SystemExit as exit_:  # --help, or a usage error that argparse has already explained
        return exit_.code if isinstance(exit_.code, int) else 2
    return int(module.run(options))


def usage() -> str:
    """The top-level help: every command with its summary."""
    width = max(len(name) for name in COMMANDS)
    lines = [f"usage: {PROG} <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {COMMANDS[name].summary}" for name in sorted(COMMANDS)]
    lines += ["", f"Run `{PROG} <command> --help` for a command's options."]
    return "\n".join(lines)
