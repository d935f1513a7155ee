"""How a decoder of the recipe splits over tensor-parallel ranks: the plan of the recipe's ``ParallelPlan``
(``DecoderLM.parallel_plan``), and what the parallel rules read of a model's config (``model_shapes``; the rules,
checked before any worker starts, are in ``lightning_npu.facts.parallel_rules``).

The plan is Megatron's layout in torch's ``parallelize_module`` styles:

- attention: q/k/v projections column-parallel (each rank computes ``n_heads / tp`` query heads and
  ``n_kv_heads / tp`` key/value heads), the output projection row-parallel;
- MLP: gate and up column-parallel, down row-parallel, so SwiGLU runs on each rank's own hidden slice;
- an MoE layer takes the whole tokens (gathered, as an MLP's input is) and gives them back as the residual stream
  holds them; its router runs on every rank alike, its shared expert splits like an MLP, and its routed experts
  are not split here: each tensor-parallel rank runs a share of their rows (``lightning_npu.parallel.expert``);
- Qwen3's per-head q/k norms replicated, on each rank's heads, their gains' gradients summed over the ranks;
- token embedding row-parallel (split by vocabulary), the output head column-parallel (split by vocabulary: with
  ``loss_parallel`` the logits stay split and the cross entropy runs on them, never gathering [tokens, vocab]);
- with ``sequence_parallel`` the norms and residuals between blocks are split by sequence: activations outside
  attention and the MLP are ``1 / tp`` the size, gathered before each and reduce-scattered after.

The model code knows nothing of this: the layers keep their shapes' meaning, and ``Attention`` reads its local
head count from the projections.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from lightning_npu.facts.parallel_rules import ModelShapes
from lightning_npu.parallel import ParallelPlan, PipelineLayout

#: How a ``CausalDecoder`` splits into pipeline stages: the embedding first, the blocks, the final norm and head last.
PIPELINE = PipelineLayout(module="", inputs=("tok_embeddings",), blocks="layers", outputs=("norm", "output"),
                          positions="position_ids")
#: The plan of one block's attention: ``(prefix, attention, sequence_parallel=...) -> {module name: ParallelStyle}``,
#: its modules named under ``prefix`` (``"layers.3.attention."``), ``wo`` (or what ends it) giving the residual
#: stream's layout. ``attention_plan`` below is the grouped-query attention's; DeepSeek's MLA has its own.
AttentionPlan = Callable[..., dict]


def model_shapes(config: Any, *, lora: bool = False) -> ModelShapes:
    """What the parallel rules (``lightning_npu.facts.parallel_rules``) read of a model of the recipe's ``config``
    (with LoRA adapters if ``lora``): its blocks and heads, the sizes this module's plan splits over the
    tensor-parallel ranks (heads, kv heads, vocabulary, the dense MLPs' widths), and the features a layout refuses."""
    sizes = [("n_heads", config.n_heads), ("n_kv_heads", config.n_kv_heads), ("vocab_size", config.vocab_size)]
    for width in ("ffn_hidden_dim", "dense_hidden_dim", "shared_expert_hidden_dim"):  # the dense MLPs' widths
        if getattr(config, width, None):
            sizes.append((width, getattr(config, width)))
    return ModelShapes(n_layers=config.n_layers, n_heads=config.n_heads, tensor_parallel_sizes=tuple(sizes),
                       tie_embeddings=bool(getattr(config, "tie_embeddings", False)),
                       mtp_layers=getattr(config, "mtp_layers", 0),
                       router_aux_loss_coef=getattr(config, "router_aux_loss_coef", 0), lora=lora)


def decoder_parallel_plan(model: nn.Module, attention: AttentionPlan | None = None) -> ParallelPlan:
    """The ``ParallelPlan`` of a ``CausalDecoder`` of the recipe: :func:`decoder_plan` for tensor parallelism (each
    block's attention by ``attention``, the grouped-query one's by default), the modules that take part in context
    parallelism, the experts, and its pipeline stages (``PIPELINE``)."""

    def tensor_parallel(tp_mesh: Any, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
        return decoder_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                            attention=attention or attention_plan)

    return ParallelPlan(tensor_parallel=tensor_parallel, context_parallel=tuple(model.context_parallel_modules()),
                        experts=tuple(model.expert_modules()), pipeline=PIPELINE)


def decoder_plan(model: nn.Module, *, prefix: str = "", sequence_parallel: bool, loss_parallel: bool,
                 attention: AttentionPlan | None = None) -> dict:
    """``parallelize_module``'s plan for a ``CausalDecoder`` of the recipe (module names under ``prefix``): blocks of
    pre-norm attention (``attention``'s plan, the grouped-query one's by default) and a dense (SwiGLU) or MoE MLP."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    attention = attention or attention_plan
    between_blocks = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    plan: dict[str, Any] = {}
    # A pipeline stage holds the embedding (first), the final norm and head (last) or neither, and some blocks.
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks)
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=between_blocks,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if sequence_parallel and model.norm is not None:
        plan["norm"] = SequenceParallel()
    for index, block in model.layers.named_children():
        layer = f"layers.{index}."
        feed_forward = getattr(block, "feed_forward", None)
        moe = feed_forward is not None and _is_moe(feed_forward)
        if not (hasattr(block, "attention") and hasattr(block, "attention_norm") and hasattr(block, "ffn_norm")
                and (moe or _is_dense_mlp(feed_forward))):
            raise TypeError(f"layers.{index} ({type(block).__name__}) is not a pre-norm block of attention and a dense"
                            " or MoE MLP; the recipe's tensor-parallel plan splits only those")
        plan.update(attention(layer + "attention.", block.attention, sequence_parallel=sequence_parallel))
        plan.update(_moe_plan(layer + "feed_forward.", feed_forward, sequence_parallel) if moe else {
            layer + "feed_forward.w_gate": ColwiseParallel(),
            layer + "feed_forward.w_up": ColwiseParallel(),
            layer + "feed_forward.w_down": RowwiseParallel(output_layouts=between_blocks),
        })
        if sequence_parallel:
            # Attention takes (x, cos, sin, cache, layer, start_pos, cu_seqlens): only x is gathered.
            gather_x = (Shard(1),) + (None,) * 6
            plan.update({
                layer + "attention_norm": SequenceParallel(),
                layer + "ffn_norm": SequenceParallel(),
                layer + "attention": PrepareModuleInput(input_layouts=gather_x,
                                                        desired_input_layouts=(Replicate(),) + (None,) * 6),
            })
            if not moe:
                plan[layer + "feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                                  desired_input_layouts=(Replicate(),))
    return {prefix + name: style for name, style in plan.items()}


def attention_plan(prefix: str, attention: nn.Module, *, sequence_parallel: bool) -> dict:
    """Grouped-query attention's entries: q/k/v column-parallel (whole heads per rank), o row-parallel; Qwen3's
    per-head q/k norms replicated, their gains' gradients summed over the ranks."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not all(hasattr(attention, name) for name in ("wq", "wk", "wv", "wo")):
        raise TypeError(f"{prefix.rstrip('.')} ({type(attention).__name__}) is not a grouped-query attention of"
                        " wq, wk, wv and wo")
    plan: dict[str, Any] = {
        prefix + "wq": ColwiseParallel(),
        prefix + "wk": ColwiseParallel(),
        prefix + "wv": ColwiseParallel(),
        prefix + "wo": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
    }
    if hasattr(attention, "q_norm"):
        # The per-head q/k norms (Qwen3) run on each rank's heads [rows, length, heads / tp, head_dim]: their gain
        # is replicated and its gradient, each rank's heads' part, summed over the ranks.
        for norm in ("q_norm", "k_norm"):
            plan[prefix + norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _is_dense_mlp(feed_forward: Any) -> bool:
    return all(hasattr(feed_forward, name) for name in ("w_gate", "w_up", "w_down"))


def _is_moe(feed_forward: nn.Module) -> bool:
    """Whether a block's MLP is an MoE layer (a router and its experts)."""
    return hasattr(feed_forward, "router") and hasattr(feed_forward, "experts")


def _moe_plan(prefix: str, moe: nn.Module, sequence_parallel: bool) -> dict:
    """An MoE layer's entries: the layer gets the whole tokens as plain tensors and gives back what the residual
    stream holds (this rank's part of the sequence under ``sequence_parallel``, else the whole), plain tensors as
    the attention's output is; the shared expert, if any, splits
    like a dense MLP (its output summed over the ranks); the router and the routed experts are left to run on every
    rank (the experts' rows are shared out by ``lightning_npu.parallel.expert``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel

    plan: dict[str, Any] = {}
    if sequence_parallel:
        plan[prefix.rstrip(".")] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))
    if hasattr(moe, "shared_expert"):
        plan.update({
            prefix + "shared_expert.w_gate": ColwiseParallel(),
            prefix + "shared_expert.w_up": ColwiseParallel(),
            prefix + "shared_expert.w_down": RowwiseParallel(),
        })
    return plan


__all__ = ["AttentionPlan", "attention_plan", "decoder_parallel_plan", "decoder_plan", "model_shapes"]
