"""How DeepSeek's Multi-head Latent Attention (``model.MLAttention``) splits over tensor-parallel ranks, in torch's
``parallelize_module`` styles (the model code knows nothing of it):

- the up-projections split by heads, column-parallel: ``wq`` (``q_lora_rank`` None) or ``wq_b``, and ``wkv_b``,
  whose output rows are head-major (n_heads x (qk_nope_head_dim + v_head_dim)), so a contiguous split gives each
  rank n_heads / tp whole heads; ``wo`` row-parallel, as in the dense plan;
- the low-rank down-projections and their norms (``wq_a``, ``q_norm``, ``wkv_a``, ``kv_norm``) replicated: each rank
  computes them whole on the block input (gathered first under sequence parallelism), their parameters plain
  tensors that data parallelism shards like any other;
- the shared rotary key, the last ``qk_rope_head_dim`` channels of ``wkv_a``'s output, feeds every head, so each rank
  uses it for its own heads only and its gradient there is that rank's share: :class:`ReplicatedParallel` sums that
  slice's gradient over the ranks before it reaches ``wkv_a``. The latent's gradient needs no sum: ``wkv_b``'s column
  split already all-reduces the gradient of its input.

The block around the attention keeps the dense plan (``recipes/decoder/tensor_parallel.py``): with
``sequence_parallel`` the norms are ``SequenceParallel`` and ``PrepareModuleInput`` gathers the attention's input;
``wo`` returns the residual stream's layout.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from lightning_npu.parallel.tensor import ReplicatedParallel


def mla_attention_plan(prefix: str, attention: nn.Module, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """``parallelize_module``'s plan for the ``MLAttention`` ``attention``, its modules named under ``prefix`` (e.g.
    ``"layers.3.attention."``): ``wo``'s output is the residual stream's layout (split by sequence with
    ``sequence_parallel``, else replicated). The attention's input must come replicated: gathered by the block
    plan's ``PrepareModuleInput`` under ``sequence_parallel``, a plain tensor otherwise. (That the heads divide by
    the tensor-parallel size is checked with the config, before workers start: ``n_heads`` in
    ``lightning_npu.facts.parallel_rules.tensor_parallel_problems``.)"""
    if not all(hasattr(attention, name) for name in ("wkv_a", "kv_norm", "wkv_b", "wo", "kv_rank", "rope")):
        raise TypeError(f"{prefix or 'the module'} ({type(attention).__name__}) is not an MLAttention")
    plan: dict[str, ParallelStyle] = {}
    if hasattr(attention, "wq"):
        plan["wq"] = ColwiseParallel()
    else:
        plan.update(wq_a=ReplicatedParallel(), q_norm=ReplicatedParallel(), wq_b=ColwiseParallel())
    rotary_key = slice(attention.kv_rank, attention.kv_rank + attention.rope)  # wkv_a's output: [latent; k_rot]
    plan.update(
        wkv_a=ReplicatedParallel(partial_grad_channels=rotary_key),
        kv_norm=ReplicatedParallel(),
        wkv_b=ColwiseParallel(),
        wo=RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
    )
    return {prefix + name: style for name, style in plan.items()}


__all__ = ["mla_attention_plan"]
