"""Turn a sharded npu_fsdp checkpoint directory into one normal Lightning checkpoint file.

  lightning-npu consolidate runs/ckpts/last.ckpt model.ckpt

The file holds the unsharded ``state_dict``, the optimizer states numbered as ``optimizer.state_dict()`` numbers them,
and everything else the checkpoint held (epoch, global_step, hyper-parameters, callback states), so
``LightningModule.load_from_checkpoint``, ``torch.load`` and a Trainer on any strategy can read it. Runs in one process
on the CPU; needs host memory for the whole checkpoint (weights and optimizer states).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="sharded checkpoint directory (holds .metadata and meta.pt)")
    parser.add_argument("output", type=Path, help="the checkpoint file to write (replaced atomically if it exists)")


def run(args: argparse.Namespace) -> int:
    from lightning_npu.strategies.checkpoints.layout import is_sharded_checkpoint
    from lightning_npu.strategies.checkpoints.offline import consolidate

    if not is_sharded_checkpoint(args.checkpoint):
        reason = "does not exist" if not args.checkpoint.exists() else "is not a directory with a .metadata file"
        print(f"lightning-npu consolidate: {args.checkpoint} {reason}; pass a sharded checkpoint directory written by"
              " npu_fsdp (e.g. .../checkpoints/last.ckpt)", file=sys.stderr)
        return 2
    written = consolidate(args.checkpoint, args.output)
    print(f"wrote {written} ({written.stat().st_size / 2**20:.1f} MiB) from {args.checkpoint}")
    return 0
