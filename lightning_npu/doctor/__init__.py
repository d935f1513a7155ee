"""``lightning-npu doctor``'s engine: gather what this machine has, diagnose it, render the report.

- ``report``: the report and its findings (level, subject, cause, fix).
- ``cann``: finding the CANN toolkit on disk and its version.
- ``probe``: ``import torch`` and the NPUs, probed in a child process (``_probe_child.py``) so that a failing or
  crashing ``import torch`` is a diagnosis, not the doctor's death; ``device_facts``: what is read from the NPUs
  there (or here, when torch is already imported).
- ``rules``: the environment variables shown and the rules for their values; the collective timeouts.
- ``diagnosis``: findings about packages, torch, NPUs and CANN.
- ``render``: the text report.

Nothing here imports torch or Lightning (``device_facts.probe_devices`` does, inside the child); the CLI is
``lightning_npu/cli/doctor.py``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path
from typing import Optional

from lightning_npu.doctor import cann, probe, rules
from lightning_npu.doctor.diagnosis import diagnose
from lightning_npu.doctor.report import Report


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
    searched = [str(path) for path in cann.cann_candidates(env)]
    found = cann.find_cann(env)
    torch_import, devices = probe.gather_devices(env)
    environment, env_findings = rules.check_environment(env, rules.host_interfaces())
    timeouts, timeout_findings = rules.check_timeouts(env, timeout_s)
    report = Report(versions, found, searched, torch_import, devices, environment, timeouts)
    report.findings = diagnose(report, env) + env_findings + timeout_findings
    return report


def installed_version(distribution: str) -> Optional[str]:
    """The version of an installed distribution from its metadata, without importing it (None if absent)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
