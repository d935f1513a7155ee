"""What a plan is asked about and what it answers: the run's settings (validated) and the estimate; the model's
shape and the parallelism beside FSDP are ``shape``'s.

Nothing here imports torch. Memory sizes are GiB in the spec and bytes in the estimate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from lightning_npu.facts import options, parallel_rules, precisions
from lightning_npu.facts import pipeline as schedules
from lightning_npu.facts.chips import (
    ATLAS_TRAINING_DEVICES_PER_SERVER,
    CHIP_MEMORY_GIB,
    DEFAULT_PLAN_CHIP,
    chip_series,
    device_memory_gib,
)
from lightning_npu.facts.precisions import PRECISION_DTYPES, PrecisionDtypes
from lightning_npu.plan.decoder import DecoderProfile
from lightning_npu.plan.posttrain import PostTraining
from lightning_npu.facts.parallel_rules import BatchShapes
from lightning_npu.plan.shape import ModelShape, Parallelism, Pipelining, PlanError, check_positive_ints, checked

GIB = 1024**3
MIB = 1024**2

#: HCCL's default per-communicator buffer (HCCL_BUFFSIZE, in MB, taken as MiB); each communicator holds two.
DEFAULT_HCCL_BUFFSIZE_MB = 200.0
#: torch_npu's P2P_HCCL_BUFFSIZE default (MB) since 7.1.0: each point-to-point communicator holds two.
DEFAULT_P2P_BUFFSIZE_MB = 20.0
#: What the NPU runtime, operator workspaces and the caching allocator's fragmentation take on top of tensors.
DEFAULT_WORKSPACE_GIB = 1.0
DEFAULT_FRAGMENTATION = 0.05
#: ``--kernels``: torch_npu fused kernels (the NPU default); the PyTorch reference paths of lightning_npu.kernels
#: (SDPA without an S x S matrix; what CPUs and fallbacks run); or attention that materialises S x S probabilities.
KERNELS = ("fused", "reference", "eager")
#: ``--optimizer``: AdamW's implementation. fused: one in-place kernel (``AdamW(fused=True)``; the recipe's choice on
#: NPUs, where torch_npu implements ``_fused_adamw_``); foreach: torch's default on accelerators without it (holds
#: sqrt(v) for every tensor while stepping); per-tensor: torch's loop on CPU tensors (a scratch of its largest two);
#: adamw8bit: ``lightning_npu.optim.AdamW8bit`` (8-bit moments at ``facts.optim8bit``'s bytes, a per-tensor loop).
OPTIMIZERS = ("fused", "foreach", "per-tensor", "adamw8bit")
#: The optimizer row's label with AdamW8bit (ITEMS has torch AdamW's).
OPTIMIZER_8BIT_LABEL = "optimizer states (AdamW8bit: 8-bit codes + fp32 scales)"


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element: sharded master parameters (and their gradients and AdamW states), the all-gathered
    working copy, activations, and the gradient reduce-scatter."""

    master: int
    param: int
    activation: int
    reduce: int


#: Bytes per element of the dtypes the precisions use (``lightning_npu.facts.precisions``).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _precision_bytes(dtypes: PrecisionDtypes) -> PrecisionBytes:
    compute = DTYPE_BYTES[dtypes.compute]
    return PrecisionBytes(DTYPE_BYTES[dtypes.master], compute, compute, DTYPE_BYTES[dtypes.reduce])


#: Every precision an NPU run accepts, with the bytes the planner counts for it.
PRECISIONS = {name: _precision_bytes(dtypes) for name, dtypes in PRECISION_DTYPES.items()}

#: What an estimate itemises, in the table's row order, with the labels; ``{m}``/``{p}`` become the master /
#: working dtype names.
ITEMS = {
    "parameters": "parameters ({m} shards)",
    "reference": "frozen reference (a copy's {m} shards)",
    "gradients": "gradients ({m} shards)",
    "optimizer": "optimizer states (AdamW 2 x {m} shards)",
    "gathered": "gathered parameters ({p} copy + all-gather buffers)",
    "unsharded_grads": "unsharded gradients + reduce-scatter buffers",
    "activations": "activations saved for backward",
    "logits": "logits + cross-entropy (fp32)",
    "temporaries": "temporaries (residual stream, op and optimizer scratch)",
    "inputs": "batch + rotary tables",
    "pipeline": "pipeline receive buffers (every microbatch)",
    "comm": "communication buffers (HCCL)",
    "allowance": "workspace + fragmentation allowance",
}


@dataclass(frozen=True)
class PlanSpec:
    """Everything the estimate depends on. Memory sizes in GiB; ``devices`` is per node, as in Lightning.

    ``profile`` is how the model spends memory (its parameter layout, saved activations); left out, the model is
    planned as the generic decoder of ``lightning_npu.plan.decoder`` with the shape ``model``.
    """

    model: ModelShape
    seq_len: int
    micro_batch: int
    devices: int = 1
    nodes: int = 1
    precision: str = "bf16-mixed"
    accumulate_grad_batches: int = 1
    wrap_blocks: bool = True
    ac_ratio: float = 0.0
    kernels: str = "fused"
    #: How AdamW steps (OPTIMIZERS): what it holds while stepping depends on it.
    optimizer: str = "fused"
    hccl_buffsize_mb: float = DEFAULT_HCCL_BUFFSIZE_MB
    workspace_gib: float = DEFAULT_WORKSPACE_GIB
    fragmentation: float = DEFAULT_FRAGMENTATION
    device_memory_gib: float = CHIP_MEMORY_GIB[DEFAULT_PLAN_CHIP]
    chip: str = DEFAULT_PLAN_CHIP
    profile: Optional[DecoderProfile] = None
    #: npu_fsdp's options, the planner's only declaration of them: it reads its ZeRO stage (the one the plan judges),
    #: sharding, CPU offload, tensor, context and pipeline parallelism from them (``parallel``, ``pipeline``); the
    #: defaults are plain sharding. (The blocks FSDP wraps and the share that recomputes are ``wrap_blocks`` and
    #: ``ac_ratio``: what the planner models of the policies.)
    options: options.FSDPOptions = dataclasses.field(default_factory=options.FSDPOptions)
    #: P2P_HCCL_BUFFSIZE (MB, taken as MiB): the buffer each pipeline neighbour's point-to-point communicator holds
    #: twice.
    p2p_buffsize_mb: float = DEFAULT_P2P_BUFFSIZE_MB
    notes: tuple[str, ...] = ()
    #: A post-training objective's extra memory (``lightning_npu.plan.posttrain``): its reference, GRPO's rollouts.
    post_training: Optional[PostTraining] = None

    def __post_init__(self) -> None:
        if self.profile is None:
            object.__setattr__(self, "profile", DecoderProfile(self.model))
        elif self.profile.shape != self.model:
            raise PlanError(f"profile {self.profile.name!r} has the shape {self.profile.shape}, not {self.model}")
        check_positive_ints(self, ["seq_len", "micro_batch", "devices", "nodes", "accumulate_grad_batches"])
        object.__setattr__(self, "precision", canonical_precision(self.precision))
        checked(options.check_activation_checkpointing_ratio, self.ac_ratio)
        if self.kernels not in KERNELS:
            raise PlanError(f"kernels={self.kernels!r} is not one of {', '.join(KERNELS)}")
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"optimizer={self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.device_memory_gib <= 0:
            raise PlanError(f"device memory {self.device_memory_gib!r} GiB must be positive")
        self._check_parallelism()
        experts = self.profile.expert_parallel_size
        if self.expert_ranks % experts:
            raise PlanError(
                f"expert_parallel_size={experts} does not divide the {self.expert_ranks} devices parameters are sharded"
                f" over ({self.nodes} nodes x {self.devices} devices{', hybrid' if self.sharding == 'hybrid' else ''});"
                " choose a divisor"
            )
        if self.seq_len > self.model.max_seq_len:
            raise PlanError(
                f"seq_len={self.seq_len} exceeds the model's max_seq_len={self.model.max_seq_len}; lower data.seq_len"
                f" (or --seq-len) or set model.config.max_seq_len >= {self.seq_len}"
            )
        if chip_series(self.chip) == "training" and self.devices not in ATLAS_TRAINING_DEVICES_PER_SERVER:
            raise PlanError(
                f"devices={self.devices} per node cannot run HCCL collectives on {self.chip}: the Atlas training series"
                f" (first-generation 910) takes {', '.join(map(str, ATLAS_TRAINING_DEVICES_PER_SERVER))} devices per"
                " server (two or four from the same half, 0-3 or 4-7); use 1, 2, 4 or 8 devices per node"
            )

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage the plan judges (npu_fsdp's ``zero_stage``; the table shows both)."""
        return self.options.zero_stage

    @property
    def sharding(self) -> str:
        return self.options.sharding

    @property
    def cpu_offload(self) -> bool:
        return self.options.cpu_offload

    @property
    def parallel(self) -> Parallelism:
        """Tensor and context parallelism (npu_fsdp's mesh beside FSDP)."""
        return Parallelism(self.options)

    @property
    def pipeline(self) -> Pipelining:
        """Pipeline parallelism: each rank holds its stages' blocks; the estimate is the fullest rank's."""
        return Pipelining(self.options)

    def _check_parallelism(self) -> None:
        """The mesh npu_fsdp would build (the strategy's own checks: tp inside a node, tp x cp dividing the world),
        the model's shapes and the micro-batch against it (``facts.parallel_rules``, which the recipe's pre-launch
        checks and the runtime read too), and the profile split accordingly."""
        parallel, pipeline = self.parallel, self.pipeline
        shapes = self.profile.parallel_shapes()
        batch = BatchShapes(seq_len=self.seq_len, batch_size=self.micro_batch)
        if pipeline.size > 1:
            checked(schedules.actions, pipeline.schedule, 0, pipeline.size, pipeline.parts, pipeline.per_rank)  # modelled
            checked(parallel_rules.check_pipeline, self.options, shapes, batch)
        if not parallel.splits and not self.profile.parallel.splits and pipeline.size == 1:
            return
        layout = checked(options.MeshLayout.for_run, num_nodes=self.nodes, devices_per_node=self.devices,
                          sharding=self.sharding, tensor_parallel_size=parallel.tensor,
                          context_parallel_size=parallel.context, pipeline_parallel_size=pipeline.size)
        if self.profile.expert_parallel_size > 1:
            checked(options.check_expert_parallel_size, self.profile.expert_parallel_size, layout, self.sharding)
        checked(parallel_rules.check_context_parallel, self.options, shapes, batch)
        checked(parallel_rules.check_tensor_parallel, self.options, shapes, batch)
        object.__setattr__(self, "profile", self.profile.with_parallelism(parallel))

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes

    @property
    def shard_group(self) -> int:
        """Devices each parameter is sharded over: all of them, or one node's under hybrid sharding, less the
        tensor-parallel ranks, which hold different parts (FSDP shards over ``dp_shard x cp``), and the other
        pipeline ranks, which hold other stages (hybrid sharding's node groups already hold every stage once)."""
        if self.sharding == "hybrid":
            return self.devices // self.parallel.tensor
        return self.world_size // (self.parallel.tensor * self.pipeline.size)

    @property
    def expert_ranks(self) -> int:
        """Devices an expert-parallel group borrows its ranks from: those the experts are sharded over before the
        split (``dp_shard x cp``, and the tensor-parallel ranks, which hold the same routed experts: ``dp_shard x cp
        x tp``)."""
        return self.shard_group * self.parallel.tensor

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence a rank holds: the sequence over the context-parallel ranks."""
        return self.seq_len // self.parallel.context

    @property
    def checkpointed_layers(self) -> list[int]:
        """Which blocks recompute their activations: the strategy's evenly spaced choice for the ratio, among the
        blocks in module order (the trunk's, then the multi-token-prediction depths')."""
        return options.evenly_spaced(self.profile.n_blocks, self.ac_ratio)

    @property
    def bytes(self) -> PrecisionBytes:
        return PRECISIONS[self.precision]


def check_zero_stage(stage: Any) -> None:
    checked(options.check_zero_stage, stage)


def canonical_precision(value: Any) -> str:
    """``value`` as one of PRECISIONS (``bf16`` -> ``bf16-mixed``, ...)."""
    return checked(precisions.canonical_precision, value)


def chip_memory_gib(chip: str) -> float:
    """Device memory of the chip named ``chip`` exactly, in GiB."""
    memory = device_memory_gib(chip)
    if memory is None:
        raise PlanError(
            f"chip {chip!r} has no known device memory; use one of {', '.join(CHIP_MEMORY_GIB)} or pass"
            " --device-memory GiB"
        )
    return memory


@dataclass
class Estimate:
    """Per-device peak of one training step (steady state, after the first optimizer step). Bytes throughout."""

    zero_stage: int
    micro_batch: int
    items: dict[str, float]
    peak_phase: str
    host_bytes: float
    device_bytes: float
    #: Under pipeline parallelism, each pipeline rank's total (the estimate is the fullest rank's).
    pipeline_ranks: tuple[float, ...] = ()
    #: GRPO's rollout phase, apart from the step's peak (``posttrain.rollout_bytes`` on the state it runs beside).
    rollout_items: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.items.values())

    @property
    def rollout_total(self) -> float:
        return sum(self.rollout_items.values())

    @property
    def headroom(self) -> float:
        return self.device_bytes - max(self.total, self.rollout_total)

    @property
    def fits(self) -> bool:
        return max(self.total, self.rollout_total) <= self.device_bytes
