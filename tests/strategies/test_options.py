"""npu_fsdp's options are declared once (``lightning_npu.facts.options.FSDPOptions``): both strategies' signatures,
their checks, LightningCLI's parsing, the planner's reading of a config and the docs' options table all come from it."""

import dataclasses
import typing

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_npu import NPUFabricFSDPStrategy, NPUFSDPStrategy
from lightning_npu.facts.options import FSDPOptions
from lightning_npu.plan import load_spec
from lightning_npu.plan.shape import PlanError
from tests.helpers import REPO
from tools.generate_docs import BLOCKS, with_block

DECLARED = dataclasses.fields(FSDPOptions)


def test_the_docs_options_table_is_generated_from_the_declaration():
    """Fails when an option's name, default or help changed without `python tools/generate_docs.py`, and checks that
    the generator repairs a stale row (docs/strategies.md holds the table; nothing else copies it)."""
    page = REPO / BLOCKS["options"][0]
    text = page.read_text()
    assert with_block(text, "options") == text, f"{page}: the options table is stale; run python tools/generate_docs.py"
    stale = text.replace("| `expert_parallel_size` | `1` |", "| `expert_parallel_size` | `2` |")
    assert stale != text and with_block(stale, "options") == text
    assert "| `expert_parallel_size` |" not in (REPO / "README.md").read_text()


@pytest.mark.parametrize("strategy", [NPUFSDPStrategy, NPUFabricFSDPStrategy])
def test_both_strategies_take_every_declared_option_with_its_default_and_type(strategy):
    """Catches a keyword the declaration lacks (or the reverse), a default or type that differs from it, or a
    signature jsonargparse cannot read (``**kwargs``): LightningCLI builds its init_args from these parameters."""
    import inspect

    parameters = inspect.signature(strategy).parameters
    types = typing.get_type_hints(FSDPOptions)
    assert list(parameters) == [spec.name for spec in DECLARED]
    for spec in DECLARED:
        assert (parameters[spec.name].default, parameters[spec.name].annotation) == (spec.default, types[spec.name])
        assert f"    {spec.name}: {spec.metadata['help']}\n" in strategy.__init__.__doc__
    assert dataclasses.asdict(strategy().options) == dataclasses.asdict(FSDPOptions())
    positional = strategy([], 2).options  # positions as before: auto_wrap_policy, zero_stage, ...
    assert (positional.auto_wrap_policy, positional.zero_stage) == ([], 2)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"zero_stag": 2}, r"NPUFSDPStrategy: 'zero_stag' \(did you mean 'zero_stage'\?\) is not an option of npu_fsdp;"
                       r" its options are auto_wrap_policy, zero_stage, "),
    ({"activation_checkpoint_ratio": 0.5, "tp": 2},
     r"'activation_checkpoint_ratio' \(did you mean 'activation_checkpointing_ratio'\?\), 'tp' are not options"),
])
def test_an_unknown_option_is_refused_with_the_closest_name(kwargs, message):
    with pytest.raises(TypeError, match=message):
        NPUFSDPStrategy(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cpu_offload": "false"}, r"cpu_offload='false' must be True or False \(in YAML: true or false\)"),
    ({"sequence_parallel": 1}, r"sequence_parallel=1 must be True or False"),
    ({"state_dict_type": "dcp"}, r"state_dict_type='dcp' is not supported; use 'sharded' \(a distributed checkpoint"),
    ({"timeout": 0}, r"timeout=0 must be a positive number of seconds, e.g. timeout=1800"),
    ({"async_save": True, "state_dict_type": "full"}, r"async_save=True needs state_dict_type='sharded'"),
    ({"expert_parallel_size": 0}, r"expert_parallel_size=0 must be a positive integer"),
])
def test_a_bad_value_is_refused_with_the_value_and_the_fix(kwargs, message):
    for strategy in (NPUFSDPStrategy, NPUFabricFSDPStrategy):
        with pytest.raises(ValueError, match=message):
            strategy(**kwargs)


def _config(tmp_path, init_args):
    path = tmp_path / "tiny.yaml"
    document = yaml.safe_load((REPO / "recipes/models/llama/configs/tiny.yaml").read_text())
    # The block by import path: the planner finds the model's memory profile next to it, not next to this copy.
    block = "recipes.models.llama.model.TransformerBlock"
    document["trainer"]["strategy"]["init_args"].update(auto_wrap_policy=[block], **init_args)
    path.write_text(yaml.safe_dump(document))
    return path


def test_the_planner_reads_a_config_s_options_through_the_declaration(tmp_path):
    """Catches the planner ignoring a misspelt option (planning npu_fsdp's default instead), accepting a value the
    strategy refuses, or refusing an option it does not model (state_dict_type, timeout)."""
    spec = load_spec(_config(tmp_path, {"zero_stage": 2, "cpu_offload": True, "state_dict_type": "full",
                                        "timeout": 600, "sequence_parallel": False}))
    assert (spec.zero_stage, spec.cpu_offload, spec.parallel.sequence_parallel) == (2, True, False)
    with pytest.raises(PlanError, match=r"trainer.strategy.init_args: 'zero_stages' \(did you mean 'zero_stage'\?\)"):
        load_spec(_config(tmp_path, {"zero_stages": 2}))
    with pytest.raises(PlanError, match=r"tiny.yaml': activation_checkpointing_ratio=1.5 must lie in \[0, 1\]"):
        load_spec(_config(tmp_path, {"activation_checkpointing_ratio": 1.5}))


def test_lightning_cli_yaml_init_args_reach_the_strategy(tmp_path, simulate, monkeypatch):
    """LightningCLI (jsonargparse) reads the generated signature: init_args of several kinds (int, Literal, float,
    timeout, bool, list of class names) parse, are typed, and reach the strategy's options; a misspelt one is
    refused by the parser."""
    import sys

    simulate(2)
    monkeypatch.setattr(sys, "argv", ["cli"])
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": {
        "accelerator": "npu", "devices": 2, "logger": False,
        "strategy": {"class_path": "lightning_npu.NPUFSDPStrategy", "init_args": {
            "zero_stage": 2, "sharding": "hybrid", "activation_checkpointing_ratio": 0.5, "state_dict_type": "full",
            "timeout": 120, "auto_wrap_policy": ["Linear"], "tensor_parallel_size": 2, "context_parallel_algo": "ring",
            "loss_parallel": False}}}}))
    cli = LightningCLI(BoringModel, run=False, save_config_callback=None,
                       args=["--config", str(config), "--trainer.strategy.init_args.cpu_offload", "true"])
    options = cli.trainer.strategy.options
    assert dataclasses.asdict(options) == dataclasses.asdict(FSDPOptions(
        zero_stage=2, sharding="hybrid", activation_checkpointing_ratio=0.5, state_dict_type="full", timeout=120.0,
        auto_wrap_policy=["Linear"], tensor_parallel_size=2, context_parallel_algo="ring", loss_parallel=False,
        cpu_offload=True))
    assert cli.trainer.strategy._timeout.total_seconds() == 120
    with pytest.raises(SystemExit):
        LightningCLI(BoringModel, run=False, save_config_callback=None,
                     args=["--config", str(config), "--trainer.strategy.init_args.zero_stag", "3"])
