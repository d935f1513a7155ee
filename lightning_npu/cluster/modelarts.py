"""A ModelArts card's variables, checked: the preset Ascend-Powered-Engine runs the boot file once per card, so every
process is a rank started from outside, and says which one through ``RANK_ID`` (global rank), ``RANK_SIZE`` (the
job's cards), ``ASCEND_DEVICE_ID`` (the card on its host), ``MA_NUM_HOSTS`` (hosts; 1 when unset),
``VC_TASK_INDEX`` (this host; 0 when unset) and ``VC_WORKER_HOSTS`` (the hosts, the master first).

ModelArts names no rendezvous port: ``MASTER_PORT`` when set, else ``DEFAULT_PORT`` on the first host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from lightning_npu.facts import env as names
from lightning_npu.cluster.variables import integer
from lightning_npu.facts.problem import Problem, SettingError

#: The rendezvous port on the first host when MASTER_PORT is unset (torch.distributed's usual one).
DEFAULT_PORT = 29500
#: Where the master is when VC_WORKER_HOSTS is unset (a one-host job).
LOCAL_HOST = "127.0.0.1"
#: Who sets these variables, as the errors name it.
SCHEDULER = "ModelArts"
_REQUIRED = (names.RANK_ID, names.RANK_SIZE, names.ASCEND_DEVICE_ID)


def is_card(env: Mapping[str, str]) -> bool:
    """Whether this process was started by ModelArts for one card (its three per-card variables are set)."""
    return all(name in env for name in _REQUIRED)


@dataclass(frozen=True)
class ModelArtsCard:
    """Rank ``rank`` of ``world_size``: card ``device_id`` of host ``host_index`` (of ``hosts``)."""

    rank: int
    world_size: int
    device_id: int
    hosts: int
    host_index: int
    main_address: str
    main_port: int

    @property
    def cards_per_host(self) -> int:
        return self.world_size // self.hosts

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "ModelArtsCard":
        """Read and check the card's variables; SettingError names the variable, its value and the fix."""
        rank = integer(env, names.RANK_ID, "this card's global rank", SCHEDULER)
        world_size = integer(env, names.RANK_SIZE, "the job's cards", SCHEDULER)
        device_id = integer(env, names.ASCEND_DEVICE_ID, "this card on its host", SCHEDULER)
        hosts = _optional(env, names.MA_NUM_HOSTS, "the job's hosts", 1)
        host_index = _optional(env, names.VC_TASK_INDEX, "this host", 0)
        if world_size < 1 or hosts < 1 or world_size % hosts:
            raise SettingError(Problem(
                f"{names.RANK_SIZE}={world_size} cards on {names.MA_NUM_HOSTS}={hosts} host(s) is not the same number"
                " of cards on every host", "give every host of the job the same number of cards"))
        per_host = world_size // hosts
        if not 0 <= host_index < hosts:
            raise SettingError(Problem(f"{names.VC_TASK_INDEX}={host_index} must lie in 0 .. {hosts - 1}"
                                       f" ({names.MA_NUM_HOSTS}={hosts})", "leave it as ModelArts sets it"))
        if not host_index * per_host <= rank < (host_index + 1) * per_host:
            raise SettingError(Problem(
                f"{names.RANK_ID}={rank} is not a rank of host {names.VC_TASK_INDEX}={host_index}, which holds ranks"
                f" {host_index * per_host} .. {(host_index + 1) * per_host - 1} ({per_host} card(s) per host)",
                f"leave {names.RANK_ID} as ModelArts sets it (a boot script that sets it must number the cards"
                " host by host)"))
        if not 0 <= device_id < per_host:
            raise SettingError(Problem(
                f"{names.ASCEND_DEVICE_ID}={device_id} is not one of this host's {per_host} card(s) (0 .."
                f" {per_host - 1}), so the process would not know its NPU",
                f"leave {names.ASCEND_DEVICE_ID} as ModelArts sets it"))
        workers = [host.strip() for host in env.get(names.VC_WORKER_HOSTS, "").split(",") if host.strip()]
        if workers and len(workers) != hosts:
            raise SettingError(Problem(
                f"{names.VC_WORKER_HOSTS}={env[names.VC_WORKER_HOSTS]!r} names {len(workers)} host(s), but"
                f" {names.MA_NUM_HOSTS}={hosts}", "leave both as ModelArts sets them"))
        port = _optional(env, names.MASTER_PORT, "the rendezvous port", DEFAULT_PORT)
        if not 1 <= port <= 65535:
            raise SettingError(Problem(f"{names.MASTER_PORT}={port} is not a TCP port",
                                       f"unset it (then {DEFAULT_PORT}) or use one in 1 .. 65535"))
        return cls(rank=rank, world_size=world_size, device_id=device_id, hosts=hosts, host_index=host_index,
                   main_address=workers[0] if workers else LOCAL_HOST, main_port=port)


def _optional(env: Mapping[str, str], name: str, meaning: str, default: int) -> int:
    return integer(env, name, meaning, SCHEDULER) if env.get(name, "").strip() else default
