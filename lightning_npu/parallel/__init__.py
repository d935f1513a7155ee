"""Everything that splits a model over ranks, in one room.

- ``mesh``: ``ParallelMesh``, the one device mesh (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``) and its
  named views (FSDP's, the loss's, the experts', Lightning's ``data_parallel`` / ``tensor_parallel``);
- ``protocol``: ``ParallelPlan``, how a model says how it splits (``parallel_plan()``);
- ``tensor`` (TP, SP, loss parallelism), ``context`` (Ulysses, ring), ``expert`` (EP, tensor-parallel shares of
  rows), ``checkpointing`` (activation checkpointing), ``fsdp`` (FSDP2 units by policy);
- ``all_to_all``: the one differentiable all-to-all (Ulysses, the experts' tokens);
- ``parallelize``: all of them applied to a finished model in order, for the Trainer and Fabric strategies alike.

The NPU attention math stays in ``lightning_npu.kernels``; the strategies (``lightning_npu.strategies``) own the
mesh's lifetime and call ``parallelize``.
"""

from lightning_npu.parallel.protocol import ParallelPlan, PipelineLayout

__all__ = ["ParallelPlan", "PipelineLayout"]
