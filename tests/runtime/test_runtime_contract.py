"""Every torch.npu call the plugin makes, run against the strict fake of each recorded torch_npu release
(2.6.0, 2.13.0, 2.14.0: real names and signatures only; documented semantics)."""

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer

from lightning_npu import NPUAccelerator, NPUDDPStrategy, NPUSingleStrategy, compat, runtime
from lightning_npu.runtime.npu import NPURuntime
from tests.npu_fake import RELEASES, install_fake_torch_npu


@pytest.fixture(params=RELEASES)
def npu(monkeypatch, request):
    def install(**kwargs):
        fake = install_fake_torch_npu(monkeypatch, release=request.param, **kwargs)
        runtime.reset()
        return fake

    yield install
    runtime.reset()


def test_runtime_calls_match_torch_npu(npu):
    fake = npu(device_count=4, device_name="Ascend910B3")
    rt = runtime.get_runtime()
    assert isinstance(rt, NPURuntime)
    device = rt.device(1)
    assert device == torch.device("npu", 1)
    assert rt.device_count() == 4
    rt.set_device(device)
    rt.synchronize(device)
    rt.set_memory_fraction(1, device)  # an int from YAML must reach torch_npu as a float
    assert isinstance(rt.memory_stats(device), dict)
    assert rt.max_memory_allocated(device) == 0
    rt.reset_peak_memory_stats(device)
    assert rt.total_memory(device) == 64 * 2**30
    rt.empty_cache()
    assert rt.device_name(1) == "Ascend910B3"
    assert rt.chip(1).peak_bf16_flops == pytest.approx(294.9e12)
    assert isinstance(rt.grad_scaler(sharded=False), torch.amp.GradScaler)
    assert fake.calls_to("npu.set_per_process_memory_fraction") == [{"fraction": 1.0, "device": device}]
    assert fake.calls_to("npu.set_device") == [{"device": device}]


def test_sharded_loss_scaler_is_torch_npus_own_built_as_every_release_accepts(npu):
    """Breakage caught: FSDP's ShardedGradScaler bound before torch_npu swaps in its own (torch's, whose
    default device is CUDA), or built with ``device=``, which torch_npu 2.6.0's constructor does not take."""
    from torch.distributed.fsdp import sharded_grad_scaler

    fake = npu(device_count=2)
    scaler = runtime.get_runtime().grad_scaler(sharded=True)
    assert type(scaler) is sharded_grad_scaler.ShardedGradScaler
    assert type(scaler).__module__ == "torch_npu.npu.amp.sharded_grad_scaler"
    assert fake.calls_to("_ShardedGradScaler") == [{}]


def test_visible_devices_mask_limits_the_count(npu, monkeypatch):
    npu(device_count=8)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,3")
    runtime.reset()
    assert runtime.get_runtime().device_count() == 2


def test_trainer_on_fake_npus_uses_npu_devices(npu):
    fake = npu(device_count=2)
    trainer = Trainer(accelerator=NPUAccelerator(memory_fraction=0.8), devices=2, logger=False)
    assert type(trainer.strategy) is NPUDDPStrategy
    assert trainer.strategy.parallel_devices == [torch.device("npu", 0), torch.device("npu", 1)]
    assert trainer.strategy._get_process_group_backend() == "hccl"
    trainer.strategy.accelerator.setup_device(torch.device("npu", 1))
    assert fake.calls_to("npu.set_per_process_memory_fraction") == [{"fraction": 0.8, "device": torch.device("npu", 1)}]
    trainer.strategy.accelerator.teardown()
    assert len(fake.calls_to("npu.empty_cache")) == 1


def test_single_npu_strategy_targets_the_npu(npu):
    npu(device_count=4)
    trainer = Trainer(accelerator="npu", devices=[2], precision="bf16-mixed", logger=False)
    assert type(trainer.strategy) is NPUSingleStrategy
    assert trainer.strategy.root_device == torch.device("npu", 2)
    assert trainer.precision_plugin.device == "npu"


def test_fp16_uses_the_npu_loss_scaler(npu):
    fake = npu(device_count=1)
    trainer = Trainer(accelerator="npu", devices=1, precision="16-mixed", logger=False)
    assert trainer.precision_plugin.device == "npu"
    assert len(fake.calls_to("npu.amp.GradScaler")) == 1


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_on_910a_suggests_fp16(npu, precision):
    npu(device_count=8, device_name="Ascend910A", bf16_supported=False)
    message = f"precision='{precision}' is not supported on Ascend910A \\(no bf16 units\\); use precision='16-mixed'"
    with pytest.raises(ValueError, match=message):
        Trainer(accelerator="npu", devices=1, precision=precision, logger=False)
    with pytest.raises(ValueError, match=message):
        Fabric(accelerator="npu", devices=1, precision=precision)


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_cpu_offload_adds_a_host_backend_beside_hccl(npu, cpu_offload):
    """hccl refuses CPU tensors; with offload, clip_grad_norm_ and the fp16 scaler reduce CPU DTensors. The
    simulation's gloo takes both, so the decision itself is tested: it failed with a pure 'hccl' group."""
    from lightning_npu import NPUFSDPStrategy

    npu(device_count=2, device_name="Ascend910B3")
    trainer = Trainer(accelerator="npu", devices=2, strategy=NPUFSDPStrategy(cpu_offload=cpu_offload), logger=False)
    expected = "cpu:gloo,npu:hccl" if cpu_offload else "hccl"
    assert trainer.strategy._get_process_group_backend() == expected


def test_offloaded_parameters_are_initialised_on_the_npu_then_moved_to_the_host(npu, monkeypatch):
    """DTensor offsets only the mesh device's generator per rank: shards initialised on the CPU of an NPU mesh
    would draw the same numbers on every rank. The simulation's mesh is the CPU, so it cannot show this; the
    decision is tested: the first values are made on the NPU and offloaded afterwards (before: on the CPU)."""
    from torch import nn

    from lightning_npu import NPUFSDPStrategy
    from lightning_npu.strategies import fsdp, initial_state

    npu(device_count=2, device_name="Ascend910B3")
    trainer = Trainer(accelerator="npu", devices=2, strategy=NPUFSDPStrategy(cpu_offload=True), logger=False)
    strategy = trainer.strategy
    strategy.parallel_mesh = "mesh"  # parallelize is replaced below: no mesh is built
    steps = []
    monkeypatch.setattr(initial_state, "capture", lambda model, built=None: "state")
    monkeypatch.setattr(fsdp, "parallelize", lambda *args: steps.append("shard"))
    monkeypatch.setattr(initial_state, "apply", lambda model, state, device: steps.append(("initialise", device)))
    monkeypatch.setattr(fsdp, "_offload_parameters", lambda model: steps.append("offload"))
    strategy._shard(nn.Linear(2, 2), precision_plugin=None)
    assert steps == ["shard", ("initialise", torch.device("npu", 0)), "offload"]


@pytest.mark.parametrize(
    ("chip", "bf16", "series", "peak"),
    [
        ("Ascend910B", False, "training", None),  # SocVersion 104: first generation, despite the A2-looking prefix
        ("Ascend310P3", False, None, None),
        ("Ascend910B4-1", True, "A2", 245.8e12),
        ("Ascend910_9362", True, "A3", 353.9e12),
    ],
)
def test_chip_facts_come_from_exact_names_and_the_runtime_bf16_answer(npu, chip, bf16, series, peak):
    """Catches prefix matching: "Ascend910B" and "Ascend310P3" were taken for bf16 chips, and bf16 must be what
    torch.npu.is_bf16_supported() says (the fake answers from the chip's SocVersion, as torch_npu does)."""
    fake = npu(device_count=1, device_name=chip)
    facts = runtime.get_runtime().chip()
    assert (facts.name, facts.supports_bf16, facts.series) == (chip, bf16, series)
    assert facts.peak_bf16_flops == (pytest.approx(peak) if peak else None)
    assert len(fake.calls_to("npu.is_bf16_supported")) == 1


@pytest.mark.parametrize("chip", ["Ascend910B", "Ascend310P3"])
def test_bf16_is_refused_on_first_generation_and_inference_chips(npu, chip):
    """Catches a bf16 run accepted on a chip without bf16 units because its name starts like an A2 part's."""
    npu(device_count=1, device_name=chip)
    with pytest.raises(ValueError, match=f"precision='bf16-mixed' is not supported on {chip} \\(no bf16 units\\)"):
        Trainer(accelerator="npu", devices=1, precision="bf16-mixed", logger=False)


def test_an_unknown_chip_that_supports_bf16_may_train_in_bf16(npu):
    """Catches a name table standing in for the runtime: a chip newer than the table trains in bf16 when
    torch_npu says it can, and simply has no MFU peak."""
    npu(device_count=1, device_name="Ascend950", bf16_supported=True)
    trainer = Trainer(accelerator="npu", devices=1, precision="bf16-mixed", logger=False)
    assert trainer.precision_plugin.device == "npu"
    assert runtime.get_runtime().chip().peak_bf16_flops is None


def test_non_bf16_precision_does_not_initialise_the_device_in_the_launcher(npu):
    """Catches the precision check initialising the NPU (is_bf16_supported does) in the process that launches
    the workers when the answer does not matter."""
    fake = npu(device_count=2)
    Trainer(accelerator="npu", devices=2, precision="32-true", logger=False)
    assert not fake.initialized and fake.calls_to("npu.is_bf16_supported") == []
