"""DPO as a LightningModule of the decoder recipes (every family): ``DPOLM`` is a ``DecoderLM`` (its model, LoRA,
``init_from``, optimizer, LR schedule and checkpoints, unchanged) whose step is TRL 1.16's DPO step
(``DPOTrainer._compute_loss`` with ``loss_type`` one of ``dpo_loss.LOSS_TYPES``, plus TRL's ``sft`` term with
``sft_weight``) on ``preference_data.PreferenceDataModule``'s batches.

A subclass, not a wrapper: DPO changes the step only, and every hook of ``DecoderLM`` (the model built on the meta
device and sharded by ``npu_fsdp``, the initial weights, the LoRA-only checkpoint) holds for it as it is.

The reference (``reference``: ``auto``, ``adapters_off`` under LoRA, ``copy`` otherwise) is
``reference.ReferencedLM``'s, which GRPO's KL term shares. With ``precompute_reference`` (TRL's
``precompute_ref_log_probs``) there is none during training: when the fit starts, the policy (its first weights, the
adapters off) scores every training and validation row once, each rank a share, and the steps read those log-probs
by row (kept in checkpoints); no copy, no reference forward per step.

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
from recipes.posttrain.reference import ReferencedLM, adapters_off

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
        precompute_reference: score every row with the reference once when the fit starts, instead of per step.
        **kwargs: ``DecoderLM``'s arguments (family, preset, init_from, lora, learning_rate, ...).
    """

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", sft_weight: float = 0.0,
                 reference: str = "auto", precompute_reference: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_loss_type(loss_type, beta)
        if sft_weight < 0:
            raise ValueError(f"sft_weight={sft_weight!r} must be >= 0: the weight of the SFT term (0: none)")
        self.use_reference(reference)
        if precompute_reference:  # the fit's first weights are the reference: scored once, then no model is kept
            self.use_reference(None)
        #: The precomputed reference log-probs by split (``train``, ``val``): [rows, 2], chosen's and rejected's.
        self.reference_logps: dict[str, Tensor] = {}

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
        if self.hparams.get("precompute_reference") and not self.reference_logps:  # a resume restores them
            data = self.trainer.datamodule
            for split, dataset in (("train", data.train_dataset), ("val", data.val_dataset)):
                if dataset is not None:
                    self.reference_logps[split] = self._score_rows(dataset, data.collate_fn, data.batch_size)

    def _score_rows(self, dataset: Any, collate: Any, batch_size: int) -> Tensor:
        """The reference's summed log-probs [rows, 2] of every row of ``dataset``: each rank scores every
        world-th row, in the same number of batches on every rank (a sharded forward is a collective), and the
        ranks' shares are gathered."""
        rank, world = self.global_rank, self.trainer.world_size
        mine = list(range(rank, len(dataset), world))
        batches = -(-len(range(0, len(dataset), world)) // batch_size)
        values, indices = [], []
        with torch.no_grad(), adapters_off(self.model):
            for start in range(0, batches * batch_size, batch_size):
                rows = mine[start:start + batch_size]
                batch = collate([dataset[i] for i in rows or [0]])  # a rank out of rows scores row 0, then drops it
                # Through the module itself: under npu_fsdp its call gathers the root unit, as a training step's does.
                values.append(torch.stack(self._summed_logps(self, batch).chunk(2), dim=1))
                indices.append(torch.tensor(rows or [-1], device=self.device))
        local_values, local_indices = torch.cat(values), torch.cat(indices)
        count = torch.tensor([local_values.shape[0]], device=self.device)
        longest = int(self.trainer.strategy.all_gather(count).max())
        pad = longest - local_values.shape[0]
        local_values = torch.nn.functional.pad(local_values, (0, 0, 0, pad))
        local_indices = torch.nn.functional.pad(local_indices, (0, pad), value=-1)
        all_values = self.trainer.strategy.all_gather(local_values).reshape(-1, 2)
        all_indices = self.trainer.strategy.all_gather(local_indices).reshape(-1)
        table = torch.zeros(len(dataset), 2, device=self.device)
        kept = all_indices >= 0
        table[all_indices[kept]] = all_values[kept].float()
        return table

    def _summed_logps(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
        """``model``'s log-probs of each sequence's completion tokens, summed [2B]."""
        input_ids, completion = batch["input_ids"].to(self.device), batch["completion_mask"].to(self.device)
        labels = input_ids.masked_fill(completion == 0, -100)[:, 1:]
        return token_logprobs(_whole(model(input_ids))[:, :-1], labels).sum(1)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.reference_logps:
            checkpoint["dpo_reference_logps"] = {split: table.cpu() for split, table in self.reference_logps.items()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.reference_logps = {split: table.to(self.device)
                                for split, table in checkpoint.get("dpo_reference_logps", {}).items()}

    # ------------------------------------------------------------------------------------------ the step
    def _dpo(self, batch: dict[str, Tensor], split: str) -> tuple[Tensor, Tensor]:
        """The loss of ``batch`` (of the ``split`` rows) and the metrics' values (``METRICS``' order) of this rank's
        pairs."""
        input_ids, completion = batch["input_ids"], batch["completion_mask"]
        labels = input_ids.masked_fill(completion == 0, -100)[:, 1:]
        policy = token_logprobs(_whole(self.model(input_ids))[:, :-1], labels)
        if self.hparams.get("precompute_reference"):
            if split not in self.reference_logps:
                raise RuntimeError(f"precompute_reference: no {split} rows were scored when the fit started")
            ref_chosen, ref_rejected = self.reference_logps[split][batch["row_index"]].unbind(1)
        else:
            with torch.no_grad(), self.reference_model() as reference:
                ref_chosen, ref_rejected = self._summed_logps(reference, batch).chunk(2)
        logps = policy.sum(1)
        chosen, rejected = logps.chunk(2)
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
        loss, metrics = self._dpo(batch, "train")
        # Means over the data-parallel ranks, a collective taken only at the steps the Trainer writes its loggers
        # (the same on every rank), as TRL gathers its metrics; a device tensor, no host sync.
        values = torch.cat([loss.detach().reshape(1), metrics])
        if compat.logs_this_step(self.trainer):
            values = self.trainer.strategy.reduce(values, reduce_op="mean")
        for name, value in zip(("train_loss", *METRICS), values):
            self.log(name, value)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, metrics = self._dpo(batch, "val")
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        for name, value in zip(METRICS, metrics):
            self.log(f"val_{name}", value, sync_dist=True)


def _whole(logits: Tensor) -> Tensor:
    """Logits whole on this rank (tensor parallelism's vocabulary split gathered)."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits
