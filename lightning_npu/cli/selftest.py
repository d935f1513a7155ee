"""Prove the NPU code paths on this machine before a long run: fused kernels against their PyTorch references,
collectives, and a short sharded training with a checkpoint resume.

    lightning-npu selftest                       # every device of this node, full checks
    lightning-npu selftest --devices 2 --quick --json selftest.json

Checks (each with its figures and a verdict: pass, fail, warn, not available, info):
  kernels      npu_fusion_attention, npu_rms_norm, npu_rotary_mul, npu_swiglu vs the reference path, forward and
               backward, fp32/bf16/fp16, the recipe's and edge shapes; errors and times (on device 0)
  collectives  all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, all_gather, broadcast,
               send/recv (batch_isend_irecv): exact results, bus bandwidth
  training     a small LLaMA-style decoder with npu_fsdp on every device: the loss falls, a sharded checkpoint
               resumes exactly, peak memory vs `lightning-npu plan`'s estimate; on an even number of devices, the
               same decoder in 2 pipeline stages (1F1B) gives plain npu_fsdp's losses
On the simulated runtime (LIGHTNING_NPU_SIMULATE) fused kernels are "not available": only the reference runs.
A failing kernel names its switch (LIGHTNING_NPU_DISABLE_FUSED=<kernel>) to train on the reference path meanwhile.
Across nodes, start it like training, on every node: torchrun --nnodes 2 --nproc-per-node 8 ... -m lightning_npu.cli
selftest --num-nodes 2 --workdir <a directory every node sees>.

Exit status: 0 when no check failed, 1 when one did (each failure is named), 2 for an option error.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Training steps of the full and the --quick run.
STEPS, QUICK_STEPS = 20, 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", default="auto",
                        help="devices of this node to use: a count ('8'), ids ('0,1') or 'auto' for all (default)")
    parser.add_argument("--num-nodes", type=int, default=1,
                        help="nodes, when started on each by torchrun / srun (default 1: this node, launched here)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smaller shapes, fewer sizes and repeats, {QUICK_STEPS} training steps (vs {STEPS})")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the report as JSON to FILE")
    parser.add_argument("--workdir", default=None,
                        help="where the training check writes its checkpoint (default: a temporary directory;"
                             " across nodes, one every node can see)")


def run(args: argparse.Namespace) -> int:
    from lightning_npu.kernels import DISABLE_FUSED_ENV, disabled_ops

    try:
        disabled_ops(os.environ.get(DISABLE_FUSED_ENV, ""))
    except ValueError as error:
        print(f"lightning-npu selftest: error: {error}", file=sys.stderr)
        return 2
    steps = QUICK_STEPS if args.quick else STEPS
    with tempfile.TemporaryDirectory(prefix="lightning-npu-selftest-") as tmp:
        workdir = Path(args.workdir or tmp)
        data = _run_checks(args, workdir, steps)
        if data is None:
            return 0  # another rank of a torchrun / srun start: global rank 0 reports
    if isinstance(data, int):
        return data
    report = build_report(data)
    from lightning_npu.selftest.report import render

    print(render(report))
    if args.json:
        report.write_json(Path(args.json))
        print(f"\nreport written to {args.json}")
    return report.exit_code


def _run_checks(args: argparse.Namespace, workdir: Path, steps: int) -> Any:
    """The worker's results: run here when this process is one of several launched ranks or the only one,
    else through `lightning-npu run`'s launcher (an int: the exit status of a launch that failed)."""
    from lightning_npu.cli import run as launcher
    from lightning_npu.selftest import worker

    options = argparse.Namespace(
        devices=args.devices, num_nodes=args.num_nodes, node_rank=0, main_address="127.0.0.1",
        main_port=_free_port(), strategy="npu_fsdp", precision=None, script=worker.__file__, script_args=[],
        cluster=launcher.CLUSTER_NONE,  # the selftest picks its own devices and port, in a pod too
    )
    try:
        processes = launcher.validate(options)
    except launcher.LaunchError as error:
        print(f"lightning-npu selftest: error: {error}", file=sys.stderr)
        return 2
    if _launched() or processes * args.num_nodes == 1:
        os.environ.update(launcher.fabric_environment(options))
        return worker.run_checks(quick=args.quick, workdir=workdir, steps=steps)
    if args.num_nodes > 1:
        print("lightning-npu selftest: error: --num-nodes > 1 needs one start per node (torchrun / srun);"
              " see `lightning-npu selftest --help`", file=sys.stderr)
        return 2
    results = workdir / "results.json"
    options.script_args = ["--results", str(results), "--workdir", str(workdir), "--steps", str(steps)]
    options.script_args += ["--quick"] if args.quick else []
    status = launcher.run(options)
    if status != 0 or not results.is_file():
        print(f"lightning-npu selftest: the selftest processes failed (exit status {status}); their errors are"
              " above", file=sys.stderr)
        return 1
    return json.loads(results.read_text())


def build_report(data: dict[str, Any]) -> Any:
    """The report: the workers' results with the versions `lightning-npu doctor` reports."""
    from lightning_npu.cli.doctor import build_report as doctor_report
    from lightning_npu.selftest.report import Report
    from lightning_npu.selftest.worker import results_from

    doctor = doctor_report()
    versions = dict(doctor.versions)
    versions["cann"] = doctor.cann.version if doctor.cann else None
    return Report(versions=versions, chip=data["chip"], checks=results_from(data), settings=data["settings"])


def _launched() -> bool:
    """Whether torchrun or srun started this process as one of several ranks (it then runs the checks itself)."""
    from lightning_npu.facts import env as names

    return names.TORCHELASTIC_RUN_ID in os.environ or int(os.environ.get(names.SLURM_NTASKS, "1")) > 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
