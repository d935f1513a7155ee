"""GRPO on the decoder recipes: ``GRPOModule`` is ``DecoderLM`` (the same model building, initial weights, LoRA,
optimizer, schedule and checkpoints) whose training step is a rollout phase and the GRPO loss.

A step: the rank's prompts (``PromptDataModule``) each get ``num_generations`` completions from the rollout engine
(``rollout.PolicyRolloutEngine``, the parameters gathered once), the reward functions score them, the advantages
are normalised within each prompt's group (``grpo_loss.group_advantages``), and the loss is TRL's
(``grpo_loss.grpo_loss``). With ``num_iterations > 1`` one rollout phase feeds that many optimizer steps (TRL's
``num_iterations``): the rollouts and their old log-probs are kept (in checkpoints too) and the batches of the steps
between phases are not used.

With ``beta > 0`` the loss adds TRL's KL term against a frozen reference (``reference.ReferencedLM``'s, DPO's too:
under LoRA the base with the adapters off, otherwise a frozen copy sharded like the policy), whose log-probs are taken
once per rollout phase, as TRL takes them; with beta 0 no reference is built (TRL's default).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_npu.facts.parallel_rules import ModelShapes
from recipes.posttrain.grpo_loss import check_loss_options, group_advantages, grpo_loss, k3_kl
from recipes.posttrain.logprobs import token_logprobs
from recipes.posttrain.reference import ReferencedLM
from recipes.posttrain.rewards import load_reward_function, score, total_reward
from recipes.posttrain.rollout import PolicyRolloutEngine, RolloutEngine, Rollouts, SamplingOptions


class GRPOModule(ReferencedLM):
    """GRPO (TRL 1.16's loss) for a decoder LM of the recipe's families; ``DecoderLM``'s arguments, plus:

    Args:
        reward_funcs: import paths of reward functions ``f(prompts, completions, **columns) -> list[float or None]``
            (default: ``rewards.math_answer_reward``).
        reward_weights: one weight a function (default 1 each); the reward is the weighted sum.
        num_generations, max_completion_length, temperature, top_p: the rollouts (``rollout.SamplingOptions``).
        loss_type, scale_rewards, epsilon, epsilon_high, beta, num_iterations: as TRL's GRPOConfig.
        reference: the KL term's reference when ``beta > 0`` (``reference.REFERENCES``; ``auto``: the base with the
            adapters off under LoRA, otherwise a frozen copy).
    """

    def __init__(
        self,
        *args: Any,
        reward_funcs: Optional[list[str]] = None,
        reward_weights: Optional[list[float]] = None,
        num_generations: int = 8,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        loss_type: str = "dapo",
        scale_rewards: str = "group",
        epsilon: float = 0.2,
        epsilon_high: Optional[float] = None,
        beta: float = 0.0,
        num_iterations: int = 1,
        reference: str = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_loss_options(loss_type, scale_rewards, epsilon, epsilon_high, beta)
        if beta == 0 and reference != "auto":
            raise ValueError(f"model.reference={reference!r} serves the KL term only, and model.beta=0 has none: set"
                             " beta > 0 (TRL's KL weight) or leave reference: auto")
        self.use_reference(reference if beta > 0 else None)
        if num_iterations < 1:
            raise ValueError(f"model.num_iterations={num_iterations} must be >= 1 (optimizer steps per rollout phase)")
        reward_funcs = reward_funcs or ["recipes.posttrain.rewards.math_answer_reward"]
        self.reward_funcs = [load_reward_function(path) for path in reward_funcs]
        self.reward_names = [path.rsplit(".", 1)[-1] for path in reward_funcs]
        weights = [1.0] * len(reward_funcs) if reward_weights is None else list(reward_weights)
        if len(weights) != len(reward_funcs):
            raise ValueError(f"model.reward_weights has {len(weights)} weights for {len(reward_funcs)} reward"
                             " functions; give one a function or none (1 each)")
        self.reward_weights = weights
        self.sampling = SamplingOptions(num_generations, max_completion_length, temperature, top_p)
        self.engine: RolloutEngine = PolicyRolloutEngine(owner=self)
        self.eos_id: Optional[int] = None
        self._rollout: Optional[dict[str, Any]] = None  # the current rollout phase's batch, kept between iterations
        self._train_started = 0.0
        self._generator: Optional[torch.Generator] = None

    def parallel_shapes(self) -> ModelShapes:
        """The model's shapes, and the layouts GRPO cannot run yet (``train_grpo.py`` and every rank refuse them)."""
        shapes = super().parallel_shapes()
        return dataclasses.replace(
            shapes,
            unsplit_parts=(*shapes.unsplit_parts,
                           "GRPO's rollouts sample from the policy's logits, which tensor parallelism splits by"
                           " vocabulary and the sampler does not gather (train GRPO with data or sharded"
                           " parallelism)"),
            pipeline_refusals=("GRPO's rollouts decode token by token through the whole model, which a pipeline would"
                               " have to schedule one token at a time; train GRPO with data or sharded parallelism",),
            context_parallel_refusals=("GRPO's rollouts decode whole sequences on each rank, and a context-parallel"
                                       " rank holds only part of every sequence; train GRPO with data or sharded"
                                       " parallelism",))

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        tokenizer = getattr(datamodule, "tokenizer", None)
        self.eos_id = None if tokenizer is None else tokenizer.eos_token_id

    def _sampling_generator(self) -> torch.Generator:
        """The rollouts' random stream: seeded from the run's seed, the rank and the step, so a resume draws what the
        uninterrupted run would have."""
        device = self.model.tok_embeddings.weight.device
        seed = torch.initial_seed() + 1_000_003 * self.global_rank + self.global_step
        return torch.Generator(device=device).manual_seed(seed % 2**63)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        # In the training step, which npu_fsdp runs as the root FSDP unit's forward (its parameters gathered): the
        # rollout gathers the other units itself.
        if self._rollout is None or self.global_step % self.hparams.num_iterations == 0:
            self._rollout = self._rollout_phase(batch)
        self._train_started = time.perf_counter()
        rollout = self._rollout
        mask = rollout["completion_mask"]
        logps = self._completion_logprobs(self.model, rollout["prompt_ids"], rollout["completion_ids"], mask)
        hp = self.hparams
        loss = grpo_loss(logps, rollout["old_logps"], rollout["advantages"], mask, loss_type=hp.loss_type,
                         epsilon=hp.epsilon, epsilon_high=hp.epsilon_high, beta=hp.beta, ref_logps=rollout["ref_logps"],
                         max_completion_length=self.sampling.max_completion_length,
                         num_items_in_batch=rollout["global_tokens"], num_processes=self.trainer.world_size)
        self.log("train_loss", loss.detach())
        if hp.beta > 0:  # TRL's kl: the k3 estimate's mean over this rank's completion tokens, then over the ranks
            kl = (k3_kl(logps.detach(), rollout["ref_logps"]) * mask).sum() / mask.sum().clamp(min=1)
            self.log("kl", self._mean_over_data(kl))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        seconds = time.perf_counter() - self._train_started  # forward, backward and optimizer step
        rollout = self._rollout
        tokens = sum(p.numel() for p in rollout["prompt_ids"]) * self.sampling.num_generations + rollout["tokens"]
        self.log("train_tokens_per_s", tokens / max(seconds, 1e-9))

    def _rollout_phase(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Completions for the batch's prompts, their rewards and advantages, and the log-probs the later steps
        compare with: the rollout policy's (for ``num_iterations > 1``) and the reference's (for ``beta > 0``)."""
        prompt_ids = [p.to(self.device) for p in batch["prompt_ids"]]
        rollouts: Rollouts = self.engine.generate(self.model, prompt_ids, self.sampling, self.eos_id,
                                                  generator=self._sampling_generator())
        G = self.sampling.num_generations
        tokenizer = self.trainer.datamodule.tokenizer
        completions = [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                       for ids, mask in zip(rollouts.completion_ids, rollouts.completion_mask)]
        prompts = [text for text in batch["prompt"] for _ in range(G)]
        columns = {key: [v for v in values for _ in range(G)] for key, values in batch.items()
                   if key not in ("prompt", "prompt_ids")}
        per_function = score(self.reward_funcs, self.reward_weights, prompts, completions, columns, self.reward_names)
        rewards = total_reward(per_function, self.reward_weights).to(self.device)
        mask = rollouts.completion_mask.to(self.device)
        old_logps = ref_logps = None
        with torch.no_grad():
            if self.hparams.num_iterations > 1:
                old_logps = self._completion_logprobs(self.model, prompt_ids, rollouts.completion_ids, mask)
            if self.reference_kind is not None:
                with self.reference_model() as reference:
                    ref_logps = self._completion_logprobs(reference, prompt_ids, rollouts.completion_ids, mask)
        global_tokens = self._sum_over_data(mask.sum().float())
        self.log("reward", self._mean_over_data(rewards.nanmean()), prog_bar=True)
        for name, column in zip(self.reward_names, per_function.T):
            self.log(f"rewards/{name}/mean", self._mean_over_data(column.nanmean().to(self.device)))
        self.log("completions/mean_length", self._mean_over_data(mask.sum(1).float().mean()))
        self.log("rollout_tokens_per_s", rollouts.tokens / max(rollouts.seconds, 1e-9))
        return {"prompt_ids": prompt_ids, "completion_ids": rollouts.completion_ids.to(self.device),
                "completion_mask": mask, "advantages": group_advantages(rewards, G, self.hparams.scale_rewards),
                "old_logps": old_logps, "ref_logps": ref_logps, "global_tokens": global_tokens,
                "tokens": rollouts.tokens}

    def _mean_over_data(self, value: Tensor) -> Tensor:
        return self._sum_over_data(value.detach().float()) / max(self.trainer.world_size, 1)

    def _completion_logprobs(self, model: torch.nn.Module, prompt_ids: list[Tensor], completion_ids: Tensor,
                             mask: Tensor) -> Tensor:
        """``model``'s (the policy's or the reference's) log-probs of each completion token [n, length] (0 on
        padding), one forward per prompt's group (prompts differ in length, and the model takes no padding mask)."""
        G, rows = self.sampling.num_generations, []
        for index, prompt in enumerate(prompt_ids):
            completions = completion_ids[index * G:(index + 1) * G]
            sequences = torch.cat([prompt.reshape(1, -1).expand(G, -1), completions], dim=1)
            logits = model(sequences)[:, prompt.numel() - 1:-1]
            if self.sampling.temperature > 0:  # TRL scores the sampling distribution: logits / temperature
                logits = logits / self.sampling.temperature
            labels = completions.masked_fill(mask[index * G:(index + 1) * G] == 0, -100)
            rows.append(token_logprobs(logits, labels))
        return torch.cat(rows)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The rollout state, every rank's (they rolled out different prompts): a resume between the iterations of one
        # rollout phase trains on the same rollouts. The sampling stream needs no state: it is drawn from the seed,
        # the rank and the step (_sampling_generator). Every rank runs this hook, so the gather is safe.
        import torch.distributed as dist

        local = None if self._rollout is None else _to_device(self._rollout, "cpu")
        gathered = [local]
        if dist.is_available() and dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        checkpoint["grpo_rollouts"] = gathered

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("grpo_rollouts") or []
        world = self.trainer.world_size if self._trainer is not None else 1
        if len(saved) != world:  # another number of ranks: their prompts differ, so the next step rolls out anew
            self._rollout = None
            return
        rank = self.global_rank if self._trainer is not None else 0
        self._rollout = None if saved[rank] is None else _to_device(saved[rank], self.device)


def _to_device(rollout: dict[str, Any], device: Any) -> dict[str, Any]:
    """The rollout state's tensors (and lists of them) on ``device``."""
    move = lambda value: value.to(device) if isinstance(value, Tensor) else value
    return {key: [move(v) for v in value] if isinstance(value, list) else move(value) for key, value in rollout.items()}
