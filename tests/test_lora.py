"""LoRA in the recipe: the adapters (lora.py), their training under npu_ddp and npu_fsdp (module.py), and their
export to PEFT and to a merged Hugging Face model (lora_export.py via convert.py)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from recipes import convert
from recipes.decoder.checkpoint_layout import read_model_tensors, save_recipe_checkpoint
from recipes.models.llama.config import LLaMAConfig
from recipes.decoder.data import DEFAULT_TOKENIZER
from recipes.decoder.lora import LoRAConfig, add_lora, is_adapter_name, quantized_base_state
from recipes.models.llama.model import LLaMA
from recipes.decoder.module import DecoderLM
from tests.helpers import SCRIPTS, read_json, run_python

ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
#: The tiny LLaMA's state-dict entries (what a LoRA run's base holds).
TINY_TENSORS = len(LLaMA(LLaMAConfig.from_preset("tiny")).state_dict())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"targets": ("q", "wq")}, r"unknown name\(s\) \['wq'\]"),
        ({"targets": ()}, "is empty"),
        ({"targets": ("q", "q")}, "names a target twice"),
        ({"rank": 0}, "rank=0 must be an integer >= 1"),
        ({"alpha": 0}, "alpha=0 must be a number > 0"),
        ({"dropout": 1.0}, r"dropout=1.0 must lie in \[0, 1\)"),
        ({"base_quantization": "int4"}, r"lora.base_quantization='int4' is not a base quantization: use one of int8,"
                                        " nf4, or null"),
    ],
)
def test_lora_config_rejects_bad_values_naming_them(fields, message):
    """Catches a LoRAConfig that accepts an unknown target, an empty or repeated target list, rank < 1, alpha <= 0 or
    a dropout of 1, which would fail later (or silently train nothing) instead of naming the bad value."""
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**fields)


def test_fresh_adapters_change_no_logit_and_leave_only_adapters_trainable():
    """Catches a B not initialised to zero (a fresh adapter would move the logits), an A not initialised as PEFT's
    Kaiming uniform (bound 1/sqrt(in)), and a base weight left trainable."""
    torch.manual_seed(0)
    model = LLaMA(LLaMAConfig.from_preset("tiny", n_layers=2))
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    before = model(tokens)
    add_lora(model, LoRAConfig(rank=4, targets=ALL_TARGETS))
    assert torch.equal(model(tokens), before)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_name(name) for name in trainable)
    assert len(trainable) == 2 * len(ALL_TARGETS) * 2  # A and B per target per layer
    a = model.layers[0].attention.wq.lora_a["q"].weight
    assert a.abs().max() <= 1 / math.sqrt(model.config.dim) and a.std() > 0.5 / math.sqrt(3 * model.config.dim)
    assert all(torch.equal(b.weight, torch.zeros_like(b.weight)) for b in model.layers[0].attention.wq.lora_b.values())


def test_gate_adapter_changes_the_gate_projection_by_scaled_BA_and_leaves_up_alone():
    """Catches an adapter that lands on the wrong projection (up instead of gate) or a wrong scaling (alpha / rank):
    each would break the exact PEFT mapping."""
    torch.manual_seed(0)
    model = LLaMA(LLaMAConfig.from_preset("tiny", n_layers=1))
    gate, up = (model.layers[0].feed_forward.w_gate.weight.detach().clone(),
                model.layers[0].feed_forward.w_up.weight.detach().clone())
    add_lora(model, LoRAConfig(rank=2, alpha=6.0, targets=("gate",)))
    layer = model.layers[0].feed_forward.w_gate
    assert type(model.layers[0].feed_forward.w_up).__name__ == "Linear"
    torch.nn.init.normal_(layer.lora_b["gate"].weight)
    x = torch.randn(3, model.config.dim)
    update = x @ (layer.lora_b["gate"].weight @ layer.lora_a["gate"].weight).T * 3.0
    torch.testing.assert_close(layer(x), x @ gate.T + update, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.layers[0].feed_forward.w_up(x), x @ up.T)


def test_an_adapter_on_one_row_block_of_a_fused_weight_changes_only_those_rows():
    """Catches an adapter on one block of a fused weight (``LoRASite`` with two blocks) that spans both halves or
    lands on the other one."""
    torch.manual_seed(0)
    from recipes.decoder.layers import Linear
    from recipes.decoder.lora import LoRALinear

    fused = Linear(8, 6)
    base = fused.weight.detach().clone()
    layer = LoRALinear(fused, 2, {"up": 1}, LoRAConfig(rank=2, alpha=2.0, targets=("up",)))
    torch.nn.init.normal_(layer.lora_b["up"].weight)
    x = torch.randn(3, 8)
    update = x @ (layer.lora_b["up"].weight @ layer.lora_a["up"].weight).T
    torch.testing.assert_close(layer(x), x @ base.T + torch.cat([torch.zeros(3, 3), update], dim=-1))


def test_lora_without_init_from_is_refused_before_training():
    """Catches a LoRA run (or resume) accepted without init_from: its checkpoints hold no base weights, so the
    base would silently be random."""
    with pytest.raises(ValueError, match=r"model.lora=.* needs model.init_from, but init_from=None.*--model.init_from"):
        DecoderLM(lora={"rank": 4, "targets": ["q"]})


def test_lora_resume_with_other_adapters_is_refused(tmp_path):
    """Catches a resume whose lora settings differ from the checkpoint's being accepted with its adapters half
    loaded (strict loading must compare against this run's adapters, not the base)."""
    module = DecoderLM(preset="tiny", init_from=str(tmp_path / "base.ckpt"), lora={"rank": 4, "targets": ["q", "v"]})
    module.configure_model()
    state = module.state_dict()
    assert state and all(is_adapter_name(k) for k in state)
    other = DecoderLM(preset="tiny", init_from=str(tmp_path / "base.ckpt"), lora={"rank": 4, "targets": ["q"]})
    other.configure_model()
    with pytest.raises(ValueError, match="does not hold the adapters of lora=.*unexpected"):
        other.load_state_dict(state)


def test_a_base_nf4_cannot_pack_is_refused_when_the_module_is_built_naming_the_weight():
    """Catches a shape NF4 cannot store (an odd row length) failing only in the workers, or without the fix."""
    with pytest.raises(ValueError, match=r"cannot quantize feed_forward.w_down.weight to nf4: .*\(128, 99\).*use int8"):
        DecoderLM(preset="tiny", config={"ffn_hidden_dim": 99}, init_from="base.ckpt",
                  lora={"rank": 4, "targets": ["q"], "base_quantization": "nf4"})
    DecoderLM(preset="tiny", config={"ffn_hidden_dim": 99}, init_from="base.ckpt",
              lora={"rank": 4, "targets": ["q"], "base_quantization": "int8"})


def _base_checkpoint(path, config):
    torch.manual_seed(0)
    return save_recipe_checkpoint(path, config, LLaMA(config).state_dict())


@pytest.mark.slow
def test_lora_trains_only_adapters_equally_under_ddp_and_fsdp_and_resumes_exactly(tmp_path):
    """On 2 simulated NPUs, 32-true, for npu_ddp and npu_fsdp: only adapters change (the base is bit-identical
    after training, the optimizer holds adapters only), the checkpoint holds adapters only, a resume from it
    (base from init_from) reproduces the uninterrupted losses, and both strategies give the same losses (1e-5).
    Breakage seen: a fresh adapter initialised per shard under FSDP (losses differ between strategies), a resume
    that does not reload the base (resumed losses differ), checkpoints holding the base (keys check)."""
    base = _base_checkpoint(tmp_path / "base.ckpt", LLaMAConfig.from_preset("tiny"))
    results = {}
    for strategy in ("npu_ddp", "npu_fsdp"):
        out = tmp_path / strategy
        run_python([str(SCRIPTS / "lora_run.py"), str(out), str(base), strategy], timeout=200)
        results[strategy] = result = read_json(out / "result.json")
        assert result["base_identical"] and result["base_keys"] == TINY_TENSORS, strategy
        assert result["adapters_moved"] and result["trained_keys"] and result["adapter_keys"] == 4 * 7 * 2, strategy
        assert result["optimizer_holds_only_adapters"], strategy
        assert len(result["checkpoint_keys"]) == result["adapter_keys"]
        assert all(is_adapter_name(k) for k in result["checkpoint_keys"]), strategy
        assert result["checkpoint_lora"]["targets"] == list(ALL_TARGETS)
        resumed = [result["resumed_losses"][str(step)] for step in (3, 4, 5)]
        assert resumed == pytest.approx(result["losses"][3:], abs=1e-6), strategy
    ddp, fsdp = results["npu_ddp"]["losses"], results["npu_fsdp"]["losses"]
    assert len(ddp) == 6 and ddp[-1] < ddp[0] - 0.05  # it learns
    assert fsdp == pytest.approx(ddp, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_lora_on_a_quantized_base_trains_shards_the_codes_and_resumes_exactly(tmp_path, scheme):
    """The tiny SFT-style LoRA run on 2 simulated NPUs (npu_fsdp, bf16-mixed) on an int8 and an NF4 base: the loss
    falls; the base stays the codes ``quantized_base_state`` makes of init_from (checkpoints hold adapters only, and a
    resume rebuilds the same codes: the resumed losses are the uninterrupted ones); each rank's shard of the quantized
    weights is about 0.5x (int8) or 0.28x (nf4) of their bf16 bytes, and all its parameter bytes are the planner's;
    inside forward the codes are gathered whole and never cast (FSDP2's mixed precision gathers only the scales in
    bf16). Breakage seen: FSDP2 casting int8 codes to bf16 (codes dtype), a quantized base saved in checkpoints."""
    import yaml

    from lightning_npu.plan import load_spec, state_bytes

    base = _base_checkpoint(tmp_path / "base.ckpt", LLaMAConfig.from_preset("tiny"))
    out = tmp_path / scheme
    run_python([str(SCRIPTS / "lora_run.py"), str(out), str(base), "npu_fsdp", scheme], timeout=300)
    result = read_json(out / "result.json")
    losses = result["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05, losses
    resumed = [result["resumed_losses"][str(step)] for step in (3, 4, 5)]
    assert resumed == pytest.approx(losses[3:], abs=1e-6)
    assert result["base_identical"] and result["base_keys"] == TINY_TENSORS + 7 * 4  # each of 7 projections: codes + scales
    assert result["adapters_moved"] and result["optimizer_holds_only_adapters"]
    assert all(is_adapter_name(k) for k in result["checkpoint_keys"])
    assert result["checkpoint_lora"]["base_quantization"] == scheme
    codes_dtype = {"int8": "int8", "nf4": "uint8"}[scheme]
    assert result["gathered"] == {"weight_codes": [codes_dtype, [128, 128 if scheme == "int8" else 64]],
                                  "weight_scales": ["bfloat16", [128 if scheme == "int8" else 256]]}
    expected_ratio = {"int8": 0.5, "nf4": 0.28}[scheme]
    document = {"model": {"family": "llama", "preset": "tiny", "lora": result["checkpoint_lora"]},
                "trainer": {"devices": 2, "precision": "bf16-mixed", "strategy": "npu_fsdp"}}
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(document))
    planned = state_bytes(load_spec(tmp_path / "plan.yaml", profile="recipes.models.llama.memory_profile"))
    for rank in result["shard_bytes"]:
        ratio = (rank["codes"] + rank["scales"]) / rank["bf16"]
        assert ratio == pytest.approx(expected_ratio, rel=0.03), rank
        assert rank["all"] == planned["parameters"], rank


def test_merged_export_of_a_quantized_base_run_gives_the_recipe_logits_and_peft_loads_the_adapter(tmp_path,
                                                                                                monkeypatch):
    """The merged export adds the adapters to the decoded quantized base (the recipe's logits within 1e-5, fp32), not
    to the full-precision one (whose logits differ); the PEFT adapter loads into peft.PeftModel with every adapter
    weight, and its README says it was trained on a quantized base."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    config = LLaMAConfig.from_preset("tiny", n_layers=2)
    lora = {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "down"], "base_quantization": "nf4"}
    base, checkpoint, recipe = _lora_checkpoint(tmp_path, config, lora)
    for argv in (["to-hf", str(base), str(tmp_path / "hf_base")], ["to-peft", str(checkpoint), str(tmp_path / "peft")],
                 ["to-hf", str(checkpoint), str(tmp_path / "merged"), "--merge-lora"]):
        assert convert.main(argv) == 0, argv
    assert "**quantized** during training" in (tmp_path / "peft" / "README.md").read_text()
    assert "NF4" in (tmp_path / "peft" / "README.md").read_text()
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    recipe.eval()
    with torch.no_grad():
        expected = recipe(tokens)
        merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32).eval()
        hf_base = LlamaForCausalLM.from_pretrained(tmp_path / "hf_base", torch_dtype=torch.float32).eval()
        peft_model = PeftModel.from_pretrained(hf_base, tmp_path / "peft", torch_device="cpu").eval()
        on_full_precision_base = peft_model(tokens).logits
    assert (merged(tokens).logits - expected).abs().max() < 1e-5
    assert (on_full_precision_base - expected).abs().max() > 1e-3  # the quantization matters
    loaded = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert len(loaded) == 2 * 2 * 3
    layer = recipe.layers[1].feed_forward.w_down
    peft_a = loaded["base_model.model.model.layers.1.mlp.down_proj.lora_A.default.weight"]
    assert torch.equal(peft_a, layer.lora_a["down"].weight.detach())


def _lora_checkpoint(tmp_path, config, lora):
    """A LoRA checkpoint as the LightningModule writes it (its state_dict: adapters only), with nonzero adapters."""
    base = _base_checkpoint(tmp_path / "base.ckpt", config)
    module = DecoderLM(preset="tiny", config=config.to_dict(), init_from=str(base), lora=lora)
    module.configure_model()
    module.model.load_state_dict(quantized_base_state(read_model_tensors(base)[1], config, module.lora), strict=False)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in module.model.named_parameters():
            if ".lora_b." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    path = tmp_path / "lora.ckpt"
    import lightning

    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": lightning.__version__}, path)
    return base, path, module.model


def test_peft_adapter_and_merged_export_reproduce_the_recipe_logits(tmp_path, monkeypatch):
    """`to-peft` loaded by peft.PeftModel onto the `to-hf` export of the base, and `to-hf --merge-lora`, give the
    recipe's logits within 1e-5 (fp32), and differ from the base's. Breakage seen: gate/up adapters swapped,
    PEFT keys without `base_model.model.` (PEFT then loads nothing, with only a warning), alpha/rank dropped."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    config = LLaMAConfig.from_preset("tiny", n_layers=2)
    lora = {"rank": 4, "alpha": 12.0, "dropout": 0.1, "targets": ["q", "v", "o", "gate", "up", "down"]}
    base, checkpoint, recipe = _lora_checkpoint(tmp_path, config, lora)
    assert os.path.getsize(checkpoint) < os.path.getsize(base) / 5
    for argv in (["to-hf", str(base), str(tmp_path / "hf_base")], ["to-peft", str(checkpoint), str(tmp_path / "peft")],
                 ["to-hf", str(checkpoint), str(tmp_path / "merged"), "--merge-lora"]):
        assert convert.main(argv) == 0, argv
    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 12.0
    assert adapter_config["target_modules"] == ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    recipe.eval()
    with torch.no_grad():
        expected = recipe(tokens)
        hf_base = LlamaForCausalLM.from_pretrained(tmp_path / "hf_base", torch_dtype=torch.float32).eval()
        base_logits = hf_base(tokens).logits
        peft_model = PeftModel.from_pretrained(hf_base, tmp_path / "peft", torch_device="cpu").eval()
        peft_logits = peft_model(tokens).logits
        merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32).eval()
        merged_logits = merged(tokens).logits
    assert (base_logits - expected).abs().max() > 1e-2  # the adapters matter
    assert (peft_logits - expected).abs().max() < 1e-5
    assert (merged_logits - expected).abs().max() < 1e-5


def test_a_full_model_loaded_from_its_checkpoint_is_validated_as_loaded_not_as_its_init_from(tmp_path):
    """Catches init_from overwriting the weights of a module restored with load_from_checkpoint when it is first
    run (validate without fit): the fine-tuned model would be scored as its starting point."""
    import lightning
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    config = LLaMAConfig.from_preset("tiny", n_layers=1)
    base = _base_checkpoint(tmp_path / "base.ckpt", config)
    module = DecoderLM(preset="tiny", config=config.to_dict(), init_from=str(base))
    module.configure_model()
    torch.manual_seed(5)
    module.model.reset_parameters()  # "fine-tuned" weights, unlike the base's
    path = tmp_path / "tuned.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": lightning.__version__}, path)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = module.model(tokens)
    loaded = DecoderLM.load_from_checkpoint(path)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    (logits,) = trainer.predict(loaded, DataLoader(tokens, batch_size=2))
    torch.testing.assert_close(logits, expected)


def test_generate_reads_a_lora_checkpoint_on_its_recorded_base_or_on_one_given_after_it_moved(tmp_path, capsys):
    """Catches generate.py unable to read a LoRA checkpoint at all, and no way to name a base that moved (the error
    told users to pass --base, which generate.py did not take)."""
    from recipes import generate

    config = LLaMAConfig.from_preset("tiny", n_layers=1)
    base, checkpoint, recipe = _lora_checkpoint(tmp_path, config, {"rank": 2, "targets": ["q", "v"]})
    tokens = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = recipe.eval()(tokens)
        torch.testing.assert_close(generate.load_model(checkpoint)[0](tokens), expected)
        moved = base.rename(tmp_path / "moved.ckpt")
        with pytest.raises(FileNotFoundError):
            generate.load_model(checkpoint)
        torch.testing.assert_close(generate.load_model(checkpoint, base=moved)[0](tokens), expected)
    argv = [str(checkpoint), "--prompt", "The", "--max-new-tokens", "2", "--tokenizer", DEFAULT_TOKENIZER]
    assert generate.main([*argv, "--base", str(moved)]) == 0
    assert generate.main(argv) == 1 and "(its init_from), does not exist; pass --base" in capsys.readouterr().err


def test_lora_flops_per_token_count_no_weight_gradients_for_the_frozen_base():
    """Catches MFU of a LoRA run counted as a full fine-tune's (6 FLOPs per frozen weight instead of 4), 1.5x too
    high for the base's matmuls."""
    config = LLaMAConfig.from_preset("7b")
    lora = {"rank": 16, "targets": list(ALL_TARGETS)}
    full = DecoderLM(preset="7b").flops_per_token
    adapted = DecoderLM(preset="7b", init_from="base", lora=lora).flops_per_token
    adapters = 32 * 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008))  # A [r, in] + B [out, r] per projection
    n = config.num_params(include_embedding=False)
    assert full - adapted == 2 * n - 6 * adapters


def test_to_hf_of_a_lora_checkpoint_without_merge_lora_is_refused(tmp_path, capsys):
    """Catches `to-hf` on a LoRA checkpoint failing with a confusing "lacks N tensors" (or writing a broken model)
    instead of pointing at --merge-lora / to-peft."""
    _, checkpoint, _ = _lora_checkpoint(tmp_path, LLaMAConfig.from_preset("tiny", n_layers=1), {"rank": 2, "targets": ["q"]})
    assert convert.main(["to-hf", str(checkpoint), str(tmp_path / "out")]) == 1
    assert "is a LoRA checkpoint" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("stage", "restore"), [("validate", "ckpt_path"), ("predict", "ckpt_path"),
                                              ("predict", "load_from_checkpoint")])
def test_a_lora_checkpoint_evaluated_without_fit_runs_on_its_base_and_adapters(tmp_path, stage, restore):
    """`trainer.validate` / `trainer.predict` of a LoRA checkpoint (given as ckpt_path, or loaded with
    DecoderLM.load_from_checkpoint) and no `fit` before: the base comes from init_from and the adapters from the
    checkpoint, so the module computes the merged model (generate.py's view of the checkpoint). Breakage seen: the
    base loaded only in on_fit_start (random base weights under evaluation); adapters of a loaded module redrawn
    as fresh ones (the base's outputs)."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from recipes.generate import load_model

    config = LLaMAConfig.from_preset("tiny", n_layers=2)
    lora = {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "down"]}
    base, checkpoint, _ = _lora_checkpoint(tmp_path, config, lora)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        merged = load_model(checkpoint)[0]
        expected = merged(tokens)
    if restore == "load_from_checkpoint":
        module, ckpt_path = DecoderLM.load_from_checkpoint(checkpoint), None
    else:
        module, ckpt_path = DecoderLM(preset="tiny", config=config.to_dict(), init_from=str(base), lora=lora), str(checkpoint)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    if stage == "predict":
        (logits,) = trainer.predict(module, DataLoader(tokens, batch_size=2), ckpt_path=ckpt_path)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    else:
        batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
        (result,) = trainer.validate(module, DataLoader([batch], batch_size=None), ckpt_path=ckpt_path)
        loss = torch.nn.functional.cross_entropy(expected[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        assert result["val_loss"] == pytest.approx(float(loss), abs=1e-5)
