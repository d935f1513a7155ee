"""The MoE recipe end to end on 2 simulated NPUs with npu_fsdp: tiny_moe.yaml fits and writes a sharded checkpoint,
generate.py decodes from it, convert.py to-hf writes a directory transformers loads, and transformers' greedy
decoding of that directory gives the tokens the recipe's generation gives from the checkpoint."""

import json

import pytest
import torch

from tests.helpers import REPO, run_python

pytestmark = pytest.mark.slow  # trains on two processes

TINY_MOE = str(REPO / "recipes/models/moe/configs/tiny_moe.yaml")
SMALL = ["--data.seq_len", "64", "--data.max_documents", "60", "--data.batch_size", "4",
         "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "4", "--trainer.log_every_n_steps", "2",
         "--trainer.enable_progress_bar", "false", "--model.warmup_steps", "2"]


def test_tiny_moe_fits_generates_and_exports_what_transformers_decodes_alike(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    from recipes.decoder.checkpoint_layout import read_recipe_metadata
    from recipes.decoder.tokenizer import load_tokenizer
    from recipes.generate import generate, load_model

    out = run_python([str(REPO / "recipes/train.py"), "fit", "--config", TINY_MOE, *SMALL,
                      "--trainer.max_steps", "8", "--trainer.default_root_dir", str(tmp_path)], simulate=2)
    ckpt = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and f"checkpoint: {ckpt}" in out.stdout
    metadata = read_recipe_metadata(ckpt)
    assert metadata["global_step"] == 8 and metadata["hyper_parameters"]["family"] == "moe"
    # Each logging step (every 2nd) logs the expert load, max / mean tokens per expert: 1 (even) .. 8 / 2.
    rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    column = rows[0].split(",").index("expert_load")
    loads = [float(row.split(",")[column]) for row in rows[1:] if row.split(",")[column]]
    assert len(loads) == 4 and all(1.0 <= load <= 4.0 for load in loads), loads

    generated = run_python([str(REPO / "recipes/generate.py"), str(ckpt), "--prompt", "Return the",
                            "--max-new-tokens", "8", "--temperature", "0"], simulate=None)
    assert "new tokens" in generated.stderr

    hf_dir = tmp_path / "hf"
    run_python([str(REPO / "recipes/convert.py"), "to-hf", str(ckpt), str(hf_dir)], simulate=None)
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "qwen3_moe"
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert isinstance(hf, Qwen3MoeForCausalLM)

    model, tokenizer_path = load_model(ckpt)
    prompt = torch.tensor([load_tokenizer(tokenizer_path)("Return the")["input_ids"]])
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, prompt, 12), expected)
