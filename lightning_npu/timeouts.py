"""Collective timeouts that agree, and torch_npu's flight recorder for hang diagnostics.

Three clocks bound a stuck collective on Ascend: HCCL's link set-up (``HCCL_CONNECT_TIMEOUT``, default 120 s),
HCCL's execution of one collective (``HCCL_EXEC_TIMEOUT``, default 1836 s; 0 = never on A2/A3), and the
process-group timeout given to ``init_process_group`` (the strategies' ``timeout``), after which the
watchdog aborts. torch_npu advises the process-group timeout above both HCCL timeouts (libtorch_npu warns
"... (which is set by init_process_group) is less than or equal to HCCL execution timeout"): otherwise the
watchdog kills a collective HCCL would still have completed, with less diagnosis than HCCL's own error.

This module is the one place of that rule, used by the strategies at start-up (``strategies/common.py``) and by
``lightning-npu doctor``. It imports only the standard library, because the doctor must run where
``import torch`` fails.
"""

from __future__ import annotations

from typing import Mapping, Optional

from lightning_npu.facts import env as names
from lightning_npu.facts.problem import Problem

#: The process-group timeout when none is given and the HCCL timeouts need no more (seconds).
DEFAULT_TIMEOUT_S = 1800.0
#: HCCL's defaults when the variables are unset (seconds; CANN documentation, Atlas A2/A3).
HCCL_DEFAULTS_S = {names.HCCL_CONNECT_TIMEOUT: 120.0, names.HCCL_EXEC_TIMEOUT: 1836.0}
#: How far above the larger HCCL timeout the process-group timeout should be, so HCCL reports first.
MARGIN_S = 60.0

#: torch_npu's flight recorder (names read from the torch_npu 2.13.0 wheel: libtorch_npu.so,
#: torch_npu/_init/core/optional_features.py). On a collective timeout every rank dumps its last collectives
#: to ``<TORCH_HCCL_DEBUG_INFO_TEMP_FILE><rank>``; compare the ranks' last sequence numbers to find the one
#: that fell behind.
FLIGHT_RECORDER_ENV = {
    names.TORCH_HCCL_TRACE_BUFFER_SIZE: "2000",  # collectives remembered per rank (0 = recorder off)
    names.TORCH_HCCL_ENABLE_MONITORING: "1",  # heartbeat monitor: dumps and aborts a rank whose watchdog is stuck
    names.TORCH_HCCL_DUMP_ON_TIMEOUT: "1",  # write the trace when a collective times out
    names.TORCH_HCCL_DEBUG_INFO_TEMP_FILE: "/tmp/hccl_trace_rank_",  # dump file prefix (rank appended)
    names.TORCH_HCCL_TRACE_CPP_STACK: "1",  # C++ stacks in the dump
    names.ASCEND_GLOBAL_LOG_LEVEL: "1",  # CANN logs at INFO (under ~/ascend/log)
    names.ASCEND_GLOBAL_EVENT_ENABLE: "1",  # CANN event logs
}


def hccl_timeouts_s(env: Mapping[str, str]) -> dict[str, float]:
    """``HCCL_CONNECT_TIMEOUT`` and ``HCCL_EXEC_TIMEOUT`` in seconds as HCCL will use them (unset or unreadable:
    the default; the doctor reports unreadable values separately)."""
    values = {}
    for name, default in HCCL_DEFAULTS_S.items():
        try:
            value = float(env[name])
            values[name] = value if value >= 0 else default
        except (KeyError, ValueError):
            values[name] = default
    return values


def minimum_timeout_s(env: Mapping[str, str]) -> float:
    """The smallest process-group timeout that stays above both HCCL timeouts (by ``MARGIN_S``)."""
    return max(hccl_timeouts_s(env).values()) + MARGIN_S  # HCCL_EXEC_TIMEOUT=0 (never) needs nothing above it


def default_timeout_s(env: Mapping[str, str]) -> float:
    """The strategies' timeout when none is given: 30 min, or more where the HCCL timeouts need it."""
    return max(DEFAULT_TIMEOUT_S, minimum_timeout_s(env))


def timeout_problem(timeout_s: float, env: Mapping[str, str]) -> Optional[Problem]:
    """Why ``timeout_s`` (the process-group timeout) disagrees with the HCCL timeouts in ``env``, with the fix;
    None when it is above both."""
    hccl = hccl_timeouts_s(env)
    name, value = max(hccl.items(), key=lambda item: item[1])
    if timeout_s > value:
        return None
    shown = ", ".join(f"{n}={v:g} s" + ("" if n in env else " (default)") for n, v in hccl.items())
    return Problem(
        f"the process-group timeout ({timeout_s:g} s) is not above {name} ({value:g} s; {shown}): the watchdog would"
        " abort collectives HCCL still waits for, and a hang reports less",
        f"set the strategy's timeout to at least {minimum_timeout_s(env):g} (YAML: trainer.strategy.init_args.timeout:"
        f" {minimum_timeout_s(env):g}), or lower {name} below {timeout_s:g}"
        f" (export {name}={max(int(timeout_s - MARGIN_S), 1)})",
    )


def flight_recorder_exports(env: Mapping[str, str]) -> str:
    """Shell ``export`` lines turning on torch_npu's flight recorder (values the user already set are kept)."""
    return "\n".join(f"export {name}={env.get(name, value)}" for name, value in FLIGHT_RECORDER_ENV.items())


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FLIGHT_RECORDER_ENV",
    "default_timeout_s",
    "flight_recorder_exports",
    "hccl_timeouts_s",
    "minimum_timeout_s",
    "timeout_problem",
]
