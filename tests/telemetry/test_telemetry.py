"""TokenThroughputMonitor: the arithmetic against hand-computed numbers, the line layout, and real fits on the CPU
and on the simulated NPU (gradient accumulation, LR read before the scheduler steps, one-time notices)."""

import re
import time

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_npu.facts.chips import ChipFacts
from lightning_npu.runtime.simulated import SimulatedRuntime
from lightning_npu.telemetry import (
    GIB,
    MemoryReading,
    TokenThroughputMonitor,
    flops_per_second,
    format_duration,
    format_line,
    format_summary,
    mfu,
    tokens_per_second,
)
from recipes.models.llama.config import LLaMAConfig

BATCH, SEQ, VOCAB, DIM = 4, 16, 32, 8
TOKENS_PER_MICRO_BATCH = BATCH * SEQ  # 64
FLOPS_PER_TOKEN = 6 * (DIM * VOCAB + VOCAB)  # 1728: 6 * parameters of the head, enough for a test model


# ------------------------------------------------------------------------------------------------ arithmetic


def test_throughput_flops_and_mfu_match_hand_computation():
    assert tokens_per_second(8192, 2.0) == 4096.0
    assert flops_per_second(4096.0, 6e9) == 2.4576e13
    # 24.576 TFLOP/s on a 353.9 TFLOP/s Ascend910B2: 24.576 / 353.9 = 0.069443345578...
    assert mfu(4096.0, 6e9, 353.9e12) == pytest.approx(0.0694433456, rel=1e-9)


def test_llama2_7b_mfu_from_the_documented_formula():
    # 7B: N_non_embedding = 6,607,343,616; 6 * N = 39,644,061,696; 12 * L * S * D = 12 * 32 * 4096 * 4096
    # = 6,442,450,944; sum = 46,086,512,640 FLOPs per token at seq_len 4096.
    per_token = 46_086_512_640
    assert LLaMAConfig.from_preset("7b").flops_per_token(4096) == per_token
    # 3,000 tokens/s/NPU -> 138.259537920 TFLOP/s; / 353.9 TFLOP/s = 0.39067402...
    assert flops_per_second(3000.0, per_token) == pytest.approx(1.3825953792e14, rel=1e-12)
    assert mfu(3000.0, per_token, 353.9e12) == pytest.approx(0.390674026, rel=1e-8)


def test_arithmetic_rejects_impossible_inputs():
    with pytest.raises(ValueError, match="seconds=0 must be positive"):
        tokens_per_second(10, 0)
    with pytest.raises(ValueError, match="peak_flops=0 must be a positive"):
        mfu(10.0, 10.0, 0)
    with pytest.raises(ValueError, match="log_every_n_steps=0 must be a positive integer"):
        TokenThroughputMonitor(log_every_n_steps=0)


def test_arithmetic_and_formatting_import_without_torch():
    """The formulas and the lines are plain Python: importing them (with the package's own ``__init__`` kept out,
    which still registers with Lightning) loads neither torch nor Lightning, so torch-free tools can use them."""
    from tests.helpers import REPO, run_python

    script = (
        "import sys, types; package = types.ModuleType('lightning_npu'); "
        f"package.__path__ = [{str(REPO / 'lightning_npu')!r}]; sys.modules['lightning_npu'] = package; "
        "from lightning_npu.telemetry import arithmetic, formatting; "
        "rate = arithmetic.tokens_per_second(8, 2); "
        "print(formatting.format_line(step=1, max_steps=None, step_time_s=0.5, tokens_per_s=rate)); "
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    # fresh: what an import pulls in is the question, and a warm interpreter has torch and Lightning already
    out = run_python(["-c", script], simulate=None, fresh=True).stdout.splitlines()
    assert out == ["step 1 | 4 tokens/s/npu | 0.50 s/step", "[]"]


def test_line_has_the_reference_layout():
    line = format_line(
        step=100, max_steps=1000, loss=2.3454, lr=1e-5, tokens_per_s=4210.4, flops_per_s=212.3e12,
        mfu_fraction=0.5994, memory=MemoryReading(41.2 * GIB, 64 * GIB), step_time_s=1.951,
    )
    assert line == (
        "step 100/1000 | loss 2.345 | lr 1.0e-05 | 4,210 tokens/s/npu | 212 TFLOP/s | MFU 59.9% "
        "| mem 41.2/64.0 GiB | 1.95 s/step"
    )


def test_line_leaves_out_what_is_unknown_and_labels_process_memory():
    assert format_line(step=3, max_steps=None, step_time_s=0.5) == "step 3 | 0.50 s/step"
    line = format_line(step=3, max_steps=9, step_time_s=0.5, tokens_per_s=12.0, flops_per_s=2.07e10,
                       memory=MemoryReading(1.5 * GIB, process_rss=True), device_label="device")
    assert line == "step 3/9 | 12 tokens/s/device | 0.0207 TFLOP/s | peak RSS 1.5 GiB (process) | 0.50 s/step"


def test_summary_and_durations():
    assert format_duration(12.34) == "12.3 s"
    assert format_duration(125) == "2m 05s"
    assert format_duration(3725.4) == "1h 02m 05s"
    summary = format_summary(steps=1000, total_s=3725.4, validation_s=125, tokens_per_s=4180, flops_per_s=21.24e12,
                             mfu_fraction=0.06, memory=MemoryReading(41.2 * GIB, 64 * GIB))
    assert summary == ("training done: 1000 steps in 1h 02m 05s (2m 05s of it validation) | avg 4,180 tokens/s/npu"
                       " | 21.2 TFLOP/s | MFU 6.0% | peak mem 41.2/64.0 GiB")


# ------------------------------------------------------------------------------------------------ real fits


class RecordingLogger(Logger):
    def __init__(self):
        super().__init__()
        self.records = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        perf = {key: value for key, value in metrics.items() if key.startswith("perf/")}
        if perf:
            self.records.append((step, perf))


class TinyLM(LightningModule):
    """Next-token prediction on random ids; LR halves at every optimizer step (scheduler interval 'step')."""

    def __init__(self, batches=16, dict_batches=True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.flops_per_token = FLOPS_PER_TOKEN
        self.batches = batches
        self.dict_batches = dict_batches
        self.losses = []

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"] if self.dict_batches else batch[0]
        logits = self.head(self.emb(ids[:, :-1]))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (self.batches * BATCH, SEQ), generator=generator)
        items = [{"input_ids": row} for row in ids] if self.dict_batches else [(row,) for row in ids]
        return DataLoader(items, batch_size=BATCH)


class MaskCountingLM(TinyLM):
    """Counts only the first half of each sequence, to show count_tokens wins over input_ids.numel()."""

    def count_tokens(self, batch):
        return torch.ones_like(batch["input_ids"])[:, : SEQ // 2].sum()


def _fit(tmp_path, module, accelerator="cpu", max_steps=6, accumulate=2, every=2):
    logger = RecordingLogger()
    trainer = Trainer(
        accelerator=accelerator, devices=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
        callbacks=[TokenThroughputMonitor(log_every_n_steps=every)], logger=logger, default_root_dir=tmp_path,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module)
    return logger.records


def _lines(out):
    return [line for line in out.splitlines() if line.startswith("step ")]


def test_cpu_fit_prints_every_n_optimizer_steps_with_gradient_accumulation(tmp_path, capsys):
    module = TinyLM()
    records = _fit(tmp_path, module)
    out = capsys.readouterr().out
    lines = _lines(out)

    # 6 optimizer steps of 2 micro-batches, a line every 2 optimizer steps.
    assert [line.split(" | ")[0] for line in lines] == ["step 2/6", "step 4/6", "step 6/6"]
    assert [step for step, _ in records] == [2, 4, 6]
    # Step 6 is micro-batches 11 and 12: the printed loss is their mean, undoing Lightning's 1/2 scaling.
    assert f"loss {(module.losses[10] + module.losses[11]) / 2:.3f}" in lines[-1]
    # Step 6 (0-based 5) ran at 0.1 * 0.5**5 = 3.125e-3; the scheduler had already moved on at batch end.
    assert "lr 3.1e-03" in lines[-1]
    for _, metrics in records:
        # tokens/s * s/step = tokens per optimizer step = 2 micro-batches of 4 x 16 tokens.
        tokens = metrics["perf/tokens_per_sec_per_device"] * metrics["perf/step_time_s"]
        assert tokens == pytest.approx(2 * TOKENS_PER_MICRO_BATCH, rel=1e-4)
        assert metrics["perf/tflops_per_device"] == pytest.approx(
            metrics["perf/tokens_per_sec_per_device"] * FLOPS_PER_TOKEN / 1e12, rel=1e-6
        )
        assert "perf/mfu" not in metrics
        assert metrics["perf/memory_peak_gib"] > 0
    assert all(re.search(r"\| [\d,]+ tokens/s/device \| [\d.e+-]+ TFLOP/s \| peak RSS [\d.]+ GiB \(process\)", line)
               for line in lines)
    assert out.count("MFU unavailable") == 1
    assert "[TokenThroughputMonitor] MFU unavailable: training runs on the CPU, which has no known peak FLOP/s" in out
    assert re.search(r"^training done: 6 steps in [\d.]+ s \| avg [\d,]+ tokens/s/device \| [\d.e+-]+ TFLOP/s"
                     r" \| peak RSS [\d.]+ GiB \(process\)$", out, re.M)


def test_simulated_npu_fit_says_once_that_mfu_is_unavailable(tmp_path, capsys, simulate):
    simulate(1)
    _fit(tmp_path, TinyLM(), accelerator="npu", max_steps=4, accumulate=1, every=1)
    out = capsys.readouterr().out
    lines = _lines(out)
    assert len(lines) == 4
    assert all("tokens/s/npu" in line and "peak RSS" in line and "MFU" not in line for line in lines)
    assert out.count("MFU unavailable") == 1
    assert "MFU unavailable: the simulated NPU (LIGHTNING_NPU_SIMULATE) runs on the CPU" in out


def test_mfu_is_achieved_flops_over_the_chip_peak(tmp_path, capsys, simulate, monkeypatch):
    peak = 5e9
    monkeypatch.setattr(SimulatedRuntime, "chip", lambda self, index=0: ChipFacts("Ascend910B2", True, peak))
    simulate(1)
    records = _fit(tmp_path, TinyLM(), accelerator="npu", max_steps=4, accumulate=1, every=2)
    out = capsys.readouterr().out
    assert "MFU unavailable" not in out
    for (_, metrics), line in zip(records, _lines(out), strict=True):
        expected = metrics["perf/tflops_per_device"] * 1e12 / peak
        assert metrics["perf/mfu"] == pytest.approx(expected, rel=1e-6)
        assert f"MFU {100 * metrics['perf/mfu']:.1f}%" in line


def test_batches_without_input_ids_report_step_time_only(tmp_path, capsys):
    records = _fit(tmp_path, TinyLM(dict_batches=False), max_steps=4, accumulate=1, every=2)
    out = capsys.readouterr().out
    assert out.count("define `count_tokens(self, batch) -> int`") == 1
    assert "a list batch has no 'input_ids'" in out
    assert all("tokens/s" not in line and "TFLOP/s" not in line for line in _lines(out))
    assert [sorted(metrics) for _, metrics in records] == [["perf/memory_peak_gib", "perf/step_time_s"]] * 2


def test_count_tokens_takes_precedence_over_input_ids(tmp_path, capsys):
    records = _fit(tmp_path, MaskCountingLM(), max_steps=4, accumulate=1, every=2)
    capsys.readouterr()
    for _, metrics in records:
        tokens = metrics["perf/tokens_per_sec_per_device"] * metrics["perf/step_time_s"]
        assert tokens == pytest.approx(BATCH * SEQ // 2, rel=1e-4)


def test_ranks_are_reduced_only_when_a_line_is_printed(tmp_path, capsys, monkeypatch):
    """Emulate a second rank at 1,000 tokens/s and 9 s/step: the line shows the mean and the slowest."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    calls = []

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if reduce_op not in ("mean", "max"):
            return tensor  # Lightning's own bookkeeping (dataloader lengths), single rank
        calls.append(reduce_op)
        if reduce_op == "mean":
            return (tensor + torch.tensor([1000.0])) / 2
        return torch.maximum(tensor, torch.tensor([9.0, 0.0]))

    monkeypatch.setattr(SingleDeviceStrategy, "reduce", reduce)
    module = TinyLM()
    records = _fit(tmp_path, module, max_steps=6, accumulate=2, every=3)
    out = capsys.readouterr().out
    # Two reports (steps 3 and 6) and the summary, two collectives each; none per batch.
    assert calls == ["mean", "max"] * 3
    for (_, metrics), line in zip(records, _lines(out), strict=True):
        assert metrics["perf/step_time_s"] == 9.0
        assert metrics["perf/tokens_per_sec_per_device"] > 500  # the mean of a fast local rank and 1,000
        assert f"{metrics['perf/tokens_per_sec_per_device']:,.0f} tokens/s/device" in line
        assert line.endswith("9.00 s/step")


class SlowValidationLM(TinyLM):
    VALIDATION_S = 1.2

    def validation_step(self, batch, batch_idx):
        time.sleep(self.VALIDATION_S)

    def val_dataloader(self):
        return self.train_dataloader()


def test_validation_time_is_left_out_of_step_time(tmp_path, capsys):
    logger = RecordingLogger()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=4, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
        callbacks=[TokenThroughputMonitor(log_every_n_steps=4)], logger=logger, default_root_dir=tmp_path,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(SlowValidationLM())
    out = capsys.readouterr().out
    (step, metrics), = logger.records
    # The window of steps 1-4 contains one 1.2 s validation: counted, it would add 0.3 s to every step.
    assert step == 4 and metrics["perf/step_time_s"] < SlowValidationLM.VALIDATION_S / 4
    validation_s = float(re.search(r"\(([\d.]+) s of it validation\)", out).group(1))
    assert validation_s >= 2 * SlowValidationLM.VALIDATION_S


def test_other_accelerators_use_torch_accelerator_for_sync_and_memory(monkeypatch):
    """A GPU-like device: synchronisation and memory go through torch.accelerator, with the training device."""
    from lightning_npu.telemetry.device import torch_accelerator_device

    calls = []
    record = calls.append
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: record(("sync", device)))
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda device=None: 3 * GIB)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda device=None: (10 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats", lambda device=None: record(("reset", device)))
    device = torch.device("meta", 1)
    access = torch_accelerator_device(device)
    access.reset_peak()
    access.synchronize()
    assert calls == [("reset", device), ("sync", device)]
    assert access.read_memory().describe() == "mem 3.0/80.0 GiB"
    assert access.label == "device" and access.peak_flops is None
    assert access.no_peak_reason == "no peak FLOP/s is known for 'meta' devices"


class KnownCostLM(TinyLM):
    """Each micro-batch sleeps ``SLEEP_S`` and, once, holds ``HOLD_BYTES`` of host memory: figures known up front."""

    SLEEP_S = 0.3
    HOLD_BYTES = 768 * 2**20

    def training_step(self, batch, batch_idx):
        time.sleep(self.SLEEP_S)
        if batch_idx == 0:
            held = torch.ones(self.HOLD_BYTES // 4)  # written, so the pages are resident
            assert float(held[-1]) == 1.0
            del held
        return super().training_step(batch, batch_idx)


@pytest.mark.slow
def test_step_time_tokens_and_peak_memory_agree_with_a_model_of_known_cost(tmp_path, capsys):
    """Breakage caught: a step time read before the device (or the loop) finished, counted per micro-batch rather
    than per optimizer step, throughput over the wrong interval, or a memory peak that misses the step's tensors:
    every figure here is set by the model (2 micro-batches of 0.3 s each per step, 768 MiB held once), not by the
    monitor's own arithmetic."""
    records = _fit(tmp_path, KnownCostLM(), max_steps=4, accumulate=2, every=2)
    assert len(records) == 2
    sleep_per_step = 2 * KnownCostLM.SLEEP_S
    for _, metrics in records:
        # Never below the sleeps (a clock read early, or per micro-batch, would be); the report after steps 3-4
        # (no allocation, no first-step costs) stays under two steps' sleeps (a sum over the interval would not).
        assert metrics["perf/step_time_s"] >= sleep_per_step
        assert metrics["perf/tokens_per_sec_per_device"] <= 2 * TOKENS_PER_MICRO_BATCH / sleep_per_step
        assert metrics["perf/memory_peak_gib"] >= KnownCostLM.HOLD_BYTES / GIB
    _, last = records[-1]
    assert last["perf/step_time_s"] < 2 * sleep_per_step
    assert last["perf/tokens_per_sec_per_device"] > TOKENS_PER_MICRO_BATCH / sleep_per_step


def test_the_ranks_that_share_a_batch_share_its_tokens():
    """Tensor, context and pipeline parallelism: world 8 over 2 sampler replicas is 4 ranks a batch, each doing a
    quarter of its work (tokens/s per device and MFU count a quarter of its tokens on each); one rank alone, all."""
    from types import SimpleNamespace

    from lightning_npu.telemetry.monitor import _ranks_per_batch

    def trainer(world, sampler):
        return SimpleNamespace(world_size=world, strategy=SimpleNamespace(distributed_sampler_kwargs=sampler))

    assert _ranks_per_batch(trainer(8, {"num_replicas": 2, "rank": 0})) == 4
    assert _ranks_per_batch(trainer(8, {"num_replicas": 8, "rank": 3})) == 1
    assert _ranks_per_batch(trainer(1, None)) == 1
