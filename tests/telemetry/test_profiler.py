"""NPUProfiler: torch_npu's profiler with NPU + CPU activities, a wait/warmup/active schedule and traces in the
run's profiler folder (checked against the strict fake), and a real CPU trace on the simulated runtime."""

import json
import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_npu import NPUProfiler, runtime
from lightning_npu.runtime.npu import NPURuntime
from lightning_npu.runtime.simulated import SimulationWarning
from tests.npu_fake import install_fake_torch_npu


def _fit(tmp_path, profiler, accelerator, model=None, max_steps=6):
    trainer = Trainer(accelerator=accelerator, devices=1, max_steps=max_steps, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, profiler=profiler)
    trainer.fit(model or BoringModel())
    return trainer


@pytest.fixture
def fake(monkeypatch):
    fake = install_fake_torch_npu(monkeypatch)
    runtime.reset()
    yield fake
    runtime.reset()


def test_npu_profiler_records_npu_and_cpu_on_the_schedule_into_the_run_folder(fake, tmp_path):
    """Catches a wrong torch_npu.profiler call (activities, schedule, trace dir) or a schedule that never steps.

    The model trains on the CPU; the profiler goes through the real NPU runtime, onto the fake torch_npu.
    """
    assert isinstance(runtime.get_runtime(), NPURuntime)
    _fit(tmp_path, NPUProfiler(wait=1, warmup=1, active=2), accelerator="cpu")
    import torch_npu

    activity = torch_npu.profiler.ProfilerActivity
    (profile,) = fake.calls_to("profiler.profile")
    assert profile["activities"] == [activity.CPU, activity.NPU]
    assert fake.calls_to("profiler.schedule") == [{"wait": 1, "warmup": 1, "active": 2, "repeat": 1}]
    assert fake.calls_to("profiler.tensorboard_trace_handler") == [{"dir_name": str(tmp_path / "profiler")}]
    # Steps 0 wait, 1 warmup, 2-3 recorded, then one trace; repeat=1 records nothing more in steps 4-5.
    assert fake.traces == [{"dir_name": str(tmp_path / "profiler"), "worker_name": None, "steps": [2, 3]}]


def test_the_fake_rejects_what_torch_npu_would_silently_change(fake):
    """Catches the fake accepting calls torch_npu would refuse, or ignore with only a printed warning."""
    import torch_npu

    prof = torch_npu.profiler
    with pytest.raises(TypeError, match="not torch_npu.profiler.ProfilerActivity"):
        prof.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    with pytest.raises(AttributeError):
        prof.ProfilerActivity.CUDA
    with pytest.raises(TypeError, match="unexpected keyword argument 'activity'"):
        prof.profile(activity=[prof.ProfilerActivity.NPU])
    with pytest.raises(TypeError, match="too many positional"):
        prof.profile([prof.ProfilerActivity.NPU])  # every profile argument is keyword-only
    with pytest.raises(TypeError, match="not callable"):
        prof.profile(schedule=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'dir'"):
        prof.tensorboard_trace_handler(dir="traces")
    with pytest.raises(ValueError, match="active=0"):
        prof.schedule(wait=1, active=0)
    with pytest.raises(TypeError, match="not a torch_npu.profiler.ProfilerAction"):
        prof.profile(schedule=torch.profiler.schedule(wait=0, warmup=0, active=1))
    with pytest.raises(AttributeError):
        prof.export_chrome_trace  # a method of profile, not a module name
    action = prof.ProfilerAction
    steps = [prof.schedule(wait=1, warmup=1, active=2, repeat=1)(step) for step in range(5)]
    assert steps == [action.NONE, action.WARMUP, action.RECORD, action.RECORD_AND_SAVE, action.NONE]


def test_npu_profiler_on_the_simulated_runtime_writes_a_cpu_trace_and_warns_once(simulate, tmp_path):
    """Catches the simulated runtime lacking the profiler primitive, writing no trace, or warning every session."""
    simulate(1)
    profiler = NPUProfiler(wait=1, warmup=1, active=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, profiler, accelerator="npu")
        trainer.validate(BoringModel(), verbose=False)  # a second profiling session in the same process
    cpu_only = [w for w in caught if issubclass(w.category, SimulationWarning) and "profiling the CPU only" in str(w.message)]
    assert len(cpu_only) == 1
    traces = sorted((tmp_path / "profiler").glob("*.pt.trace.json"))
    assert len(traces) == 1  # fit's window; validate ran no batch, so it recorded none
    names = {event.get("name") for event in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names
    assert "[pl][profile][Strategy]NPUSingleStrategy.training_step" in names


@pytest.mark.parametrize(("kwargs", "bad"), [({"active": 0}, "active=0"), ({"wait": -1}, "wait=-1"),
                                             ({"warmup": 1.5}, "warmup=1.5"), ({"repeat": True}, "repeat=True")])
def test_schedule_counts_are_checked_when_the_profiler_is_built(kwargs, bad):
    """Catches bad counts reaching torch_npu, which resets them with only a printed warning."""
    with pytest.raises(ValueError, match=bad):
        NPUProfiler(**kwargs)
