"""One rule set for a parallel layout, three readers (``lightning_npu.facts.parallel_rules``): the recipe's check
before workers start (``recipes/train.py`` ``check_parallel_layout``), the runtime's on every rank
(``DecoderLM.configure_model``) and the planner's (``PlanSpec``) refuse the same layout with the same message. The
planner's npu_fsdp options are ``FSDPOptions`` itself, and ``lightning-npu plan``'s flags are generated from it."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import re
from types import SimpleNamespace

import pytest

from lightning_npu.cli import main
from lightning_npu.cli import plan as plan_cli
from lightning_npu.facts import parallel_rules
from lightning_npu.facts.options import FSDPOptions
from lightning_npu.facts.parallel_rules import ModelShapes
from lightning_npu.plan import ModelShape, Parallelism, Pipelining, PlanError, PlanSpec, load_spec

TINY_CONFIG = "recipes/models/llama/configs/tiny.yaml"
SEQ_LEN, BATCH_SIZE = 32, 8


def _module(family: str, config: dict):
    from recipes.decoder.module import DecoderLM

    return DecoderLM(family=family, preset="tiny", config=config)


def _trainer(options: FSDPOptions) -> SimpleNamespace:
    return SimpleNamespace(strategy=SimpleNamespace(options=options))


def recipe_refusal(family: str, config: dict, options: FSDPOptions, devices: int) -> str:
    """train.py's check before any worker starts, with the recipe's data."""
    from recipes.decoder.data import TextDataModule
    from recipes.train import check_parallel_layout

    with pytest.raises(ValueError) as refused:
        check_parallel_layout(_module(family, config), TextDataModule(batch_size=BATCH_SIZE, seq_len=SEQ_LEN),
                              _trainer(options))
    return str(refused.value)


def runtime_refusal(family: str, config: dict, options: FSDPOptions, devices: int) -> str:
    """What every rank checks when the strategy builds the model (a script that builds DecoderLM itself)."""
    module = _module(family, config)
    module._trainer = _trainer(options)
    with pytest.raises(ValueError) as refused:
        module.configure_model()
    assert module.model is None  # refused before the model is built or split
    return str(refused.value)


def planner_refusal(family: str, config: dict, options: FSDPOptions, devices: int) -> str:
    """``lightning-npu plan``'s, from the family's memory profile (no model)."""
    profile = importlib.import_module(f"recipes.models.{family}.memory_profile").lightning_npu_memory_profile(
        {"family": family, "preset": "tiny", "config": config})
    with pytest.raises(PlanError) as refused:
        PlanSpec(model=profile.shape, profile=profile, seq_len=SEQ_LEN, micro_batch=BATCH_SIZE, devices=devices,
                 options=options)
    return str(refused.value).replace(profile.name, "this model")


BAD_LAYOUTS = [
    pytest.param("llama", {}, dict(tensor_parallel_size=8), 8,
                 r"^tensor_parallel_size=8 cannot split this model: n_heads=4 is not divisible by"
                 r" tensor_parallel_size=8.*n_kv_heads=2 is not divisible.*divides them \(1, 2\)", id="tp-heads"),
    pytest.param("llama", {}, dict(tensor_parallel_size=2, context_parallel_size=4), 8,
                 r"heads % \(tp x cp\) == 0 \(4 % 8 = 4\).*or context_parallel_algo='ring'", id="ulysses-heads"),
    pytest.param("deepseek", {"mtp_layers": 1}, dict(context_parallel_size=2), 2,
                 r"^context_parallel_size=2: model.config.mtp_layers=1: multi-token prediction reads the tokens up to"
                 r" 1 ahead.*set mtp_layers=0$", id="cp-mtp"),
    pytest.param("llama", {"tie_embeddings": True}, dict(pipeline_parallel_size=2), 2,
                 r"^pipeline_parallel_size=2 cannot run this model: model.config.tie_embeddings=true: the embedding"
                 r" \(first stage\) and the head \(last stage\)", id="pp-tied"),
    pytest.param("moe", {"router_aux_loss_coef": 0.01}, dict(pipeline_parallel_size=2), 2,
                 r"model.config.router_aux_loss_coef=0.01: the load-balancing loss sums the routing", id="pp-aux-loss"),
    pytest.param("deepseek", {"mtp_layers": 1}, dict(pipeline_parallel_size=2), 2,
                 r"model.config.mtp_layers=1: multi-token prediction runs the embedding again", id="pp-mtp"),
    pytest.param("llama", {"n_layers": 1}, dict(pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B",
                                                pipeline_microbatches=4), 2,
                 r"1 blocks do not spread over 4 pipeline stages", id="pp-blocks"),
]


@pytest.mark.parametrize("family, config, options, devices, message", BAD_LAYOUTS)
def test_each_rule_gives_the_same_refusal_to_the_recipe_the_runtime_and_the_planner(family, config, options, devices,
                                                                                    message):
    """Catches a rule written again in one reader (its own words, or a check the others lack: the runtime used to
    check only the pipeline, the planner and the recipe worded every pipeline refusal apart)."""
    options = FSDPOptions(**options)
    refusals = {reader.__name__: reader(family, config, options, devices)
                for reader in (recipe_refusal, runtime_refusal, planner_refusal)}
    for reader, refusal in refusals.items():
        assert re.search(message, refusal), (reader, refusal)
    assert len(set(refusals.values())) == 1, refusals


def test_a_layout_the_rules_accept_passes_all_three_readers():
    options = FSDPOptions(tensor_parallel_size=2, context_parallel_size=2, context_parallel_algo="ring")
    from recipes.decoder.data import TextDataModule
    from recipes.train import check_parallel_layout

    module = _module("llama", {})
    check_parallel_layout(module, TextDataModule(batch_size=BATCH_SIZE, seq_len=SEQ_LEN), _trainer(options))
    module._trainer = _trainer(options)
    module.configure_model()
    profile = importlib.import_module("recipes.models.llama.memory_profile").lightning_npu_memory_profile(
        {"preset": "tiny"})
    spec = PlanSpec(model=profile.shape, profile=profile, seq_len=SEQ_LEN, micro_batch=BATCH_SIZE, devices=4,
                    options=options)
    assert (spec.parallel.tensor, spec.parallel.context, spec.local_seq_len) == (2, 2, SEQ_LEN // 2)


# ------------------------------------------------------------------------------- the planner reads FSDPOptions


OPTION_NAMES = {spec.name for spec in dataclasses.fields(FSDPOptions)}


def test_the_planner_declares_no_npu_fsdp_option_of_its_own():
    """Fails if an option is declared again: a planner dataclass field or a load_spec keyword of an option's name
    (or one of the short names the planner used to give them), instead of one ``FSDPOptions`` held by the spec."""
    old_names = {"tensor", "context", "context_algo", "size", "schedule", "microbatches", "stages_per_rank",
                 "layers_per_stage"}
    assert [spec.name for spec in dataclasses.fields(Parallelism)] == ["options"]
    assert [spec.name for spec in dataclasses.fields(Pipelining)] == ["options"]
    spec_fields = {spec.name: spec.type for spec in dataclasses.fields(PlanSpec)}
    assert not (OPTION_NAMES | old_names) & set(spec_fields), spec_fields
    assert "options" in spec_fields
    parameters = inspect.signature(load_spec).parameters
    assert not (OPTION_NAMES | old_names) & set(parameters)
    assert [p.kind for p in parameters.values()][-1] is inspect.Parameter.VAR_KEYWORD


def test_load_spec_takes_every_parallel_option_by_its_npu_fsdp_name_and_refuses_other_names():
    given = dict(zero_stage=2, sharding="full", cpu_offload=True, tensor_parallel_size=2, context_parallel_size=2,
                 context_parallel_algo="ring", sequence_parallel=False, loss_parallel=False,
                 pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B", pipeline_microbatches=4,
                 pipeline_stages_per_rank=2, pipeline_layers_per_stage=[1, 1, 1, 1])
    shape = ModelShape(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=352,
                       max_seq_len=64)
    spec = load_spec(model_shape=shape, devices=8, seq_len=64, micro_batch=4, **given)
    assert {name: getattr(spec.options, name) for name in given} == given
    assert (spec.zero_stage, spec.cpu_offload, spec.parallel.context_algo, spec.pipeline.num_stages) == (
        2, True, "ring", 4)
    with pytest.raises(PlanError, match=r"'tensor_parallel' \(did you mean 'tensor_parallel_size'\?\) is not an"
                                        r" option of npu_fsdp"):
        load_spec(model_shape=shape, tensor_parallel=2)


def test_every_npu_fsdp_option_is_a_plan_flag_generated_from_its_declaration():
    """One flag per option (its name with dashes, its help and default), the short ALIASES beside them, values read
    as YAML reads them; fails on a hand-listed flag set (the planner had six)."""
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    by_dest = {action.dest: action for action in parser._actions}
    assert OPTION_NAMES <= set(by_dest)
    for spec in dataclasses.fields(FSDPOptions):
        action = by_dest[spec.name]
        assert action.option_strings == ["--" + spec.name.replace("_", "-"), *plan_cli.ALIASES.get(spec.name, ())]
        assert action.help.startswith(spec.metadata["help"].replace("%", "%%")[:40]), (spec.name, action.help)
    assert set(plan_cli.ALIASES) <= OPTION_NAMES
    args = parser.parse_args(["--pipeline-layers-per-stage", "[1, 3]", "--sequence-parallel", "false",
                              "--tp", "2", "--pipeline-schedule", "GPipe", "--timeout", "60"])
    assert (args.pipeline_layers_per_stage, args.sequence_parallel, args.tensor_parallel_size,
            args.pipeline_schedule, args.timeout) == ([1, 3], False, 2, "GPipe", 60)


def test_a_generated_flag_and_its_alias_plan_the_same(capsys):
    assert main(["plan", "--config", TINY_CONFIG, "--devices", "4", "--tensor-parallel-size", "2",
                 "--context-parallel-algo", "ring", "--context-parallel-size", "2", "--json"]) == 0
    long = json.loads(capsys.readouterr().out)
    assert main(["plan", "--config", TINY_CONFIG, "--devices", "4", "--tp", "2", "--cp-algo", "ring", "--cp", "2",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == long
    assert (long["parallel"]["tensor"], long["parallel"]["context"], long["parallel"]["context_algo"]) == (
        2, 2, "ring")
    assert main(["plan", "--config", TINY_CONFIG, "--sequence-parallel", "maybe"]) == 2
    assert "sequence_parallel='maybe' must be True or False" in capsys.readouterr().err


def test_an_objectives_refusals_stop_its_layouts_with_its_reason():
    """A post-training loss that a layout cannot run (DPO under a pipeline or context parallelism) says so through the
    same rules: each refusal raised for its own dimension only."""
    shapes = ModelShapes(n_layers=4, n_heads=4, pipeline_refusals=("the loss needs whole sequences; use dp",),
                         context_parallel_refusals=("the loss sums whole sequences; use dp",))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 .*the loss needs whole sequences; use dp"):
        parallel_rules.check(FSDPOptions(pipeline_parallel_size=2), shapes)
    with pytest.raises(ValueError, match=r"context_parallel_size=2: the loss sums whole sequences; use dp"):
        parallel_rules.check(FSDPOptions(context_parallel_size=2), shapes)
    parallel_rules.check(FSDPOptions(tensor_parallel_size=2), shapes)
