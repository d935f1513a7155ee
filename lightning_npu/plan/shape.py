"""What the planner's modules share below the spec: the model's shape, the run's parallelism beside FSDP (views of
npu_fsdp's ``FSDPOptions``), and ``PlanError``. The decoder profile (``decoder``) and the spec (``spec``) import it; it imports neither. No torch."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

from lightning_npu.facts import options, parallel_rules
from lightning_npu.facts import pipeline as schedules


class PlanError(ValueError):
    """A configuration the planner cannot model; the message names the value, why, and the fix."""


@dataclass(frozen=True)
class Parallelism:
    """How npu_fsdp splits each layer beside FSDP, read from its ``options`` (the planner declares none of its own):
    ``tensor`` ranks (tensor_parallel_size) split the block matrices, embedding and head; ``context`` ranks
    (context_parallel_size) split every sequence, attention seeing the whole by ``context_algo``
    (context_parallel_algo: ``"ulysses"`` | ``"ring"``); ``sequence_parallel`` splits the norms and residuals between
    blocks by sequence over the tensor-parallel ranks; ``loss_parallel`` keeps the logits split by vocabulary. The
    default options: plain sharding."""

    options: options.FSDPOptions = dataclasses.field(default_factory=options.FSDPOptions)

    @property
    def tensor(self) -> int:
        return self.options.tensor_parallel_size

    @property
    def context(self) -> int:
        return self.options.context_parallel_size

    @property
    def context_algo(self) -> str:
        return self.options.context_parallel_algo

    @property
    def sequence_parallel(self) -> bool:
        return self.options.sequence_parallel

    @property
    def loss_parallel(self) -> bool:
        return self.options.loss_parallel

    @property
    def splits(self) -> bool:
        """Whether tensor or context parallelism splits anything (else: plain sharding)."""
        return self.tensor > 1 or self.context > 1

    @property
    def between_blocks(self) -> int:
        """How many ranks split the residual stream's tensors (norms, residuals, checkpointed inputs) of a rank's
        tokens: the tensor-parallel ranks with sequence parallelism, else none (1: replicated over them)."""
        return self.tensor if self.sequence_parallel and self.tensor > 1 else 1

    @property
    def split_vocabulary(self) -> bool:
        """Whether the logits stay split by vocabulary over the tensor-parallel ranks (loss_parallel)."""
        return self.tensor > 1 and self.loss_parallel

    def report(self) -> dict[str, Any]:
        """The split as the plan's JSON gives it."""
        return {"tensor": self.tensor, "context": self.context, "context_algo": self.context_algo,
                "sequence_parallel": self.sequence_parallel, "loss_parallel": self.loss_parallel}

    def describe(self) -> str:
        parts = []
        if self.tensor > 1:
            extras = [name for name, on in (("sequence parallel", self.sequence_parallel),
                                           ("loss parallel", self.loss_parallel)) if on]
            parts.append(f"tensor parallel {self.tensor}" + (f" ({', '.join(extras)})" if extras else ""))
        if self.context > 1:
            parts.append(f"context parallel {self.context} ({self.context_algo})")
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class Pipelining:
    """npu_fsdp's pipeline, read from its ``options`` (``pipeline_parallel_size``, ``pipeline_schedule``,
    ``pipeline_microbatches``, ``pipeline_stages_per_rank``, ``pipeline_layers_per_stage``; the planner declares none
    of its own): ``size`` ranks each hold ``per_rank`` stages of contiguous blocks (the embedding on the first stage,
    the final norm and head on the last), and every step's micro-batch runs through them as ``parts`` microbatches
    in the schedule's order. The default options: no pipeline."""

    options: options.FSDPOptions = dataclasses.field(default_factory=options.FSDPOptions)

    @property
    def size(self) -> int:
        return self.options.pipeline_parallel_size

    @property
    def schedule(self) -> str:
        return self.options.pipeline_schedule

    @property
    def per_rank(self) -> int:
        return self.options.stages_per_rank

    @property
    def num_stages(self) -> int:
        return self.size * self.per_rank

    @property
    def parts(self) -> int:
        """The microbatches each step's batch splits into (one per stage unless given)."""
        return self.options.microbatches

    def stage_blocks(self, n_layers: int) -> list[list[int]]:
        """The blocks of each stage (``facts.parallel_rules.stage_blocks``: the recipes' split rule)."""
        return checked(parallel_rules.stage_blocks, self.options, n_layers)

    def bubble(self) -> float:
        """The share of a step the idlest rank waits, with torch's order replayed (``replayed_bubble``); 0 without
        a pipeline."""
        if self.size == 1:
            return 0.0
        return max(schedules.replayed_bubble(self.schedule, self.size, self.parts, self.per_rank))

    def report(self) -> dict[str, Any]:
        """The pipeline as the plan's JSON gives it."""
        given = self.options
        return {"size": self.size, "schedule": self.schedule, "microbatches": given.pipeline_microbatches,
                "stages_per_rank": given.pipeline_stages_per_rank,
                "layers_per_stage": (None if given.pipeline_layers_per_stage is None
                                     else list(given.pipeline_layers_per_stage))}

    def describe(self) -> str:
        if self.size == 1:
            return "none"
        formula = schedules.bubble_fraction(self.schedule, self.size, self.parts, self.per_rank)
        return (f"pipeline {self.size} ({self.schedule}, {self.num_stages} stages, {self.parts} microbatches;"
                f" bubble {100 * self.bubble():.1f}% of the step, the formula's {100 * formula:.1f}%)")


#: ``--model-shape`` keys -> ModelShape fields. ``kv_heads`` defaults to ``heads`` (multi-head attention).
SHAPE_KEYS = {
    "hidden": "dim",
    "layers": "n_layers",
    "heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "ffn": "ffn_hidden_dim",
    "vocab": "vocab_size",
    "max_seq_len": "max_seq_len",
}


@dataclass(frozen=True)
class ModelShape:
    """The decoder dimensions the estimate needs (any object with these attribute names provides them).

    ``head_dim`` is each attention head's width; left out it is ``dim // n_heads`` (LLaMA), given it may differ
    (Qwen3: 32 heads of 128 on a 2048-wide residual stream, so the queries are wider than the stream)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    max_seq_len: int
    head_dim: Optional[int] = None

    def __post_init__(self) -> None:
        free_head_dim = self.head_dim is not None
        if not free_head_dim and isinstance(self.dim, int) and isinstance(self.n_heads, int) and self.n_heads > 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        check_positive_ints(self, [f.name for f in dataclasses.fields(self)], "model ")
        if (self.dim % self.n_heads and not free_head_dim) or self.n_heads % self.n_kv_heads:
            raise PlanError(
                f"model dim={self.dim}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads} do not divide: heads"
                " must divide dim (unless head_dim is given) and kv_heads must divide heads"
            )

    @property
    def q_dim(self) -> int:
        """The width of the queries (and of the attention's output): heads x head_dim."""
        return self.n_heads * self.head_dim

    @classmethod
    def of(cls, config: Any) -> "ModelShape":
        return cls(**{f.name: int(getattr(config, f.name)) for f in dataclasses.fields(cls)})

    @classmethod
    def parse(cls, text: str) -> "ModelShape":
        """A shape from ``hidden=4096,layers=32,heads=32,kv_heads=32,ffn=11008,vocab=32000,max_seq_len=4096``."""
        values: dict[str, int] = {}
        for part in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if key not in SHAPE_KEYS:
                hint = " (the trained length is --seq-len)" if key == "seq_len" else ""
                raise PlanError(f"--model-shape key {key!r} is unknown{hint}; the keys are {', '.join(SHAPE_KEYS)}")
            if not sep or not re.fullmatch(r"\s*\d+\s*", value):
                raise PlanError(f"--model-shape {part!r}: give {key}=N with a positive integer N")
            values[SHAPE_KEYS[key]] = int(value)
        values.setdefault("n_kv_heads", values.get("n_heads", 0))
        missing = [key for key, field in SHAPE_KEYS.items() if field not in values]
        if missing:
            raise PlanError(f"--model-shape {text!r} lacks {', '.join(missing)}; give every one of {', '.join(SHAPE_KEYS)}"
                            " (kv_heads may be left out for multi-head attention)")
        return cls(**values)


def check_positive_ints(owner: Any, names: list[str], prefix: str = "") -> None:
    for name in names:
        value = getattr(owner, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{prefix}{name}={value!r} is invalid: it must be a positive integer")


def checked(check: Any, *args: Any, **kwargs: Any) -> Any:
    """``check(*args, **kwargs)`` (an npu_fsdp option check of lightning_npu.facts), its ValueError as a PlanError."""
    try:
        return check(*args, **kwargs)
    except ValueError as error:
        raise PlanError(str(error)) from None
