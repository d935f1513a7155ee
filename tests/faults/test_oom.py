"""NPU out-of-memory errors: the batch-size finder backs off from them, the NPU cache is emptied between its
trials, a failed run on accelerator="npu" gets one hint, and CUDA OOMs and other errors behave as before."""

import traceback

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.tuner import batch_size_scaling
from lightning.pytorch.utilities import memory
from torch.utils.data import DataLoader, TensorDataset

import lightning_npu
from lightning_npu import runtime
from lightning_npu.oom import OOM_HINT, is_npu_oom_error
from lightning_npu.runtime.simulated import SimulatedRuntime
from tests.npu_fake import install_fake_torch_npu

# The text torch_npu 2.13.0's caching allocator builds (NPUCachingAllocator.cpp, strings of libtorch_npu.so).
NPU_OOM = (
    "NPU out of memory. Tried to allocate {size:.2f} GiB (NPU 0; 60.96 GiB total capacity; 57.31 GiB already allocated;"
    " 57.31 GiB current active; 1.02 GiB free; 58.40 GiB reserved in total by PyTorch).If reserved memory is >>"
    " allocated memory try setting max_split_size_mb to avoid fragmentation."
)
CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB"
THRESHOLD = 40  # the largest batch that "fits"


class RaisesAboveThreshold(LightningModule):
    """A linear model whose training_step raises ``make_error(batch)`` for batches larger than THRESHOLD."""

    def __init__(self, make_error, batch_size=2):
        super().__init__()
        self.batch_size = batch_size
        self.layer = torch.nn.Linear(4, 1)
        self.make_error = make_error
        self.events = []
        self.raised = []

    def train_dataloader(self):
        data = torch.randn(512, 4)
        return DataLoader(TensorDataset(data, data.sum(1, keepdim=True)), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.events.append(("step", len(x)))
        if len(x) > THRESHOLD:
            error = self.make_error(len(x))
            self.raised.append(error)
            raise error
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def npu_oom(batch):
    return torch.OutOfMemoryError(NPU_OOM.format(size=batch * 0.05))


def old_npu_oom(batch):  # torch_npu before TORCH_CHECK_WITH(OutOfMemoryError, ...): a plain RuntimeError
    return RuntimeError(NPU_OOM.format(size=batch * 0.05))


def _trainer(tmp_path, accelerator="npu"):
    return Trainer(accelerator=accelerator, devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("make_error", [npu_oom, old_npu_oom], ids=["OutOfMemoryError", "RuntimeError"])
def test_batch_size_finder_backs_off_from_an_npu_oom(simulate, tmp_path, make_error):
    """Catches Lightning's is_oom_error not knowing NPU messages: the finder then crashes on the first OOM."""
    simulate(1)
    model = RaisesAboveThreshold(make_error)
    found = Tuner(_trainer(tmp_path)).scale_batch_size(model, mode="power", init_val=2, steps_per_trial=1, max_trials=10)
    # power mode doubles 2 -> 64, which fails, and halves back to the last size that trained.
    assert found == 32 and model.batch_size == 32
    assert [size for kind, size in model.events] == [2, 4, 8, 16, 32, 64]


@pytest.mark.slow
def test_the_npu_cache_is_emptied_between_trials(simulate, tmp_path, monkeypatch):
    """Catches garbage_collection_cuda emptying only the CUDA cache: NPU memory of a failed trial stays cached."""
    simulate(1)
    model = RaisesAboveThreshold(npu_oom)
    monkeypatch.setattr(SimulatedRuntime, "empty_cache", lambda self: model.events.append(("empty_cache", None)))
    Tuner(_trainer(tmp_path)).scale_batch_size(model, mode="power", init_val=2, steps_per_trial=1, max_trials=10)
    kinds = [kind for kind, _ in model.events]
    trial_starts = [i for i, (kind, _) in enumerate(model.events) if kind == "step"]
    assert len(trial_starts) == 6
    for previous, start in zip([-1, *trial_starts], trial_starts):
        assert "empty_cache" in kinds[previous + 1:start], f"no empty_cache before the trial at event {start}"
    assert kinds[-1] == "empty_cache"  # also after the failed trial and at the end of the search


def test_cache_emptying_calls_torch_npu_only_once_the_npu_runtime_exists(monkeypatch):
    """Catches emptying the NPU cache in processes that never chose the NPU runtime (a CUDA or CPU run would probe)."""
    fake = install_fake_torch_npu(monkeypatch)
    runtime.reset()
    memory.garbage_collection_cuda()
    assert fake.calls_to("npu.empty_cache") == []
    runtime.get_runtime()
    batch_size_scaling.garbage_collection_cuda()
    memory.garbage_collection_cuda()
    assert fake.calls_to("npu.empty_cache") == [{}, {}]
    runtime.reset()


def test_an_npu_oom_in_fit_keeps_the_error_and_adds_one_hint(simulate, tmp_path):
    """Catches a fit on accelerator='npu' failing with a bare OOM (no advice), or with the error replaced."""
    simulate(1)
    model = RaisesAboveThreshold(npu_oom, batch_size=64)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _trainer(tmp_path).fit(model)
    error = caught.value
    assert error is model.raised[0]  # the very object torch_npu raised: type, message and traceback kept
    assert type(error) is torch.OutOfMemoryError and str(error) == NPU_OOM.format(size=64 * 0.05)
    assert error.__notes__ == [OOM_HINT]
    assert "lightning-npu plan" in OOM_HINT and "activation_checkpointing_ratio" in OOM_HINT
    printed = "".join(traceback.format_exception(error))
    assert printed.index(str(error)) < printed.index(OOM_HINT)


@pytest.mark.slow
@pytest.mark.parametrize("accelerator", ["cpu", "npu"])
def test_a_cuda_oom_backs_off_as_before_and_gets_no_npu_hint(simulate, tmp_path, accelerator):
    """Catches the NPU additions changing how Lightning treats CUDA OOMs (still detected, no NPU advice)."""
    simulate(1)
    model = RaisesAboveThreshold(lambda batch: torch.OutOfMemoryError(CUDA_OOM))
    found = Tuner(_trainer(tmp_path, accelerator)).scale_batch_size(model, mode="power", init_val=2, steps_per_trial=1,
                                                                    max_trials=10)
    assert found == 32
    model = RaisesAboveThreshold(lambda batch: torch.OutOfMemoryError(CUDA_OOM), batch_size=64)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _trainer(tmp_path, accelerator).fit(model)
    assert not hasattr(caught.value, "__notes__")


@pytest.mark.slow
def test_other_errors_pass_through_unchanged(simulate, tmp_path):
    """Catches the NPU check mistaking other errors for OOMs (the finder would swallow a real bug)."""
    simulate(1)
    model = RaisesAboveThreshold(lambda batch: RuntimeError("index 7 is out of bounds"))
    with pytest.raises(RuntimeError, match="out of bounds") as caught:
        Tuner(_trainer(tmp_path)).scale_batch_size(model, mode="power", init_val=2, steps_per_trial=1, max_trials=10)
    assert caught.value is model.raised[0] and not hasattr(caught.value, "__notes__")
    assert not is_npu_oom_error(ValueError(NPU_OOM.format(size=1.0)))  # Lightning catches RuntimeError only
    assert not is_npu_oom_error(torch.OutOfMemoryError(CUDA_OOM))
    assert is_npu_oom_error(torch.OutOfMemoryError("NPU function error: aclnnMatmul, error code is 207018"))


def test_registering_again_wraps_nothing_twice():
    """Catches a second register() stacking wrappers (each trial would then empty the cache twice)."""
    before = (memory.is_oom_error, batch_size_scaling.garbage_collection_cuda,
              lightning_npu.NPUSingleStrategy.on_exception)
    lightning_npu.register()
    assert (memory.is_oom_error, batch_size_scaling.garbage_collection_cuda,
            lightning_npu.NPUSingleStrategy.on_exception) == before
    assert memory.is_oom_error.__wrapped__.__module__ == "lightning.pytorch.utilities.memory"
    assert not hasattr(memory.is_oom_error.__wrapped__, "__wrapped__")
