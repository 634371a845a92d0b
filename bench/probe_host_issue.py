"""How long the host takes to issue one request, with the device never making it wait.

A 16-head request (1,024 new tokens over 64k context: the per-GPU shard of a 128-head
model under 8-way tensor parallelism) runs ~2 ms of kernels; its Python issues ~27
launches and ~48 timing events. When the host needs about as long as the device, the
device idles inside stages (a stage's events bracket its host work too), which shows as
the fused path's attention "running slower" than the generic path's on the same kernel
(the generic path's long pack hides the host). cProfile inflates Python several-fold, so
this measures without it: a spin kernel (``torch.cuda._sleep``) holds the device first,
so that nothing the host does waits on the device, and the host's time from the call to
the request's one synchronize is its issue time. The same for single calls of the loop's
pieces (per call, device held the same way). The paths: generic, fused, and fused with
its chunk loop replayed as a CUDA graph (engine/graphs.py) in place, copying, and through
torch's calls (PATHS).

  PYTHONPATH=server:client python3 bench/probe_host_issue.py --out bench/results/probe_host.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("client", "server", "bench"):
    if os.path.join(ROOT, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _sub))

import torch  # noqa: E402

import pm_qos  # noqa: E402
from ctxprefill.app import build_engine  # noqa: E402
from ctxprefill.engine import timing  # noqa: E402
from ctxprefill.engine.request import PrefillRequest, validate_prefill  # noqa: E402
from ctxprefill.settings import ServeSettings  # noqa: E402
from ctxprefill_bench import run_info  # noqa: E402
from ctxprefill_bench.engine_bench import make_device_request, time_request  # noqa: E402

HOLD_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: longer than anything issued behind it


#: how after_wait_us queues its 12 ms of GEMMs before a validation (the JSON's meta says it)
GEMM_WAIT = "one CUDA graph"
#: the paths probed: (name, fused, graphs_on). graph: the replay through the extension, q read
#: and out and LSE written in place where the capture found and checked that
#: (engine/graphs.py); graph_copies: the same with q copied into the graph's buffer and out
#: and LSE copied out of it; graph_torch: copying, queued through torch's calls
#: (Tensor.copy_, Event.record, CUDAGraph.replay), the baseline of the extension's launch
PATHS = (("generic", False, False), ("fused", True, False), ("graph", True, True), ("graph_copies", True, True),
         ("graph_torch", True, True))


@contextlib.contextmanager
def replay_mode(engine, path: str):
    """Within: every captured loop replays as ``path`` says (a PATHS name; graph and the
    eager paths: as the engine does)."""
    with contextlib.ExitStack() as patches:
        for loop in engine.graphs._graphs.values() if path in ("graph_copies", "graph_torch") else ():
            patches.enter_context(mock.patch.object(loop, "copies_because", "copying, as the probe asks"))
            if path == "graph_torch":
                patches.enter_context(mock.patch.object(loop, "_exec", 0))
        yield


def _requests(engine, q, seqs, fused: bool, graphs: bool, iters: int, marks: dict):
    """``iters`` requests, each from an idle device: yields (start, end) host times, with
    ``marks`` cleared before each (the wrappers fill it)."""
    for _ in range(iters):
        marks.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.prefill_context(q, seqs, fused=fused, graphs_on=graphs)
        yield t0, time.perf_counter()


def issue_time_s(engine, q, seqs, fused: bool, graphs: bool, iters: int) -> tuple[float, float]:
    """(median host time from the call to the first stage, median host time from the
    first stage to the request's synchronize in StageTimer.finish). The spin kernel is
    queued at the first stage, so the work before it runs with the device idle, as a
    request finds it."""
    marks = {}
    begin, finish = timing.StageTimer.begin, timing.StageTimer.finish

    def held_begin(self, name):
        if "first" not in marks:
            torch.cuda._sleep(HOLD_CYCLES)
            marks["first"] = time.perf_counter()
        return begin(self, name)

    def marked_finish(self):
        marks["finish"] = time.perf_counter()
        return finish(self)

    def held_begin_by_caller(self, name):  # a replay through the extension (engine/graphs.py)
        if "first" not in marks:
            torch.cuda._sleep(HOLD_CYCLES)
            marks["first"] = time.perf_counter()
        return begin_by_caller(self, name)

    begin_by_caller = timing.StageTimer.begin_recorded_by_caller
    pre, issue = [], []
    with mock.patch.object(timing.StageTimer, "begin", held_begin), \
            mock.patch.object(timing.StageTimer, "begin_recorded_by_caller", held_begin_by_caller), \
            mock.patch.object(timing.StageTimer, "finish", marked_finish):
        for t0, _ in _requests(engine, q, seqs, fused, graphs, iters, marks):
            pre.append(marks["first"] - t0)
            issue.append(marks["finish"] - marks["first"])
    return statistics.median(pre), statistics.median(issue)


def replay_launch_rounds(engine, q, seqs, rounds: int, iters: int) -> dict:
    """The replay's time outside its stage, its stage's time and its host steps up to the
    first copy, in place and copying q in and out and LSE out (both through the extension),
    in ``rounds`` interleaved rounds of ``iters`` requests each (a host's state drifts over
    a run: adjacent rounds see the same one): each round's medians per mode (s; the first
    copy and validation in µs, ``host_steps_us``), and the median over rounds of the
    differences (the copying mode's minus the in-place one's)."""
    got: dict[str, list[float]] = {f"{m}_{k}": [] for m in ("in_place", "copies")
                                   for k in ("outside_s", "stage_s", "first_copy_us", "validate_us")}
    for _ in range(rounds):
        for mode, path in (("in_place", "graph"), ("copies", "graph_copies")):
            with replay_mode(engine, path):
                t = time_request(engine, q, seqs, True, engine.device, max_iters=iters, min_iters=iters, target_s=0,
                                 graphs_on=True)
                steps = host_steps_us(engine, q, seqs, True, True, iters)
            got[f"{mode}_outside_s"].append(t["outside_s"])
            got[f"{mode}_stage_s"].append(sum(t["stage_s"].values()))
            got[f"{mode}_first_copy_us"].append(steps["first copy"])
            got[f"{mode}_validate_us"].append(steps["validate"])
    for k in ("outside_s", "stage_s"):
        got[f"median_saving_{k}"] = statistics.median(b - a for a, b in zip(got[f"in_place_{k}"], got[f"copies_{k}"],
                                                                          strict=True))
    got["in_place"] = all(loop.in_place for loop in engine.graphs._graphs.values())
    return got


#: a request's host steps, in order (probe_host_issue.host_steps_us)
STEPS = ("validate", "inputs", "metadata", "copies in", "to first stage", "issue+device", "sync+readout", "return")


def host_steps_us(engine, q, seqs, fused: bool, graphs: bool, iters: int) -> dict:
    """Median host time of each step of a normal (unheld) request, in µs: validation (with
    the plan; a replay of a one-sequence shape that replayed before checks its block ids
    alone, ``Engine.known_shape``), the loop's inputs (none on a replay), the chunk metadata (and on a replay its
    graph's lookup), the copies of the metadata (and q, on a copying replay) into device memory, the
    rest up to the first stage, the stages' issue and the device's work, the synchronize and event
    readout, the return to the caller; and ``first copy``: from the call to the first
    device work queued (the end of the copies in: q is already on the device; on a replay
    through the extension, the time its one call returns for the copies queued, before it
    records the stage's start and launches the graph)."""
    from ctxprefill.engine import engine as engine_mod
    from ctxprefill.engine import graphs as graphs_mod
    from ctxprefill.engine import loop as loop_mod

    marks: dict[str, float] = {}

    def marking(orig, before, *after):
        def wrapped(*args, **kwargs):
            if before and before not in marks:
                marks[before] = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                t = time.perf_counter()
                for a in after:
                    marks.setdefault(a, t)

        return wrapped

    # (owner, name, mark at its first call's start, marks at its first call's end). A replay
    # through the extension (engine/graphs.py) stages its metadata, then queues the copies in,
    # the stage's start and the graph in one call (``launch``, an attribute of each captured
    # loop), which returns the time the copies were queued: the copies in end there, the first
    # stage starts at the call's end.
    wraps = [(engine_mod, "validate_prefill", None, "checked"), (engine_mod.Engine, "known_shape", None, "checked"),
             (engine_mod.Engine, "loop_inputs", None, "inputs"),
             (loop_mod, "_upload", "copy0", "copy1"), (graphs_mod.CapturedLoop, "load", "copy0", "copy1"),
             (graphs_mod.CapturedLoop, "_stage", "copy0"),
             (timing.StageTimer, "begin", "first_stage"), (timing.StageTimer, "finish", "finish", "finished")]

    def launching(orig):  # the extension's graph_launch: its return marks the copies queued
        def wrapped(*args, **kwargs):
            queued = orig(*args, **kwargs)
            marks.setdefault("copy1", queued)
            marks.setdefault("first_stage", time.perf_counter())
            return queued

        return wrapped

    launches = [(loop, name) for loop in engine.graphs._graphs.values() for name in ("launch", "launch_in_place")
                if getattr(loop, name) is not None]
    got: dict[str, list[float]] = {k: [] for k in (*STEPS, "first copy")}
    with contextlib.ExitStack() as patches:
        for owner, name, before, *after in wraps:
            patches.enter_context(mock.patch.object(owner, name, marking(getattr(owner, name), before, *after)))
        for loop, name in launches:
            patches.enter_context(mock.patch.object(loop, name, launching(getattr(loop, name))))
        for t0, t1 in _requests(engine, q, seqs, fused, graphs, iters, marks):
            m = marks
            # a replay takes no loop inputs: its shape and metadata come straight from the
            # checked request
            inputs = m.get("inputs", m["checked"])
            for k, a, b in (("validate", t0, m["checked"]), ("inputs", m["checked"], inputs),
                            ("metadata", inputs, m["copy0"]), ("copies in", m["copy0"], m["copy1"]),
                            ("to first stage", m["copy1"], m["first_stage"]),
                            ("issue+device", m["first_stage"], m["finish"]),
                            ("sync+readout", m["finish"], m["finished"]), ("return", m["finished"], t1),
                            ("first copy", t0, m["copy1"])):
                got[k].append((b - a) * 1e6)
    return {k: round(statistics.median(v), 1) for k, v in got.items()}


def per_call_us(fn, n: int = 200, hold: bool = True) -> float:
    """Median over 5 rounds of the mean host time of ``n`` calls, the device held by a
    spin kernel (``hold=False``: idle, for calls that wait for it)."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        if hold:
            torch.cuda._sleep(HOLD_CYCLES)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(rounds)


def after_wait_us(fn, n: int = 40) -> dict[str, float]:
    """Median host time (µs) of one ``fn()`` call: in a loop (``hot``), and right after the
    thread waited for a spin kernel of ~1.5 or ~12 ms (a 16- and a 128-head request's
    device time), for ~12 ms of GEMMs (one graph: the device at its power cap), and for
    ~12 ms spent calling ``fn`` over and over (``12 ms busy``), ~12 ms polling the stream
    from Python (``12 ms polled``; ``yielding``: with ``sched_yield`` between polls) and
    13 ms asleep (``12 ms asleep``): which part of a request's host steps the wait costs,
    whether the device's load or the waiting is why, and whether waiting in Python would do."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def device_ms(work) -> float:
        start.record()
        work()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)

    def timed_once() -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.mm(x, x)
    mm_ms = device_ms(lambda: [torch.mm(x, x) for _ in range(20)]) / 20
    gemms = torch.cuda.CUDAGraph()  # ~12 ms of GEMMs in one launch (GEMM_WAIT), as the spin kernel is
    with torch.cuda.graph(gemms):
        for _ in range(max(1, round(12.0 / mm_ms))):
            torch.mm(x, x)
    cycles_per_ms = 10_000_000 / device_ms(lambda: torch.cuda._sleep(10_000_000))

    def spin(ms: float):
        return lambda: torch.cuda._sleep(int(ms * cycles_per_ms))

    got = {"hot": [timed_once() for _ in range(n)]}
    stream = torch.cuda.current_stream()
    for name, queue, how in (("1.5 ms", spin(1.5), "sync"), ("12 ms", spin(12.0), "sync"),
                             ("12 ms gemm", gemms.replay, "sync"), ("12 ms busy", spin(12.0), "busy"),
                             ("12 ms polled", spin(12.0), "poll"), ("12 ms yielding", spin(12.0), "yield"),
                             ("12 ms asleep", spin(12.0), "sleep")):
        got[name] = []
        for _ in range(n):
            queue()
            if how == "busy":
                while not stream.query():
                    fn()
            elif how == "poll":  # the thread asks the stream from Python, running nothing else
                while not stream.query():
                    pass
            elif how == "yield":  # the same, giving the GIL and the core away between asks
                while not stream.query():
                    os.sched_yield()
            elif how == "sleep":  # off the core until the work is surely done
                time.sleep(0.013)
                torch.cuda.synchronize()
            else:
                torch.cuda.synchronize()
            got[name].append(timed_once())
    return {k: round(statistics.median(v) * 1e6, 2) for k, v in got.items()}


def triton_run_us(fn, n: int = 50) -> float | None:
    """Mean host time per ``fn()`` spent inside the Triton kernels' ``JITFunction.run``
    (device held); None when the backend is not ours."""
    try:
        from ctxprefill.backends import gluon_attention, triton_attention
    except Exception:  # noqa: BLE001 - no Triton
        return None
    spent = [0.0]
    kernels = [jf for jf in (getattr(gluon_attention, "_mla_attn_ws_fwd", None),
                             getattr(triton_attention, "_mla_ctx_attn_fwd", None)) if hasattr(jf, "run")]

    def timing_run(orig):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t

        return timed

    with contextlib.ExitStack() as patches:
        for jf in kernels:
            patches.enter_context(mock.patch.object(jf, "run", timing_run(jf.run)))
        torch.cuda.synchronize()
        torch.cuda._sleep(HOLD_CYCLES)
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return spent[0] / n * 1e6 if kernels else None


def profile_top(fn, n: int = 200, top: int = 25) -> list[dict]:
    """cProfile of ``n`` calls of ``fn`` (device held): the ``top`` functions by own time,
    µs per call of ``fn``. cProfile inflates every Python call; read the shares, not the
    absolute figures."""
    import cProfile
    import pstats

    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(HOLD_CYCLES)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"function": f"{os.path.basename(file)}:{line}:{func}", "calls_per_call": nc / n,
                     "own_us": round(tt / n * 1e6, 2), "cumulative_us": round(ct / n * 1e6, 2)})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


def _measure(a: argparse.Namespace) -> list[dict]:
    """Every (heads, prefill dtype) row, printed as it is measured."""
    rows = []
    cpus = os.sched_getaffinity(0)
    for heads, pd in [(h, pd) for h in a.heads for pd in a.prefill_dtype]:
        s = ServeSettings(device="cuda", heads=heads, prefill_dtype=pd, block_size=64,
                          num_blocks=math.ceil(a.context / 64) + 8, workspace_tokens=a.workspace_tokens)
        if a.pin_cpu is not None:  # the engine's threads start on every CPU, then this thread alone moves
            os.sched_setaffinity(0, cpus)
        engine = build_engine(s)
        if a.pin_cpu is not None:
            os.sched_setaffinity(0, {a.pin_cpu})
        q, seqs = make_device_request(engine, [a.context], [a.new])
        row = {"heads": heads, "new": a.new, "context": a.context, "prefill_dtype": pd}
        for name, fused, graphs in PATHS:
            with replay_mode(engine, name):
                t = time_request(engine, q, seqs, fused, engine.device, max_iters=a.iters, min_iters=a.iters,
                                 target_s=0, graphs_on=graphs)
                row[f"{name}_request_s"] = t["median_s"]
                row[f"{name}_span_s"] = t["span_s"]
                row[f"{name}_stages_s"] = sum(t["stage_s"].values())
                # the request's time outside its stages: host work before and after the device's,
                # and the device idle between stages
                row[f"{name}_outside_s"] = t["outside_s"]
                row[f"{name}_before_stages_s"], row[f"{name}_issue_s"] = issue_time_s(engine, q, seqs, fused, graphs,
                                                                                      a.iters)
                row[f"{name}_host_steps_us"] = host_steps_us(engine, q, seqs, fused, graphs, a.iters)
        row["replay_launch_rounds"] = replay_launch_rounds(engine, q, seqs, a.rounds, a.iters)
        row["graph_replays"] = engine.graphs.replays
        row["graph_quick_replays"] = engine.quick_replays  # of them, one-sequence shapes known before (quick checks)
        # the captured loop's arguments into q, out and LSE (engine/graphs.py's GraphPatch), and
        # why its replays copy ("" where they run in place)
        for loop in engine.graphs._graphs.values():
            row["graph_copies_because"] = loop.copies_because
            if loop.patch is not None:
                row["graph_patch"] = {"arguments": list(loop.patch.counts),
                                      "descriptors": list(loop.patch.descriptor_counts),
                                      "nodes": loop.patch.nodes, "unlisted_nodes": loop.patch.unlisted}
        if not row["graph_replays"]:  # else the "graph" rows would be the eager loop's
            raise SystemExit(f"probe_host_issue: H={heads} {pd}: the graph path never replayed")
        # the pieces, one call each (device held): what a stage's bracket costs the host
        ev = torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream()
        row["event_record_us"] = per_call_us(lambda: ev.record(stream))
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        e1.record(stream)
        torch.cuda.synchronize()
        row["event_elapsed_us"] = per_call_us(lambda: e0.elapsed_time(e1))
        row["empty_us"] = per_call_us(lambda: torch.empty((1024, heads, 128), dtype=torch.bfloat16, device="cuda"))
        # the request's host work before its first stage: validation, and the upload of its
        # block table and chunk metadata (one copy from pinned memory; pageable beside it)
        request = PrefillRequest(q, seqs)
        row["validate_us"] = per_call_us(lambda: validate_prefill(request, engine.config, engine.instance_id), n=50)
        row["validate_after_wait_us"] = after_wait_us(lambda: validate_prefill(request, engine.config,
                                                                               engine.instance_id))
        small = torch.zeros(1100, dtype=torch.int32)
        row["h2d_pageable_4k_us"] = per_call_us(lambda: small.to("cuda"), hold=False)
        row["h2d_pinned_4k_us"] = per_call_us(lambda: small.pin_memory().to("cuda", non_blocking=True), hold=False)
        chunk = {}

        def keep(i, c, q_c, k, v, o, lse):
            if i == 0:
                chunk.update(q=q_c, k=k, v=v, rows=c.rows)

        engine.prefill_context(q, seqs, fused=True, observer=keep)
        dev = engine.device
        cu_q = torch.tensor([0, chunk["q"].shape[0]], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, chunk["rows"]], dtype=torch.int32, device=dev)
        kw = {}
        if chunk["v"].dim() == 3 and chunk["v"].shape[1] == 128 and chunk["v"].shape[0] == heads:
            kw = {"v_layout": "hdt", "cu_seqlens_v": cu_k}
        be = engine.backend
        row["attention_call_us"] = per_call_us(lambda: be.run_context_chunk(
            chunk["q"], chunk["k"], chunk["v"], cu_q, cu_k, chunk["q"].shape[0], chunk["rows"], 0.1, **kw), n=50)
        # of which inside Triton's launch (JITFunction.run: binding, specialization, cache
        # lookup, the launcher), for whichever Triton kernel the backend runs here
        row["attention_triton_run_us"] = triton_run_us(lambda: be.run_context_chunk(
            chunk["q"], chunk["k"], chunk["v"], cu_q, cu_k, chunk["q"].shape[0], chunk["rows"], 0.1, **kw))
        row["attention_call_profile"] = profile_top(lambda: be.run_context_chunk(
            chunk["q"], chunk["k"], chunk["v"], cu_q, cu_k, chunk["q"].shape[0], chunk["rows"], 0.1, **kw))
        row["fused_request_profile"] = profile_top(lambda: engine.prefill_context(q, seqs, fused=True), n=20, top=40)
        row["graph_request_profile"] = profile_top(
            lambda: engine.prefill_context(q, seqs, fused=True, graphs_on=True), n=20, top=40)
        rows.append(row)
        print(json.dumps({k: (round(v * 1e3, 4) if k.endswith("_s") else round(v, 2) if isinstance(v, float) else v)
                          for k, v in row.items() if not isinstance(v, list)}), flush=True)
        chunk.clear()
        engine = q = seqs = be = None
        torch.cuda.empty_cache()
    print("ms: request / device span / host time before the first stage / host time issuing the stages "
          "(device held: no waits); us: per host call")
    for r in rows:
        for path, _, _ in PATHS:
            print(f"  H={r['heads']} {r['prefill_dtype']:>4} {path:>7}: request {r[path + '_request_s'] * 1e3:.3f}, "
                  f"span {r[path + '_span_s'] * 1e3:.3f}, stages {r[path + '_stages_s'] * 1e3:.3f}, "
                  f"host before the first stage {r[path + '_before_stages_s'] * 1e3:.3f}, "
                  f"host issue of the stages {r[path + '_issue_s'] * 1e3:.3f}, "
                  f"outside the stages {r[path + '_outside_s'] * 1e3:.3f}")
        for path, _, _ in PATHS:
            print(f"  {path} request's host steps (us, unheld): {r[path + '_host_steps_us']}")
        print(f"  per call: event record {r['event_record_us']:.1f}, elapsed_time {r['event_elapsed_us']:.1f}, "
              f"torch.empty {r['empty_us']:.1f}, attention launch {r['attention_call_us']:.1f} "
              f"(in Triton's JITFunction.run: {r['attention_triton_run_us'] or 0:.1f}), "
              f"request validation {r['validate_us']:.1f} (one call, by what the host did before it: "
              f"{r['validate_after_wait_us']}), 4 KB host-to-device copy from pageable memory "
              f"{r['h2d_pageable_4k_us']:.1f} / pinned, asynchronous {r['h2d_pinned_4k_us']:.1f}")
        for key in ("attention_call_profile", "fused_request_profile", "graph_request_profile"):
            print(f"  {key} (us per call, own time, cProfile-inflated):")
            for e in r[key][:15]:
                print(f"    {e['own_us']:8.2f} {e['cumulative_us']:9.2f}  x{e['calls_per_call']:<5g} {e['function']}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, nargs="+", default=[16])
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--prefill-dtype", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--workspace-tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the replay's two launch paths")
    p.add_argument("--no-gc", action="store_true",
                   help="collect, freeze and disable Python's garbage collector first: whether its "
                        "collections are part of a request's host time")
    p.add_argument("--cpu-latency-us", type=int, default=None,
                   help="hold /dev/cpu_dma_latency at this many microseconds while measuring (bench/pm_qos.py; "
                        "root only): whether idle CPUs' wake-ups are part of a request's host time")
    p.add_argument("--pin-cpu", type=int, default=None,
                   help="hold the measuring thread (the engine's caller) on this CPU: whether moving between "
                        "CPUs is part of a request's host time")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_host_issue: needs a CUDA device (it holds the device with a spin kernel)")
        return 2
    if a.no_gc:
        import gc

        gc.collect()
        gc.freeze()
        gc.disable()
    with pm_qos.cpu_latency(a.cpu_latency_us) as qos:
        rows = _measure(a)
    if a.out:
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "date": run_info.utc_now(),
                "commit": run_info.commit(), "no_gc": a.no_gc, "cpu_latency": qos, "pinned_cpu": a.pin_cpu,
                "graph_first_copy": "the copies queued (graph_launch's return)",
                "gemm_wait": GEMM_WAIT}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
