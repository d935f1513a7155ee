"""The strict fake's HCCL point-to-point: torch_npu's ``batch_isend_irecv`` as importing it installs it, refusing what
HcclBatchSendRecv refuses (``lightning_npu.facts.hccl``), and a recorder of the batches a run hands it.

Gloo runs each operation of a batch alone, so a simulated run cannot fail as HCCL would; the fake checks every batch
before handing it to torch's own function (gloo underneath), so a test fails on the batch HCCL would refuse."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

from lightning_npu.facts.hccl import batch_send_recv_refusal


def _tasks(ops: list) -> list[tuple[str, int]]:
    return [("send" if op.op is dist.isend else "recv", int(op.peer)) for op in ops]


def checked_batch_isend_irecv(original: Callable[[list], list]) -> Callable[[list], list]:
    """torch_npu's ``batch_isend_irecv`` over ``original``: torch's own list checks (``P2POp``s of one group), then
    HCCL's rule, raising RuntimeError as the HCCL call would; a batch both take runs through ``original``."""

    def batch_isend_irecv(p2p_op_list: list) -> list:
        dist.distributed_c10d._check_p2p_op_list(p2p_op_list)
        refusal = batch_send_recv_refusal(_tasks(p2p_op_list))
        if refusal is not None:
            raise RuntimeError(refusal)
        return original(p2p_op_list)

    return batch_isend_irecv


def install_hccl_batch_send_recv(monkeypatch: Any) -> None:
    """What importing torch_npu does to ``torch.distributed.batch_isend_irecv`` (both names it is reachable by)."""
    checked = checked_batch_isend_irecv(dist.distributed_c10d.batch_isend_irecv)
    monkeypatch.setattr(dist, "batch_isend_irecv", checked)
    monkeypatch.setattr(dist.distributed_c10d, "batch_isend_irecv", checked)


@dataclass
class P2PRecorder:
    """Records every ``dist.batch_isend_irecv`` call made while active (``with P2PRecorder() as recorder: ...``) as its
    ``(kind, peer)`` tasks, and lists those HCCL would refuse (``refused_by_hccl``) without stopping the run. torch
    2.13's schedules send an all-send or all-receive group as separate operations and only a mixed one through
    ``batch_isend_irecv``."""

    batches: list[list[tuple[str, int]]] = field(default_factory=list)

    def __enter__(self) -> "P2PRecorder":
        self._original = original = dist.batch_isend_irecv

        def batch_isend_irecv(ops: list) -> list:
            self.batches.append(_tasks(ops))
            return original(ops)

        dist.batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv = batch_isend_irecv
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv = self._original

    def refused_by_hccl(self) -> list[list[tuple[str, int]]]:
        return [batch for batch in self.batches if batch_send_recv_refusal(batch) is not None]
