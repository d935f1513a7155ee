"""Parsing of ``devices=`` for the NPU accelerator, and the accelerator's device hooks."""

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_npu import NPUAccelerator
from lightning_npu.accelerator import parse_device_ids


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (1, [0]),
        (3, [0, 1, 2]),
        (-1, [0, 1, 2, 3]),
        ("auto", [0, 1, 2, 3]),
        ("-1", [0, 1, 2, 3]),
        ("2", [0, 1]),
        ("1,3", [1, 3]),
        ("2,", [2]),
        ([0, 2], [0, 2]),
        ((3,), [3]),
    ],
)
def test_parse_device_ids(devices, expected):
    assert parse_device_ids(devices, visible=4) == expected


@pytest.mark.parametrize(
    ("devices", "error", "message"),
    [
        (5, ValueError, r"devices=5 asks for more NPUs than are visible: 4 NPU\(s\) visible \(ids 0..3\)"),
        ([0, 4], ValueError, r"asks for NPU 4, which is not visible"),
        ("0,7", ValueError, r"asks for NPU 7, which is not visible"),
        ([1, 1], ValueError, "more than once"),
        (0, ValueError, "must be a positive number"),
        ([], ValueError, "selects no NPU"),
        ("npu:0", ValueError, "is not understood"),
        (True, TypeError, "is not a device count"),
        ([0.5], TypeError, "integer device ids"),
    ],
)
def test_parse_device_ids_errors(devices, error, message):
    with pytest.raises(error, match=message):
        parse_device_ids(devices, visible=4)


def test_errors_mention_the_visibility_mask(monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ValueError, match="ids count from 0 within ASCEND_RT_VISIBLE_DEVICES=4,5"):
        parse_device_ids([4], visible=2)


def test_trainer_rejects_invisible_ids(simulate):
    simulate(2)
    with pytest.raises(ValueError, match="asks for NPU 2, which is not visible: 2 NPU"):
        Trainer(accelerator="npu", devices=[2], logger=False)


def test_device_count_is_the_runtime_count(simulate):
    simulate(3)
    assert NPUAccelerator.auto_device_count() == 3
    assert NPUAccelerator.is_available()
    assert NPUAccelerator.get_parallel_devices([0, 1]) == [torch.device("cpu")] * 2


def test_memory_fraction_is_validated(simulate):
    simulate(1)
    with pytest.raises(ValueError, match=r"memory_fraction=1.5 must lie in \(0, 1\]"):
        NPUAccelerator(memory_fraction=1.5)
    assert NPUAccelerator(memory_fraction=0.5).memory_fraction == 0.5


def test_device_stats_report_memory(simulate):
    """The simulated device's memory is the process's: 256 MiB written show up in the RSS and its peak."""
    simulate(1)
    accelerator = NPUAccelerator()
    before = accelerator.get_device_stats("cpu")
    block = torch.ones(64 * 2**20)  # 256 MiB, every page written
    during = accelerator.get_device_stats("cpu")
    assert during["rss_bytes"] - before["rss_bytes"] >= 200 * 2**20
    assert during["peak_rss_bytes"] >= during["rss_bytes"] >= block.numel()
