"""What every selftest process runs: kernels (on global rank 0), collectives, the short training and the pipelined
step (on all ranks).

Started by ``lightning-npu selftest`` through ``lightning-npu run``'s launcher (one process per device, torchrun),
run in the command's own process for a single device, or started by the user's torchrun / srun across nodes. The
accelerator, devices and strategy come from the ``LT_*`` variables the launcher sets, as for any ``fabric run``
script. Global rank 0 gathers every rank's results and returns (or writes) them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from lightning_npu.selftest.report import CheckResult, merge_ranks


def run_checks(*, quick: bool, workdir: Path, steps: int) -> Optional[dict[str, Any]]:
    """Run every check in this process, each shown as it starts and ends (``lightning_npu.progress``, global rank
    0); the results (JSON-ready) on global rank 0, None on the other ranks."""
    import torch
    from lightning.fabric import Fabric

    import lightning_npu  # noqa: F401 -- registers accelerator="npu" and the NPU strategies
    from lightning_npu.progress import Progress
    from lightning_npu.runtime import get_runtime
    from lightning_npu.selftest.collectives import FULL_SIZES, QUICK_SIZES, collective_checks
    from lightning_npu.selftest.kernels import kernel_checks
    from lightning_npu.selftest.training import FAMILY, PIPELINE_CHECK, check_pipeline, check_training
    from lightning_npu.strategies.clean_exit import destroy_process_groups

    runtime = get_runtime()
    # bf16 where the chip has it (the NPU default); fp32 on the CPU simulation, whose bf16 matmuls are slow.
    precision = "bf16-mixed" if runtime.chip().supports_bf16 and not runtime.simulated else "32-true"
    # The launcher's LT_* variables make Fabric() set up the processes itself (no fabric.launch()).
    fabric = Fabric(precision=precision)
    device = fabric.device
    kernels = kernel_checks(runtime, device, quick=quick) if fabric.global_rank == 0 else []
    shared = [(label, lambda check=check: [check()]) for label, check in
              collective_checks(runtime, device, sizes=QUICK_SIZES if quick else FULL_SIZES,
                                iterations=5 if quick else 20)]
    shared.append((f"{FAMILY}/loss, resume, memory ({steps} steps)",
                   lambda: check_training(fabric, runtime, workdir, steps=steps, precision=precision)))
    shared.append((f"{FAMILY}/{PIPELINE_CHECK}", lambda: [check_pipeline(fabric, runtime, precision=precision)]))
    results: list[CheckResult] = []
    with Progress("selftest", total=len(kernels) + len(shared)) as progress:
        for label, check in kernels:
            with progress.step(label) as step:
                results.append(check())
                step.outcome = results[-1].verdict
        for label, check in shared:
            with progress.step(label) as step:
                merged = _merged(torch.distributed, fabric.world_size, check())
                step.outcome = ", ".join(result.verdict for result in merged)
                results += merged
    # The last collective: the groups go now, not in interpreter teardown (lightning_npu.strategies.clean_exit).
    destroy_process_groups()
    if fabric.global_rank != 0:
        return None
    chip = runtime.chip()
    return {
        "chip": {**asdict(chip), "devices_per_node": runtime.device_count(),
                 "memory_gib": runtime.total_memory(device) / 1024**3, "simulated": runtime.simulated},
        "settings": {"ranks": fabric.world_size, "nodes": getattr(fabric.strategy, "num_nodes", 1),
                     "strategy": type(fabric.strategy).__name__, "precision": precision, "quick": quick,
                     "training_steps": steps},
        "checks": [asdict(c) for c in results],
    }


def _merged(distributed: Any, world_size: int, results: list[CheckResult]) -> list[CheckResult]:
    """One check's results for the whole group, gathered from every rank as soon as it ends (so the verdict
    shown is the group's, not rank 0's)."""
    if world_size == 1:
        return results
    per_rank = [None] * world_size
    distributed.all_gather_object(per_rank, results)
    return merge_ranks(per_rank)


def results_from(data: dict[str, Any]) -> list[CheckResult]:
    return [CheckResult.from_dict(check) for check in data["checks"]]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="one process of lightning-npu selftest")
    parser.add_argument("--results", required=True, help="where global rank 0 writes the results (JSON)")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    data = run_checks(quick=args.quick, workdir=Path(args.workdir), steps=args.steps)
    if data is not None:
        Path(args.results).write_text(json.dumps(data))


if __name__ == "__main__":
    main(sys.argv[1:])
