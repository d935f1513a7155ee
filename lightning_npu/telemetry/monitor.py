"""``TokenThroughputMonitor``: the callback that measures, prints and logs the telemetry (formulas in the package
docstring, ``lightning_npu.telemetry``)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from typing_extensions import override

from lightning_npu.telemetry.arithmetic import GIB, TERA, tokens_per_second, training_rates
from lightning_npu.telemetry.device import TrainingDevice, training_device
from lightning_npu.telemetry.formatting import MemoryReading, Rates, format_line, format_summary

METRIC_TOKENS = "perf/tokens_per_sec_per_device"
METRIC_TFLOPS = "perf/tflops_per_device"
METRIC_MFU = "perf/mfu"
METRIC_STEP_TIME = "perf/step_time_s"
METRIC_MEMORY = "perf/memory_peak_gib"


class TokenThroughputMonitor(Callback):
    """Prints and logs tokens/s per device, TFLOP/s, MFU, memory and step time every few optimizer steps.

    Tokens per batch: ``pl_module.count_tokens(batch)`` if the LightningModule defines it, else
    ``batch["input_ids"].numel()`` for dict batches; otherwise only step time is reported (said once). A batch's
    tokens are shared by the ranks that train on it together (tensor, context and pipeline parallelism: the
    strategy's ``distributed_sampler_kwargs`` say how many replicas there are).
    FLOPs per token: ``pl_module.flops_per_token`` (attribute or property; for a decoder LLM
    ``6 * N_non_embedding + 12 * n_layers * seq_len * dim``, see ``LLaMAConfig.flops_per_token``).
    MFU needs the chip's peak (``runtime.chip().peak_bf16_flops``); on an unknown chip, the CPU or the simulated
    NPU it is reported as unavailable, once, with the reason. Works on any accelerator; on NPUs it uses the
    plugin's runtime for synchronisation and memory.

    Logged metrics: ``perf/tokens_per_sec_per_device`` (tokens/s, mean over ranks), ``perf/tflops_per_device``
    (TFLOP/s), ``perf/mfu`` (fraction of peak, 0..1), ``perf/step_time_s`` (s per optimizer step, slowest rank),
    ``perf/memory_peak_gib`` (GiB, highest rank; process peak RSS on CPU and simulated runs).
    """

    def __init__(self, log_every_n_steps: int = 10) -> None:
        """``log_every_n_steps``: optimizer steps (not micro-batches) between two lines."""
        super().__init__()
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(
                f"log_every_n_steps={log_every_n_steps!r} must be a positive integer number of optimizer steps, e.g. 10"
            )
        self.log_every_n_steps = log_every_n_steps
        self._device: Optional[TrainingDevice] = None
        self._reset()

    def _reset(self) -> None:
        self._notices: set[str] = set()
        self._flops_per_token: Optional[float] = None
        self._token_source_known: Optional[bool] = None
        self._train_start = 0.0
        self._start_step = 0
        self._total_tokens: Any = 0
        self._total_paused = 0.0
        self._window_start = 0.0
        self._window_step = 0
        self._window_tokens: Any = 0
        self._window_paused = 0.0
        self._last_step = 0
        self._step_loss: Optional[Tensor] = None
        self._step_micro_batches = 0
        self._last_loss: Optional[Tensor] = None
        self._last_lr: Optional[float] = None
        self._validation_start: Optional[float] = None
        self._training = False

    # ------------------------------------------------------------------------------------------- hooks

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._reset()
            self._device = training_device(trainer)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = self._require_device(trainer)
        self._flops_per_token = self._read_flops_per_token(pl_module)
        if self._flops_per_token is not None and device.peak_flops is None:
            self._notice(pl_module, f"MFU unavailable: {device.no_peak_reason}")
        device.reset_peak()
        device.synchronize()
        now = time.perf_counter()
        self._train_start = self._window_start = now
        self._start_step = self._window_step = self._last_step = trainer.global_step
        self._training = True

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # Read here, not at batch end: Lightning steps the LR schedulers before on_train_batch_end.
        if trainer.optimizers and optimizer is trainer.optimizers[0]:
            self._last_lr = float(optimizer.param_groups[0]["lr"])

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        tokens = self._batch_tokens(pl_module, batch)
        if tokens is not None:
            self._window_tokens = self._window_tokens + tokens
            self._total_tokens = self._total_tokens + tokens
        self._add_loss(trainer, pl_module, outputs)

        step = trainer.global_step
        if step <= self._last_step:
            return  # still accumulating gradients: no optimizer step yet
        if self._step_micro_batches:
            self._last_loss = self._step_loss / self._step_micro_batches
        self._step_loss, self._step_micro_batches = None, 0
        crossed = step // self.log_every_n_steps > self._last_step // self.log_every_n_steps
        self._last_step = step
        if crossed:
            self._report(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._training:
            self._require_device(trainer).synchronize()
            self._validation_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._training and self._validation_start is not None:
            self._require_device(trainer).synchronize()
            paused = time.perf_counter() - self._validation_start
            self._window_paused += paused
            self._total_paused += paused
            self._validation_start = None

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._training:
            return
        self._training = False
        self._require_device(trainer).synchronize()
        total = time.perf_counter() - self._train_start
        rates, _ = self._measure(trainer, pl_module, self._total_tokens, max(total - self._total_paused, 1e-9))
        steps = trainer.global_step - self._start_step
        pl_module.print(format_summary(steps=steps, total_s=total, validation_s=self._total_paused, **rates))

    # ------------------------------------------------------------------------------------------- internals

    def _report(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._require_device(trainer).synchronize()
        now = time.perf_counter()
        elapsed = max(now - self._window_start - self._window_paused, 1e-9)
        steps = max(self._last_step - self._window_step, 1)
        rates, step_time = self._measure(trainer, pl_module, self._window_tokens, elapsed, elapsed / steps)
        loss = float(self._last_loss) if self._last_loss is not None else None
        line = format_line(step=self._last_step, max_steps=_max_steps(trainer), step_time_s=step_time, loss=loss,
                           lr=self._last_lr, **rates)
        pl_module.print(line)
        if trainer.is_global_zero:
            metrics = {METRIC_STEP_TIME: step_time}
            if rates["tokens_per_s"] is not None:
                metrics[METRIC_TOKENS] = rates["tokens_per_s"]
            if rates["flops_per_s"] is not None:
                metrics[METRIC_TFLOPS] = rates["flops_per_s"] / TERA
            if rates["mfu_fraction"] is not None:
                metrics[METRIC_MFU] = rates["mfu_fraction"]
            if rates["memory"] is not None:
                metrics[METRIC_MEMORY] = rates["memory"].peak_gib
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=self._last_step)

        self._window_start = now
        self._window_step = self._last_step
        self._window_tokens = 0
        self._window_paused = 0.0

    def _reduce(
        self, trainer: Trainer, pl_module: LightningModule, tokens_per_s: float, step_time: float,
        memory: Optional[MemoryReading],
    ) -> tuple[float, float, Optional[float]]:
        """Mean tokens/s over ranks; slowest step time and highest peak memory over ranks."""
        # float32: HCCL reduces no fp64.
        mean = torch.tensor([tokens_per_s], dtype=torch.float32, device=pl_module.device)
        mean = trainer.strategy.reduce(mean, reduce_op="mean")
        peak_bytes = memory.peak_bytes if memory is not None else 0.0
        highest = torch.tensor([step_time, peak_bytes / GIB], dtype=torch.float32, device=pl_module.device)
        highest = trainer.strategy.reduce(highest, reduce_op="max")
        step_time_max, peak_gib = (float(value) for value in highest.tolist())
        return float(mean[0]), step_time_max, (peak_gib * GIB if memory is not None else None)

    def _measure(
        self, trainer: Trainer, pl_module: LightningModule, tokens: Any, seconds: float, step_time: float = 0.0
    ) -> tuple[Rates, float]:
        """The rates of ``seconds`` of training in which this rank trained on ``tokens``, over all ranks, and the
        slowest rank's ``step_time``. Collectives: every rank calls it at the same optimizer step."""
        device = self._require_device(trainer)
        counted = self._token_source_known is True
        local_tps = tokens_per_second(float(tokens), seconds) if counted else 0.0
        memory = device.read_memory()
        tps, step_time, peak = self._reduce(trainer, pl_module, local_tps, step_time, memory)
        tokens_per_s, flops, mfu_fraction = training_rates(
            tps if counted else None, self._flops_per_token, device.peak_flops
        )
        rates = Rates(tokens_per_s=tokens_per_s, flops_per_s=flops, mfu_fraction=mfu_fraction,
                      memory=_with_peak(memory, peak), device_label=device.label)
        return rates, step_time

    def _batch_tokens(self, pl_module: LightningModule, batch: Any) -> Any:
        count_tokens = getattr(pl_module, "count_tokens", None)
        if callable(count_tokens):
            tokens = count_tokens(batch)
            why = "count_tokens(batch) returned None"
        elif isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor):
            tokens = batch["input_ids"].numel()
        else:
            tokens = None
            why = f"a {type(batch).__name__} batch has no 'input_ids' to count"
        if tokens is None:
            if self._token_source_known is None:
                self._notice(
                    pl_module,
                    f"tokens/s, TFLOP/s and MFU unavailable: {why}; define `count_tokens(self, batch) -> int` on"
                    " your LightningModule. Reporting step time only.",
                )
            self._token_source_known = False
            return None
        self._token_source_known = True
        # A tensor count stays on the device until the next report, so counting adds no host sync per batch.
        tokens = tokens.detach() if isinstance(tokens, Tensor) else int(tokens)
        return tokens / _ranks_per_batch(pl_module.trainer)

    def _add_loss(self, trainer: Trainer, pl_module: LightningModule, outputs: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            return
        loss = loss.detach().float().reshape(())
        if pl_module.automatic_optimization:
            # Lightning divides each micro-batch loss by accumulate_grad_batches before handing it over.
            loss = loss * trainer.accumulate_grad_batches
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        self._step_micro_batches += 1

    def _read_flops_per_token(self, pl_module: LightningModule) -> Optional[float]:
        value = getattr(pl_module, "flops_per_token", None)
        if callable(value):
            value = None  # a method needs arguments we do not have; the contract is a number
        if value is None:
            self._notice(
                pl_module,
                "TFLOP/s and MFU unavailable: the LightningModule has no `flops_per_token` (training FLOPs per token,"
                " e.g. 6 * N_non_embedding + 12 * n_layers * seq_len * dim for a decoder LLM).",
            )
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            self._notice(
                pl_module,
                f"TFLOP/s and MFU unavailable: flops_per_token={value!r} is not a positive number of FLOPs per token.",
            )
            return None
        return float(value)

    def _notice(self, pl_module: LightningModule, message: str) -> None:
        if message not in self._notices:
            self._notices.add(message)
            pl_module.print(f"[TokenThroughputMonitor] {message}")

    def _require_device(self, trainer: Trainer) -> TrainingDevice:
        if self._device is None:
            self._device = training_device(trainer)
        return self._device


def _with_peak(memory: Optional[MemoryReading], peak_bytes: Optional[float]) -> Optional[MemoryReading]:
    if memory is None or peak_bytes is None:
        return memory
    return MemoryReading(peak_bytes, memory.total_bytes, memory.process_rss)


def _ranks_per_batch(trainer: Trainer) -> int:
    """How many ranks train on each batch together: the world over the sampler's replicas (1 without a split)."""
    sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return max(trainer.world_size // sampler.get("num_replicas", trainer.world_size), 1)


def _max_steps(trainer: Trainer) -> Optional[int]:
    if trainer.max_steps and trainer.max_steps > 0:
        return trainer.max_steps
    try:
        estimated = trainer.estimated_stepping_batches
    except Exception:  # noqa: BLE001 -- an unknown total only drops the "/total" part of the line
        return None
    return int(estimated) if math.isfinite(estimated) else None
