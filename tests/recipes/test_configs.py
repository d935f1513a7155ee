"""Every YAML config the recipe ships parses through the recipe's own CLI and builds its LightningModule, so a typo
in a config (an unknown key, a bad LoRA target, a data class that does not take an option) fails here, not on a
cluster after the job was queued."""

import sys

import pytest
import yaml

from recipes import train
from recipes.decoder.module import DecoderLM
from recipes.posttrain.dpo import DPOLM
from tests.helpers import REPO

CONFIGS = sorted((REPO / "recipes" / "models").glob("*/configs/*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_every_shipped_config_parses_and_builds_its_module(config, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])  # LightningCLI warns when pytest's own arguments are there too
    if config.name.endswith("_grpo.yaml"):  # recipes/posttrain/train_grpo.py's configs
        return _check_grpo_config(config, capsys)
    # A post-training config (its data a recipes.posttrain class) runs through its objective's command
    # (recipes/posttrain/train_dpo.py), the others through train.py.
    data_class = ((yaml.safe_load(config.read_text()).get("data") or {}).get("class_path") or "")
    module_class = DPOLM if data_class.startswith("recipes.posttrain.") else DecoderLM
    with pytest.raises(SystemExit) as exited:
        train.main(["fit", "--config", str(config), "--print_config"], model_class=module_class)
    assert exited.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    model = dict(printed["model"])
    if model.get("lora") and not model.get("init_from"):
        model["init_from"] = "given on the command line"  # tiny_sft_lora.yaml: --model.init_from <pretrained ckpt>
    module = module_class(**model)
    data = printed["data"]["init_args"]
    assert module.config.max_seq_len >= data.get("seq_len", data.get("max_length"))
    assert printed["data"]["class_path"].startswith(("recipes.decoder.", "recipes.posttrain."))
    if config.name == "tiny_sft_lora.yaml":  # no path given: SFTDataModule's own default, not the text data's
        assert printed["data"]["init_args"]["path"].endswith("assets/instructions.jsonl")
        assert printed["data"]["init_args"]["val_fraction"] == 0.05


def _check_grpo_config(config, capsys):
    from recipes.posttrain import train_grpo
    from recipes.posttrain.grpo_module import GRPOModule

    with pytest.raises(SystemExit) as exited:
        train_grpo.main(["fit", "--config", str(config), "--print_config"])
    assert exited.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    module = GRPOModule(**{**printed["model"], "init_from": None})  # a real run's init_from is a path on the cluster
    assert module.config.max_seq_len >= printed["data"]["seq_len"]


def test_the_fine_tuning_configs_are_the_ones_the_readme_names():
    names = {path.name for path in CONFIGS}
    assert {"tiny_sft_lora.yaml", "llama2_7b_sft.yaml", "llama2_7b_lora.yaml", "llama3_8b_lora.yaml"} <= names


def test_a_run_without_a_data_section_trains_on_the_embedded_text(capsys, monkeypatch):
    """Catches the data section becoming required (LightningCLI's subclass mode) for a run that names none."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit):
        train.main(["fit", "--model.preset", "tiny", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["class_path"] == "recipes.decoder.data.TextDataModule"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_every_shipped_config_plans_and_fits_on_the_nodes_it_names(config):
    """``lightning-npu plan --config`` with no flags (the devices, nodes, precision and strategy the YAML names, on
    the default 64 GiB 910B) says each shipped config fits: the real-size ones' headers promise it. Fails for a
    config whose model family has no memory profile, and for one that outgrows its nodes (Mixtral-8x7B fully
    fine-tuned on 2 x 8 NPUs: 119 GiB, each rank holding a whole padded expert per layer)."""
    from lightning_npu.plan import estimate, load_spec

    spec = load_spec(config)
    planned = estimate(spec)
    assert planned.fits, (
        f"{config.name} on {spec.nodes} x {spec.devices} devices: planned {planned.total / 2**30:.1f} GiB of"
        f" {planned.device_bytes / 2**30:.0f} GiB ({planned.peak_phase})"
    )
