"""The warm interpreters run_python forks from (tests/warm_python.py) must behave as fresh ones for what the suite
checks: arguments, environment, paths, ``__main__``, Lightning's import-time rank, exit statuses and signals; and a
request a fresh interpreter would import differently must run cold."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import WARM_PYTHON, run_python
from tests.warm_python import WARM_VARIABLE


@pytest.fixture(autouse=True)
def _warm(monkeypatch):
    monkeypatch.setenv(WARM_VARIABLE, "1")

PROBE = textwrap.dedent("""
    import json, os, pickle, sys
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    class Defined:  # pickled by reference to __main__, as spawned workers and DataLoaders do
        pass

    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "executable": sys.executable, "name": __name__,
        "path_head": sys.path[:2], "marker": os.environ.get("WARM_TEST_MARKER"), "rank": rank_zero_only.rank,
        "main_is_script": sys.modules["__main__"].__dict__ is globals(),
        "pickled": type(pickle.loads(pickle.dumps(Defined()))).__name__,
    }))
""")


def _probe(tmp_path, **kwargs) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    extra = tmp_path / "extra"
    extra.mkdir(exist_ok=True)
    env = {"WARM_TEST_MARKER": "seen", "RANK": "1", "PYTHONPATH": str(extra), **kwargs.pop("env", {})}
    out = run_python([str(script), "a", "--b"], simulate=None, env=env, cwd=tmp_path, **kwargs)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_warm_child_sees_the_command_line_environment_paths_and_main_of_a_fresh_interpreter(tmp_path):
    """Catches a forked child that keeps the zygote's argv, cwd, environment, sys.path or ``__main__`` (a class
    defined in the script would not pickle), or Lightning's rank from the zygote's import (rank 1 logging as 0)."""
    warm = _probe(tmp_path)
    fresh = _probe(tmp_path, fresh=True)
    assert warm["executable"] == WARM_PYTHON.shim != fresh["executable"]  # forked; its own children too
    for result in (warm, fresh):
        assert result["argv"] == [str(tmp_path / "probe.py"), "a", "--b"]
        assert result["cwd"] == str(tmp_path) and result["name"] == "__main__" and result["marker"] == "seen"
        assert result["path_head"] == [str(tmp_path), str(tmp_path / "extra")]
        assert result["rank"] == 1 and result["main_is_script"] and result["pickled"] == "Defined"


def test_a_request_whose_imports_would_differ_runs_cold(tmp_path):
    """Catches a warm child for an environment that changes what torch, Lightning or transformers read at import
    (here HF_HUB_OFFLINE) or for a PYTHONPATH entry with a sitecustomize: a fresh interpreter would differ."""
    assert _probe(tmp_path, env={"HF_HUB_OFFLINE": "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"}
                  )["executable"] == sys.executable
    (tmp_path / "extra" / "sitecustomize.py").write_text("")
    assert _probe(tmp_path)["executable"] == sys.executable


WARNING_PROBE = textwrap.dedent("""
    import json, sys, warnings
    from tests.warm_python import PRELOAD
    for module in PRELOAD:
        __import__(module)
    print(json.dumps({"executable": sys.executable, "warnoptions": sys.warnoptions, "filters": [
        [action, getattr(message, "pattern", message), category.__qualname__, getattr(module, "pattern", module),
         lineno]
        for action, message, category, module, lineno in warnings.filters]}))
""")


def test_warning_options_run_warm_with_the_filters_of_a_fresh_interpreter(tmp_path):
    """Catches PYTHONWARNINGS sending a process cold (the planner-accuracy benchmark sets it for every case: 24
    processes and their ranks imported torch again) or a warm child whose ``sys.warnoptions`` or filters differ
    from a fresh one's (its options ahead of what torch and Lightning add at import, or missing); an option that
    turns warnings into errors runs cold, since a warning at import would stop a fresh interpreter."""
    script = tmp_path / "warnings_probe.py"
    script.write_text(WARNING_PROBE)
    command = ["-W", "always::UserWarning", str(script)]
    env = {"PYTHONWARNINGS": "ignore::DeprecationWarning,default:::json"}
    warm, fresh = (json.loads(run_python(command, simulate=None, env=env, fresh=fresh).stdout.splitlines()[-1])
                   for fresh in (False, True))
    assert warm["executable"] == WARM_PYTHON.shim and fresh["executable"] == sys.executable
    assert warm["warnoptions"] == fresh["warnoptions"] == [
        "ignore::DeprecationWarning", "default:::json", "always::UserWarning"]
    assert warm["filters"] == fresh["filters"]
    errors = run_python([str(script)], simulate=None, env={"PYTHONWARNINGS": "error::FutureWarning"})
    assert json.loads(errors.stdout.splitlines()[-1])["executable"] == sys.executable


@pytest.mark.parametrize("code, status, stderr", [
    ("import sys; print('out'); sys.exit(3)", 3, ""),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, ""),
    ("import atexit, sys; atexit.register(lambda: sys.stderr.write('atexit ran'))", 0, "atexit ran"),
])
def test_a_warm_child_exits_as_a_fresh_interpreter_does(code, status, stderr):
    """Catches exit statuses, tracebacks or atexit hooks lost between the child and the process the test waits
    for (a signal death must reach the caller as that signal)."""
    env = dict(os.environ)
    proc = subprocess.run([WARM_PYTHON.command(env), "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stderr
    assert stderr in proc.stderr


def test_signals_sent_to_the_process_reach_the_warm_child():
    """Catches a shim that does not pass on SIGTERM (a preemption test's signal would stop nothing)."""
    env = dict(os.environ)
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
    proc = subprocess.Popen([WARM_PYTHON.command(env), "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        assert child != proc.pid  # the script runs in the forked child, not in the process the test started
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{child}")
    finally:
        proc.kill()


def test_a_shim_gone_with_its_reply_unread_leaves_the_zygote_serving(tmp_path):
    """Catches a zygote that died of the reset connection (ECONNRESET) a shim killed before it read the child's pid
    leaves: every later process of the session ran cold, and those running lost their status ("the zygote went
    away"). Here a client that speaks the shim's protocol closes without reading the reply; the zygote must kill the
    orphaned child, as for any shim gone, and go on serving."""
    read_end, write_end = os.pipe()
    env = dict(os.environ)
    request = json.dumps({"argv": ["-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"],
                          "cwd": str(tmp_path), "env": env, "nice": os.getpriority(os.PRIO_PROCESS, 0)}).encode()
    WARM_PYTHON.start()
    with open(os.devnull, "rb") as stdin, socket.socket(socket.AF_UNIX) as sock:
        sock.connect(WARM_PYTHON.socket)
        socket.send_fds(sock, [b"R"], [stdin.fileno(), write_end, sys.stderr.fileno()])
        sock.sendall(len(request).to_bytes(8, "big") + request)
        os.close(write_end)
        with os.fdopen(read_end) as child_stdout:
            child = int(child_stdout.readline())
            time.sleep(0.5)  # the reply, sent right after the fork, is in the socket by now: closed unread
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}")
    assert _probe(tmp_path)["executable"] == WARM_PYTHON.shim  # still forked warm


def test_a_warm_child_runs_at_the_callers_cpu_priority():
    """Catches a child that keeps the zygote's priority or scheduling group: the background fixtures
    (tests/prefetch.py) start their runs at nice 19 so that they take only idle CPU, and a warm rank at nice 0, or in
    the test session's autogroup, would compete with the tests instead."""
    env = dict(os.environ)
    code = ("import os; group = '/proc/self/autogroup'; print(os.getpriority(os.PRIO_PROCESS, 0), os.getsid(0),"
            " open(group).read().split()[-1] if os.path.exists(group) else 'none')")
    proc = subprocess.run(["nice", "-n", "7", WARM_PYTHON.command(env), "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    nice, session, group_nice = proc.stdout.split()
    expected = os.getpriority(os.PRIO_PROCESS, 0) + 7
    assert int(nice) == expected
    # Under autogroup scheduling, nice counts only inside a session's group: the child leads its own, at that nice.
    assert int(session) != os.getsid(0) and group_nice in (str(expected), "none")
