"""The planner counts what post-training adds (lightning_npu/plan/posttrain.py): the frozen reference (a copy's
shards, nothing under LoRA), GRPO's rollout phase (the gathered parameters, the KV cache, the prefill's logits) as a
peak of its own, and a DPO row's two sequences; the Qwen3-8B DPO (LoRA) and GRPO configs plan within 64 GB NPUs."""

from __future__ import annotations

import pytest
import yaml

from lightning_npu.plan import GIB, estimate, load_spec, render, report
from lightning_npu.plan.posttrain import PostTraining, post_training_from_config
from tests.helpers import REPO

QWEN = REPO / "recipes/models/qwen/configs"


def test_qwen3_8b_dpo_lora_plans_within_64_gb_with_no_reference_memory_and_two_sequences_a_row():
    spec = load_spec(QWEN / "qwen3_8b_dpo_lora.yaml", device_memory_gib=64)
    assert spec.post_training == PostTraining("dpo", "adapters_off")
    assert spec.micro_batch == 2  # data.batch_size 1 row: chosen and rejected
    result = estimate(spec)
    assert result.fits and result.items["reference"] == 0 and result.rollout_items == {}
    assert "frozen reference" not in render(spec, report(spec))


def test_qwen3_8b_grpo_plans_within_64_gb_counting_its_rollout_phase():
    spec = load_spec(QWEN / "qwen3_8b_grpo.yaml", device_memory_gib=64)
    assert spec.post_training == PostTraining("grpo", "none", num_generations=8, max_completion_length=1024)
    result = estimate(spec)
    rollout = result.rollout_items
    assert rollout["rollout_gathered"] == spec.profile.num_params() * 2  # bf16, the whole policy on each NPU
    assert rollout["rollout_kv_cache"] == 2 * 36 * 8 * 128 * 2 * 8 * 1536  # k and v, layers, kv heads, 8 x 1536
    assert rollout["parameters"] == result.items["parameters"] > 0
    assert 20 * GIB < result.rollout_total < 64 * GIB and result.fits
    assert report(spec)["stages"]["3"]["rollout_total_gib"] == pytest.approx(result.rollout_total / GIB)
    assert "GRPO rollout phase" in render(spec, report(spec))


def test_a_frozen_copy_reference_holds_the_parameter_shards_once_more(tmp_path):
    config = yaml.safe_load((QWEN / "qwen3_8b_grpo.yaml").read_text())
    config["model"]["beta"] = 0.04  # full fine-tuning, beta > 0: reference auto is a frozen copy
    path = tmp_path / "grpo_kl.yaml"
    path.write_text(yaml.safe_dump(config))
    spec = load_spec(path, device_memory_gib=64)
    result = estimate(spec)
    assert spec.post_training.reference == "copy"
    assert result.items["reference"] == result.items["parameters"] > 0
    assert result.rollout_items["reference"] == result.items["reference"]
    assert "frozen reference (a copy's fp32 shards)" in render(spec, report(spec))


@pytest.mark.parametrize(("model", "lora", "expected"), [
    ({"beta": 0.1, "loss_type": "sigmoid"}, False, PostTraining("dpo", "copy")),
    ({"sft_weight": 0.5}, True, PostTraining("dpo", "adapters_off")),
    ({"loss_type": "ipo", "precompute_reference": True}, False, PostTraining("dpo", "none")),
    ({"num_generations": 4, "max_completion_length": 64, "beta": 0.02}, True,
     PostTraining("grpo", "adapters_off", 4, 64)),
    ({"reward_funcs": ["f"]}, False, PostTraining("grpo", "none", 8, 256)),
    ({"learning_rate": 1e-4}, False, None),
])
def test_the_objective_and_reference_are_read_as_the_recipes_choose_them(model, lora, expected):
    assert post_training_from_config(model, lora=lora) == expected
