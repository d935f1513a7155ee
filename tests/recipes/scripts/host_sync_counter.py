"""A callback that counts host syncs per optimizer step: reads of a tensor's value on the host (``.item()``,
``float()``, ``bool()``, ``int()`` of a tensor all dispatch ``aten._local_scalar_dense``) and the runtime's
``synchronize``, each attributed to who made it:

- ``preemption_check``: the ranks' agreement on a preemption signal (``lightning_npu/preemption.py``);
- ``ours``: any other code in ``lightning_npu/`` or ``recipes/``;
- ``lightning``: Lightning's own loop (e.g. its per-step SIGTERM broadcast);
  (each read belongs to the innermost caller outside torch itself)
- ``optimizer_host_counters``: torch.optim reading its ``step`` counters, which live on the host for the
  non-fused optimizers (not a device sync; a fused NPU optimizer keeps them on the device and reads none).

Counted from one step's ``on_train_batch_start`` to the next one's, for every step but the first (lazy
initialisation) and the last (the final checkpoint). Rank 0 writes ``{"steps": [...per-step counts...]}`` to
``out`` at the end of training.
"""

from __future__ import annotations

import json
import traceback
from collections import Counter
from pathlib import Path

import torch
from lightning.pytorch import Callback
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_npu.runtime import get_runtime


def _source() -> str:
    """Who asked for the value: the innermost caller outside torch's own code (torch.optim counts apart)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename
        if "/torch/optim/" in path:
            return "optimizer_host_counters"
        if path.endswith("/lightning_npu/preemption.py"):
            return "preemption_check"
        if "/lightning_npu/" in path or "/recipes/" in path:
            return "ours"
        if "/lightning/" in path:
            return "lightning"
    return "other"


class _Counting(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts[f"scalar_reads_{_source()}"] += 1
        return func(*args, **(kwargs or {}))


class HostSyncCounter(Callback):
    def __init__(self, out: str) -> None:
        self.out = out
        self.counts: Counter = Counter()
        self.marks: list[Counter] = []

    def on_train_start(self, trainer, pl_module):
        runtime = get_runtime()
        self._synchronize = runtime.synchronize

        def counted(*args, **kwargs):
            self.counts[f"synchronize_{_source()}"] += 1
            return self._synchronize(*args, **kwargs)

        runtime.synchronize = counted
        self._mode = _Counting(self.counts)
        self._mode.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.marks.append(Counter(self.counts))

    def on_train_end(self, trainer, pl_module):
        self._mode.__exit__(None, None, None)
        get_runtime().synchronize = self._synchronize
        if trainer.global_rank == 0:
            steps = [dict(later - earlier) for earlier, later in zip(self.marks[1:], self.marks[2:])]
            Path(self.out).write_text(json.dumps({"steps": steps}))
