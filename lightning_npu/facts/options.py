"""The ``npu_fsdp`` options that are facts rather than torch objects: their defaults, the values each accepts
(with the error that names the value, why and the fix), and which blocks a checkpointing ratio selects.

``strategies.fsdp.FSDPOptions`` adds the module-class policies and the torch-side work on top of
``FSDPChoices``; ``lightning-npu plan`` validates the same options here without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

#: What each supported ZeRO stage means under FSDP2 (``reshard_after_forward``), in order of preference.
ZERO_STAGES = {
    3: "parameters resharded after forward, least memory",
    2: "parameters kept gathered until backward, less communication",
}
#: ``"full"``: every parameter sharded over all devices; ``"hybrid"``: sharded within a node, replicated across.
SHARDINGS = ("full", "hybrid")

DEFAULT_ZERO_STAGE = 3
DEFAULT_SHARDING = "full"
#: The share of the ``activation_checkpointing_policy`` blocks that recompute their activations.
DEFAULT_ACTIVATION_CHECKPOINTING_RATIO = 1.0

#: npu_fsdp's device mesh dimensions, outermost first: tensor parallelism innermost, so a tensor-parallel group is
#: consecutive ranks (one node's fast links), and FSDP shards over ``dp_shard x cp``.
MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
#: How attention runs over a sequence split across the ``cp`` ranks (``lightning_npu.kernels.context_parallel``).
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


def check_context_parallel_algo(value: Any) -> str:
    """``value`` if it is one of ``CONTEXT_PARALLEL_ALGOS``; ValueError with the choices otherwise."""
    if value not in CONTEXT_PARALLEL_ALGOS:
        choices = "; ".join(f"{algo!r} ({meaning})" for algo, meaning in CONTEXT_PARALLEL_ALGOS.items())
        raise ValueError(f"context_parallel_algo={value!r} is not supported; use {choices}")
    return value


def check_expert_parallel_size(value: Any, layout: "MeshLayout", sharding: str, *, with_context_parallel: bool = False
                               ) -> int:
    """``value`` if ``layout``'s FSDP shard ranks (``dp_shard x cp``, where expert parallelism borrows its ranks as
    torchtitan's ParallelDims does) split into expert-parallel groups of that size; ValueError with the numbers and
    the fix otherwise (before workers start; the experts count is checked at sharding). ``with_context_parallel``:
    the caller handles expert parallelism under context parallelism (npu_fsdp does; the planner does not model it
    yet, so it leaves this off and refuses cp > 1 with ep > 1)."""
    check_parallel_size("expert_parallel_size", value)
    if value == 1:
        return value
    if layout.tp > 1 or sharding != "full" or (layout.cp > 1 and not with_context_parallel):
        supported = ("tensor_parallel_size=1" if with_context_parallel
                     else "tensor_parallel_size = context_parallel_size = 1")
        raise ValueError(
            f"expert_parallel_size={value} works with sharding='full' and {supported} only for now (got"
            f" sharding={sharding!r}, tensor_parallel_size={layout.tp}, context_parallel_size={layout.cp}); drop one"
            " of the two"
        )
    borrowed = layout.expert_parallel_ranks
    if borrowed % value:
        dims = f"dp_shard={layout.dp_shard} x context_parallel_size={layout.cp}" if layout.cp > 1 else "data-parallel"
        raise ValueError(
            f"expert_parallel_size={value} does not divide the {dims} size {borrowed}: expert-parallel groups are"
            " carved out of the ranks FSDP shards over (dp_shard x cp); use a divisor of"
            f" {borrowed} ({', '.join(map(str, _divisors(borrowed)))})"
        )
    return value


def indivisible_by_tensor_parallel(tp: int, sizes: Iterable[tuple[str, int]]) -> list[str]:
    """The ``(name, value)`` sizes of a model that ``tp`` tensor-parallel ranks cannot split evenly, each as a problem
    with its numbers (empty when all divide): what the recipe checks before workers start, and the planner too."""
    return [f"{name}={value} is not divisible by tensor_parallel_size={tp}: each rank holds 1/{tp} of them"
            for name, value in sizes if value % tp]


def check_context_parallel_shapes(cp: int, algo: str, *, heads: int, seq_len: int, tp: int = 1) -> None:
    """ValueError, with the numbers and the fix, unless ``cp`` context-parallel ranks can split a model of ``heads``
    query heads (before ``tp``-way tensor parallelism) and ``seq_len``-token sequences by ``algo``: what a recipe
    checks before any worker starts (the kernels check the same at run time). Any key/value head count works: Ulysses
    repeats key/value heads where cp does not divide them."""
    if cp == 1:
        return
    check_context_parallel_algo(algo)
    if algo == "ulysses":
        if heads % (tp * cp):
            raise ValueError(
                f"context_parallel_algo='ulysses' splits each rank's {heads} / tensor_parallel_size={tp} attention"
                f" heads over context_parallel_size={cp} ranks, which needs heads % (tp x cp) == 0 ({heads} % {tp * cp}"
                f" = {heads % (tp * cp)}); choose context_parallel_size (and tensor_parallel_size) whose product"
                f" divides {heads}, or context_parallel_algo='ring' (any head count)"
            )
        if seq_len % cp:
            raise ValueError(
                f"seq_len={seq_len} does not split into context_parallel_size={cp} equal chunks (Ulysses gives each"
                f" rank one); use a sequence length that is a multiple of {cp}"
            )
    elif seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={seq_len} does not split into 2 x context_parallel_size = {2 * cp} equal chunks (ring attention"
            f" gives each rank one chunk from each end, so causal work is balanced); use a sequence length that is a"
            f" multiple of {2 * cp}"
        )


@dataclass(frozen=True)
class MeshLayout:
    """The sizes of npu_fsdp's mesh dimensions (``MESH_DIM_NAMES``) for one run, checked against the devices.

    Rank ``((r * dp_shard + s) * cp + c) * tp + t`` sits at ``(r, s, c, t)``: consecutive ranks form a
    tensor-parallel group, and ranks ``cp * tp`` apart are data-parallel replicas.
    """

    dp_replicate: int
    dp_shard: int
    cp: int = 1
    tp: int = 1

    @classmethod
    def for_run(cls, *, num_nodes: int, devices_per_node: int, sharding: str, tensor_parallel_size: int = 1,
                context_parallel_size: int = 1) -> MeshLayout:
        """The layout of ``num_nodes x devices_per_node`` devices; ValueError with the numbers and the fix."""
        tp, cp = tensor_parallel_size, context_parallel_size
        world = num_nodes * devices_per_node
        if devices_per_node % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the {devices_per_node} devices of each node: a"
                " tensor-parallel group exchanges activations in every layer and must stay inside one node; use a"
                f" divisor of {devices_per_node} ({', '.join(map(str, _divisors(devices_per_node)))})"
            )
        if world % (tp * cp):
            raise ValueError(
                f"tensor_parallel_size={tp} x context_parallel_size={cp} = {tp * cp} does not divide the world size"
                f" {world} ({num_nodes} nodes x {devices_per_node} devices): the data-parallel size would not be a"
                f" whole number; choose sizes whose product divides {world}"
            )
        dp_replicate = num_nodes if sharding == "hybrid" else 1
        if sharding == "hybrid" and devices_per_node % (tp * cp):
            raise ValueError(
                f"sharding='hybrid' shards within each node of {devices_per_node} devices, which"
                f" tensor_parallel_size={tp} x context_parallel_size={cp} = {tp * cp} does not divide; choose sizes"
                f" whose product divides {devices_per_node}, or use sharding='full'"
            )
        return cls(dp_replicate, world // (dp_replicate * cp * tp), cp, tp)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def model_parallel(self) -> bool:
        """Whether any rank shares its batch with another (tensor or context parallelism); else plain sharding."""
        return self.tp > 1 or self.cp > 1

    @property
    def data_parallel_size(self) -> int:
        """How many different batches each step trains on (the sampler's replicas)."""
        return self.dp_replicate * self.dp_shard

    @property
    def expert_parallel_ranks(self) -> int:
        """How many ranks an expert-parallel group may borrow its members from (``dp_shard x cp``): the ranks FSDP
        shards over, whose tokens differ (``expert_parallel_size`` must divide it)."""
        return self.dp_shard * self.cp

    def data_parallel_rank(self, global_rank: int) -> int:
        """Which of those batches ``global_rank`` trains on: the same for every rank of a TP or CP group."""
        return global_rank // (self.cp * self.tp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evenly_spaced(count: int, ratio: float) -> list[int]:
    """Indices of ``round(count * ratio)``-ish items spread evenly over ``count`` (ratio 0.5 of 4 -> [1, 3]):
    the blocks ``activation_checkpointing_ratio`` selects among those the policy matches."""
    return [i for i in range(count) if int((i + 1) * ratio) > int(i * ratio)]


@dataclass(frozen=True)
class FSDPChoices:
    """The ``npu_fsdp`` options that need no torch, with their defaults, validated at construction."""

    zero_stage: int = DEFAULT_ZERO_STAGE
    sharding: str = DEFAULT_SHARDING
    activation_checkpointing_ratio: float = DEFAULT_ACTIVATION_CHECKPOINTING_RATIO
    cpu_offload: bool = False
    memory_fraction: Optional[float] = None
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    #: Under context parallelism: how attention sees the whole sequence (``CONTEXT_PARALLEL_ALGOS``).
    context_parallel_algo: str = DEFAULT_CONTEXT_PARALLEL_ALGO
    #: Under tensor parallelism: norms and residuals sharded over the sequence (the plan decides how).
    sequence_parallel: bool = True
    #: Under tensor parallelism: the loss computed on vocabulary-sharded logits (torch's ``loss_parallel``).
    loss_parallel: bool = True
    #: Ranks (of the FSDP shard ranks, ``dp_shard x cp``) that split each MoE layer's experts between them.
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_zero_stage(self.zero_stage)
        check_sharding(self.sharding)
        check_activation_checkpointing_ratio(self.activation_checkpointing_ratio)
        check_memory_fraction(self.memory_fraction)
        check_parallel_size("tensor_parallel_size", self.tensor_parallel_size)
        check_parallel_size("context_parallel_size", self.context_parallel_size)
        check_context_parallel_algo(self.context_parallel_algo)
        check_parallel_size("expert_parallel_size", self.expert_parallel_size)

    def layout(self, num_nodes: int, devices_per_node: int) -> MeshLayout:
        """The mesh these options give ``num_nodes x devices_per_node`` devices (ValueError if they cannot)."""
        layout = MeshLayout.for_run(num_nodes=num_nodes, devices_per_node=devices_per_node, sharding=self.sharding,
                                    tensor_parallel_size=self.tensor_parallel_size,
                                    context_parallel_size=self.context_parallel_size)
        check_expert_parallel_size(self.expert_parallel_size, layout, self.sharding, with_context_parallel=True)
        return layout

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2's ``reshard_after_forward`` for ``zero_stage``."""
        return self.zero_stage == 3
