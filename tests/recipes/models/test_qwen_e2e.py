"""The Qwen recipe end to end on 2 simulated NPUs with npu_fsdp: tiny_qwen3.yaml trains (the loss falls) and writes a
sharded checkpoint, convert.py to-hf writes a directory transformers loads as a Qwen3ForCausalLM, and transformers'
greedy decoding of it gives the tokens the recipe's generation gives from the checkpoint."""

import json

import pytest
import torch

from tests.helpers import REPO, run_python
from tests.recipe_runs import SMALL, last_checkpoint, logged_losses

pytestmark = pytest.mark.slow  # trains on two processes

TINY_QWEN3 = str(REPO / "recipes/models/qwen/configs/tiny_qwen3.yaml")


def test_tiny_qwen3_trains_and_exports_what_transformers_decodes_alike(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    from recipes.decoder.checkpoint_layout import read_recipe_metadata
    from recipes.decoder.tokenizer import load_tokenizer
    from recipes.generate import generate, load_model

    out = run_python([str(REPO / "recipes/train.py"), "fit", "--config", TINY_QWEN3, *SMALL, "--trainer.max_steps",
                      "12", "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(tmp_path)], simulate=2)
    ckpt = last_checkpoint(tmp_path, 0)
    assert ckpt.is_dir() and f"checkpoint: {ckpt}" in out.stdout
    assert read_recipe_metadata(ckpt)["hyper_parameters"]["family"] == "qwen"
    losses = list(logged_losses(tmp_path, 0).values())
    assert len(losses) == 12 and max(losses[-3:]) < min(losses[:3]) - 0.5, losses

    hf_dir = tmp_path / "hf"
    run_python([str(REPO / "recipes/convert.py"), "to-hf", str(ckpt), str(hf_dir)], simulate=None)
    written = json.loads((hf_dir / "config.json").read_text())
    assert written["model_type"] == "qwen3" and written["tie_word_embeddings"] and written["head_dim"] == 48
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert isinstance(hf, Qwen3ForCausalLM)

    model, tokenizer_path = load_model(ckpt)
    prompt = torch.tensor([load_tokenizer(tokenizer_path)("Return the")["input_ids"]])
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, prompt, 12), expected)


def test_qwen3_with_tensor_parallelism_trains_with_the_losses_of_plain_sharding(layout_parity_runs):
    """The tiny Qwen3 (per-head q/k norms, its embedding tied to the head) with tensor_parallel_size 2 on 4 simulated
    NPUs against plain npu_fsdp on 2 (as many data-parallel replicas), from one checkpoint of first weights: the 10
    per-step losses agree within 1e-5, and the loss falls. The tied matrix stays one parameter, split by vocabulary
    rows for the lookup and the head alike."""
    losses, _ = layout_parity_runs
    plain = losses["qwen3"]
    assert len(plain) == 10 and plain[-3:].mean() < plain[:3].mean() - 0.5
    torch.testing.assert_close(losses["qwen3_tp2"], plain, rtol=0, atol=1e-5)
