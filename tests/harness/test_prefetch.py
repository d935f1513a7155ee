"""The background fixtures (tests/prefetch.py): their bodies run once, in a thread at the lowest CPU priority with the
environment of the session's start, their errors reach the tests that read them, and those tests run last."""

import os
import threading
from types import SimpleNamespace

import pytest

from tests.helpers import run_python
from tests.prefetch import NICE, Prefetched

PRIORITY_AND_MARKER = ("import os; group = '/proc/self/autogroup'; print(os.getpriority(os.PRIO_PROCESS, 0),"
                       " open(group).read().split()[-1] if os.path.exists(group) else 19, os.getsid(0),"
                       " os.environ.get('PREFETCH_MARKER'))")


def test_a_body_runs_once_in_the_background_at_nice_19_with_the_sessions_starting_environment(
        tmp_path_factory, monkeypatch):
    """Catches a background run at normal priority or in the test session's autogroup (it would slow the tests
    running meanwhile: the preemption tests' sessions got half the cores instead of nearly all), processes that read
    what a test running meanwhile patched into os.environ, and a body run again for each test that reads it."""
    prefetched, calls, release = Prefetched(), [], threading.Event()

    @prefetched.fixture(seconds=1)
    def records(factory):
        calls.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        release.wait(60)  # the "test running meanwhile" patches os.environ before the body starts its process
        return run_python(["-c", PRIORITY_AND_MARKER], simulate=None).stdout.split()

    monkeypatch.setenv("PREFETCH_MARKER", "at-start")
    prefetched.start({"records"}, tmp_path_factory)
    monkeypatch.setenv("PREFETCH_MARKER", "patched-by-a-test")
    release.set()
    first = prefetched.result("records", tmp_path_factory)
    nice, group_nice, session, marker = first
    assert (nice, group_nice, marker) == (str(NICE), str(NICE), "at-start")
    assert int(session) != os.getsid(0)  # its own session, so its autogroup's nice is its own
    assert prefetched.result("records", tmp_path_factory) is first
    assert calls == [NICE]  # once, in a niced thread


def test_a_failing_body_fails_every_test_that_reads_it(tmp_path_factory):
    prefetched = Prefetched()

    @prefetched.fixture(seconds=1)
    def broken(factory):
        raise AssertionError("the launch exited 1")

    prefetched.start({"broken"}, tmp_path_factory)
    for _ in range(2):
        with pytest.raises(AssertionError, match="the launch exited 1"):
            prefetched.result("broken", tmp_path_factory)


def test_a_body_no_test_asked_for_at_start_runs_when_read(tmp_path_factory):
    prefetched = Prefetched()

    @prefetched.fixture(seconds=1)
    def inline(factory):
        return threading.current_thread() is threading.main_thread()

    prefetched.start(set(), tmp_path_factory)
    assert prefetched.result("inline", tmp_path_factory) is True


def test_modules_reading_background_fixtures_run_last_whole_and_longest_first():
    """Catches a reader scheduled before the others (it would wait for its run while the idle CPU goes unused), a
    module split in two (its module fixtures would be set up twice), and fixtures nobody reads being started."""
    prefetched = Prefetched()
    for name, seconds in (("short", 1), ("long", 100), ("unread", 50)):
        body = lambda factory: None  # noqa: E731
        body.__name__ = name
        prefetched.fixture(seconds=seconds)(body)
    def item(module, *fixtures):
        return SimpleNamespace(nodeid=f"tests/test_{module}.py::test_{len(fixtures)}",
                               fixturenames=["tmp_path", *fixtures])

    items = [item("a", "short"), item("a"), item("b"), item("c", "long"), item("c"), item("d"), item("a", "long")]
    needed = prefetched.reorder(items)
    assert needed == {"short", "long"}
    assert [i.nodeid.split("_")[1][0] for i in items] == ["b", "d", "a", "a", "a", "c", "c"]
    assert items[2].fixturenames == ["tmp_path", "short"]  # within a module, the order is kept
