"""Lightning's OOM handling, taught NPU errors (``lightning_npu.oom`` says what torch_npu raises and why):

- ``is_oom_error`` and ``garbage_collection_cuda``, in ``lightning.pytorch.utilities.memory`` and in
  ``lightning.pytorch.tuner.batch_size_scaling`` (which bound them with ``from ... import``): they know only CUDA,
  so the batch-size finder crashed on the first NPU OOM instead of backing off. Lightning's original runs first:
  detection only adds NPU errors, and the NPU cache is emptied only in a process that created the NPU runtime.
- ``on_exception`` of the Trainer's NPU strategies: with ``accelerator="npu"`` an NPU OOM gets one note (PEP 678)
  naming the fixes; the error stays the very object torch_npu raised.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from lightning_npu.accelerator import NPUAccelerator
from lightning_npu.oom import add_oom_hint, empty_npu_cache, is_npu_oom_error
from lightning_npu.strategies import STRATEGIES

_PATCHED = "_lightning_npu_oom_patched"


def install() -> None:
    """Teach Lightning's OOM handling NPU errors and hint on NPU OOMs (idempotent)."""
    import lightning.pytorch.tuner.batch_size_scaling as batch_size_scaling
    import lightning.pytorch.utilities.memory as memory

    for module in (memory, batch_size_scaling):
        _wrap(module, "is_oom_error", lambda original, error: original(error) or is_npu_oom_error(error))
        _wrap(module, "garbage_collection_cuda", _collect_both)
    for trainer_cls, _ in STRATEGIES.values():
        _wrap(trainer_cls, "on_exception", _hint_on_npu)


def _hint_on_npu(original: Callable[[Any, BaseException], None], strategy: Any, error: BaseException) -> None:
    original(strategy, error)
    if isinstance(strategy.accelerator, NPUAccelerator):
        add_oom_hint(error)


def _wrap(owner: Any, name: str, replacement: Callable[..., Any]) -> None:
    """Replace ``owner.name`` by ``replacement(original, *args)`` unless it is already ours."""
    original = getattr(owner, name)
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def wrapped(*args: Any) -> Any:
        return replacement(original, *args)

    setattr(wrapped, _PATCHED, True)
    setattr(owner, name, wrapped)


def _collect_both(original: Callable[[], None]) -> None:
    """Lightning's collection (gc, CUDA cache), then the NPU runtime's cache."""
    original()
    empty_npu_cache()
