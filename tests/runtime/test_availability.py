"""Without an NPU (and without simulation), accelerator='npu' fails with one message that names the cause."""

import json
import re
import sys
import textwrap

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer

import lightning_npu
from lightning_npu import NPUAccelerator, NPUUnavailableError
from lightning_npu.facts import devices
from lightning_npu.runtime import probe, simulated
from tests.helpers import REPO, run_python


def test_trainer_without_npu_names_the_cause():
    with pytest.raises(NPUUnavailableError, match="accelerator='npu' cannot be used: torch_npu is not installed"):
        Trainer(accelerator="npu", devices=1)
    with pytest.raises(NPUUnavailableError, match="LIGHTNING_NPU_SIMULATE"):
        Fabric(accelerator="npu", devices=1)
    assert NPUAccelerator.is_available() is False


def test_import_touches_no_device_and_needs_no_npu():
    out = run_python(["-c", "import lightning_npu, sys; print('torch_npu' in sys.modules)"], simulate=None, fresh=True)
    assert out.stdout.strip() == "False"


def test_registration_is_idempotent():
    from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    choose = _AcceleratorConnector._choose_strategy
    lightning_npu.register()
    lightning_npu.register()
    assert _AcceleratorConnector._choose_strategy is choose  # wrapped once, not twice
    assert AcceleratorRegistry["npu"]["accelerator"] is NPUAccelerator
    assert ACCELERATOR_REGISTRY["npu"]["accelerator"] is NPUAccelerator
    for name in ("npu_single", "npu_ddp", "npu_fsdp"):
        assert name in StrategyRegistry.available_strategies()
        assert name in STRATEGY_REGISTRY.available_strategies()
    assert StrategyRegistry["npu_fsdp"]["strategy"] is lightning_npu.NPUFSDPStrategy
    assert STRATEGY_REGISTRY["npu_fsdp"]["strategy"] is lightning_npu.NPUFabricFSDPStrategy


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "is set but empty, which hides every NPU"),
        ("0, 1", "malformed: torch_npu reads only device\\(s\\) 0 from it.*e.g. 0,1$"),
        ("0,,2", "malformed: torch_npu reads only device\\(s\\) 0 from it.*e.g. 0,2$"),
        (" 0,1", "malformed and hides every NPU.*e.g. 0,1$"),
        ("npu0", "malformed and hides every NPU"),
        ("1,0", "not strictly ascending.*e.g. 0,1$"),
        ("2,2", "not strictly ascending.*e.g. 2$"),
    ],
)
def test_visible_devices_problems(monkeypatch, value, message):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", value)
    result = probe.probe_npu()
    assert not result.available
    assert re.search(message, result.reason)


@pytest.mark.parametrize(
    ("value", "ids"),
    [("0,1,3", [0, 1, 3]), ("0,1,", [0, 1]), ("0,1 ", [0, 1]), ("0,1\n", [0, 1]), ("0, 1", [0]), ("0,,1", [0]),
     (" 0,1", []), ("4,5x6", [4, 5]), ("2,1", [2, 1]), ("", [])],
)
def test_visible_device_ids_are_read_like_torch_npu_reads_them(value, ids):
    """Catches a parser that differs from torch_npu's _parse_visible_devices (trailing comma or space accepted,
    reading stops at the first empty field or stray character)."""
    assert devices.visible_device_ids(value) == ids


@pytest.mark.parametrize(("value", "count"), [("0,1,", 2), ("0,1 ", 2), ("2,3,5", 3), ("0,1,3\n", 3)])
def test_values_torch_npu_reads_in_full_pass_the_probe_with_its_count(monkeypatch, value, count):
    """Catches the probe refusing ASCEND_RT_VISIBLE_DEVICES values torch_npu reads exactly as written."""
    from tests.npu_fake import install_fake_torch_npu

    install_fake_torch_npu(monkeypatch, device_count=8)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", value)
    assert devices.visible_devices_problem(value) is None
    result = probe.probe_npu()
    assert (result.available, result.device_count, result.reason) == (True, count, None)


def test_version_mismatch_is_explained():
    assert probe.version_mismatch("2.13.0+cpu", "2.13.0.post2") is None
    reason = str(probe.version_mismatch("2.13.0", "2.6.0.post3"))
    assert "torch 2.13.0 and torch_npu 2.6.0.post3 do not match" in reason
    assert "torch-npu==2.13.0" in reason


def test_cann_missing_is_explained():
    error = ImportError("libhccl.so: cannot open shared object file: No such file or directory")
    reason = str(probe.import_problem(error))
    assert "CANN libraries are missing" in reason
    assert "set_env.sh" in reason


def _stand_in_torch_npu(tmp_path, version, body):
    """A torch_npu distribution on sys.path that behaves like a broken real one (never the real package)."""
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(body))
    dist = tmp_path / f"torch_npu-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch-npu\nVersion: {version}\n")
    return tmp_path


PROBE = "import json, lightning_npu.runtime.probe as p; r = p.probe_npu(); print(json.dumps([r.available, r.reason]))"


@pytest.mark.slow
def test_probe_reports_missing_cann_from_a_real_import(tmp_path):
    release = ".".join(map(str, probe.release(torch.__version__)))
    path = _stand_in_torch_npu(
        tmp_path, release, 'raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")'
    )
    out = run_python(["-c", PROBE], simulate=None, env={"PYTHONPATH": f"{path}:{REPO}"}, fresh=True)
    available, reason = json.loads(out.stdout.strip().splitlines()[-1])
    assert not available
    assert "CANN libraries are missing" in reason and "libhccl.so" in reason


@pytest.mark.slow
def test_probe_reports_version_mismatch_before_importing(tmp_path):
    path = _stand_in_torch_npu(tmp_path, "2.1.0", 'raise AssertionError("must not be imported")')
    out = run_python(["-c", PROBE], simulate=None, env={"PYTHONPATH": f"{path}:{REPO}"}, fresh=True)
    available, reason = json.loads(out.stdout.strip().splitlines()[-1])
    assert not available
    assert "torch_npu 2.1.0 do not match" in reason


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_bad_simulate_value_is_rejected(monkeypatch, value):
    monkeypatch.setenv("LIGHTNING_NPU_SIMULATE", value)
    lightning_npu.runtime.reset()
    with pytest.raises(ValueError, match=f"LIGHTNING_NPU_SIMULATE='{value}' is not a number of devices"):
        Trainer(accelerator="npu", devices=1)


def test_simulation_is_never_implicit():
    assert devices.simulated_count(None) == 0
    assert devices.simulated_count("0") == 0
    assert devices.simulated_count("4") == 4


def test_simulation_warns_once_per_process(simulate):
    with pytest.warns(simulated.SimulationWarning, match="runs on the CPU with gloo, simulating 2 NPU"):
        simulate(2)
        Trainer(accelerator="npu", devices=2, logger=False)
        Trainer(accelerator="npu", devices=1, logger=False)
    assert sys.modules.get("torch_npu") is None
