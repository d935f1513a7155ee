"""What ``lightning-npu doctor`` reports: the facts it gathered and the findings (cause + fix) drawn from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

ERROR, WARNING, NOTE = "error", "warning", "note"
#: Findings are listed most severe first.
LEVELS = (ERROR, WARNING, NOTE)


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
    """``torch_import``: how ``import torch`` fared (``probe.gather_devices``); ``devices``: the device facts
    (None when no process could import torch); ``environment``: rows (name, value or None, meaning when unset)."""

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
