import os

# The tests never reach the network; one value for the whole session (set before anything imports
# huggingface_hub, which reads it at import) also lets the warm interpreters of tests/warm_python.py serve them all.
os.environ["HF_HUB_OFFLINE"] = "1"
# One CPU thread per process unless the caller says otherwise, set before torch is imported (it reads the value
# once). The ranks share the cores anyway (Lightning's launcher gives each cpu_count // ranks); the pytest process
# and the single-process scripts would otherwise use every core on tensors too small to split, spinning threads that
# take the cores from the background fixtures' ranks (tests/prefetch.py). The full suite: 580 s instead of 707 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

import lightning_npu  # noqa: E402,F401 -- registers the accelerator and strategies
from lightning_npu import runtime
from tests import quick_tier
from tests.helpers import stop_background
from tests.prefetch import PREFETCHED
from tests.recipe_runs import TRAINED_STEPS, TrainedRun, train_tiny

#: The background fixtures the selected tests read (tests/prefetch.py), started when the session's first test is.
_PREFETCH_NEEDED: set[str] = set()
#: Every collected test's reason not to be in the quick tier (tests/quick_tier.py), selected by -m / -k or not.
_QUICK_TIER_PROBLEMS: list[str] = []


def pytest_itemcollected(item):
    problem = quick_tier.problem(item)
    if problem:
        _QUICK_TIER_PROBLEMS.append(problem)


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what they deselect
def pytest_collection_modifyitems(items):
    if _QUICK_TIER_PROBLEMS:
        raise pytest.UsageError("\n".join(_QUICK_TIER_PROBLEMS))
    _PREFETCH_NEEDED.update(PREFETCHED.reorder(items))


@pytest.fixture(scope="session", autouse=True)
def _start_background_fixtures(tmp_path_factory):
    PREFETCHED.start(_PREFETCH_NEEDED, tmp_path_factory)
    yield
    stop_background()


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


@PREFETCHED.fixture(seconds=20)
def _trained_tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained_tiny_run")
    run = TrainedRun(root, train_tiny(root, *TRAINED_STEPS).stdout)
    return run, run.snapshot()


@pytest.fixture(scope="session")
def trained_tiny_run(_trained_tiny_run):
    """The tiny recipe trained once per session (``train_tiny(root, *TRAINED_STEPS)``, 2 simulated NPUs; in the
    background, tests/prefetch.py), for the tests that only need a trained run. Read-only: a test that writes into it
    uses ``copy_to(tmp_path)``. At the end of the session the run must be as it was trained, or a test leaked into the
    others' input."""
    run, trained = _trained_tiny_run
    yield run
    assert run.snapshot() == trained, (f"a test wrote into the shared trained run {run.root}; "
                                       "write into TrainedRun.copy_to(tmp_path) instead")


@PREFETCHED.fixture(seconds=140)
def layout_parity_runs(tmp_path_factory):
    """``tests/scripts/layout_parity_run.py``'s three launches (2, 4, 2 simulated NPUs): MoE, Qwen3 and DeepSeek
    under tensor and expert parallelism, and plain npu_fsdp with as many data-parallel replicas, from one
    checkpoint of first weights per model. Returns each run's losses (tensors) and its whole record."""
    import torch

    from tests.helpers import SCRIPTS, read_json, run_python

    out = tmp_path_factory.mktemp("layout_parity")
    for stage, devices in (("plain", 2), ("mesh", 4), ("resume", 2)):
        run_python([str(SCRIPTS / "layout_parity_run.py"), "--out", str(out), "--stage", stage], simulate=devices,
                   timeout=2400)
    result = {name: run for stage in ("plain", "mesh", "resume") for name, run in read_json(out / f"{stage}.json").items()}
    return {name: torch.tensor(run["losses"]) for name, run in result.items()}, result


@PREFETCHED.fixture(seconds=80)
def pipeline_runs(tmp_path_factory):
    """``tests/scripts/pipeline_run.py``'s four launches (1, 2, 4, 1 simulated NPUs): pipeline parallelism under the
    Trainer and Fabric against plain npu_fsdp with as many data-parallel replicas. Returns each run's record, and
    under "out" the directory the launches wrote (their checkpoints and predictions)."""
    from tests.helpers import SCRIPTS, read_json, run_python

    out = tmp_path_factory.mktemp("pipeline")
    stages = (("one", 1), ("two", 2), ("four", 4), ("back", 1))
    for stage, devices in stages:
        run_python([str(SCRIPTS / "pipeline_run.py"), "--out", str(out), "--stage", stage], simulate=devices,
                   timeout=1800)
    runs = {name: run for stage, _ in stages for name, run in read_json(out / f"{stage}.json").items()}
    return {**runs, "out": str(out)}  # "out": the launches' directory (checkpoints, predictions)
