"""HCCL's rule for batched point-to-point calls, torch-free: what the pipeline's schedules must respect and the strict
fake of torch_npu enforces.

torch_npu aliases ``torch.distributed.batch_isend_irecv`` to its own (``_batch_isend_irecv``, 2.13.0 wheel,
``torch_npu/distributed/distributed_c10d.py``, aliased in ``torch_npu/_init/patches/distributed_patches.py``). On NPU
tensors it checks the list as torch does (``P2POp``s of one group), then either coalesces the operations (910B1 to
910B4-1 and 910_93 chips, with a CANN version it can read) or hands the whole list to one
``ProcessGroupHCCL.batch_isend_irecv``, that is one ``HcclBatchSendRecv``. CANN's HcclBatchSendRecv takes no two
tasks of the same kind to one rank (CANN 8.0, hcclcpp_07_0033). npu_fsdp treats that rule as binding on every chip,
coalesced or not, so a schedule never depends on which path a cluster takes.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional


def batch_send_recv_refusal(tasks: Iterable[tuple[str, int]]) -> Optional[str]:
    """Why HcclBatchSendRecv refuses a batch of ``(kind, peer)`` tasks (``"send"`` / ``"recv"``, the peer's rank),
    or None when it takes them."""
    repeated = sorted(task for task, count in Counter(tasks).items() if count > 1)
    if not repeated:
        return None
    listed = ", ".join(f"{kind} to/from rank {peer}" for kind, peer in repeated)
    return (f"HcclBatchSendRecv takes one task of each kind per peer rank, but this batch repeats {listed}; split the"
            " batch into calls that each hold at most one send and one receive per peer")


__all__ = ["batch_send_recv_refusal"]
