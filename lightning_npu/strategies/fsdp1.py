"""FSDP1 code met under ``npu_fsdp``, which shards with FSDP2 (``fully_shard``): what it does there, said plainly.

Lightning's ``FSDPStrategy`` builds ``configure_model`` inside FSDP1's ``enable_wrap``, so ``wrap(module)`` there
makes an FSDP1 unit. Outside ``enable_wrap``, torch's ``wrap()`` returns the module unchanged: ported to npu_fsdp,
the calls would silently do nothing. npu_fsdp therefore builds ``configure_model`` inside an ``enable_wrap`` whose
wrapper only records the modules (and returns them unchanged), and warns once per process naming what npu_fsdp
does instead. The model trains as any other: its units come from ``auto_wrap_policy``.

FSDP1 units themselves (``FullyShardedDataParallel(...)``, or ``enable_wrap`` of the user's own, which torch
cannot nest in npu_fsdp's) are refused before anything is sharded: FSDP2 units cannot be mixed with them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

#: Whether this process has said that ``wrap()`` does nothing under npu_fsdp.
_wrap_reported = False

_INSTEAD = (
    "npu_fsdp makes FSDP2 units from auto_wrap_policy (left unset: the repeated block, named in the log), or"
    " keeps modules you shard with torch.distributed.fsdp.fully_shard in configure_model"
)


@contextmanager
def fsdp1_wrap_reported(where: str) -> Generator[None, None, None]:
    """Run model-building code (``where``: ``configure_model``, ``fabric.init_module()``) so that FSDP1's
    ``wrap()`` inside it is reported, not silent."""
    from torch.distributed.fsdp.wrap import enable_wrap

    wrapped: list[nn.Module] = []

    def record(module: nn.Module, **fsdp1_kwargs: Any) -> nn.Module:
        wrapped.append(module)
        return module

    with enable_wrap(wrapper_cls=record):
        try:
            yield
        except NotImplementedError as error:
            if "nested autowrap" not in str(error):
                raise
            raise RuntimeError(
                f"{where} entered FSDP1's enable_wrap(), which builds FSDP1 units: under strategy='npu_fsdp'"
                f" modules are sharded with FSDP2 and cannot mix with FSDP1 units. Remove enable_wrap/wrap; {_INSTEAD}."
            ) from error
    if wrapped:
        _report_wrap(wrapped, where)


def _report_wrap(wrapped: list[nn.Module], where: str) -> None:
    global _wrap_reported
    if _wrap_reported:
        return
    _wrap_reported = True
    classes = sorted({type(module).__name__ for module in wrapped})
    rank_zero_warn(
        f"FSDP1's wrap() was called in {where} on {len(wrapped)} modules ({', '.join(classes)}) and does nothing"
        f" under strategy='npu_fsdp', which shards with FSDP2: {_INSTEAD}. To make those modules the units, give the"
        f" strategy auto_wrap_policy={classes}, and remove the wrap() calls."
    )


def refuse_fsdp1_units(model: nn.Module) -> None:
    """Raise if ``model`` holds FSDP1 ``FullyShardedDataParallel`` modules: FSDP2 cannot shard around them."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    found = [name or type(model).__name__ for name, module in model.named_modules()
             if isinstance(module, FullyShardedDataParallel)]
    if found:
        raise TypeError(
            f"the model holds FSDP1 FullyShardedDataParallel modules ({', '.join(found)}): strategy='npu_fsdp' shards"
            " with FSDP2 (fully_shard), whose units cannot mix with FSDP1's. Build the modules without"
            f" FullyShardedDataParallel(...) (or FSDP1's enable_wrap/wrap); {_INSTEAD}."
        )


__all__ = ["fsdp1_wrap_reported", "refuse_fsdp1_units"]
