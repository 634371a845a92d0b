"""Whether this process's CUDA work runs as a client of an MPS daemon (docs/DEPLOY.md).

Under CUDA MPS the server's kernels and its caller's share one GPU context: no context
switch when the work passes between them, and no fault isolation either. Which of the two
a server got depends on the host (a daemon for that GPU, its pipe directory in the
process's environment), so the server says it: GetServerInfo's ``mps_client`` and the
``serving`` log line. The driver answers it per process (``CU_DEVICE_ATTRIBUTE_MPS_ENABLED``);
torch does not expose that attribute, so it is read through ctypes from the driver library
torch has loaded.
"""

from __future__ import annotations

import ctypes
from typing import Any

#: CU_DEVICE_ATTRIBUTE_MPS_ENABLED (cuda.h): contexts made on the device are shared via MPS
MPS_ENABLED = 133
LIBCUDA = "libcuda.so.1"


def mps_client(index: int, driver: Any = None) -> bool | None:
    """Whether contexts this process makes on CUDA device ``index`` (torch's index, the
    driver's ordinal) are shared through MPS; None where the driver cannot say: no driver
    library, or one that does not know the attribute. ``driver``: the library (tests)."""
    try:
        cuda = driver if driver is not None else ctypes.CDLL(LIBCUDA)
    except OSError:
        return None
    dev, value = ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), int(index)) != 0:
        return None
    if cuda.cuDeviceGetAttribute(ctypes.byref(value), MPS_ENABLED, dev) != 0:
        return None
    return bool(value.value)
