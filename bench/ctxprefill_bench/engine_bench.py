"""``ctxprefill bench``: the fused and the generic path side by side, in one process.

For each configuration of a grid, one request (one sequence of ``new`` query tokens
over ``context`` cached tokens) runs through the in-process engine on both paths,
with the same engine and the same inputs (q on the device before timing); we report
the median request time, time per stage, launches per chunk, whether both paths gave
bit-identical output and LSE, and the floor: kv_b_proj and attention FLOPs at the
measured matrix rate plus the memory-bound stages' bytes at the measured copy
bandwidth.

``--grid full`` is the whole grid: H ∈ {16, 128} × new ∈ {512, 1024, 8192} × context ∈
{8k, 64k, 256k} × cache {auto, fp8, fp8_ds_mla} × prefill {bf16, fp8} (108 rows); an
axis given explicitly narrows it. Iterations scale with the work: one or two warm-up
calls, then timed calls until ``--target-s`` of measured time (at least
``--min-iters``, at most ``--iters``). ``--budget-s`` skips a row that is predicted
not to fit before the deadline (recorded in the JSON as skipped); the JSON is
rewritten after every row, so a killed run keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

from ctxprefill.app import build_engine
from ctxprefill.settings import ServeSettings

from . import growth, run_info

GRIDS = {
    # the headline shape (1,024 new over 64k), every dtype combination
    "default": {"heads": [16, 128], "new": [1024], "context": [65536],
                "cache_dtype": ["auto", "fp8", "fp8_ds_mla"], "prefill_dtype": ["bf16", "fp8"]},
    # 108 shapes: new tokens x context x every dtype combination
    "full": {"heads": [16, 128], "new": [512, 1024, 8192], "context": [8192, 65536, 262144],
             "cache_dtype": ["auto", "fp8", "fp8_ds_mla"], "prefill_dtype": ["bf16", "fp8"]},
}
STAGES = ("gather", "cast", "kv_b_proj", "pack", "attention", "merge")
_ABBR = {"gather": "gat", "cast": "cst", "kv_b_proj": "kvb", "pack": "pck", "attention": "att", "merge": "mrg"}
L, P, R, V = 512, 128, 64, 128  # latent, nope, rope, value dims (CONTRACT §1: the only ones supported)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_host(dev, n: int = 400) -> dict:
    """How fast this machine's host runs, for comparing eager rows across runs (a 16-head
    eager request is bounded by its host): the median µs to issue one small op on ``dev``
    (torch's dispatch and the launch; a CUDA device keeps them queued) and the median ms of
    a 100,000-step Python loop."""
    x = torch.zeros(1, device=dev)
    issue = []
    for _ in range(n):
        t = time.perf_counter()
        x.add_(1.0)
        issue.append(time.perf_counter() - t)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"op_issue_us": statistics.median(issue) * 1e6, "python_loop_ms": run_info.python_loop_ms()}


def measure_ceilings(dev, sustained_s: float = 0.0) -> dict:
    """Device copy bandwidth (bytes read + written) and bf16 GEMM rate, measured now.

    ``sustained_s`` > 0: also the GEMM rate held that long back to back, over its second
    half (``matmul_sustained_flops_per_s``). The first rate is a lone burst at the full
    clock; under minutes of compute the H200 holds its 700 W cap by lowering the SM clock
    (NVML, 2026-12-01: the fused path at 128 heads ran at 1545-1830 MHz under
    sw_power_cap against 1980 MHz at rest), so a floor at the burst rate is not reachable
    by a compute-bound request. Both floors are reported; the README's rows quote the first."""
    nan = float("nan")
    if dev.type != "cuda":
        return {"copy_bytes_per_s": nan, "matmul_flops_per_s": nan,
                **({"matmul_sustained_flops_per_s": nan} if sustained_s > 0 else {})}
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev)  # 2 GiB
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)

    def t(fn, n=10, warm=3):
        for _ in range(warm):
            fn()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / 1e3 / n

    copy = 2 * x.numel() * 2 / t(lambda: y.copy_(x))
    one = t(lambda: a @ b)
    got = {"copy_bytes_per_s": copy, "matmul_flops_per_s": 2 * 8192**3 / one}
    if sustained_s > 0:
        half = max(1, round(sustained_s / 2 / one))
        got["matmul_sustained_flops_per_s"] = 2 * 8192**3 / t(lambda: a @ b, n=half, warm=half)
        got["sustained_s"] = sustained_s
    x = y = a = b = None  # (not del: the lambdas above name them)
    torch.cuda.empty_cache()
    return got


def request_flops(heads: int, contexts, queries) -> tuple[int, int]:
    """(kv_b_proj FLOPs, attention FLOPs) of one request."""
    ctx = sum(contexts)
    kvb = 2 * ctx * L * heads * (P + V)
    att = 2 * sum(q * c for q, c in zip(queries, contexts)) * heads * (P + R + V)
    return kvb, att


def floor_seconds(cfg, contexts, queries, ceil, rate: str = "matmul_flops_per_s", pack: bool = True) -> dict:
    """Lower bound of one request: FLOPs at the matrix rate ``ceil[rate]`` + glue bytes at
    copy bandwidth. ``pack=False``: the bytes of a path that packs no K (bf16 prefill with
    unpacked keys: the floor of the work it does, not of the work it avoids)."""
    H = cfg.shape.heads
    ctx = sum(contexts)
    kvb_flops, att_flops = request_flops(H, contexts, queries)
    fp8 = cfg.prefill_dtype == "fp8"
    e = 1 if fp8 else 2
    slot = cfg.cache.bytes_per_slot
    glue = (
        ctx * (slot + (L + R) * 2)  # gather: read slots, write bf16 workspace
        # pack: read k_nope, k_pe; write k (fp8 prefill always packs: it quantizes)
        + ((ctx * H * P * 2 + ctx * R * 2 + ctx * H * (P + R) * e) if pack or fp8 else 0)
        + (ctx * H * V * (2 + e) if fp8 else 0)  # fp8: read v, write v8
    )
    parts = {"kv_b_proj_s": kvb_flops / ceil[rate], "attention_s": att_flops / ceil[rate],
             "glue_s": glue / ceil["copy_bytes_per_s"]}
    return {
        **parts,
        "total_s": sum(parts.values()),
        "attention_flops": att_flops,
        "kv_b_proj_flops": kvb_flops,
        "glue_bytes": glue,
    }


#: ``--sequences``: how a request's new and context tokens are split over its sequences
#: (cycled): bench_attention.py's ragged x4 batch — short queries over long contexts and
#: the other way round, so that a chunk's attention tiles differ in cost
RAGGED_QUERY_WEIGHTS = (1.0, 7.0, 2.5, 5.5)
RAGGED_CONTEXT_WEIGHTS = (6.0, 2.0, 8.0, 3.0)


def split_ragged(total: int, n: int, weights) -> list[int]:
    """``total`` tokens over ``n`` sequences in proportion to ``weights`` (cycled); the
    rounding goes to the last. Sums to ``total``."""
    w = [weights[i % len(weights)] for i in range(n)]
    out = [int(total * x / sum(w)) for x in w]
    out[-1] += total - sum(out)
    return out


def make_device_request(engine, context_lens, query_lens, seed: int = 0, piece: int = 65536):
    """(q, sequences) like ``workload.make_request``, but with the random latents and q
    drawn on the engine's device (drawing 256k×576 normals on the host takes seconds):
    contexts written into shuffled cache blocks, q already on the device."""
    from ctxprefill.engine.engine import SequenceSpec
    from ctxprefill.ops.fp8 import saturating_cast_fp8
    from ctxprefill_client import slot_mapping

    cfg, dev = engine.config, engine.device
    bs = cfg.cache.block_size
    need = [math.ceil(n / bs) for n in context_lens]
    if sum(need) > cfg.cache.num_blocks:
        raise ValueError(f"request needs {sum(need)} blocks, the cache has {cfg.cache.num_blocks}")
    perm = torch.randperm(cfg.cache.num_blocks, generator=torch.Generator().manual_seed(seed))[: sum(need)].tolist()
    g = torch.Generator(device=dev).manual_seed(seed)
    seqs, at = [], 0
    for n, nb, qn in zip(context_lens, need, query_lens):
        blocks = perm[at : at + nb]
        at += nb
        for j0 in range(0, n, piece):  # bounded temporaries
            slots = torch.from_numpy(slot_mapping(blocks, j0, min(n, j0 + piece), bs))
            kv_c = torch.randn((len(slots), L), generator=g, device=dev, dtype=torch.float32)
            k_pe = torch.randn((len(slots), R), generator=g, device=dev, dtype=torch.float32)
            engine.write_cache(slots, kv_c, k_pe)
        # as the service hands it to the engine (service/validate.py): an int64 array
        seqs.append(SequenceSpec(qn, n, np.asarray(blocks, dtype=np.int64)))
    q = torch.randn((sum(query_lens), cfg.shape.heads, cfg.shape.qk_head_dim), generator=g, device=dev,
                    dtype=torch.bfloat16)
    q = saturating_cast_fp8(q) if cfg.prefill_dtype == "fp8" else q
    _sync(dev)
    return q, seqs


def _with_gemm(engine, q, seqs, dev, gemm: str, it: dict) -> dict:
    """The fused request with the engine's GEMM set to ``gemm`` (its config's
    ``kv_b_proj_gemm``), eager and as a CUDA graph (its graphs captured anew), then the
    engine's graphs dropped again and the GEMM set back: :func:`time_request`'s figures of
    the graph, ``eager`` (the eager request's) and ``gemm`` and ``same`` (the replay's bits
    equal the eager request's with that kernel)."""
    was = engine.config
    engine.release_graphs()
    engine.config = dataclasses.replace(was, kv_b_proj_gemm=gemm)
    try:
        eager = time_request(engine, q, seqs, True, dev, **it)
        r = time_request(engine, q, seqs, True, dev, graphs_on=True, **it)
    finally:
        engine.config = was
        engine.release_graphs()
    r["gemm"], r["eager"], r["same"] = gemm, eager, _same_bits(r["result"], eager["result"])
    return r


#: the CUDA graph A/Bs (``_graphs_ab``): LoopGraphs' switch, the option giving its rounds,
#: and its row fields' prefix and names for the switch off and on
GRAPH_ABS = (("merges_beside", "merges_ab", "merges", "in_line", "beside"),
             ("graph_variants", "graph_variants_ab", "graph_variants", "off", "on"))


def _rounds_ab(rounds: int, switch, request, want, stage: str, label: str) -> dict:
    """``request()`` timed with ``switch(False)`` and ``switch(True)`` in ``rounds``
    interleaved rounds (off first in the 1st, 3rd, … round, on first in the others: a GPU
    under its power cap slows over a run): per setting the median of the rounds' medians
    of the request (``off_s``, ``on_s``) and of its ``stage`` (``off_{label}_s``, …), and
    whether every request gave the bits of ``want`` (a result of the same request)."""
    got: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            switch(on)
            got[on].append(request())
    out = {"rounds": rounds, "same": all(_same_bits(t["result"], want) for ts in got.values() for t in ts)}
    for on, name in ((False, "off"), (True, "on")):
        out[f"{name}_s"] = statistics.median(t["median_s"] for t in got[on])
        out[f"{name}_{label}_s"] = statistics.median(t["stage_s"].get(stage, 0.0) for t in got[on])
    return out


def _eager_variants_ab(engine, q, seqs, dev, rounds: int, it: dict, want) -> dict:
    """The eager fused request with attention's Gluon kernel taking q's and K's TMA
    descriptors from the launch (``HOST_DESC`` through ``triton_attention.EAGER_WS``: host
    work each launch, a shorter start for every tile) and not (``_rounds_ab``, its
    attention stage as ``off_attention_s`` / ``on_attention_s``)."""
    from ctxprefill.backends import triton_attention as ta

    was = ta.EAGER_WS

    def switch(on: bool) -> None:
        ta.EAGER_WS = {"HOST_DESC": True} if on else {}

    try:
        return _rounds_ab(rounds, switch, lambda: time_request(engine, q, seqs, True, dev, **it), want,
                          "attention", "attention")
    finally:
        ta.EAGER_WS = was


#: --eager-variants-ab (``_eager_variants_ab``): its row fields' prefix and names for the
#: setting off and on, as ``GRAPH_ABS``' last three (its stage: attention, not the replay)
EAGER_AB = ("eager_variants", "off", "on")


def _ab_fields(prefix: str, off: str, on: str, ab: dict, label: str = "replay") -> dict:
    """A row's fields of a ``_rounds_ab`` result, named ``{prefix}_{off|on}_...``."""
    return {f"{prefix}_ab_rounds": ab["rounds"], f"{prefix}_{off}_s": ab["off_s"],
            f"{prefix}_{off}_{label}_s": ab[f"off_{label}_s"], f"{prefix}_{on}_s": ab["on_s"],
            f"{prefix}_{on}_{label}_s": ab[f"on_{label}_s"], f"{prefix}_ab_bit_identical": ab["same"]}


def _ab_note(prefix: str, off: str, on: str, ab: dict, label: str = "replay") -> str:
    """The progress line's note of a ``_rounds_ab`` result."""
    return (f"  ({prefix.replace('_', ' ')} {off.replace('_', ' ')} | {on}: {label} {ab[f'off_{label}_s'] * 1e3:.3f} "
            f"| {ab[f'on_{label}_s'] * 1e3:.3f} ms, request {ab['off_s'] * 1e3:.3f} | {ab['on_s'] * 1e3:.3f} ms)")


def _graphs_ab_note(graph_abs: dict[str, dict]) -> str:
    """The progress line's note of each ``_graphs_ab`` result a row has, by switch."""
    return "".join(_ab_note(prefix, off, on, ab)
                   for switch, _, prefix, off, on in GRAPH_ABS if (ab := graph_abs.get(switch)) is not None)


def _graphs_ab(engine, q, seqs, dev, switch: str, rounds: int, it: dict, want) -> dict:
    """The fused request as a CUDA graph with ``LoopGraphs``' boolean ``switch`` off and on
    (``merges_beside``: the merges in line or on a branch of their own; ``graph_variants``:
    attention told it is captured or not), each captured anew (``_rounds_ab``, the replay
    as ``off_replay_s`` / ``on_replay_s``)."""
    graphs = engine.graphs
    was = getattr(graphs, switch)

    def flip(on: bool) -> None:
        engine.release_graphs()
        setattr(graphs, switch, on)

    try:
        return _rounds_ab(rounds, flip, lambda: time_request(engine, q, seqs, True, dev, graphs_on=True, **it),
                          want, "graph", "replay")
    finally:
        setattr(graphs, switch, was)
        engine.release_graphs()


def time_request(engine, q, seqs, fused, dev, max_iters=5, min_iters=2, target_s=0.3, unpacked_keys=None,
                 graphs_on=None):
    """Median wall time of a request (device synchronized), median time per stage, the
    last result, and how many warm-up and timed calls ran. Warm-up: one call, a second
    one when the first was cheap (always with ``graphs_on``: the shape is captured at its
    second call and replays from the third); then timed calls until ``target_s`` of
    measured time, at least ``min_iters`` and at most ``max_iters`` of them."""
    min_iters = max(1, min(min_iters, max_iters))
    kw = {} if unpacked_keys is None else {"unpacked_keys": unpacked_keys}
    if graphs_on is not None:
        kw["graphs_on"] = graphs_on

    def call():
        _sync(dev)
        t = time.perf_counter()
        r = engine.prefill_context(q, seqs, fused=fused, **kw)
        _sync(dev)
        return time.perf_counter() - t, r

    t_first, _ = call()
    warm = 1
    if t_first < 0.05 or graphs_on:
        call()
        warm = 2
    times, stages, spans, outside = [], [], [], []
    while len(times) < max_iters and (len(times) < min_iters or sum(times) < target_s):
        t, r = call()
        times.append(t)
        stages.append(r.stats.stage_ns)
        spans.append(r.stats.span_ns)
        outside.append(t - sum(r.stats.stage_ns.values()) / 1e9)
    keys = sorted(set().union(*stages))
    stage_med = {k: statistics.median(s.get(k, 0) for s in stages) / 1e9 for k in keys}
    # outside_s: the time outside the stages, per call (a difference of medians would carry
    # the device's call-to-call jitter: ~0.2 ms on a 12 ms request)
    return {"median_s": statistics.median(times), "min_s": min(times), "iters": len(times), "warmup": warm,
            "stage_s": stage_med, "outside_s": statistics.median(outside), "span_s": statistics.median(spans) / 1e9,
            "result": r}


def predict_row_s(work: float, history: list[dict], target_s: float, min_iters: int, max_iters: int,
                  safety: float = 1.5) -> float | None:
    """Predicted wall time of a grid row of ``work`` FLOPs from the rows measured so far
    (``history``: dicts with ``work``, ``t_s`` (the slower path's request time) and
    ``setup_s``): request time scaled linearly from the largest measured row of no more
    work (or taken from the smallest larger one), times ``safety``; None before any row."""
    if not history:
        return None
    below = [h for h in history if h["work"] <= work]
    if below:
        h = max(below, key=lambda h: h["work"])
        t = h["t_s"] * (work / h["work"] if h["work"] else 1.0)
    else:
        t = min(history, key=lambda h: h["work"])["t_s"]
    t *= safety
    min_iters = max(1, min(min_iters, max_iters))
    n = min(max_iters, max(min_iters, math.ceil(target_s / t) if t > 0 else max_iters))
    warm = 1 if t >= 0.05 else 2
    setup = statistics.median(h["setup_s"] for h in history)
    return setup + 2 * (warm + n) * t


def _same_bits(a, b) -> bool:
    return bool(torch.equal(a.out.view(torch.int16), b.out.view(torch.int16))
                and torch.equal(a.lse.view(torch.int32), b.lse.view(torch.int32)))


@contextlib.contextmanager
def _launch_order_replaced(backend, fn):
    """``backend.launch_order`` replaced by ``fn`` on this instance for the block."""
    backend.launch_order = fn
    try:
        yield
    finally:
        del backend.launch_order


def launch_orders_given(engine, q, seqs, fused: bool = True) -> tuple[list, object]:
    """(the launch orders the engine's backend gives, chunk by chunk — None where it gives
    none —, the result) of one request."""
    real, gave = engine.backend.launch_order, []

    def probe(*a, **kw):
        gave.append(real(*a, **kw))
        return gave[-1]

    with _launch_order_replaced(engine.backend, probe):
        result = engine.prefill_context(q, seqs, fused=fused)
    return gave, result


def _without_launch_order(engine, q, seqs, dev, it: dict) -> dict | None:
    """The fused path timed with the backend's launch order turned off, or None where it
    gives none for this request's chunks (then there is nothing to compare)."""
    gave, _ = launch_orders_given(engine, q, seqs)
    if not any(x is not None for x in gave):
        return None
    with _launch_order_replaced(engine.backend, lambda *a, **kw: None):
        return time_request(engine, q, seqs, True, dev, **it)


def _clocks(monitor, engine, q, seqs, fused: bool, dev, t_request: float, seconds: float) -> dict | None:
    """What NVML reports (SM clock, power, clock-event reasons) over a pass of back-to-back
    requests of at least ``seconds`` (clock_monitor.py: the fused path's compute stages ran
    slower than the generic path's in one process — a power-capped clock?). None without
    NVML or with ``--clocks-s 0``."""
    if monitor is None or not monitor.available or seconds <= 0:
        return None
    n = max(2, math.ceil(seconds / max(t_request, 1e-6)))

    def run():
        for _ in range(n):
            engine.prefill_context(q, seqs, fused=fused)
        _sync(dev)

    r = monitor.sample_during(run)
    return None if r is None else {**r, "requests": n}


class _Engines:
    """Engines of the grid, one per row (built with just enough cache blocks); the
    random kv_b_proj weights are made once per head count and shared."""

    def __init__(self):
        self._weights = {}

    def build(self, s: ServeSettings):
        from ctxprefill.config import CacheConfig
        from ctxprefill.engine.engine import Engine
        from ctxprefill.settings import resolve_device

        key = (s.heads, s.kv_b_proj_dtype, s.seed)
        if key not in self._weights:
            engine = build_engine(s)
            self._weights[key] = (engine.config, engine.weights)
            return engine
        cfg, weights = self._weights[key]
        cfg = dataclasses.replace(cfg, cache=CacheConfig(s.cache_dtype, s.block_size, s.num_blocks, s.k_scale),
                                  prefill_dtype=s.prefill_dtype, workspace_tokens=s.workspace_tokens,
                                  backend=s.backend, fused=not s.generic)
        return Engine(cfg, weights, resolve_device(s.device))


def _clean(x):
    """NaN/inf -> None, so that the JSON is strict."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _write_json(path: str, meta: dict, rows: list) -> None:
    """The run so far; ``growth``: the lines fitted along context (growth.py) where the grid
    has three or more context lengths."""
    doc = {"meta": meta, "rows": rows}
    fitted = growth.growth(rows)
    if fitted:
        doc["growth"] = fitted
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_clean(doc), f, indent=1)
    os.replace(tmp, path)


def _axes(ns) -> dict:
    grid = GRIDS[ns.grid]
    return {k: (getattr(ns, k) if getattr(ns, k) is not None else grid[k]) for k in grid}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ctxprefill bench", description=(__doc__ or "").replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--grid", choices=sorted(GRIDS), default="default",
                   help="default: H {16,128}, 1024 new over 64k context, every dtype pair; full: the "
                        "2x3x3x3x2 grid of H, new, context, cache and prefill dtypes. An axis flag below "
                        "overrides that axis of the grid")
    p.add_argument("--heads", type=int, nargs="+", default=None)
    p.add_argument("--new", type=int, nargs="+", default=None, help="new (query) tokens per request")
    p.add_argument("--context", type=int, nargs="+", default=None, help="cached context tokens per request")
    p.add_argument("--cache-dtype", nargs="+", default=None)
    p.add_argument("--prefill-dtype", nargs="+", default=None)
    p.add_argument("--kv-b-proj-dtype", default="bf16")
    p.add_argument("--workspace-tokens", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--backend", default="auto")
    p.add_argument("--sequences", type=int, default=1,
                   help="sequences per request: the new and context tokens split over them unevenly "
                        "(RAGGED_*_WEIGHTS); with more than one, the fused path is also timed without the "
                        "attention backend's launch order (the Triton backend's per-SM packing)")
    p.add_argument("--iters", type=int, default=5, help="most timed calls per path and row")
    p.add_argument("--cpu-latency-us", type=int, default=None,
                   help="hold /dev/cpu_dma_latency at this many microseconds while measuring (bench/pm_qos.py, "
                        "what the latency-performance tuned profile does; root only): idle CPUs wake fast")
    p.add_argument("--min-iters", type=int, default=2, help="fewest timed calls per path and row")
    p.add_argument("--target-s", type=float, default=0.3,
                   help="timed calls per path continue until this much measured time (within the iteration limits)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget of the whole run (from start-up): a row predicted not to finish before "
                        "it is skipped and recorded as skipped")
    p.add_argument("--clocks-s", type=float, default=0.0,
                   help="after timing a row, run each path this many seconds more while NVML's SM clock, power "
                        "and clock-event reasons are sampled (CUDA with nvidia-ml-py; 0: off)")
    p.add_argument("--sustained-gemm-s", type=float, default=2.0,
                   help="also measure the GEMM rate held this long (its second half), and report each row's floor "
                        "at that rate too: the H200 lowers its clock under its power cap (0: off)")
    from ctxprefill.ops.kv_b_proj import GEMMS

    p.add_argument("--gemm", choices=GEMMS, default="cublas",
                   help="kv_b_proj's bf16 GEMM kernel on a Hopper GPU (serve --kv-b-proj-gemm)")
    p.add_argument("--gemm-ab", choices=GEMMS, default=None,
                   help="also time each row's fused request, eager and as a CUDA graph, with this GEMM kernel, in "
                        "the same process right after the runs with --gemm's (the A/B of the two)")
    p.add_argument("--merges-ab", type=int, default=0, metavar="ROUNDS",
                   help="also time each row's CUDA graph with its merges in line and on a branch of their own "
                        "(engine/graphs.py), in this many interleaved rounds (0: off)")
    p.add_argument("--graph-variants-ab", type=int, default=0, metavar="ROUNDS",
                   help="also time each row's CUDA graph with attention told it is captured and not (its "
                        "variants for CUDA graphs, engine/graphs.py), in this many interleaved rounds (0: off)")
    p.add_argument("--eager-variants-ab", type=int, default=0, metavar="ROUNDS",
                   help="also time each row's eager fused request with attention's q and K descriptors made by "
                        "the launch and by every program (triton_attention.EAGER_WS), in this many interleaved "
                        "rounds (0: off)")
    p.add_argument("--out", default=None, help="write JSON results here (rewritten after every row)")
    ns = p.parse_args(argv)
    if ns.sequences < 1:
        p.error("--sequences must be >= 1")
    if ns.cpu_latency_us is None:
        return _measure(ns, "not requested")
    import pm_qos  # bench/pm_qos.py (bench/ on the path, as for every benchmark here)

    with pm_qos.cpu_latency(ns.cpu_latency_us) as qos:
        return _measure(ns, qos)


def _measure(ns: argparse.Namespace, cpu_latency: str) -> int:
    from ctxprefill.settings import resolve_device

    t_start = time.monotonic()
    deadline = t_start + ns.budget_s if ns.budget_s is not None else None
    axes = _axes(ns)
    dev = resolve_device(ns.device)
    ceil = measure_ceilings(dev, ns.sustained_gemm_s)
    host = measure_host(dev)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    print(f"device {dev} ({gpu or 'cpu'}); torch {torch.__version__}; "
          f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 GEMM {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s"
          + (f" ({ceil['matmul_sustained_flops_per_s'] / 1e12:.0f} held for {ns.sustained_gemm_s:g} s)"
             if "matmul_sustained_flops_per_s" in ceil else "")
          + f"; host: a small op issued in {host['op_issue_us']:.1f} µs, a 100k-step Python loop in "
          f"{host['python_loop_ms']:.2f} ms", flush=True)
    ext = {"loaded": None, "why_not": None, "load_s": None}
    if dev.type == "cuda":  # build or load the fused kernels now, not inside the first row's warm-up
        from ctxprefill.ops import _cuda

        t = time.monotonic()
        mod = _cuda.load()
        ext = {"loaded": mod is not None, "why_not": None if mod is not None else _cuda.why_not(),
               "load_s": time.monotonic() - t}
        print(f"CUDA extension: {'loaded' if mod is not None else 'UNAVAILABLE (' + ext['why_not'] + ')'} "
              f"in {ext['load_s']:.1f} s", flush=True)
    grid = list(itertools.product(axes["heads"], axes["new"], axes["context"], axes["cache_dtype"],
                                  axes["prefill_dtype"]))
    gemm = ns.gemm
    meta = {"kind": "engine", "date": run_info.utc_now(), "device": str(dev), "gemm": gemm,
            "gpu": gpu, "torch": torch.__version__, "commit": run_info.commit(), "ceilings": ceil, "host": host,
            "args": vars(ns), "grid": ns.grid, "axes": axes, "rows_planned": len(grid), "cuda_extension": ext,
            "cpu_latency": cpu_latency}
    rows: list[dict] = []
    history: list[dict] = []
    engines = _Engines()
    monitor = None
    if ns.clocks_s > 0:
        from ctxprefill.clock_monitor import ClockMonitor

        monitor = ClockMonitor(dev)
        meta["clocks"] = {"seconds_per_path": ns.clocks_s, "available": monitor.available, "why_not": monitor.why_not}
        if not monitor.available:
            print(f"--clocks-s: no clock samples ({monitor.why_not})", flush=True)
    print(f"{len(grid)} rows; stage columns: the fused path's median ms per stage "
          f"({', '.join(f'{v}={k}' for k, v in _ABBR.items())}); the generic path's are in the JSON; gap: the "
          f"fused request's time outside its stages; in-span: the part of it between the first stage's start and "
          f"the last one's end (device work outside the stages, or the device waiting on the host; the rest is "
          f"host work before and after)", flush=True)
    hdr = (f"{'H':>4} {'new':>5} {'ctx':>7} {'cache':>10} {'prefill':>7} {'chunks':>6} {'generic ms':>10} "
           f"{'fused ms':>9} {'speedup':>7} {'floor ms':>8} {'fused/floor':>11} {'launch/chunk g|f':>16} "
           f"{'it g|f':>6}  "
           + " ".join(f"{_ABBR[s]:>7}" for s in STAGES) + f" {'gap':>7} {'in-span':>7} {'t s':>6}")
    print(hdr, flush=True)  # each row is printed as it is measured: the table is the progress (no tqdm bar in a log)
    for i, (H, new, ctx, cd, pd) in enumerate(grid):
        key = {"heads": H, "new": new, "context": ctx, "cache_dtype": cd, "prefill_dtype": pd}
        ctx_lens = split_ragged(ctx, ns.sequences, RAGGED_CONTEXT_WEIGHTS)
        new_lens = split_ragged(new, ns.sequences, RAGGED_QUERY_WEIGHTS)
        if ns.sequences > 1:
            key.update(sequences=ns.sequences, context_lens=ctx_lens, new_lens=new_lens)
        work = sum(request_flops(H, ctx_lens, new_lens))
        if deadline is not None:
            left = deadline - time.monotonic()
            pred = predict_row_s(work, history, ns.target_s, ns.min_iters, ns.iters)
            if left <= 0 or (pred is not None and pred > left):
                why = f"budget: {left:.1f} s left" + (f", row predicted {pred:.1f} s" if pred is not None else "")
                print(f"{H:4d} {new:5d} {ctx:7d} {cd:>10} {pd:>7} skipped ({why})", flush=True)
                rows.append({**key, "skipped": why, "predicted_s": pred})
                if ns.out:
                    _write_json(ns.out, meta, rows)
                continue
        s = ServeSettings(device=str(dev), heads=H, block_size=ns.block_size,
                          num_blocks=sum(-(-c // ns.block_size) for c in ctx_lens) + 1, cache_dtype=cd,
                          prefill_dtype=pd,
                          kv_b_proj_dtype=ns.kv_b_proj_dtype, workspace_tokens=ns.workspace_tokens, backend=ns.backend,
                          kv_b_proj_gemm=gemm)
        t_row = time.monotonic()
        engine = q = seqs = g = f = fp = fgr = ab = eab = None
        graph_abs: dict[str, dict] = {}
        try:
            engine = engines.build(s)
            q, seqs = make_device_request(engine, ctx_lens, new_lens, seed=i)
            setup_s = time.monotonic() - t_row
            it = dict(max_iters=ns.iters, min_iters=ns.min_iters, target_s=ns.target_s)
            g = time_request(engine, q, seqs, False, dev, **it)
            f = time_request(engine, q, seqs, True, dev, **it)
            rg, rf = g["result"], f["result"]
            same = _same_bits(rf, rg)
            # unpacked keys (bf16 prefill): the fused path with its K pack beside it, the
            # pack's share of the fused request measured in the same process
            if rf.stats.unpacked_keys:
                fp = time_request(engine, q, seqs, True, dev, unpacked_keys=False, **it)
                same = same and _same_bits(fp["result"], rg)
            # the fused path with its chunk loop replayed as a CUDA graph (engine/graphs.py)
            if dev.type == "cuda":
                fgr = time_request(engine, q, seqs, True, dev, graphs_on=True, **it)
                same = same and _same_bits(fgr["result"], rg)
                if "graph" not in fgr["stage_s"]:  # not replayed (a capture failed): no graph figures
                    print(f"{H:4d} {new:5d} {ctx:7d} {cd:>10} {pd:>7}: the CUDA graph did not replay", flush=True)
                    fgr = None
                if fgr is not None and ns.gemm_ab is not None:  # another GEMM: its replay against its eager bits
                    ab = _with_gemm(engine, q, seqs, dev, ns.gemm_ab, it)
                    same = same and ab["same"]
                for switch, opt, *_ in GRAPH_ABS:  # --merges-ab, --graph-variants-ab
                    if fgr is not None and getattr(ns, opt) > 0:
                        graph_abs[switch] = _graphs_ab(engine, q, seqs, dev, switch, getattr(ns, opt), it, rg)
                        same = same and graph_abs[switch]["same"]
                if ns.eager_variants_ab > 0:  # --eager-variants-ab
                    eab = _eager_variants_ab(engine, q, seqs, dev, ns.eager_variants_ab, it, rg)
                    same = same and eab["same"]
            unordered = _without_launch_order(engine, q, seqs, dev, it) if ns.sequences > 1 else None
            if unordered is not None:
                same = same and _same_bits(rf, unordered["result"])
            clk_g = _clocks(monitor, engine, q, seqs, False, dev, g["median_s"], ns.clocks_s)
            clk_f = _clocks(monitor, engine, q, seqs, True, dev, f["median_s"], ns.clocks_s)
        except Exception as e:  # keep the grid going; record the failure
            print(f"{H:4d} {new:5d} {ctx:7d} {cd:>10} {pd:>7} failed: {type(e).__name__}: {e}", flush=True)
            rows.append({**key, "error": f"{type(e).__name__}: {e}"})
            engine = q = seqs = g = f = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            if ns.out:
                _write_json(ns.out, meta, rows)
            continue
        tg, tf = g["median_s"], f["median_s"]
        # the fused path's floor: of the stages it runs (no K pack with unpacked keys)
        packs = not rf.stats.unpacked_keys
        fl = floor_seconds(engine.config, ctx_lens, new_lens, ceil, pack=packs)
        floor = fl["total_s"]
        floor_packed = floor if packs else floor_seconds(engine.config, ctx_lens, new_lens, ceil)["total_s"]
        held = None
        if "matmul_sustained_flops_per_s" in ceil:
            held = floor_seconds(engine.config, ctx_lens, new_lens, ceil,
                                 rate="matmul_sustained_flops_per_s", pack=packs)["total_s"]
        n = len(rf.stats.chunks)
        lg, lf = sum(rg.stats.launches.values()) / n, sum(rf.stats.launches.values()) / n
        row_s = time.monotonic() - t_row
        history.append({"work": work, "t_s": max(tg, tf), "setup_s": setup_s})
        stage_ms = " ".join(f"{f['stage_s'].get(st, 0.0) * 1e3:7.3f}" for st in STAGES)
        gap_g, gap_f = tg - sum(g["stage_s"].values()), tf - sum(f["stage_s"].values())
        # the gap split: inside the span of the stages (between them: device work outside any
        # stage, or the device waiting on the host) and outside it (host before and after)
        in_g, in_f = g["span_s"] - sum(g["stage_s"].values()), f["span_s"] - sum(f["stage_s"].values())
        print(f"{H:4d} {new:5d} {ctx:7d} {cd:>10} {pd:>7} {n:6d} {tg * 1e3:10.3f} {tf * 1e3:9.3f} {tg / tf:7.2f} "
              f"{floor * 1e3:8.3f} {tf / floor:11.2f} {lg:7.1f} | {lf:6.1f} {g['iters']:>2}|{f['iters']:<3} "
              f"{stage_ms} {gap_f * 1e3:7.3f} {in_f * 1e3:7.3f} {row_s:6.2f}{'' if same else '  MISMATCH'}"
              + (f"  (fused without launch order {unordered['median_s'] * 1e3:.3f} ms)" if unordered else "")
              + (f"  (unpacked keys; fused with its K pack {fp['median_s'] * 1e3:.3f} ms)" if fp else "")
              + (f"  (CUDA graph {fgr['median_s'] * 1e3:.3f} ms, {fgr['median_s'] / floor:.2f}x floor)" if fgr else "")
              + (f"  (with GEMM {ab['gemm']}: eager {ab['eager']['median_s'] * 1e3:.3f} ms, graph "
                 f"{ab['median_s'] * 1e3:.3f} ms, {ab['median_s'] / floor:.2f}x floor)" if ab else "")
              + _graphs_ab_note(graph_abs)
              + (_ab_note(*EAGER_AB, eab, "attention") if eab else "")
              + (f"  SM MHz g|f {clk_g['sm_mhz_median']:.0f}|{clk_f['sm_mhz_median']:.0f}, "
                 f"W {clk_g['power_w_median']:.0f}|{clk_f['power_w_median']:.0f}" if clk_g and clk_f else ""),
              flush=True)
        rows.append({
            **key, "kv_b_proj_dtype": ns.kv_b_proj_dtype, "workspace_tokens": ns.workspace_tokens,
            "block_size": ns.block_size, "chunks": n,
            "backend": engine.backend.name, "fused_kernels_active": engine.fused_kernels_active,
            "generic_s": tg, "fused_s": tf, "speedup": tg / tf, "floor_s": floor, "fused_over_floor": tf / floor,
            # with the K pack's bytes (the floor of a fused path that packs K)
            "floor_packed_s": floor_packed, "unpacked_keys": rf.stats.unpacked_keys,
            **({"fused_packed_s": fp["median_s"], "fused_packed_stage_s": fp["stage_s"],
                "fused_packed_over_floor_packed": fp["median_s"] / floor_packed,
                "unpacked_gain": fp["median_s"] / tf} if fp else {}),
            # the two paths differ only in the pack (engine/loop.py): the speedup this request
            # would show if the fused pack took no time at all, the most any pack can give
            "speedup_free_pack": tg / max(tf - f["stage_s"].get("pack", 0.0), 1e-12),
            # the fused request with its chunk loop replayed as a CUDA graph: its time, the
            # replay's on the device, and the host's outside it (check, plan, copies in and out)
            **({"fused_graph_s": fgr["median_s"], "fused_graph_over_floor": fgr["median_s"] / floor,
                "fused_graph_replay_s": fgr["stage_s"].get("graph", 0.0),
                "fused_graph_outside_s": fgr["outside_s"]} if fgr else {}),
            # --gemm-ab: the same graph with the other GEMM kernel, timed right after
            **({"gemm_ab": ab["gemm"], "fused_ab_s": ab["eager"]["median_s"], "fused_graph_ab_s": ab["median_s"],
                "fused_graph_ab_replay_s": ab["stage_s"].get("graph", 0.0), "fused_graph_ab_outside_s": ab["outside_s"],
                "fused_graph_ab_over_floor": ab["median_s"] / floor, "ab_bit_identical": ab["same"]} if ab else {}),
            # --merges-ab, --graph-variants-ab: the graph with the switch off and on, interleaved rounds
            **{k: v for switch, _, *names in GRAPH_ABS if switch in graph_abs
               for k, v in _ab_fields(*names, graph_abs[switch]).items()},
            # --eager-variants-ab: the eager request with attention's q and K descriptors by the launch
            **(_ab_fields(*EAGER_AB, eab, "attention") if eab else {}),
            "floor": fl, "generic_min_s": g["min_s"], "fused_min_s": f["min_s"],
            **({"floor_sustained_s": held, "fused_over_sustained_floor": tf / held} if held else {}),
            **({"fused_graph_over_sustained_floor": fgr["median_s"] / held} if held and fgr else {}),
            "generic_stage_s": g["stage_s"], "fused_stage_s": f["stage_s"],
            "generic_host_gap_s": gap_g, "fused_host_gap_s": gap_f,
            "generic_span_s": g["span_s"], "fused_span_s": f["span_s"],
            "generic_gap_in_span_s": in_g, "fused_gap_in_span_s": in_f,
            "generic_launches": dict(rg.stats.launches), "fused_launches": dict(rf.stats.launches),
            "generic_launches_per_chunk": lg, "fused_launches_per_chunk": lf,
            "generic_iters": g["iters"], "fused_iters": f["iters"], "warmup": [g["warmup"], f["warmup"]],
            "setup_s": setup_s, "row_s": row_s, "bit_identical": same,
            **({"fused_no_launch_order_s": unordered["median_s"]} if unordered else {}),
            **({"generic_clocks": clk_g, "fused_clocks": clk_f} if monitor is not None else {}),
        })
        if ns.out:
            _write_json(ns.out, meta, rows)
        engine = q = seqs = g = f = rg = rf = fp = fgr = unordered = ab = eab = None
        graph_abs = {}
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    done = [r for r in rows if "speedup" in r]
    failed = [r for r in rows if "error" in r]
    mismatched = [r for r in done if not r["bit_identical"]]
    skipped = [r for r in rows if "skipped" in r]
    wall = time.monotonic() - t_start
    meta.update({"wall_s": wall, "rows_done": len(done), "rows_failed": len(failed), "rows_skipped": len(skipped),
                 "rows_mismatched": len(mismatched)})
    print(f"done: {len(done)} of {len(grid)} rows measured, {len(failed)} failed, {len(mismatched)} not bit-identical, "
          f"{len(skipped)} skipped (budget); {wall:.1f} s", flush=True)
    for r in done:
        if r["new"] == 1024 and r["context"] == 65536:
            seqs_note = f" ({r['sequences']} sequences)" if r.get("sequences") else ""
            print(f"  target H={r['heads']} {r['cache_dtype']}/{r['prefill_dtype']}{seqs_note}: "
                  f"speedup {r['speedup']:.2f} "
                  f"(>= 1.4: {r['speedup'] >= 1.4}; {r['speedup_free_pack']:.2f} with a pack of zero time), "
                  f"fused/floor "
                  + (f"{r['fused_over_floor']:.2f} (<= 1.2: {r['fused_over_floor'] <= 1.2})"
                     if math.isfinite(r["fused_over_floor"]) else "n/a")
                  + (f"; at the held GEMM rate {r['fused_over_sustained_floor']:.2f}"
                     if math.isfinite(r.get("fused_over_sustained_floor", math.nan)) else "")
                  + (f"; unpacked keys: {r['unpacked_gain']:.2f}x the fused request with its K pack "
                     f"({r['fused_packed_s'] * 1e3:.3f} ms, {r['fused_packed_over_floor_packed']:.2f}x its floor)"
                     if "unpacked_gain" in r else ""), flush=True)
    if ns.out:
        _write_json(ns.out, meta, rows)
    return 0 if not failed and not mismatched else 1


if __name__ == "__main__":
    sys.exit(main())
