"""LightningCLI YAML selects the accelerator and strategy by name and by class_path with init args."""

import pytest
from tests.helpers import read_json, room_scripts, run_python

SCRIPTS = room_scripts("cli")

SCRIPT = str(SCRIPTS / "cli_run.py")


def _fit(tmp_path, trainer_lines, import_plugin="1"):
    config = tmp_path / "config.yaml"
    config.write_text(
        "model:\n"
        f"  out: {tmp_path / 'out'}\n"
        "trainer:\n"
        "  devices: 2\n"
        "  max_steps: 2\n"
        "  logger: false\n"
        "  enable_checkpointing: false\n"
        "  enable_progress_bar: false\n"
        "  enable_model_summary: false\n" + "".join(f"  {line}\n" for line in trainer_lines)
    )
    run_python([SCRIPT, "fit", "--config", str(config)], env={"IMPORT_PLUGIN": import_plugin})
    return read_json(tmp_path / "out" / "result.json")


@pytest.mark.slow
def test_yaml_selects_accelerator_and_strategy_by_name(tmp_path):
    result = _fit(tmp_path, ["accelerator: npu", "strategy: npu_fsdp", "precision: bf16-mixed"])
    assert result["accelerator"] == "NPUAccelerator"
    assert result["strategy"] == "NPUFSDPStrategy"
    assert result["world_size"] == 2
    assert result["zero_stage"] == 3
    assert result["precision"] == "bf16-mixed"
    assert len(result["losses"]) == 2


@pytest.mark.slow
def test_yaml_class_paths_with_init_args_bring_in_the_plugin(tmp_path):
    result = _fit(
        tmp_path,
        [
            "accelerator:",
            "    class_path: lightning_npu.NPUAccelerator",
            "    init_args:",
            "      memory_fraction: 0.9",
            "strategy:",
            "    class_path: lightning_npu.NPUFSDPStrategy",
            "    init_args:",
            "      auto_wrap_policy: [tests.strategies.scripts.trainer_run.Block]",
            "      zero_stage: 2",
            "      activation_checkpointing_policy: [Block]",
            "      activation_checkpointing_ratio: 0.5",
            "      state_dict_type: full",
            "      timeout: 120",
        ],
        import_plugin="0",
    )
    assert result["accelerator"] == "NPUAccelerator"
    assert result["strategy"] == "NPUFSDPStrategy"
    assert result["zero_stage"] == 2
    assert result["ac_ratio"] == 0.5
