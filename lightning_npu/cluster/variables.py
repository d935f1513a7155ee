"""Reading a scheduler's integer variable: the one error both schedulers' readers give for a value that is not one."""

from __future__ import annotations

from typing import Mapping

from lightning_npu.facts.problem import Problem, SettingError


def integer(env: Mapping[str, str], name: str, meaning: str, scheduler: str) -> int:
    """``int(env[name])``, or SettingError naming the variable, what it means, and who sets it."""
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise SettingError(Problem(f"{name}={value!r} ({meaning}) is not an integer",
                                   f"leave {name} as {scheduler} sets it")) from None
