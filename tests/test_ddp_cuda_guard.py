"""``npu_ddp`` never reaches a ``torch.cuda`` call when it wraps the model, whatever Lightning's DDP does there.

Lightning 2.6.6 wraps the model inside ``torch.cuda.stream(torch.cuda.Stream())`` whenever it passes ``device_ids``
(any non-CPU device); its main branch (PR 21746, not yet released) asks ``torch.cuda.is_current_stream_capturing()``
and then enters ``torch.cuda.stream(torch.cuda.default_stream())``. Both are run here under a guard that replaces
every ``torch.cuda`` function with one that fails naming it: Lightning's own DDP trips it, npu_ddp must not.

The devices are the strict fake torch_npu's (``npu:0``, ``npu:1``). Nothing can allocate on them, so
``DistributedDataParallel`` itself is replaced by a recorder of its arguments: what is under test is the path to it.
"""

import types
from contextlib import nullcontext

import pytest
import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_npu import NPUAccelerator, NPUDDPStrategy, NPUFabricDDPStrategy, compat
from lightning_npu.strategies import common
from tests.npu_fake import install_fake_torch_npu


class CudaReached(AssertionError):
    pass


class RecordedDDP:
    """Stands in for DistributedDataParallel: keeps what it was built with."""

    def __init__(self, module, device_ids=None, **kwargs):
        self.module, self.device_ids, self.kwargs = module, device_ids, kwargs


def main_wrap(device_ids, module, ddp_kwargs):
    """The model wrap of Lightning main's DDP (after PR 21746), written from reading it: the Trainer's
    ``_setup_model`` and Fabric's ``setup_module`` make the same calls."""
    if device_ids is None:
        context = nullcontext()
    elif torch.cuda.is_current_stream_capturing():
        context = torch.cuda.stream(torch.cuda.Stream())
    else:
        context = torch.cuda.stream(torch.cuda.default_stream())
    with context:
        return RecordedDDP(module=module, device_ids=device_ids, **ddp_kwargs)


def main_trainer_setup_model(self, model):
    return main_wrap(self.determine_ddp_device_ids(), model, compat.ddp_kwargs(self))


def main_fabric_setup_module(self, module):
    return main_wrap(self._determine_ddp_device_ids(), module, compat.ddp_kwargs(self))


def use_lightning_ddp(monkeypatch, version):
    """Lightning's DDP model wrap as installed (2.6.6), or as on Lightning main."""
    if version == "main":
        monkeypatch.setattr(DDPStrategy, "_setup_model", main_trainer_setup_model)
        monkeypatch.setattr(FabricDDPStrategy, "setup_module", main_fabric_setup_module)


@pytest.fixture
def cuda_guard(monkeypatch):
    """Every public ``torch.cuda`` function and class raises ``CudaReached("torch.cuda.<name>")`` when called."""
    def refuse(name):
        def called(*args, **kwargs):
            raise CudaReached(f"torch.cuda.{name} was called")
        return called

    for name in dir(torch.cuda):
        value = getattr(torch.cuda, name)
        if not name.startswith("_") and callable(value) and not isinstance(value, types.ModuleType):
            monkeypatch.setattr(torch.cuda, name, refuse(name))


@pytest.fixture
def two_npus(monkeypatch):
    install_fake_torch_npu(monkeypatch, device_count=2)
    monkeypatch.setattr(common, "DistributedDataParallel", RecordedDDP)
    monkeypatch.setattr("lightning.pytorch.strategies.ddp.DistributedDataParallel", RecordedDDP)
    monkeypatch.setattr("lightning.fabric.strategies.ddp.DistributedDataParallel", RecordedDDP)
    return [torch.device("npu", 0), torch.device("npu", 1)]


@pytest.mark.parametrize("version", ["installed", "main"])
def test_npu_ddp_wraps_the_model_without_a_torch_cuda_call(monkeypatch, two_npus, cuda_guard, version):
    use_lightning_ddp(monkeypatch, version)
    strategy = NPUDDPStrategy(accelerator=NPUAccelerator(), parallel_devices=two_npus)
    strategy.model = LightningModule()
    strategy.model.layer = nn.Linear(2, 2)
    strategy.configure_ddp()  # what the Trainer's strategy.setup() calls
    assert isinstance(strategy.model, RecordedDDP) and strategy.model.device_ids == [0]

    fabric_strategy = NPUFabricDDPStrategy(accelerator=NPUAccelerator(), parallel_devices=two_npus)
    wrapped = fabric_strategy.setup_module(nn.Linear(2, 2))  # what Fabric.setup() calls
    assert isinstance(wrapped, RecordedDDP) and wrapped.device_ids == [0]


@pytest.mark.parametrize(("version", "first_call"),
                         [("installed", "torch.cuda.Stream"), ("main", "torch.cuda.is_current_stream_capturing")])
def test_the_guard_names_the_torch_cuda_call_of_lightnings_own_ddp(monkeypatch, two_npus, cuda_guard, version,
                                                                    first_call):
    use_lightning_ddp(monkeypatch, version)
    strategy = DDPStrategy(accelerator=NPUAccelerator(), parallel_devices=two_npus)
    strategy.model = LightningModule()
    with pytest.raises(CudaReached, match=f"^{first_call} was called$"):
        strategy.configure_ddp()
    fabric_strategy = FabricDDPStrategy(accelerator=NPUAccelerator(), parallel_devices=two_npus)
    with pytest.raises(CudaReached, match=f"^{first_call} was called$"):
        fabric_strategy.setup_module(nn.Linear(2, 2))
