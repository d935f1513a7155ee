"""NPU out-of-memory errors: Lightning's OOM detection and cache emptying learn them, and a failed run says what to do.

What torch_npu 2.13.0 raises (read from the wheel's ``libtorch_npu.so`` and headers): the caching allocator
raises ``torch.OutOfMemoryError`` (a ``RuntimeError``) with a message starting "NPU out of memory." --
"NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.96 GiB total capacity; ... reserved in total by
PyTorch).If reserved memory is >> ...", or "... Allocation was preemptively rejected because it would exceed
per_process_memory_fraction limit", "... NPUWorkspaceAllocator tried to allocate", "... device id: ". CANN's own
OOMs (``NPU_CHECK_ERROR`` / HCCL paths) raise ``torch.OutOfMemoryError`` with an "NPU function error" / "HCCL
function error" text. Older torch_npu raised a plain ``RuntimeError`` with the same "NPU out of memory" text.

Lightning's ``is_oom_error`` knows only CUDA, cuDNN and CPU-allocator texts and ``garbage_collection_cuda``
empties only the CUDA cache, so the batch-size finder (``Tuner.scale_batch_size`` / ``BatchSizeFinder``) crashes
on the first NPU OOM instead of backing off. ``lightning_npu.lightning_patches.oom`` (run on ``import lightning_npu``)
replaces both where Lightning looks them up: in ``lightning.pytorch.utilities.memory`` and in
``lightning.pytorch.tuner.batch_size_scaling``, which bound them with ``from ... import``. Each replacement runs
Lightning's original first, so nothing changes for other accelerators: detection only adds NPU errors, and the
NPU cache (the runtime's ``empty_cache``) is emptied only in a process that created the NPU runtime.

The hint on a failed run: Lightning passes the exception that ends ``fit`` / ``validate`` / ``test`` /
``predict`` to the strategy's ``on_exception`` and then re-raises it unchanged (``trainer/call.py``); its own DDP
strategy explains errors there. The same patch wraps ``on_exception`` of the Trainer's NPU strategies so that,
with ``accelerator="npu"``, an NPU OOM gets one note (PEP 678) naming the fixes. The error stays the very object
torch_npu raised -- same type, message, traceback and ``__cause__`` chain -- and the note prints below it. (A new
chained exception would have to be raised above Lightning's private ``_call_and_handle_interrupt`` and would change
``str(error)``.) Fabric runs the user's own loop and no Fabric frame sees the exception; a Fabric script gets the
same note with ``except Exception as error: add_oom_hint(error); raise``.
"""

from __future__ import annotations

import logging
import sys

import torch

from lightning_npu.runtime import active_runtime

log = logging.getLogger(__name__)

OOM_HINT = (
    "lightning-npu: the NPU ran out of memory. Reduce the micro-batch (the DataLoader's batch_size; with"
    " gradient accumulation the global batch can stay), or under strategy='npu_fsdp' recompute more activations"
    " (activation_checkpointing_policy={your block class}, activation_checkpointing_ratio towards 1.0), or run"
    " `lightning-npu plan --config <your YAML>` to see the memory per device and the largest micro-batch that fits."
)


def is_npu_oom_error(error: BaseException) -> bool:
    """Whether ``error`` is an NPU out-of-memory error raised by torch_npu or CANN."""
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return "NPU out of memory" in text or (isinstance(error, torch.OutOfMemoryError) and "NPU" in text)


def add_oom_hint(error: BaseException) -> bool:
    """Attach ``OOM_HINT`` to an NPU OOM error (once); returns whether ``error`` is one."""
    if not is_npu_oom_error(error):
        return False
    if OOM_HINT not in getattr(error, "__notes__", ()):
        if sys.version_info >= (3, 11):
            error.add_note(OOM_HINT)
        else:  # no notes before 3.11: the traceback would not show it
            error.__notes__ = [*getattr(error, "__notes__", []), OOM_HINT]
            log.error(OOM_HINT)
    return True


def empty_npu_cache() -> None:
    """Empty the NPU runtime's cache if this process uses that runtime (what Lightning's ``garbage_collection_cuda``
    misses); an OOM raised while emptying it is swallowed, as Lightning swallows CUDA's."""
    runtime = active_runtime()
    if runtime is None:
        return
    try:
        runtime.empty_cache()
    except RuntimeError as error:
        if not is_npu_oom_error(error):
            raise
