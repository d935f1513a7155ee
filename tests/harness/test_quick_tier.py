"""The quick tier's collection check (tests/quick_tier.py): a test not marked slow that requests a slow fixture is
named with that fixture; a slow test, or a quick one with quick fixtures only, passes."""

from types import SimpleNamespace

import pytest

from tests import quick_tier


def item(*fixtures, slow=False):
    return SimpleNamespace(nodeid="tests/room/test_x.py::test_y", fixturenames=["tmp_path", *fixtures],
                           get_closest_marker=lambda name: object() if slow and name == "slow" else None)


def test_a_quick_test_reading_a_background_fixture_is_named_with_it():
    """Catches the quick tier waiting on an 80-second launch (the pipeline fixture), directly or through a fixture
    that reads it (pytest lists both in fixturenames)."""
    problem = quick_tier.problem(item("trained_tiny_run", "_trained_tiny_run"))
    assert problem.startswith("tests/room/test_x.py::test_y is in the quick tier (not marked slow)")
    assert "the slow fixture _trained_tiny_run (" in problem and "mark the test @pytest.mark.slow" in problem
    assert quick_tier.problem(item("_trained_tiny_run", slow=True)) is None
    assert quick_tier.problem(item("simulate")) is None


def test_a_fixture_declared_slow_counts_and_its_name_is_taken_once(monkeypatch):
    monkeypatch.setattr(quick_tier, "SLOW_FIXTURES", set())

    @quick_tier.slow_fixture(scope="module")
    def launches():
        return None

    assert "launches" in quick_tier.problem(item("launches"))
    assert quick_tier.problem(item("launches", slow=True)) is None
    with pytest.raises(ValueError, match="two slow fixtures are named 'launches'"):
        quick_tier.slow_fixture(name="launches")(lambda: None)
    with pytest.raises(ValueError, match="two slow fixtures are named 'pipeline_runs'"):
        quick_tier.slow_fixture(name="pipeline_runs")(lambda: None)
