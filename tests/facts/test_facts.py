"""lightning_npu.facts: the torch-free layer that holds each fact once (chips, precisions, npu_fsdp options,
environment variable names, device ids)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import lightning_npu
from lightning_npu.facts import chips, devices, env, options, precisions

PACKAGE = Path(lightning_npu.__file__).parent
FACTS = PACKAGE / "facts"


def _imported_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):  # every import, also those inside functions
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_facts_modules_import_only_the_standard_library_and_each_other():
    """Catches a facts module importing torch, Lightning or another part of lightning_npu (which imports them):
    the planner and the doctor read these facts where torch must not be imported."""
    modules = sorted(FACTS.glob("*.py"))
    assert {path.stem for path in modules} >= {"__init__", "chips", "precisions", "options", "env", "devices"}
    for path in modules:
        for name in _imported_modules(ast.parse(path.read_text())):
            top = name.split(".")[0]
            allowed = top in sys.stdlib_module_names or top == "__future__" or name.startswith("lightning_npu.facts")
            assert allowed, f"lightning_npu/facts/{path.name} imports {name!r}"


def test_no_package_module_spells_an_environment_variable_name_outside_facts_env():
    """Catches a second copy of a variable's name (os.environ.get("HCCL_EXEC_TIMEOUT") or a local
    ``SIMULATE_ENV = "LIGHTNING_NPU_SIMULATE"``), which can drift from the one the rest of the package reads."""
    names = set(env.NAMES)
    assert {"LIGHTNING_NPU_SIMULATE", "ASCEND_RT_VISIBLE_DEVICES", "TORCH_DEVICE_BACKEND_AUTOLOAD",
            "HCCL_EXEC_TIMEOUT", "SLURM_JOB_ID"} <= names
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "facts/env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{relative}:{node.lineno} {node.value}")
    assert found == []


def test_device_memory_is_known_per_exact_chip_name():
    """Catches memory matched by prefix (an unknown "Ascend910B" first-generation part or a made-up
    "Ascend910B2X" given an A2 figure) or a variant spelling missing from the table."""
    assert chips.device_memory_gib("Ascend910B4_1") == chips.device_memory_gib("Ascend910B4-1") == 32.0
    assert chips.device_memory_gib("Ascend910B2C") == 64.0
    assert {chips.device_memory_gib(name) for name in chips.ATLAS_A3} == {64.0}
    assert chips.device_memory_gib("Ascend910A") == 32.0
    for unknown in ("Ascend910B", "Ascend910B2X", "Ascend910_93", "Ascend310P3"):
        assert chips.device_memory_gib(unknown) is None, unknown
    assert chips.device_memory_gib(chips.DEFAULT_PLAN_CHIP) == 64.0
    facts = chips.chip_facts("Ascend910B4", supports_bf16=True)
    assert (facts.series, facts.memory_gib, facts.peak_bf16_flops) == ("A2", 32.0, pytest.approx(245.8e12))
    # The series lists are read from the same table, in SocVersion order.
    assert chips.ATLAS_TRAINING == ("Ascend910PremiumA", "Ascend910ProA", "Ascend910A", "Ascend910ProB", "Ascend910B")
    assert chips.ATLAS_A2[0] == "Ascend910B1" and len(chips.ATLAS_A2) == 7 and len(chips.ATLAS_A3) == 7


@pytest.mark.parametrize(
    ("value", "canonical"),
    [("bf16", "bf16-mixed"), ("16", "16-mixed"), (16, "16-mixed"), (32, "32-true"), ("bf16-true", "bf16-true")],
)
def test_lightning_precision_aliases_have_one_canonical_name(value, canonical):
    """Catches an alias (Trainer(precision=16), YAML `precision: bf16`) rejected, or read as another setting."""
    assert precisions.canonical_precision(value) == canonical


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (64, "precision=64 is not supported on NPUs: HCCL cannot reduce float64 tensors. Use one of '32-true',"),
        ("transformer-engine", "precision='transformer-engine' is not supported on NPUs: transformer-engine fp8"),
        ("INT8-true", "precision='INT8-true' is not supported on NPUs: torch_npu's int8 matmuls"),
        ("bf16-mixed ", "precision='bf16-mixed ' is not supported on NPUs; use one of 32-true, bf16-mixed, bf16-true,"
                        " 16-mixed, 16-true"),
    ],
)
def test_a_precision_npus_cannot_run_names_the_value_the_reason_and_the_choices(value, message):
    """Catches a bare KeyError, or an alias of an unsupported setting (64) slipping through as supported."""
    with pytest.raises(ValueError) as error:
        precisions.canonical_precision(value)
    assert str(error.value).startswith(message)


def test_precision_dtypes_say_what_mixed_and_true_settings_store_and_compute_in():
    """Catches a setting whose dtypes disagree with its name (what the FSDP2 policy and the planner read)."""
    assert precisions.precision_dtypes("bf16") == precisions.PrecisionDtypes("float32", "bfloat16", "float32")
    assert precisions.precision_dtypes("16-true") == precisions.PrecisionDtypes("float16", "float16", "float16")
    assert [p for p in precisions.PRECISIONS if precisions.precision_dtypes(p).mixed] == ["bf16-mixed", "16-mixed"]
    assert [p for p in precisions.PRECISIONS if precisions.uses_bf16(p)] == ["bf16-mixed", "bf16-true"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero_stage": 1}, "zero_stage=1 is not supported; use 3 (parameters resharded after forward, least memory)"
                            " or 2 (parameters kept gathered until backward, less communication)"),
        ({"sharding": "ddp"}, "sharding='ddp' is not supported; use 'full' or 'hybrid'"),
        ({"activation_checkpointing_ratio": -0.1}, "activation_checkpointing_ratio=-0.1 must lie in [0, 1]"),
        ({"memory_fraction": 1.5}, "memory_fraction=1.5 must lie in (0, 1]: it is the share of each NPU's memory"),
    ],
)
def test_fsdp_choices_are_validated_without_torch(kwargs, message):
    """Catches the torch-free options (what the planner validates a YAML with) accepting a value npu_fsdp
    rejects, or rejecting it with a message that does not give the choices."""
    with pytest.raises(ValueError) as error:
        options.FSDPOptions(**kwargs)
    assert str(error.value).startswith(message)


def test_fsdp_choices_defaults_are_the_strategy_defaults():
    """Catches the planner's defaults drifting from what NPUFSDPStrategy() does when an option is left out."""
    from lightning_npu import NPUFSDPStrategy

    default = options.FSDPOptions()
    strategy = NPUFSDPStrategy().options
    assert (default.zero_stage, default.sharding, default.activation_checkpointing_ratio) == (3, "full", 1.0)
    for name in ("zero_stage", "sharding", "activation_checkpointing_ratio", "cpu_offload", "memory_fraction"):
        assert getattr(strategy, name) == getattr(default, name), name
    assert default.reshard_after_forward and not options.FSDPOptions(zero_stage=2).reshard_after_forward


@pytest.mark.parametrize(
    ("value", "request_"),
    [("auto", devices.ALL_DEVICES), (-1, devices.ALL_DEVICES), (" 2 ", 2), (4, 4), ("0,1,", [0, 1]), ((3, 1), [3, 1])],
)
def test_a_devices_value_is_read_without_knowing_the_visible_devices(value, request_):
    """Catches the planner and the accelerator reading a ``devices`` value differently ("0,1," as two ids)."""
    assert devices.devices_request(value) == request_


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (True, TypeError, "devices=True is not a device count or list of ids"),
        (0, ValueError, "devices=0 must be a positive number of NPUs, -1 or 'auto' for all"),
        ("0;1", ValueError, "devices='0;1' is not understood"),
        ([0, 0], ValueError, "devices=[0, 0] lists a device more than once"),
        ([], ValueError, "devices=[] selects no NPU"),
    ],
)
def test_a_bad_devices_value_is_refused_before_any_device_is_counted(value, error, message):
    """Catches a malformed ``devices`` value accepted by the torch-free reader (the planner would plan it)."""
    with pytest.raises(error) as raised:
        devices.devices_request(value)
    assert str(raised.value).startswith(message)
