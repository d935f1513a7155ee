"""What the facts' checks return for a bad setting: its cause and its fix, kept apart.

Messages read "<cause>; <fix>" wherever they are raised or printed (``str(problem)``); ``lightning-npu doctor``
shows the two on separate lines, so it needs them as fields rather than parsing the text back apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Problem:
    """Why something cannot work (``cause``) and what to do about it (``fix``, None when there is nothing to do)."""

    cause: str
    fix: Optional[str] = None

    def __str__(self) -> str:
        return self.cause if self.fix is None else f"{self.cause}; {self.fix}"


class SettingError(ValueError):
    """A value that cannot be used; the message is ``str(problem)``, and ``problem`` keeps cause and fix apart."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(str(problem))
        self.problem = problem
