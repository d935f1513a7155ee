"""Every change ``import lightning_npu`` makes to Lightning's own code, in one room. Lightning 2.6 has no hook for a
third-party accelerator beyond its registries (``lightning_npu.registration``), so where it assumes CUDA, or does
something a process group of NPUs cannot survive, its function is wrapped here. Each wrapper behaves as Lightning's
original for every other accelerator and strategy, is installed once (a marker attribute makes a second install a
no-op), and reaches Lightning's private names through ``lightning_npu.compat``, which fails with the supported
versions when one is gone.

- ``connectors``: the Trainer's and Fabric's accelerator connectors -- the strategy for an NPU run without one
  (Lightning would train a one-device run on the CPU, or enter a CUDA stream under ``ddp``), Lightning's own
  strategies refused on NPUs, autocast built for the NPU (Lightning builds CUDA autocast, a no-op there, and drops
  fp16 loss scaling), ``precision="int8"`` refused with the reason.
- ``oom``: ``is_oom_error`` / ``garbage_collection_cuda`` know NPU out-of-memory errors and the NPU cache, so the
  batch-size finder backs off; an NPU OOM that ends a Trainer run carries a note naming the fixes.
- ``preemption``: Lightning's SIGTERM handler (a collective inside a signal handler: a signalled group hangs) and
  its per-batch SIGTERM broadcast give way to ``lightning_npu.preemption``; its SLURM resume choice skips the hidden
  temporaries of interrupted saves.
- ``cluster``: the cluster-environment choice tries the Ascend Operator's and ModelArts' environments in their places
  and checks a rank table (``RANK_TABLE_FILE``) against the run.
- ``checkpoint_loader``: ``load_from_checkpoint`` and ``TorchCheckpointIO`` read npu_fsdp's sharded checkpoint
  directories (Lightning's loader is ``torch.load``).
"""

from __future__ import annotations


def install() -> None:
    """Install every patch (idempotent); run by ``lightning_npu.registration.register`` once Lightning is imported."""
    from lightning_npu.lightning_patches import checkpoint_loader, cluster, connectors, oom, preemption

    connectors.install_all()
    oom.install()
    checkpoint_loader.install()
    preemption.install()
    cluster.install()
