"""Training telemetry: tokens/s per device, TFLOP/s, MFU against the chip's peak, memory and step time.

Every ``log_every_n_steps`` optimizer steps, rank 0 prints one line (here folded in two)::

    step 100/1000 | loss 2.345 | lr 1.0e-05 | 4,210 tokens/s/npu | 212 TFLOP/s | MFU 59.9%
        | mem 41.2/64.0 GiB | 1.95 s/step

and the numbers go to every logger under ``perf/...``. The formulas, per device, over the window of optimizer
steps since the last line (device work synchronised before each clock read, validation time left out)::

    tokens/s/device = tokens this rank trained on / window seconds         (printed: the mean over ranks)
    FLOP/s/device   = tokens/s/device * flops_per_token
    MFU             = FLOP/s/device / peak dense bf16 FLOP/s of the chip   (ChipFacts.peak_bf16_flops)

``flops_per_token`` comes from the LightningModule. For a decoder LLM it is the PaLM (appendix B) count that
``LLaMAConfig.flops_per_token(seq_len)`` implements: ``6 * N + 12 * L * S * D`` with N the non-embedding
parameters, L layers, S the sequence length and D the model width (forward + backward; the causal mask's skipped
half is still counted, so MFU compares with published figures).
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from typing_extensions import override

from lightning_npu.accelerator import NPUAccelerator

GIB = 1024**3
TERA = 1e12

METRIC_TOKENS = "perf/tokens_per_sec_per_device"
METRIC_TFLOPS = "perf/tflops_per_device"
METRIC_MFU = "perf/mfu"
METRIC_STEP_TIME = "perf/step_time_s"
METRIC_MEMORY = "perf/memory_peak_gib"


# ----------------------------------------------------------------------------------------------- arithmetic


def tokens_per_second(tokens: float, seconds: float) -> float:
    """Throughput in tokens/s of ``tokens`` processed in ``seconds`` of wall time."""
    if seconds <= 0:
        raise ValueError(f"seconds={seconds!r} must be positive to compute a throughput")
    return tokens / seconds


def flops_per_second(tokens_per_s: float, flops_per_token: float) -> float:
    """Achieved training FLOP/s per device from its tokens/s and the model's training FLOPs per token."""
    return tokens_per_s * flops_per_token


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation as a fraction (0.599 = 59.9%): achieved FLOP/s per device over the chip's peak FLOP/s."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops={peak_flops!r} must be a positive FLOP/s figure")
    return flops_per_second(tokens_per_s, flops_per_token) / peak_flops


@dataclass(frozen=True)
class MemoryReading:
    """Peak memory in bytes; ``total_bytes`` is the device's capacity where known.

    ``process_rss`` marks a reading of the process's peak resident set size (CPU and simulated runs), which
    is not device memory and is labelled as such.
    """

    peak_bytes: float
    total_bytes: Optional[float] = None
    process_rss: bool = False

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def describe(self) -> str:
        if self.process_rss:
            return f"peak RSS {self.peak_gib:.1f} GiB (process)"
        if self.total_bytes:
            return f"mem {self.peak_gib:.1f}/{self.total_bytes / GIB:.1f} GiB"
        return f"mem {self.peak_gib:.1f} GiB"


def format_tflops(flops_per_s: float) -> str:
    """FLOP/s as a TFLOP/s number with about three significant digits (``212``, ``21.2``, ``0.0212``)."""
    tflops = flops_per_s / TERA
    if tflops >= 100:
        return f"{tflops:.0f}"
    if tflops >= 1:
        return f"{tflops:.1f}"
    return f"{tflops:.3g}"


def format_duration(seconds: float) -> str:
    """``12.3 s``, ``2m 05s`` or ``1h 02m 05s``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def format_line(
    *,
    step: int,
    max_steps: Optional[int],
    step_time_s: float,
    loss: Optional[float] = None,
    lr: Optional[float] = None,
    tokens_per_s: Optional[float] = None,
    flops_per_s: Optional[float] = None,
    mfu_fraction: Optional[float] = None,
    memory: Optional[MemoryReading] = None,
    device_label: str = "npu",
) -> str:
    """One progress line; parts whose number is unknown (``None``) are left out."""
    parts = [f"step {step}/{max_steps}" if max_steps else f"step {step}"]
    if loss is not None:
        parts.append(f"loss {loss:.3f}")
    if lr is not None:
        parts.append(f"lr {lr:.1e}")
    parts += _rate_parts(tokens_per_s, flops_per_s, mfu_fraction, device_label)
    if memory is not None:
        parts.append(memory.describe())
    parts.append(f"{step_time_s:.2f} s/step")
    return " | ".join(parts)


def _rate_parts(tokens_per_s: Optional[float], flops_per_s: Optional[float], mfu_fraction: Optional[float],
                device_label: str, prefix: str = "") -> list[str]:
    parts = []
    if tokens_per_s is not None:
        parts.append(f"{prefix}{tokens_per_s:,.0f} tokens/s/{device_label}")
    if flops_per_s is not None:
        parts.append(f"{format_tflops(flops_per_s)} TFLOP/s")
    if mfu_fraction is not None:
        parts.append(f"MFU {100 * mfu_fraction:.1f}%")
    return parts


def format_summary(
    *,
    steps: int,
    total_s: float,
    validation_s: float = 0.0,
    tokens_per_s: Optional[float] = None,
    flops_per_s: Optional[float] = None,
    mfu_fraction: Optional[float] = None,
    memory: Optional[MemoryReading] = None,
    device_label: str = "npu",
) -> str:
    """The end-of-training line: wall time, and averages over the training time (validation excluded)."""
    head = f"training done: {steps} steps in {format_duration(total_s)}"
    if validation_s > 0:
        head += f" ({format_duration(validation_s)} of it validation)"
    parts = [head]
    parts += _rate_parts(tokens_per_s, flops_per_s, mfu_fraction, device_label, prefix="avg ")
    if memory is not None:
        parts.append(memory.describe() if memory.process_rss else f"peak {memory.describe()}")
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------- the callback


class TokenThroughputMonitor(Callback):
    """Prints and logs tokens/s per device, TFLOP/s, MFU, memory and step time every few optimizer steps.

    Tokens per batch: ``pl_module.count_tokens(batch)`` if the LightningModule defines it, else
    ``batch["input_ids"].numel()`` for dict batches; otherwise only step time is reported (said once).
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
        self._device: Optional[_DeviceAccess] = None
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
            self._device = _device_access(trainer)

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
        device = self._require_device(trainer)
        device.synchronize()
        total = time.perf_counter() - self._train_start
        train_time = max(total - self._total_paused, 1e-9)
        counted = self._token_source_known is True
        local_tps = tokens_per_second(float(self._total_tokens), train_time) if counted else 0.0
        memory = device.read_memory()
        tps, _, peak = self._reduce(trainer, pl_module, local_tps, 0.0, memory)
        tps_shown, flops, mfu_shown = self._derived(tps if counted else None, device)
        summary = format_summary(
            steps=trainer.global_step - self._start_step,
            total_s=total,
            validation_s=self._total_paused,
            tokens_per_s=tps_shown,
            flops_per_s=flops,
            mfu_fraction=mfu_shown,
            memory=_with_peak(memory, peak),
            device_label=device.label,
        )
        pl_module.print(summary)

    # ------------------------------------------------------------------------------------------- internals

    def _report(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = self._require_device(trainer)
        device.synchronize()
        now = time.perf_counter()
        elapsed = max(now - self._window_start - self._window_paused, 1e-9)
        steps = max(self._last_step - self._window_step, 1)
        counted = self._token_source_known is True
        local_tps = tokens_per_second(float(self._window_tokens), elapsed) if counted else 0.0
        memory = device.read_memory()
        # Every rank reaches this point at the same optimizer step, so the collectives cannot deadlock.
        tps, step_time, peak = self._reduce(trainer, pl_module, local_tps, elapsed / steps, memory)
        tps_shown, flops, mfu_shown = self._derived(tps if counted else None, device)
        memory = _with_peak(memory, peak)
        loss = float(self._last_loss) if self._last_loss is not None else None

        line = format_line(
            step=self._last_step,
            max_steps=_max_steps(trainer),
            step_time_s=step_time,
            loss=loss,
            lr=self._last_lr,
            tokens_per_s=tps_shown,
            flops_per_s=flops,
            mfu_fraction=mfu_shown,
            memory=memory,
            device_label=device.label,
        )
        pl_module.print(line)
        if trainer.is_global_zero:
            metrics = {METRIC_STEP_TIME: step_time}
            if tps_shown is not None:
                metrics[METRIC_TOKENS] = tps_shown
            if flops is not None:
                metrics[METRIC_TFLOPS] = flops / TERA
            if mfu_shown is not None:
                metrics[METRIC_MFU] = mfu_shown
            if memory is not None:
                metrics[METRIC_MEMORY] = memory.peak_gib
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

    def _derived(
        self, tokens_per_s: Optional[float], device: "_DeviceAccess"
    ) -> tuple[Optional[float], Optional[float], Optional[float]]:
        if tokens_per_s is None or self._flops_per_token is None:
            return tokens_per_s, None, None
        flops = flops_per_second(tokens_per_s, self._flops_per_token)
        if device.peak_flops is None:
            return tokens_per_s, flops, None
        return tokens_per_s, flops, mfu(tokens_per_s, self._flops_per_token, device.peak_flops)

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
        return tokens.detach() if isinstance(tokens, Tensor) else int(tokens)

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

    def _require_device(self, trainer: Trainer) -> "_DeviceAccess":
        if self._device is None:
            self._device = _device_access(trainer)
        return self._device


# ----------------------------------------------------------------------------------------------- device access


@dataclass
class _DeviceAccess:
    """What the monitor needs from the training device, looked up once from the accelerator."""

    label: str
    synchronize: Callable[[], None]
    read_memory: Callable[[], Optional[MemoryReading]]
    reset_peak: Callable[[], None]
    peak_flops: Optional[float]
    no_peak_reason: Optional[str]


def _device_access(trainer: Trainer) -> _DeviceAccess:
    device = trainer.strategy.root_device
    accelerator = trainer.accelerator
    if isinstance(accelerator, NPUAccelerator):
        runtime = accelerator.runtime
        chip = runtime.chip(device.index or 0)
        if runtime.simulated:
            reason = "the simulated NPU (LIGHTNING_NPU_SIMULATE) runs on the CPU, which has no NPU peak FLOP/s"
            memory = lambda: MemoryReading(runtime.max_memory_allocated(device), process_rss=True)  # noqa: E731
        else:
            reason = (
                f"no peak bf16 FLOP/s is known for chip {chip.name!r}"
                + ("" if chip.supports_bf16 else " (it has no bf16 units)")
                + "; add it to lightning_npu/facts/chips.py if it is published"
            )
            memory = lambda: MemoryReading(runtime.max_memory_allocated(device), runtime.total_memory(device))  # noqa: E731
        return _DeviceAccess(
            label="npu",
            synchronize=lambda: runtime.synchronize(device),
            read_memory=memory,
            reset_peak=lambda: runtime.reset_peak_memory_stats(device),
            peak_flops=chip.peak_bf16_flops,
            no_peak_reason=None if chip.peak_bf16_flops is not None else reason,
        )
    if device.type == "cpu":
        return _DeviceAccess(
            label="device",
            synchronize=lambda: None,  # CPU work is done when the call returns
            read_memory=lambda: MemoryReading(_process_peak_rss(), process_rss=True),
            reset_peak=lambda: None,
            peak_flops=None,
            no_peak_reason="training runs on the CPU, which has no known peak FLOP/s",
        )
    return _generic_device_access(device)


def _generic_device_access(device: torch.device) -> _DeviceAccess:
    """Any other torch accelerator, through ``torch.accelerator`` where it has the call, else ``torch.<type>``."""
    unified = getattr(torch, "accelerator", None)
    module = getattr(torch, device.type, None)

    def call(name: str) -> Optional[Callable[..., Any]]:
        for owner in (unified, module):
            function = getattr(owner, name, None)
            if callable(function):
                return function
        return None

    synchronize, reset = call("synchronize"), call("reset_peak_memory_stats")
    max_allocated = call("max_memory_allocated")
    memory_info = call("get_memory_info") or call("mem_get_info")

    def read_memory() -> Optional[MemoryReading]:
        if max_allocated is None:
            return None
        total = memory_info(device)[1] if memory_info is not None else None
        return MemoryReading(max_allocated(device), total)

    return _DeviceAccess(
        label="device",
        synchronize=(lambda: synchronize(device)) if synchronize is not None else (lambda: None),
        read_memory=read_memory,
        reset_peak=(lambda: reset(device)) if reset is not None else (lambda: None),
        peak_flops=None,
        no_peak_reason=f"no peak FLOP/s is known for {device.type!r} devices",
    )


def _process_peak_rss() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _with_peak(memory: Optional[MemoryReading], peak_bytes: Optional[float]) -> Optional[MemoryReading]:
    if memory is None or peak_bytes is None:
        return memory
    return MemoryReading(peak_bytes, memory.total_bytes, memory.process_rss)


def _max_steps(trainer: Trainer) -> Optional[int]:
    if trainer.max_steps and trainer.max_steps > 0:
        return trainer.max_steps
    try:
        estimated = trainer.estimated_stepping_batches
    except Exception:  # noqa: BLE001 -- an unknown total only drops the "/total" part of the line
        return None
    return int(estimated) if math.isfinite(estimated) else None
