"""How ``import torch`` fares and what the NPUs are, found without importing torch in the doctor's process.

When torch is already imported here (the doctor called from Python) the devices are probed in this process;
otherwise ``_probe_child.py`` probes them in a fresh interpreter, so that an ``import torch`` that raises -- or
kills its process with a signal (a broken driver or CANN library) -- becomes a diagnosis. When ``import torch``
fails because torch >= 2.5 autoloads torch_npu, or crashes, a second child retries with
TORCH_DEVICE_BACKEND_AUTOLOAD=0 to tell torch_npu's part from torch's.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from lightning_npu.doctor._probe_child import IMPORT_TORCH, MARKER, STAGE_MARKER
from lightning_npu.doctor.device_facts import probe_devices
from lightning_npu.facts.env import AUTOLOAD_ENV

#: How torch (>= 2.5, torch/__init__.py _import_device_backends) words a failing `torch.backends` entry point.
AUTOLOAD_FAILURE = "Failed to load the backend extension"
CHILD_SCRIPT = Path(__file__).with_name("_probe_child.py")
#: How long the child may take to import torch and count the devices before it counts as hung (seconds).
CHILD_TIMEOUT_S = 180
#: faulthandler's line for a Python frame: File "<path>", line <n> in <function>.
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def gather_devices(env: Mapping[str, str]) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """How ``import torch`` fares (``ok``, else ``error``, ``cause``, ``crash``: the signal name or None,
    ``autoload``: whether torch_npu's autoload is to blame), and the device facts from ``probe_devices`` (None
    if no process could run it)."""
    if "torch" in sys.modules:
        return {"ok": True, "where": "this process"}, _guarded(probe_devices)
    first = run_child(env)
    if first.get("torch_error") is None:
        return {"ok": True, "where": "child process"}, first.get("facts")
    crash = first.get("torch_crash")
    torch_import = {
        "ok": False,
        "error": first["torch_error"],
        "cause": first.get("torch_error_cause"),
        "crash": crash,
        "autoload": AUTOLOAD_FAILURE in first["torch_error"],
    }
    # A crash says nothing about torch_npu's part, so it is retried too (unless autoload is already off).
    if not torch_import["autoload"] and not (crash and env.get(AUTOLOAD_ENV) != "0"):
        return torch_import, None
    retry = run_child({**env, AUTOLOAD_ENV: "0"})
    torch_import["without_autoload"] = "ok" if retry.get("torch_error") is None else retry["torch_error"]
    torch_import["autoload"] = torch_import["autoload"] or retry.get("torch_error") is None
    return torch_import, retry.get("facts")


def _guarded(probe: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return probe()
    except Exception as error:  # noqa: BLE001 -- a crashing probe is itself the diagnosis
        return {"probe_error": f"{type(error).__name__}: {error}"}


def run_child(env: Mapping[str, str]) -> dict[str, Any]:
    """Run ``_probe_child.py`` in a fresh interpreter with ``env``; its marked stdout line is the result. A child
    that dies without one is described by how it ended (signal or status), the stage it was in, and the Python
    frame faulthandler names."""
    try:
        proc = subprocess.run(
            [sys.executable, str(CHILD_SCRIPT)], env=dict(env), capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"torch_error": None, "facts": {"probe_error": f"the device probe did not finish in {CHILD_TIMEOUT_S} s"
                                               " (a hung driver, or devices held by another process?)"}}
    stage = None
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
        if line.startswith(STAGE_MARKER):
            stage = line[len(STAGE_MARKER):]
    signal_name = _signal_name(proc.returncode)
    if signal_name:  # no Python error to show: faulthandler's innermost frame says where
        ended, detail = f"killed by signal {signal_name}", _crash_frame(proc.stderr)
    else:
        last = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), None)
        ended, detail = f"exited with status {proc.returncode}", f": {last}" if last else ""
    if stage == IMPORT_TORCH:
        return {"torch_error": f"the torch import probe was {ended} during `import torch`{detail}",
                "torch_error_cause": None, "torch_crash": signal_name or f"exit status {proc.returncode}"}
    return {"torch_error": None,
            "facts": {"probe_error": f"the device probe was {ended} during {stage or 'start-up'}{detail}"}}


def _signal_name(returncode: int) -> Optional[str]:
    """``"SIGSEGV (Segmentation fault)"`` for a process a signal ended (negative return code), else None."""
    if returncode >= 0:
        return None
    try:
        number = signal.Signals(-returncode)
    except ValueError:
        return f"signal {-returncode}"
    description = signal.strsignal(number)
    return f"{number.name} ({description})" if description else number.name


def _crash_frame(stderr: str) -> str:
    """`` in <file>, line <n>``: the innermost Python frame of faulthandler's dump, skipping importlib's own."""
    for match in _FRAME.finditer(stderr):
        if not match["file"].startswith("<frozen"):
            return f" (in {match['file']}, line {match['line']})"
    return ""
