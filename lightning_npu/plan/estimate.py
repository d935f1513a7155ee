"""The estimate of a PlanSpec: its step replayed (``replay``), each pipeline rank's under pipeline parallelism
(``stages``, the fullest rank's peak standing for the run), and the largest micro-batch that fits."""

from __future__ import annotations

from typing import Optional

from lightning_npu.plan.posttrain import rollout_bytes
from lightning_npu.plan.replay import MAX_MICRO_BATCH, _StepReplay, state_bytes
from lightning_npu.plan.spec import GIB, Estimate, PlanSpec, check_zero_stage
from lightning_npu.plan.stages import estimate_ranks


def estimate(spec: PlanSpec, zero_stage: Optional[int] = None, micro_batch: Optional[int] = None) -> Estimate:
    """Replay one steady-state training step of ``spec`` (at ``zero_stage`` / ``micro_batch`` if given) and
    return the per-device peak, itemised. Under pipeline parallelism it is the fullest pipeline rank's (each
    rank's total in ``Estimate.pipeline_ranks``); the ZeRO stage does not change it (npu_fsdp keeps every unit
    of a stage gathered for the step)."""
    stage = spec.zero_stage if zero_stage is None else zero_stage
    check_zero_stage(stage)
    batch = spec.micro_batch if micro_batch is None else micro_batch
    if spec.pipeline.size == 1:
        result = _StepReplay(spec, stage, batch).run()
        result.rollout_items = rollout_phase(spec, result)
        return result
    ranks = estimate_ranks(spec, batch)
    fullest = max(ranks, key=lambda result: result.total)
    fullest.zero_stage = stage
    fullest.pipeline_ranks = tuple(result.total for result in ranks)
    return fullest


def rollout_phase(spec: PlanSpec, step: Estimate) -> dict[str, float]:
    """GRPO's rollout phase, itemised (empty for any other run): the step's persistent state (shards, the previous
    step's gradients, optimizer states, the reference, the communication buffers, the batch) with the rollout's
    gathered parameters, KV cache and prefill logits (``posttrain.rollout_bytes``), and the allowance on top."""
    post = spec.post_training
    if post is None or post.objective != "grpo":
        return {}
    state = {**state_bytes(spec), **{key: step.items.get(key, 0.0) for key in ("reference", "comm", "inputs")}}
    if spec.cpu_offload:
        state.update(parameters=0.0, gradients=0.0, optimizer=0.0)
    items = {**state, **rollout_bytes(post, spec.model, spec.seq_len, spec.parallel.tensor, spec.bytes.activation,
                                      spec.bytes.param, spec.profile.num_params())}
    items["allowance"] = spec.workspace_gib * GIB + spec.fragmentation * sum(items.values())
    return items


def max_micro_batch(spec: PlanSpec, zero_stage: Optional[int] = None, limit: int = MAX_MICRO_BATCH) -> int:
    """The largest micro-batch (samples per device) whose estimate fits the device memory; 0 if not even 1 fits.
    Under pipeline parallelism it is a multiple of the microbatches a step splits into."""
    step = spec.pipeline.parts if spec.pipeline.size > 1 else 1

    def fits(multiple: int) -> bool:
        return estimate(spec, zero_stage, multiple * step).fits

    if not fits(1):
        return 0
    low, high = 1, 2
    while high * step <= limit and fits(high):  # memory grows with the batch, so double, then bisect
        low, high = high, high * 2
    if high * step > limit:
        return low * step
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * step
