"""lightning-npu plan as someone who installed the package runs it: from an empty directory, with only a copy of
``lightning_npu/`` on the path (no checkout root, so no ``recipes`` package), for a recipe config given by its
path and for a model given by its shapes alone; the figures must equal those of the run inside the checkout."""

import json
import os
import shutil
import subprocess
import sys

from lightning_npu.plan import ModelShape, load_spec, report
from tests.helpers import REPO, SUBPROCESS_TIMEOUT_S

CONFIG_7B = REPO / "recipes" / "models" / "llama" / "configs" / "llama2_7b.yaml"
SHAPE_7B = "hidden=4096,layers=32,heads=32,kv_heads=32,ffn=11008,vocab=32000,max_seq_len=4096"
#: Runs the console command after checking where the package comes from and that no recipe is importable.
_RUN = """
import importlib.util, sys
import lightning_npu
from lightning_npu.cli import main
print("PACKAGE", lightning_npu.__file__, "RECIPES", importlib.util.find_spec("recipes"), file=sys.stderr)
sys.exit(main(["plan", *sys.argv[1:]]))
"""


def _plan_outside_the_checkout(tmp_path, args):
    site, cwd = tmp_path / "site", tmp_path / "empty"
    shutil.copytree(REPO / "lightning_npu", site / "lightning_npu", ignore=shutil.ignore_patterns("__pycache__"))
    cwd.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-c", _RUN, *args, "--json"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert f"PACKAGE {site / 'lightning_npu' / '__init__.py'} RECIPES None" in proc.stderr
    return json.loads(proc.stdout)


def test_a_recipe_config_plans_from_an_empty_directory_with_only_the_package_installed(tmp_path):
    """Catches the package reaching into the checkout for the recipe (the planner's old ``import recipes``, which
    failed without the checkout root on the path): the config's class paths must lead to the recipe's own
    memory profile, found from the config file's location."""
    plan = _plan_outside_the_checkout(tmp_path, ["--config", str(CONFIG_7B), "--devices", "8", "--device-memory", "64"])
    assert plan["model"]["name"] == "LLaMA 7b"
    assert plan == report(load_spec(CONFIG_7B, devices=8, device_memory_gib=64))


def test_a_model_given_by_its_shapes_plans_without_any_config(tmp_path):
    """Catches a planner that needs a recipe (config, preset or profile) to know a model's memory."""
    args = ["--model-shape", SHAPE_7B, "--devices", "8", "--device-memory", "64", "--precision", "bf16-mixed",
            "--seq-len", "2048", "--micro-batch", "2"]
    plan = _plan_outside_the_checkout(tmp_path, args)
    expected = load_spec(model_shape=ModelShape.parse(SHAPE_7B), devices=8, device_memory_gib=64,
                         precision="bf16-mixed", seq_len=2048, micro_batch=2)
    assert plan == report(expected)
    assert (plan["model"]["params"], plan["seq_len"], plan["micro_batch"]) == (6_738_415_616, 2048, 2)
