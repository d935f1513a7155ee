"""The quick tier (``-m "not slow"``) stays quick: a test not marked slow may not request a slow fixture, directly or
through another fixture. Slow fixtures are the background fixtures (``@PREFETCHED.fixture``, tests/prefetch.py) and
those declared with ``@slow_fixture`` (a fixture that starts processes or trains); collection fails on a quick test
that requests one (``problem``, called by tests/conftest.py for every collected test), naming the test and the
fixture, since the quick tier would otherwise wait for a launch of a minute or more without saying why."""

from __future__ import annotations

from typing import Callable, Optional

import pytest

from tests.prefetch import PREFETCHED

#: The names of the fixtures declared with ``@slow_fixture``.
SLOW_FIXTURES: set[str] = set()


def slow_fixture(**options) -> Callable:
    """``@pytest.fixture(**options)`` for a fixture that starts processes or trains: only tests marked slow may
    request it."""

    def register(body: Callable) -> Callable:
        name = options.get("name", body.__name__)
        if name in SLOW_FIXTURES or name in PREFETCHED:
            raise ValueError(f"two slow fixtures are named {name!r}: the quick tier's check knows them by name")
        SLOW_FIXTURES.add(name)
        return pytest.fixture(**options)(body)

    return register


def is_slow_fixture(name: str) -> bool:
    return name in SLOW_FIXTURES or name in PREFETCHED


def problem(item: pytest.Item) -> Optional[str]:
    """Why ``item`` may not be in the quick tier (it is not marked slow and requests a slow fixture), or None."""
    if item.get_closest_marker("slow") is not None:
        return None
    slow = sorted(name for name in getattr(item, "fixturenames", ()) if is_slow_fixture(name))
    if not slow:
        return None
    return (f"{item.nodeid} is in the quick tier (not marked slow) but requests the slow fixture "
            f"{', '.join(slow)} (it starts processes or trains; requested directly or through another fixture): "
            f"mark the test @pytest.mark.slow, or give it a fixture that launches nothing")
