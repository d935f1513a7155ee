"""The environment rules: which variables the doctor shows, what each means when unset, and which values are
wrong (a finding with the cause and the fix). Ranges and choices are CANN's and torch_npu's documented ones."""

from __future__ import annotations

import ipaddress
import math
import socket
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from lightning_npu.cluster import modelarts, pod, rank_table
from lightning_npu.doctor.report import ERROR, NOTE, WARNING, Finding
from lightning_npu.facts import env as names
from lightning_npu.facts.problem import SettingError
from lightning_npu.timeouts import HCCL_DEFAULTS_S, default_timeout_s, hccl_timeouts_s, minimum_timeout_s
from lightning_npu.timeouts import timeout_problem

#: HCCL's documented ranges: link set-up timeout (s), execution timeout (s; 0 = never, the top is INT32_MAX),
#: the first host port (the top leaves room for the ports HCCL counts up from it), the buffer size (MB).
CONNECT_TIMEOUT_RANGE_S = (120, 7200)
EXEC_TIMEOUT_RANGE_S = (0, 2**31 - 1)
BASE_PORT_RANGE = (1024, 65520)
MIN_BUFFSIZE_MB = 1
#: HCCL's defaults when unset, as the report shows them.
DEFAULT_BASE_PORT = 60000
DEFAULT_BUFFSIZE_MB = 200
#: An HCCL_EXEC_TIMEOUT to suggest in place of 0 (never), besides the default.
SUGGESTED_EXEC_TIMEOUT_S = 3600

Check = Callable[[str, Mapping[str, str], Sequence[str]], list[Finding]]


@dataclass(frozen=True)
class EnvVar:
    """An environment variable the doctor shows; ``check(value, env, interfaces)`` returns findings for a bad
    value (``interfaces``: this host's network interface names)."""

    name: str
    when_unset: str
    check: Optional[Check] = None


def _integer_in(name: str, low: int, high: Optional[int], unit: str, meaning: str) -> Check:
    def check(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
        return _range_findings(name, value, low, high, unit, meaning, integer=True)

    return check


def _range_findings(
    name: str, value: str, low: float, high: Optional[float], unit: str, meaning: str, *, integer: bool
) -> list[Finding]:
    kind = "an integer" if integer else "a number"
    allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
    try:
        number = int(value) if integer else float(value)
        if not math.isfinite(number):
            raise ValueError(value)
    except ValueError:
        return [Finding(ERROR, name, f"{name}={value!r} is not {kind} ({meaning})",
                        f"set it to {kind} {allowed} {unit}".rstrip() + ", or unset it")]
    if number < low or (high is not None and number > high):
        return [Finding(ERROR, name, f"{name}={value} is outside the documented range {allowed} {unit}".rstrip()
                        + f" ({meaning})", f"set it within {allowed}, or unset it for the default")]
    return []


def _check_exec_timeout(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
    name = names.HCCL_EXEC_TIMEOUT
    meaning = "how long a rank waits inside a collective for the others"
    findings = _range_findings(name, value, *EXEC_TIMEOUT_RANGE_S, "s", meaning, integer=False)
    if not findings and float(value) == 0:
        findings.append(Finding(WARNING, name, f"{name}=0 disables the timeout on Atlas A2/A3: a rank that dies"
                                " mid-collective leaves the others hanging forever",
                                f"set a finite timeout such as {HCCL_DEFAULTS_S[name]:g} (the default) or"
                                f" {SUGGESTED_EXEC_TIMEOUT_S}"))
    return findings


def _check_ip(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
    name = names.HCCL_IF_IP
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return [Finding(ERROR, name, f"{name}={value!r} is not an IP address (HCCL binds the host NIC that has it)",
                        "set it to this host's IP address on the training network, or unset it")]
    if env.get(names.HCCL_SOCKET_IFNAME):
        return [Finding(NOTE, name, f"{name} and {names.HCCL_SOCKET_IFNAME} are both set; {name} takes precedence")]
    return []


def _check_ifname(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
    name = names.HCCL_SOCKET_IFNAME
    # HCCL's syntax: "eth,enp" prefixes; "=eth0,enp0" exact names; a leading "^" excludes instead.
    rest = value[1:] if value.startswith("^") else value
    exact = rest.startswith("=")
    wanted = [part for part in (rest[1:] if exact else rest).split(",") if part]
    if not wanted:
        return [Finding(ERROR, name, f"{name}={value!r} names no interface",
                        "use prefixes like eth,enp or exact names like =eth0, or unset it")]
    if value.startswith("^") or not interfaces:
        return []
    matched = [i for i in interfaces if any(i == n if exact else i.startswith(n) for n in wanted)]
    if matched:
        return []
    return [Finding(WARNING, name, f"{name}={value!r} matches none of this host's network interfaces"
                    f" ({', '.join(interfaces)}), so HCCL cannot pick a NIC from it",
                    "name an interface that exists here (see `ip addr`)")]


def _choice(name: str, allowed: Sequence[str], meaning: str, warn_on: Optional[dict[str, str]] = None) -> Check:
    def check(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
        if value not in allowed:
            return [Finding(ERROR, name, f"{name}={value!r} is not one of {', '.join(allowed)} ({meaning})",
                            f"set it to one of {', '.join(allowed)}, or unset it")]
        if warn_on and value in warn_on:
            return [Finding(WARNING, name, warn_on[value], f"unset {name} (or set it to {allowed[0]}) for training")]
        return []

    return check


def _check_alloc_conf(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
    name = names.NPU_ALLOC_CONF
    findings = []
    if env.get(names.ALLOC_CONF):
        findings.append(Finding(ERROR, name, f"{name} and {names.ALLOC_CONF} are both set; torch_npu refuses to start"
                                " the allocator", f"keep only {name}"))
    for item in value.split(","):
        key, sep, setting = item.partition(":")
        if not sep or not key.strip() or not setting.strip():
            findings.append(Finding(ERROR, name, f"{name}={value!r}: {item!r} is not a key:value pair",
                                    "write comma-separated key:value pairs, e.g. expandable_segments:True"))
        elif key.strip() == "expandable_segments" and setting.strip() not in ("True", "False"):
            findings.append(Finding(ERROR, name, f"expandable_segments:{setting.strip()} must be True or False",
                                    "use expandable_segments:True"))
    return findings


def _check_autoload(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
    if value == "1":
        return []
    return [Finding(NOTE, names.AUTOLOAD_ENV, f"{names.AUTOLOAD_ENV}={value}: `import torch` does not load torch_npu;"
                    " lightning_npu imports it itself when accelerator='npu' is used")]


def _check_rank_table(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
    """The rank table read and checked (``cluster/rank_table.py``), and against the job where the Ascend Operator's or
    ModelArts' variables say what the job is."""
    try:
        table = rank_table.load(value)
        job = None
        if pod.is_pod(env):
            ascend_pod = pod.AscendPod.from_env(env)
            job = ascend_pod.nodes, ascend_pod.npus
        elif modelarts.is_card(env):
            card = modelarts.ModelArtsCard.from_env(env)
            job = card.hosts, card.cards_per_host
        if job is not None:
            table.check_job(*job)
    except SettingError as error:
        return [Finding(ERROR, names.RANK_TABLE_FILE, error.problem.cause, error.problem.fix)]
    checked = "matches this job" if job is not None else "no cluster variables here to check it against"
    return [Finding(NOTE, names.RANK_TABLE_FILE, f"{table.describe()} ({checked})")]


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(names.VISIBLE_DEVICES_ENV, "all NPUs visible"),  # checked by the runtime's probe (diagnosis.py)
    EnvVar(names.HCCL_CONNECT_TIMEOUT, f"{HCCL_DEFAULTS_S[names.HCCL_CONNECT_TIMEOUT]:g} s", _integer_in(
        names.HCCL_CONNECT_TIMEOUT, *CONNECT_TIMEOUT_RANGE_S, "s",
        "how long ranks wait for each other while HCCL sets up links")),
    EnvVar(names.HCCL_EXEC_TIMEOUT, f"{HCCL_DEFAULTS_S[names.HCCL_EXEC_TIMEOUT]:g} s", _check_exec_timeout),
    EnvVar(names.HCCL_BUFFSIZE, f"{DEFAULT_BUFFSIZE_MB} MB", _integer_in(
        names.HCCL_BUFFSIZE, MIN_BUFFSIZE_MB, None, "MB", "the buffer each communicator allocates twice on every NPU")),
    EnvVar(names.HCCL_IF_IP, "chosen by HCCL", _check_ip),
    EnvVar(names.HCCL_SOCKET_IFNAME, "chosen by HCCL", _check_ifname),
    EnvVar(names.HCCL_IF_BASE_PORT, f"{DEFAULT_BASE_PORT}", _integer_in(
        names.HCCL_IF_BASE_PORT, *BASE_PORT_RANGE, "",
        "the first of the host ports HCCL uses to set up communicators")),
    EnvVar(names.TORCH_HCCL_ASYNC_ERROR_HANDLING, "torch_npu default", _choice(
        names.TORCH_HCCL_ASYNC_ERROR_HANDLING, ("0", "1", "2", "3"), "torch_npu's HCCL error handling mode")),
    EnvVar(names.HCCL_DETERMINISTIC, "false", _choice(
        names.HCCL_DETERMINISTIC, ("false", "true", "strict"), "deterministic reductions in HCCL")),
    EnvVar(names.NPU_ALLOC_CONF, "allocator defaults (expandable_segments:True helps against fragmentation OOM)",
           _check_alloc_conf),
    EnvVar(names.TASK_QUEUE_ENABLE, "torch_npu default", _choice(
        names.TASK_QUEUE_ENABLE, ("1", "0", "2"), "torch_npu's operator dispatch queue level")),
    EnvVar(names.ASCEND_LAUNCH_BLOCKING, "0", _choice(
        names.ASCEND_LAUNCH_BLOCKING, ("0", "1"), "synchronous operator launches, for debugging",
        {"1": f"{names.ASCEND_LAUNCH_BLOCKING}=1 runs every operator synchronously: training is much slower"})),
    EnvVar(names.AUTOLOAD_ENV, "1 (torch loads torch_npu on import)", _check_autoload),
    EnvVar(names.RANK_TABLE_FILE, "no rank table (torch_npu sets up HCCL without one)", _check_rank_table),
    EnvVar(names.SIMULATE_ENV, "off (real NPUs)"),  # checked by the runtime (diagnosis.py)
    EnvVar(names.ASCEND_HOME_PATH, "CANN environment not loaded"),  # see diagnosis.py
)


def check_environment(
    env: Mapping[str, str], interfaces: Sequence[str] = ()
) -> tuple[list[tuple[str, Optional[str], str]], list[Finding]]:
    """Rows ``(name, value or None, meaning when unset)`` for the report, and findings for bad values.

    ``interfaces`` are this host's network interface names (to check HCCL_SOCKET_IFNAME against).
    """
    rows, findings = [], []
    for var in ENV_VARS:
        value = env.get(var.name)
        rows.append((var.name, value, var.when_unset))
        if value is not None and var.check is not None:
            findings += var.check(value, env, interfaces)
    if env.get(names.HCCL_ASYNC_ERROR_HANDLING) is not None:
        findings.append(Finding(WARNING, names.HCCL_ASYNC_ERROR_HANDLING, f"{names.HCCL_ASYNC_ERROR_HANDLING} is"
                                " deprecated in torch_npu", f"rename it to {names.TORCH_HCCL_ASYNC_ERROR_HANDLING}"))
    return rows, findings + _pod_findings(env)


def _pod_findings(env: Mapping[str, str]) -> list[Finding]:
    """In an Ascend Operator pod: its variables checked, and how its processes start (``import lightning`` fails on
    the pod's list-shaped LOCAL_RANK)."""
    if not pod.is_pod(env):
        return []
    try:
        ascend_pod = pod.AscendPod.from_env(env)
    except SettingError as error:
        return [Finding(ERROR, "Ascend Operator pod", error.problem.cause, error.problem.fix)]
    return [Finding(NOTE, "Ascend Operator pod", ascend_pod.describe(),
                    "start training with `lightning-npu run train.py ...`: it starts one process per NPU from these"
                    f" variables (`python train.py` fails at `import lightning` on {names.LOCAL_RANK}="
                    f"{env[names.LOCAL_RANK]!r})")]


def check_timeouts(env: Mapping[str, str], timeout_s: Optional[float]) -> tuple[dict[str, float], list[Finding]]:
    """The collective timeouts in effect (seconds) and a warning when the process-group timeout is not above the
    HCCL ones (the rule lives in lightning_npu/timeouts.py, shared with the strategies' start-up check)."""
    process_group = default_timeout_s(env) if timeout_s is None else float(timeout_s)
    timeouts = {**hccl_timeouts_s(env), "process group": process_group, "minimum process group": minimum_timeout_s(env)}
    problem = timeout_problem(process_group, env)
    if problem is None:
        return timeouts, []
    return timeouts, [Finding(WARNING, "timeouts", problem.cause, problem.fix)]


def host_interfaces() -> list[str]:
    """This host's network interface names (empty where the OS does not say)."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
