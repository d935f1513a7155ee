"""DPO as a LightningModule of the decoder recipes (every family): ``DPOLM`` is a ``DecoderLM`` (its model, LoRA,
``init_from``, optimizer, LR schedule and checkpoints, unchanged) whose step is TRL 1.16's DPO step
(``DPOTrainer._compute_loss`` with ``loss_type`` one of ``dpo_loss.LOSS_TYPES``, plus TRL's ``sft`` term with
``sft_weight``) on ``preference_data.PreferenceDataModule``'s batches.

A subclass, not a wrapper: DPO changes the step only, and every hook of ``DecoderLM`` (the model built on the meta
device and sharded by ``npu_fsdp``, the initial weights, the LoRA-only checkpoint) holds for it as it is.

The reference (``reference``: ``auto``, ``adapters_off`` under LoRA, ``copy`` otherwise) is
``reference.ReferencedLM``'s, which GRPO's KL term shares.

Per step, on a batch of B pairs (2B sequences: chosen, then rejected): the policy's and the reference's log-probs of
the completion tokens, summed per sequence; the pair losses' mean (``pair_losses``), plus ``sft_weight`` x the mean
negative log-prob of the chosen completions' tokens. Logged, under TRL's names and meaning (means over every
data-parallel rank's pairs, taken at the Trainer's logging steps): ``train_loss``, ``rewards/chosen``,
``rewards/rejected`` (beta x log-ratio), ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``,
``logps/rejected``.

Pipeline and context parallelism are refused before workers start: a pipeline stage would need the reference's
stages beside its own, and a context-parallel rank holds part of each completion, whose log-probs DPO sums whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from lightning_npu import compat
from lightning_npu.facts.parallel_rules import ModelShapes
from recipes.posttrain.dpo_loss import check_loss_type, pair_losses
from recipes.posttrain.logprobs import token_logprobs
from recipes.posttrain.reference import ReferencedLM

#: What the step logs, in TRL's names, after ``train_loss``.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


class DPOLM(ReferencedLM):
    """A decoder LM trained by DPO against a frozen reference (see the module docstring).

    Args:
        beta: the DPO temperature (TRL's ``beta``): the scale of the log-ratio margin.
        loss_type: ``sigmoid`` (DPO), ``ipo`` or ``hinge`` (``dpo_loss.LOSS_TYPES``).
        sft_weight: weight of an SFT term on the chosen completions (TRL's ``loss_type=[..., "sft"]``,
            ``loss_weights=[1, sft_weight]``: RPO); 0 adds none.
        reference: ``auto``, ``adapters_off`` (needs ``lora``) or ``copy`` (``reference.REFERENCES``).
        **kwargs: ``DecoderLM``'s arguments (family, preset, init_from, lora, learning_rate, ...).
    """

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", sft_weight: float = 0.0,
                 reference: str = "auto", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_loss_type(loss_type, beta)
        if sft_weight < 0:
            raise ValueError(f"sft_weight={sft_weight!r} must be >= 0: the weight of the SFT term (0: none)")
        self.use_reference(reference)

    def parallel_shapes(self) -> ModelShapes:
        """The model's shapes, and the layouts DPO's loss cannot run (``train.py`` and every rank refuse them)."""
        return dataclasses.replace(
            super().parallel_shapes(),
            pipeline_refusals=("DPO scores every sequence with the policy and the reference, which a pipeline would"
                               " have to split and schedule side by side; train DPO with data, tensor or sharded"
                               " parallelism",),
            context_parallel_refusals=("DPO sums each completion's log-probs whole, and a context-parallel rank holds"
                                       " only part of every sequence; train DPO with data, tensor or sharded"
                                       " parallelism",))

    # ------------------------------------------------------------------------------------------ the step
    def _dpo(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The loss of ``batch`` and the metrics' values (``METRICS``' order) of this rank's pairs."""
        input_ids, completion = batch["input_ids"], batch["completion_mask"]
        labels = input_ids.masked_fill(completion == 0, -100)[:, 1:]
        policy = token_logprobs(_whole(self.model(input_ids))[:, :-1], labels)
        with torch.no_grad(), self.reference_model() as reference:
            reference_logps = token_logprobs(_whole(reference(input_ids))[:, :-1], labels).sum(1)
        logps = policy.sum(1)
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = reference_logps.chunk(2)
        chosen_tokens, rejected_tokens = completion.sum(1).chunk(2)
        hp = self.hparams
        loss = pair_losses(hp.loss_type, hp.beta, chosen - ref_chosen, rejected - ref_rejected,
                           chosen_tokens, rejected_tokens).mean()
        if hp.sft_weight:
            chosen_labels = labels.chunk(2)[0] != -100
            loss = loss + hp.sft_weight * -policy.chunk(2)[0][chosen_labels].mean()
        with torch.no_grad():
            chosen_rewards = hp.beta * (chosen - ref_chosen)
            rejected_rewards = hp.beta * (rejected - ref_rejected)
            metrics = torch.stack([chosen_rewards.mean(), rejected_rewards.mean(),
                                   (chosen_rewards - rejected_rewards).mean(),
                                   (chosen_rewards > rejected_rewards).float().mean(), chosen.mean(), rejected.mean()])
        return loss, metrics

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, metrics = self._dpo(batch)
        # Means over the data-parallel ranks, a collective taken only at the steps the Trainer writes its loggers
        # (the same on every rank), as TRL gathers its metrics; a device tensor, no host sync.
        values = torch.cat([loss.detach().reshape(1), metrics])
        if compat.logs_this_step(self.trainer):
            values = self.trainer.strategy.reduce(values, reduce_op="mean")
        for name, value in zip(("train_loss", *METRICS), values):
            self.log(name, value)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, metrics = self._dpo(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        for name, value in zip(METRICS, metrics):
            self.log(f"val_{name}", value, sync_dist=True)


def _whole(logits: Tensor) -> Tensor:
    """Logits whole on this rank (tensor parallelism's vocabulary split gathered)."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits
