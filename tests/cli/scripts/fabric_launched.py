"""A Fabric script written for a launcher (``lightning-npu run``): ``Fabric()`` takes no arguments and this
script never imports lightning_npu, so the accelerator, devices, strategy and precision all come from the
launcher. Each process writes ``<out>/rank<r>.json`` with what its Fabric resolved and one all-reduce result.
"""

import argparse
import json
import sys
from pathlib import Path

from lightning.fabric import Fabric


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fabric = Fabric()  # no launch(): under a launcher the processes already exist
    import torch

    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum").item()
    report = {
        "global_rank": fabric.global_rank,
        "local_rank": fabric.local_rank,
        "world_size": fabric.world_size,
        "accelerator": type(fabric.accelerator).__name__,
        "strategy": type(fabric.strategy).__name__,
        "precision": getattr(fabric._precision, "precision", None),
        "rank_sum": total,
        "argv": sys.argv[1:],
        "main_module": __name__,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
