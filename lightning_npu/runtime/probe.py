"""Is an Ascend NPU usable in this process, and if not, exactly why.

The probe never initialises a device: it reads the environment and package metadata first, imports
``torch_npu`` only when it is installed for the torch in use, and then asks for the device count
(which is fork-safe in torch_npu).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_npu.facts.devices import DRIVER_HINT, visible_devices_problem
from lightning_npu.facts.env import VISIBLE_DEVICES_ENV
from lightning_npu.facts.problem import Problem

CANN_HINT = (
    "install the CANN toolkit and source its environment before starting Python, e.g."
    " `source /usr/local/Ascend/ascend-toolkit/set_env.sh`"
)


@dataclass(frozen=True)
class ProbeResult:
    """The outcome of probing for NPUs: when ``available`` is False, ``cause`` says why they cannot be used and
    ``fix`` what to do (``lightning-npu doctor`` prints the two apart; ``reason`` joins them for error messages)."""

    available: bool
    device_count: int = 0
    cause: Optional[str] = None
    fix: Optional[str] = None

    @classmethod
    def unavailable(cls, problem: Problem) -> ProbeResult:
        return cls(available=False, cause=problem.cause, fix=problem.fix)

    @property
    def reason(self) -> Optional[str]:
        """``"<cause>; <fix>"`` (None when NPUs are available)."""
        return None if self.cause is None else str(Problem(self.cause, self.fix))


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"2.13.0+cpu"`` and ``"2.13.0.post1"`` give ``(2, 13, 0)``."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        return ()
    return tuple(int(part or 0) for part in match.groups())


def torch_npu_version() -> Optional[str]:
    """The installed torch_npu distribution's version, read from metadata without importing it."""
    for name in ("torch-npu", "torch_npu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_mismatch(torch_version: str, npu_version: str) -> Optional[Problem]:
    """Why a torch / torch_npu pair cannot work together, or None when their releases match."""
    if release(torch_version) == release(npu_version):
        return None
    wanted = ".".join(str(part) for part in release(torch_version))
    return Problem(
        f"torch {torch_version} and torch_npu {npu_version} do not match (torch_npu must be built for the same torch"
        " release)",
        f"install torch-npu=={wanted} or the torch release your torch_npu was built for",
    )


def import_problem(error: BaseException) -> Problem:
    """Turn the exception raised by ``import torch_npu`` into a cause and a fix."""
    text = str(error)
    if any(lib in text for lib in ("libhccl", "libascendcl", "libascend", "libruntime", "libge_runner")):
        return Problem(f"torch_npu is installed but the CANN libraries are missing ({text})", CANN_HINT)
    return Problem(f"`import torch_npu` failed: {type(error).__name__}: {text}")


def probe_npu() -> ProbeResult:
    """Probe for usable NPUs, returning the cause and the fix when there are none."""
    problem = visible_devices_problem(os.environ.get(VISIBLE_DEVICES_ENV))
    if problem:
        return ProbeResult.unavailable(problem)
    npu_version = torch_npu_version()
    if npu_version is None and "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        wanted = ".".join(str(part) for part in release(torch.__version__))
        return ProbeResult.unavailable(Problem(
            "torch_npu is not installed",
            f"on an Ascend machine run `pip install torch-npu=={wanted}` (matching torch {torch.__version__}) with"
            " CANN >= 8 installed",
        ))
    if npu_version is not None:
        mismatch = version_mismatch(torch.__version__, npu_version)
        if mismatch:
            return ProbeResult.unavailable(mismatch)
    try:
        importlib.import_module("torch_npu")
    except Exception as error:  # noqa: BLE001 -- any import failure is a diagnosis, not a crash
        return ProbeResult.unavailable(import_problem(error))
    try:
        count = torch.npu.device_count()
        available = torch.npu.is_available()
    except RuntimeError as error:
        return ProbeResult.unavailable(Problem(f"the NPU driver failed to report devices: {error}", DRIVER_HINT))
    if count == 0 or not available:
        visible = os.environ.get(VISIBLE_DEVICES_ENV)
        hint = f" ({VISIBLE_DEVICES_ENV}={visible})" if visible is not None else ""
        return ProbeResult.unavailable(Problem(
            f"torch_npu imported but no NPU is visible{hint}",
            f"{DRIVER_HINT} and that no other process holds the devices",
        ))
    return ProbeResult(available=True, device_count=count)
