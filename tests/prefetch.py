"""Fixtures whose work is launching other processes (a multi-process training run whose records several tests read)
start in the background when the session starts, at the lowest CPU priority, and the tests that read them run last.

Why: on the 2-core CI machine the suite left about a third of the CPU idle (one core while pytest runs in-process
tests, both while a test waits for a process to start or a signal to land), while a handful of long launches ran
alone. Started at session start with ``nice 19``, those launches use the idle cycles and take almost nothing from the
tests running meanwhile (the scheduler gives a nice-19 process about 1.5% of a core a nice-0 one wants); by the time
their tests run, the launches have finished or are nearly done.

What stays the same: each fixture's body is the one it had as a plain fixture, run once per session, and its tests
check the same records. A body that fails makes each of its tests fail with that error, as a fixture's failure does.
A test session that selects none of a fixture's tests does not start its launches. Bodies run in threads of the
test process, so they must only launch processes (through ``tests.helpers.run_python``) and read their files: the
thread hands ``run_python`` the environment of the session's start, so what a test running meanwhile patches into
``os.environ`` does not leak into them. Their processes get long timeouts, since they may wait for the CPU.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any, Callable

import pytest

from tests import helpers
from tests.warm_python import WARM_VARIABLE

#: How many bodies run at once (each starts up to 4 ranks: more would only add memory, not use more idle CPU).
CONCURRENT = 2
#: The background's CPU priority: it runs when no foreground test wants the core.
NICE = 19


class Prefetched:
    """The registry of background fixtures (``@PREFETCHED.fixture`` in a test module) and their runs."""

    def __init__(self) -> None:
        self._bodies: dict[str, Callable[[pytest.TempPathFactory], Any]] = {}
        self._seconds: dict[str, float] = {}
        self._order: list[str] = []  # the order they start in: longest first
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()

    def fixture(self, *, seconds: float) -> Callable:
        """Register the decorated body as a session fixture of the same name computed in the background.
        ``seconds``: about how long it takes alone (bodies start longest first)."""

        def register(body: Callable[[pytest.TempPathFactory], Any]) -> Callable:
            name = body.__name__
            if name in self._bodies:
                raise ValueError(f"two background fixtures are named {name!r}: the registry is the session's")
            self._bodies[name] = body
            self._seconds[name] = seconds
            self._order = sorted(self._bodies, key=lambda n: -self._seconds[n])

            @pytest.fixture(scope="session", name=name)
            def prefetched(tmp_path_factory):
                return self.result(name, tmp_path_factory)

            prefetched.__doc__ = body.__doc__
            return prefetched

        return register

    def __contains__(self, name: str) -> bool:
        """Whether ``name`` is a background fixture of this registry."""
        return name in self._bodies

    def start(self, names: set[str], tmp_path_factory: pytest.TempPathFactory) -> None:
        """Start the bodies of ``names`` in background threads, ``CONCURRENT`` at a time, longest first."""
        queue = [name for name in self._order if name in names and name not in self._futures]
        if not queue:
            return
        environment = dict(os.environ)
        tmp_path_factory.getbasetemp()  # made once, here, not raced by the threads
        if environment.get(WARM_VARIABLE) != "0":
            helpers.WARM_PYTHON.start()  # at the test process's priority, not the threads'
        with self._lock:
            for name in queue:
                self._futures[name] = Future()
        pending = list(queue)

        def worker() -> None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)  # this thread and what it starts
            helpers.run_in_background(environment, NICE)
            while True:
                with self._lock:
                    if not pending:
                        return
                    name = pending.pop(0)
                future = self._futures[name]
                future.set_running_or_notify_cancel()
                try:
                    future.set_result(self._bodies[name](tmp_path_factory))
                except BaseException as error:  # handed to the tests, as a fixture's error is
                    future.set_exception(error)

        for _ in range(min(CONCURRENT, len(queue))):
            threading.Thread(target=worker, name="prefetch", daemon=True).start()

    def result(self, name: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
        """The body's value, waiting for its background run; a body not started (its fixture requested by a test
        the session did not collect at start) runs here."""
        with self._lock:
            future = self._futures.get(name)
        if future is None:
            return self._bodies[name](tmp_path_factory)
        return future.result()

    def reorder(self, items: list[pytest.Item]) -> set[str]:
        """Move the modules whose tests read a background fixture after all others (each module kept whole, in the
        order their fixtures start); return the fixtures those tests need."""
        needed = {name for item in items for name in item.fixturenames if name in self._bodies}
        rank: dict[str, int] = {}  # a module's file -> the earliest start among the fixtures its tests read
        for item in items:
            module = item.nodeid.partition("::")[0]
            for name in item.fixturenames:
                if name in self._bodies:
                    rank[module] = min(rank.get(module, len(self._order)), self._order.index(name))
        first: dict[str, int] = {}
        for index, item in enumerate(items):
            first.setdefault(item.nodeid.partition("::")[0], index)

        def position(item: pytest.Item) -> tuple[int, int]:
            module = item.nodeid.partition("::")[0]
            return rank.get(module, -1), first[module]

        items.sort(key=position)  # stable: the order within a module is kept
        return needed


PREFETCHED = Prefetched()
