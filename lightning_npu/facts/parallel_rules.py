"""What a parallel layout refuses of a model and its batches, each rule written once with one message (the value,
why, the fix), for three readers that must not disagree:

- the recipe, before any worker starts (``recipes/train.py`` ``check_run``), with the model's config and the data;
- the runtime, on every rank before the split (``DecoderLM.configure_model`` for the recipes' models; the
  pipeline's block split in ``lightning_npu.parallel.pipeline.check_split``), with what it holds by then;
- the planner (``lightning_npu.plan``), which has no model, only a memory profile's shapes.

So a rule takes the run's ``FSDPOptions`` and torch-free shapes: ``ModelShapes`` (what the rules read of a model:
its layers, heads, the sizes tensor parallelism splits, what no plan splits, and the features a layout refuses) and
``BatchShapes`` (the sequence length, the rows per device, what packs samples into rows). A reader fills in what it
knows; a rule whose shape is unknown (``None``) is not checked by that reader. ``check`` runs every rule;
``check_tensor_parallel``, ``check_context_parallel`` and ``check_pipeline`` one parallel dimension each, and
``*_problems`` list what a dimension refuses without raising. The mesh's own arithmetic (sizes against the
devices, expert-parallel groups) is ``options.MeshLayout``'s and ``options.check_expert_parallel_size``'s; the
schedules' (microbatches, stages per rank, blocks per stage) is ``facts.pipeline``'s, which the rules here call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from lightning_npu.facts import pipeline
from lightning_npu.facts.options import FSDPOptions, check_context_parallel_algo

#: The tensor-parallel sizes a model's divisibility problems suggest instead (a node's devices split evenly).
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, kw_only=True)
class ModelShapes:
    """The sizes and features of a model that the parallel rules read; ``None``: unknown to this reader.

    ``name`` is how messages call the model ("this model", a profile's name). ``tensor_parallel_sizes``: the
    ``(config name, value)`` sizes the tensor-parallel plan splits (heads, kv heads, vocabulary, the dense MLPs'
    widths), each of which tp must divide; ``unsplit_parts``: parts no tensor-parallel plan splits, each a problem
    with its fix. ``tie_embeddings``, ``mtp_layers`` (multi-token-prediction depths), ``router_aux_loss_coef`` (the
    MoE load-balancing loss) and ``lora`` (adapters) are the features a layout may refuse.
    ``context_parallel_refusals`` / ``pipeline_refusals``: what else of the model or its objective (a post-training
    loss) those layouts cannot run, each the reason with its fix."""

    name: str = "this model"
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    tensor_parallel_sizes: Optional[tuple[tuple[str, int], ...]] = None
    unsplit_parts: tuple[str, ...] = ()
    tie_embeddings: bool = False
    mtp_layers: int = 0
    router_aux_loss_coef: float = 0.0
    lora: bool = False
    context_parallel_refusals: tuple[str, ...] = ()
    pipeline_refusals: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class BatchShapes:
    """What the rules read of the batches: ``seq_len`` tokens per row, ``batch_size`` rows per device per step
    (``data.batch_size``), ``packed_by``: what packs several samples into each row (their boundaries span the
    batch), for the message; ``None``: unknown to this reader (or no packing)."""

    seq_len: Optional[int] = None
    batch_size: Optional[int] = None
    packed_by: Optional[str] = None


def check(options: FSDPOptions, model: ModelShapes, batch: BatchShapes = BatchShapes()) -> None:
    """ValueError with the value, the reason and the fix for the first parallel dimension of ``options`` (tensor,
    context, pipeline) that cannot run ``model`` on ``batch``."""
    check_tensor_parallel(options, model, batch)
    check_context_parallel(options, model, batch)
    check_pipeline(options, model, batch)


# ------------------------------------------------------------------------------------------------- tensor parallel


def indivisible_by_tensor_parallel(tp: int, sizes: Iterable[tuple[str, int]]) -> list[str]:
    """The ``(name, value)`` sizes that ``tp`` tensor-parallel ranks cannot split evenly, each as a problem with its
    numbers (empty when all divide)."""
    return [f"{name}={value} is not divisible by tensor_parallel_size={tp}: each rank holds 1/{tp} of them"
            for name, value in sizes if value % tp]


def tensor_parallel_problems(tp: int, model: ModelShapes, batch: BatchShapes = BatchShapes(), *,
                             sequence_parallel: bool = True) -> list[str]:
    """What keeps ``tp`` tensor-parallel ranks from splitting ``model`` (empty when they can): its sizes that tp
    does not divide (and the sequence, which ``sequence_parallel`` splits between blocks), the parts no plan
    splits, multi-token prediction and adapters."""
    if tp == 1:
        return []
    sizes = list(model.tensor_parallel_sizes or ())
    if sequence_parallel and batch.seq_len is not None:
        sizes.append(("data.seq_len", batch.seq_len))
    problems = indivisible_by_tensor_parallel(tp, sizes) + list(model.unsplit_parts)
    if model.mtp_layers:
        problems.append(
            f"mtp_layers={model.mtp_layers}: the multi-token-prediction modules have no tensor-parallel plan; train"
            " them without tensor_parallel_size (data or expert parallelism), or set mtp_layers=0"
        )
    if model.lora:
        problems.append(
            "LoRA adapters have no tensor-parallel plan (a LoRA run trains few parameters: plain npu_fsdp sharding"
            " fits the frozen base)"
        )
    return problems


def check_tensor_parallel(options: FSDPOptions, model: ModelShapes, batch: BatchShapes = BatchShapes()) -> None:
    """ValueError listing every problem of :func:`tensor_parallel_problems` for ``options``' tensor_parallel_size,
    with the sizes that would work."""
    tp, sp = options.tensor_parallel_size, options.sequence_parallel
    problems = tensor_parallel_problems(tp, model, batch, sequence_parallel=sp)
    if problems:
        fitting = [size for size in TENSOR_PARALLEL_SIZES
                   if size < tp and not tensor_parallel_problems(size, model, batch, sequence_parallel=sp)]
        raise ValueError(
            f"tensor_parallel_size={tp} cannot split {model.name}: " + "; ".join(problems)
            + f". Use a tensor_parallel_size that divides them ({', '.join(map(str, fitting))})"
            + (", or change the model config" if fitting else "; change the model config")
        )


# ------------------------------------------------------------------------------------------------ context parallel


def check_context_parallel(options: FSDPOptions, model: ModelShapes, batch: BatchShapes = BatchShapes()) -> None:
    """ValueError unless ``options``' context-parallel ranks can split ``model``'s sequences of ``batch``: no
    multi-token prediction (it reads tokens another rank holds), and the heads and the sequence length that
    ``context_parallel_algo`` needs (:func:`check_context_parallel_shapes`, each that this reader knows)."""
    cp = options.context_parallel_size
    if cp == 1:
        return
    if model.mtp_layers:
        raise ValueError(
            f"context_parallel_size={cp}: model.config.mtp_layers={model.mtp_layers}: multi-token prediction reads the"
            f" tokens up to {model.mtp_layers} ahead of each, which at the end of a rank's part of a sequence another"
            " context-parallel rank holds; train it with context_parallel_size=1, or set mtp_layers=0"
        )
    if model.context_parallel_refusals:
        raise ValueError(f"context_parallel_size={cp}: " + "; ".join(model.context_parallel_refusals))
    check_context_parallel_shapes(cp, options.context_parallel_algo, heads=model.n_heads, seq_len=batch.seq_len,
                                  tp=options.tensor_parallel_size)


def check_context_parallel_shapes(cp: int, algo: str, *, heads: Optional[int], seq_len: Optional[int],
                                  tp: int = 1) -> None:
    """ValueError, with the numbers and the fix, unless ``cp`` context-parallel ranks can split a model of ``heads``
    query heads (before ``tp``-way tensor parallelism) and ``seq_len``-token sequences by ``algo`` (the kernels check
    the same at run time; ``None``: unknown, not checked). Any key/value head count works: Ulysses repeats key/value
    heads where cp does not divide them."""
    if cp == 1:
        return
    check_context_parallel_algo(algo)
    if algo == "ulysses":
        if heads is not None and heads % (tp * cp):
            raise ValueError(
                f"context_parallel_algo='ulysses' splits each rank's {heads} / tensor_parallel_size={tp} attention"
                f" heads over context_parallel_size={cp} ranks, which needs heads % (tp x cp) == 0 ({heads} % {tp * cp}"
                f" = {heads % (tp * cp)}); choose context_parallel_size (and tensor_parallel_size) whose product"
                f" divides {heads}, or context_parallel_algo='ring' (any head count)"
            )
        if seq_len is not None and seq_len % cp:
            raise ValueError(
                f"seq_len={seq_len} does not split into context_parallel_size={cp} equal chunks (Ulysses gives each"
                f" rank one); use a sequence length that is a multiple of {cp}"
            )
    elif seq_len is not None and seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={seq_len} does not split into 2 x context_parallel_size = {2 * cp} equal chunks (ring attention"
            f" gives each rank one chunk from each end, so causal work is balanced); use a sequence length that is a"
            f" multiple of {2 * cp}"
        )


# ------------------------------------------------------------------------------------------------------- pipeline


def pipeline_problems(options: FSDPOptions, model: ModelShapes, batch: BatchShapes = BatchShapes()) -> list[str]:
    """What of ``model`` and ``batch`` the pipeline of ``options`` cannot split, each with the fix (empty when it
    can, or without a pipeline)."""
    if options.pipeline_parallel_size == 1:
        return []
    problems = [problem for given, problem in (
        (model.tie_embeddings, "model.config.tie_embeddings=true: the embedding (first stage) and the head (last"
         " stage) would be one matrix on two ranks; train it untied"),
        (model.mtp_layers, f"model.config.mtp_layers={model.mtp_layers}: multi-token prediction runs the embedding"
         " again after the last block, on the last stage; set mtp_layers=0"),
        (model.router_aux_loss_coef, f"model.config.router_aux_loss_coef={model.router_aux_loss_coef}: the"
         " load-balancing loss sums the routing of MoE layers that lie on different stages; set it to 0"
         " (router_bias_update_rate balances without a loss)"),
        (batch.packed_by, f"{batch.packed_by} packs samples into rows, and their boundaries (cu_seqlens) span the"
         " batch, which the pipeline splits into microbatches; pretrain on TextDataModule"),
        (batch.batch_size is not None and batch.batch_size % options.microbatches,
         f"data.batch_size={batch.batch_size} does not split into pipeline_microbatches={options.microbatches}"
         f" equal microbatches; make it a multiple of {options.microbatches}"),
    ) if given] + list(model.pipeline_refusals)
    if model.n_layers is not None:
        try:
            stage_blocks(options, model.n_layers)
        except ValueError as error:
            problems.append(str(error))
    return problems


def check_pipeline(options: FSDPOptions, model: ModelShapes, batch: BatchShapes = BatchShapes()) -> None:
    """ValueError listing every problem of :func:`pipeline_problems`."""
    problems = pipeline_problems(options, model, batch)
    if problems:
        raise ValueError(f"pipeline_parallel_size={options.pipeline_parallel_size} cannot run {model.name}: "
                         + "; ".join(problems))


def stage_blocks(options: FSDPOptions, n_layers: int) -> list[list[int]]:
    """The blocks of each of ``options``' pipeline stages for a model of ``n_layers`` blocks
    (``facts.pipeline.blocks_per_stage``); ValueError with the fix where they do not spread."""
    return pipeline.blocks_per_stage(n_layers, options.pipeline_parallel_size * options.stages_per_rank,
                                     schedule=options.pipeline_schedule,
                                     layers_per_stage=options.pipeline_layers_per_stage)
