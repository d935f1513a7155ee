"""The findings drawn from a report's facts: packages, ``import torch``, the NPUs, CANN. Each names the cause and
the fix; the runtime's probe hands both over as separate fields, so nothing here parses a message."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from lightning_npu.doctor.report import ERROR, NOTE, WARNING, CannInstall, Finding, Report
from lightning_npu.facts.devices import DRIVER_HINT
from lightning_npu.facts.env import ASCEND_HOME_PATH, AUTOLOAD_ENV, SIMULATE_ENV, VISIBLE_DEVICES_ENV

#: The default location of CANN's set_env.sh, for a machine where no CANN was found.
DEFAULT_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"


def diagnose(report: Report, env: Mapping[str, str]) -> list[Finding]:
    """Every finding about the packages, torch, the NPUs and CANN (the environment rules are ``rules.py``'s)."""
    return _package_findings(report) + _device_findings(report) + _cann_findings(report, env)


def _package_findings(report: Report) -> list[Finding]:
    findings = [] if report.torch_import["ok"] else _torch_findings(report)
    if report.versions["lightning"] is None:
        findings.append(Finding(ERROR, "lightning", "Lightning is not installed",
                                "`pip install 'lightning>=2.6,<2.7'`"))
    return findings


def _torch_findings(report: Report) -> list[Finding]:
    status = report.torch_import
    torch_version = report.versions["torch"]
    if torch_version is None:
        return [Finding(ERROR, "torch", "torch is not installed", "`pip install lightning-npu` (it installs torch),"
                        " or `pip install torch` matching your torch_npu release")]
    reinstall = f"reinstall torch: `pip install --force-reinstall torch=={torch_version}`"
    autoload_off = (f"Meanwhile `export {AUTOLOAD_ENV}=0` lets `import torch` work without torch_npu"
                    " (accelerator='npu' stays unavailable).")
    if status.get("crash") and status.get("autoload"):
        return [Finding(
            ERROR, "import torch",
            f"`import torch` crashes: {status['error']}; torch >= 2.5 loads the installed torch_npu on import (its"
            f" `torch.backends` entry point), and with {AUTOLOAD_ENV}=0 torch imports, so loading torch_npu crashes",
            f"a driver, CANN and torch_npu that do not belong together, usually: {DRIVER_HINT}, then"
            f" {_source_cann(report.cann)} for the CANN your torch_npu {report.versions['torch_npu']} was built for."
            f" {autoload_off}",
        )]
    if status.get("crash"):
        return [Finding(ERROR, "import torch", f"`import torch` crashes: {status['error']}",
                        "a native library torch loads is broken or foreign: check LD_PRELOAD and LD_LIBRARY_PATH,"
                        f" then {reinstall}")]
    if not status.get("autoload"):
        return [Finding(ERROR, "import torch", f"`import torch` fails: {status['error']}", reinstall)]
    why = f": {status['cause']}" if status.get("cause") else ""
    return [Finding(
        ERROR, "import torch",
        f"`import torch` fails: {status['error']} torch >= 2.5 loads the installed torch_npu on import (its"
        f" `torch.backends` entry point), and loading torch_npu failed{why}",
        f"make torch_npu loadable (see the NPU problem below; usually {_source_cann(report.cann)} before starting"
        f" Python). {autoload_off}",
    )]


def _source_cann(cann: Optional[CannInstall]) -> str:
    if cann is None:
        return f"install CANN >= 8 and `source` its set_env.sh (default: {DEFAULT_SET_ENV})"
    if cann.set_env:
        return f"`source {cann.set_env}`"
    return f"`source` the set_env.sh of the CANN at {cann.home}"


def _problem(level: str, subject: str, problem: Mapping[str, Any]) -> Finding:
    return Finding(level, subject, problem["cause"], problem["fix"])


def _device_findings(report: Report) -> list[Finding]:
    facts = report.devices
    if facts is None:
        return []
    if facts.get("probe_error"):
        return [Finding(ERROR, "NPU", f"the NPU probe failed: {facts['probe_error']}", DRIVER_HINT)]
    findings = []
    if facts["simulate_problem"]:
        findings.append(_problem(ERROR, SIMULATE_ENV, facts["simulate_problem"]))
    visible = facts["visible_devices_problem"]
    if visible:
        findings.append(_problem(ERROR, VISIBLE_DEVICES_ENV, visible))
    simulated = facts["simulated_devices"]
    if not facts["available"]:
        if visible is None or facts["cause"] != visible["cause"]:  # the probe stops at a bad visible-devices value
            if simulated:
                findings.append(Finding(NOTE, "NPU", f"no real NPU is usable ({facts['cause']}); accelerator='npu'"
                                        f" runs {simulated} simulated NPU(s) on the CPU because"
                                        f" {SIMULATE_ENV}={simulated}", facts["fix"]))
            else:
                findings.append(Finding(ERROR, "NPU", facts["cause"], facts["fix"]))
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
    home = env.get(ASCEND_HOME_PATH)
    if home and (report.cann is None or Path(report.cann.home) != Path(home).expanduser()):
        findings.append(Finding(WARNING, "CANN", f"{ASCEND_HOME_PATH}={home} holds no CANN toolkit (no"
                                " <arch>-linux/ascend_toolkit_install.info or version.cfg)",
                                "source the set_env.sh of the CANN you installed, or fix the path"))
    npu_usable = report.devices is not None and report.devices.get("available")
    if report.cann is not None and not home and report.versions["torch_npu"] and not npu_usable:
        findings.append(Finding(WARNING, "CANN", f"CANN {report.cann.version} is installed at {report.cann.home} but"
                                f" its environment is not loaded in this shell ({ASCEND_HOME_PATH} is unset)",
                                _source_cann(report.cann)))
    return findings
