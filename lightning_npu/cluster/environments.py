"""Lightning ``ClusterEnvironment``s for Ascend jobs (they serve the Trainer and Fabric alike), detected as Lightning
detects torchelastic and SLURM (``lightning_patches/cluster.py``).

- ``AscendOperatorEnvironment``: the processes ``lightning-npu run`` (torchrun) starts in an Ascend Operator pod.
  torchrun gives each its own ``RANK`` / ``LOCAL_RANK`` / ``GROUP_RANK``; what this adds to Lightning's
  ``TorchElasticEnvironment`` is a check of the Trainer's / Fabric's ``devices`` and ``num_nodes`` against the job's
  pods, with the fix in the pod's terms.
- ``ModelArtsEnvironment``: one process per card, started by ModelArts (``creates_processes_externally``), its
  ranks from ``RANK_ID`` / ``RANK_SIZE`` / ``ASCEND_DEVICE_ID`` and the master from ``VC_WORKER_HOSTS``.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import ClusterEnvironment, TorchElasticEnvironment
from typing_extensions import override

from lightning_npu.cluster import modelarts
from lightning_npu.facts import env as names


class AscendOperatorEnvironment(TorchElasticEnvironment):
    """torchrun's processes in an Ascend Operator pod (``MINDX_TASK_ID`` set), checked against the job's pods."""

    @staticmethod
    @override
    def detect() -> bool:
        return names.MINDX_TASK_ID in os.environ and TorchElasticEnvironment.detect()

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        world_size, per_pod = self.world_size(), int(os.environ[names.LOCAL_WORLD_SIZE])
        if num_devices != per_pod or num_devices * num_nodes != world_size:
            raise ValueError(
                f"devices={num_devices}, num_nodes={num_nodes} is not this Ascend Operator job: {world_size // per_pod}"
                f" pod(s) x {per_pod} NPU(s) ({names.WORLD_SIZE}={world_size}, {names.LOCAL_WORLD_SIZE}={per_pod});"
                f" set devices={per_pod} and num_nodes={world_size // per_pod} (trainer.devices / trainer.num_nodes in"
                " a LightningCLI config; `lightning-npu run` sets them for Fabric())")


class ModelArtsEnvironment(ClusterEnvironment):
    """One process per card, started by ModelArts: rank ``RANK_ID`` of ``RANK_SIZE``, on card ``ASCEND_DEVICE_ID``."""

    def __init__(self) -> None:
        super().__init__()
        self.card = modelarts.ModelArtsCard.from_env(os.environ)

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self.card.main_address

    @property
    @override
    def main_port(self) -> int:
        return self.card.main_port

    @staticmethod
    @override
    def detect() -> bool:
        return modelarts.is_card(os.environ)

    @override
    def world_size(self) -> int:
        return self.card.world_size

    @override
    def set_world_size(self, size: int) -> None:
        pass  # RANK_SIZE says it; validate_settings refuses a Trainer / Fabric that disagrees

    @override
    def global_rank(self) -> int:
        return self.card.rank

    @override
    def set_global_rank(self, rank: int) -> None:
        pass  # RANK_ID says it

    @override
    def local_rank(self) -> int:
        # The index of this process's device among the Trainer's / Fabric's devices: its card on the host.
        return self.card.device_id

    @override
    def node_rank(self) -> int:
        return self.card.host_index

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices != self.card.cards_per_host or num_nodes != self.card.hosts:
            raise ValueError(
                f"devices={num_devices}, num_nodes={num_nodes} is not this ModelArts job: {self.card.hosts} host(s) x"
                f" {self.card.cards_per_host} card(s) ({names.RANK_SIZE}={self.card.world_size},"
                f" {names.MA_NUM_HOSTS}={self.card.hosts}); set devices={self.card.cards_per_host} and"
                f" num_nodes={self.card.hosts}")
