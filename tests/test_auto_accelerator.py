"""``accelerator="auto"`` (the Trainer's, Fabric's and the LightningCLI's default) means the NPUs when the runtime
sees NPUs; ``"gpu"`` / ``"cuda"`` there fail naming them; machines without NPUs, and CUDA machines, keep Lightning's
choice."""

import logging
import math
import sys

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_npu import (
    NPUAccelerator,
    NPUDDPStrategy,
    NPUFabricDDPStrategy,
    NPUFabricSingleStrategy,
    NPUSingleStrategy,
    compat,
    runtime,
)
from lightning_npu.lightning_patches import connectors
from tests.helpers import SCRIPTS, read_json, run_python
from tests.npu_fake import install_fake_torch_npu

TRAINER_KW = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
CONNECTORS = (compat.TrainerConnector, compat.FabricConnector)


@pytest.mark.parametrize(("count", "trainer_strategy", "fabric_strategy"),
                         [(1, NPUSingleStrategy, NPUFabricSingleStrategy), (2, NPUDDPStrategy, NPUFabricDDPStrategy)])
def test_defaults_pick_every_visible_npu_and_the_npu_strategy(simulate, caplog, count, trainer_strategy,
                                                              fabric_strategy):
    simulate(count)
    caplog.set_level(logging.INFO)
    trainer = Trainer(**TRAINER_KW)
    assert isinstance(trainer.accelerator, NPUAccelerator)
    assert type(trainer.strategy) is trainer_strategy
    assert trainer.num_devices == count
    fabric = Fabric()
    assert isinstance(fabric.accelerator, NPUAccelerator)
    assert type(fabric.strategy) is fabric_strategy
    lines = [record.getMessage() for record in caplog.records if "accelerator='auto'" in record.getMessage()]
    assert lines == [f"accelerator='auto' chose 'npu': the runtime sees {count} Ascend NPU(s) (simulated on the CPU:"
                     f" LIGHTNING_NPU_SIMULATE={count}). Pass accelerator='cpu' to train on the CPU."] * 2


def test_auto_keeps_the_devices_strategy_and_precision_rules_of_npu(simulate):
    simulate(4)
    trainer = Trainer(devices=[1, 3], strategy="npu_fsdp", precision="bf16-mixed", **TRAINER_KW)
    assert isinstance(trainer.accelerator, NPUAccelerator)
    assert trainer.num_devices == 2
    assert trainer.precision_plugin.device == "cpu"  # autocast on the runtime's device type, not CUDA's
    with pytest.raises(ValueError, match="devices=5 asks for more NPUs than are visible: 4 NPU"):
        Trainer(devices=5, **TRAINER_KW)
    with pytest.raises(ValueError, match="strategy='ddp' cannot run on accelerator='npu'.*'npu_ddp'"):
        Fabric(devices=2, strategy="ddp")
    for precision in ("64-true", "int8"):
        with pytest.raises(ValueError, match=f"precision='{precision}' is not supported on NPUs"):
            Trainer(precision=precision, **TRAINER_KW)
        with pytest.raises(ValueError, match=f"precision='{precision}' is not supported on NPUs"):
            Fabric(precision=precision)


@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_gpu_on_a_machine_with_npus_and_no_cuda_names_the_npus_and_the_fix(simulate, accelerator):
    simulate(2)
    message = (f"accelerator='{accelerator}' asks for CUDA GPUs, but this machine has none; the runtime sees 2"
               " Ascend NPU.*Use accelerator='npu', or leave accelerator='auto', which picks the NPUs")
    with pytest.raises(ValueError, match=message):
        Trainer(accelerator=accelerator, **TRAINER_KW)
    with pytest.raises(ValueError, match=message):
        Fabric(accelerator=accelerator)


def test_without_npus_nothing_changes():
    trainer = Trainer(**TRAINER_KW)
    assert type(trainer.accelerator).__name__ == "CPUAccelerator"
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy"
    assert type(Fabric().accelerator).__name__ == "CPUAccelerator"
    with pytest.raises(MisconfigurationException, match="No supported gpu backend found"):
        Trainer(accelerator="gpu", **TRAINER_KW)
    with pytest.raises(RuntimeError, match="No supported gpu backend found"):
        Fabric(accelerator="gpu")
    with pytest.raises(MisconfigurationException, match="CUDAAccelerator` can not run on your system"):
        Trainer(accelerator="cuda", **TRAINER_KW)
    assert "torch_npu" not in sys.modules


def test_probing_at_auto_initialises_no_device(monkeypatch):
    fake = install_fake_torch_npu(monkeypatch, device_count=0)
    assert all(connector._choose_auto_accelerator() == "cpu" for connector in CONNECTORS)
    assert type(Trainer(**TRAINER_KW).accelerator).__name__ == "CPUAccelerator"
    assert not fake.initialized

    runtime.reset()
    fake = install_fake_torch_npu(monkeypatch, device_count=2)
    trainer = Trainer(**TRAINER_KW)
    assert isinstance(trainer.accelerator, NPUAccelerator)
    assert trainer.strategy.parallel_devices == [torch.device("npu", 0), torch.device("npu", 1)]
    assert not fake.initialized  # building the Trainer probes and counts; the run's setup_device initialises


def test_cuda_machines_keep_lightnings_choice_and_are_not_probed(simulate, monkeypatch):
    simulate(2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def probe():
        raise AssertionError("NPUs probed on a CUDA machine")

    monkeypatch.setattr(connectors, "is_available", probe)
    assert [connector._choose_auto_accelerator() for connector in CONNECTORS] == ["cuda", "cuda"]
    connectors.refuse_cuda_without_cuda("gpu")
    connectors.refuse_cuda_without_cuda("cuda")


def _train(args, simulate=2):
    out = args[args.index("--out") + 1]
    run_python([str(SCRIPTS / "defaults_run.py"), *args], simulate=simulate)
    return read_json(f"{out}/result.json"), [read_json(f"{out}/rank{rank}.json") for rank in range(simulate)]


@pytest.mark.slow
@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_a_project_with_the_defaults_trains_on_every_simulated_npu(tmp_path, api):
    result, ranks = _train(["--api", api, "--out", str(tmp_path)])
    assert result["accelerator"] == "NPUAccelerator"
    assert result["strategy"] == {"trainer": "NPUDDPStrategy", "fabric": "NPUFabricDDPStrategy"}[api]
    assert result["world_size"] == 2
    assert len(result["losses"]) == 4 and all(math.isfinite(loss) for loss in result["losses"])
    # Each rank trained on its own batches; DDP's all-reduce left them with the same weights.
    assert ranks[0]["batch_sums"] != ranks[1]["batch_sums"]
    assert ranks[0]["weights"] == ranks[1]["weights"]


@pytest.mark.slow
def test_lightning_cli_with_the_default_trainer_trains_on_every_simulated_npu(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model:\n  out: {tmp_path / 'out'}\n"
        "trainer:\n  max_steps: 2\n  logger: false\n  enable_checkpointing: false\n  enable_progress_bar: false\n"
        "  enable_model_summary: false\n"
    )
    run_python([str(SCRIPTS / "cli_run.py"), "fit", "--config", str(config)])
    result = read_json(tmp_path / "out" / "result.json")
    assert result["accelerator"] == "NPUAccelerator"
    assert result["strategy"] == "NPUDDPStrategy"
    assert result["world_size"] == 2
    assert len(result["losses"]) == 2
