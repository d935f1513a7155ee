import os

# The tests never reach the network; one value for the whole session (set before anything imports
# huggingface_hub, which reads it at import) also lets the warm interpreters of tests/warm_python.py serve them all.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402

import lightning_npu  # noqa: E402,F401 -- registers the accelerator and strategies
from lightning_npu import runtime


@pytest.fixture
def simulate(monkeypatch):
    """Turn on the simulated runtime with ``n`` devices for this test (and off again afterwards)."""

    def enable(n: int = 2) -> None:
        monkeypatch.setenv("LIGHTNING_NPU_SIMULATE", str(n))
        runtime.reset()

    yield enable
    monkeypatch.delenv("LIGHTNING_NPU_SIMULATE", raising=False)
    runtime.reset()


@pytest.fixture(autouse=True)
def _no_simulation_unless_asked(monkeypatch):
    monkeypatch.delenv("LIGHTNING_NPU_SIMULATE", raising=False)
    runtime.reset()
    yield
    runtime.reset()
