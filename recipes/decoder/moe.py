"""The Mixture-of-Experts layers every family with MoE layers builds from (the MoE family's Mixtral, Qwen2-MoE and
Qwen3-MoE; DeepSeek's DeepSeekMoE): stacked ``Experts``, the ``MoEFeedForward`` MLP that routes tokens to them, and
``RoutedDecoder``, the trunk's additions for a model with such layers (router logits, auxiliary loss, balancing
bias, routing balance). The router and the routing rules are ``router.py``; ``EXPERT_LORA_SITES`` says where the
experts' LoRA targets sit.

Why here, in ``recipes/decoder/``, and not in a family's folder or a ``recipes/models/common/``: ``recipes/decoder/``
is already the one place for what several families share (the trunk of ``transformer.py`` these layers plug into,
``layers.py``, LoRA, the checkpoint layout, HF conversion); a second shared folder would give "where does shared
model code go" two answers. A family folder (``recipes/models/<family>/``) holds only what is that family's, and
imports ``recipes.decoder`` and ``lightning_npu``, never another family's folder (``tests/test_import_graph.py``).

The experts of a layer are stacked, one parameter per projection (``w_gate_up`` [E, 2F, dim], ``w_down``
[E, dim, F], Hugging Face 5's layout), so FSDP2 shards two large tensors per layer rather than 3 x E small ones,
and they run as two grouped matmuls over the tokens sorted by expert (``permute_tokens`` ->
``grouped_matmul`` -> ``unpermute_tokens``, fused on NPUs). The router is fp32 plain torch (``router.py``).
``Experts`` follows the experts contract of ``lightning_npu.parallel.protocol`` (``RoutedDecoder.expert_modules``
names them for the recipe's ``ParallelPlan``): under ``expert_parallel_size`` npu_fsdp splits each layer's experts
over ranks and moves the rows between them, under ``tensor_parallel_size`` each tensor-parallel rank runs a share of
the rows (``lightning_npu.parallel.expert``); this code stays as it is.

Parameter names of an MoE layer's ``feed_forward`` (a family's ``hf.py`` maps them to Hugging Face's)::

    router.weight                   [n_experts, dim]
    experts.w_gate_up               [n_experts, 2 * expert_hidden_dim, dim] (gate rows first)
    experts.w_down                  [n_experts, dim, expert_hidden_dim]
    shared_expert.w_gate.weight     [shared_expert_hidden_dim, dim]  (with one; w_up too)
    shared_expert.w_down.weight     [dim, shared_expert_hidden_dim]
    shared_expert_gate.weight       [1, dim]  (a gated shared expert: Qwen2-MoE)
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from lightning_npu import compat
from lightning_npu.kernels import grouped_matmul, permute_tokens, swiglu, unpermute_tokens
from lightning_npu.parallel.expert import local_experts
from lightning_npu.parallel.pipeline import inferring_shapes
from recipes.decoder.layers import INIT_STD, Linear
from recipes.decoder.router import Router, Routing, expert_load, load_balancing_loss
from recipes.decoder.transformer import CausalDecoder, FeedForward

#: Where the expert LoRA targets sit in a block whose ``feed_forward`` is an ``MoEFeedForward``
#: (``DecoderFamily.expert_lora_sites``): per-expert adapters on the stacked experts (not on a shared expert or a
#: dense layer's MLP).
EXPERT_LORA_SITES = {
    "expert_gate": ("feed_forward.experts", "w_gate_up", 0, 2),
    "expert_up": ("feed_forward.experts", "w_gate_up", 1, 2),
    "expert_down": ("feed_forward.experts", "w_down", 0, 1),
}


class Experts(nn.Module):
    """``n_experts`` SwiGLU MLPs in two stacked parameters, run over rows sorted by expert. Under expert
    parallelism npu_fsdp gives each rank a block of the experts and only their rows (``local_experts``).

    ``adapters`` maps a stacked weight's name to a module whose ``(rows, counts)`` output is added to that
    weight's (per-expert LoRA: ``recipes.decoder.lora.StackedLoRA``); empty unless LoRA targets the experts."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.w_down = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.adapters = nn.ModuleDict()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate_up, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.w_down, mean=0.0, std=INIT_STD)

    def forward(self, rows: Tensor, counts: Tensor) -> Tensor:
        """The experts' outputs [R, dim] for rows [R, dim] sorted by expert, ``counts[e]`` of them for expert e."""
        hidden = swiglu(self.project("w_gate_up", rows, counts))
        return self.project("w_down", hidden, counts)

    def project(self, name: str, rows: Tensor, counts: Tensor) -> Tensor:
        """Each row times its expert's matrix of the stacked weight ``name``, plus its adapters' update if any."""
        # [E, out, in] -> [E, in, out] views: grouped_matmul takes [E, K, N] (the fused op reads the view as is).
        out = grouped_matmul(rows, local_experts(getattr(self, name)).transpose(1, 2), counts)
        if name in self.adapters:
            out = out + self.adapters[name](rows, counts)
        return out


class MoEFeedForward(nn.Module):
    """An MoE MLP: the router picks each token's experts (``routing``: ``router.Routing``), their weighted sum is
    the output, plus the shared expert's output (width ``shared_hidden_dim``, none at 0), scaled by a sigmoid gate
    with ``shared_gate`` (Qwen2-MoE; DeepSeek's shared experts are ungated). ``balancing_bias``: the router keeps
    the bias ``route`` adds for the choice (``Router``). The last forward's router logits are kept in
    ``router_logits`` [tokens, n_experts] for the load-balancing loss (``RoutedDecoder.forward(output_router_logits=True)``)."""

    def __init__(self, dim: int, n_experts: int, hidden_dim: int, routing: Routing, *, shared_hidden_dim: int = 0,
                 shared_gate: bool = True, balancing_bias: bool = False) -> None:
        super().__init__()
        self.routing = routing
        self.n_experts = n_experts
        self.router = Router(dim, n_experts, balancing_bias=balancing_bias)
        self.experts = Experts(n_experts, dim, hidden_dim)
        if shared_hidden_dim:
            self.shared_expert = FeedForward(dim, shared_hidden_dim)
            if shared_gate:
                self.shared_expert_gate = Linear(dim, 1)
        self.router_logits: Optional[Tensor] = None
        #: Tokens routed to each expert [n_experts] by this rank's training forwards since ``take_routed``.
        self.routed: Optional[Tensor] = None

    def take_routed(self) -> Tensor:
        """The tokens per expert routed since the last call (zeros if none), and a fresh count."""
        routed = self.routed if self.routed is not None else self.router.weight.new_zeros(self.n_experts)
        self.routed = None
        return routed

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens)
        # Not when activation checkpointing recomputes this forward inside backward: the recomputed logits would
        # keep the block's recomputed graph, and its saved tensors, alive until the next forward; the recomputed
        # routing would count its tokens twice.
        recompute = compat.in_backward()
        if not recompute:
            self.router_logits = logits
        bias = getattr(self.router, "expert_bias", None)
        probs, expert_ids = self.routing(logits, bias)
        # The probs go in the tokens' dtype: the fused unpermute's backward gives NaN for mixed dtypes (moe-facts.md).
        permuted, counts, permutation = permute_tokens(tokens, expert_ids, probs.to(tokens.dtype), self.n_experts)
        # What the balancing bias moves by: tokens of training forwards (not a pipeline stage's shape inference).
        if bias is not None and self.training and not recompute and not inferring_shapes():
            self.routed = counts.detach() if self.routed is None else self.routed + counts.detach()
        out = unpermute_tokens(self.experts(permuted, counts), permutation)
        if hasattr(self, "shared_expert_gate"):
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        elif hasattr(self, "shared_expert"):
            out = out + self.shared_expert(tokens)
        return out.view_as(x)


class RoutedDecoder(CausalDecoder):
    """What a decoder with MoE layers adds to ``CausalDecoder``, for any family whose config has ``moe_layers``,
    ``routing`` (``router.Routing``), ``router_aux_loss_coef`` and ``router_bias_update_rate``, and whose MoE
    layers' ``feed_forward`` is an ``MoEFeedForward``: the router logits, the auxiliary loss, the balancing bias's
    update and the routing balance ``DecoderLM`` logs."""

    def _moe_layers(self) -> list[MoEFeedForward]:
        """This model's MoE layers, in order (under pipeline parallelism, those of this rank's stages)."""
        moe = set(self.config.moe_layers)
        return [block.feed_forward for index, block in self.layers.named_children() if int(index) in moe]

    def expert_modules(self) -> list[str]:
        """The names of every experts module (its MoE layers', multi-token prediction's too): what the recipe's
        ``ParallelPlan`` gives expert parallelism."""
        return [name for name, module in self.named_modules() if isinstance(module, Experts)]

    def forward(self, tokens: Tensor, *, output_router_logits: bool = False, **kwargs) -> Tensor | tuple:
        """``CausalDecoder.forward``'s logits; with ``output_router_logits``, ``(logits, router_logits)``: the
        router logits [batch * seq, n_experts] (fp32) of each MoE layer in order, as Hugging Face returns them."""
        logits = super().forward(tokens, **kwargs)
        if not output_router_logits:
            return logits
        return logits, tuple(layer.router_logits for layer in self._moe_layers())

    def auxiliary_loss(self, sum_over_ranks: Optional[Callable[[Tensor], Tensor]] = None) -> Tensor:
        """``router_aux_loss_coef`` x the load-balancing loss of the last forward's routing (what ``DecoderLM``
        adds to the cross-entropy, as transformers does with ``output_router_logits``); 0 when the coefficient is.
        ``sum_over_ranks``: counts the tokens of every rank whose tokens differ (``router.load_balancing_loss``);
        None: this rank's."""
        coef = self.config.router_aux_loss_coef
        if not coef:
            return self.no_loss()
        logits = [layer.router_logits for layer in self._moe_layers()]
        return coef * load_balancing_loss(logits, self.config.top_k, sum_over_ranks)

    def balance_experts(self, reduce: Callable[[Tensor], Tensor]) -> None:
        """After an optimizer step, with ``router_bias_update_rate``: move each MoE layer's balancing bias towards
        balance for the tokens routed since the last step, summed by ``reduce`` over the ranks whose tokens differ
        (data-parallel x context-parallel: the whole batch's counts, so the biases stay equal on every rank and
        move as without context parallelism). Without the rate, nothing."""
        rate = self.config.router_bias_update_rate
        if not rate:
            return
        layers = self._moe_layers()
        if not layers:  # a pipeline stage of dense layers (its data-parallel peers hold the same)
            return
        routed = reduce(torch.stack([layer.take_routed().float() for layer in layers]))
        for layer, counts in zip(layers, routed):
            layer.router.balance(counts, rate)

    def expert_load(self) -> Optional[Tensor]:
        """The last forward's routing balance (``router.expert_load``: max / mean tokens per expert, worst layer),
        which ``DecoderLM`` logs as ``expert_load``; None without MoE layers (a pipeline stage of dense ones)."""
        layers = self._moe_layers()
        if not layers:
            return None
        return expert_load([layer.router_logits for layer in layers], self.config.top_k,
                           [getattr(layer.router, "expert_bias", None) for layer in layers],
                           routing=self.config.routing)
