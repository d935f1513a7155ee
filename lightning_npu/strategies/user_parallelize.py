"""npu_fsdp's ``parallelize_fn`` option: the user's own function shards the model, as Lightning's
``ModelParallelStrategy(parallelize_fn)`` lets it (litgpt's ``finetune_lora`` is one such project).

The rules:

- the function receives what Lightning gives it: the module and the run's 2-D ``DeviceMesh`` with the dimensions
  ``"data_parallel"`` and ``"tensor_parallel"`` (``tensor_parallel_size`` sizes the second; the first takes every
  other device), on the NPUs; it must return the module it was given, sharded in place (``fully_shard``,
  ``parallelize_module``, ``checkpoint_wrapper`` over its children);
- it replaces npu_fsdp's own sharding: the options that choose that (``CHOSEN_BY_NPU_FSDP``) must stay at their
  defaults, else the strategy is refused when it is made, naming them;
- everything else stays npu_fsdp's: the first weights (rank 0's values sent to every rank, modules left on the meta
  device initialised by ``reset_parameters()``, see ``initial_state``), precision, checkpoints, gradient clipping.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable

from torch import nn

from lightning_npu.facts.options import FSDPOptions
from lightning_npu.strategies.initial_state import InitialState

#: The options through which npu_fsdp shards by itself; a parallelize_fn does their work.
CHOSEN_BY_NPU_FSDP = (
    "auto_wrap_policy", "zero_stage", "sharding", "activation_checkpointing_policy", "cpu_offload", "parallel_plan",
    "context_parallel_size", "expert_parallel_size", "pipeline_parallel_size",
)


def check_parallelize_fn(options: FSDPOptions) -> None:
    """ValueError naming the options set beside ``parallelize_fn`` that it replaces; nothing without one."""
    function = options.parallelize_fn
    if function is None:
        return
    if not callable(function):
        raise ValueError(f"parallelize_fn={function!r} is not a function: give parallelize_fn(module, device_mesh)"
                         " -> module, as Lightning's ModelParallelStrategy takes it")
    defaults = {spec.name: spec.default for spec in fields(FSDPOptions)}
    given = [f"{name}={getattr(options, name)!r}" for name in CHOSEN_BY_NPU_FSDP
             if getattr(options, name) != defaults[name]]
    if given:
        raise ValueError(
            f"parallelize_fn={_name(function)} shards the model itself, so npu_fsdp does not, and {', '.join(given)}"
            " would be ignored: apply that in the function (fully_shard(..., reshard_after_forward=...),"
            " checkpoint_wrapper, offload_policy) and leave those options out, or drop parallelize_fn and let"
            " npu_fsdp shard with them")


def parallelize_with(function: Callable[[nn.Module, Any], nn.Module], model: nn.Module, device_mesh: Any,
                     state: InitialState) -> None:
    """Run the user's ``function`` on ``model`` and ``device_mesh`` (Lightning's 2-D mesh), then rename the meta
    tensors and buffers of ``state`` (captured before) to the names the function gave them: a ``checkpoint_wrapper``
    puts its child one level down, and ``initial_state.apply`` finds those by name (its values go through torch's
    ``set_model_state_dict``, which reads names without the wrappers, as captured)."""
    before = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    returned = function(model, device_mesh)
    if returned is not model:
        raise TypeError(
            f"parallelize_fn={_name(function)} returned {type(returned).__name__}, not the module it was given: under"
            " npu_fsdp it must shard the module in place (fully_shard, parallelize_module, wrapping its children)"
            " and return it")
    renamed = {}
    for name, module in model.named_modules(remove_duplicate=False):
        old = before.get(id(module))
        if old is not None and old != name:
            renamed[old] = name
    if not renamed:
        return

    def new_name(tensor_name: str) -> str:
        prefix, _, leaf = tensor_name.rpartition(".")
        return f"{renamed.get(prefix, prefix)}.{leaf}" if prefix else tensor_name

    state.meta_names = frozenset(new_name(name) for name in state.meta_names)
    state.buffers = {new_name(name): value for name, value in state.buffers.items()}


def _name(function: Any) -> str:
    return getattr(function, "__qualname__", repr(function))


__all__ = ["CHOSEN_BY_NPU_FSDP", "check_parallelize_fn", "parallelize_with"]
