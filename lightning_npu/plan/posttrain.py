"""What the post-training objectives (the recipes' DPO and GRPO) add to a plan: the frozen reference, and GRPO's
rollout phase, whose peak is apart from the training step's. Torch-free; read from a config's model and data
sections by their option names (the planner never imports the recipes).

- The reference: the base with the adapters off under LoRA costs nothing; a frozen copy (full fine-tuning) is a
  second model's parameter shards, held for the whole run (``reference`` in the table).
- GRPO's rollout phase (``rollout_bytes``): the policy's parameters gathered whole for the phase (the working
  dtype), the KV cache of one prompt's ``num_generations`` completions at the longest sequence, and the prefill's
  logits, on top of the shards, gradients, optimizer states and the reference; the training step's activations
  are not alive then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from lightning_npu.plan.shape import ModelShape

#: ``model.loss_type`` values of the recipes' DPO; a model section with one of these (or ``sft_weight``) is DPO.
DPO_LOSSES = ("sigmoid", "ipo", "hinge")
#: The logits of a decode step are fp32 where they are sampled.
FP32_BYTES = 4


@dataclass(frozen=True)
class PostTraining:
    """A post-training run: ``objective`` ``dpo`` or ``grpo``; ``reference`` ``none``, ``adapters_off`` or ``copy``;
    for GRPO the rollout's ``num_generations`` (one decode batch) and ``max_completion_length``."""

    objective: str
    reference: str
    num_generations: int = 0
    max_completion_length: int = 0

    @property
    def sequences_per_row(self) -> int:
        """Sequences a data row becomes in the training step (a DPO row: chosen and rejected)."""
        return 2 if self.objective == "dpo" else 1


def post_training_from_config(model: Mapping[str, Any], lora: bool) -> Optional[PostTraining]:
    """The post-training run a recipe config's model section describes (its ``init_args``), or None (pretraining,
    SFT). The reference as the recipes choose it: ``auto`` is the base with the adapters off under LoRA, otherwise
    a copy; GRPO builds none with ``beta`` 0, DPO none with ``precompute_reference``."""
    grpo = "num_generations" in model or "reward_funcs" in model
    dpo = not grpo and ("sft_weight" in model or model.get("loss_type") in DPO_LOSSES)
    if not (grpo or dpo):
        return None
    reference = str(model.get("reference", "auto"))
    if reference == "auto":
        reference = "adapters_off" if lora else "copy"
    if grpo and not float(model.get("beta", 0.0)) or not grpo and model.get("precompute_reference"):
        reference = "none"  # GRPO without its KL term; DPO with the reference's log-probs scored before training
    if not grpo:
        return PostTraining("dpo", reference)
    return PostTraining("grpo", reference, int(model.get("num_generations", 8)),
                        int(model.get("max_completion_length", 256)))


def reference_bytes(post: Optional[PostTraining], parameter_shards: float) -> float:
    """Per-device bytes of the frozen reference: a copy holds the policy's parameter shards once more."""
    return parameter_shards if post is not None and post.reference == "copy" else 0.0


def rollout_bytes(post: PostTraining, model: ModelShape, seq_len: int, tensor: int, act_bytes: int,
                  param_bytes: int, num_params: int) -> dict[str, float]:
    """Per-device bytes GRPO's rollout phase adds to the state it runs beside: the gathered parameters (each tensor-
    parallel rank's part), the KV cache of ``num_generations`` sequences of ``seq_len`` tokens (prompt and
    completion) and the prefill's logits (the prompt, ``seq_len - max_completion_length`` tokens, in the working
    dtype, and the last position's in fp32)."""
    generations = post.num_generations
    kv_heads = max(model.n_kv_heads // tensor, 1)
    cache = 2 * model.n_layers * kv_heads * model.head_dim * act_bytes * generations * seq_len
    prompt = max(seq_len - post.max_completion_length, 1)
    logits = generations * model.vocab_size * (prompt * act_bytes + FP32_BYTES)
    return {"rollout_gathered": num_params * param_bytes / tensor, "rollout_kv_cache": cache,
            "rollout_logits": logits}
