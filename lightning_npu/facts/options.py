"""The ``npu_fsdp`` options, declared once (``FSDPOptions``): their defaults, types, the values each accepts (with the
error that names the value, why and the fix) and their help, from which the strategies' signature, their
docstring and the docs' options table are generated; which blocks a checkpointing ratio selects; the mesh layout.

Nothing here imports torch: ``lightning-npu plan`` reads a config's ``trainer.strategy.init_args`` with
``FSDPOptions`` too. The one check that needs the user's code (that ``parallel_plan`` imports) runs when a strategy
is made (``lightning_npu.parallel.protocol.resolve_parallel_plan``).
"""

from __future__ import annotations

import difflib
import inspect
import typing
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Callable, Iterable, Literal, Optional, Union

from lightning_npu.facts import pipeline

#: What each supported ZeRO stage means under FSDP2 (``reshard_after_forward``), in order of preference.
ZERO_STAGES = {
    3: "parameters resharded after forward, least memory",
    2: "parameters kept gathered until backward, less communication",
}
#: ``"full"``: every parameter sharded over all devices; ``"hybrid"``: sharded within a node, replicated across.
Sharding = Literal["full", "hybrid"]
SHARDINGS = typing.get_args(Sharding)
#: ``"sharded"``: a distributed checkpoint directory; ``"full"``: one consolidated file.
StateDictType = Literal["sharded", "full"]
STATE_DICT_TYPES = typing.get_args(StateDictType)
#: Module classes, their names or import paths (``auto_wrap_policy``, ``activation_checkpointing_policy``).
ModuleClasses = Optional[Iterable[Union[str, type]]]
#: A function ``plan(module) -> lightning_npu.parallel.ParallelPlan`` (how ``module`` splits over ranks), or its import
#: path (``"pkg.module.function"``), for a module that does not define ``parallel_plan()`` itself.
ParallelPlanFunction = Optional[Union[str, Callable[..., Any]]]
#: A process-group timeout: seconds (YAML) or a timedelta (Python); None: the default.
Timeout = Optional[Union[float, timedelta]]

DEFAULT_ZERO_STAGE = 3
DEFAULT_SHARDING = "full"
#: The share of the ``activation_checkpointing_policy`` blocks that recompute their activations.
DEFAULT_ACTIVATION_CHECKPOINTING_RATIO = 1.0

#: npu_fsdp's device mesh dimensions, outermost first: pipeline stages outermost (neighbouring stages exchange only
#: activations, so they can sit on different nodes), tensor parallelism innermost, so a tensor-parallel group is
#: consecutive ranks (one node's fast links); FSDP shards over ``dp_shard x cp`` (replicated over ``dp_replicate``).
MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: How attention runs over a sequence split across the ``cp`` ranks (``lightning_npu.parallel.context``).
CONTEXT_PARALLEL_ALGOS = {
    "ulysses": "all-to-all to whole sequences for a share of the heads; heads % (tp x cp) == 0, packed rows work",
    "ring": "keys and values passed around the ranks, head-tail balanced; any head count, seq_len % (2 x cp) == 0",
}
DEFAULT_CONTEXT_PARALLEL_ALGO = "ulysses"


def check_zero_stage(value: Any) -> int:
    """``value`` if it is a supported ``zero_stage``; ValueError with the choices otherwise."""
    if value not in ZERO_STAGES:
        choices = " or ".join(f"{stage} ({meaning})" for stage, meaning in ZERO_STAGES.items())
        raise ValueError(f"zero_stage={value!r} is not supported; use {choices}")
    return value


def check_sharding(value: Any) -> str:
    """``value`` if it is a supported ``sharding``; ValueError with the choices otherwise."""
    if value not in SHARDINGS:
        raise ValueError(f"sharding={value!r} is not supported; use {' or '.join(repr(s) for s in SHARDINGS)}")
    return value


def check_activation_checkpointing_ratio(value: Any) -> float:
    """``value`` as a float if it lies in [0, 1]; ValueError otherwise."""
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(
            f"activation_checkpointing_ratio={value!r} must lie in [0, 1]:"
            " it is the fraction of matching blocks whose activations are recomputed"
        )
    return float(value)


def check_memory_fraction(value: Any) -> Optional[float]:
    """``value`` as a float if it lies in (0, 1] (None: no limit); ValueError otherwise."""
    if value is None:
        return None
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(
            f"memory_fraction={value!r} must lie in (0, 1]: it is the share of each NPU's memory"
            " this process may allocate (e.g. 0.9)"
        )
    return float(value)


def check_parallel_size(option: str, value: Any) -> int:
    """``value`` if it is a positive int (a mesh dimension's size); ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{option}={value!r} must be a positive integer (the number of devices in each group)")
    return value


def check_optional_count(option: str, value: Any) -> Optional[int]:
    """``value`` if it is None (the default applies) or a positive int; ValueError otherwise."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{option}={value!r} must be a positive integer, or unset for the default")
    return value


def check_layer_counts(option: str, value: Any) -> Optional[list[int]]:
    """``value`` if it is None (the default rule applies) or a list of block counts (ints >= 0); ValueError
    otherwise."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                  for n in value):
        raise ValueError(f"{option}={value!r} must be a list of block counts, one per stage (e.g. [1, 3, 3, 1]),"
                         " or unset for the balancing rule")
    return list(value)


def check_context_parallel_algo(value: Any) -> str:
    """``value`` if it is one of ``CONTEXT_PARALLEL_ALGOS``; ValueError with the choices otherwise."""
    if value not in CONTEXT_PARALLEL_ALGOS:
        choices = "; ".join(f"{algo!r} ({meaning})" for algo, meaning in CONTEXT_PARALLEL_ALGOS.items())
        raise ValueError(f"context_parallel_algo={value!r} is not supported; use {choices}")
    return value


def check_expert_parallel_size(value: Any, layout: "MeshLayout", sharding: str) -> int:
    """``value`` if ``layout``'s ranks of different tokens within a pipeline stage and a replica (``dp_shard x cp x
    tp``, where expert parallelism borrows its ranks, ep innermost, as torchtitan's ParallelDims does) split into
    expert-parallel groups of that size; ValueError with the numbers and the fix otherwise (before workers start; the
    experts count is checked at sharding)."""
    check_parallel_size("expert_parallel_size", value)
    if value == 1:
        return value
    if sharding != "full":
        raise ValueError(
            f"expert_parallel_size={value} works with sharding='full' only for now (got sharding={sharding!r}): the"
            " experts would need a hybrid (replicated x sharded) mesh of their own; use sharding='full' or"
            " expert_parallel_size=1"
        )
    borrowed = layout.expert_parallel_ranks
    if borrowed % value:
        raise ValueError(
            f"expert_parallel_size={value} does not divide dp_shard={layout.dp_shard} x"
            f" context_parallel_size={layout.cp} x tensor_parallel_size={layout.tp} = {borrowed}: expert-parallel"
            " groups are carved out of those ranks (consecutive ranks, tensor-parallel ones first); use a divisor of"
            f" {borrowed} ({', '.join(map(str, _divisors(borrowed)))})"
        )
    return value


@dataclass(frozen=True, kw_only=True)
class MeshLayout:
    """The sizes of npu_fsdp's mesh dimensions (``MESH_DIM_NAMES``) for one run, checked against the devices.

    Rank ``(((p * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t`` sits at ``(p, r, s, c, t)``: consecutive
    ranks form a tensor-parallel group, ranks ``cp * tp`` apart are data-parallel replicas, and each pipeline stage
    is a block of ``world / pp`` consecutive ranks.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int
    cp: int = 1
    tp: int = 1

    @classmethod
    def for_run(cls, *, num_nodes: int, devices_per_node: int, sharding: str, tensor_parallel_size: int = 1,
                context_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> MeshLayout:
        """The layout of ``num_nodes x devices_per_node`` devices; ValueError with the numbers and the fix."""
        tp, cp, pp = tensor_parallel_size, context_parallel_size, pipeline_parallel_size
        world = num_nodes * devices_per_node
        if devices_per_node % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the {devices_per_node} devices of each node: a"
                " tensor-parallel group exchanges activations in every layer and must stay inside one node; use a"
                f" divisor of {devices_per_node} ({', '.join(map(str, _divisors(devices_per_node)))})"
            )
        if world % (tp * cp * pp):
            product = " x ".join(f"{name}={size}" for name, size in (
                ("pipeline_parallel_size", pp), ("tensor_parallel_size", tp), ("context_parallel_size", cp))
                if size > 1 or name != "pipeline_parallel_size")
            raise ValueError(
                f"{product} = {tp * cp * pp} does not divide the world size {world} ({num_nodes} nodes x"
                f" {devices_per_node} devices): the data-parallel size would not be a whole number; choose sizes whose"
                f" product divides {world}"
            )
        dp_replicate = 1
        if sharding == "hybrid":
            if devices_per_node % (tp * cp):
                raise ValueError(
                    f"sharding='hybrid' shards within each node of {devices_per_node} devices, which"
                    f" tensor_parallel_size={tp} x context_parallel_size={cp} = {tp * cp} does not divide; choose"
                    f" sizes whose product divides {devices_per_node}, or use sharding='full'"
                )
            if num_nodes % pp:
                raise ValueError(
                    f"sharding='hybrid' with pipeline_parallel_size={pp} replicates each stage across nodes, but"
                    f" {num_nodes} nodes do not split into {pp} equal groups; use a pipeline_parallel_size that"
                    f" divides {num_nodes}, or sharding='full'"
                )
            dp_replicate = num_nodes // pp
        return cls(pp=pp, dp_replicate=dp_replicate, dp_shard=world // (pp * dp_replicate * cp * tp), cp=cp, tp=tp)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """The size of each dimension of ``MESH_DIM_NAMES``, outermost first."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def sizes(self) -> dict[str, int]:
        """Each dimension's size by its name."""
        return dict(zip(MESH_DIM_NAMES, self.shape))

    @property
    def world_size(self) -> int:
        return self.pp * self.stage_size

    @property
    def stage_size(self) -> int:
        """How many ranks hold each pipeline stage (every rank when there is one stage)."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def data_parallel_size(self) -> int:
        """How many different batches each step trains on (the sampler's replicas): the ranks of a TP, CP or PP group
        share one."""
        return self.dp_replicate * self.dp_shard

    @property
    def loss_ranks(self) -> int:
        """How many ranks of a stage hold different tokens (``dp_replicate x dp_shard x cp``): what gradients and a
        logged loss are averaged over. Tensor-parallel ranks hold the same ones."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def expert_parallel_ranks(self) -> int:
        """How many ranks an expert-parallel group may borrow its members from (``dp_shard x cp x tp``, the ranks of
        a stage and a replica; ``expert_parallel_size`` must divide it)."""
        return self.dp_shard * self.cp * self.tp

    def coordinates(self, global_rank: int) -> dict[str, int]:
        """Where ``global_rank`` sits in each dimension (the rank formula of the class docstring read backwards)."""
        coordinates = {}
        for name, size in reversed(self.sizes.items()):
            global_rank, coordinates[name] = divmod(global_rank, size)
        return dict(reversed(coordinates.items()))

    def data_parallel_rank(self, global_rank: int) -> int:
        """Which of the ``data_parallel_size`` batches ``global_rank`` trains on: the same for every rank of a TP, CP
        or PP group."""
        at = self.coordinates(global_rank)
        return at["dp_replicate"] * self.dp_shard + at["dp_shard"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evenly_spaced(count: int, ratio: float) -> list[int]:
    """Indices of ``round(count * ratio)``-ish items spread evenly over ``count`` (ratio 0.5 of 4 -> [1, 3]):
    the blocks ``activation_checkpointing_ratio`` selects among those the policy matches."""
    return [i for i in range(count) if int((i + 1) * ratio) > int(i * ratio)]


def check_flag(option: str, value: Any) -> bool:
    """``value`` if it is True or False; ValueError otherwise (``"false"`` is a true string in Python)."""
    if not isinstance(value, bool):
        raise ValueError(f"{option}={value!r} must be True or False (in YAML: true or false)")
    return value


def check_state_dict_type(value: Any) -> str:
    """``value`` if it is one of ``STATE_DICT_TYPES``; ValueError with the choices otherwise."""
    if value not in STATE_DICT_TYPES:
        raise ValueError(
            f"state_dict_type={value!r} is not supported; use 'sharded' (a distributed checkpoint directory)"
            " or 'full' (one consolidated file)"
        )
    return value


def check_timeout(value: Any) -> Timeout:
    """``value`` if it is None, a timedelta or a positive number of seconds; ValueError otherwise."""
    if value is None or isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"timeout={value!r} must be a positive number of seconds, e.g. timeout=1800")
    return value


def option(default: Any, check: Optional[Callable[[str, Any], Any]], help: str) -> Any:
    """One ``npu_fsdp`` option of ``FSDPOptions``: its default, its check (called with the option's name and value;
    None: any value of its type) and its one-line help (the docstring and the docs' options table)."""
    return field(default=default, metadata={"check": check, "help": help})


def value_check(check: Callable[[Any], Any]) -> Callable[[str, Any], Any]:
    """An option check from one that names its option itself (``check_zero_stage``)."""
    return lambda option, value: check(value)


@dataclass(frozen=True)
class FSDPOptions:
    """Every ``npu_fsdp`` option, declared once: the strategies' keyword arguments, in this order (their signature is
    generated from it, ``constructor_signature``), defaults, types, checks, docs (``options_table``) and the
    planner's reading of ``trainer.strategy.init_args``. Adding an option is one field here plus its behaviour."""

    auto_wrap_policy: ModuleClasses = option(
        None, None, "module classes (or names / import paths) that become FSDP units, e.g. the decoder block; unset:"
        " the repeated block (the class with several instances holding the most parameters); `[]`: one unit")
    zero_stage: int = option(
        DEFAULT_ZERO_STAGE, value_check(check_zero_stage),
        "3 reshards parameters after forward (least memory); 2 keeps them gathered until backward")
    sharding: Sharding = option(
        DEFAULT_SHARDING, value_check(check_sharding),
        "`\"full\"` over all devices, or `\"hybrid\"`: shard within a node, replicate across nodes")
    activation_checkpointing_policy: ModuleClasses = option(
        None, None, "module classes (or names / import paths) whose activations are recomputed in backward")
    activation_checkpointing_ratio: float = option(
        DEFAULT_ACTIVATION_CHECKPOINTING_RATIO, value_check(check_activation_checkpointing_ratio),
        "fraction (0..1) of those modules, evenly spaced, that recompute")
    cpu_offload: bool = option(
        False, check_flag, "keep sharded parameters, gradients and optimizer states in host memory")
    state_dict_type: StateDictType = option(
        "sharded", value_check(check_state_dict_type),
        "`\"sharded\"`: a DCP directory, each rank writes its shard; `\"full\"`: one consolidated file that also"
        " loads into a plain, unsharded model")
    timeout: Timeout = option(
        None, value_check(check_timeout), "process-group timeout in seconds (or a timedelta); unset: 30 min, or"
        " more when the HCCL timeouts in the environment need it")
    memory_fraction: Optional[float] = option(
        None, value_check(check_memory_fraction), "share (0..1] of each NPU's memory this process may allocate")
    process_group_backend: Optional[str] = option(
        None, None, "the process-group backend; unset: hccl on NPUs, gloo when simulated")
    async_save: bool = option(
        False, check_flag, "write sharded checkpoints in the background while training continues (needs"
        " `state_dict_type=\"sharded\"`); saves are atomic either way")
    tensor_parallel_size: int = option(
        1, check_parallel_size, "devices (consecutive ranks, inside one node) that split each layer between them and"
        " train on the same batch (by the model's plan: `parallel_plan`); FSDP shards over the rest")
    context_parallel_size: int = option(
        1, check_parallel_size, "devices that split each sequence between them and train on the same batch (the"
        " modules the model's plan names get the group); FSDP shards over them too")
    context_parallel_algo: str = option(
        DEFAULT_CONTEXT_PARALLEL_ALGO, value_check(check_context_parallel_algo),
        "`\"ulysses\"` (all-to-all over heads; heads % (tp x cp) == 0; packed rows work) or `\"ring\"` (keys and"
        " values around the ranks; any head count; seq_len % (2 x cp) == 0)")
    sequence_parallel: bool = option(
        True, check_flag, "under tensor parallelism, passed to the plan: norms and residuals split by sequence (and"
        " under a pipeline the activations its stages exchange)")
    loss_parallel: bool = option(
        True, check_flag, "under tensor parallelism, passed to the plan (vocabulary-sharded logits); the Trainer runs"
        " the steps and backward inside torch's `loss_parallel()` (Fabric: wrap your loss and `fabric.backward` in"
        " it yourself)")
    parallel_plan: ParallelPlanFunction = option(
        None, None, "import path of (or) a function `plan(module) -> lightning_npu.parallel.ParallelPlan`: how the"
        " module splits over tensor-, context- and expert-parallel ranks; unset: the module's own `parallel_plan()`"
        " method, if any (see `lightning_npu.parallel.protocol`)")
    parallelize_fn: Optional[Callable[..., Any]] = option(
        None, None, "a function `parallelize_fn(module, device_mesh) -> module` (Lightning's ModelParallelStrategy"
        " contract; the mesh's dimensions: `\"data_parallel\"`, `\"tensor_parallel\"`) that shards the module itself"
        " instead of npu_fsdp; then the other sharding options must stay at their defaults (docs/porting.md)")
    expert_parallel_size: int = option(
        1, check_parallel_size, "devices (consecutive ranks of dp_shard x cp x tp) that split each MoE layer's experts"
        " between them and exchange its tokens by all_to_all; must divide dp_shard x cp x tp and every layer's expert"
        " count")
    pipeline_parallel_size: int = option(
        1, check_parallel_size, "pipeline stages' ranks (the outermost mesh dimension): each holds a share of the"
        " blocks (the first the embedding, the last the head) and passes activations to the next; the model names"
        " its parts in its plan (`ParallelPlan.pipeline`)")
    pipeline_schedule: str = option(
        pipeline.DEFAULT_SCHEDULE, value_check(pipeline.check_schedule),
        "`\"1F1B\"`, `\"GPipe\"`, `\"Interleaved1F1B\"` (several stages per rank), `\"ZBVZeroBubble\"` or"
        " `\"DualPipeV\"` (2 stages per rank, V-shaped)")
    pipeline_microbatches: Optional[int] = option(
        None, check_optional_count, "microbatches each step's batch splits into (its rows must divide by them); unset: one per"
        " stage")
    pipeline_stages_per_rank: Optional[int] = option(
        None, check_optional_count, "stages each rank runs: 1 (GPipe, 1F1B), 2 (ZBVZeroBubble, DualPipeV), 2 or more"
        " (Interleaved1F1B); unset: the schedule's")
    pipeline_layers_per_stage: Optional[list[int]] = option(
        None, check_layer_counts, "blocks each stage holds, in stage order (`[1, 3, 3, 1]`); unset: the balancing rule"
        " (the embedding and the head count as a block each, so the end stages take fewer; under a V-shaped schedule,"
        " whose rank 0 holds both ends, every rank an equal share)")

    def __post_init__(self) -> None:
        for spec in fields(FSDPOptions):
            check = spec.metadata["check"]
            if check is not None:
                check(spec.name, getattr(self, spec.name))
        if self.async_save and self.state_dict_type != "sharded":
            raise ValueError(
                "async_save=True needs state_dict_type='sharded': a full checkpoint is gathered on rank 0, which"
                " blocks training anyway; use state_dict_type='sharded' (consolidate later with"
                " `lightning-npu consolidate`) or async_save=False"
            )
        if self.pipeline_parallel_size > 1:
            self._check_pipeline()

    def _check_pipeline(self) -> None:
        pp = self.pipeline_parallel_size
        per_rank = pipeline.stages_per_rank(self.pipeline_schedule, self.pipeline_stages_per_rank)
        pipeline.check_microbatches(self.pipeline_schedule, self.microbatches, pp, per_rank)
        counts = self.pipeline_layers_per_stage
        if counts is not None and len(counts) != pp * per_rank:
            raise ValueError(f"pipeline_layers_per_stage={counts} gives {len(counts)} stages, but the pipeline has"
                             f" {pp * per_rank} (pipeline_parallel_size={pp} x {per_rank} per rank): give one count"
                             " per stage")
        refused = [(name, reason) for name, given, reason in (
            ("activation_checkpointing_policy", bool(self.activation_checkpointing_policy)
             and self.activation_checkpointing_ratio > 0 and pipeline.SCHEDULES[self.pipeline_schedule].splits_backward,
             f"pipeline_schedule={self.pipeline_schedule!r} computes each backward in two passes (input, then weight"
             " gradients), and torch 2.13 cannot recompute a checkpointed block's activations a second time; use"
             " 1F1B or Interleaved1F1B with activation checkpointing"),
        ) if given]
        if refused:
            raise ValueError(
                f"pipeline_parallel_size={pp} does not run with " + "; ".join(f"{name} ({why})" for name, why in refused)
                + ": drop those options, or train without pipeline parallelism"
            )

    @property
    def stages_per_rank(self) -> int:
        """How many pipeline stages each rank runs."""
        return pipeline.stages_per_rank(self.pipeline_schedule, self.pipeline_stages_per_rank)

    @property
    def microbatches(self) -> int:
        """The microbatches each pipelined step splits its batch into."""
        if self.pipeline_microbatches is not None:
            return self.pipeline_microbatches
        return pipeline.default_microbatches(self.pipeline_schedule, self.pipeline_parallel_size,
                                             self.stages_per_rank)

    def layout(self, num_nodes: int, devices_per_node: int) -> MeshLayout:
        """The mesh these options give ``num_nodes x devices_per_node`` devices (ValueError if they cannot)."""
        layout = MeshLayout.for_run(num_nodes=num_nodes, devices_per_node=devices_per_node, sharding=self.sharding,
                                    tensor_parallel_size=self.tensor_parallel_size,
                                    context_parallel_size=self.context_parallel_size,
                                    pipeline_parallel_size=self.pipeline_parallel_size)
        check_expert_parallel_size(self.expert_parallel_size, layout, self.sharding)
        return layout

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2's ``reshard_after_forward`` for ``zero_stage``."""
        return self.zero_stage == 3


#: Options that were renamed: the old name -> what to write instead (``check_option_names`` says it).
RENAMED = {
    "tensor_parallel_plan": "parallel_plan (a function returning lightning_npu.parallel.ParallelPlan("
                            "tensor_parallel=<the old plan>), or a parallel_plan() method on the model)",
}


def check_option_names(names: Iterable[str], where: str) -> None:
    """TypeError naming each of ``names`` that is no ``npu_fsdp`` option, with the closest option or what replaced
    it (``where``: who was given them, for the message)."""
    known = [spec.name for spec in fields(FSDPOptions)]
    unknown = [name for name in names if name not in known]
    if not unknown:
        return
    problems = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        if name in RENAMED:
            problems.append(f"{name!r} (renamed: use {RENAMED[name]})")
        else:
            problems.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"{where}: {', '.join(problems)} {'is not an option' if len(unknown) == 1 else 'are not options'} of"
        f" npu_fsdp; its options are {', '.join(known)}"
    )


def constructor_signature() -> inspect.Signature:
    """``__init__(self, <every option of FSDPOptions, in order, with its default and type>)``: what LightningCLI
    (jsonargparse), ``help()`` and IDEs read from a constructor that takes the options as ``**kwargs``."""
    types = typing.get_type_hints(FSDPOptions)
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature(
        [inspect.Parameter("self", kind)]
        + [inspect.Parameter(spec.name, kind, default=spec.default, annotation=types[spec.name])
           for spec in fields(FSDPOptions)],
        return_annotation=None,
    )


def options_docstring() -> str:
    """The constructor's ``Args:`` section (Google style, as jsonargparse reads it), one line per option."""
    return "Args:\n" + "".join(f"    {spec.name}: {spec.metadata['help']}\n" for spec in fields(FSDPOptions))


def options_table() -> str:
    """The Markdown table of every option, its default and its help (docs/strategies.md's, ``tools/generate_docs.py``)."""
    rows = [f"| `{spec.name}` | `{_shown(spec.default)}` | {spec.metadata['help']} |" for spec in fields(FSDPOptions)]
    return "\n".join(["| option | default | meaning |", "|---|---|---|", *rows]) + "\n"


def _shown(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)

