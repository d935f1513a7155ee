"""Strict fake of torch_npu for contract tests (see fake.py), one recorded API per release in ``RELEASES``.

Use it per test::

    from tests.npu_fake import install_fake_torch_npu

    def test_something(monkeypatch):
        fake = install_fake_torch_npu(monkeypatch, device_count=2)
        ...
        assert fake.calls_to("npu.set_device") == [{"device": 1}]

or import the ready-made ``fake_npu`` fixture into a test module (``from tests.npu_fake import fake_npu``).
"""

import pytest

from tests.npu_fake.fake import RELEASES, FakeTorchNPU, ensure_npu_device_type, install_fake_torch_npu, load_api

__all__ = ["RELEASES", "FakeTorchNPU", "ensure_npu_device_type", "fake_npu", "install_fake_torch_npu", "load_api"]


@pytest.fixture
def fake_npu(monkeypatch) -> FakeTorchNPU:
    """The fake installed with its defaults: 8 visible Ascend910B2 devices, bf16 supported, 64 GiB each."""
    return install_fake_torch_npu(monkeypatch)
