"""Check that this machine can train on Ascend NPUs with lightning-npu, and say what to fix.

Reports the Python, torch, torch_npu, CANN and Lightning versions; whether NPUs are usable (count, chip, bf16
support, memory); and the HCCL, runtime and allocator environment variables in effect. Every problem is printed
with its cause and its fix.

exit status:
  0  accelerator="npu" can run here -- real NPUs were found, or LIGHTNING_NPU_SIMULATE turns on the simulated
     NPU -- and no setting is invalid (warnings and notes do not change the status)
  1  at least one error
  2  usage error

It works where `import torch` fails (torch >= 2.5 autoloads an installed torch_npu, which fails without CANN):
this module never imports torch. When torch is already imported in this process the devices are probed here;
otherwise a child process probes them, and when `import torch` fails there because of autoloading, a second
child retries with TORCH_DEVICE_BACKEND_AUTOLOAD=0 to find the underlying cause.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import ipaddress
import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from lightning_npu.cli._probe_child import MARKER as CHILD_MARKER
from lightning_npu.timeouts import FLIGHT_RECORDER_ENV, default_timeout_s, flight_recorder_exports, hccl_timeouts_s
from lightning_npu.timeouts import minimum_timeout_s, timeout_problem

ERROR, WARNING, NOTE = "error", "warning", "note"
AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"
#: How torch (>= 2.5, torch/__init__.py _import_device_backends) words a failing `torch.backends` entry point.
AUTOLOAD_FAILURE = "Failed to load the backend extension"
# The runtime's names, repeated because importing lightning_npu.runtime imports torch (a test keeps them equal).
SIMULATE_ENV = "LIGHTNING_NPU_SIMULATE"
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"

#: Where CANN's set_env.sh points (ASCEND_HOME_PATH) and where the installer puts it, in search order.
CANN_HOME_ENVS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
DEFAULT_CANN_HOMES = (
    "/usr/local/Ascend/ascend-toolkit/latest",  # CANN <= 8.3 (root install)
    "/usr/local/Ascend/cann",  # CANN >= 8.5 (root install)
    "~/Ascend/ascend-toolkit/latest",  # non-root installs
    "~/Ascend/cann",
)
CHILD_SCRIPT = Path(__file__).with_name("_probe_child.py")
CHILD_TIMEOUT_S = 180


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="the process-group timeout your run sets (strategy timeout, seconds), checked against"
                             " HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT; default: the strategies' default")
    parser.add_argument("--hang-diagnostics", action="store_true",
                        help="also print the exports that turn on torch_npu's HCCL flight recorder and CANN logs")


def run(args: argparse.Namespace) -> int:
    report = build_report(timeout_s=args.timeout)
    if args.json:
        data = report.to_dict()
        if args.hang_diagnostics:
            data["hang_diagnostics"] = {name: os.environ.get(name, value) for name, value in FLIGHT_RECORDER_ENV.items()}
        print(json.dumps(data, indent=2))
    else:
        print(render(report) + (render_hang_diagnostics(os.environ) if args.hang_diagnostics else ""))
    return report.exit_code


# ------------------------------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class Finding:
    """One thing the user should know: ``level`` is ``error`` (fails the check), ``warning`` or ``note``."""

    level: str
    subject: str
    cause: str
    fix: Optional[str] = None


@dataclass(frozen=True)
class CannInstall:
    """A CANN toolkit found on disk: its home (what ASCEND_HOME_PATH points to), version and set_env.sh."""

    home: str
    version: Optional[str]
    version_file: Optional[str]
    set_env: Optional[str]


@dataclass
class Report:
    versions: dict[str, Optional[str]]
    cann: Optional[CannInstall]
    cann_searched: list[str]
    torch_import: dict[str, Any]
    devices: Optional[dict[str, Any]]
    environment: list[tuple[str, Optional[str], str]]
    timeouts: dict[str, float] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if any(finding.level == ERROR for finding in self.findings) else 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["environment"] = [{"name": n, "value": v, "when_unset": d} for n, v, d in self.environment]
        data["exit_code"] = self.exit_code
        return data


def build_report(timeout_s: Optional[float] = None) -> Report:
    """Gather everything about this process's environment and diagnose it. ``timeout_s``: the process-group
    timeout to check against the HCCL timeouts (None: the strategies' default)."""
    # A snapshot: probing in this process may import a torch_npu that changes os.environ as it fails.
    env = dict(os.environ)
    package_dir = Path(__file__).resolve().parents[1]
    versions = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": installed_version("torch"),
        "torch_npu": installed_version("torch-npu"),
        "lightning": installed_version("lightning"),
        "lightning-npu": installed_version("lightning-npu") or f"not installed (running from {package_dir})",
    }
    searched = [str(path) for path in cann_candidates(env)]
    cann = find_cann(env)
    torch_import, devices = gather_devices(env)
    environment, env_findings = check_environment(env, host_interfaces())
    timeouts, timeout_findings = check_timeouts(env, timeout_s)
    report = Report(versions, cann, searched, torch_import, devices, environment, timeouts)
    report.findings = (_package_findings(report) + _device_findings(report) + _cann_findings(report, env) + env_findings
                       + timeout_findings)
    return report


def check_timeouts(env: Mapping[str, str], timeout_s: Optional[float]) -> tuple[dict[str, float], list[Finding]]:
    """The collective timeouts in effect (seconds) and a warning when the process-group timeout is not above the
    HCCL ones (the rule lives in lightning_npu/timeouts.py, shared with the strategies' start-up check)."""
    process_group = default_timeout_s(env) if timeout_s is None else float(timeout_s)
    timeouts = {**hccl_timeouts_s(env), "process group": process_group, "minimum process group": minimum_timeout_s(env)}
    problem = timeout_problem(process_group, env)
    if problem is None:
        return timeouts, []
    cause, fix = problem.split("; set ", 1)
    return timeouts, [Finding(WARNING, "timeouts", cause, "set " + fix)]


def installed_version(distribution: str) -> Optional[str]:
    """The version of an installed distribution from its metadata, without importing it (None if absent)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------------- CANN


def cann_candidates(env: Mapping[str, str]) -> list[Path]:
    """Directories that may hold a CANN toolkit, in search order, without duplicates."""
    seen: list[Path] = []
    for raw in [env.get(name) for name in CANN_HOME_ENVS] + list(DEFAULT_CANN_HOMES):
        if raw:
            path = Path(raw).expanduser()
            if path not in seen:
                seen.append(path)
    return seen


def find_cann(env: Mapping[str, str]) -> Optional[CannInstall]:
    """The first candidate directory that holds a CANN toolkit with a readable version, or None."""
    for home in cann_candidates(env):
        version, source = read_cann_version(home)
        if version is not None:
            set_env = next((p for p in (home / "set_env.sh", home.parent / "set_env.sh") if p.is_file()), None)
            return CannInstall(str(home), version, str(source), str(set_env) if set_env else None)
    return None


def read_cann_version(home: Path) -> tuple[Optional[str], Optional[Path]]:
    """CANN's version and the file it came from, read the ways Ascend documents.

    ``<home>/<arch>-linux/ascend_toolkit_install.info`` holds ``version=8.0.RC2``; ``<home>/version.cfg`` holds
    ``toolkit_running_version=[7.3.0.1.231:8.0.RC2]`` (inner version, then the release after the colon).
    """
    infos = [home / f"{platform.machine()}-linux" / "ascend_toolkit_install.info"]
    if home.is_dir():
        infos += sorted(home.glob("*-linux/ascend_toolkit_install.info"))
    for info in infos:
        if info.is_file():
            version = _key_values(info).get("version")
            if version:
                return version, info
    cfg = home / "version.cfg"
    if cfg.is_file():
        values = _key_values(cfg)
        for key in ("toolkit_running_version", "runtime_running_version"):
            match = re.fullmatch(r"\[([^:\]]*):([^\]]+)\]", values.get(key, ""))
            if match:
                return match.group(2), cfg
    return None, None


def _key_values(path: Path) -> dict[str, str]:
    values = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return values
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            values[key.strip()] = value.strip()
    return values


# ------------------------------------------------------------------------------------------------- devices


def gather_devices(env: Mapping[str, str]) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """How ``import torch`` fares, and the device facts from ``probe_devices`` (None if no process could run it)."""
    if "torch" in sys.modules:
        return {"ok": True, "where": "this process"}, _guarded(probe_devices)
    first = _run_child(env)
    if first.get("torch_error") is None:
        return {"ok": True, "where": "child process"}, first.get("facts")
    torch_import = {
        "ok": False,
        "error": first["torch_error"],
        "cause": first.get("torch_error_cause"),
        "autoload": AUTOLOAD_FAILURE in first["torch_error"],
    }
    if not torch_import["autoload"]:
        return torch_import, None
    retry = _run_child({**env, AUTOLOAD_ENV: "0"})
    torch_import["without_autoload"] = "ok" if retry.get("torch_error") is None else retry["torch_error"]
    return torch_import, retry.get("facts")


def probe_devices() -> dict[str, Any]:
    """NPU facts from this process's torch through lightning_npu's runtime (JSON-serialisable). Imports torch."""
    import torch

    from lightning_npu.runtime.probe import probe_npu, visible_devices_problem
    from lightning_npu.runtime.simulated import simulated_count

    facts: dict[str, Any] = {
        "torch_version": torch.__version__,
        "visible_devices_problem": visible_devices_problem(os.environ.get(VISIBLE_DEVICES_ENV)),
        "simulated_devices": 0,
        "simulate_problem": None,
    }
    try:
        facts["simulated_devices"] = simulated_count(os.environ.get(SIMULATE_ENV))
    except ValueError as error:
        facts["simulate_problem"] = str(error)
    result = probe_npu()
    facts.update(available=result.available, device_count=result.device_count, reason=result.reason)
    if result.available:
        from lightning_npu.runtime.npu import NPURuntime

        runtime = NPURuntime()
        chip = runtime.chip(0)
        facts.update(
            device_names=[runtime.device_name(index) for index in range(result.device_count)],
            supports_bf16=chip.supports_bf16,
            peak_bf16_tflops=None if chip.peak_bf16_flops is None else chip.peak_bf16_flops / 1e12,
            memory_gib=runtime.total_memory(runtime.device(0)) / 1024**3,
            hccl_backend=torch.distributed.is_available()
            and torch.distributed.Backend.default_device_backend_map.get("npu") == "hccl",
        )
    return facts


def _guarded(probe: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return probe()
    except Exception as error:  # noqa: BLE001 -- a crashing probe is itself the diagnosis
        return {"probe_error": f"{type(error).__name__}: {error}"}


def _run_child(env: Mapping[str, str]) -> dict[str, Any]:
    """Run ``_probe_child.py`` in a fresh interpreter with ``env``; its last marked stdout line is the result."""
    try:
        proc = subprocess.run(
            [sys.executable, str(CHILD_SCRIPT)], env=dict(env), capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"torch_error": None, "facts": {"probe_error": f"the device probe did not finish in {CHILD_TIMEOUT_S} s"
                                               " (a hung driver, or devices held by another process?)"}}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(CHILD_MARKER):
            return json.loads(line[len(CHILD_MARKER):])
    last = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), f"exit status {proc.returncode}")
    return {"torch_error": None, "facts": {"probe_error": f"the device probe crashed: {last}"}}


# ------------------------------------------------------------------------------------------------- environment


@dataclass(frozen=True)
class EnvVar:
    """An environment variable the doctor shows; ``check(value)`` returns findings for a bad value."""

    name: str
    when_unset: str
    check: Optional[Callable[[str, Mapping[str, str], Sequence[str]], list[Finding]]] = None


def _integer_in(name: str, low: int, high: Optional[int], unit: str, meaning: str) -> Callable[..., list[Finding]]:
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
    meaning = "how long a rank waits inside a collective for the others"
    findings = _range_findings("HCCL_EXEC_TIMEOUT", value, 0, 2147483647, "s", meaning, integer=False)
    if not findings and float(value) == 0:
        findings.append(Finding(WARNING, "HCCL_EXEC_TIMEOUT", "HCCL_EXEC_TIMEOUT=0 disables the timeout on Atlas A2/A3:"
                                " a rank that dies mid-collective leaves the others hanging forever",
                                "set a finite timeout such as 1836 (the default) or 3600"))
    return findings


def _check_ip(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return [Finding(ERROR, "HCCL_IF_IP", f"HCCL_IF_IP={value!r} is not an IP address (HCCL binds the host NIC"
                        " that has it)", "set it to this host's IP address on the training network, or unset it")]
    if env.get("HCCL_SOCKET_IFNAME"):
        return [Finding(NOTE, "HCCL_IF_IP", "HCCL_IF_IP and HCCL_SOCKET_IFNAME are both set;"
                        " HCCL_IF_IP takes precedence")]
    return []


def _check_ifname(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
    # HCCL's syntax: "eth,enp" prefixes; "=eth0,enp0" exact names; a leading "^" excludes instead.
    rest = value[1:] if value.startswith("^") else value
    exact = rest.startswith("=")
    names = [name for name in (rest[1:] if exact else rest).split(",") if name]
    if not names:
        return [Finding(ERROR, "HCCL_SOCKET_IFNAME", f"HCCL_SOCKET_IFNAME={value!r} names no interface",
                        "use prefixes like eth,enp or exact names like =eth0, or unset it")]
    if value.startswith("^") or not interfaces:
        return []
    matched = [i for i in interfaces if any(i == n if exact else i.startswith(n) for n in names)]
    if matched:
        return []
    return [Finding(WARNING, "HCCL_SOCKET_IFNAME", f"HCCL_SOCKET_IFNAME={value!r} matches none of this host's network"
                    f" interfaces ({', '.join(interfaces)}), so HCCL cannot pick a NIC from it",
                    "name an interface that exists here (see `ip addr`)")]


def _choice(
    name: str, allowed: Sequence[str], meaning: str, warn_on: Optional[dict[str, str]] = None
) -> Callable[..., list[Finding]]:
    def check(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
        if value not in allowed:
            return [Finding(ERROR, name, f"{name}={value!r} is not one of {', '.join(allowed)} ({meaning})",
                            f"set it to one of {', '.join(allowed)}, or unset it")]
        if warn_on and value in warn_on:
            return [Finding(WARNING, name, warn_on[value], f"unset {name} (or set it to {allowed[0]}) for training")]
        return []

    return check


def _check_alloc_conf(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
    findings = []
    if env.get("PYTORCH_ALLOC_CONF"):
        findings.append(Finding(ERROR, "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF and PYTORCH_ALLOC_CONF are"
                                " both set; torch_npu refuses to start the allocator",
                                "keep only PYTORCH_NPU_ALLOC_CONF"))
    for item in value.split(","):
        key, sep, setting = item.partition(":")
        if not sep or not key.strip() or not setting.strip():
            findings.append(Finding(ERROR, "PYTORCH_NPU_ALLOC_CONF", f"PYTORCH_NPU_ALLOC_CONF={value!r}: {item!r} is"
                                    " not a key:value pair", "write comma-separated key:value pairs, e.g."
                                    " expandable_segments:True"))
        elif key.strip() == "expandable_segments" and setting.strip() not in ("True", "False"):
            findings.append(Finding(ERROR, "PYTORCH_NPU_ALLOC_CONF", f"expandable_segments:{setting.strip()} must be"
                                    " True or False", "use expandable_segments:True"))
    return findings


def _check_autoload(value: str, env: Mapping[str, str], interfaces: Sequence[str]) -> list[Finding]:
    if value == "1":
        return []
    return [Finding(NOTE, AUTOLOAD_ENV, f"{AUTOLOAD_ENV}={value}: `import torch` does not load torch_npu;"
                    " lightning_npu imports it itself when accelerator='npu' is used")]


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(VISIBLE_DEVICES_ENV, "all NPUs visible"),  # checked by the runtime's probe (see _device_findings)
    EnvVar("HCCL_CONNECT_TIMEOUT", "120 s", _integer_in(
        "HCCL_CONNECT_TIMEOUT", 120, 7200, "s", "how long ranks wait for each other while HCCL sets up links")),
    EnvVar("HCCL_EXEC_TIMEOUT", "1836 s", _check_exec_timeout),
    EnvVar("HCCL_BUFFSIZE", "200 MB", _integer_in(
        "HCCL_BUFFSIZE", 1, None, "MB", "the buffer each communicator allocates twice on every NPU")),
    EnvVar("HCCL_IF_IP", "chosen by HCCL", _check_ip),
    EnvVar("HCCL_SOCKET_IFNAME", "chosen by HCCL", _check_ifname),
    EnvVar("HCCL_IF_BASE_PORT", "60000", _integer_in(
        "HCCL_IF_BASE_PORT", 1024, 65520, "", "the first of the host ports HCCL uses to set up communicators")),
    EnvVar("TORCH_HCCL_ASYNC_ERROR_HANDLING", "torch_npu default", _choice(
        "TORCH_HCCL_ASYNC_ERROR_HANDLING", ("0", "1", "2", "3"), "torch_npu's HCCL error handling mode")),
    EnvVar("HCCL_DETERMINISTIC", "false", _choice(
        "HCCL_DETERMINISTIC", ("false", "true", "strict"), "deterministic reductions in HCCL")),
    EnvVar("PYTORCH_NPU_ALLOC_CONF", "allocator defaults (expandable_segments:True helps against fragmentation OOM)",
           _check_alloc_conf),
    EnvVar("TASK_QUEUE_ENABLE", "torch_npu default", _choice(
        "TASK_QUEUE_ENABLE", ("1", "0", "2"), "torch_npu's operator dispatch queue level")),
    EnvVar("ASCEND_LAUNCH_BLOCKING", "0", _choice(
        "ASCEND_LAUNCH_BLOCKING", ("0", "1"), "synchronous operator launches, for debugging",
        {"1": "ASCEND_LAUNCH_BLOCKING=1 runs every operator synchronously: training is much slower"})),
    EnvVar(AUTOLOAD_ENV, "1 (torch loads torch_npu on import)", _check_autoload),
    EnvVar(SIMULATE_ENV, "off (real NPUs)"),  # checked by the runtime (see _device_findings)
    EnvVar("ASCEND_HOME_PATH", "CANN environment not loaded"),  # see _cann_findings
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
    if env.get("HCCL_ASYNC_ERROR_HANDLING") is not None:
        findings.append(Finding(WARNING, "HCCL_ASYNC_ERROR_HANDLING", "HCCL_ASYNC_ERROR_HANDLING is deprecated in"
                                " torch_npu", "rename it to TORCH_HCCL_ASYNC_ERROR_HANDLING"))
    return rows, findings


def host_interfaces() -> list[str]:
    """This host's network interface names (empty where the OS does not say)."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


# ------------------------------------------------------------------------------------------------- diagnosis


def _package_findings(report: Report) -> list[Finding]:
    findings = [] if report.torch_import["ok"] else _torch_findings(report)
    if report.versions["lightning"] is None:
        findings.append(Finding(ERROR, "lightning", "Lightning is not installed",
                                "`pip install 'lightning>=2.6,<2.7'`"))
    return findings


def _torch_findings(report: Report) -> list[Finding]:
    status = report.torch_import
    if report.versions["torch"] is None:
        return [Finding(ERROR, "torch", "torch is not installed", "`pip install lightning-npu` (it installs torch),"
                        " or `pip install torch` matching your torch_npu release")]
    if not status.get("autoload"):
        return [Finding(ERROR, "import torch", f"`import torch` fails: {status['error']}",
                        f"reinstall torch: `pip install --force-reinstall torch=={report.versions['torch']}`")]
    why = f": {status['cause']}" if status.get("cause") else ""
    return [Finding(
        ERROR, "import torch",
        f"`import torch` fails: {status['error']} torch >= 2.5 loads the installed torch_npu on import (its"
        f" `torch.backends` entry point), and loading torch_npu failed{why}",
        f"make torch_npu loadable (see the NPU problem below; usually {_source_cann(report.cann)} before starting"
        f" Python). Meanwhile `export {AUTOLOAD_ENV}=0` lets `import torch` work without torch_npu"
        " (accelerator='npu' stays unavailable).",
    )]


def _source_cann(cann: Optional[CannInstall]) -> str:
    if cann is None:
        return "install CANN >= 8 and `source` its set_env.sh (default: /usr/local/Ascend/ascend-toolkit/set_env.sh)"
    if cann.set_env:
        return f"`source {cann.set_env}`"
    return f"`source` the set_env.sh of the CANN at {cann.home}"


def _device_findings(report: Report) -> list[Finding]:
    facts = report.devices
    if facts is None:
        return []
    if facts.get("probe_error"):
        return [Finding(ERROR, "NPU", f"the NPU probe failed: {facts['probe_error']}",
                        "check the driver with `npu-smi info`")]
    findings = []
    if facts["simulate_problem"]:
        findings.append(Finding(ERROR, SIMULATE_ENV, *split_reason(facts["simulate_problem"])))
    visible = facts["visible_devices_problem"]
    if visible:
        findings.append(Finding(ERROR, VISIBLE_DEVICES_ENV, *split_reason(visible)))
    simulated = facts["simulated_devices"]
    if not facts["available"]:
        if facts["reason"] != visible:
            cause, fix = split_reason(facts["reason"])
            if simulated:
                findings.append(Finding(NOTE, "NPU", f"no real NPU is usable ({cause}); accelerator='npu' runs"
                                        f" {simulated} simulated NPU(s) on the CPU because {SIMULATE_ENV}={simulated}",
                                        fix))
            else:
                findings.append(Finding(ERROR, "NPU", cause, fix))
        return findings
    if simulated:
        findings.append(Finding(WARNING, SIMULATE_ENV, f"{SIMULATE_ENV}={simulated} makes accelerator='npu' run on the"
                                f" CPU although {facts['device_count']} NPU(s) are available", f"unset {SIMULATE_ENV}"))
    chip = facts["device_names"][0]
    if not facts["supports_bf16"]:
        findings.append(Finding(WARNING, "bf16", f"{chip} has no bf16 units: precision='bf16-mixed' will fail",
                                "use precision='16-mixed'"))
    elif facts["peak_bf16_tflops"] is None:
        findings.append(Finding(NOTE, "MFU", f"no published bf16 peak is known for {chip}, so MFU is not reported"))
    if not facts["hccl_backend"]:
        findings.append(Finding(WARNING, "HCCL", "torch_npu imported but the 'hccl' process-group backend is not"
                                " registered for npu devices: multi-NPU strategies will fail",
                                "reinstall torch_npu for this torch release"))
    return findings


def _cann_findings(report: Report, env: Mapping[str, str]) -> list[Finding]:
    findings = []
    home = env.get("ASCEND_HOME_PATH")
    if home and (report.cann is None or Path(report.cann.home) != Path(home).expanduser()):
        findings.append(Finding(WARNING, "CANN", f"ASCEND_HOME_PATH={home} holds no CANN toolkit (no"
                                " <arch>-linux/ascend_toolkit_install.info or version.cfg)",
                                "source the set_env.sh of the CANN you installed, or fix the path"))
    npu_usable = report.devices is not None and report.devices.get("available")
    if report.cann is not None and not home and report.versions["torch_npu"] and not npu_usable:
        findings.append(Finding(WARNING, "CANN", f"CANN {report.cann.version} is installed at {report.cann.home} but"
                                " its environment is not loaded in this shell (ASCEND_HOME_PATH is unset)",
                                _source_cann(report.cann)))
    return findings


def split_reason(reason: str) -> tuple[str, Optional[str]]:
    """Split the runtime's "<cause>; <fix>" messages at the first "; " outside brackets and backticks."""
    depth, quoted = 0, False
    for index, char in enumerate(reason):
        if char == "`":
            quoted = not quoted
        elif char in "([{" and not quoted:
            depth += 1
        elif char in ")]}" and not quoted:
            depth -= 1
        elif reason.startswith("; ", index) and depth == 0 and not quoted:
            return reason[:index], reason[index + 2:]
    return reason, None


# ------------------------------------------------------------------------------------------------- rendering


def render(report: Report) -> str:
    """The report as text: versions, devices, environment, then each problem with its cause and fix."""
    out = ["lightning-npu doctor", "", "Versions"]
    versions = dict(report.versions)
    if report.cann is not None:
        versions["CANN"] = f"{report.cann.version} ({report.cann.home})"
    else:
        versions["CANN"] = f"not found (looked in {', '.join(report.cann_searched)})"
    out += _rows({name: value or "not installed" for name, value in versions.items()})

    out += ["", "Devices"]
    out += _rows(_device_rows(report))

    out += ["", "Environment"]
    out += _rows({name: f"(unset: {unset})" if value is None else value for name, value, unset in report.environment})

    if report.timeouts:
        out += ["", "Collective timeouts (s)"]
        out += _rows({name: f"{value:g}" for name, value in report.timeouts.items()})

    order = {ERROR: 0, WARNING: 1, NOTE: 2}
    findings = sorted(report.findings, key=lambda f: order[f.level])
    out += ["", "Problems" if findings else "Problems: none"]
    for finding in findings:
        out.append(f"  {finding.level.upper():<8} {finding.subject}: {finding.cause}")
        if finding.fix:
            out.append(f"  {'':<8} fix: {finding.fix}")
    errors = sum(f.level == ERROR for f in findings)
    warnings = sum(f.level == WARNING for f in findings)
    verdict = "Ready" if report.exit_code == 0 else "Not ready"
    out += ["", f"{verdict}: {errors} error(s), {warnings} warning(s) (exit status {report.exit_code})."]
    return "\n".join(out)


def render_hang_diagnostics(env: Mapping[str, str]) -> str:
    """The exports that turn on torch_npu's HCCL flight recorder (and CANN's logs), for a run that hangs."""
    prefix = env.get("TORCH_HCCL_DEBUG_INFO_TEMP_FILE", FLIGHT_RECORDER_ENV["TORCH_HCCL_DEBUG_INFO_TEMP_FILE"])
    return "\n".join([
        "", "", "Hang diagnostics: export these in the job script before launching, on every node",
        flight_recorder_exports(env),
        f"On a collective timeout each rank writes its last collectives to {prefix}<rank>; the rank whose last",
        "sequence number is behind the others is the one that stalled (its stack is in the dump).",
    ])


def _device_rows(report: Report) -> dict[str, str]:
    status = report.torch_import
    rows = {"import torch": f"ok ({status['where']})" if status["ok"] else f"FAILS: {status['error']}"}
    if not status["ok"] and "without_autoload" in status:
        rows["import torch"] += f" (with {AUTOLOAD_ENV}=0: {status['without_autoload']})"
    facts = report.devices
    if facts is None:
        rows["NPUs"] = "not probed (torch cannot be imported)"
        return rows
    if facts.get("probe_error"):
        rows["NPUs"] = f"probe failed: {facts['probe_error']}"
        return rows
    if facts["available"]:
        names = facts["device_names"]
        kinds = ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
        peak = facts["peak_bf16_tflops"]
        rows["NPUs"] = kinds
        rows["bf16"] = "supported" if facts["supports_bf16"] else "not supported (fp16 only)"
        rows["peak"] = f"{peak:.1f} TFLOP/s bf16 per chip" if peak is not None else "unknown for this chip"
        rows["memory"] = f"{facts['memory_gib']:.1f} GiB per NPU"
        rows["HCCL"] = "registered for npu" if facts["hccl_backend"] else "NOT registered"
    else:
        rows["NPUs"] = f"none usable: {split_reason(facts['reason'])[0]}"
    simulated = facts["simulated_devices"]
    rows["simulation"] = f"on: {simulated} simulated NPU(s) on the CPU" if simulated else "off"
    return rows


def _rows(values: Mapping[str, str]) -> list[str]:
    width = max(len(name) for name in values)
    return [f"  {name:<{width}}  {value}" for name, value in values.items()]
