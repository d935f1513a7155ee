"""The selftest's results: one ``CheckResult`` per check, the report they make (table and JSON), the exit status.

A verdict is ``pass``, ``fail``, ``warn`` (worth a look, not a reason to stop: e.g. the planner's estimate is far
from the measured peak), ``not available`` (the check cannot run here: a fused kernel on the simulated runtime or
an unsupported chip -- never counted as passed) or ``info`` (figures only). Only ``fail`` makes the exit status 1.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

PASS, FAIL, WARN, NOT_AVAILABLE, INFO = "pass", "fail", "warn", "not available", "info"
VERDICTS = (PASS, FAIL, WARN, NOT_AVAILABLE, INFO)


@dataclass
class CheckResult:
    """One check. ``figures`` are the measured numbers (units in their names: ``_s``, ``_gbps``, ``_bytes``);
    ``detail`` says why in words; ``fallback`` is what a user sets to train around a failure (None: nothing)."""

    family: str
    name: str
    verdict: str
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    fallback: Optional[str] = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")

    @property
    def label(self) -> str:
        return f"{self.family}/{self.name}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CheckResult":
        return cls(**data)


@dataclass
class Report:
    """Everything the selftest found: versions (from ``lightning-npu doctor``), the chip, and every check."""

    versions: dict[str, Any]
    chip: dict[str, Any]
    checks: list[CheckResult]
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def failures(self) -> list[CheckResult]:
        return [check for check in self.checks if check.verdict == FAIL]

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "versions": self.versions,
            "chip": self.chip,
            "settings": self.settings,
            "checks": [asdict(check) for check in self.checks],
            "failures": [check.label for check in self.failures],
            "exit_code": self.exit_code,
        }

    def write_json(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def merge_ranks(per_rank: Sequence[Sequence[CheckResult]]) -> list[CheckResult]:
    """One result per check for the whole group, from every rank's results for the same checks: rank 0's
    figures, failed (with every failing rank's detail) if the check failed on any rank."""
    merged = []
    for first, *others in zip(*per_rank):
        failed = [result for result in (first, *others) if result.verdict == FAIL]
        if failed and first.verdict != FAIL or len(failed) > 1:
            first = replace(first, verdict=FAIL, detail="; ".join(result.detail for result in failed))
        merged.append(first)
    return merged


def render(report: Report) -> str:
    """The report as text: versions, chip, one table row per check, then what to do about each failure."""
    lines = ["lightning-npu selftest", ""]
    lines += _pairs({**report.versions, "chip": report.chip.get("name"), **report.settings})
    rows = [(check.label, check.verdict, _figures(check.figures), check.detail) for check in report.checks]
    lines += ["", *_table(("check", "verdict", "figures", "detail"), rows), ""]
    counts = {verdict: sum(c.verdict == verdict for c in report.checks) for verdict in VERDICTS}
    lines.append("summary: " + ", ".join(f"{n} {verdict}" for verdict, n in counts.items() if n))
    for check in report.failures:
        fix = (f"to train meanwhile, set {check.fallback}" if check.fallback else
               "no setting trains around this; please report it with the JSON report (--json)")
        lines.append(f"FAILED {check.label}: {check.detail}. {fix}")
    return "\n".join(lines)


def _pairs(values: dict[str, Any]) -> list[str]:
    width = max(len(str(key)) for key in values)
    return [f"  {key:<{width}}  {value}" for key, value in values.items()]


def _table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> list[str]:
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    out = []
    for row in rows:
        cells = [f"{cell:<{width}}" for cell, width in zip(row, widths)] + [row[-1]]
        out.append("  ".join(cells).rstrip())
    out.insert(1, "  ".join("-" * width for width in widths) + "  " + "-" * len(header[-1]))
    return out


def _figures(figures: dict[str, Any]) -> str:
    """The headline figures of a check, compactly (the JSON keeps all of them)."""
    shown = []
    for key, value in figures.items():
        if isinstance(value, (dict, list)):
            continue
        if isinstance(value, float):
            value = f"{value:.3g}"
        shown.append(f"{key}={value}")
    return " ".join(shown)
