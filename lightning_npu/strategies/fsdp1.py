"""FSDP1 code met under ``npu_fsdp``, which shards with FSDP2 (``fully_shard``): what it does there, said plainly.

Lightning's ``FSDPStrategy`` builds ``configure_model`` inside FSDP1's ``enable_wrap``, so ``wrap(module)`` there
makes an FSDP1 unit. Outside ``enable_wrap``, torch's ``wrap()`` returns the module unchanged: ported to npu_fsdp,
the calls would silently do nothing. npu_fsdp therefore builds ``configure_model`` inside an ``enable_wrap`` whose
wrapper only records the modules (and returns them unchanged), and warns once per process naming what npu_fsdp
does instead. The model trains as any other: its units come from ``auto_wrap_policy``.

FSDP1 units themselves (``FullyShardedDataParallel(...)``, or ``enable_wrap`` of the user's own, which torch
cannot nest in npu_fsdp's) are refused before anything is sharded: FSDP2 units cannot be mixed with them.

FSDP1's static APIs (``FullyShardedDataParallel.summon_full_params``, ``.state_dict_type``,
``.full_optim_state_dict``, ...) look only for FSDP1 units: given a model FSDP2 sharded they would gather nothing,
switch nothing or return nothing, silently. Once npu_fsdp has sharded a model (``refuse_fsdp1_apis``), each of them
given a model with FSDP2 units and no FSDP1 unit fails naming its FSDP2 replacement; with FSDP1 units they behave as
before.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Any, Callable, Generator

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


_GATHERED = ("torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=StateDictOptions("
             "full_state_dict=True)), or parameter.full_tensor() of each (DTensor) parameter")
_MODEL_STATE = ("torch.distributed.checkpoint.state_dict.get_model_state_dict / set_model_state_dict with"
                " StateDictOptions(full_state_dict=True) for a full state, False for a sharded one (or the strategy's"
                " state_dict_type option for Lightning's checkpoints)")
_OPTIMIZER_STATE = ("torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer, options="
                    "StateDictOptions(full_state_dict=True))")
_OPTIMIZER_LOAD = ("torch.distributed.checkpoint.state_dict.set_optimizer_state_dict(model, optimizer,"
                   " optim_state_dict, options=StateDictOptions(full_state_dict=True))")

#: FSDP1's static APIs that look only for FSDP1 units, and their FSDP2 replacements.
FSDP1_APIS = {
    "summon_full_params": _GATHERED + "; to keep a unit gathered, its unshard() / reshard()",
    "state_dict_type": _MODEL_STATE,
    "set_state_dict_type": _MODEL_STATE,
    "get_state_dict_type": _MODEL_STATE,
    "full_optim_state_dict": _OPTIMIZER_STATE,
    "sharded_optim_state_dict": _OPTIMIZER_STATE.replace("True", "False"),
    "optim_state_dict": _OPTIMIZER_STATE,
    "optim_state_dict_to_load": _OPTIMIZER_LOAD,
    "shard_full_optim_state_dict": _OPTIMIZER_LOAD,
    "scatter_full_optim_state_dict": _OPTIMIZER_LOAD,
    "flatten_sharded_optim_state_dict": _OPTIMIZER_LOAD.replace("True", "False"),
}
# FSDP.fsdp_modules() stays: its empty answer is right for an FSDP2 model, and torch's own DCP state-dict API asks it.
_REFUSING = "_lightning_npu_refuses_on_fsdp2"


def refuse_fsdp1_apis() -> None:
    """Make each of ``FSDP1_APIS``, given a model with FSDP2 units and no FSDP1 unit, fail naming its FSDP2
    replacement (idempotent; FSDP1 models are unaffected)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for name, replacement in FSDP1_APIS.items():
        original = getattr(FullyShardedDataParallel, name)
        if not getattr(original, _REFUSING, False):
            setattr(FullyShardedDataParallel, name, staticmethod(_refusing_on_fsdp2(name, original, replacement)))


def _refusing_on_fsdp2(name: str, original: Callable[..., Any], replacement: str) -> Callable[..., Any]:
    signature = inspect.signature(original)
    model_argument = "module" if "module" in signature.parameters else "model"

    @functools.wraps(original)
    def api(*args: Any, **kwargs: Any) -> Any:
        model = signature.bind_partial(*args, **kwargs).arguments.get(model_argument)
        if isinstance(model, nn.Module) and _sharded_by_fsdp2_only(model):
            raise TypeError(
                f"FullyShardedDataParallel.{name}() is an FSDP1 API, and {type(model).__name__} is sharded with FSDP2"
                f" (strategy='npu_fsdp'): it would find no FSDP1 unit and silently do nothing. Use {replacement}."
            )
        return original(*args, **kwargs)

    setattr(api, _REFUSING, True)
    return api


def _sharded_by_fsdp2_only(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    modules = list(model.modules())
    return any(isinstance(m, FSDPModule) for m in modules) and not any(
        isinstance(m, FullyShardedDataParallel) for m in modules)


__all__ = ["FSDP1_APIS", "fsdp1_wrap_reported", "refuse_fsdp1_apis", "refuse_fsdp1_units"]
