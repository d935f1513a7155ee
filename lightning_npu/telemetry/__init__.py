"""Training telemetry: tokens/s per device, TFLOP/s, MFU against the chip's peak, memory and step time.

Every ``log_every_n_steps`` optimizer steps, rank 0 prints one line (here folded in two)::

    step 100/1000 | loss 2.345 | lr 1.0e-05 | 4,210 tokens/s/npu | 212 TFLOP/s | MFU 59.9%
        | mem 41.2/64.0 GiB | 1.95 s/step

and the numbers go to every logger under ``perf/...``. The formulas, per device, over the window of optimizer
steps since the last line (device work synchronised before each clock read, validation time left out)::

    tokens/s/device = tokens of this rank's batches / ranks sharing a batch / window seconds  (printed: mean over ranks)
    FLOP/s/device   = tokens/s/device * flops_per_token
    MFU             = FLOP/s/device / peak dense bf16 FLOP/s of the chip   (ChipFacts.peak_bf16_flops)

The ranks of a tensor-, context- or pipeline-parallel group train on one batch together, each doing its share of
the work: the strategy's sampler replicas say how many share one (``world_size / num_replicas``).
``flops_per_token`` comes from the LightningModule. For a decoder LLM it is the PaLM (appendix B) count that
``LLaMAConfig.flops_per_token(seq_len)`` implements: ``6 * N + 12 * L * S * D`` with N the non-embedding
parameters, L layers, S the sequence length and D the model width (forward + backward; the causal mask's skipped
half is still counted, so MFU compares with published figures).

Modules: ``arithmetic`` (the formulas above, pure functions), ``formatting`` (the lines), both torch-free;
``device`` (synchronisation, memory and peak FLOP/s of the training device, through the plugin's runtime on NPUs);
``monitor`` (the ``TokenThroughputMonitor`` callback). Names load on first use, so importing the two torch-free
modules imports neither torch nor Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the submodule defining it (PEP 562: imported when first asked for).
_LAZY = {
    "GIB": "arithmetic",
    "TERA": "arithmetic",
    "flops_per_second": "arithmetic",
    "mfu": "arithmetic",
    "tokens_per_second": "arithmetic",
    "training_rates": "arithmetic",
    "MemoryReading": "formatting",
    "Rates": "formatting",
    "format_duration": "formatting",
    "format_line": "formatting",
    "format_summary": "formatting",
    "format_tflops": "formatting",
    "METRIC_MEMORY": "monitor",
    "METRIC_MFU": "monitor",
    "METRIC_STEP_TIME": "monitor",
    "METRIC_TFLOPS": "monitor",
    "METRIC_TOKENS": "monitor",
    "TokenThroughputMonitor": "monitor",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

