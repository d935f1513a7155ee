"""The recipe's LightningModule, for every model family (``family``, in ``recipes/families.py``): next-token loss,
AdamW without weight decay on norms and biases, linear warmup then cosine decay to a floor, optional initialisation
from Hugging Face weights, optional LoRA adapters.

The model is built in ``configure_model``, under ``npu_fsdp`` on the meta device: it is initialised shard by
shard (``reset_parameters``) after the strategy has sharded it, so no rank ever holds the full 7B model.

With ``lora`` the base weights are frozen and only the adapters train (``lora.py``). A LoRA checkpoint is small:
its ``state_dict`` holds the adapter weights only (``model.layers.N.attention.wq.lora_a.q.weight`` ...), next to
the optimizer state (adapters only), the LR schedule, the loop counters, the data position and the
hyper-parameters (``lora`` and ``init_from`` included). The base is never saved: it comes from ``init_from`` at
every start, fresh or resumed, which is why LoRA needs ``init_from``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from contextlib import nullcontext
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor

from lightning_npu import compat
from lightning_npu.facts import parallel_rules
from lightning_npu.facts.options import FSDPOptions
from lightning_npu.facts.parallel_rules import ModelShapes
from lightning_npu.optim import AdamW8bit
from lightning_npu.parallel import ParallelPlan
from lightning_npu.parallel.tensor import local_tensor
from recipes import families
from recipes.decoder.transformer import positions_in_samples
from recipes.decoder.lora import (
    LoRAConfig,
    active_adapter_params,
    adapter_shapes,
    add_lora,
    check_adapter_state,
    is_adapter_name,
)
from recipes.decoder.pretrained import load_pretrained
from recipes.decoder.tensor_parallel import model_shapes


#: The recipe's ``model.optimizer`` choices.
OPTIMIZERS = ("adamw", "adamw8bit")


class DecoderLM(LightningModule):
    """A causal decoder language model of one of the recipe's model families.

    Args:
        family: the model family (``recipes/families.py``: ``llama`` for LLaMA-2 and LLaMA-3), whose config class,
            presets and model this builds; recorded in checkpoints.
        preset: named architecture of the family (LLaMA: ``tiny``, ``7b``, ``13b``, ``config.LLAMA3_PRESETS``).
        config: fields of the family's config that override the preset (e.g. ``{max_seq_len: 2048}``).
        learning_rate: peak learning rate after warmup.
        min_lr_ratio: the cosine decay's floor as a fraction of ``learning_rate``.
        warmup_steps: optimizer steps of linear warmup from 0.
        weight_decay: AdamW decay for matrices; norms and biases get none.
        betas, eps: AdamW moments.
        init_from: a local Hugging Face directory or a recipe checkpoint of the family to start from (fine-tuning).
        tokenizer_path: recorded in checkpoints so generation finds the tokenizer.
        lora: ``{rank, alpha, dropout, targets, base_quantization}`` (see ``lora.LoRAConfig``) to train LoRA
            adapters on a frozen base loaded from ``init_from`` (stored int8 or NF4 with ``base_quantization``);
            None trains every weight.
        optimizer: ``adamw`` (torch's, fp32 moments: 8 bytes of state per parameter) or ``adamw8bit``
            (``lightning_npu.optim.AdamW8bit``: 8-bit moments, about 2.03 bytes).
    """

    #: Set by npu_fsdp under context parallelism (``lightning_npu.parallel.context.ContextParallel``).
    context_parallel = None

    def __init__(
        self,
        family: str = families.DEFAULT_FAMILY,
        preset: str = "tiny",
        config: Optional[dict[str, Any]] = None,
        learning_rate: float = 3e-4,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 100,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        init_from: Optional[str] = None,
        tokenizer_path: Optional[str] = None,
        lora: Optional[dict[str, Any]] = None,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is not one of {', '.join(OPTIMIZERS)}: 'adamw' keeps fp32"
                             " moments, 'adamw8bit' 8-bit ones (lightning_npu.optim.AdamW8bit)")
        self.family = families.get(family)
        self.config = self.family.config_class.from_preset(preset, **(config or {}))
        self.lora = LoRAConfig.from_value(lora)
        if self.lora is not None and not init_from:
            raise ValueError(
                f"model.lora={self.lora.to_dict()} needs model.init_from, but init_from={init_from!r}: a LoRA run "
                "trains adapters on a frozen base, and its checkpoints hold the adapters only, so the base weights "
                "must come from init_from at every start, a resume included. Pass --model.init_from with the base "
                "(a Hugging Face directory or a recipe checkpoint), the same one the run started from."
            )
        if self.lora is not None:  # builds the adapted model on the meta device: a weight nf4 cannot pack fails here
            adapter_shapes(self.config, self.lora)
        if init_from:  # recorded absolute, so a LoRA checkpoint finds its base from any working directory
            init_from = os.path.abspath(init_from)
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={min_lr_ratio!r} must lie in [0, 1]: the LR floor as a fraction of the peak")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be >= 0")
        self.save_hyperparameters()
        # The full architecture, so checkpoints are self-describing whatever the preset table becomes.
        self.hparams["config"] = self.config.to_dict()
        self.hparams["lora"] = None if self.lora is None else self.lora.to_dict()
        self.model: Optional[torch.nn.Module] = None
        self._initial_weights_loaded = False
        self._state_restored = False  # set by on_load_checkpoint: the weights (a LoRA run's adapters) are a checkpoint's
        self._step_before_batch = 0  # the optimizer steps taken before the current training batch
        self._pipelined = False  # set by configure_model: npu_fsdp splits the model into pipeline stages

    def configure_model(self) -> None:
        trainer = compat.attached_trainer(self)
        options = getattr(trainer.strategy, "options", None) if trainer is not None else None
        self._pipelined = isinstance(options, FSDPOptions) and options.pipeline_parallel_size > 1
        if isinstance(options, FSDPOptions):
            # train.py checks these before workers start; a script building the module itself gets them here, on every
            # rank alike, before the split (where the load-balancing loss would fail in a second backward).
            parallel_rules.check(options, self.parallel_shapes())
        if self.model is None:
            with torch.device("meta") if _shards_parameters(self) else nullcontext():
                self.model = self.family.model_class(self.config)
                if self.lora is not None:
                    add_lora(self.model, self.lora)  # before the strategy wraps it: FSDP2 copies requires_grad

    def parallel_shapes(self) -> ModelShapes:
        """What the parallel rules read of this model (``lightning_npu.facts.parallel_rules``)."""
        return model_shapes(self.config, lora=self.lora is not None)

    def parallel_plan(self) -> ParallelPlan:
        """How the model splits over ranks under ``npu_fsdp`` (``lightning_npu.parallel.protocol``): the model's own
        plan (``CausalDecoder.parallel_plan``; ``train.py`` checks the model against the sizes first), and this
        module takes part in context parallelism too (it shards the batch)."""
        plan = self.model.parallel_plan().under("model")
        return dataclasses.replace(plan, context_parallel=("", *plan.context_parallel))

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token at the configured context length (the family config's flops_per_token, which
        counts the weights a token runs through: an MoE model's top-k and shared experts, not all of them). With
        LoRA the frozen weights' matmuls run forward and for the input gradients only (4 FLOPs per weight, not 6: no
        weight gradient), the adapters' all three."""
        seq_len = getattr(getattr(self.trainer, "datamodule", None), "seq_len", None) if compat.attached_trainer(self) else None
        flops = self.config.flops_per_token(seq_len)
        if self.lora is not None:
            adapters = active_adapter_params(self.config, self.lora)
            # The count's weight part at no context (6 per weight a token runs through: the active experts, an MTP
            # depth's extra pass through the shared head) is what freezing takes 2 of.
            frozen = self.config.flops_per_token(0) // 6
            flops += 6 * adapters - 2 * frozen
        return flops

    def forward(self, input_ids: Tensor) -> Tensor:
        """The logits [batch, seq, vocab] of ``input_ids`` [batch, seq] (a ``predict_step``'s call). Under context
        parallelism each rank runs its part of every sequence and the logits are gathered whole on every rank (the
        model called directly takes and gives this rank's part)."""
        cp = self.context_parallel
        if cp is None:
            return self.model(input_ids)
        logits = self.model(cp.shard(input_ids), position_ids=cp.shard(_positions(input_ids, None)))
        return cp.gather(logits.full_tensor() if hasattr(logits, "full_tensor") else logits)  # vocabulary-split: whole

    def _loss(self, batch: dict[str, Any]) -> Tensor:
        """Mean cross-entropy over the labelled tokens (-100 marks the others: prompts and padding in SFT rows), plus
        the model's ``auxiliary_loss(sum_over_data)`` of that forward (over the tokens of every rank whose tokens
        differ: ``_sum_over_data``) and its ``multi_token_loss(labels)`` if its family defines them.
        Packed rows (``cu_seqlens``, ``position_ids``: ``sft_data.collate_packed``) attend within each sample.
        Under context parallelism each rank computes its share on its part of every sequence (the strategy averages
        the shares: the mean over all labelled tokens however many each part holds)."""
        cp = self.context_parallel
        if cp is not None:
            batch = self._sequence_shard(batch)
        packing = {"cu_seqlens": batch.get("cu_seqlens"), "position_ids": batch.get("position_ids")}
        if cp is None or self._pipelined:
            # The model's own loss: under pipeline parallelism only its last stage sees the logits, and with context
            # parallelism the pipeline gives this rank's share of the mean, as token_mean does below.
            loss = local_tensor(self.model(batch["input_ids"], labels=batch["labels"], **packing))
        else:
            logits = self.model(batch["input_ids"], **packing)
            labels = batch["labels"]
            loss = cp.token_mean(local_tensor(self.model.loss(logits, labels, reduction="sum")), (labels != -100).sum())
        auxiliary = getattr(self.model, "auxiliary_loss", None)  # a family's extra training term (MoE: load balance)
        if auxiliary is not None:
            loss = loss + auxiliary(self._sum_over_data)
        ahead = getattr(self.model, "multi_token_loss", None)  # a family's multi-token prediction (DeepSeek-V3 MTP)
        return loss if ahead is None else loss + ahead(batch["labels"])

    def _sequence_shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This context-parallel rank's part of each sequence of ``batch`` (ids, labels, positions: the batch's, or
        made here for the whole sequences; the sample boundaries ``cu_seqlens`` stay the whole batch's)."""
        by_sequence = ("input_ids", "labels", "position_ids")
        if batch.get("position_ids") is None:
            batch = {**batch, "position_ids": _positions(batch["input_ids"], batch.get("cu_seqlens"))}
        return {key: self.context_parallel.shard(value) if key in by_sequence else value
                for key, value in batch.items()}

    def _sum_over_data(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over the ranks whose tokens differ, the group the strategy reduces a logged value over
        (npu_fsdp: every rank, or ``dp x cp`` with tensor parallelism, whose ranks hold the same tokens); a
        collective. ``tensor`` itself outside a Trainer."""
        if compat.attached_trainer(self) is None:
            return tensor
        return self.trainer.strategy.reduce(tensor, reduce_op="sum")

    def _logged_loss(self, loss: Tensor) -> Tensor:
        """What ``train_loss`` logs: the loss of this data-parallel rank's whole sequences, as without context
        parallelism. Under it ``loss`` is this rank's share (``token_mean``: the cross-entropy's token weighting is
        in it; the MoE load-balancing loss is the group's, the same on each rank), and their mean over the
        context-parallel group is that loss. The mean is a collective, so it is taken only at the steps the Trainer
        writes to its loggers (``log_every_n_steps``, the same on every rank); at the others ``train_loss`` holds
        the share (``trainer.callback_metrics`` too)."""
        cp = self.context_parallel
        if cp is None or not compat.logs_this_step(self.trainer):
            return loss
        return self.trainer.strategy.reduce(loss.detach().clone(), group=cp.group, reduce_op="mean")

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        # Not on the progress bar: Lightning turns progress-bar values into Python numbers every step, a host sync
        # that stalls the NPU; TokenThroughputMonitor prints the loss at logging steps.
        self.log("train_loss", self._logged_loss(loss))
        expert_load = getattr(self.model, "expert_load", None)  # an MoE family's routing balance (max / mean)
        if expert_load is not None and (load := expert_load()) is not None:
            self.log("expert_load", load)  # a device tensor, written at logging steps as train_loss is
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_before_batch = self.trainer.global_step

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # After a batch that ended with an optimizer step (not between the micro-batches it accumulates, nor between
        # a forward and the recompute of its checkpointed blocks): an MoE family's auxiliary-loss-free balancing bias
        # moves, by the tokens every data-parallel and context-parallel rank routed.
        balance = getattr(self.model, "balance_experts", None)
        if balance is not None and self.trainer.global_step > self._step_before_batch:
            balance(self._sum_over_data)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def on_fit_start(self) -> None:
        self._load_initial_weights()

    def on_validation_start(self) -> None:
        self._load_initial_weights()

    def on_predict_start(self) -> None:
        self._load_initial_weights()

    def _load_initial_weights(self) -> None:
        """Once, when the module first runs (``fit``, ``validate`` or ``predict``, after the strategy has set it up
        and restored any checkpoint): the weights ``init_from`` gives. A LoRA model always needs its base from there,
        since its checkpoints hold the adapters only; a full model only when no checkpoint was restored, neither by the
        trainer (``ckpt_path``) nor into the module itself (``DecoderLM.load_from_checkpoint``)."""
        if self._initial_weights_loaded:
            return
        self._initial_weights_loaded = True
        fresh = self.trainer.ckpt_path is None and not self._state_restored
        if self.lora is not None:
            # A LoRA checkpoint holds no base weights: they come from init_from on a resume too. A fresh run also
            # gets its first adapters here, drawn from the seed alone (identical under every strategy).
            load_pretrained(self.model, self.hparams.init_from, self.config, lora=self.lora, fresh_adapters=fresh)
        elif self.hparams.init_from and fresh:  # a resumed full fine-tune restores its own weights
            load_pretrained(self.model, self.hparams.init_from, self.config)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Not in load_state_dict: strategies call that for other reasons (npu_fsdp hands out the first weights).
        self._state_restored = True

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The module's state; with LoRA only the adapters' (the frozen base comes from ``init_from``)."""
        state = super().state_dict(*args, **kwargs)
        if self.lora is not None:
            for name in [name for name in state if not is_adapter_name(name)]:
                del state[name]
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """With LoRA, ``state_dict`` holds the adapters only (a LoRA checkpoint): with ``strict`` it must hold
        exactly this run's adapters; the base weights are left alone."""
        if self.lora is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        if strict:  # the adapters this model holds: under pipeline parallelism, its stages'
            held = None if self.model is None else {name for name, _ in self.model.named_parameters()}
            check_adapter_state(_without_prefix(state_dict, "model."), self.config, self.lora,
                                source="The checkpoint being resumed", held=held)
        return super().load_state_dict(state_dict, strict=False, assign=assign)

    def configure_optimizers(self) -> dict[str, Any]:
        decay, no_decay = [], []
        for param in self.model.parameters():
            if not param.requires_grad:  # the frozen base of a LoRA run: no gradients, no optimizer state
                continue
            # Matrices (linear and embedding weights) decay; norm gains and biases (vectors) do not.
            (decay if param.ndim >= 2 else no_decay).append(param)
        # One fused kernel per step where the runtime backs it (NPUs: torch_npu's _fused_adamw_, which also runs on
        # FSDP2's DTensor shards); torch's default (foreach) elsewhere, the CPU simulation included. fp16 with
        # clipping stays unfused: a fused step unscales internally, too late for the clip to see true gradients.
        from lightning_npu.accelerator import NPUAccelerator

        accelerator = self.trainer.accelerator
        fused = isinstance(accelerator, NPUAccelerator) and accelerator.runtime.fused_optimizer
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None and self.trainer.gradient_clip_val:
            fused = False
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        hyper = dict(lr=self.hparams.learning_rate, betas=tuple(self.hparams.betas), eps=self.hparams.eps)
        if self.hparams.get("optimizer", "adamw") == "adamw8bit":  # older checkpoints' hparams have no optimizer
            optimizer = AdamW8bit(groups, **hyper)
        else:
            optimizer = torch.optim.AdamW(groups, **hyper, fused=True if fused else None)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        schedule = warmup_cosine(self.hparams.warmup_steps, total, self.hparams.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _positions(input_ids: Tensor, cu_seqlens: Any) -> Tensor:
    """Each token's position in its row [batch, seq], or with the packed rows' boundaries ``cu_seqlens`` in its
    sample."""
    if cu_seqlens is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
    return positions_in_samples(bounds, device=input_ids.device).view_as(input_ids)


def _shards_parameters(module: LightningModule) -> bool:
    """Whether the module is being set up by a strategy that shards parameters (FSDP2) and so initialises
    modules built on the meta device itself."""
    return compat.attached_trainer(module) is not None and isinstance(module.trainer.strategy, ModelParallelStrategy)


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float):
    """LR multiplier: linear from 0 to 1 over ``warmup_steps``, then cosine from 1 down to ``min_ratio`` at
    ``total_steps``, and ``min_ratio`` after."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


def _without_prefix(state_dict: Any, prefix: str) -> dict[str, Any]:
    return {key[len(prefix):] if key.startswith(prefix) else key: value for key, value in state_dict.items()}
