"""How close is ``lightning-npu plan`` to the real peak memory of training? Measured on the CPU.

    python benchmarks/plan_accuracy.py                 # every case
    python benchmarks/plan_accuracy.py --cases base,ac1 --out /tmp/plan_accuracy.json
    python benchmarks/plan_accuracy.py --cases tp2,cp2_ring --update  # re-measure some, keep the other rows

Each case trains the recipe's DecoderLM LightningModule for a few steps with
``Trainer(accelerator="npu", strategy=NPUFSDPStrategy(...))`` on the simulated runtime
(LIGHTNING_NPU_SIMULATE=<devices>), varying width, depth, sequence, micro-batch, ZeRO stage, activation
checkpointing, precision, attention kernel, gradient accumulation, tensor and context parallelism (the
recipe's TP plan with and without sequence parallelism and loss_parallel; Ulysses and ring attention; both
together), expert parallelism, alone and with context parallelism, and LoRA on the experts. The planner's estimate for the same configuration (its CPU settings: PyTorch reference kernels, per-tensor AdamW, no HCCL buffers, no allowance) is
compared with the measured peak of the steady-state steps (after the optimizer states exist).

How the peak is measured, and why it can be trusted. PyTorch's CPU allocator reports every allocation and free
of tensor storage to the profiler when ``profile_memory=True`` (c10's ``ProfiledCPUMemoryReporter``), including
those made inside C++ (autograd, FSDP2's buffers, DTensor, the optimizer), with sizes and timestamps. The running
sum of those events from before ``fit`` starts is the live tensor memory of the process at every instant, and its
maximum is the peak (benchmarks/_memory.py). RSS would also count the Python heap, libraries and freed-but-cached
pages; tracemalloc does not see torch's allocator. Two checks are recorded for every case: a calibration in the
same process (tensors of known sizes must give the exact peak; a case whose calibration is off fails), and after
every optimizer step the running sum minus the bytes of the parameter shards, gradients and AdamW states found by
walking the objects must stay constant (it is the batches and rotary tables; a drift would mean frees the profiler
missed).

The profiler follows only the threads it was started on. With N real gloo processes, gloo's worker threads drop
the last reference to some collective buffers, so those frees go unseen and the running sum drifts upward by
megabytes per step (``--backend gloo`` shows it in the state-check column). So by default one process plays rank 0
of N over torch's fake process group (``torch.testing._internal.distributed.fake_pg``): FSDP2 allocates and frees
exactly the same buffers for N ranks, the collectives move no data and allocate nothing, and every allocation is on
the profiled thread. The planner's HCCL buffers and allowance are set to zero for the comparison. The pipelined
cases must exchange real activations, so they run on gloo, and their reading is bounded instead (``steady_peak``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MIB = 1024**2
#: Each case: the model fields over the tiny preset, the run's shape, and the strategy options.
CASES: dict[str, dict[str, Any]] = {
    "base": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=3, ac=0.0),
    "zero2": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=2, ac=0.0),
    "ac1": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=3, ac=1.0),
    "ac05_zero2": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=2, ac=0.5),
    "bf16": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=3, ac=0.0,
                 precision="bf16-mixed"),
    "bf16_zero2_ac1": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=2, ac=1.0,
                           precision="bf16-mixed"),
    "wide": dict(model=dict(dim=512, n_layers=2, n_heads=8, n_kv_heads=8, ffn_hidden_dim=1376), seq=128, batch=2,
                 devices=2, zero=3, ac=0.0),
    "long_seq": dict(model=dict(n_layers=6, max_seq_len=1024), seq=1024, batch=1, devices=2, zero=3, ac=0.0),
    "eager": dict(model=dict(dim=256, ffn_hidden_dim=688, max_seq_len=512), seq=512, batch=2, devices=2, zero=3,
                  ac=0.0, kernels="eager"),
    "one_device": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=1, zero=3, ac=0.5),
    "accumulate": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=3, ac=0.0,
                       accumulate=2),
    # Measured only after the planner was final (the cases above guided it): a check on unseen configurations.
    "dev4_bf16_ac05": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=4, zero=3, ac=0.5,
                           precision="bf16-mixed", holdout=True),
    "dev8_padding": dict(model=dict(dim=320, n_heads=5, n_kv_heads=5, ffn_hidden_dim=868), seq=128, batch=4, devices=8,
                         zero=2, ac=0.0, holdout=True),
    "hybrid_2x2": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=2, devices=2, nodes=2, zero=3, ac=0.0,
                       sharding="hybrid", holdout=True),
    "bf16_true": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=3, ac=0.0,
                      precision="bf16-true", holdout=True),
    "mha_eager_ac1": dict(model=dict(dim=256, n_kv_heads=4, ffn_hidden_dim=688, max_seq_len=512), seq=512, batch=2,
                          devices=2, zero=3, ac=1.0, kernels="eager", holdout=True),
    "deep_zero2": dict(model=dict(n_layers=12), seq=256, batch=2, devices=2, zero=2, ac=0.25, holdout=True),
    # The MoE family (``family: moe``; its tiny preset: Qwen3-MoE q/k norms, 8 experts, top-2, load-balancing loss):
    # stacked experts, permuted rows, router tensors; a Qwen2-MoE with a shared expert, a dense layer and qkv biases;
    # LoRA on attention over frozen experts.
    "moe_zero3": dict(family="moe", model={}, seq=256, batch=4, devices=2, zero=3, ac=0.0),
    "moe_zero2_ac05": dict(family="moe", model={}, seq=256, batch=4, devices=2, zero=2, ac=0.5),
    "moe_qwen2_shared_dense": dict(family="moe", model=dict(
        architecture="qwen2_moe", shared_expert_hidden_dim=192, dense_layers=[0], dense_hidden_dim=256,
        qkv_bias=True, norm_topk_prob=False), seq=256, batch=4, devices=2, zero=3, ac=0.0),
    "moe_lora": dict(family="moe", model={}, seq=256, batch=4, devices=2, zero=3, ac=0.0,
                     lora=dict(rank=8, targets=["q", "k", "v", "o"])),
    "moe_bf16_dev4": dict(family="moe", model=dict(n_experts=16, top_k=4), seq=256, batch=4, devices=4, zero=3,
                          ac=0.0, precision="bf16-mixed", holdout=True),
    # Tensor and context parallelism (npu_fsdp's tensor_parallel_size / context_parallel_size with the recipe's
    # plan: sequence parallelism and loss_parallel by default; Ulysses and ring attention), on 2 or 4 ranks.
    "tp2": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=3, ac=0.0, tp=2),
    # The embedding tied to the head (LLaMA-3.2, Qwen3's small sizes): one [vocab / tp, dim] matrix per rank.
    "tp2_tied": dict(model=dict(dim=256, ffn_hidden_dim=688, tie_embeddings=True), seq=256, batch=4, devices=2,
                     zero=3, ac=0.0, tp=2),
    "tp2_plain_bf16_ac05": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=4, zero=3, ac=0.5,
                                tp=2, sequence_parallel=False, loss_parallel=False, precision="bf16-mixed"),
    "cp2_ulysses": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=3, ac=0.0, cp=2,
                        cp_algo="ulysses"),
    "cp2_ring": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=3, ac=0.0, cp=2,
                     cp_algo="ring"),
    "tp2_cp2_ring_zero2": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=4, zero=2, ac=0.0,
                               tp=2, cp=2, cp_algo="ring"),
    "tp2_cp2_ulysses_bf16": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=4, zero=3,
                                 ac=0.0, tp=2, cp=2, cp_algo="ulysses", precision="bf16-mixed"),
    # Expert parallelism (npu_fsdp's expert_parallel_size: the experts split over ep ranks borrowed from dp_shard x cp,
    # an FSDP unit of their own over the ranks holding the same ones; the rows exchanged by all-to-all), alone on
    # experts that outweigh the rest of each block, and with context parallelism (Ulysses and ring) on the tiny MoE
    # and the tiny DeepSeek (MLA, shared expert, a dense first layer).
    "moe_ep2_zero3_heavy": dict(family="moe", model=dict(n_experts=16, expert_hidden_dim=512), seq=64, batch=2,
                                devices=4, zero=3, ac=0.0, ep=2),
    "moe_ep2_cp2_ulysses": dict(family="moe", model={}, seq=256, batch=4, devices=4, zero=3, ac=0.0, ep=2, cp=2,
                                cp_algo="ulysses"),
    "moe_ep2_cp2_ring_zero2_ac05": dict(family="moe", model={}, seq=256, batch=4, devices=4, zero=2, ac=0.5, ep=2,
                                        cp=2, cp_algo="ring"),
    "moe_ep2_cp2_ring_heavy": dict(family="moe", model=dict(n_experts=16, expert_hidden_dim=512), seq=64, batch=2,
                                   devices=4, zero=3, ac=0.0, ep=2, cp=2, cp_algo="ring"),
    "deepseek_ep2_cp2_ulysses_bf16": dict(family="deepseek", model={}, seq=256, batch=4, devices=4, zero=3, ac=0.0,
                                          ep=2, cp=2, cp_algo="ulysses", precision="bf16-mixed"),
    "deepseek_ep2_cp2_ring": dict(family="deepseek", model={}, seq=256, batch=4, devices=4, zero=3, ac=0.0, ep=2,
                                  cp=2, cp_algo="ring"),
    # DeepSeek's multi-token prediction (mtp_layers: one more DeepSeekMoE block after the trunk, its own logits and
    # loss through the shared head): alone, with the ratio 0.5 checkpointing the depth's block, and in bf16 under
    # ZeRO-2; two depths under expert parallelism.
    "deepseek_mtp": dict(family="deepseek", model=dict(mtp_layers=1), seq=256, batch=4, devices=2, zero=3, ac=0.0),
    "deepseek_mtp_ac05": dict(family="deepseek", model=dict(mtp_layers=1), seq=256, batch=4, devices=2, zero=3,
                              ac=0.5),
    "deepseek_mtp_bf16_zero2": dict(family="deepseek", model=dict(mtp_layers=1), seq=256, batch=4, devices=2, zero=2,
                                    ac=0.0, precision="bf16-mixed"),
    "deepseek_mtp2_ep2": dict(family="deepseek", model=dict(mtp_layers=2), seq=256, batch=2, devices=2, zero=3,
                              ac=0.0, ep=2),
    # LoRA on the experts (lora.targets expert_gate / expert_up / expert_down: per-expert adapters stacked like the
    # experts, everything else frozen): alone; with attention's and dropout on a Qwen2-MoE (shared expert, dense
    # first layer); with half the blocks checkpointed; under ep 2 x cp 2; on DeepSeek with MLA's output, bf16.
    "moe_expert_lora": dict(family="moe", model={}, seq=256, batch=4, devices=2, zero=3, ac=0.0,
                            lora=dict(rank=8, targets=["expert_gate", "expert_up", "expert_down"])),
    "moe_qwen2_expert_lora_dropout_zero2": dict(family="moe", model=dict(
        architecture="qwen2_moe", shared_expert_hidden_dim=192, dense_layers=[0], dense_hidden_dim=256,
        qkv_bias=True, norm_topk_prob=False), seq=256, batch=4, devices=2, zero=2, ac=0.0,
        lora=dict(rank=8, dropout=0.1, targets=["q", "v", "expert_gate", "expert_down"])),
    "moe_expert_lora_ac05": dict(family="moe", model={}, seq=256, batch=4, devices=2, zero=3, ac=0.5,
                                 lora=dict(rank=16, targets=["expert_gate", "expert_up"])),
    "moe_expert_lora_ep2_cp2": dict(family="moe", model={}, seq=256, batch=4, devices=4, zero=3, ac=0.0, ep=2, cp=2,
                                    cp_algo="ulysses", lora=dict(rank=8, targets=["expert_up", "expert_down"])),
    "deepseek_expert_lora_bf16": dict(family="deepseek", model={}, seq=256, batch=4, devices=2, zero=3, ac=0.0,
                                      precision="bf16-mixed",
                                      lora=dict(rank=8, targets=["o", "expert_gate", "expert_up", "expert_down"])),
    # MoE under tensor parallelism (attention and dense MLPs split, the router whole, the shared expert split like a
    # dense MLP, each TP rank's share of the routed rows on whole experts, ep borrowing dp_shard x cp x tp)
    "moe_tp2": dict(family="moe", model=dict(
        architecture="qwen2_moe", shared_expert_hidden_dim=192, dense_layers=[0], dense_hidden_dim=256,
        qkv_bias=True, norm_topk_prob=False), seq=256, batch=4, devices=2, zero=3, ac=0.0, tp=2),
    "moe_tp2_ep2": dict(family="moe", model={}, seq=256, batch=4, devices=2, zero=3, ac=0.0, tp=2, ep=2),
    "moe_tp2_ep2_dev4_zero2": dict(family="moe", model={}, seq=256, batch=4, devices=4, zero=2, ac=0.0, tp=2, ep=2),
    "moe_tp2_ep2_cp2_ring": dict(family="moe", model={}, seq=256, batch=4, devices=4, zero=3, ac=0.0, tp=2, ep=2,
                                 cp=2, cp_algo="ring"),
    # Pipeline parallelism: N real gloo processes (a stage's receives need its neighbour's shapes and data), each
    # pipeline rank's own peak against the planner's for that rank: the schedules, bf16, ZeRO over dp 2 with half
    # the blocks checkpointed, tp 2.
    "pp2_1f1b": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=3, ac=0.0, pp=2,
                     microbatches=2),
    "pp2_gpipe_m4": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=2, zero=3, ac=0.0, pp=2,
                         pp_schedule="GPipe", microbatches=4),
    "pp2_interleaved_m4_bf16": dict(model=dict(dim=256, ffn_hidden_dim=688, n_layers=6), seq=256, batch=4, devices=2,
                                    zero=3, ac=0.0, pp=2, pp_schedule="Interleaved1F1B", microbatches=4,
                                    precision="bf16-mixed"),
    "pp2_zbv_m4": dict(model=dict(dim=256, ffn_hidden_dim=688, n_layers=6), seq=256, batch=4, devices=2, zero=3, ac=0.0,
                       pp=2, pp_schedule="ZBVZeroBubble", microbatches=4),
    # DualPipeV (measured after the planner modelled its order): ZBV's stages, full backwards beside split ones.
    "pp2_dualpipev_m4": dict(model=dict(dim=256, ffn_hidden_dim=688, n_layers=6), seq=256, batch=4, devices=2, zero=3,
                             ac=0.0, pp=2, pp_schedule="DualPipeV", microbatches=4, holdout=True),
    "pp2_dp2_1f1b_ac05": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=4, zero=3, ac=0.5,
                              pp=2, microbatches=4),
    "pp2_tp2_1f1b": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=4, zero=3, ac=0.0, pp=2,
                         tp=2, sequence_parallel=False, microbatches=2),
    # Sequence parallelism under the pipeline (measured after the planner's change for it): the stages exchange and
    # receive each sequence's half, the checkpointed blocks keep their halves of the residual stream.
    "pp2_tp2_sp_1f1b_ac05": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=4, zero=3, ac=0.5,
                                 pp=2, tp=2, microbatches=4, holdout=True),
    # Context parallelism inside the stages (measured after it ran under the pipeline): each rank's half of every
    # sequence through its stage, the ring's or Ulysses' exchanges in the blocks.
    "pp2_cp2_ring_1f1b": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=4, zero=3, ac=0.0,
                              pp=2, cp=2, cp_algo="ring", microbatches=2, holdout=True),
    "pp2_cp2_ulysses_ac05": dict(model=dict(dim=256, ffn_hidden_dim=688), seq=256, batch=4, devices=4, zero=3,
                                 ac=0.5, pp=2, cp=2, cp_algo="ulysses", microbatches=4, holdout=True),
    # (the load-balancing loss sums the routing over stages, so it is off under a pipeline; the routing bias balances)
    "moe_pp2_ep2": dict(family="moe", model=dict(router_aux_loss_coef=0.0, router_bias_update_rate=0.01), seq=256,
                        batch=4, devices=4, zero=3, ac=0.0, pp=2, ep=2, microbatches=2),
}
STEPS = 4  # optimizer steps per run (a case's "steps" overrides it); the first is excluded (no optimizer states yet)


#: Each family's block class, by family name (a case's ``family``, default LLaMA's): the FSDP unit.
BLOCKS = {"llama": "recipes.models.llama.model.TransformerBlock", "moe": "recipes.models.moe.model.MoEBlock",
          "deepseek": "recipes.models.deepseek.model.DeepSeekBlock"}


def case_options(case: dict[str, Any]) -> dict[str, Any]:
    """The npu_fsdp options (``FSDPOptions`` names) of a case beside its block classes: its ZeRO stage, sharding,
    tensor, context, expert and pipeline parallelism; what the measured run's strategy gets and the planner reads."""
    return {
        "zero_stage": case["zero"],
        "sharding": case.get("sharding", "full"),
        "tensor_parallel_size": case.get("tp", 1),
        "context_parallel_size": case.get("cp", 1),
        "context_parallel_algo": case.get("cp_algo", "ulysses"),
        "sequence_parallel": case.get("sequence_parallel", True),
        "loss_parallel": case.get("loss_parallel", True),
        "expert_parallel_size": case.get("ep", 1),
        "pipeline_parallel_size": case.get("pp", 1),
        "pipeline_schedule": case.get("pp_schedule", "1F1B"),
        "pipeline_microbatches": case.get("microbatches"),
    }


def case_spec(case: dict[str, Any]):
    """The planner's PlanSpec for a case (its family's profile, its ``lora``, if any, as the recipe's profile reads
    it), with the CPU's settings."""
    import importlib

    from lightning_npu.facts.options import FSDPOptions
    from lightning_npu.plan import PlanSpec

    family = case.get("family", "llama")
    module = importlib.import_module(BLOCKS[family].rpartition(".model.")[0] + ".memory_profile")
    profile = module.lightning_npu_memory_profile(
        {"family": family, "preset": "tiny", "config": case["model"], "lora": case.get("lora")})
    profile = profile.with_expert_parallelism(case.get("ep", 1))
    return PlanSpec(
        model=profile.shape,
        profile=profile,
        seq_len=case["seq"],
        micro_batch=case["batch"],
        devices=case["devices"],
        nodes=case.get("nodes", 1),
        precision=case.get("precision", "32-true"),
        accumulate_grad_batches=case.get("accumulate", 1),
        wrap_blocks=True,
        ac_ratio=case["ac"],
        kernels=case.get("kernels", "reference"),
        optimizer="per-tensor",  # torch's AdamW runs its per-tensor loop on CPU tensors
        hccl_buffsize_mb=0.0,
        workspace_gib=0.0,
        fragmentation=0.0,
        device_memory_gib=1024.0,
        options=FSDPOptions(**case_options(case)),
        p2p_buffsize_mb=0.0,
    )


# -------------------------------------------------------------------------------------------- the measured run


def _windows(prof: Any, prefix: str) -> list[tuple[str, int, int]]:
    out = []
    for event in prof.profiler.kineto_results.events():
        if event.name().startswith(prefix):
            out.append((event.name(), event.start_ns(), event.end_ns()))
    return sorted(out, key=lambda w: w[1])


def worker(case: dict[str, Any], out: Path) -> None:
    """One rank of a measured run (Lightning starts the other ranks by re-running this command)."""
    import contextlib

    import torch
    from lightning.pytorch import Callback, Trainer
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.data import DataLoader, Dataset

    from benchmarks._memory import calibration, memory_curve
    import importlib

    from lightning_npu import NPUFSDPStrategy
    from recipes.decoder.module import DecoderLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    calibrated = calibration()  # in this process, before the run: the profiler must report known sizes exactly
    family = case.get("family", "llama")
    module_name, _, block_name = BLOCKS[family].rpartition(".")
    block = getattr(importlib.import_module(module_name), block_name)
    module = DecoderLM(family=family, preset="tiny", config=case["model"], warmup_steps=1)
    if case.get("lora"):  # LoRA on a base initialised in place: the same tensors as one loaded from init_from
        from recipes.decoder.lora import LoRAConfig

        module.lora = LoRAConfig.from_value(case["lora"])
        module.on_fit_start = lambda: None  # nothing to load
        if any(target.startswith("expert_") for target in module.lora.targets):
            # Built here with its values (as tests/recipes/models/scripts/expert_lora_ep_run.py builds it), not on the meta device
            # inside fit: npu_fsdp would reset the stacked adapters' meta parameters once sharded, and their
            # per-expert initialisation iterates a DTensor along its sharded dim, which DTensor refuses.
            module.configure_model()
    vocab, seq, batch = module.config.vocab_size, case["seq"], case["batch"]
    accumulate = case.get("accumulate", 1)
    steps = case.get("steps", STEPS)

    class Tokens(Dataset):
        def __len__(self) -> int:
            return steps * accumulate * batch * _data_parallel(case)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(index)
            block = torch.randint(0, vocab, (seq + 1,), generator=g)
            return {"input_ids": block[:-1].clone(), "labels": block[1:].clone()}

    class Marks(Callback):
        """Brackets each batch with a profiler range; counts the persistent state at the end of the last one."""

        def __init__(self) -> None:
            self.range = None
            self.state_bytes: list[int] = []
            self.visible_bytes: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.range = record_function(f"batch {batch_idx}")
            self.range.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.range.__exit__(None, None, None)
            if (batch_idx + 1) % accumulate == 0:
                with record_function(f"state check {batch_idx}"):
                    self.state_bytes.append(sum(_state_bytes(pl_module, trainer.optimizers[0]).values()))
                    self.visible_bytes.append(_other_tensor_bytes(pl_module, trainer.optimizers[0]))

    marks = Marks()
    backend = None
    if case["devices"] * case.get("nodes", 1) > 1 and _backend(case) == "fake":
        # One process poses as rank 0 of N: torch's fake process group performs no communication and allocates
        # nothing, so every tensor FSDP2 allocates for its collectives is its own, made on this thread.
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case["devices"] * case.get("nodes", 1))
        backend = "fake"
        if case.get("ep", 1) > 1:
            _balanced_all_to_all()
    strategy = NPUFSDPStrategy(
        auto_wrap_policy=[block],
        activation_checkpointing_policy=[block] if case["ac"] > 0 else None,
        activation_checkpointing_ratio=case["ac"] if case["ac"] > 0 else 1.0,
        **case_options(case),
        timeout=600,
        process_group_backend=backend,
    )
    trainer = Trainer(
        accelerator="npu", devices=case["devices"], num_nodes=case.get("nodes", 1), strategy=strategy,
        precision=case.get("precision", "32-true"),
        max_steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=1.0, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[marks],
    )
    attention = contextlib.nullcontext()
    if case.get("kernels") == "eager":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.MATH)  # SDPA's math backend keeps the S x S probabilities
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, attention:
        trainer.fit(module, train_dataloaders=DataLoader(Tokens(), batch_size=batch))
    seconds = time.perf_counter() - started
    times, live = memory_curve(prof)
    batches = _windows(prof, "batch ")
    state_checks = _windows(prof, "state check")
    steady_from = accumulate  # batches before this one ran without optimizer states
    peaks = []
    for _, start, end in batches:
        inside = [v for t, v in zip(times, live, strict=True) if start <= t <= end]
        peaks.append(max(inside) if inside else 0)
    # Live bytes right after each optimizer step minus the parameter/gradient/optimizer bytes found through the
    # objects: what else the loop holds (batches, rotary tables, retained collective buffers). Constant if every
    # free is seen.
    extra = [[v for t, v in zip(times, live, strict=True) if t <= start][-1] - state
             for (_, start, _), state in zip(state_checks, marks.state_bytes, strict=True)]
    result = {
        "rank": trainer.global_rank,
        "batch_peaks": peaks,
        "first_step_peak": max(peaks[:steady_from]),
        "overall_peak": max(live),
        "state_bytes_by_objects": marks.state_bytes,
        "live_minus_state_after_each_step": extra,
        "other_tensors_after_each_step": marks.visible_bytes,
        "calibration": calibrated,
        "fit_seconds": seconds,
    }
    out.with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _balanced_all_to_all() -> None:
    """Under the fake process group every collective leaves its output as it was allocated, but expert parallelism
    reads the per-expert counts its all-to-all exchanges on the host and sizes the rows' exchange by them. So for
    the expert-parallel cases ``all_to_all_single`` returns what this rank sent (in place, allocating nothing): every
    rank routes as rank 0 does, so each receives as many rows as it sends (T x top_k; the balanced exchange the
    planner plans for), and the split sizes stay consistent."""
    import torch.distributed as dist

    exchange = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        work = exchange(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        if output.shape == input.shape:
            output.copy_(input)
        return work

    dist.all_to_all_single = all_to_all_single


def _backend(case: dict[str, Any]) -> str:
    """The process group a case runs on: a pipeline's stages exchange real activations, so they run on gloo."""
    return "gloo" if case.get("pp", 1) > 1 else case.get("backend", "fake")


def _data_parallel(case: dict[str, Any]) -> int:
    """How many different batches a step trains on: the world over the ranks of a tensor- and context-parallel group."""
    return case["devices"] * case.get("nodes", 1) // (case.get("tp", 1) * case.get("cp", 1) * case.get("pp", 1))


def _other_tensor_bytes(module: Any, optimizer: Any) -> int:
    """Bytes of the tensors Python can reach, other than the parameters, gradients and optimizer states (the
    batches, rotary tables, a pipeline's receive buffers): what live minus state should be if every free is seen."""
    import gc

    import torch

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    state = {local(p).untyped_storage().data_ptr() for p in module.parameters()}
    state |= {local(p.grad).untyped_storage().data_ptr() for p in module.parameters() if p.grad is not None}
    state |= {local(v).untyped_storage().data_ptr() for s in optimizer.state.values() for v in s.values()
              if isinstance(v, torch.Tensor)}
    others = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            storage = local(obj).untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in state:
                others[storage.data_ptr()] = storage.nbytes()
    return sum(others.values())


def _state_bytes(module: Any, optimizer: Any) -> dict[str, int]:
    """Bytes of this rank's parameter shards, gradient shards and AdamW states, found through the objects."""
    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    params = list(module.parameters())
    sizes = {"parameters": sum(local(p).untyped_storage().nbytes() for p in params), "optimizer": 0}
    seen = set()
    for state in optimizer.state.values():
        for value in state.values():
            if hasattr(value, "untyped_storage"):
                storage = local(value).untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    sizes["optimizer"] += storage.nbytes()
    # A unit's gradient shards are views of one reduce-scatter output: count each storage once.
    grads = {local(p.grad).untyped_storage().data_ptr(): local(p.grad).untyped_storage().nbytes()
             for p in params if p.grad is not None}
    sizes["gradients"] = sum(grads.values())
    return sizes


# ----------------------------------------------------------------------------------------------------- the driver


def measure(name: str, case: dict[str, Any], workdir: Path, timeout: float = 900) -> dict[str, Any]:
    out = workdir / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_NPU_SIMULATE"}
    env.update(LIGHTNING_NPU_SIMULATE=str(case["devices"]), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    ranks = case["devices"]
    if case["devices"] * case.get("nodes", 1) > 1 and _backend(case) == "fake":
        env.update(LOCAL_RANK="0", NODE_RANK="0")  # Lightning then starts no other process: this is rank 0 of N
        ranks = 1
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(case), "--result", str(out)]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"case {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    results = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(ranks)]
    return {"ranks": results, "wall_seconds": time.perf_counter() - started}


def steady_peak(case: dict[str, Any], rank: dict[str, Any]) -> dict[str, int]:
    """A rank's steady-state peak: the smallest over the optimizer steps after the first of the step's raw peak
    less the offset of unseen frees before the step began, with the bounds it is known within.

    On gloo, some collective buffers are freed on gloo's threads, where the profiler does not look, so the running
    sum only ever gains an offset: after each optimizer step, live bytes minus the state minus every other tensor
    Python can reach. A free can go unseen at any instant of a step, before or after its peak, so the true peak of
    step i lies between its raw peak less the offset after it and its raw peak less the offset before it. Every
    steady step has the same true peak (the same allocation sizes), so the tightest upper bound over the steady
    steps is the measurement (``upper``), and ``lower`` is the tightest lower bound: they differ only when every
    steady step lost a free before its peak. 0 offsets on the fake process group."""
    accumulate = case.get("accumulate", 1)
    peaks = rank["batch_peaks"]
    offsets = [0] * len(rank["live_minus_state_after_each_step"])
    if _backend(case) == "gloo":
        offsets = [max(0, live - other) for live, other in
                   zip(rank["live_minus_state_after_each_step"], rank["other_tensors_after_each_step"], strict=True)]
    raw = [max(peaks[i * accumulate:(i + 1) * accumulate]) for i in range(len(offsets))]
    before = [0, *offsets[:-1]]
    upper = min(peak - offset for peak, offset in zip(raw[1:], before[1:], strict=True))
    lower = max(peak - offset for peak, offset in zip(raw[1:], offsets[1:], strict=True))
    return {"upper": upper, "lower": min(lower, upper)}


def check_calibration(name: str, ranks: list[dict[str, Any]]) -> dict[str, int]:
    """Rank 0's calibration; raises unless every rank's profiler reported the known allocations exactly (a run
    whose profiler misses or misreports allocations measures nothing)."""
    for rank in ranks:
        found = rank["calibration"]
        if found["measured_peak"] != found["expected_peak"]:
            raise RuntimeError(
                f"case {name}: rank {rank['rank']}'s profiler reported a peak of {found['measured_peak']} bytes for"
                f" allocations whose peak is {found['expected_peak']} bytes, so its memory curve cannot be trusted"
                " (is profile_memory supported by this torch build?)"
            )
    return ranks[0]["calibration"]


def compare(name: str, case: dict[str, Any], workdir: Path, timeout: float = 900) -> dict[str, Any]:
    """The planner's estimate of ``case`` next to its measured steady-state peak (one row of the table)."""
    from lightning_npu.plan import estimate
    from lightning_npu.plan.stages import estimate_ranks

    spec = case_spec(case)
    predicted = estimate(spec)
    run = measure(name, case, workdir, timeout)
    calibrated = check_calibration(name, run["ranks"])
    for rank in run["ranks"]:
        rank["steady"] = steady_peak(case, rank)
    measured = max(rank["steady"]["upper"] for rank in run["ranks"])
    error = 100.0 * (predicted.total - measured) / measured
    stages = {}
    if spec.pipeline.size > 1:  # each pipeline rank against its own estimate; the case's error is the worst rank's
        per_stage = spec.world_size // spec.pipeline.size  # the stage's replicas hold the same allocations
        for pp_rank, result in enumerate(estimate_ranks(spec)):
            replicas = [r["steady"] for r in run["ranks"] if r["rank"] // per_stage == pp_rank]
            real = min(bounds["upper"] for bounds in replicas)
            lower = max(bounds["lower"] for bounds in replicas)
            stages[pp_rank] = {"predicted_mib": result.total / MIB, "measured_mib": real / MIB,
                               "measured_lower_bound_mib": min(lower, real) / MIB,
                               "error_pct": 100.0 * (result.total - real) / real, "peak_phase": result.peak_phase}
        error = max((row["error_pct"] for row in stages.values()), key=abs)
    rank0 = run["ranks"][0]
    return {
        "case": name,
        "config": case,
        "predicted_mib": predicted.total / MIB,
        "measured_mib": measured / MIB,
        "error_pct": error,
        "pipeline_ranks": stages,
        "predicted_items_mib": {k: v / MIB for k, v in predicted.items.items()},
        "predicted_peak_phase": predicted.peak_phase,
        "first_step_peak_mib": max(r["first_step_peak"] for r in run["ranks"]) / MIB,
        "check_state_by_objects_mib": rank0["state_bytes_by_objects"][-1] / MIB,
        "check_live_minus_state_mib": [x / MIB for x in rank0["live_minus_state_after_each_step"]],
        "check_calibration": calibrated,
        "wall_seconds": run["wall_seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated subset of {', '.join(CASES)} (default: all of them)")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")), help="where the JSON result goes")
    parser.add_argument("--backend", choices=("fake", "gloo"), default="fake",
                        help="fake: one process poses as rank 0 of N (exact, default; the pipelined cases always run"
                             " on gloo); gloo: N real processes, whose"
                             " gloo worker threads free some buffers where the profiler cannot see it (see the state"
                             " check column)")
    parser.add_argument("--update", action="store_true",
                        help="keep the other cases' rows of the --out file (the ones run replace theirs) and summarise"
                        " them all")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker), Path(args.result))
        return 0

    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    known = CASES
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(known)}")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            case = dict(known[name], backend=args.backend)
            row = compare(name, dict(case, backend=_backend(case)), Path(workdir))  # the pipelined run on gloo
            rows.append(row)
            print(f"{name:<30} predicted {row['predicted_mib']:8.1f} MiB  measured {row['measured_mib']:8.1f} MiB"
                  f"  error {row['error_pct']:+6.1f}%   ({row['wall_seconds']:.0f} s)", flush=True)
    if args.update and Path(args.out).is_file():
        run = {row["case"] for row in rows}
        kept = [row for row in json.loads(Path(args.out).read_text())["rows"] if row["case"] not in run]
        rows = sorted(kept + rows, key=lambda row: list(known).index(row["case"]) if row["case"] in known else 0)
    print()
    print(f"{'case':<30}{'zero':>5}{'AC':>5}{'prec':>11}{'kernels':>10}{'world':>6}{'tokens':>7}"
          f"{'plan MiB':>10}{'real MiB':>10}{'error':>8}{'state chk':>11}")
    for r in rows:
        c = r["config"]
        extra = r["check_live_minus_state_mib"]
        print(f"{r['case'] + (' (h)' if c.get('holdout') else ''):<30}{c['zero']:>5}{c['ac']:>5.2f}"
              f"{c.get('precision', '32-true'):>11}{c.get('kernels', 'reference'):>10}"
              f"{c['devices'] * c.get('nodes', 1):>6}{c['seq'] * c['batch']:>7}{r['predicted_mib']:>10.1f}"
              f"{r['measured_mib']:>10.1f}{r['error_pct']:>+7.1f}%{extra[-1] - extra[0]:>+9.2f}MiB")
    summary = {}
    for label, subset in (("all", rows), ("holdout", [r for r in rows if r["config"].get("holdout")])):
        errors = [abs(r["error_pct"]) for r in subset]
        if errors:
            summary[label] = {"mean_abs_error_pct": statistics.mean(errors), "max_abs_error_pct": max(errors),
                              "cases": len(errors)}
            print(f"{label}: mean |error| {statistics.mean(errors):.1f}%, max |error| {max(errors):.1f}%"
                  f" over {len(errors)} cases")
    print("(h): measured only after the planner was final. state chk: drift, over the run, of live tensor bytes"
          " after an optimizer step minus the parameter, gradient and AdamW bytes found through the objects"
          " (0 when the profiler sees every free)")
    Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
