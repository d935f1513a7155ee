"""litgpt 0.5.13 on 2 simulated NPUs, started as docs/porting.md says (tests/strategies/scripts/litgpt_npu.py: litgpt's own
entry point after ``import lightning_npu``), from the same random weights and the recipes' tokenizer and data
(tests/strategies/scripts/litgpt_data.py). litgpt is installed apart from the test extra (it pins older huggingface-hub and
jsonargparse than ours, yet runs with them): .ci/run's litgpt line, docs/contributing/testing.md."""

import csv
import importlib.util
import math

import pytest
import torch
import yaml

from tests.helpers import room_scripts, run_python

pytestmark = pytest.mark.slow

if importlib.util.find_spec("litgpt") is None:
    pytest.fail("litgpt is not installed in this environment, and tests/strategies/test_litgpt.py runs it: install it as .ci/run"
                " does (its litgpt line; docs/contributing/testing.md)", pytrace=False)

from tests.strategies.scripts.litgpt_data import MODEL_CONFIG, SEQ_LEN, TOKENIZER, write_checkpoint_dir, write_instructions  # noqa: E402

SCRIPTS = room_scripts("strategies")
LITGPT = str(SCRIPTS / "litgpt_npu.py")
#: pretrain compiles the model (torch.compile), which on the CPU costs most of a launch and checks nothing here.
NOT_COMPILED = {"TORCHDYNAMO_DISABLE": "1"}
LORA = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_query": True, "lora_value": True}
STEPS = 4
#: 4 optimizer steps of 4 rows (2 ranks x 2 micro-batches of 1); no checkpoint, validation or sample on the way.
SCHEDULE = {"log_interval": 1, "global_batch_size": 4, "micro_batch_size": 1, "lr_warmup_steps": 1,
            "max_seq_length": SEQ_LEN}
QUIET_EVAL = {"interval": 1000, "max_iters": 1, "initial_validation": False, "final_validation": False}


def litgpt(command, config, tmp_path, env=None):
    """``litgpt <command> --config <config as YAML>`` on 2 simulated NPUs, which litgpt's ``accelerator="auto"``
    picks; its output."""
    path = tmp_path / f"{config['out_dir'].name}.yaml"
    path.write_text(yaml.safe_dump({key: str(value) if hasattr(value, "is_dir") else value
                                    for key, value in config.items()}))
    proc = run_python([LITGPT, command, "--config", str(path)], simulate=2, env=env)
    return proc.stdout + proc.stderr


def losses(out_dir):
    """Each logged loss litgpt's CSV logger wrote, in order."""
    (metrics,) = out_dir.glob("logs/csv/**/metrics.csv")
    with open(metrics) as rows:
        return [float(row["loss"]) for row in csv.DictReader(rows) if row.get("loss")]


def test_pretrain_under_its_fsdp_strategy_trains_as_under_npu_ddp(tmp_path):
    """Breakage caught: litgpt's FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full",
    sharding_strategy="HYBRID_SHARD") refused or changed on its way to npu_fsdp (weights, gradient averaging and
    clipping, data split, steps): from the same weights, its per-step losses equal npu_ddp's."""
    initial = write_checkpoint_dir(tmp_path / "initial")
    runs = {}
    for name, strategy in (("fsdp", {}), ("npu_ddp", {"LT_STRATEGY": "npu_ddp"})):
        out = tmp_path / name
        output = litgpt("pretrain", {
            "model_name": MODEL_CONFIG["name"], "model_config": MODEL_CONFIG, "initial_checkpoint_dir": initial,
            "tokenizer_dir": TOKENIZER, "data": {"class_path": "tests.strategies.scripts.litgpt_data.CorpusRows"},
            "out_dir": out, "precision": "32-true", "devices": 2, "logger_name": "csv", "seed": 42,
            "train": {**SCHEDULE, "save_interval": None, "max_tokens": STEPS * 4 * SEQ_LEN, "max_norm": 1.0,
                      "min_lr": 1e-4, "tie_embeddings": False},
            "eval": QUIET_EVAL,
        }, tmp_path, {**NOT_COMPILED, **strategy})
        runs[name] = losses(out)
        if name == "fsdp":
            assert ("strategy=FSDPStrategy(...) on accelerator='npu' runs as strategy='npu_fsdp'" in output
                    and "sharding_strategy='HYBRID_SHARD' -> sharding='hybrid', zero_stage=3" in output), output
    assert len(runs["fsdp"]) == STEPS and all(math.isfinite(loss) for loss in runs["fsdp"]), runs
    assert runs["fsdp"] == pytest.approx(runs["npu_ddp"], abs=1e-4), runs


def test_finetune_lora_under_its_model_parallel_strategy_trains_the_adapters(tmp_path):
    """Breakage caught: Fabric's ModelParallelStrategy(parallelize_fn) refused on NPUs, litgpt's parallelize_fn not
    called on the NPUs' mesh, its checkpoint-wrapped adapters left uninitialised, or not trained: the run ends, its
    losses are finite, and every adapter's B matrix (LoRA starts it at zero) has moved, with finite values.

    Its losses are not compared with npu_ddp's, which would not mean the same: under any strategy but its sharded
    ones litgpt leaves the adapters of a model built with ``empty_init=True`` (it does on several devices)
    uninitialised, and the LT_STRATEGY that would choose npu_ddp also reaches the one-device Fabric its final
    merge_lora builds, which then fails."""
    initial = write_checkpoint_dir(tmp_path / "initial")
    out = tmp_path / "lora"
    output = litgpt("finetune_lora", {
        "checkpoint_dir": initial, "out_dir": out, "precision": "32-true", "devices": 2, **LORA,
        "data": {"class_path": "litgpt.data.JSON",
                 "init_args": {"json_path": str(write_instructions(tmp_path / "instructions.json")),
                               "val_split_fraction": 0.125}},
        "train": {**SCHEDULE, "save_interval": 1000, "max_steps": STEPS, "epochs": 1},
        "eval": {**QUIET_EVAL, "max_new_tokens": 4}, "logger_name": "csv", "seed": 42,
    }, tmp_path)
    assert ("strategy=ModelParallelStrategy(...) on accelerator='npu' runs as strategy='npu_fsdp'" in output
            and "parallelize_fn=parallelize_fn -> parallelize_fn=parallelize_fn (called with the module" in output), output
    logged = losses(out)
    assert len(logged) == 2 * STEPS and all(math.isfinite(loss) for loss in logged), logged
    adapters = torch.load(out / "final" / "lit_model.pth.lora")["model"]
    assert {name.rsplit(".", 1)[-1] for name in adapters} == {"lora_A", "lora_B"}
    assert all(torch.isfinite(value).all() for value in adapters.values())
    b_moved = {name: bool(value.abs().sum() > 0) for name, value in adapters.items() if name.endswith("lora_B")}
    assert len(b_moved) == MODEL_CONFIG["n_layer"] and all(b_moved.values()), b_moved
