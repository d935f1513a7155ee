"""Lightning's own sharded strategies on ``accelerator="npu"``: ``FSDPStrategy(...)``, ``strategy="fsdp"`` (and the
other names Lightning registers for it, ``"fsdp_cpu_offload"``) and the Trainer's ``ModelParallelStrategy(...)``
become ``npu_fsdp``, option by option.

``TRANSLATIONS`` declares, once, how each option Lightning's strategies store becomes npu_fsdp's: the function that
maps it (exactly, or not at all), and the words of docs/porting.md's table (``porting_table``, generated). An option
with no exact counterpart fails naming the option, why, and the nearest setting; nothing is dropped silently. The run
logs (INFO, rank zero) what each option became.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import lightning.fabric.strategies as fabric_strategies
import lightning.pytorch.strategies as trainer_strategies
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities import rank_zero_info

from lightning_npu import compat
from lightning_npu.strategies.fsdp import NPUFabricFSDPStrategy, NPUFSDPStrategy

#: Lightning's strategy classes converted here, by the name the table and the messages use.
FSDP = "FSDPStrategy"
MODEL_PARALLEL = "ModelParallelStrategy"
_TRAINER_CLASSES = {trainer_strategies.FSDPStrategy: FSDP, trainer_strategies.ModelParallelStrategy: MODEL_PARALLEL}
_FABRIC_CLASSES = {fabric_strategies.FSDPStrategy: FSDP, fabric_strategies.ModelParallelStrategy: MODEL_PARALLEL}

#: FSDP1's sharding strategies -> npu_fsdp's (sharding, zero_stage).
_SHARDING_STRATEGIES = {
    "FULL_SHARD": ("full", 3),
    "SHARD_GRAD_OP": ("full", 2),
    "HYBRID_SHARD": ("hybrid", 3),
    "_HYBRID_SHARD_ZERO2": ("hybrid", 2),
}


class NotExact(ValueError):
    """An option of Lightning's strategy that npu_fsdp cannot reproduce exactly: the option, why, the nearest."""

    def __init__(self, strategy: str, option: str, value: Any, reason: str, nearest: str) -> None:
        super().__init__(
            f"{strategy}({option}={_shown(value)}) has no exact counterpart on accelerator='npu', where Lightning's"
            f" {strategy} runs as strategy='npu_fsdp' (FSDP2): {reason}. Nearest setting: {nearest}"
        )


@dataclass(frozen=True)
class Run:
    """What a translation may need to know about the run: its devices and precision, and the strategy's class."""

    strategy: str  # FSDP or MODEL_PARALLEL
    num_nodes: int
    devices_per_node: int
    precision: Any

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node


#: A translation's result: what the option was (as the log shows it), npu_fsdp's options it sets ({}: npu_fsdp
#: behaves so anyway) and a note for the log ("": none); None: the option was left at a default with nothing to say.
Translated = Optional[tuple[Any, dict[str, Any], str]]


@dataclass(frozen=True)
class Translation:
    """How one option of Lightning's strategies becomes npu_fsdp's, declared once: ``translate(strategy, run)`` does
    it (raising ``NotExact``), ``becomes`` and ``fails`` are docs/porting.md's words for it."""

    option: str
    strategies: tuple[str, ...]
    becomes: str
    fails: str
    translate: Callable[[Any, Run], Translated]


def _auto_wrap_policy(strategy: Any, run: Run) -> Translated:
    policy = compat.fsdp1_kwargs(strategy).get("auto_wrap_policy")
    if policy is None:
        return None
    return policy, {"auto_wrap_policy": _policy_classes("auto_wrap_policy", policy, run)}, ""


def _policy_classes(option: str, policy: Any, run: Run) -> list[type]:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if isinstance(policy, ModuleWrapPolicy):
        return sorted(compat.wrap_policy_classes(policy), key=lambda cls: cls.__qualname__)
    raise NotExact(
        run.strategy, option, policy, "FSDP2 has no wrap-policy functions: its units are chosen by module class, and a"
        " function's choice (by size, by a predicate) cannot be read before the model exists",
        f"{option}={{Block}}, the set of module classes the function selects (unset: npu_fsdp's repeated block)"
        if option == "auto_wrap_policy" else f"{option}={{Block}}, the set of module classes the function selects")


def _sharding_strategy(strategy: Any, run: Run) -> Translated:
    name = strategy.sharding_strategy.name
    if name == "NO_SHARD":
        raise NotExact(run.strategy, "sharding_strategy", name, "NO_SHARD replicates every parameter, which is DDP",
                       "strategy='npu_ddp'")
    sharding, zero_stage = _SHARDING_STRATEGIES[name]
    return name, {"sharding": sharding, "zero_stage": zero_stage}, ""


def _device_mesh(strategy: Any, run: Run) -> Translated:
    mesh = compat.fsdp1_kwargs(strategy).get("device_mesh")
    if mesh is None:
        return None
    hybrid = _SHARDING_STRATEGIES.get(strategy.sharding_strategy.name, ("full",))[0] == "hybrid"
    expected = (run.num_nodes, run.devices_per_node) if hybrid else (1, run.world_size)
    if not isinstance(mesh, tuple) or tuple(mesh) != expected:
        raise NotExact(
            run.strategy, "device_mesh", mesh, "npu_fsdp builds its own mesh: full sharding over every device, or"
            f" (sharding='hybrid') sharding within each node and replicating across nodes, here {expected}",
            f"sharding_strategy='HYBRID_SHARD' with device_mesh={(run.num_nodes, run.devices_per_node)} (or no"
            " device_mesh), or npu_fsdp's own sizes (tensor_parallel_size, context_parallel_size)")
    return mesh, {}, f"npu_fsdp's mesh for sharding={'hybrid' if hybrid else 'full'}"


def _state_dict_type(strategy: Any, run: Run) -> Translated:
    value = compat.fsdp1_state_dict_type(strategy)
    return value, {"state_dict_type": value}, ""


def _activation_checkpointing(strategy: Any, run: Run) -> Translated:
    kwargs = compat.fsdp1_activation_checkpointing(strategy)
    if not kwargs:
        return None
    if "auto_wrap_policy" in kwargs:
        policy = kwargs["auto_wrap_policy"]
        classes = _policy_classes("activation_checkpointing_policy", policy, run)
        return policy, {"activation_checkpointing_policy": classes}, ""
    # The deprecated activation_checkpointing=[classes]: Lightning keeps them only in its check function's closure.
    classes = inspect.getclosurevars(kwargs["check_fn"]).nonlocals.get("classes")
    if not isinstance(classes, tuple):
        raise NotExact(run.strategy, "activation_checkpointing", kwargs["check_fn"], "its module classes cannot be read",
                       "activation_checkpointing_policy={Block}")
    return set(classes), {"activation_checkpointing_policy": sorted(classes, key=lambda cls: cls.__qualname__)}, ""


def _cpu_offload(strategy: Any, run: Run) -> Translated:
    return strategy.cpu_offload, {"cpu_offload": strategy.cpu_offload.offload_params}, ""


def _mixed_precision(strategy: Any, run: Run) -> Translated:
    policy = strategy.mixed_precision
    if policy is None:
        return None
    import torch

    nearest = {torch.bfloat16: "'bf16-mixed'", torch.float16: "'16-mixed'"}.get(policy.param_dtype, "'32-true'")
    raise NotExact(
        run.strategy, "mixed_precision", policy, "npu_fsdp takes its dtypes from the run's precision, with bf16 or"
        " fp16 parameters for compute and fp32 gradient reductions (FSDP2's MixedPrecisionPolicy), so that one"
        " setting decides autocast, the loss scaler and the sharded dtypes",
        f"precision={nearest} on the Trainer / Fabric, without mixed_precision")


def _flag(option: str, exact: bool, reason: str, nearest: str) -> Callable[[Any, Run], Translated]:
    """A boolean FSDP1 keyword that npu_fsdp always behaves as ``exact``: the other value fails."""

    def translate(strategy: Any, run: Run) -> Translated:
        kwargs = compat.fsdp1_kwargs(strategy)
        if option not in kwargs:
            return None
        if bool(kwargs[option]) != exact:
            raise NotExact(run.strategy, option, kwargs[option], reason, nearest)
        return kwargs[option], {}, "what npu_fsdp does"

    return translate


def _process_group(strategy: Any, run: Run) -> Translated:
    group = compat.fsdp1_kwargs(strategy).get("process_group")
    if group is None:
        return None
    raise NotExact(run.strategy, "process_group", group, "npu_fsdp builds its process groups from its device mesh",
                   "sharding_strategy='HYBRID_SHARD' (shard within a node) or none (shard over every device)")


def _other_fsdp1_kwargs(strategy: Any, run: Run) -> Translated:
    mapped = {"auto_wrap_policy", "device_mesh", "limit_all_gathers", "use_orig_params", "sync_module_states",
              "process_group"}
    others = {name: value for name, value in compat.fsdp1_kwargs(strategy).items() if name not in mapped}
    if not others:
        return None
    name, value = next(iter(others.items()))
    raise NotExact(run.strategy, name, value, "it is a FullyShardedDataParallel (FSDP1) argument that FSDP2 has no"
                   " counterpart for", "remove it (npu_fsdp's options: docs/strategies.md)")


def _timeout(strategy: Any, run: Run) -> Translated:
    timeout = compat.process_group_timeout(strategy)
    if timeout is None or timeout == default_pg_timeout:
        return None
    return timeout, {"timeout": timeout}, ""


def _process_group_backend(strategy: Any, run: Run) -> Translated:
    backend = compat.process_group_backend_given(strategy)
    return None if backend is None else (backend, {"process_group_backend": backend}, "")


def _sizes(strategy: Any, run: Run) -> tuple[int, int]:
    """ModelParallelStrategy's (data_parallel_size, tensor_parallel_size) on this run's devices."""
    dp, tp = compat.model_parallel_sizes(strategy)
    world = run.world_size
    if tp == "auto":
        tp = 1 if dp == "auto" else world // dp if world % dp == 0 else 0
    if dp == "auto":
        dp = world // tp if tp and world % tp == 0 else 0
    if dp * tp != world:
        given = compat.model_parallel_sizes(strategy)
        raise NotExact(
            run.strategy, "data_parallel_size", given[0], f"with tensor_parallel_size={_shown(given[1])} it does not"
            f" cover the {world} devices ({run.num_nodes} nodes x {run.devices_per_node}): npu_fsdp shards over every"
            " device that no tensor-parallel group takes",
            f"data_parallel_size='auto' with a tensor_parallel_size that divides {run.devices_per_node}")
    return dp, tp


def _data_parallel_size(strategy: Any, run: Run) -> Translated:
    dp, _ = _sizes(strategy, run)
    return compat.model_parallel_sizes(strategy)[0], {}, f"{dp} data-parallel ranks, over which FSDP shards"


def _tensor_parallel_size(strategy: Any, run: Run) -> Translated:
    _, tp = _sizes(strategy, run)
    given = compat.model_parallel_sizes(strategy)[1]
    note = (f"Lightning's own 'auto' would be {run.devices_per_node} (every device of a node, no FSDP sharding within"
            " it); give tensor_parallel_size=N to split layers" if given == "auto" else "")
    return given, {"tensor_parallel_size": tp}, note


def _parallelize_fn(strategy: Any, run: Run) -> Translated:
    function = compat.model_parallel_function(strategy)
    if function is None:  # the Trainer's: the LightningModule's configure_model parallelizes
        return None
    return function, {"parallelize_fn": function}, "called with the module and the NPUs' DeviceMesh, as Lightning does"


def _save_distributed_checkpoint(strategy: Any, run: Run) -> Translated:
    sharded = compat.saves_distributed_checkpoint(strategy)
    return sharded, {"state_dict_type": "sharded" if sharded else "full"}, ""


_BOTH = (FSDP, MODEL_PARALLEL)

#: Every option of Lightning's FSDPStrategy and ModelParallelStrategy, and what it becomes under npu_fsdp.
TRANSLATIONS = (
    Translation("auto_wrap_policy", (FSDP,),
                "a set of classes or `ModuleWrapPolicy(classes)`: `auto_wrap_policy=[classes]`; unset: npu_fsdp's"
                " repeated block (Lightning: one unit; the same numbers, less memory)",
                "a policy function (`size_based_auto_wrap_policy`, a lambda): nearest `auto_wrap_policy={Block}`",
                _auto_wrap_policy),
    Translation("sharding_strategy", (FSDP,),
                "`FULL_SHARD`: `zero_stage=3`; `SHARD_GRAD_OP`: `zero_stage=2`; `HYBRID_SHARD`: `sharding=\"hybrid\"`;"
                " `_HYBRID_SHARD_ZERO2`: `sharding=\"hybrid\", zero_stage=2` (strings in any case, or the enum)",
                "`NO_SHARD`: nearest `strategy=\"npu_ddp\"`", _sharding_strategy),
    Translation("device_mesh", (FSDP,),
                "`(num_nodes, devices)` with `HYBRID_SHARD`, `(1, world size)` otherwise: npu_fsdp's own mesh",
                "any other shape, or a `DeviceMesh`: nearest `HYBRID_SHARD` with `(num_nodes, devices)`",
                _device_mesh),
    Translation("state_dict_type", (FSDP,), "the same (`\"full\"`: one file; `\"sharded\"`: a DCP directory); Lightning's"
                " default stays (Trainer `\"full\"`, Fabric `\"sharded\"`)", "-", _state_dict_type),
    Translation("activation_checkpointing_policy", (FSDP,),
                "a set of classes or `ModuleWrapPolicy(classes)` (also the deprecated `activation_checkpointing`):"
                " `activation_checkpointing_policy=[classes]`",
                "a policy function: nearest `activation_checkpointing_policy={Block}`", _activation_checkpointing),
    Translation("cpu_offload", (FSDP,), "`True` / `CPUOffload(offload_params=True)`: `cpu_offload=True`", "-",
                _cpu_offload),
    Translation("mixed_precision", (FSDP,), "-",
                "always: nearest `precision=\"bf16-mixed\"` (`\"16-mixed\"` for fp16 parameters) on the Trainer / Fabric",
                _mixed_precision),
    Translation("limit_all_gathers", (FSDP,), "`True`: what FSDP2 always does (it bounds the all-gathers in flight)",
                "`False`: nearest: leave it out",
                _flag("limit_all_gathers", True, "FSDP2 always bounds the all-gathers in flight",
                      "leave limit_all_gathers out")),
    Translation("use_orig_params", (FSDP,), "`True` (Lightning's default): what FSDP2 always does",
                "`False`: nearest: leave it out",
                _flag("use_orig_params", True, "FSDP2 has no flat parameters: each parameter stays itself (a DTensor)",
                      "leave use_orig_params out")),
    Translation("sync_module_states", (FSDP,), "`True`: what npu_fsdp always does (rank 0's weights are sent to every"
                " rank)", "`False`: nearest: leave it out",
                _flag("sync_module_states", True, "npu_fsdp always starts every rank from rank 0's weights",
                      "leave sync_module_states out")),
    Translation("process_group", (FSDP,), "-", "always: nearest `HYBRID_SHARD` (or nothing: every device)",
                _process_group),
    Translation("other FullyShardedDataParallel arguments", (FSDP,), "-",
                "always (`forward_prefetch`, `param_init_fn`, `ignored_modules`, ...): nearest: leave it out",
                _other_fsdp1_kwargs),
    Translation("timeout", _BOTH, "`timeout=` (Lightning's 30 min default: npu_fsdp's default)", "-", _timeout),
    Translation("process_group_backend", _BOTH, "`process_group_backend=`", "-", _process_group_backend),
    Translation("data_parallel_size", (MODEL_PARALLEL,),
                "`\"auto\"`: every device no tensor-parallel group takes (Lightning's own `\"auto\"` is `num_nodes`:"
                " no sharding within a node); an int: checked to be that",
                "an int with tensor_parallel_size not covering the devices: nearest `\"auto\"`", _data_parallel_size),
    Translation("tensor_parallel_size", (MODEL_PARALLEL,),
                "`\"auto\"`: `1` (Lightning's own `\"auto\"` is every device of a node: give the size to split layers);"
                " an int: `tensor_parallel_size=`; `self.device_mesh[\"tensor_parallel\"]` in `configure_model` is"
                " that group", "-", _tensor_parallel_size),
    Translation("parallelize_fn", (MODEL_PARALLEL,),
                "Fabric's: `parallelize_fn=` (the function shards; npu_fsdp's own sharding options stay unset)", "-",
                _parallelize_fn),
    Translation("save_distributed_checkpoint", (MODEL_PARALLEL,),
                "`True`: `state_dict_type=\"sharded\"`; `False`: `\"full\"`", "-", _save_distributed_checkpoint),
)


def lightning_strategy_name(flag: Any, trainer: bool) -> Optional[str]:
    """``FSDP`` / ``MODEL_PARALLEL`` when ``flag`` (a ``strategy=`` string or instance) is one of Lightning's own
    strategies converted here (its exact class, or a name Lightning registered for it); None otherwise."""
    classes = _TRAINER_CLASSES if trainer else _FABRIC_CLASSES
    if isinstance(flag, str):
        registry = trainer_strategies.StrategyRegistry if trainer else fabric_strategies.STRATEGY_REGISTRY
        return classes.get(registry[flag]["strategy"]) if flag in registry else None
    return classes.get(type(flag))


def as_npu_fsdp(flag: Any, *, trainer: bool, num_nodes: int, devices_per_node: int, precision: Any) -> Any:
    """npu_fsdp (``NPUFSDPStrategy`` / ``NPUFabricFSDPStrategy``) with ``flag``'s options, logging what each became;
    ``NotExact`` for an option it cannot reproduce. ``flag``: a strategy, or a name Lightning registered for one."""
    name = lightning_strategy_name(flag, trainer)
    if name is None:
        raise TypeError(f"strategy={flag!r} is not one of Lightning's FSDPStrategy / ModelParallelStrategy")
    shown = repr(flag) if isinstance(flag, str) else f"{name}(...)"
    if isinstance(flag, str):
        registry = trainer_strategies.StrategyRegistry if trainer else fabric_strategies.STRATEGY_REGISTRY
        flag = registry.get(flag)
    run = Run(strategy=name, num_nodes=num_nodes, devices_per_node=devices_per_node, precision=precision)
    options: dict[str, Any] = {}
    became = []
    for translation in TRANSLATIONS:
        if name not in translation.strategies:
            continue
        result = translation.translate(flag, run)
        if result is None:
            continue
        value, mapped, note = result
        options.update(mapped)
        what = ", ".join(f"{key}={_shown(item)}" for key, item in mapped.items())
        what = " ".join(filter(None, (what, f"({note})" if note else "")))
        became.append(f"{translation.option}={_shown(value)} -> {what}")
    rank_zero_info(f"strategy={shown} on accelerator='npu' runs as strategy='npu_fsdp' (FSDP2): " + "; ".join(became))
    return (NPUFSDPStrategy if trainer else NPUFabricFSDPStrategy)(**options)


def porting_table() -> str:
    """The Markdown table of ``TRANSLATIONS`` (docs/porting.md's, ``tools/generate_docs.py``)."""
    rows = [f"| `{t.option}` | {', '.join(f'`{s}`' for s in t.strategies)} | {t.becomes} | {t.fails} |"
            for t in TRANSLATIONS]
    header = ["| Lightning's option | of | under `npu_fsdp` | fails (with the nearest setting) |", "|---|---|---|---|"]
    return "\n".join([*header, *rows]) + "\n"


def _shown(value: Any) -> str:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if isinstance(value, ModuleWrapPolicy):
        return f"ModuleWrapPolicy({_shown(compat.wrap_policy_classes(value))})"
    if isinstance(value, type) or inspect.isfunction(value):
        return value.__qualname__
    if isinstance(value, (list, tuple, set)) and value and all(isinstance(item, type) for item in value):
        names = ", ".join(sorted(item.__qualname__ for item in value))
        return f"{{{names}}}" if isinstance(value, set) else f"[{names}]"
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}s"
    return repr(value)


__all__ = ["NotExact", "TRANSLATIONS", "as_npu_fsdp", "lightning_strategy_name", "porting_table"]
