"""`import lightning_npu` costs no torch and no Lightning, and still registers "npu" with the Trainer and Fabric
whichever is imported first. Each case runs in a fresh interpreter (the pytest process has torch loaded)."""

import json
import textwrap

import pytest

from tests.helpers import run_python

#: Printed by each script: what `import lightning_npu` alone loaded, then what the Trainer and Fabric chose.
REPORT = """
import json, sys
from lightning.pytorch import Trainer
from lightning.fabric import Fabric
trainer = Trainer(accelerator="npu", devices=1, strategy="npu_single", logger=False)
fabric = Fabric(accelerator="npu", devices=1, strategy="npu_single")
print(json.dumps({"alone": ALONE, "trainer": [type(trainer.accelerator).__name__, type(trainer.strategy).__name__],
                  "fabric": [type(fabric.accelerator).__name__, type(fabric.strategy).__name__],
                  "hooks_left": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_AfterImport"]}))
"""

ORDERS = {
    # The plugin first: registration waits for Lightning's import, and must happen when it comes.
    "plugin then lightning": "import lightning_npu\nALONE = sorted({'torch', 'lightning'} & set(sys.modules))\n",
    # Lightning first: registration happens during `import lightning_npu`.
    "lightning then plugin": "import lightning.pytorch\nimport lightning_npu\nALONE = []\n",
    # A plugin module that imports Lightning half-way through itself: registering then would import the
    # half-executed module, so the hook must wait until that module is done.
    "plugin submodule first": "import lightning_npu.accelerator\nALONE = []\n",
}


def _run(code: str) -> dict:
    out = run_python(["-c", textwrap.dedent(code)], simulate=1, fresh=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("order", ORDERS)
def test_npu_is_registered_with_trainer_and_fabric_in_any_import_order(order):
    """Catches: `import lightning_npu` importing torch or Lightning (the first order sees them in sys.modules),
    registration that never happens when Lightning comes after the plugin, one that fails on a half-executed
    plugin module, or a hook left on sys.meta_path after it fired."""
    result = _run("import sys\n" + ORDERS[order] + REPORT)
    assert result == {"alone": [], "trainer": ["NPUAccelerator", "NPUSingleStrategy"],
                      "fabric": ["NPUAccelerator", "NPUFabricSingleStrategy"], "hooks_left": []}


@pytest.mark.slow
def test_public_names_load_on_first_use_and_keep_their_identity():
    """Catches: `from lightning_npu import X` or `lightning_npu.X` (jsonargparse's class paths) not working with
    the lazy names, names missing from __all__/dir(), or a lazy name that differs from the registered class."""
    result = _run("""
        import json, sys
        import lightning_npu
        before = sorted({"torch", "lightning_npu.strategies"} & set(sys.modules))
        from lightning_npu import NPUFSDPStrategy
        from lightning.pytorch.strategies import StrategyRegistry
        print(json.dumps({
            "before": before,
            "same": StrategyRegistry["npu_fsdp"]["strategy"] is NPUFSDPStrategy
                    is __import__("lightning_npu", fromlist=["NPUFSDPStrategy"]).NPUFSDPStrategy,  # jsonargparse's way
            "missing": [n for n in lightning_npu.__all__
                        if n not in dir(lightning_npu) or not getattr(lightning_npu, n)],
        }))
    """)
    assert result == {"before": [], "same": True, "missing": []}


def test_names_raise_import_error_naming_the_failure_when_lightning_cannot_be_imported(tmp_path):
    """Catches: `import lightning_npu` failing (or trying Lightning at all) where `import lightning` fails --
    the doctor needs the package to import there -- or a plugin name that then raises something other than an
    ImportError naming the original failure; and an unknown name raising ImportError instead of AttributeError."""
    broken = tmp_path / "lightning"
    broken.mkdir()
    (broken / "__init__.py").write_text("import os\nos.environ['TRIED_LIGHTNING'] = '1'\n"
                                        "raise ImportError('libhccl.so: cannot open shared object file')\n")
    code = """
        import json, os, sys
        import lightning_npu
        tried = os.environ.get("TRIED_LIGHTNING")
        errors = []
        for name in ("NPUFSDPStrategy", "NPUAccelerator"):
            try:
                getattr(lightning_npu, name)
            except ImportError as error:
                errors.append(str(error))
        try:
            lightning_npu.no_such_name
        except AttributeError as error:
            errors.append(type(error).__name__)
        print(json.dumps({"tried_on_import": tried, "errors": errors}))
    """
    out = run_python(["-c", textwrap.dedent(code)], simulate=None, env={"PYTHONPATH": f"{tmp_path}:."}, fresh=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tried_on_import"] is None
    assert result["errors"] == [
        f"lightning_npu.{name} cannot be used: `import lightning.pytorch` failed with ImportError: libhccl.so: cannot"
        " open shared object file. Run `lightning-npu doctor` for the cause and the fix."
        for name in ("NPUFSDPStrategy", "NPUAccelerator")
    ] + ["AttributeError"]


def test_cli_help_imports_neither_torch_nor_lightning():
    """Catches: the `lightning-npu` console script (lightning_npu.cli:main) importing torch or Lightning for
    `--help` or `doctor --help` (seconds of imports, and a crash where `import torch` crashes)."""
    result = _run("""
        import contextlib, io, json, sys
        from lightning_npu.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            codes = [main(["--help"]), main(["doctor", "--help"])]
        print(json.dumps({"codes": codes, "loaded": sorted({"torch", "lightning"} & set(sys.modules))}))
    """)
    assert result == {"codes": [0, 0], "loaded": []}


def test_facts_modules_import_neither_torch_nor_lightning():
    """Catches: a facts module (chips, precisions, options, env, devices, problem) that costs torch or Lightning
    when imported -- through its own imports or through lightning_npu/__init__ -- which the planner and the doctor
    read where torch must not (or cannot) be imported."""
    result = _run("""
        import importlib, json, pkgutil, sys
        import lightning_npu.facts
        names = [f"lightning_npu.facts.{m.name}" for m in pkgutil.iter_modules(lightning_npu.facts.__path__)]
        for name in names:
            importlib.import_module(name)
        print(json.dumps({"modules": sorted(n.rsplit(".", 1)[1] for n in names),
                          "loaded": sorted({"torch", "lightning"} & set(sys.modules))}))
    """)
    assert set(result["modules"]) >= {"chips", "devices", "env", "options", "precisions", "problem"}
    assert result["loaded"] == []
