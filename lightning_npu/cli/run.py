"""Launch a Lightning Fabric script on NPUs: ``fabric run`` with ``--accelerator npu``, which Lightning's launcher refuses.

    lightning-npu run --devices 8 --strategy npu_fsdp --precision bf16-mixed train.py --lr 3e-4
    lightning-npu run --devices 8 --num-nodes 2 --node-rank $NODE_RANK --main-address $MASTER_ADDR train.py

Like ``fabric run``, it sets the variables a no-argument ``Fabric()`` reads (``LT_CLI_USED``, ``LT_ACCELERATOR=npu``,
``LT_DEVICES``, ``LT_NUM_NODES``, ``LT_STRATEGY``, ``LT_PRECISION``) and starts one process per device on this node
through torch's ``torchrun`` (``torch.distributed.run``). Each process imports ``lightning_npu`` before running the
script, so a script written for ``fabric run`` works unchanged. Every option is checked before anything starts:
the script, node and port numbers, the devices against the NPUs visible here, the strategy, and the precision on
this chip. Arguments after the script go to the script.

Exit status: the script's (0 when every process succeeded, 1 when one failed), 2 for an option error.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from lightning_npu.facts import env as names

#: Lightning's ``fabric run`` default, so both launchers meet on the same port.
DEFAULT_PORT = 29400
STRATEGY_AUTO = "auto"


class LaunchError(ValueError):
    """An option that cannot launch; the message names the value, why, and the fix."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", default="1",
                        help="NPUs per node: a count ('8'), ids ('0,1'), or 'auto' for all visible (default 1)")
    parser.add_argument("--num-nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index, 0 .. num-nodes - 1 (default 0)")
    parser.add_argument("--main-address", default="127.0.0.1",
                        help="host name or IP of the node with rank 0 (default 127.0.0.1)")
    parser.add_argument("--main-port", type=int, default=DEFAULT_PORT,
                        help=f"port on the main node for the rendezvous (default {DEFAULT_PORT})")
    parser.add_argument("--strategy", default=None,
                        help="npu_single, npu_ddp or npu_fsdp (default: what Fabric picks, npu_ddp for several)")
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed, 16-mixed, 32-true (default: Fabric's)")
    parser.add_argument("script", help="the Python script to run in every process")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def run(args: argparse.Namespace) -> int:
    try:
        processes = validate(args)
    except LaunchError as error:
        print(f"lightning-npu run: error: {error}", file=sys.stderr)
        return 2
    os.environ.update(fabric_environment(args))
    # torchrun would set 1 (with a warning); share the host's cores among the processes instead, as fabric run does.
    os.environ.setdefault(names.OMP_NUM_THREADS, str(max(1, (os.cpu_count() or 1) // processes)))
    return _torchrun(args, processes)


def validate(args: argparse.Namespace) -> int:
    """Check every option before any process starts; the number of processes to start on this node."""
    script = Path(args.script)
    if not script.is_file():
        raise LaunchError(f"script {args.script!r} {'is a directory' if script.is_dir() else 'does not exist'};"
                          " give the path of the Python file to run")
    if args.num_nodes < 1:
        raise LaunchError(f"--num-nodes {args.num_nodes} must be at least 1")
    if not 0 <= args.node_rank < args.num_nodes:
        raise LaunchError(f"--node-rank {args.node_rank} must lie in 0 .. {args.num_nodes - 1} (--num-nodes"
                          f" {args.num_nodes}); give each node its own rank, 0 on the main node")
    if not 1 <= args.main_port <= 65535:
        raise LaunchError(f"--main-port {args.main_port} is not a TCP port; use one in 1 .. 65535, e.g. {DEFAULT_PORT}")
    if not args.main_address.strip():
        raise LaunchError("--main-address is empty; give the host name or IP of the node with rank 0")

    # The rest needs the plugin and torch: imported here, as the cli package imports no torch at module level.
    import lightning_npu  # noqa: F401 -- registers "npu" and the NPU strategies
    from lightning_npu.accelerator import parse_device_ids
    from lightning_npu.precision import check_precision
    from lightning_npu.runtime import NPUUnavailableError, get_runtime
    from lightning_npu.strategies import STRATEGIES

    try:
        runtime = get_runtime()
        processes = len(parse_device_ids(args.devices, runtime.device_count()))
        if args.precision is not None:
            chip = runtime.chip()
            check_precision(args.precision, chip.name, chip.supports_bf16)
    except (NPUUnavailableError, ValueError, TypeError) as error:
        raise LaunchError(str(error)) from None
    if args.strategy is not None and args.strategy != STRATEGY_AUTO and args.strategy not in STRATEGIES:
        raise LaunchError(f"--strategy {args.strategy!r} cannot run on NPUs; use one of"
                          f" {', '.join(sorted(STRATEGIES))} (or leave it out)")
    if args.strategy == "npu_single" and processes * args.num_nodes > 1:
        raise LaunchError(f"--strategy npu_single runs one process, but --devices {args.devices} --num-nodes"
                          f" {args.num_nodes} asks for {processes * args.num_nodes}; use npu_ddp or npu_fsdp")
    return processes


def fabric_environment(args: argparse.Namespace) -> dict[str, str]:
    """The variables Lightning's ``Fabric()`` reads in place of its arguments (lightning/fabric/connector.py)."""
    env = {
        names.LT_CLI_USED: "1",
        names.LT_ACCELERATOR: "npu",
        names.LT_DEVICES: str(args.devices).strip(),
        names.LT_NUM_NODES: str(args.num_nodes),
    }
    if args.strategy is not None:
        env[names.LT_STRATEGY] = args.strategy
    if args.precision is not None:
        env[names.LT_PRECISION] = args.precision
    return env


def _torchrun(args: argparse.Namespace, processes: int) -> int:
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    torchrun_args = [
        f"--nproc-per-node={processes}",
        f"--nnodes={args.num_nodes}",
        f"--node-rank={args.node_rank}",
        f"--master-addr={args.main_address}",
        f"--master-port={args.main_port}",
        # Each process runs this module's __main__ below, which imports the plugin, then the script.
        "--module", __name__,
        args.script,
        *args.script_args,
    ]
    try:
        torchrun.main(torchrun_args)
    except ChildFailedError as error:  # its message is torchrun's table of the failed ranks and exit codes
        print(f"lightning-npu run: {args.script} failed:{error}", file=sys.stderr)
        return 1
    return 0


def _run_script(argv: list[str]) -> Any:
    """In each launched process: import the plugin, then run the script as ``python script.py args`` would."""
    import lightning_npu  # noqa: F401 -- "npu" must be registered before the script's Fabric() is built

    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` has it
    return runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    _run_script(sys.argv[1:])
