"""Counting what one call runs on the GPU, the way the launch metric is checked."""

from __future__ import annotations

from collections import Counter

import torch


def device_work(fn):
    """(fn's result, device kernels it ran, device-to-device copies it ran).

    Host transfers (the request's metadata upload) and memsets are excluded. A
    device-to-device ``copy_`` of contiguous tensors runs as a DtoD memcpy rather than
    a kernel; the engine notes it as one launch (it is the copy of the ``out`` contract's
    non-out mode), so it is counted separately and added."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if not any(s in n.lower() for s in ("memcpy", "memset"))]
    dtod = [n for n in names if "memcpy dtod" in n.lower()]
    return r, kernels, dtod


def fail_unless_counts_match(line: str, seen: int, noted: int, names: list[str]) -> None:
    """Raise with ``line`` and the kernel names the profiler saw (most frequent first)
    when the profiler's count ``seen`` differs from the engine's ``noted`` one."""
    if seen != noted:
        top = Counter(n[:120] for n in names).most_common()
        raise AssertionError(f"{line}\nkernels the profiler saw:\n" + "\n".join(f"  {c} x {n}" for n, c in top))
