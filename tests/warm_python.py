"""Warm interpreters for the suite's subprocesses: a zygote that has imported torch and Lightning once forks a
process for each ``python ...`` the tests start, instead of each paying for those imports again.

Why: a test's multi-process run starts two or three interpreters (the launcher, the ranks it starts, torchrun's
agent), and each spends about 4 s of CPU importing torch and Lightning before the first line of the script runs.
On the 2-core CI machine that was more of the suite's time than the training the tests check.

How it stays a fresh process for what the tests check:
- A request is served warm only when a fresh interpreter would have imported the preloaded modules the same way:
  every environment variable those imports read (recorded while the zygote imported them) equals the zygote's,
  except the few the child sets again itself (Lightning's import-time rank, the temp dir); no ``PYTHON*`` or
  ``LD_*`` variable other than ``PYTHONPATH`` / ``PYTHONUNBUFFERED`` / ``PYTHONWARNINGS`` differs; no warning
  option (``PYTHONWARNINGS``, ``-W``) turns warnings into errors (one raised at import would stop a fresh one); no
  new ``PYTHONPATH`` entry holds a ``sitecustomize`` / ``usercustomize``, a module that shadows a preloaded one, or
  a ``torch.backends`` entry point (torch loads those at import); the command line uses only ``-u``, ``-B``, ``-W``, ``-c``, ``-m`` or a script.
  Anything else runs cold: the shim ``exec``s the real interpreter. Tests about interpreter start-up itself (import
  order, what an import pulls in) ask for a fresh process (``run_python(..., fresh=True)``).
- The child gets the caller's stdin / stdout / stderr (passed over the socket), working directory, CPU priority
  (a caller nicer than the zygote, as the background fixtures of tests/prefetch.py and their ranks are, gets a
  child at its priority in a session of its own: ``lower_priority``), environment,
  ``sys.argv`` and ``sys.path``, a new ``__main__`` module, and ends as any interpreter does (atexit hooks, thread
  joins, finalisation), so exit statuses, tracebacks and teardown behave as in a fresh process.
- ``sys.executable`` in the child is the shim, so the ranks Lightning's launcher and torchrun start (from
  ``sys.executable``) are warm too. The shim forwards the signals a test or a launcher sends it to the child, and
  exits with the child's status (a child killed by signal N kills the shim with N). A shim that dies (a test's
  timeout kills it) takes its child with it.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

#: The environment variable that gives a shim the zygote's socket.
SOCKET_VARIABLE = "LIGHTNING_NPU_TEST_WARM_PYTHON"
#: Set to 0 to start every run_python process as a fresh interpreter (the default forks them from the zygote;
#: tests of interpreter start-up, process trees and exit statuses ask for fresh ones themselves).
WARM_VARIABLE = "LIGHTNING_NPU_TEST_WARM"
#: What the zygote imports before serving (what nearly every test subprocess imports first).
PRELOAD = (
    "numpy", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
    "torch.distributed.tensor", "torch.distributed.run", "lightning.fabric", "lightning.pytorch",
    "lightning.pytorch.cli",
)
#: Read at import but set again in the child: the rank Lightning's rank_zero_only took at import, the temp dir
#: tempfile caches, and the shell's own bookkeeping.
SET_IN_CHILD = frozenset({"RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK", "TMPDIR", "TEMP", "TMP",
                          "PWD", "OLDPWD", "_", "SHLVL"})
#: Interpreter variables the child applies itself; every other PYTHON* variable must equal the zygote's. The zygote
#: starts without PYTHONWARNINGS, so its warning filters are the interpreter's defaults plus what the imports added,
#: and each child puts its own options between the two, where a fresh interpreter has them (``_apply_warnings``).
APPLIED_IN_CHILD = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONWARNINGS"})
#: Signals the shim passes on to its child (SIGKILL cannot be caught: the zygote sees the shim die instead).
FORWARDED = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGCONT", "SIGTSTP")

SHIM = """#!{python} -IS
import json, os, signal, socket, sys
REAL = {python!r}
FORWARDED = [getattr(signal, name) for name in {forwarded!r}]
# Held until the handlers that pass them on are in place (a signal that came before would stop the shim alone).
signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
def cold():
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # exec keeps the mask
    os.execv(REAL, [REAL] + sys.argv[1:])
path = os.environ.get({variable!r})
if not path:
    cold()
sock = socket.socket(socket.AF_UNIX)
try:
    sock.connect(path)
except OSError:
    cold()
request = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ),
                      "nice": os.getpriority(os.PRIO_PROCESS, 0)}}).encode()
socket.send_fds(sock, [b"R"], [0, 1, 2])
sock.sendall(len(request).to_bytes(8, "big") + request)
replies = sock.makefile("rb")
reply = json.loads(replies.readline() or b'{{"cold": true}}')
if reply.get("cold"):
    sock.close()
    cold()
pid = reply["pid"]
for number in FORWARDED:
    signal.signal(number, lambda number, frame: os.kill(pid, number))
signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
line = replies.readline()
if not line:
    sys.stderr.write("warm python: the zygote went away before process " + str(pid) + " ended\\n")
    os._exit(1)
status = json.loads(line)
if "signal" in status:
    if status["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(status["signal"], signal.SIG_DFL)
    os.kill(os.getpid(), status["signal"])
os._exit(status.get("exit", 1))
"""


def lower_priority(pid: int, nice: int) -> None:
    """Run process ``pid``, the leader of a session of its own, at CPU priority ``nice``. With the kernel's autogroup
    scheduling (on here) the cores are shared between sessions first, so a niced process in the test session would
    still take half of them from a test in a session of its own (the preemption tests signal theirs as a whole); the
    session's group gets ``nice`` too, and with it every process started in it."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except ProcessLookupError:  # already gone
        return
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:  # a kernel without autogroup scheduling (its own priority is what counts), or gone
        pass


# ---- the test process's side ------------------------------------------------------------------------------------

class WarmPython:
    """A zygote started on first use, stopped when the test process exits.

    Made at import (test collection), it keeps the environment of that moment: the zygote imports with it, not
    with what a test that happens to start it first has patched in.
    """

    def __init__(self) -> None:
        self._environment = {k: v for k, v in os.environ.items()
                             if k not in ("PYTHONPATH", "PYTHONWARNINGS", SOCKET_VARIABLE)}
        self._process: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self._directory: Optional[tempfile.TemporaryDirectory] = None
        self.shim: Optional[str] = None
        self.socket: Optional[str] = None

    def command(self, env: dict[str, str]) -> str:
        """The interpreter to start a subprocess with ``env``: the shim, after adding what it needs to ``env``; the
        real one where ``env`` has ``LIGHTNING_NPU_TEST_WARM=0``."""
        if env.get(WARM_VARIABLE) == "0":
            return sys.executable
        self.start()
        env[SOCKET_VARIABLE] = self.socket
        return self.shim

    def start(self) -> None:
        """Start the zygote if it is not running. The background fixtures (tests/prefetch.py) call this from the main
        thread before their niced threads start processes: a zygote those threads started would be niced too."""
        with self._lock:  # those threads start processes through command() too
            self._start()

    def _start(self) -> None:
        if self._process is not None:
            return
        self._directory = tempfile.TemporaryDirectory(prefix="lnpu-warm-")
        directory = Path(self._directory.name)
        self.socket = str(directory / "zygote.sock")
        self.shim = str(directory / "python")
        Path(self.shim).write_text(SHIM.format(python=sys.executable, variable=SOCKET_VARIABLE,
                                               forwarded=FORWARDED))
        os.chmod(self.shim, 0o755)
        log = open(directory / "zygote.log", "wb")
        self._process = subprocess.Popen([sys.executable, __file__, self.socket, self.shim, str(os.getpid())],
                                         env=self._environment, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 120
        while not os.path.exists(self.socket):
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the warm-python zygote did not start:\n{(directory / 'zygote.log').read_text()}")
            time.sleep(0.05)
        atexit.register(self.stop)

    def stop(self) -> None:
        """Stop the zygote; say on stderr how many processes it served warm and why the others ran cold."""
        if self._process is not None and self._directory is not None:
            lines = (Path(self._directory.name) / "zygote.log").read_text(errors="replace").splitlines()
            if self._process.poll() is not None:  # it serves until this process ends: it failed
                said = [line for line in lines if line != "warm" and not line.startswith("cold: ")]
                sys.__stderr__.write(f"warm python: the zygote exited early with status {self._process.returncode}:\n"
                                     + "\n".join(said) + "\n")
            cold: dict[str, int] = {}
            for line in lines:
                if line.startswith("cold: "):
                    reason = line[len("cold: "):].split(": [")[0]
                    cold[reason] = cold.get(reason, 0) + 1
            reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(cold.items(), key=lambda i: -i[1]))
            sys.__stderr__.write(f"warm python: {sum(line == 'warm' for line in lines)} processes forked warm,"
                                 f" {sum(cold.values())} cold{' (' + reasons + ')' if reasons else ''}\n")
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
        if self._directory is not None:
            self._directory.cleanup()


# ---- the zygote -------------------------------------------------------------------------------------------------

#: Packages that copy or scan the whole environment at import (``os.environ.items()``, ``dict(os.environ)``,
#: reading every value) and use only the variables with a prefix: what they read counts as that prefix. A scan by
#: any other package makes every variable it read count (the zygote then serves less warm, never wrongly).
PREFIX_SCANS = {"tqdm": "TQDM_", "fsspec": "FSSPEC_"}


#: The warning filters the preloaded imports put before and after the interpreter's own (its defaults: the zygote
#: has no warning options); None where the imports removed or reordered the defaults.
_IMPORTED_FILTERS: Optional[tuple[list, list]] = None


def _preload() -> tuple[set[str], tuple[str, ...], dict[str, str], dict[str, str]]:
    """Import PRELOAD; return the names of the environment variables those imports read, the prefixes of the
    variables they scanned for, the environment before them, and the variables they set (torch sets some)."""
    global _IMPORTED_FILTERS
    import warnings

    defaults = list(warnings.filters)
    before = dict(os.environ)
    read: set[str] = set()
    prefixes: set[str] = set()
    environ = type(os.environ)
    originals = {name: getattr(environ, name) for name in ("__getitem__", "get", "__contains__")}

    def recording(original):
        def method(self, key, *args):
            depth = 1
            if "_collections_abc" in sys._getframe(depth).f_code.co_filename:  # items() / values()
                depth += 1
            reader = sys._getframe(depth).f_globals.get("__name__", "").partition(".")[0]
            if reader in PREFIX_SCANS:
                prefixes.add(PREFIX_SCANS[reader])
            else:
                read.add(key)
            return original(self, key, *args)
        return method

    for name, original in originals.items():
        setattr(environ, name, recording(original))
    try:
        import importlib

        for module in PRELOAD:
            importlib.import_module(module)
    finally:
        for name, original in originals.items():
            setattr(environ, name, original)
    set_by_imports = {key: value for key, value in os.environ.items() if before.get(key) != value}
    after = list(warnings.filters)
    for start in range(len(after) - len(defaults) + 1):
        if after[start:start + len(defaults)] == defaults:
            _IMPORTED_FILTERS = after[:start], after[start + len(defaults):]
            break
    return {key for key in read if isinstance(key, str)}, tuple(sorted(prefixes)), before, set_by_imports


def _command(argv: list[str]) -> Optional[dict[str, Any]]:
    """The interpreter options and what to run, or None for a command line the child does not reproduce."""
    options: dict[str, Any] = {"unbuffered": False, "no_bytecode": False, "warnings": []}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-u":
            options["unbuffered"] = True
        elif arg == "-B":
            options["no_bytecode"] = True
        elif arg == "-W" and i + 1 < len(argv):
            options["warnings"].append(argv[i + 1])
            i += 1
        elif arg in ("-c", "-m") and i + 1 < len(argv):
            return {**options, "kind": arg, "target": argv[i + 1], "args": argv[i + 2:]}
        elif arg.startswith("-"):
            return None
        else:
            return {**options, "kind": "script", "target": arg, "args": argv[i + 1:]}
        i += 1
    return None  # an interactive interpreter


def _warning_options(request: dict[str, Any], command: dict[str, Any]) -> list[str]:
    """``sys.warnoptions`` of a fresh interpreter for the request: ``PYTHONWARNINGS``' entries, then the ``-W`` ones."""
    return [entry for entry in request["env"].get("PYTHONWARNINGS", "").split(",") if entry] + command["warnings"]


def _warnings_cold_reason(options: list[str]) -> Optional[str]:
    """Why the child could not reproduce a fresh interpreter's warning options, or None."""
    import warnings

    if options and _IMPORTED_FILTERS is None:
        return "warning options (the imports reordered the default filters)"
    for option in options:
        try:
            action = warnings._getaction(option.split(":")[0].strip())
        except warnings._OptionError:
            return f"warning option {option!r} (invalid)"
        if action == "error":
            return f"warning option {option!r} (a warning at import would stop a fresh interpreter)"
    return None


def _apply_warnings(options: list[str]) -> None:
    """Give this process a fresh interpreter's ``sys.warnoptions`` and filters: what the imports added before, the
    options over the defaults (the last given first, as at start-up), what the imports appended after."""
    import warnings

    if not options:
        return
    before, after = _IMPORTED_FILTERS
    warnings.filters[:] = [f for f in warnings.filters if f not in before and f not in after]  # the defaults
    for option in options:
        warnings._setoption(option)
    warnings.filters[:0] = before
    warnings.filters.extend(after)
    warnings._filters_mutated()
    sys.warnoptions[:] = options


def _shadows(entry: str, preloaded: set[str]) -> bool:
    """Whether a new sys.path entry would change what a fresh interpreter imports at start-up or with torch."""
    try:
        names = os.listdir(entry or ".")
    except OSError:
        return False
    for name in names:
        stem = name[:-3] if name.endswith(".py") else name
        if stem in ("sitecustomize", "usercustomize") or stem in preloaded:
            return True
        if name.endswith((".dist-info", ".egg-info")):
            entry_points = Path(entry, name, "entry_points.txt")
            if entry_points.is_file() and "[torch.backends]" in entry_points.read_text(errors="replace"):
                return True
    return False


def _cold_reason(request: dict[str, Any], read_at_import: set[str], scanned: tuple[str, ...], own: dict[str, str],
                 set_by_imports: dict[str, str], preloaded: set[str]) -> Optional[str]:
    """Why a fresh interpreter could import differently from the zygote (``own``: its environment before the
    imports; ``set_by_imports``: what they set, such as torch's inductor cache dir, which a caller that imported
    torch itself passes on with the same value), or None."""
    command = _command(request["argv"])
    if command is None:
        return "command line"
    warnings_reason = _warnings_cold_reason(_warning_options(request, command))
    if warnings_reason:
        return warnings_reason
    env = request["env"]
    for key in read_at_import - SET_IN_CHILD:
        if env.get(key) != own.get(key) and not (key in set_by_imports and env.get(key) == set_by_imports[key]):
            return f"{key} read at import"
    for key in set(env) | set(own):
        if scanned and key.startswith(scanned) and env.get(key) != own.get(key):
            return f"{key} scanned at import"
        if key.startswith(("PYTHON", "LD_")) and key not in APPLIED_IN_CHILD and env.get(key) != own.get(key):
            return key
    for entry in env.get("PYTHONPATH", "").split(os.pathsep):
        if entry and _shadows(os.path.join(request["cwd"], entry), preloaded):
            return f"PYTHONPATH entry {entry}"
    return None


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    stream = conn.makefile("rb")
    size = int.from_bytes(stream.read(8), "big")
    return json.loads(stream.read(size)), fds


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the shim is gone


def _receive_byte(conn: socket.socket) -> bytes:
    """A byte from the shim, or none when it is gone: a shim killed before it read a reply resets the connection
    (ECONNRESET) rather than closing it."""
    try:
        return conn.recv(1)
    except OSError:
        return b""


def serve(path: str, parent: int) -> tuple[dict[str, Any], list[int], dict[str, str]]:
    """Serve requests until the test process ``parent`` is gone; in a forked child, return its request, its
    descriptors and the environment variables the imports set."""
    read_at_import, scanned, own, set_by_imports = _preload()
    from importlib.metadata import entry_points

    if not entry_points(group="torch.backends"):  # nothing for torch to autoload: the switch changes nothing
        read_at_import.discard("TORCH_DEVICE_BACKEND_AUTOLOAD")
    preloaded = {name.partition(".")[0] for name in sys.modules}
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the test process waits for this name
    children: dict[socket.socket, int] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, *children], [], [], 0.05)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                reason = _cold_reason(request, read_at_import, scanned, own, set_by_imports, preloaded)
                if reason is not None:
                    sys.stderr.write(f"cold: {reason}: {request['argv'][:3]}\n")
                    _send(conn, {"cold": True})
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in (*children, conn):
                        other.close()
                    return request, fds, set_by_imports
                for fd in fds:
                    os.close(fd)
                _send(conn, {"pid": pid})
                sys.stderr.write("warm\n")
                children[conn] = pid
            elif not _receive_byte(sock):  # the shim died (killed by a timeout): so does its process
                try:
                    os.kill(children[sock], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = next(c for c, p in children.items() if p == pid)
            del children[conn]
            if os.WIFSIGNALED(status):
                _send(conn, {"signal": os.WTERMSIG(status)})
            else:
                _send(conn, {"exit": os.WEXITSTATUS(status)})
            conn.close()
    for pid in children.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sys.exit(0)


def become(request: dict[str, Any], fds: list[int], set_by_imports: dict[str, str], shim: str,
           base_path: list[str]) -> dict[str, Any]:
    """Turn this forked child into the process the request asked for (its environment plus what the imports set,
    as they would have in it); return what to run."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    if request["nice"] > os.getpriority(os.PRIO_PROCESS, 0):
        os.setsid()  # a scheduling group of its own (see lower_priority), as the background's processes get
        lower_priority(os.getpid(), request["nice"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(set_by_imports)
    tempfile.tempdir = None
    import numpy
    from lightning.fabric.utilities import rank_zero

    numpy.random.seed()  # a fresh interpreter seeds it from the OS; forked children would share the zygote's
    rank = rank_zero._get_rank() or 0
    for name in ("lightning.fabric.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero",
                 "lightning_utilities.core.rank_zero"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "rank_zero_only"):
            module.rank_zero_only.rank = rank
    command = _command(request["argv"])
    unbuffered = command["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED"))
    sys.stdout.reconfigure(line_buffering=os.isatty(1), write_through=unbuffered)
    sys.stderr.reconfigure(line_buffering=True, write_through=unbuffered)
    sys.dont_write_bytecode = sys.dont_write_bytecode or command["no_bytecode"]
    _apply_warnings(_warning_options(request, command))
    sys.executable = shim
    extra = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep) if entry]
    first = {"script": os.path.dirname(os.path.abspath(command["target"])), "-m": os.getcwd(), "-c": ""}
    sys.path[:] = [first[command["kind"]], *[os.path.abspath(e) for e in extra], *base_path]
    return command


def run(command: dict[str, Any]) -> None:
    """Run the script, module or code as ``python`` would, in a new ``__main__`` module."""
    import builtins
    import runpy
    import types

    if command["kind"] == "-m":
        sys.argv = ["-m", *command["args"]]
        runpy._run_module_as_main(command["target"])
        return
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    if command["kind"] == "script":
        filename = command["target"]
        main.__file__ = filename
        sys.argv = [filename, *command["args"]]
        source = Path(filename).read_bytes()
    else:
        filename = "<string>"
        sys.argv = ["-c", *command["args"]]
        source = command["target"]
    sys.modules["__main__"] = main
    exec(compile(source, filename, "exec"), main.__dict__)


if __name__ == "__main__":
    _socket, _shim, _parent = sys.argv[1], sys.argv[2], int(sys.argv[3])
    _base_path = sys.path[1:]  # without this file's directory
    _request, _fds, _set_by_imports = serve(_socket, _parent)
    _command_to_run = become(_request, _fds, _set_by_imports, _shim, _base_path)
    del _request, _fds, _set_by_imports, _socket, _parent
    run(_command_to_run)
