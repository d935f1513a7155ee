"""An HCCL rank table (``hccl.json``, the file ``RANK_TABLE_FILE`` names), parsed and checked against the job.

torch_npu uses a rank table, when one is given, to build its communicators faster on large clusters; a wrong one
fails only at the first collective, on every rank. So it is read here before any worker starts. The formats
(MindCluster's ``hccl.json_file_description.md``; every value is a string):

- ``1.0`` (Atlas A2 / training): ``{"status": "completed", "version": "1.0", "server_count": "2",
  "server_list": [{"server_id", "host_ip"?, "device": [{"device_id", "device_ip", "rank_id"}]}]}``;
- ``1.2`` (A3): the same, each device with a ``super_device_id``, and ``super_pod_list: [{"super_pod_id",
  "server_list": [{"server_id"}]}]`` naming servers of ``server_list``;
- ``2.0`` (Atlas 350/850/950): ``{"status", "version": "2.0", "rank_count", "rank_list": [{"rank_id",
  "local_id", "device_id", ...}]}``; only ranks and devices are checked (it does not say which ranks share a server).

``status`` is ``initializing`` until the Ascend Operator has written the table, ``completed`` after. Rank ids must
be 0 .. n-1, each once; a server's device ids distinct; every server the same number of devices; IPs valid.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lightning_npu.facts import env as names
from lightning_npu.facts.problem import Problem, SettingError

VERSIONS = ("1.0", "1.2", "2.0")
COMPLETED = "completed"
#: Where the Ascend Operator mounts the table it writes (ConfigMap ``rings-config-<job>``).
OPERATOR_PATH = "/user/serverid/devindex/config/hccl.json"


@dataclass(frozen=True)
class RankTable:
    """A checked table: ``ranks`` devices in all, on ``servers`` servers of ``devices_per_server`` each (None for
    version 2.0, which does not group ranks by server)."""

    path: str
    version: str
    ranks: int
    servers: Optional[int]
    devices_per_server: Optional[int]

    def describe(self) -> str:
        layout = (f"{self.servers} server(s) x {self.devices_per_server} device(s)" if self.servers is not None
                  else f"{self.ranks} rank(s)")
        return f"{names.RANK_TABLE_FILE}={self.path}: hccl.json version {self.version}, {layout}"

    def check_job(self, nodes: int, devices_per_node: int) -> None:
        """SettingError if the job (``nodes`` x ``devices_per_node`` processes) is not the one the table describes."""
        job = f"the job runs {nodes} node(s) x {devices_per_node} device(s) = {nodes * devices_per_node} rank(s)"
        fix = ("use the rank table written for this job (or unset RANK_TABLE_FILE: torch_npu then sets up HCCL without"
               " one), or give the job the table's layout (devices / num_nodes)")
        if self.ranks != nodes * devices_per_node:
            raise SettingError(Problem(f"{self._where('rank count')} is {self.ranks}, but {job}", fix))
        if self.servers is not None and self.servers != nodes:
            raise SettingError(Problem(f"{self._where('server_count')} is {self.servers}, but {job}", fix))
        if self.devices_per_server is not None and self.devices_per_server != devices_per_node:
            raise SettingError(Problem(
                f"{self._where('server_list[*].device')} lists {self.devices_per_server} device(s) per server, but {job}",
                fix))

    def _where(self, field: str) -> str:
        return f"{names.RANK_TABLE_FILE}={self.path}: {field}"


def load(path: str) -> RankTable:
    """Read and check the table at ``path``; SettingError names the file, the field, the value and the fix."""
    file = Path(path)
    where = f"{names.RANK_TABLE_FILE}={path}"
    if not file.is_file():
        raise SettingError(Problem(
            f"{where} {'is a directory' if file.is_dir() else 'does not exist'}",
            f"point it at the hccl.json the scheduler wrote (the Ascend Operator mounts it at {OPERATOR_PATH}),"
            " or unset it: torch_npu then sets up HCCL without a rank table"))
    try:
        data = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SettingError(Problem(f"{where} is not JSON ({error})",
                                   "give the hccl.json the scheduler wrote, unchanged")) from None
    return _Reader(path, data).table()


class _Reader:
    """Walks one table, naming the field of every error (``server_list[1].device[0].rank_id``)."""

    def __init__(self, path: str, data: Any) -> None:
        self.path = path
        self.data = data

    def fail(self, field: str, value: Any, why: str, fix: str) -> SettingError:
        return SettingError(Problem(f"{names.RANK_TABLE_FILE}={self.path}: {field}={value!r} {why}", fix))

    def field(self, owner: Any, key: str, where: str) -> Any:
        if not isinstance(owner, dict) or key not in owner:
            raise SettingError(Problem(f"{names.RANK_TABLE_FILE}={self.path}: {where or 'the table'} has no {key!r}",
                                       "give the hccl.json the scheduler wrote, unchanged"))
        return owner[key]

    def number(self, owner: Any, key: str, where: str) -> int:
        value = self.field(owner, key, where)
        if not (isinstance(value, str) and value.isdigit()):
            raise self.fail(f"{where}.{key}".lstrip("."), value, "is not a non-negative integer (as a string)",
                            "give the hccl.json the scheduler wrote, unchanged")
        return int(value)

    def items(self, owner: Any, key: str, where: str) -> list:
        value = self.field(owner, key, where)
        if not isinstance(value, list) or not value:
            raise self.fail(f"{where}.{key}".lstrip("."), value, "is not a non-empty list",
                            "give the hccl.json the scheduler wrote, unchanged")
        return value

    def ip(self, owner: dict, key: str, where: str) -> None:
        if key in owner:
            try:
                ipaddress.ip_address(owner[key])
            except ValueError:
                raise self.fail(f"{where}.{key}", owner[key], "is not an IP address",
                                "give the hccl.json the scheduler wrote, unchanged") from None

    def table(self) -> RankTable:
        status = self.field(self.data, "status", "")
        if status != COMPLETED:
            raise self.fail("status", status, f"is not {COMPLETED!r}: the scheduler has not finished writing it",
                            "start training once the table's status is 'completed' (the Ascend Operator writes it when"
                            " every pod is placed)")
        version = self.field(self.data, "version", "")
        if version not in VERSIONS:
            raise self.fail("version", version, f"is not a version this reads ({', '.join(VERSIONS)})",
                            "give the hccl.json the scheduler wrote, or unset RANK_TABLE_FILE")
        if version == "2.0":
            return self.flat_table(version)
        return self.server_table(version)

    def server_table(self, version: str) -> RankTable:
        servers = self.items(self.data, "server_list", "")
        count = self.number(self.data, "server_count", "")
        if count != len(servers):
            raise self.fail("server_count", str(count), f"disagrees with server_list, which has {len(servers)} server(s)",
                            "give the hccl.json the scheduler wrote, unchanged")
        ranks: list[int] = []
        sizes = set()
        server_ids = []
        for s, server in enumerate(servers):
            where = f"server_list[{s}]"
            server_ids.append(self.field(server, "server_id", where))
            self.ip(server, "host_ip", where)
            devices = self.items(server, "device", where)
            sizes.add(len(devices))
            device_ids = []
            for d, device in enumerate(devices):
                at = f"{where}.device[{d}]"
                device_ids.append(self.number(device, "device_id", at))
                ranks.append(self.number(device, "rank_id", at))
                self.field(device, "device_ip", at)
                self.ip(device, "device_ip", at)
                if version == "1.2":
                    self.field(device, "super_device_id", at)
            if len(set(device_ids)) != len(device_ids):
                raise self.fail(f"{where}.device[*].device_id", device_ids, "lists a device more than once",
                                "list each NPU of the server once")
        if len(sizes) > 1:
            raise self.fail("server_list[*].device", sorted(sizes), "gives the servers different numbers of devices",
                            "give every server of the job the same number of NPUs")
        if version == "1.2":
            self.super_pods(server_ids)
        self.rank_ids(ranks, "server_list[*].device[*].rank_id")
        return RankTable(self.path, version, len(ranks), len(servers), sizes.pop())

    def super_pods(self, server_ids: list) -> None:
        for p, pod in enumerate(self.items(self.data, "super_pod_list", "")):
            for s, server in enumerate(self.items(pod, "server_list", f"super_pod_list[{p}]")):
                server_id = self.field(server, "server_id", f"super_pod_list[{p}].server_list[{s}]")
                if server_id not in server_ids:
                    raise self.fail(f"super_pod_list[{p}].server_list[{s}].server_id", server_id,
                                    "is not a server of server_list", "give the hccl.json the scheduler wrote, unchanged")

    def flat_table(self, version: str) -> RankTable:
        entries = self.items(self.data, "rank_list", "")
        count = self.number(self.data, "rank_count", "")
        if count != len(entries):
            raise self.fail("rank_count", str(count), f"disagrees with rank_list, which has {len(entries)} rank(s)",
                            "give the hccl.json the scheduler wrote, unchanged")
        ranks = []
        for r, entry in enumerate(entries):
            ranks.append(self.number(entry, "rank_id", f"rank_list[{r}]"))
            self.number(entry, "local_id", f"rank_list[{r}]")
            self.number(entry, "device_id", f"rank_list[{r}]")
        self.rank_ids(ranks, "rank_list[*].rank_id")
        return RankTable(self.path, version, len(ranks), None, None)

    def rank_ids(self, ranks: list[int], field: str) -> None:
        if sorted(ranks) != list(range(len(ranks))):
            raise self.fail(field, ranks, f"are not the ranks 0 .. {len(ranks) - 1}, each once",
                            "give every device of the job one rank id, counting from 0")


def check_for_job(env: Any, nodes: int, devices_per_node: int) -> Optional[RankTable]:
    """The table ``RANK_TABLE_FILE`` names, checked against the job (None when it is unset); SettingError if wrong."""
    path = env.get(names.RANK_TABLE_FILE)
    if not path:
        return None
    table = load(path)
    table.check_job(nodes, devices_per_node)
    return table
