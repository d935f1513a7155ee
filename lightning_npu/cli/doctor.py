"""Check that this machine can train on Ascend NPUs with lightning-npu, and say what to fix.

Reports the Python, torch, torch_npu, CANN and Lightning versions; whether NPUs are usable (count, chip, bf16
support, memory); and the HCCL, runtime and allocator environment variables in effect. Every problem is printed
with its cause and its fix.

exit status:
  0  accelerator="npu" can run here -- real NPUs were found, or LIGHTNING_NPU_SIMULATE turns on the simulated
     NPU -- and no setting is invalid (warnings and notes do not change the status)
  1  at least one error
  2  usage error

It works where `import torch` fails (torch >= 2.5 autoloads an installed torch_npu, which fails without CANN)
or kills the process (a broken driver or CANN library): this command never imports torch. When torch is already
imported in this process the devices are probed here; otherwise a child process probes them, and when
`import torch` fails or crashes there, a second child retries with TORCH_DEVICE_BACKEND_AUTOLOAD=0 to find the
underlying cause.
"""

from __future__ import annotations

import argparse
import json
import os

from lightning_npu.doctor import build_report
from lightning_npu.doctor.render import render, render_hang_diagnostics
from lightning_npu.timeouts import FLIGHT_RECORDER_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="the process-group timeout your run sets (strategy timeout, seconds), checked against"
                             " HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT; default: the strategies' default")
    parser.add_argument("--hang-diagnostics", action="store_true",
                        help="also print the exports that turn on torch_npu's HCCL flight recorder and CANN logs")


def run(args: argparse.Namespace) -> int:
    report = build_report(timeout_s=args.timeout)
    if args.json:
        data = report.to_dict()
        if args.hang_diagnostics:
            data["hang_diagnostics"] = {name: os.environ.get(name, value) for name, value in FLIGHT_RECORDER_ENV.items()}
        print(json.dumps(data, indent=2))
    else:
        print(render(report) + (render_hang_diagnostics(os.environ) if args.hang_diagnostics else ""))
    return report.exit_code
