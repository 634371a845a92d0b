"""The engine makes its GPU the current one around its launches only where another GPU is
current (engine.py ``Engine._on_device``): a worker serving cuda:1 switches and restores,
one GPU skips the switch — on the CPU, with the current device mocked."""

from __future__ import annotations

import contextlib
import types
from unittest import mock

import torch

from ctxprefill.engine.engine import Engine


def _engine_on(index: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(device=torch.device(f"cuda:{index}"), _device_index=index)


def test_another_gpu_current_is_switched_to_the_engines():
    with mock.patch.object(torch.cuda, "current_device", return_value=0):
        ctx = Engine._on_device(_engine_on(1))  # type: ignore[arg-type]
    assert isinstance(ctx, torch.cuda.device) and ctx.idx == 1


def test_the_engines_gpu_current_is_not_switched():
    with mock.patch.object(torch.cuda, "current_device", return_value=1):
        ctx = Engine._on_device(_engine_on(1))  # type: ignore[arg-type]
    assert isinstance(ctx, contextlib.nullcontext)


def test_a_cpu_engine_never_asks_for_a_gpu():
    cpu = types.SimpleNamespace(device=torch.device("cpu"), _device_index=-1)
    with mock.patch.object(torch.cuda, "current_device", side_effect=AssertionError("asked")):
        assert isinstance(Engine._on_device(cpu), contextlib.nullcontext)  # type: ignore[arg-type]
