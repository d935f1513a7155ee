"""GRPO's rollouts and rewards: the built-in engine's greedy completions are generate.py's, its masks end at the first
EOS, reward functions load by import path and bad ones are named before training."""

from __future__ import annotations

import json

import pytest
import torch

from recipes.generate import generate
from recipes.posttrain.grpo_data import PromptDataModule
from recipes.posttrain.rewards import (digits_reward, load_reward_function, math_answer_reward, score,
                                       think_format_reward, total_reward)
from recipes.posttrain.rollout import PolicyRolloutEngine, SamplingOptions
from tests.helpers import room_scripts, run_python
from tests.recipes.test_generate import config, random_model

SCRIPTS = room_scripts("recipes/posttrain")


def test_greedy_rollouts_equal_generate_py_for_every_prompt_and_generation():
    model = random_model(config())
    prompts = [torch.tensor([5, 9, 17]), torch.tensor([3, 44, 12, 8, 30])]
    options = SamplingOptions(num_generations=2, max_completion_length=7, temperature=0.0)
    rollouts = PolicyRolloutEngine().generate(model, prompts, options, eos_id=None)
    assert rollouts.completion_ids.shape == (4, 7) and rollouts.tokens == 28
    for index, prompt in enumerate(prompts):
        expected = generate(model, prompt, 7, temperature=0.0)[prompt.numel():]
        for row in (2 * index, 2 * index + 1):
            assert rollouts.completion_ids[row].tolist() == expected.tolist()


def test_completion_mask_ends_at_the_first_eos():
    model = random_model(config())
    prompt = torch.tensor([5, 9, 17])
    free = generate(model, prompt, 6, temperature=0.0)[3:]
    eos = int(free[2])  # the greedy path's third token made the EOS: the completion stops there
    rollouts = PolicyRolloutEngine().generate(model, [prompt], SamplingOptions(2, 6, temperature=0.0), eos_id=eos)
    first = free.tolist().index(eos)
    assert rollouts.completion_mask[0].tolist() == [1] * (first + 1) + [0] * (rollouts.completion_ids.shape[1] - first - 1)


def test_sampled_rollouts_reproduce_with_the_same_generator():
    model = random_model(config())
    options = SamplingOptions(num_generations=4, max_completion_length=5, temperature=1.0, top_p=0.9)
    draw = lambda: PolicyRolloutEngine().generate(model, [torch.tensor([5, 9])], options, eos_id=None,
                                                  generator=torch.Generator().manual_seed(3)).completion_ids
    first = draw()
    assert torch.equal(first, draw()) and len({tuple(row) for row in first.tolist()}) > 1


def test_shipped_rewards_score_answers_formats_and_digits():
    assert math_answer_reward([r"so \boxed{\frac{1}{2}}", "I think 3", "$1$"], ["$0.5$", "$0.5$", "no answer"]) == \
        [1.0, 0.0, None]
    assert think_format_reward(["<think>a</think> 4", "<think>a 4", "4"]) == [1.0, 0.0, 0.0]
    assert digits_reward(["12 a", "", "x"]) == [pytest.approx(2 / 3), 0.0, 0.0]


def test_rewards_sum_with_weights_and_unscorable_is_nan():
    per_function = score([math_answer_reward, digits_reward], [1.0, 0.5], ["p", "p"], [r"\boxed{1} 7", "x"],
                         {"solution": ["$1$", "not math"]})
    total = total_reward(per_function, [1.0, 0.5])
    assert total[0].item() == pytest.approx(1.0 + 0.5 * 2 / 10) and total[1].item() == 0.0
    assert torch.isnan(total_reward(torch.tensor([[float("nan")]]), [1.0])).all()


@pytest.mark.parametrize("path, message", [("nowhere.module.reward", "does not import"),
                                           ("recipes.posttrain.rewards.no_such", "has no callable 'no_such'"),
                                           ("reward", "not an import path")])
def test_a_reward_function_that_does_not_import_is_named(path, message):
    with pytest.raises(ValueError, match=message):
        load_reward_function(path)


def test_a_reward_function_returning_the_wrong_length_is_named():
    def short(prompts, completions, **columns):
        return [1.0]

    with pytest.raises(ValueError, match="reward function short returned 1 rewards for 2 completions"):
        score([short], [1.0], ["a", "b"], ["a", "b"], {})


def test_num_generations_that_does_not_divide_the_batch_is_refused():
    with pytest.raises(ValueError, match="batch_size=12 .* does not divide by num_generations=8"):
        PromptDataModule(batch_size=12, num_generations=8)


def test_beta_takes_the_reference_dpo_takes_and_one_that_cannot_be_built_is_refused():
    """What the CLI builds before workers start: beta > 0 gets a frozen copy (or the base with adapters off under
    LoRA), beta 0 none, and a reference that cannot be built is named with the fix."""
    from recipes.posttrain.grpo_module import GRPOModule

    assert GRPOModule(beta=0.04).reference_kind == "copy" and GRPOModule().reference_kind is None
    lora = {"lora": {"rank": 4, "alpha": 8}, "init_from": "/base"}
    assert GRPOModule(beta=0.04, **lora).reference_kind == "adapters_off"
    with pytest.raises(ValueError, match="reference='adapters_off' needs model.lora"):
        GRPOModule(beta=0.04, reference="adapters_off")
    with pytest.raises(ValueError, match="reference='copy' under model.lora would hold a second copy"):
        GRPOModule(beta=0.04, reference="copy", **lora)
    with pytest.raises(ValueError, match="model.reference='copy' serves the KL term only, and model.beta=0"):
        GRPOModule(reference="copy")
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingOptions(top_p=0)


@pytest.mark.slow
def test_sharded_rollouts_gather_each_unit_once_and_equal_generate_py():
    """Under FSDP2 on 2 gloo ranks the engine's greedy completions are generate.py's on the unsharded model; the rollout
    phase all-gathers each sharded block once (plain FSDP2 decoding gathers them at every token), and the blocks are
    sharded again afterwards, with their reshard_after_forward as before."""
    out = run_python([str(SCRIPTS / "grpo_rollout_fsdp.py")], simulate=2, timeout=300)
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    assert result["completions"] == [row for row in result["expected"] for _ in range(2)]
    assert result["plain_fsdp_completion"] == result["expected"][0]
    assert result["rollout_gathers"] == result["sharded_blocks"]
    assert result["per_forward_gathers"] >= 6 * result["sharded_blocks"]
    assert result["flags_after"] == result["flags_before"] == [[True, False]] * result["sharded_blocks"]


@pytest.mark.parametrize(("size", "message"), [
    ("pipeline_parallel_size", r"pipeline_parallel_size=2 cannot run this model: GRPO's rollouts decode token by token"),
    ("context_parallel_size", r"context_parallel_size=2: GRPO's rollouts decode whole sequences"),
    ("tensor_parallel_size", r"tensor_parallel_size=2 cannot split this model: GRPO's rollouts sample from the"),
])
def test_pipeline_context_and_tensor_parallel_grpo_are_refused_by_the_parallel_rules(size, message):
    """What train_grpo.py checks before workers start (recipes/train.py check_parallel_layout) and every rank checks
    again: the layouts the rollouts cannot run."""
    from lightning_npu.facts import parallel_rules
    from lightning_npu.facts.options import FSDPOptions
    from recipes.posttrain.grpo_module import GRPOModule

    with pytest.raises(ValueError, match=message):
        parallel_rules.check(FSDPOptions(**{size: 2}), GRPOModule().parallel_shapes())


def test_accumulating_grpo_steps_is_refused_before_workers_start():
    from recipes.posttrain.train_grpo import check_accumulation

    check_accumulation(1)
    with pytest.raises(ValueError, match="accumulate_grad_batches=4: a GRPO step rolls out"):
        check_accumulation(4)
