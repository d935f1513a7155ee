"""The recipe's model families: a config or checkpoint names its family, the registry refuses unknown ones, and what
the recipe wrote before families existed (``recipes.llama2.*`` class paths, checkpoints without a family, tokenizer
paths in the old assets directory) still loads."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import lightning
import pytest
import torch
import yaml

from lightning_npu.plan import load_spec
from recipes import convert, families, generate, train
from recipes.decoder import checkpoint_layout
from recipes.decoder.module import DecoderLM
from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.model import LLaMA
from tests.helpers import REPO

TINY = REPO / "recipes" / "models" / "llama" / "configs" / "tiny.yaml"
ASSETS_TOKENIZER = REPO / "recipes" / "assets" / "tokenizer"
SHAPE = dict(vocab_size=2048, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden_dim=64, max_seq_len=64)


def legacy_checkpoint(path: Path, checkout: Path) -> Path:
    """A checkpoint as the recipe wrote it in ``recipes/llama2/`` (its hyper-parameters, read from a real one of
    that version): no ``family``, and the tokenizer recorded absolute in that checkout's old assets directory."""
    config = LLaMAConfig.from_preset("tiny", **SHAPE)
    torch.manual_seed(0)
    model = LLaMA(config)
    hparams = {
        "preset": "tiny", "config": config.to_dict(), "learning_rate": 0.003, "min_lr_ratio": 0.1,
        "warmup_steps": 20, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-08, "init_from": None,
        "lora": None, "tokenizer_path": str(checkout / "recipes" / "llama2" / "assets" / "tokenizer"),
        "_instantiator": "lightning.pytorch.cli.instantiate_module",
    }
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "hyper_parameters": hparams,
                "pytorch-lightning_version": lightning.__version__}, path)
    return path


def test_an_unknown_family_is_refused_naming_the_known_ones():
    known = re.escape(str(sorted(families.FAMILIES)))
    assert {"llama", "moe", "qwen"} <= set(families.FAMILIES)
    with pytest.raises(ValueError, match=r"model.family='mixtral' is not a model family.*" + known):
        DecoderLM(family="mixtral")
    hparams = {"family": "mixtral", "config": LLaMAConfig.from_preset("tiny").to_dict()}
    with pytest.raises(checkpoint_layout.CheckpointError, match=r"family.*'mixtral'.*" + known):
        checkpoint_layout.config_from_hparams(hparams, source="ckpt")


def test_the_configured_family_builds_its_model_and_checkpoints_record_it(tmp_path):
    module = DecoderLM(family="llama", preset="tiny", config=SHAPE)
    module.configure_model()
    assert isinstance(module.model, LLaMA) and module.hparams.family == "llama"
    written = checkpoint_layout.save_recipe_checkpoint(tmp_path / "m.ckpt", module.config, module.model.state_dict())
    assert checkpoint_layout.read_recipe_metadata(written)["hyper_parameters"]["family"] == "llama"
    assert checkpoint_layout.load_recipe_checkpoint(written)[0] == module.config


def test_every_shipped_config_names_its_family():
    for config in (REPO / "recipes" / "models").glob("*/configs/*.yaml"):
        family = config.parents[1].name
        assert yaml.safe_load(config.read_text())["model"]["family"] == family, config
        assert families.FAMILIES[family] == f"recipes.models.{family}.family"


def test_a_checkpoint_of_the_llama2_layout_generates_converts_and_resumes(tmp_path, monkeypatch, capsys):
    old = legacy_checkpoint(tmp_path / "last.ckpt", checkout=tmp_path / "old-checkout")
    model, tokenizer = generate.load_model(old)
    assert isinstance(model, LLaMA) and model.config == LLaMAConfig.from_preset("tiny", **SHAPE)
    assert tokenizer == str(ASSETS_TOKENIZER)  # the old assets directory, found in its new place
    assert generate.main([str(old), "--prompt", "The", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert convert.main(["to-hf", str(old), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    train.check_resume_checkpoint(str(old), LLaMAConfig.from_preset("tiny", **SHAPE))
    # Resuming: LightningCLI parses the checkpoint's hyper-parameters into the configured model (no family: llama).
    monkeypatch.setattr(sys, "argv", ["train.py"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main(["fit", "--config", str(TINY), "--model.config", json.dumps(SHAPE), "--ckpt_path", str(old),
                    "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["family"] == "llama" and printed["model"]["config"]["dim"] == SHAPE["dim"]


def test_resuming_a_checkpoint_as_another_family_is_refused_before_training(tmp_path, monkeypatch):
    class OtherConfig(LLaMAConfig):
        """A stand-in second family's config (the registry's lookup is by class)."""

    other = dataclasses.replace(families.get("llama"), config_class=OtherConfig)
    monkeypatch.setitem(families.FAMILIES, "other", "unused")
    real_get = families.get
    monkeypatch.setattr(families, "get", lambda name: other if name == "other" else real_get(name))
    old = legacy_checkpoint(tmp_path / "last.ckpt", checkout=tmp_path)
    with pytest.raises(ValueError, match="holds a model of family 'llama', but the config's model.family is 'other'"):
        train.check_resume_checkpoint(str(old), OtherConfig.from_preset("tiny", **SHAPE))


def test_the_old_module_names_are_the_new_modules():
    from jsonargparse.typing import import_object

    import recipes.llama2.model as old_model
    from recipes.llama2.sft_data import SFTDataModule
    from recipes.decoder import sft_data
    from recipes.models.llama import model

    assert old_model is model and SFTDataModule is sft_data.SFTDataModule
    assert import_object("recipes.llama2.model.TransformerBlock") is model.TransformerBlock
    assert import_object("recipes.llama2.data.TextDataModule").__module__ == "recipes.decoder.data"


def test_an_old_config_is_planned_by_the_profile_its_old_class_path_names(tmp_path):
    document = yaml.safe_load((REPO / "recipes" / "models" / "llama" / "configs" / "llama2_7b.yaml").read_text())
    del document["model"]["family"]
    policy = document["trainer"]["strategy"]["init_args"]
    policy["auto_wrap_policy"] = policy["activation_checkpointing_policy"] = ["recipes.llama2.model.TransformerBlock"]
    config = tmp_path / "old_7b.yaml"
    config.write_text(yaml.safe_dump(document))
    spec = load_spec(config)
    assert spec.profile.name == "LLaMA 7b" and spec.profile.block_class == "recipes.models.llama.model.TransformerBlock"
    # The planner imports profiles without torch; the alias keeps it so.
    script = "import sys, recipes.llama2.memory_profile; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=120).returncode == 0


def test_lora_adapts_the_sites_the_family_names_and_refuses_a_target_it_lacks(monkeypatch):
    from recipes.decoder.lora import LoRAConfig, add_lora

    llama = families.get("llama")
    config = LLaMAConfig.from_preset("tiny", **SHAPE)
    adapted = add_lora(LLaMA(config), LoRAConfig(targets=["q", "gate"]))
    assert {type(adapted.layers[0].attention.wq).__name__, type(adapted.layers[0].feed_forward.w_gate).__name__} == {
        "LoRALinear"}
    without_gate = dataclasses.replace(llama, lora_sites={k: v for k, v in llama.lora_sites.items() if k != "gate"})
    monkeypatch.setattr(families, "get", lambda name: without_gate)
    with pytest.raises(ValueError, match=r"names 'gate', which the 'llama' family's blocks do not have; choose among"):
        add_lora(LLaMA(config), LoRAConfig(targets=["q", "gate"]))


def test_a_config_saved_by_a_run_of_the_llama2_layout_parses_and_finds_its_data(tmp_path, monkeypatch, capsys):
    """The data section of the config.yaml LightningCLI saved next to such a run (class path and paths as written)."""
    old_assets = tmp_path / "old-checkout" / "recipes" / "llama2" / "assets"
    saved = {
        "seed_everything": 1234,
        "model": {"preset": "tiny", "config": SHAPE, "learning_rate": 0.003},
        "data": {"class_path": "recipes.llama2.data.TextDataModule",
                 "init_args": {"path": str(old_assets / "corpus.jsonl"), "tokenizer": str(old_assets / "tokenizer"),
                               "seq_len": 32, "batch_size": 2, "val_fraction": 0.02}},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2,
                    "strategy": {"class_path": "lightning_npu.NPUFSDPStrategy",
                                 "init_args": {"auto_wrap_policy": ["recipes.llama2.model.TransformerBlock"]}}},
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(saved))
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as exited:
        train.main(["fit", "--config", str(config), "--print_config"])
    assert exited.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["family"] == "llama"
    from jsonargparse.typing import import_object

    data = import_object(printed["data"]["class_path"])(**printed["data"]["init_args"])
    assert data.path == str(REPO / "recipes" / "assets" / "corpus.jsonl")
    assert data.tokenizer_path == str(ASSETS_TOKENIZER)
