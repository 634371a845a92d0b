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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("client", "server", "bench"):
    if os.path.join(ROOT, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _sub))

import numpy as np  # noqa: E402

from ctxprefill.app import build_engine  # noqa: E402
from ctxprefill.engine.engine import Engine  # noqa: E402
from ctxprefill.engine.graphs import LoopGraphs  # noqa: E402
from ctxprefill.engine.loop import RowMetadata, uses_keys_last  # noqa: E402
from ctxprefill.engine.request import PrefillRequest, validate_prefill  # noqa: E402
from ctxprefill.settings import ServeSettings  # noqa: E402
from ctxprefill_bench.engine_bench import make_device_request  # noqa: E402

STEPS = ("validate", "shape", "fill")
QUICK_STEPS = ("shape", "block ids", "fill")


def host_steps(engine: Engine, request: PrefillRequest, rounds: int, evict: np.ndarray | None) -> dict[str, float]:
    """Median µs of each step over ``rounds`` requests; ``evict``: an array written through
    (one byte a cache line) before each request."""
    cfg = engine.config
    graphs = LoopGraphs()
    weight = engine._gemm_weights[0]
    keys_last = uses_keys_last(engine.backend, cfg.prefill_dtype == "fp8", request.q.dtype)
    staging = np.empty(1 << 20, dtype=np.int32)
    got: dict[str, list[float]] = {s: [] for s in STEPS}
    pc = time.perf_counter
    for _ in range(rounds):
        if evict is not None:
            evict[::64] += 1
        t0 = pc()
        checked = validate_prefill(request, cfg, engine.instance_id)
        t1 = pc()
        _, hm = graphs.shape(checked.layer_position, cfg.fused, cfg.unpacked_keys, checked.q, weight,
                             checked.query_lens, checked.chunks, checked.block_table, keys_last)
        t2 = pc()
        hm.fill(staging[: hm.size])
        t3 = pc()
        for s, a, b in zip(STEPS, (t0, t1, t2), (t1, t2, t3), strict=True):
            got[s].append((b - a) * 1e6)
    out = {s: round(statistics.median(v), 2) for s, v in got.items()}
    out["total"] = round(sum(out[s] for s in STEPS), 2)
    return out


def quick_steps(engine: Engine, request: PrefillRequest, rounds: int, evict: np.ndarray | None) -> dict[str, float]:
    """:func:`host_steps` of the quick path (the request's shape remembered first, as its
    replay remembers it)."""
    cfg = engine.config
    graphs = LoopGraphs()
    keys_last = uses_keys_last(engine.backend, cfg.prefill_dtype == "fp8", request.q.dtype)
    checked = validate_prefill(request, cfg, engine.instance_id)
    key, hm = graphs.shape(checked.layer_position, cfg.fused, cfg.unpacked_keys, checked.q,
                           engine._gemm_weights[0], checked.query_lens, checked.chunks, checked.block_table, keys_last)
    engine.remember_shape(engine.shape_key(request, graphs, cfg.fused, None), checked, key, hm)
    staging = np.empty(1 << 20, dtype=np.int32)
    got: dict[str, list[float]] = {s: [] for s in QUICK_STEPS}
    pc = time.perf_counter
    for _ in range(rounds):
        if evict is not None:
            evict[::64] += 1
        t0 = pc()
        shape = engine.shape_key(request, graphs, cfg.fused, None)
        t1 = pc()
        found = engine.known_shape(request, shape)
        t2 = pc()
        assert found is not None
        known, _, row = found
        RowMetadata(known.vectors, row, 0).fill(staging)  # one layer: its blocks at no offset
        t3 = pc()
        for s, a, b in zip(QUICK_STEPS, (t0, t1, t2), (t1, t2, t3), strict=True):
            got[s].append((b - a) * 1e6)
    out = {s: round(statistics.median(v), 2) for s, v in got.items()}
    out["total"] = round(sum(out[s] for s in QUICK_STEPS), 2)
    return out


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
