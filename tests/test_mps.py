"""ctxprefill.mps: the driver's answer to "is this process an MPS client", through a fake
driver library (ctypes calls with by-reference results), and what each failure reads as.
tests/gpu/test_mps_gpu.py asks the real driver, with and without a daemon."""

from __future__ import annotations

import ctypes
from unittest import mock

import pytest
import torch

from ctxprefill import mps
from ctxprefill.service import info


class FakeDriver:
    """cuInit, cuDeviceGet and cuDeviceGetAttribute as libcuda has them: CUresult codes,
    results written through the pointers given."""

    def __init__(self, value: int = 1, init: int = 0, get: int = 0, attribute: int = 0):
        self.value, self.codes, self.asked = value, (init, get, attribute), []

    def cuInit(self, flags):  # noqa: N802 - the driver's names
        return self.codes[0]

    def cuDeviceGet(self, dev, ordinal):  # noqa: N802
        dev._obj.value = 40 + ordinal  # a CUdevice handle is the driver's own value
        return self.codes[1]

    def cuDeviceGetAttribute(self, value, attribute, dev):  # noqa: N802
        self.asked.append((attribute, dev.value))
        value._obj.value = self.value
        return self.codes[2]


@pytest.mark.parametrize("value, expected", [(1, True), (0, False)])
def test_the_attribute_of_the_devices_handle_is_the_answer(value, expected):
    d = FakeDriver(value)
    assert mps.mps_client(3, d) is expected
    assert d.asked == [(mps.MPS_ENABLED, 43)]  # CU_DEVICE_ATTRIBUTE_MPS_ENABLED of cuDeviceGet's handle
    assert mps.MPS_ENABLED == 133


@pytest.mark.parametrize("codes", [dict(init=100), dict(get=101), dict(attribute=1)],
                         ids=["no device", "invalid ordinal", "attribute unknown to the driver"])
def test_a_driver_that_cannot_say_reads_as_none(codes):
    d = FakeDriver(1, **codes)
    assert mps.mps_client(0, d) is None


def test_no_driver_library_reads_as_none():
    with mock.patch.object(ctypes, "CDLL", side_effect=OSError("libcuda.so.1: cannot open shared object file")):
        assert mps.mps_client(0) is None


def test_a_cpu_device_is_not_asked():
    with mock.patch.object(info, "mps_client", side_effect=AssertionError("asked")):
        assert info.device_mps_client(torch.device("cpu")) is None
    with mock.patch.object(info, "mps_client", return_value=True) as asked:  # a CUDA device is asked by index
        assert info.device_mps_client(torch.device("cuda", 2)) is True
    asked.assert_called_once_with(2)
