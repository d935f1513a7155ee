"""A plan as plain data (``report``, what ``--json`` prints) and as a table for people (``render``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

from lightning_npu.facts import pipeline as schedules
from lightning_npu.facts.precisions import PRECISION_DTYPES
from lightning_npu.plan.estimate import estimate, max_micro_batch
from lightning_npu.plan.shape import PlanError
from lightning_npu.plan.spec import GIB, ITEMS, OPTIMIZER_8BIT_LABEL, PlanSpec, chip_memory_gib

KIB = 1024
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
STAGES = ("2", "3")
COLUMN_WIDTH = 12
#: The rows that hold nothing for frozen parameters (gradients, their reduce-scatters, AdamW's moments).
FROZEN_FREE_ITEMS = ("gradients", "optimizer", "unsharded_grads")


def report(spec: PlanSpec) -> dict[str, Any]:
    """The plan as plain data: ZeRO-2 and ZeRO-3 estimates (GiB), verdicts and largest micro-batches."""
    stages = {}
    for stage in STAGES:
        result = estimate(spec, int(stage))
        stages[stage] = {
            "items_gib": {key: value / GIB for key, value in result.items.items()},
            "total_gib": result.total / GIB,
            "headroom_gib": result.headroom / GIB,
            "fits": result.fits,
            "peak_phase": result.peak_phase,
            "max_micro_batch": max_micro_batch(spec, int(stage)),
            "host_gib": result.host_bytes / GIB,
            "pipeline_ranks_gib": [total / GIB for total in result.pipeline_ranks],
            "rollout_gib": {key: value / GIB for key, value in result.rollout_items.items()},
            "rollout_total_gib": result.rollout_total / GIB,
        }
    per_layer = spec.profile.block_activations(spec.kernels, spec.bytes.activation, spec.seq_len)
    return {
        "model": {"name": spec.profile.name, "params": spec.profile.num_params(),
                  "trainable_params": spec.profile.num_trainable_params(), "mtp_depths": spec.profile.mtp_depths,
                  "adapters": None if spec.profile.adapters is None else dataclasses.asdict(spec.profile.adapters),
                  **dataclasses.asdict(spec.model)},
        "seq_len": spec.seq_len,
        "micro_batch": spec.micro_batch,
        "devices": spec.devices,
        "nodes": spec.nodes,
        "shard_group": spec.shard_group,
        "parallel": spec.parallel.report(),
        "expert_parallel_size": spec.profile.expert_parallel_size,
        "pipeline": {**spec.pipeline.report(), "stages": spec.pipeline.num_stages,
                     "microbatches": spec.pipeline.parts, "bubble_fraction": spec.pipeline.bubble(),
                     "bubble_formula": schedules.bubble_fraction(spec.pipeline.schedule, spec.pipeline.size,
                                                                 spec.pipeline.parts, spec.pipeline.per_rank),
                     "blocks_per_stage": ([len(blocks) for blocks in spec.pipeline.stage_blocks(spec.model.n_layers)]
                                          if spec.pipeline.size > 1 else [])},
        "precision": spec.precision,
        "configured_zero_stage": spec.zero_stage,
        "checkpointed_layers": len(spec.checkpointed_layers),
        "kernels": spec.kernels,
        "device_memory_gib": spec.device_memory_gib,
        "activation_bytes_per_token_per_layer": sum(per_layer.values()),
        "stages": stages,
        "notes": list(spec.notes),
    }


def render(spec: PlanSpec, plan: Mapping[str, Any]) -> str:
    """The plan as a table for people."""
    dtypes = PRECISION_DTYPES[spec.precision]
    names = {"m": DTYPE_NAMES[dtypes.master], "p": DTYPE_NAMES[dtypes.compute]}
    model = spec.model
    layout = f"{spec.nodes} node x {spec.devices}" if spec.nodes == 1 else f"{spec.nodes} nodes x {spec.devices}"
    per_token = plan["activation_bytes_per_token_per_layer"]
    parallel = "" if spec.parallel.describe() == "none" else f", {spec.parallel.describe()}"
    if spec.profile.expert_parallel_size > 1:
        parallel += f", expert parallel {spec.profile.expert_parallel_size}"
    own = "" if spec.parallel.context == 1 else f"; each device holds {spec.local_seq_len} tokens of each sequence"
    params, trainable = spec.profile.num_params(), spec.profile.num_trainable_params()
    depths = spec.profile.mtp_depths
    mtp = f" + {depths} multi-token-prediction depth{'s' if depths > 1 else ''}" if depths else ""
    lines = [
        f"{spec.profile.name}: {_count(params)} parameters, {model.n_layers} layers{mtp}, dim {model.dim},"
        f" vocab {model.vocab_size}",
        f"{spec.world_size} devices ({layout}), shard group {spec.shard_group} ({spec.sharding}){parallel},"
        f" {spec.precision},"
        f" seq {spec.seq_len} x micro-batch {spec.micro_batch}, accumulate {spec.accumulate_grad_batches},"
        f" activation checkpointing {len(spec.checkpointed_layers)}/{spec.profile.n_blocks} blocks, {spec.kernels}"
        " kernels",
        f"activations{' per device' if parallel else ''}: {per_token / KIB:.1f} KiB per token per layer"
        f" ({per_token * spec.local_seq_len * spec.micro_batch / GIB:.2f} GiB per layer at this micro-batch{own}),"
        f" {spec.bytes.activation * model.dim / spec.parallel.between_blocks / KIB:.1f} KiB per token per"
        " checkpointed layer",
    ]
    if trainable < params:
        what = spec.profile.adapters.describe() if spec.profile.adapters is not None else "the rest frozen"
        lines.append(f"{'LoRA run' if spec.profile.adapters is not None else 'partly frozen'}: trainable parameters"
                     f" {trainable:,} of {params:,} ({100 * trainable / params:.2f}%), {what}; gradients and"
                     " optimizer states only for those")
    if spec.pipeline.size > 1:
        pipe = plan["pipeline"]
        parts = pipe["microbatches"]
        lines.append(f"{spec.pipeline.describe()}: blocks per stage {pipe['blocks_per_stage']}, micro-batch"
                     f" {spec.micro_batch} in {parts} parts of {spec.micro_batch // parts}; the table is the fullest"
                     " pipeline rank's")
    lines.append("")
    labels = {key: label.format(**names) for key, label in ITEMS.items()}
    if spec.pipeline.size == 1:
        del labels["pipeline"]
    if spec.post_training is None or spec.post_training.reference != "copy":
        del labels["reference"]
    if spec.optimizer == "adamw8bit":
        labels["optimizer"] = OPTIMIZER_8BIT_LABEL
    scheme = spec.profile.adapters.base_quantization if spec.profile.adapters is not None else None
    if scheme is not None:  # a LoRA base stored quantized: its codes are sharded and gathered as they are
        labels["parameters"] = f"parameters ({names['m']} shards; base {scheme} codes + {names['m']} scales)"
        labels["gathered"] = f"gathered parameters ({names['p']} copy, base {scheme} codes + {names['p']} scales)"
    if trainable < params:  # no gradients or AdamW moments for frozen weights: say so in their rows
        for key in FROZEN_FREE_ITEMS:
            labels[key] += ", trainable only"
    label_width = max(len(label) for label in labels.values()) + 2
    header = f"{'per-device peak (GiB)':<{label_width}}" + "".join(
        f"{'ZeRO-' + s + ('*' if int(s) == spec.zero_stage else ''):>{COLUMN_WIDTH}}" for s in STAGES)
    lines += [header, "-" * len(header)]
    stages = plan["stages"]
    for key, label in labels.items():
        lines.append(f"{label:<{label_width}}" + "".join(
            f"{stages[s]['items_gib'][key]:>{COLUMN_WIDTH}.2f}" for s in STAGES))
    lines.append("-" * len(header))
    rows: list[tuple[str, Callable[[Mapping[str, Any]], str]]] = [
        ("total", lambda r: f"{r['total_gib']:.2f}"),
        *([("GRPO rollout phase (its own peak, see below)", lambda r: f"{r['rollout_total_gib']:.2f}")]
          if stages[str(spec.zero_stage)]["rollout_gib"] else []),
        (f"device memory ({spec.chip if spec.device_memory_gib == _default_memory(spec) else 'given'})",
         lambda r: f"{spec.device_memory_gib:.2f}"),
        ("headroom", lambda r: f"{r['headroom_gib']:+.2f}"),
        ("verdict", lambda r: "fits" if r["fits"] else "NO FIT"),
        ("largest micro-batch that fits", lambda r: str(r["max_micro_batch"])),
    ]

    for label, cell in rows:
        lines.append(f"{label:<{label_width}}" + "".join(f"{cell(stages[s]):>{COLUMN_WIDTH}}" for s in STAGES))
    lines.append("")
    lines.append(f"* configured zero_stage. The peak falls in: ZeRO-2 {stages['2']['peak_phase']};"
                 f" ZeRO-3 {stages['3']['peak_phase']}.")
    if spec.pipeline.size > 1:
        totals = ", ".join(f"{total:.2f}" for total in stages[str(spec.zero_stage)]["pipeline_ranks_gib"])
        lines.append(f"Each pipeline rank's total (GiB), rank 0 first: {totals}. Both columns are the same under a"
                     " pipeline: npu_fsdp keeps each stage's units gathered for the whole step (one all-gather per"
                     " step, not one per microbatch).")
    rollout = stages[str(spec.zero_stage)]["rollout_gib"]
    if rollout:
        lines.append(f"GRPO's rollout phase, apart from the training step: the policy gathered whole"
                     f" {rollout['rollout_gathered']:.2f}, the KV cache of one prompt's completions"
                     f" {rollout['rollout_kv_cache']:.2f}, the prefill's logits {rollout['rollout_logits']:.2f} GiB, on"
                     " the shards, gradients, optimizer states and reference; the verdict takes the larger peak.")
    if spec.cpu_offload:
        lines.append(f"cpu_offload: parameters, gradients and optimizer states ({stages['3']['host_gib']:.2f} GiB per"
                     " device) live in host memory.")
    configured = stages[str(spec.zero_stage)]
    if not configured["fits"]:
        lines.append(_advice(spec, plan))
    lines += [f"note: {note}" for note in spec.notes]
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _default_memory(spec: PlanSpec) -> Optional[float]:
    try:
        return chip_memory_gib(spec.chip)
    except PlanError:
        return None


def _advice(spec: PlanSpec, plan: Mapping[str, Any]) -> str:
    configured = plan["stages"][str(spec.zero_stage)]
    tips = []
    if configured["max_micro_batch"] > 0:
        tips.append(f"lower data.batch_size to {configured['max_micro_batch']} (raise accumulate_grad_batches to keep"
                    " the global batch)")
    if spec.zero_stage == 2 and plan["stages"]["3"]["fits"]:
        tips.append("use zero_stage: 3")
    if len(spec.checkpointed_layers) < spec.profile.n_blocks:
        block = (spec.profile.block_class or "<block class>").rpartition(".")[2]
        tips.append(f"raise activation_checkpointing_ratio (with activation_checkpointing_policy: [{block}])")
    tips.append("add devices or nodes (parameters and optimizer states shard over them)")
    return f"does not fit with zero_stage={spec.zero_stage}: " + "; or ".join(tips) + "."
