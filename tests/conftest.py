"""Make the source tree importable without installing it, run Triton kernels in its
interpreter where there is no GPU, and keep hypothesis bounded on a 2-core CI machine."""

import os
import sys

import torch

if not torch.cuda.is_available():
    # set before anything imports triton: the Triton backend's CPU tests run its kernels
    # in the interpreter (the backend itself reports "unavailable" on a CPU device)
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("server", "client", "bench"):
    path = os.path.join(ROOT, sub)
    if path not in sys.path:
        sys.path.insert(0, path)

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("ci")
except ImportError:  # pragma: no cover
    pass
