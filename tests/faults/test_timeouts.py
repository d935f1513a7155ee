"""The process-group timeout against HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT at strategy start-up: one rule
(lightning_npu/timeouts.py) shared with `lightning-npu doctor`."""

import warnings
from datetime import timedelta

import pytest

from lightning_npu import NPUDDPStrategy, NPUFSDPStrategy
from lightning_npu.strategies.common import as_timedelta


@pytest.fixture(autouse=True)
def no_hccl_env(monkeypatch):
    for name in ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


def test_default_timeout_rises_above_the_hccl_exec_timeout(monkeypatch):
    """Catches: a fixed 1800 s default below HCCL_EXEC_TIMEOUT (1836 s by default, or whatever the job exports)."""
    assert as_timedelta(None) == timedelta(seconds=1896)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "3600")
    assert NPUFSDPStrategy()._timeout == timedelta(seconds=3660)
    assert NPUFSDPStrategy(timeout=7200)._timeout == timedelta(seconds=7200)  # an explicit timeout is kept


@pytest.mark.parametrize("cls", [NPUDDPStrategy, NPUFSDPStrategy])
def test_start_up_warns_when_the_timeout_is_not_above_hccl(monkeypatch, cls):
    """Catches: a timeout below HCCL_EXEC_TIMEOUT passing silently at start-up (the watchdog then aborts collectives
    HCCL still waits for); the backend is asked for right before init_process_group."""
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1836")
    strategy = cls(timeout=600, process_group_backend="gloo")
    with pytest.warns(UserWarning, match=r"The process-group timeout \(600 s\) is not above HCCL_EXEC_TIMEOUT \(1836 s"):
        assert strategy._get_process_group_backend() == "gloo"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._get_process_group_backend()  # once per strategy
        cls(timeout=1900, process_group_backend="gloo")._get_process_group_backend()  # above both: silent
