"""Launch a Lightning Fabric script on NPUs: ``fabric run`` with ``--accelerator npu``, which Lightning's launcher refuses.

    lightning-npu run --devices 8 --strategy npu_fsdp --precision bf16-mixed train.py --lr 3e-4
    lightning-npu run --devices 8 --num-nodes 2 --node-rank $NODE_RANK --main-address $MASTER_ADDR train.py

Like ``fabric run``, it sets the variables a no-argument ``Fabric()`` reads (``LT_CLI_USED``, ``LT_ACCELERATOR=npu``,
``LT_DEVICES``, ``LT_NUM_NODES``, ``LT_STRATEGY``, ``LT_PRECISION``) and starts one process per device on this node
through torch's ``torchrun`` (``torch.distributed.run``). Each process imports ``lightning_npu`` before running the
script, so a script written for ``fabric run`` works unchanged. Every option is checked before anything starts:
the script, node and port numbers, the devices against the NPUs visible here, the strategy, and the precision on
this chip. Arguments after the script go to the script.

In an Ascend Operator pod (MindCluster's AscendJob on Volcano: ``MINDX_TASK_ID`` set), the pod's variables give
the launch -- ``LOCAL_WORLD_SIZE`` processes, ``--nnodes WORLD_SIZE / LOCAL_WORLD_SIZE``, ``--node-rank RANK``, the
master ``MASTER_ADDR:MASTER_PORT`` -- so a pod's command is ``lightning-npu run train.py`` (``--cluster
ascend-operator`` requires a pod, ``--cluster none`` ignores one). The pod-level ``RANK`` and list-shaped
``LOCAL_RANK`` (``{0,1,2,3}``, on which ``import lightning`` fails) are removed from this process's environment, as
the line it prints says; torchrun gives every process its own. A Trainer script (a LightningCLI recipe) runs the same
way, its ``devices`` / ``num_nodes`` checked against the pods. With ``RANK_TABLE_FILE`` set, the rank table is checked
against the launch first.

Exit status: the script's (0 when every process succeeded, 1 when one failed), 2 for an option error.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from lightning_npu.cluster import pod as ascend_pod
from lightning_npu.cluster import rank_table
from lightning_npu.facts import env as names
from lightning_npu.facts.problem import SettingError

#: Lightning's ``fabric run`` default, so both launchers meet on the same port.
DEFAULT_PORT = 29400
STRATEGY_AUTO = "auto"
#: --cluster: read the Ascend Operator's pod variables when they are there, always, or never.
CLUSTER_AUTO, CLUSTER_ASCEND_OPERATOR, CLUSTER_NONE = "auto", "ascend-operator", "none"
#: The launch options a pod's variables give, and what each is outside a pod.
LAUNCH_DEFAULTS = {"devices": "1", "num_nodes": 1, "node_rank": 0, "main_address": "127.0.0.1",
                   "main_port": DEFAULT_PORT}


class LaunchError(ValueError):
    """An option that cannot launch; the message names the value, why, and the fix."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", default=None,
                        help="NPUs per node: a count ('8'), ids ('0,1'), or 'auto' for all visible (default 1;"
                             " in an Ascend Operator pod, LOCAL_WORLD_SIZE)")
    parser.add_argument("--num-nodes", type=int, default=None,
                        help="number of nodes (default 1; in a pod, WORLD_SIZE / LOCAL_WORLD_SIZE)")
    parser.add_argument("--node-rank", type=int, default=None,
                        help="this node's index, 0 .. num-nodes - 1 (default 0; in a pod, RANK)")
    parser.add_argument("--main-address", default=None,
                        help="host name or IP of the node with rank 0 (default 127.0.0.1; in a pod, MASTER_ADDR)")
    parser.add_argument("--main-port", type=int, default=None,
                        help=f"port on the main node for the rendezvous (default {DEFAULT_PORT}; in a pod,"
                             f" MASTER_PORT or {ascend_pod.DEFAULT_PORT})")
    parser.add_argument("--cluster", choices=(CLUSTER_AUTO, CLUSTER_ASCEND_OPERATOR, CLUSTER_NONE),
                        default=CLUSTER_AUTO,
                        help="auto (default): take the launch from the Ascend Operator's pod variables when"
                             " MINDX_TASK_ID is set; ascend-operator: require them; none: ignore them")
    parser.add_argument("--strategy", default=None,
                        help="npu_single, npu_ddp or npu_fsdp (default: what Fabric picks, npu_ddp for several)")
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed, 16-mixed, 32-true (default: Fabric's)")
    parser.add_argument("script", help="the Python script to run in every process")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def run(args: argparse.Namespace) -> int:
    try:
        from_cluster(args, os.environ)
        processes = validate(args)
    except LaunchError as error:
        print(f"lightning-npu run: error: {error}", file=sys.stderr)
        return 2
    os.environ.update(fabric_environment(args))
    # torchrun would set 1 (with a warning); share the host's cores among the processes instead, as fabric run does.
    os.environ.setdefault(names.OMP_NUM_THREADS, str(max(1, (os.cpu_count() or 1) // processes)))
    return _torchrun(args, processes)


def from_cluster(args: argparse.Namespace, env: dict) -> None:
    """Fill the launch options a cluster's variables give (an Ascend Operator pod's), the rest with their defaults.

    In a pod, its ``RANK`` / ``LOCAL_RANK`` leave ``env`` (this process's environment) with a line saying so: they
    describe the pod, and ``import lightning`` fails on the list; torchrun sets each process's own."""
    in_pod = args.cluster == CLUSTER_ASCEND_OPERATOR or (args.cluster == CLUSTER_AUTO and ascend_pod.is_pod(env))
    if in_pod:
        if names.MINDX_TASK_ID not in env:
            raise LaunchError(f"--cluster {CLUSTER_ASCEND_OPERATOR}: {names.MINDX_TASK_ID} is not set, so this is not"
                              " an Ascend Operator pod; leave --cluster out outside one")
        try:
            pod = ascend_pod.AscendPod.from_env(env)
        except SettingError as error:
            raise LaunchError(str(error)) from None
        given = {"devices": pod.npus, "num_nodes": pod.nodes, "node_rank": pod.node_rank,
                 "main_address": pod.main_address, "main_port": pod.main_port}
        for option, value in given.items():
            chosen = getattr(args, option)
            if chosen is not None and str(chosen) != str(value):
                raise LaunchError(f"--{option.replace('_', '-')} {chosen} disagrees with the Ascend Operator pod, which"
                                  f" gives {value} ({pod.describe()}); leave the option out in a pod, or use"
                                  f" --cluster {CLUSTER_NONE} to launch by the options alone")
            setattr(args, option, value)
        args.pod = pod
        removed = {name: env.pop(name) for name in (names.RANK, names.LOCAL_RANK) if name in env}
        print(f"lightning-npu run: {pod.describe()}; the pod's "
              + ", ".join(f"{name}={value}" for name, value in removed.items())
              + " replaced by each process's own (torchrun)", file=sys.stderr)
    else:
        args.pod = None
    for option, default in LAUNCH_DEFAULTS.items():
        if getattr(args, option) is None:
            setattr(args, option, default)


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
        given_by = f"{names.LOCAL_WORLD_SIZE}={args.devices} (the pod's NPUs): " if getattr(args, "pod", None) else ""
        raise LaunchError(f"{given_by}{error}") from None
    if args.strategy is not None and args.strategy != STRATEGY_AUTO and args.strategy not in STRATEGIES:
        raise LaunchError(f"--strategy {args.strategy!r} cannot run on NPUs; use one of"
                          f" {', '.join(sorted(STRATEGIES))} (or leave it out)")
    if args.strategy == "npu_single" and processes * args.num_nodes > 1:
        raise LaunchError(f"--strategy npu_single runs one process, but --devices {args.devices} --num-nodes"
                          f" {args.num_nodes} asks for {processes * args.num_nodes}; use npu_ddp or npu_fsdp")
    try:
        table = rank_table.check_for_job(os.environ, args.num_nodes, processes)
    except SettingError as error:
        raise LaunchError(str(error)) from None
    if table is not None:
        print(f"lightning-npu run: {table.describe()}, matches the launch", file=sys.stderr)
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
