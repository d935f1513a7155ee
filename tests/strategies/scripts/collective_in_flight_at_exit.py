"""Rank 0 exits with an all-reduce in flight that rank 1 never joins (rank 1 only sleeps), so freeing rank 0's
process group waits for it until the process-group timeout (600 s). Rank 0 uses the plugin's exit hook with its
limit shortened to ``--limit`` seconds; plain torch.distributed (gloo, a file store), no Lightning.

    python collective_in_flight_at_exit.py RANK STORE_FILE [--limit S]
"""

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_npu.strategies import clean_exit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("store")
    parser.add_argument("--limit", type=float, default=clean_exit.DESTROY_TIMEOUT_S)
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=2,
                            timeout=timedelta(seconds=600))
    clean_exit.DESTROY_TIMEOUT_S = args.limit
    clean_exit.destroy_at_exit()
    dist.all_reduce(torch.ones(1))  # both ranks are connected
    if args.rank == 0:
        dist.all_reduce(torch.ones(4), async_op=True)
        print("rank 0 exits with an all-reduce in flight", flush=True)
    else:
        time.sleep(600)


if __name__ == "__main__":
    main()
