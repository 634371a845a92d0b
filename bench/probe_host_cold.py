"""The host steps of a CUDA-graph replay that need no device, hot and with cold caches.

A replay's host work before its first copy is Python: the request's checks and plan
(``validate_prefill``), its shape and chunk metadata (``LoopGraphs.shape``) and the
metadata written into the page-locked staging (``HostMetadata.fill``). Timed in a loop
they take a few µs; timed per request on a GPU host they take several times that
(``bench/results/probe_host.json``: ``validate_us`` in a loop against the ``validate``
step of a request), because the host waited for the device in between and comes back to
caches that hold something else. This probe runs the three steps on a CPU engine (no
GPU needed) back to back, and again after touching ``--evict-mb`` of memory before each
request (the cold case), and prints the medians in µs as JSON. ``quick_*``: the same for
the path a one-sequence request of a shape that replayed before takes
(``Engine._quick_replay``): its shape's key (``shape``), the remembered shape, its layer
and block ids checked (``block ids``), the staging written from them (``fill``):

  PYTHONPATH=server:client:bench python3 bench/probe_host_cold.py [--heads 16] [--evict-mb 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("client", "server", "bench"):
    if os.path.join(ROOT, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _sub))

import numpy as np  # noqa: E402

from ctxprefill.app import build_engine  # noqa: E402
from ctxprefill.engine.engine import Engine  # noqa: E402
from ctxprefill.engine.graphs import LoopGraphs  # noqa: E402
from ctxprefill.engine.loop import RowMetadata  # noqa: E402
from ctxprefill.engine.request import PrefillRequest, validate_prefill  # noqa: E402
from ctxprefill.settings import ServeSettings  # noqa: E402
from ctxprefill_bench.engine_bench import make_device_request  # noqa: E402

STEPS = ("validate", "shape", "fill")
QUICK_STEPS = ("shape", "block ids", "fill")


def _medians(steps: tuple[str, ...], rounds: int, evict: np.ndarray | None,
             one: Callable[[], tuple[float, ...]]) -> dict[str, float]:
    """Median µs of each step over ``rounds`` calls of ``one`` (its steps' perf_counter
    boundaries); ``evict``: an array written through (one byte a cache line) before each."""
    got: dict[str, list[float]] = {s: [] for s in steps}
    for _ in range(rounds):
        if evict is not None:
            evict[::64] += 1
        ts = one()
        for s, a, b in zip(steps, ts[:-1], ts[1:], strict=True):
            got[s].append((b - a) * 1e6)
    out = {s: round(statistics.median(v), 2) for s, v in got.items()}
    out["total"] = round(sum(out[s] for s in steps), 2)
    return out


def host_steps(engine: Engine, request: PrefillRequest, rounds: int, evict: np.ndarray | None) -> dict[str, float]:
    """:func:`_medians` of the full path's steps: the checks, the shape, the staging."""
    graphs, staging, pc = LoopGraphs(), np.empty(1 << 20, dtype=np.int32), time.perf_counter

    def one() -> tuple[float, ...]:
        t0 = pc()
        checked = validate_prefill(request, engine.config, engine.instance_id)
        t1 = pc()
        _, hm = engine.graph_shape(graphs, checked, engine.config.fused, engine.config.unpacked_keys, checked.q)
        t2 = pc()
        hm.fill(staging[: hm.size])
        return t0, t1, t2, pc()

    return _medians(STEPS, rounds, evict, one)


def quick_steps(engine: Engine, request: PrefillRequest, rounds: int, evict: np.ndarray | None) -> dict[str, float]:
    """:func:`_medians` of the quick path's steps (the request's shape remembered first, as
    its replay remembers it): its key, its layer and block ids checked, the staging."""
    graphs, staging, pc = LoopGraphs(), np.empty(1 << 20, dtype=np.int32), time.perf_counter
    path = engine.config.fused, engine.config.unpacked_keys
    checked = validate_prefill(request, engine.config, engine.instance_id)
    engine.remember_shape(engine.shape_key(request, graphs, *path), checked,
                         *engine.graph_shape(graphs, checked, *path, checked.q))

    def one() -> tuple[float, ...]:
        t0 = pc()
        shape = engine.shape_key(request, graphs, *path)
        t1 = pc()
        found = engine.known_shape(request, shape)
        t2 = pc()
        assert found is not None
        RowMetadata(found.known.vectors, found.row, 0).fill(staging)  # one layer: its blocks at no offset
        return t0, t1, t2, pc()

    return _medians(QUICK_STEPS, rounds, evict, one)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--prefill-dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--evict-mb", type=int, default=64, help="memory written through before each cold request")
    a = p.parse_args(argv)
    block = 64
    engine = build_engine(ServeSettings(device="cpu", heads=a.heads, block_size=block,
                                        num_blocks=-(-a.context // block) + 8, workspace_tokens=16384,
                                        prefill_dtype=a.prefill_dtype))
    q, seqs = make_device_request(engine, [a.context], [a.new])
    request = PrefillRequest(q, seqs)
    evict = np.ones(a.evict_mb << 20, dtype=np.uint8)
    host_steps(engine, request, 50, None)  # every shape remembered
    result = {"heads": a.heads, "new": a.new, "context": a.context, "prefill_dtype": a.prefill_dtype,
              "evict_mb": a.evict_mb, "hot_us": host_steps(engine, request, a.rounds, None),
              "cold_us": host_steps(engine, request, a.rounds, evict),
              "quick_hot_us": quick_steps(engine, request, a.rounds, None),
              "quick_cold_us": quick_steps(engine, request, a.rounds, evict)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
