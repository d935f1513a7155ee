"""Helpers for tests that run scripts in fresh processes (Lightning relaunches ``sys.argv`` for extra ranks,
so multi-process runs cannot live inside the pytest process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from tests.warm_python import WarmPython, lower_priority

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
#: Each subprocess gets this long; a hung collective must not stall the suite.
SUBPROCESS_TIMEOUT_S = 240
#: The warm interpreters run_python forks its processes from (started on first use).
WARM_PYTHON = WarmPython()
#: Added to the timeouts of processes started from a background fixture (tests/prefetch.py): at the lowest CPU
#: priority they may wait for the cores for as long as the rest of the suite keeps them busy.
BACKGROUND_EXTRA_TIMEOUT_S = 1800
_THREAD = threading.local()
#: The background's processes still running (each the leader of its own session).
_BACKGROUND: set[subprocess.Popen] = set()


def run_in_background(environment: dict[str, str], nice: int) -> None:
    """Start this thread's processes (a background fixture's) from ``environment`` rather than ``os.environ`` (what
    a test running meanwhile patches into it is not theirs), at CPU priority ``nice`` in a scheduling group of their
    own (``lower_priority``), with the background's timeouts."""
    _THREAD.background = (environment, nice)


def stop_background() -> None:
    """Kill what the background still runs (a session ended early: -x, Ctrl-C), each process with its session."""
    for popen in list(_BACKGROUND):
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_python(args: list[str], *, simulate: Optional[int] = 2, env: Optional[dict[str, str]] = None,
               timeout: float = SUBPROCESS_TIMEOUT_S, cwd: Path = REPO, fresh: bool = False
               ) -> subprocess.CompletedProcess:
    """Run ``python *args`` with LIGHTNING_NPU_SIMULATE=simulate; fail the test with its output if it fails.

    The process (and the ranks it starts) is forked from a warm interpreter that has imported torch and Lightning
    (tests/warm_python.py), unless ``fresh`` (a test of interpreter start-up itself) or a fresh interpreter would
    import them differently.
    """
    environment, nice = getattr(_THREAD, "background", (os.environ, None))
    if nice is not None:
        timeout += BACKGROUND_EXTRA_TIMEOUT_S
    full_env = {k: v for k, v in environment.items() if k != "LIGHTNING_NPU_SIMULATE"}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    if simulate:
        full_env["LIGHTNING_NPU_SIMULATE"] = str(simulate)
    full_env.update(env or {})
    python = sys.executable if fresh else WARM_PYTHON.command(full_env)
    with subprocess.Popen([python, *args], cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=nice is not None) as popen:
        if nice is not None:
            lower_priority(popen.pid, nice)
            _BACKGROUND.add(popen)
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            raise
        finally:
            _BACKGROUND.discard(popen)
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}")
    return proc


def outputs_of(procs: list[subprocess.Popen]) -> tuple[list[int], list[str]]:
    """The exit codes and combined outputs of processes started together (text, stdout piped), each waited for at
    most ``SUBPROCESS_TIMEOUT_S``; any still running when this returns or fails is killed."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [proc.returncode for proc in procs], outputs


def free_port() -> int:
    """A TCP port free on this machine now (other runs here may hold Lightning's default one)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
