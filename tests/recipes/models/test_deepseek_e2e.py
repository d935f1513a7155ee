"""The DeepSeek recipe end to end on 2 simulated NPUs with npu_fsdp: tiny_deepseek.yaml (MLA, 8 routed + 1 shared
experts, group-limited routing, the first layer dense, the balancing bias trained) trains (the loss falls) and writes
a sharded checkpoint, convert.py to-hf writes a directory transformers loads as a DeepseekV3ForCausalLM with the
trained correction bias, and transformers' greedy decoding of it gives the tokens the recipe's generation gives."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import REPO, run_python
from tests.recipe_runs import SMALL, last_checkpoint, logged_losses

pytestmark = pytest.mark.slow  # trains on two processes

TINY_DEEPSEEK = str(REPO / "recipes/models/deepseek/configs/tiny_deepseek.yaml")


def test_tiny_deepseek_trains_and_exports_what_transformers_decodes_alike(tmp_path):
    from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

    from recipes.decoder.checkpoint_layout import read_recipe_metadata
    from recipes.decoder.tokenizer import load_tokenizer
    from recipes.generate import generate, load_model

    out = run_python([str(REPO / "recipes/train.py"), "fit", "--config", TINY_DEEPSEEK, *SMALL, "--trainer.max_steps",
                      "12", "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(tmp_path)], simulate=2)
    ckpt = last_checkpoint(tmp_path, 0)
    assert ckpt.is_dir() and f"checkpoint: {ckpt}" in out.stdout
    assert read_recipe_metadata(ckpt)["hyper_parameters"]["family"] == "deepseek"
    losses = list(logged_losses(tmp_path, 0).values())
    assert len(losses) == 12 and max(losses[-3:]) < min(losses[:3]) - 0.5, losses

    hf_dir = tmp_path / "hf"
    run_python([str(REPO / "recipes/convert.py"), "to-hf", str(ckpt), str(hf_dir)], simulate=None)
    written = json.loads((hf_dir / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3" and written["n_group"] == 4 and written["first_k_dense_replace"] == 1
    bias = load_file(hf_dir / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().max() > 0  # the auxiliary-loss-free balancing bias moved and is exported under HF's name
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert isinstance(hf, DeepseekV3ForCausalLM)

    model, tokenizer_path = load_model(ckpt)
    prompt = torch.tensor([load_tokenizer(tokenizer_path)("Return the")["input_ids"]])
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, prompt, 12), expected)


def test_tiny_deepseek_trains_with_expert_parallelism_with_the_losses_of_plain_sharding(tmp_path):
    """expert_parallel_size 2 on 2 simulated NPUs (each rank holds 4 of the 8 routed experts of the 2 MoE layers;
    the shared experts, the dense layer and MLA stay whole) gives plain sharding's per-step losses from the same
    seed: the stacked experts split by expert parallelism, named in the recipe's ParallelPlan."""
    losses = {}
    for ep in (1, 2):
        root = tmp_path / f"ep{ep}"
        out = run_python([str(REPO / "recipes/train.py"), "fit", "--config", TINY_DEEPSEEK, *SMALL,
                          "--trainer.strategy.init_args.expert_parallel_size", str(ep), "--trainer.max_steps", "6",
                          "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(root)], simulate=2)
        if ep == 2:
            assert "expert parallelism over 2 ranks: the experts of 2 modules split" in out.stdout + out.stderr
        losses[ep] = torch.tensor(list(logged_losses(root, 0).values()))
    assert len(losses[1]) == 6 and losses[1][-1] < losses[1][0]
    torch.testing.assert_close(losses[2], losses[1], rtol=0, atol=1e-3)


def test_tiny_deepseek_trains_multi_token_prediction_and_exports_it_at_layer_n(tmp_path):
    """--model.config {mtp_layers: 1}: the logged loss (next-token plus 0.3 x the depth-1 MTP loss) falls, the export
    holds the MTP depth as DeepSeek's release does (model.layers.3.*, num_nextn_predict_layers 1), imports back with
    it, and transformers, which ignores it, decodes as the recipe's generation (which skips it) does."""
    from transformers import AutoModelForCausalLM

    from recipes.decoder.hf_checkpoint import load_hf_checkpoint
    from recipes.generate import generate, load_model

    run_python([str(REPO / "recipes/train.py"), "fit", "--config", TINY_DEEPSEEK, *SMALL, "--model.config",
                "{mtp_layers: 1}", "--trainer.max_steps", "10", "--trainer.log_every_n_steps", "1",
                "--trainer.default_root_dir", str(tmp_path)], simulate=2)
    losses = list(logged_losses(tmp_path, 0).values())
    assert len(losses) == 10 and max(losses[-3:]) < min(losses[:3]) - 0.5, losses
    ckpt = last_checkpoint(tmp_path, 0)
    hf_dir = tmp_path / "hf"
    run_python([str(REPO / "recipes/convert.py"), "to-hf", str(ckpt), str(hf_dir)], simulate=None)
    assert json.loads((hf_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert "model.layers.3.eh_proj.weight" in load_file(hf_dir / "model.safetensors")
    assert load_hf_checkpoint(hf_dir)[0].mtp_layers == 1
    model, _ = load_model(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    prompt = torch.tensor([[5, 17, 99, 3]])
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, prompt, 8), expected)


def test_tiny_deepseek_with_tensor_or_expert_parallelism_on_4_trains_with_the_losses_of_plain_sharding(
        layout_parity_runs):
    """The tiny DeepSeek (MLA, the first layer dense, then DeepSeekMoE with every token routed to all 8 experts) on 4
    simulated NPUs from one checkpoint of first weights: tensor_parallel_size 2 against plain npu_fsdp on 2, and
    expert_parallel_size 2 against plain on 4 (as many data-parallel replicas each): the 10 per-step losses agree
    within 1e-5, and the loss falls. Under TP MLA splits its up-projections by heads, computes its low-rank ones
    whole, and the MoE layer gives each tensor-parallel rank half the routed rows."""
    losses, _ = layout_parity_runs
    plain = losses["deepseek"]
    assert len(plain) == 10 and plain[-3:].mean() < plain[:3].mean() - 0.5
    torch.testing.assert_close(losses["deepseek_tp2"], plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(losses["deepseek_ep2"], losses["deepseek_plain4"], rtol=0, atol=1e-5)
