"""Training checks: the selftest decoder (``selftest.model``) trained with npu_fsdp on every device for a few steps.

- ``loss``: the loss (averaged over ranks) falls over the run.
- ``resume``: a sharded checkpoint saved halfway and loaded into a fresh model and optimizer reproduces the
  uninterrupted run's remaining losses exactly (bit for bit: same data, same kernels, same reductions).
- ``memory``: the peak device memory of the run against ``lightning-npu plan``'s estimate for the same model,
  batch, precision and devices (tensor items only: HCCL's buffers and the workspace allowance are not allocated
  by torch's caching allocator). A planner off by more than ``MEMORY_WARN_RATIO`` is a warning, not a failure:
  it misjudges the fit of long runs, but the run itself is sound. The simulated runtime measures the process's
  RSS, not device memory, so there it is reported for information only.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from lightning_npu.facts import env as names
from lightning_npu.facts.options import FSDPOptions
from lightning_npu.facts.pipeline import blocks_per_stage
from lightning_npu.selftest.model import Decoder, DecoderConfig
from lightning_npu.selftest.report import FAIL, INFO, PASS, WARN, CheckResult

FAMILY = "training"
GIB = 1024**3
MEMORY_WARN_RATIO = 1.25
#: A fraction of the first loss the last must fall below: the synthetic task is learnable in a few steps.
LOSS_DROP = 0.9


def check_training(fabric: Any, runtime: Any, workdir: Path, *, steps: int, precision: str,
                   config: DecoderConfig = DecoderConfig(), batch_size: int = 4, seq_len: int = 64,
                   learning_rate: float = 3e-3, seed: int = 1234) -> list[CheckResult]:
    """Train ``steps`` steps (saving at ``steps // 2``), then resume from that checkpoint; returns the results."""
    save_at = steps // 2
    checkpoint = Path(workdir) / "selftest-checkpoint"
    runtime.reset_peak_memory_stats(fabric.device)
    model, optimizer = _build(fabric, runtime, config, seed, learning_rate)
    losses = []
    for step in range(steps):
        if step == save_at:
            fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": step})
        losses.append(_train_step(fabric, model, optimizer, step, config, batch_size, seq_len))
    peak = runtime.max_memory_allocated(fabric.device)

    # Other initial weights, so only the checkpoint can make the losses agree.
    resumed_model, resumed_optimizer = _build(fabric, runtime, config, seed + 1, learning_rate)
    state = {"model": resumed_model, "optimizer": resumed_optimizer, "step": 0}
    fabric.load(checkpoint, state)
    resumed = [_train_step(fabric, resumed_model, resumed_optimizer, step, config, batch_size, seq_len)
               for step in range(state["step"], steps)]

    nodes = getattr(fabric.strategy, "num_nodes", 1)
    plan = planned_peak(config, seq_len=seq_len, micro_batch=batch_size, devices=fabric.world_size // nodes,
                        nodes=nodes, precision=precision, fused_optimizer=runtime.fused_optimizer,
                        kernels="reference" if runtime.simulated else "fused", chip=runtime.device_name(),
                        device_memory_gib=runtime.total_memory(fabric.device) / GIB)
    return [
        loss_result(losses),
        resume_result(losses[save_at:], resumed, save_at),
        memory_result(peak, plan, simulated=runtime.simulated),
    ]


def _build(fabric: Any, runtime: Any, config: DecoderConfig, seed: int, learning_rate: float) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = fabric.setup_module(Decoder(config))
    fused = True if runtime.fused_optimizer else None
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=learning_rate, fused=fused))
    return model, optimizer


def batch(step: int, rank: int, config: DecoderConfig, batch_size: int, seq_len: int) -> torch.Tensor:
    """Token rows that count up from a random start by a random stride of 1..3 (the model learns to continue
    them): the same for a given step and rank in every run, as a resumed run needs."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    start = torch.randint(config.vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    return (start + stride * torch.arange(seq_len + 1)) % config.vocab_size


def _train_step(fabric: Any, model: Any, optimizer: Any, step: int, config: DecoderConfig, batch_size: int,
                seq_len: int) -> float:
    loss = _step(fabric, model, optimizer, batch(step, fabric.global_rank, config, batch_size, seq_len))
    return fabric.all_reduce(loss, reduce_op="mean").item()


def _step(fabric: Any, model: Any, optimizer: Any, tokens: torch.Tensor) -> torch.Tensor:
    """One optimizer step on ``tokens`` (the model's call with labels: under pipeline parallelism that runs every
    microbatch's forward and backward); the step's loss, detached."""
    tokens = tokens.to(fabric.device)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def loss_result(losses: list[float]) -> CheckResult:
    figures = {"first_loss": losses[0], "last_loss": losses[-1], "steps": len(losses), "losses": losses}
    if all(map(_finite, losses)) and losses[-1] < LOSS_DROP * losses[0]:
        return CheckResult(FAMILY, "loss", PASS, f"loss fell from {losses[0]:.3f} to {losses[-1]:.3f}", figures)
    return CheckResult(FAMILY, "loss", FAIL, f"loss did not fall below {LOSS_DROP} x the first step's: "
                       + ", ".join(f"{x:.4g}" for x in losses), figures)


def resume_result(expected: list[float], resumed: list[float], save_at: int) -> CheckResult:
    diffs = [abs(a - b) for a, b in zip(expected, resumed)]
    figures = {"resumed_at": save_at, "steps_compared": len(resumed), "max_abs_diff": max(diffs, default=0.0),
               "expected": expected, "resumed": resumed}
    if len(resumed) == len(expected) and expected == resumed:
        return CheckResult(FAMILY, "resume", PASS, f"{len(resumed)} steps after a sharded save at step {save_at}"
                           " reproduced exactly", figures)
    first = next((i for i, (a, b) in enumerate(zip(expected, resumed)) if a != b), min(len(expected), len(resumed)))
    detail = (f"resuming the sharded checkpoint of step {save_at} does not reproduce the run: step {save_at + first}"
              f" gave {resumed[first] if first < len(resumed) else 'nothing'} instead of"
              f" {expected[first] if first < len(expected) else 'nothing'} (nondeterministic kernels or collectives,"
              " or state missing from the checkpoint; try HCCL_DETERMINISTIC=true)")
    return CheckResult(FAMILY, "resume", FAIL, detail, figures)


def memory_result(peak_bytes: int, plan: dict[str, Any], *, simulated: bool) -> CheckResult:
    figures = {"peak_gib": peak_bytes / GIB}
    if "error" in plan:
        return CheckResult(FAMILY, "memory", INFO, f"the planner cannot model this run: {plan['error']}", figures)
    figures.update(planned_tensors_gib=plan["tensors"] / GIB, planned_total_gib=plan["total"] / GIB)
    if simulated:
        return CheckResult(FAMILY, "memory", INFO, "simulated runtime: the peak is the process's RSS, not device"
                           " memory, so it is not compared with the plan", figures)
    ratio = peak_bytes / plan["tensors"]
    figures["measured_over_planned"] = ratio
    detail = f"measured peak {peak_bytes / GIB:.3f} GiB vs planned tensors {plan['tensors'] / GIB:.3f} GiB"
    if 1 / MEMORY_WARN_RATIO <= ratio <= MEMORY_WARN_RATIO:
        return CheckResult(FAMILY, "memory", PASS, detail, figures)
    return CheckResult(FAMILY, "memory", WARN, detail + f": off by more than {MEMORY_WARN_RATIO}x; trust"
                       " `lightning-npu plan` less for this setup, and please report it", figures)


#: The pipelined step's layout: 2 stages (the decoder's 2 blocks, one each, with the embedding on the first and the
#: head on the last), 1F1B, 4 microbatches of one row (1F1B needs at least one per stage; 4 give it a steady state).
PIPELINE_OPTIONS = {"pipeline_parallel_size": 2, "pipeline_schedule": "1F1B", "pipeline_microbatches": 4}
PIPELINE_STEPS = 4
#: The largest relative difference, per step, between the pipelined loss and plain npu_fsdp's. The two runs differ in
#: summation order only (per-microbatch sums over the batch's tokens, gradients accumulated over 4 microbatches). In
#: fp32 that is ~1e-7 (measured on 2 and 4 simulated NPUs: 9.5e-8 over the 4 steps): 1e-5 leaves margin. In bf16-mixed
#: every matmul rounds to 2^-8, differently for a 1-row microbatch than for 4 rows, and AdamW's early sign-like updates
#: carry that into later steps (measured on the CPU: 1.3e-4 over 8 steps; NPU kernels may tile the two batch shapes
#: differently): 4 x 2^-8, so a sound NPU never fails it. Either catches a lost or doubled microbatch (25%), a
#: misscaled loss, activations or gradients corrupted in transit, or a stage that does not train (17% by step 4).
PIPELINE_TOLERANCE = {"32-true": 1e-5, "bf16-mixed": 4 * 2**-8}
PIPELINE_CHECK = f"pipelined step ({PIPELINE_OPTIONS['pipeline_schedule']})"


def check_pipeline(fabric: Any, runtime: Any, *, precision: str, steps: int = PIPELINE_STEPS,
                   config: DecoderConfig = DecoderConfig(), batch_size: int = 4, seq_len: int = 64,
                   learning_rate: float = 3e-3, seed: int = 1234) -> CheckResult:
    """Train ``steps`` steps with plain npu_fsdp (``fabric``), then as many from the same weights on the same rows
    split into pipeline stages (a second Fabric, with ``PIPELINE_OPTIONS``); the pipelined losses against the plain
    ones. ``info`` where the ranks cannot form the pipeline. ``fabric`` must be made from the launcher's ``LT_*``
    variables, as the selftest worker makes it: the pipelined Fabric is made from them too."""
    nodes = getattr(fabric.strategy, "num_nodes", 1)
    problem = pipeline_problem(fabric.world_size, nodes, config)
    if problem is not None:
        return CheckResult(FAMILY, PIPELINE_CHECK, INFO, f"not run on {fabric.world_size} rank(s): {problem}",
                           {"ranks": fabric.world_size})
    rows = batch(0, 0, config, batch_size, seq_len)  # the same on every rank
    reference = _losses(fabric, runtime, rows, steps, config, seed, learning_rate)
    pipelined = _losses(_pipelined_fabric(precision), runtime, rows, steps, config, seed, learning_rate)
    return pipeline_result(pipelined, reference, PIPELINE_TOLERANCE[precision], rank=fabric.global_rank)


def pipeline_problem(world_size: int, nodes: int, config: DecoderConfig) -> Optional[str]:
    """Why ``world_size`` ranks on ``nodes`` nodes cannot run the pipelined step (None when they can): npu_fsdp's
    own checks of the layout and of the decoder's split."""
    stages = PIPELINE_OPTIONS["pipeline_parallel_size"]
    if world_size < stages:
        return f"{stages} pipeline stages need at least {stages} ranks"
    try:
        FSDPOptions(**PIPELINE_OPTIONS).layout(nodes, world_size // nodes)
        blocks_per_stage(config.n_layers, stages)
    except ValueError as error:
        return str(error)
    return None


def _losses(fabric: Any, runtime: Any, rows: torch.Tensor, steps: int, config: DecoderConfig, seed: int,
            learning_rate: float) -> list[float]:
    """Each step's loss on this rank (under pipeline parallelism the last stage's, sent to every rank)."""
    model, optimizer = _build(fabric, runtime, config, seed, learning_rate)
    return [_step(fabric, model, optimizer, rows).item() for _ in range(steps)]


def _pipelined_fabric(precision: str) -> Any:
    """A Fabric on the same processes and devices with npu_fsdp split into pipeline stages."""
    from lightning.fabric import Fabric

    from lightning_npu.strategies.fsdp import NPUFabricFSDPStrategy

    with _strategy_not_from_launcher():
        return Fabric(strategy=NPUFabricFSDPStrategy(**PIPELINE_OPTIONS), precision=precision)


@contextmanager
def _strategy_not_from_launcher() -> Iterator[None]:
    """Without the launcher's ``LT_STRATEGY`` (plain ``npu_fsdp``), which Fabric would otherwise prefer to a strategy
    object, refusing the two together; its other ``LT_*`` variables (accelerator, devices, nodes) still apply."""
    launcher_strategy = os.environ.pop(names.LT_STRATEGY, None)
    try:
        yield
    finally:
        if launcher_strategy is not None:
            os.environ[names.LT_STRATEGY] = launcher_strategy


def pipeline_result(pipelined: list[float], reference: list[float], tolerance: float, *, rank: int) -> CheckResult:
    """The pipelined losses against plain npu_fsdp's: each finite and within ``tolerance`` (relative), and falling;
    a failure names the first step off."""
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(pipelined, reference)]
    figures = {"stages": PIPELINE_OPTIONS["pipeline_parallel_size"],
               "microbatches": PIPELINE_OPTIONS["pipeline_microbatches"], "steps": len(pipelined),
               "max_rel_diff": max(diffs), "tolerance": tolerance, "losses": pipelined, "reference": reference}
    fallback = "pipeline_parallel_size=1 (train without pipeline parallelism)"
    off = [step for step, diff in enumerate(diffs) if not diff <= tolerance]  # NaN is never within it
    if off:
        step = off[0]
        detail = (f"rank {rank}: step {step}'s pipelined loss {pipelined[step]:.6g} differs from plain npu_fsdp's"
                  f" {reference[step]:.6g} on the same weights and rows by {diffs[step]:.2e} (relative), over the"
                  f" {tolerance:.2e} allowed: the stages' activations or gradients, or the loss sent from the last"
                  " stage, are wrong (see the send/recv row)")
        return CheckResult(FAMILY, PIPELINE_CHECK, FAIL, detail, figures, fallback)
    if not pipelined[-1] < LOSS_DROP * pipelined[0]:
        detail = (f"rank {rank}: the pipelined loss did not fall below {LOSS_DROP} x the first step's: "
                  + ", ".join(f"{x:.4g}" for x in pipelined))
        return CheckResult(FAMILY, PIPELINE_CHECK, FAIL, detail, figures, fallback)
    return CheckResult(FAMILY, PIPELINE_CHECK, PASS, f"{len(pipelined)} steps over 2 stages matched plain npu_fsdp's"
                       f" losses within {max(diffs):.1e} (allowed {tolerance:.1e}); the loss fell from"
                       f" {pipelined[0]:.3f} to {pipelined[-1]:.3f}", figures)


def planned_peak(config: DecoderConfig, *, seq_len: int, micro_batch: int, devices: int, nodes: int, precision: str,
                 fused_optimizer: bool, kernels: str, chip: str, device_memory_gib: float) -> dict[str, Any]:
    """The planner's per-device peak for this run, in bytes: ``total`` and the torch-allocated ``tensors`` part.

    The one place the selftest calls the planner (its import path moves with the planner package)."""
    from lightning_npu.plan import ModelShape, PlanError, PlanSpec, estimate

    try:
        spec = PlanSpec(model=ModelShape.of(config), seq_len=seq_len, micro_batch=micro_batch, devices=devices,
                        nodes=nodes, precision=precision, kernels=kernels,
                        # fused on NPUs; the simulation's CPU tensors run torch's per-tensor loop
                        optimizer="fused" if fused_optimizer else "per-tensor",
                        chip=chip, device_memory_gib=device_memory_gib)
        result = estimate(spec)
    except PlanError as error:
        return {"error": str(error)}
    untracked = result.items.get("comm", 0.0) + result.items.get("allowance", 0.0)
    return {"total": result.total, "tensors": result.total - untracked, "items": result.items}


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
