"""Helpers for tests that run scripts in fresh processes (Lightning relaunches ``sys.argv`` for extra ranks,
so multi-process runs cannot live inside the pytest process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from tests.warm_python import WarmPython

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
#: Each subprocess gets this long; a hung collective must not stall the suite.
SUBPROCESS_TIMEOUT_S = 240
#: The warm interpreters run_python forks its processes from (started on first use).
WARM_PYTHON = WarmPython()


def run_python(args: list[str], *, simulate: Optional[int] = 2, env: Optional[dict[str, str]] = None,
               timeout: float = SUBPROCESS_TIMEOUT_S, cwd: Path = REPO, fresh: bool = False
               ) -> subprocess.CompletedProcess:
    """Run ``python *args`` with LIGHTNING_NPU_SIMULATE=simulate; fail the test with its output if it fails.

    The process (and the ranks it starts) is forked from a warm interpreter that has imported torch and Lightning
    (tests/warm_python.py), unless ``fresh`` (a test of interpreter start-up itself) or a fresh interpreter would
    import them differently.
    """
    full_env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_NPU_SIMULATE"}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    if simulate:
        full_env["LIGHTNING_NPU_SIMULATE"] = str(simulate)
    full_env.update(env or {})
    python = sys.executable if fresh else WARM_PYTHON.command(full_env)
    proc = subprocess.run([python, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}")
    return proc


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
