"""An Ascend Operator pod's variables (MindCluster's ``environment_variable_description.md``), checked, and the
torchrun options that start one process per NPU from them.

The operator describes the pod, not a process: ``RANK`` is the pod's rank (0 on the master pod), ``LOCAL_RANK`` the
list of the pod's NPU ids (``{0,1,2,3}``), ``WORLD_SIZE`` the job's NPUs, ``LOCAL_WORLD_SIZE`` the pod's NPUs, and
``MASTER_ADDR`` / ``MASTER_PORT`` (2222 by default) the master pod's service. torchrun reads none of them (its options
come from ``PET_*``), and ``import lightning`` fails on the list-shaped ``LOCAL_RANK`` (torchmetrics reads it as a
number), so ``lightning-npu run`` reads them here and passes torchrun ``--nnodes WORLD_SIZE / LOCAL_WORLD_SIZE
--node-rank RANK --nproc-per-node LOCAL_WORLD_SIZE``; torchrun then gives every process its own ``RANK`` and
``LOCAL_RANK``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from lightning_npu.facts import env as names
from lightning_npu.cluster.variables import integer
from lightning_npu.facts.problem import Problem, SettingError

#: The operator's default for MASTER_PORT (the ``ascendjob-port`` of the master pod's service).
DEFAULT_PORT = 2222
#: ``{0,1,2,3}``: the operator's form of LOCAL_RANK (spaces tolerated).
_ID_LIST = re.compile(r"\{\s*(\d+(?:\s*,\s*\d+)*)\s*\}")
#: Who sets these variables, as the errors name it.
SCHEDULER = "the Ascend Operator"
_REQUIRED = (names.RANK, names.LOCAL_RANK, names.WORLD_SIZE, names.LOCAL_WORLD_SIZE, names.MASTER_ADDR)


def is_pod(env: Mapping[str, str]) -> bool:
    """Whether this process is an Ascend Operator pod's own command (``MINDX_TASK_ID`` set, not a torchrun worker)."""
    return names.MINDX_TASK_ID in env and names.TORCHELASTIC_RUN_ID not in env


@dataclass(frozen=True)
class AscendPod:
    """One pod of an Ascend Operator job: ``node_rank`` of ``nodes`` pods, ``npus`` NPUs each, ``world_size`` in all."""

    node_rank: int
    nodes: int
    npus: int
    world_size: int
    main_address: str
    main_port: int
    task_id: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "AscendPod":
        """Read and check the pod's variables; SettingError names the variable, its value and the fix."""
        missing = [name for name in _REQUIRED if not env.get(name, "").strip()]
        if missing:
            raise SettingError(Problem(
                f"the Ascend Operator pod variables {', '.join(missing)} are not set"
                f" ({names.MINDX_TASK_ID}={env.get(names.MINDX_TASK_ID)!r} says this is an Ascend Operator pod)",
                "start the job as an AscendJob (apiVersion mindxdl.gitee.com/v1), which sets them in every pod, or run"
                " `lightning-npu run --cluster none` with --devices / --num-nodes / --node-rank / --main-address"))
        world_size = _positive(env, names.WORLD_SIZE, "the job's NPUs")
        npus = _positive(env, names.LOCAL_WORLD_SIZE, "the pod's NPUs")
        ids = local_rank_ids(env[names.LOCAL_RANK])
        if ids != list(range(npus)):
            raise SettingError(Problem(
                f"{names.LOCAL_RANK}={env[names.LOCAL_RANK]!r} lists NPU ids {ids}, but {names.LOCAL_WORLD_SIZE}={npus}"
                f" says the pod has {npus} NPU(s), which the operator numbers {_id_list(range(npus))}",
                f"make the AscendJob's huawei.com/Ascend910 request and {names.LOCAL_WORLD_SIZE} agree (the operator"
                " writes both from it; a hand-set value must keep that form)"))
        if world_size % npus:
            raise SettingError(Problem(
                f"{names.WORLD_SIZE}={world_size} (the job's NPUs) is not a multiple of {names.LOCAL_WORLD_SIZE}={npus}"
                " (each pod's NPUs), so the pods cannot all have the same number of processes",
                "give every replica (Master and Worker) the same huawei.com/Ascend910 count, or correct a hand-set"
                f" {names.WORLD_SIZE}"))
        nodes = world_size // npus
        node_rank = integer(env, names.RANK, "the pod's rank", SCHEDULER)
        if not 0 <= node_rank < nodes:
            raise SettingError(Problem(
                f"{names.RANK}={node_rank} (the pod's rank) must lie in 0 .. {nodes - 1}: the job has {nodes} pod(s)"
                f" ({names.WORLD_SIZE}={world_size} / {names.LOCAL_WORLD_SIZE}={npus})",
                "check the AscendJob's replicas against its NPUs per pod"))
        port = DEFAULT_PORT
        if env.get(names.MASTER_PORT):
            port = integer(env, names.MASTER_PORT, "the master pod's port", SCHEDULER)
        if not 1 <= port <= 65535:
            raise SettingError(Problem(f"{names.MASTER_PORT}={port} is not a TCP port",
                                       f"use the master service's ascendjob-port ({DEFAULT_PORT} by default)"))
        return cls(node_rank=node_rank, nodes=nodes, npus=npus, world_size=world_size,
                   main_address=env[names.MASTER_ADDR].strip(), main_port=port, task_id=env[names.MINDX_TASK_ID])

    def torchrun_options(self) -> list[str]:
        """The options that make torchrun start this pod's processes as ranks of the whole job."""
        return [f"--nproc-per-node={self.npus}", f"--nnodes={self.nodes}", f"--node-rank={self.node_rank}",
                f"--master-addr={self.main_address}", f"--master-port={self.main_port}"]

    def describe(self) -> str:
        return (f"Ascend Operator pod {self.node_rank} of {self.nodes} ({names.MINDX_TASK_ID}={self.task_id}):"
                f" {self.npus} process(es), one per NPU, ranks {self.node_rank * self.npus} .."
                f" {(self.node_rank + 1) * self.npus - 1} of {self.world_size}, master"
                f" {self.main_address}:{self.main_port}")


def local_rank_ids(value: str) -> list[int]:
    """The NPU ids of the operator's ``LOCAL_RANK`` list (``"{0,1,2,3}"`` -> [0, 1, 2, 3]); SettingError otherwise."""
    match = _ID_LIST.fullmatch(value.strip())
    ids = [int(part) for part in match.group(1).split(",")] if match else []
    if not match or len(set(ids)) != len(ids):
        raise SettingError(Problem(
            f"{names.LOCAL_RANK}={value!r} is not the Ascend Operator's list of the pod's NPU ids (e.g. '{{0,1,2,3}}':"
            " distinct ids, comma-separated, in braces)",
            f"leave {names.LOCAL_RANK} as the operator writes it, or set it to the pod's NPU ids such as"
            " '{0,1,2,3}'"))
    return ids


def _id_list(ids: range) -> str:
    return "{" + ",".join(map(str, ids)) + "}"




def _positive(env: Mapping[str, str], name: str, meaning: str) -> int:
    number = integer(env, name, meaning, SCHEDULER)
    if number < 1:
        raise SettingError(Problem(f"{name}={number} ({meaning}) must be at least 1",
                                   f"leave {name} as the Ascend Operator writes it"))
    return number
