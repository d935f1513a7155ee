"""The doctor's report as text: versions, devices, environment, timeouts, then each problem with its fix."""

from __future__ import annotations

from typing import Mapping

from lightning_npu.doctor.report import ERROR, LEVELS, WARNING, Report
from lightning_npu.facts.env import AUTOLOAD_ENV, TORCH_HCCL_DEBUG_INFO_TEMP_FILE
from lightning_npu.timeouts import FLIGHT_RECORDER_ENV, flight_recorder_exports


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

    findings = sorted(report.findings, key=lambda f: LEVELS.index(f.level))
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
    prefix = env.get(TORCH_HCCL_DEBUG_INFO_TEMP_FILE, FLIGHT_RECORDER_ENV[TORCH_HCCL_DEBUG_INFO_TEMP_FILE])
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
        again = "the same" if status["without_autoload"] == status["error"] else status["without_autoload"]
        rows["import torch"] += f" (with {AUTOLOAD_ENV}=0: {again})"
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
        rows["NPUs"] = f"none usable: {facts['cause']}"
    simulated = facts["simulated_devices"]
    rows["simulation"] = f"on: {simulated} simulated NPU(s) on the CPU" if simulated else "off"
    return rows


def _rows(values: Mapping[str, str]) -> list[str]:
    width = max(len(name) for name in values)
    return [f"  {name:<{width}}  {value}" for name, value in values.items()]
