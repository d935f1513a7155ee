"""Which strategy and precision plugin the Trainer and Fabric end up with on accelerator='npu'."""

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_npu import (
    NPUAccelerator,
    NPUDDPStrategy,
    NPUFabricDDPStrategy,
    NPUFabricFSDPStrategy,
    NPUFabricSingleStrategy,
    NPUFSDPStrategy,
    NPUSingleStrategy,
)

TRAINER_KW = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}


@pytest.mark.parametrize(
    ("devices", "strategy", "expected"),
    [
        (1, "auto", NPUSingleStrategy),
        ([1], "auto", NPUSingleStrategy),
        (2, "auto", NPUDDPStrategy),
        ("0,1", "auto", NPUDDPStrategy),
        (-1, "auto", NPUDDPStrategy),
        (1, "npu_single", NPUSingleStrategy),
        (2, "npu_ddp", NPUDDPStrategy),
        (2, "npu_fsdp", NPUFSDPStrategy),
        (1, "npu_fsdp", NPUFSDPStrategy),
    ],
)
def test_trainer_strategy_choice(simulate, devices, strategy, expected):
    simulate(2)
    trainer = Trainer(accelerator="npu", devices=devices, strategy=strategy, **TRAINER_KW)
    assert type(trainer.strategy) is expected
    assert isinstance(trainer.accelerator, NPUAccelerator)


@pytest.mark.parametrize(
    ("devices", "strategy", "expected"),
    [
        (1, "auto", NPUFabricSingleStrategy),
        (2, "auto", NPUFabricDDPStrategy),
        (2, "npu_ddp", NPUFabricDDPStrategy),
        (2, "npu_fsdp", NPUFabricFSDPStrategy),
        (1, "npu_single", NPUFabricSingleStrategy),
    ],
)
def test_fabric_strategy_choice(simulate, devices, strategy, expected):
    simulate(2)
    fabric = Fabric(accelerator="npu", devices=devices, strategy=strategy)
    assert type(fabric.strategy) is expected


def test_strategy_instances_are_kept(simulate):
    simulate(2)
    strategy = NPUFSDPStrategy(zero_stage=2, activation_checkpointing_ratio=0.25)
    trainer = Trainer(accelerator=NPUAccelerator(), devices=2, strategy=strategy, **TRAINER_KW)
    assert trainer.strategy is strategy
    assert trainer.strategy.options.zero_stage == 2
    assert len(trainer.strategy.parallel_devices) == 2


def test_single_device_strategy_runs_on_the_requested_device(simulate):
    simulate(4)
    trainer = Trainer(accelerator="npu", devices=[3], **TRAINER_KW)
    # Lightning's own choice would be SingleDeviceStrategy(device="cpu"); the simulated NPU is a CPU device too,
    # so the proof is the strategy type and that the device came from devices=.
    assert type(trainer.strategy) is NPUSingleStrategy
    assert trainer.strategy.root_device == torch.device("cpu")
    assert trainer.num_devices == 1


@pytest.mark.parametrize(
    ("precision", "plugin_type", "dtype"),
    [
        ("bf16-mixed", MixedPrecision, torch.bfloat16),
        ("16-mixed", MixedPrecision, torch.float16),
        ("bf16-true", HalfPrecision, torch.bfloat16),
        ("32-true", Precision, None),
    ],
)
def test_precision_autocasts_on_the_runtime_device(simulate, precision, plugin_type, dtype):
    simulate(2)
    trainer = Trainer(accelerator="npu", devices=1, precision=precision, **TRAINER_KW)
    plugin = trainer.precision_plugin
    # bf16-mixed is Lightning's MixedPrecision that also clips for fused optimizers (no loss scaler to unscale).
    assert type(plugin) is plugin_type or (precision == "bf16-mixed" and type(plugin).__base__ is plugin_type)
    if plugin_type is MixedPrecision:
        assert plugin.device == "cpu"  # the simulated NPU's device type, not Lightning's "cuda"
        with plugin.forward_context():
            out = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        assert out.dtype == dtype
    if precision == "16-mixed":
        assert isinstance(plugin.scaler, torch.amp.GradScaler)
        assert plugin.scaler.is_enabled()


def test_fp16_under_fsdp_uses_the_sharded_scaler(simulate):
    simulate(2)
    trainer = Trainer(accelerator="npu", devices=2, strategy="npu_fsdp", precision="16-mixed", **TRAINER_KW)
    assert isinstance(trainer.precision_plugin.scaler, ShardedGradScaler)
    fabric = Fabric(accelerator="npu", devices=2, strategy="npu_fsdp", precision="16-mixed")
    assert isinstance(fabric.strategy.precision.scaler, ShardedGradScaler)


def test_a_cuda_precision_plugin_is_converted(simulate):
    simulate(2)
    trainer = Trainer(accelerator="npu", devices=1, plugins=[MixedPrecision("bf16-mixed", "cuda")], **TRAINER_KW)
    assert trainer.precision_plugin.device == "cpu"
    fabric = Fabric(accelerator="npu", devices=1, plugins=[FabricMixedPrecision("bf16-mixed", "cuda")])
    assert fabric.strategy.precision.device == "cpu"


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed", "ddp_spawn", "single_device"])
def test_lightning_cuda_strategies_are_rejected_on_npu(simulate, strategy):
    simulate(2)
    with pytest.raises(ValueError, match=f"strategy='{strategy}' cannot run on accelerator='npu'.*'npu_ddp'"):
        Trainer(accelerator="npu", devices=2, strategy=strategy, **TRAINER_KW)


def test_lightning_strategy_instance_is_rejected_on_npu(simulate):
    from lightning.pytorch.strategies import DDPStrategy

    simulate(2)
    with pytest.raises(ValueError, match="'DDPStrategy' cannot run on accelerator='npu'"):
        Trainer(accelerator="npu", devices=2, strategy=DDPStrategy(), **TRAINER_KW)
    with pytest.raises(ValueError, match="cannot run on accelerator='npu'"):
        Fabric(accelerator="npu", devices=2, strategy="ddp")


@pytest.mark.parametrize(
    ("precision", "reason"),
    [("transformer-engine", "no fp8 units"), ("64-true", "float64"), ("transformer-engine-float16", "NVIDIA"),
     ("int8", "have no backward.*AdamW8bit.*quantize the frozen base.*base_quantization int8 or nf4"),
     ("int8-mixed", "have no backward")],
)
def test_unsupported_precisions_fail_before_training(simulate, precision, reason):
    simulate(2)
    with pytest.raises(ValueError, match=f"precision='{precision}' is not supported on NPUs.*{reason}"):
        Trainer(accelerator="npu", devices=1, precision=precision, **TRAINER_KW)
    with pytest.raises(ValueError, match=f"precision='{precision}' is not supported on NPUs"):
        Fabric(accelerator="npu", devices=1, precision=precision)


def test_other_accelerators_are_untouched():
    trainer = Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", **TRAINER_KW)
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy"
    assert trainer.precision_plugin.device == "cpu"
    trainer = Trainer(accelerator="cpu", devices=2, **TRAINER_KW)
    assert type(trainer.strategy).__name__ == "DDPStrategy"


def test_npu_strategies_also_run_on_other_accelerators():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="npu_fsdp", precision="16-mixed", **TRAINER_KW)
    assert type(trainer.strategy) is NPUFSDPStrategy
    assert isinstance(trainer.precision_plugin.scaler, ShardedGradScaler)
