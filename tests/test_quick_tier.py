"""The quick tier's own rule (tests/quick_tier.py): a test not marked slow that requests a slow fixture, directly
or through another fixture, stops the collection, naming both."""

import pytest

from tests import quick_tier


class _Collected:
    """What the rule reads of a collected test: its id, its markers and the fixtures it requests (all of them)."""

    def __init__(self, nodeid: str, fixturenames: list[str], slow: bool) -> None:
        self.nodeid, self.fixturenames, self._slow = nodeid, fixturenames, slow

    def get_closest_marker(self, name: str):
        return pytest.mark.slow if name == "slow" and self._slow else None


def test_a_quick_test_requesting_a_slow_fixture_is_named_with_the_fixture():
    problem = quick_tier.problem(_Collected("tests/test_x.py::test_y", ["tmp_path", "trained_tiny_run",
                                                                          "_trained_tiny_run"], slow=False))
    assert problem is not None
    assert "tests/test_x.py::test_y" in problem and "_trained_tiny_run" in problem and "mark the test" in problem


def test_slow_tests_and_quick_tests_without_slow_fixtures_pass_the_rule():
    assert quick_tier.problem(_Collected("t::slow", ["pipeline_runs"], slow=True)) is None
    assert quick_tier.problem(_Collected("t::quick", ["tmp_path", "simulate"], slow=False)) is None


def test_a_fixture_declared_slow_counts_and_cannot_share_a_name():
    @quick_tier.slow_fixture(name="_quick_tier_probe_launch")
    def launch():
        return None

    assert quick_tier.is_slow_fixture("_quick_tier_probe_launch")
    with pytest.raises(ValueError, match="two slow fixtures are named 'pipeline_runs'"):
        quick_tier.slow_fixture(name="pipeline_runs")(lambda: None)
