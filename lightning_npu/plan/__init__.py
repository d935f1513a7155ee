"""The memory planner behind ``lightning-npu plan``: will a model fit in NPU memory under npu_fsdp (FSDP2), with its
tensor and context parallelism if asked?

Torch-free. Modules: ``spec`` (the model's shape, the run's settings with their validation, ``Parallelism``, the
estimate),
``decoder`` (how a pre-norm decoder on lightning_npu.kernels spends memory, and what trains: ``DecoderProfile``,
``LowRankAdapters``), ``profile``
(the protocol by which a model's package supplies its profile, and finding it from a config), ``replay`` (one
FSDP2 training step replayed as allocations and frees: ``estimate``, ``max_micro_batch``), ``config`` (a
PlanSpec from a recipe YAML and/or shapes: ``load_spec``), ``posttrain`` (what DPO and GRPO add: the reference, the
rollout phase), ``render`` (``report`` as data, ``render`` as a table).
"""

from lightning_npu.plan.config import load_spec
from lightning_npu.plan.decoder import (
    BlockActivations,
    BlockParameters,
    DecoderProfile,
    LowRankAdapters,
    RankLocalShape,
    RootParameters,
    TrainableParameters,
)
from lightning_npu.plan.profile import PROFILE_FUNCTION, PROFILE_MODULE, find_profile
from lightning_npu.plan.render import render, report
from lightning_npu.plan.estimate import estimate, max_micro_batch
from lightning_npu.plan.replay import state_bytes
from lightning_npu.plan.shape import ModelShape, Parallelism, Pipelining, PlanError
from lightning_npu.plan.spec import GIB, MIB, Estimate, PlanSpec

__all__ = [
    "BlockActivations",
    "BlockParameters",
    "DecoderProfile",
    "Estimate",
    "GIB",
    "LowRankAdapters",
    "MIB",
    "ModelShape",
    "PROFILE_FUNCTION",
    "PROFILE_MODULE",
    "Parallelism",
    "PlanError",
    "PlanSpec",
    "Pipelining",
    "RankLocalShape",
    "RootParameters",
    "TrainableParameters",
    "estimate",
    "find_profile",
    "load_spec",
    "max_micro_batch",
    "render",
    "report",
    "state_bytes",
]
