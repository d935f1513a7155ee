"""DPO as a LightningModule of the decoder recipes (every family): ``DPOLM`` is a ``DecoderLM`` (its model, LoRA,
``init_from``, optimizer, LR schedule and checkpoints, unchanged) whose step is TRL 1.16's DPO step
(``DPOTrainer._compute_loss`` with ``loss_type`` one of ``dpo_loss.LOSS_TYPES``, plus TRL's ``sft`` term with
``sft_weight``) on ``preference_data.PreferenceDataModule``'s batches.

A subclass, not a wrapper: DPO changes the step only, and every hook of ``DecoderLM`` (the model built on the meta
device and sharded by ``npu_fsdp``, the initial weights, the LoRA-only checkpoint) holds for it as it is.

The reference (``reference``; ``auto`` picks the first that applies):
  * ``adapters_off`` (LoRA): the policy itself with its adapters switched off, which is the frozen base: no second
    model, no second copy of the weights;
  * ``copy``: a frozen second model of the same family, built beside the policy in ``configure_model`` (so
    ``npu_fsdp`` shards it by the same policy, over the same mesh, and no optimizer ever sees it), given the policy's
    first weights when the fit starts (``init_from``'s, or the seed's) and saved in checkpoints (a resume restores it
    as it was). It costs one more model's weights (sharded) and one forward per step.

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
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_npu import compat
from lightning_npu.facts.parallel_rules import ModelShapes
from recipes.decoder.lora import LoRALinear, StackedLoRA
from recipes.decoder.module import DecoderLM, _shards_parameters
from recipes.posttrain.dpo_loss import check_loss_type, pair_losses
from recipes.posttrain.logprobs import token_logprobs

#: ``reference`` choices (see the module docstring).
REFERENCES = ("auto", "adapters_off", "copy")
#: What the step logs, in TRL's names, after ``train_loss``.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


class DPOLM(DecoderLM):
    """A decoder LM trained by DPO against a frozen reference (see the module docstring).

    Args:
        beta: the DPO temperature (TRL's ``beta``): the scale of the log-ratio margin.
        loss_type: ``sigmoid`` (DPO), ``ipo`` or ``hinge`` (``dpo_loss.LOSS_TYPES``).
        sft_weight: weight of an SFT term on the chosen completions (TRL's ``loss_type=[..., "sft"]``,
            ``loss_weights=[1, sft_weight]``: RPO); 0 adds none.
        reference: ``auto``, ``adapters_off`` (needs ``lora``) or ``copy``.
        **kwargs: ``DecoderLM``'s arguments (family, preset, init_from, lora, learning_rate, ...).
    """

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", sft_weight: float = 0.0,
                 reference: str = "auto", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_loss_type(loss_type, beta)
        if sft_weight < 0:
            raise ValueError(f"sft_weight={sft_weight!r} must be >= 0: the weight of the SFT term (0: none)")
        if reference not in REFERENCES:
            raise ValueError(f"reference={reference!r} is not one of {', '.join(REFERENCES)}")
        if reference == "adapters_off" and self.lora is None:
            raise ValueError("reference='adapters_off' needs model.lora: without adapters the policy is not its own"
                             " reference; use reference='copy' (or 'auto')")
        if reference == "auto":
            reference = "adapters_off" if self.lora is not None else "copy"
        self.reference_kind = reference
        self.reference: Optional[nn.Module] = None

    def configure_model(self) -> None:
        super().configure_model()
        if self.reference_kind == "copy" and self.reference is None:
            # Built here, beside the policy, so the strategy shards and places it as it does the policy.
            with torch.device("meta") if _shards_parameters(self) else nullcontext():
                self.reference = self.family.model_class(self.config)
            self.reference.requires_grad_(False)

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

    def on_fit_start(self) -> None:
        super().on_fit_start()
        fresh = self.trainer.ckpt_path is None and not self._state_restored
        if self.reference is not None and fresh:  # a resumed run restores the reference from its checkpoint
            with torch.no_grad():
                for ref, policy in zip(self.reference.parameters(), self.model.parameters(), strict=True):
                    ref.copy_(policy)
        if self.reference is not None:
            self.reference.eval()

    # ------------------------------------------------------------------------------------------ the step
    def _dpo(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The loss of ``batch`` and the metrics' values (``METRICS``' order) of this rank's pairs."""
        input_ids, completion = batch["input_ids"], batch["completion_mask"]
        labels = input_ids.masked_fill(completion == 0, -100)[:, 1:]
        policy = token_logprobs(_whole(self.model(input_ids))[:, :-1], labels)
        with torch.no_grad(), self._reference_model() as reference:
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

    @contextmanager
    def _reference_model(self) -> Iterator[nn.Module]:
        if self.reference is not None:
            yield self.reference
            return
        with adapters_off(self.model):
            yield self.model

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


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """``model``'s LoRA adapters switched off (their scaling 0: each adapted layer gives its base's output exactly)
    inside the block, on again after it."""
    adapted = [module for module in model.modules() if isinstance(module, (LoRALinear, StackedLoRA))]
    scalings = [module.scaling for module in adapted]
    for module in adapted:
        module.scaling = 0.0
    try:
        yield
    finally:
        for module, scaling in zip(adapted, scalings):
            module.scaling = scaling


def _whole(logits: Tensor) -> Tensor:
    """Logits whole on this rank (tensor parallelism's vocabulary split gathered)."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits
