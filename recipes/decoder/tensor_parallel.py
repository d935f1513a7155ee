"""How a decoder of the recipe splits over tensor-parallel ranks: the plan ``npu_fsdp`` applies with
``tensor_parallel_size > 1`` (through ``DecoderLM.tensor_parallel_plan``), and the checks of a model against a
tensor-parallel size, run before any worker starts.

The plan is Megatron's layout in torch's ``parallelize_module`` styles:

- attention: q/k/v projections column-parallel (each rank computes ``n_heads / tp`` query heads and
  ``n_kv_heads / tp`` key/value heads), the output projection row-parallel;
- MLP: gate and up column-parallel, down row-parallel, so SwiGLU runs on each rank's own hidden slice;
- Qwen3's per-head q/k norms replicated, on each rank's heads, their gains' gradients summed over the ranks;
- token embedding row-parallel (split by vocabulary), the output head column-parallel (split by vocabulary: with
  ``loss_parallel`` the logits stay split and the cross entropy runs on them, never gathering [tokens, vocab]);
- with ``sequence_parallel`` the norms and residuals between blocks are split by sequence: activations outside
  attention and the MLP are ``1 / tp`` the size, gathered before each and reduce-scattered after.

The model code knows nothing of this: the layers keep their shapes' meaning, and ``Attention`` reads its local
head count from the projections.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_npu.facts.options import indivisible_by_tensor_parallel
from recipes.decoder.transformer import Attention, DecoderBlock, FeedForward


def tensor_parallel_problems(config: Any, tp: int, *, seq_len: int, sequence_parallel: bool,
                             lora: bool = False) -> list[str]:
    """What keeps the model of ``config`` (with LoRA adapters if ``lora``) from splitting over ``tp`` ranks (empty
    when it can): each problem with its numbers."""
    if tp == 1:
        return []
    sizes = [("n_heads", config.n_heads), ("n_kv_heads", config.n_kv_heads), ("vocab_size", config.vocab_size)]
    if hasattr(config, "ffn_hidden_dim"):
        sizes.append(("ffn_hidden_dim", config.ffn_hidden_dim))
    if sequence_parallel:
        sizes.append(("data.seq_len", seq_len))
    problems = indivisible_by_tensor_parallel(tp, sizes)
    if config.tie_embeddings:
        problems.append(
            "tie_embeddings=true: under tensor parallelism the embedding is split by vocabulary rows for the lookup"
            " and the head by vocabulary columns for the logits, so one tied matrix cannot be both"
        )
    if getattr(config, "n_experts", 0):
        problems.append(
            f"the {type(config).__name__} has expert (MoE) layers, whose stacked experts have no tensor-parallel"
            " plan; split attention and experts by data parallelism (npu_fsdp without tensor_parallel_size)"
        )
    if lora:
        problems.append(
            "LoRA adapters have no tensor-parallel plan (a LoRA run trains few parameters: plain npu_fsdp sharding"
            " fits the frozen base)"
        )
    return problems


def check_tensor_parallel(config: Any, tp: int, *, seq_len: int, sequence_parallel: bool, lora: bool = False) -> None:
    """ValueError listing every problem of :func:`tensor_parallel_problems`, with the sizes that would work."""
    problems = tensor_parallel_problems(config, tp, seq_len=seq_len, sequence_parallel=sequence_parallel, lora=lora)
    if problems:
        fitting = [size for size in (1, 2, 4, 8) if size < tp and not tensor_parallel_problems(
            config, size, seq_len=seq_len, sequence_parallel=sequence_parallel, lora=lora)]
        raise ValueError(
            f"trainer.strategy.tensor_parallel_size={tp} cannot split this model: " + "; ".join(problems)
            + f". Use a tensor_parallel_size that divides them ({', '.join(map(str, fitting))})"
            + (", or change the model config" if fitting else "; change the model config")
        )


def decoder_plan(model: nn.Module, *, prefix: str = "", sequence_parallel: bool, loss_parallel: bool) -> dict:
    """``parallelize_module``'s plan for a ``CausalDecoder`` of the recipe (module names under ``prefix``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    between_blocks = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks),
        "output": ColwiseParallel(
            input_layouts=between_blocks,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for index, block in enumerate(model.layers):
        if not (isinstance(block, DecoderBlock) and isinstance(block.attention, Attention)
                and isinstance(block.feed_forward, FeedForward)):
            raise TypeError(f"layers.{index} ({type(block).__name__}) is not a block of attention and a dense MLP;"
                            " the recipe's tensor-parallel plan splits only those")
        layer = f"layers.{index}."
        plan.update({
            layer + "attention.wq": ColwiseParallel(),
            layer + "attention.wk": ColwiseParallel(),
            layer + "attention.wv": ColwiseParallel(),
            layer + "attention.wo": RowwiseParallel(output_layouts=between_blocks),
            layer + "feed_forward.w_gate": ColwiseParallel(),
            layer + "feed_forward.w_up": ColwiseParallel(),
            layer + "feed_forward.w_down": RowwiseParallel(output_layouts=between_blocks),
        })
        if hasattr(block.attention, "q_norm"):
            # The per-head q/k norms (Qwen3) run on each rank's heads [rows, length, heads / tp, head_dim]: their gain
            # is replicated and its gradient, each rank's heads' part, summed over the ranks.
            for norm in ("q_norm", "k_norm"):
                plan[layer + "attention." + norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if sequence_parallel:
            # Attention takes (x, cos, sin, cache, layer, start_pos, cu_seqlens): only x is gathered.
            gather_x = (Shard(1),) + (None,) * 6
            plan.update({
                layer + "attention_norm": SequenceParallel(),
                layer + "ffn_norm": SequenceParallel(),
                layer + "attention": PrepareModuleInput(input_layouts=gather_x,
                                                        desired_input_layouts=(Replicate(),) + (None,) * 6),
                layer + "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                           desired_input_layouts=(Replicate(),)),
            })
    return {prefix + name: style for name, style in plan.items()}


__all__ = ["check_tensor_parallel", "decoder_plan", "tensor_parallel_problems"]
