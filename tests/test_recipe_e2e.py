"""The LLaMA-2 recipe end to end on 2 simulated NPUs with npu_fsdp: fit, checkpoint, resume, generate,
export to Hugging Face, and HF's model reproduces the recipe's logits. Bad input fails before workers start."""

import json

import pytest
import torch

from tests.helpers import REPO, run_python

TRAIN = str(REPO / "recipes/llama2/train.py")
TINY = str(REPO / "recipes/llama2/configs/tiny.yaml")
SMALL = ["--data.seq_len", "64", "--data.max_documents", "60", "--data.batch_size", "4",
         "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "4", "--trainer.log_every_n_steps", "2",
         "--trainer.enable_progress_bar", "false", "--model.warmup_steps", "2"]


def _train(tmp_path, *extra, simulate=2):
    return run_python([TRAIN, "fit", "--config", TINY, *SMALL, "--trainer.default_root_dir", str(tmp_path), *extra],
                      simulate=simulate)


def _last_checkpoint(root, version):
    return root / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"


def test_fit_resume_generate_export_roundtrip(tmp_path):
    from recipes.llama2.convert import load_recipe_checkpoint, read_recipe_metadata

    first = _train(tmp_path, "--trainer.max_steps", "8")
    ckpt = _last_checkpoint(tmp_path, 0)
    assert ckpt.is_dir() and (ckpt / ".metadata").is_file()  # sharded DCP checkpoint
    assert "train loss: first" in first.stdout and f"checkpoint: {ckpt}" in first.stdout
    assert "recipes/llama2/generate.py --checkpoint" in first.stdout
    assert read_recipe_metadata(ckpt)["global_step"] == 8

    _train(tmp_path, "--trainer.max_steps", "12", "--ckpt_path", str(ckpt))
    resumed = _last_checkpoint(tmp_path, 1)
    assert read_recipe_metadata(resumed)["global_step"] == 12
    assert ckpt.is_dir()  # the first run's checkpoint is untouched

    out = run_python([str(REPO / "recipes/llama2/generate.py"), "--checkpoint", str(resumed), "--prompt", "The",
                      "--max-new-tokens", "8"], simulate=None)
    assert "new tokens" in out.stdout + out.stderr

    hf_dir = tmp_path / "hf"
    run_python([str(REPO / "recipes/llama2/convert.py"), "to-hf", str(resumed), str(hf_dir)], simulate=None)
    from transformers import LlamaForCausalLM

    from recipes.llama2.model import LLaMA

    config, state = load_recipe_checkpoint(resumed)
    recipe = LLaMA(config)
    recipe.load_state_dict(state)
    hf = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, recipe(tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ckpt_path", "/nonexistent/last.ckpt"], "ckpt_path='/nonexistent/last.ckpt' does not exist"),
        (["--data.seq_len", "512"], "data.seq_len=512 exceeds the model's max_seq_len=256"),
        (["--model.config", json.dumps({"vocab_size": 1000})], "The tokenizer has 2048 tokens but the model's vocab_size is 1000"),
        (["--data.path", "/nonexistent/corpus.jsonl"], "/nonexistent/corpus.jsonl"),
        (["--model.init_from", "/nonexistent/hf"], "model.init_from='/nonexistent/hf' does not exist"),
    ],
)
def test_bad_input_fails_before_workers_and_writes_nothing(tmp_path, args, message):
    with pytest.raises(AssertionError) as failure:
        _train(tmp_path, "--trainer.max_steps", "2", *args)
    text = str(failure.value)
    assert message in text
    assert "Initializing distributed" not in text  # no worker process was started
    assert not (tmp_path / "lightning_logs").exists()
