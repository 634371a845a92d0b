"""Where the host time of one request goes: the engine's Python, by function.

When a request's kernels are short (16 heads, 1,024 new tokens), the device can wait on
the host between them: ``ctxprefill bench`` shows it as request time above the sum of
the stages. This runs one request shape in-process (``ctxprefill bench``'s engine and
random context), reports wall time, the sum of the device stages, and their gap, then
profiles ``--iters`` requests with cProfile and prints the functions with the most own
time (``torch.cuda.synchronize`` there is the host waiting for the device: the rest is
host work that the device may wait on).

  PYTHONPATH=server:client python3 bench/profile_engine.py --heads 16 --new 1024 --context 65536
  PYTHONPATH=server:client python3 bench/profile_engine.py --device cpu --heads 2 --new 8 --context 512 \\
      --block-size 16 --workspace-tokens 128 --iters 5
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import os
import pstats
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("client", "server", "bench"):
    if os.path.join(ROOT, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _sub))

from ctxprefill.app import build_engine  # noqa: E402
from ctxprefill.settings import ServeSettings  # noqa: E402
from ctxprefill_bench.engine_bench import make_device_request, time_request  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--cache-dtype", default="auto")
    p.add_argument("--prefill-dtype", default="bf16")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--workspace-tokens", type=int, default=16384)
    p.add_argument("--generic", action="store_true", help="profile the generic path instead of the fused one")
    p.add_argument("--cuda-graphs", action="store_true", help="replay the fused chunk loop as a CUDA graph")
    p.add_argument("--gemm", default="cublas", help="serve --kv-b-proj-gemm (cublas, gluon, paged)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--timeline", action="store_true",
                   help="on CUDA, also split the gap with torch.profiler: host time before the first kernel, "
                        "idle time between kernels (and which launches follow the longest idles), after the last")
    a = p.parse_args(argv)

    blocks = math.ceil(a.context / a.block_size) + 8
    s = ServeSettings(device=a.device, heads=a.heads, cache_dtype=a.cache_dtype, prefill_dtype=a.prefill_dtype,
                      block_size=a.block_size, num_blocks=blocks, workspace_tokens=a.workspace_tokens,
                      cuda_graphs=a.cuda_graphs, kv_b_proj_gemm=a.gemm)
    engine = build_engine(s)
    dev = engine.device
    q, seqs = make_device_request(engine, [a.context], [a.new])
    fused = not a.generic

    # the same timing as ``ctxprefill bench`` (its gap column): median request, median stages
    t = time_request(engine, q, seqs, fused, dev, max_iters=a.iters, min_iters=a.iters, target_s=0.0)
    wall, stages, r = t["median_s"], sum(t["stage_s"].values()), t["result"]
    print(f"device {dev}; H={a.heads} new={a.new} context={a.context} cache={a.cache_dtype} "
          f"prefill={a.prefill_dtype} path={'fused' if fused else 'generic'}; {len(r.stats.chunks)} chunks")
    span = t["span_s"]
    print(f"request {wall * 1e3:.3f} ms (median of {t['iters']}); device stages {stages * 1e3:.3f} ms; "
          f"gap {(wall - stages) * 1e3:.3f} ms ({(wall - stages) / wall:.0%}): "
          f"{(span - stages) * 1e3:.3f} ms between the stages (first stage's start to last one's end "
          f"{span * 1e3:.3f} ms), {(wall - span) * 1e3:.3f} ms before and after them")

    if a.timeline and dev.type == "cuda":
        try:
            timeline(engine, q, seqs, fused, min(a.iters, 10))
        except Exception as e:  # noqa: BLE001 - the cProfile part below still runs
            print(f"timeline failed: {type(e).__name__}: {e}")

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.iters):
        engine.prefill_context(q, seqs, fused=fused)  # each call synchronizes once, at its end
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(a.top)
    print(f"cProfile over {a.iters} requests (per request: divide by {a.iters}), by own time:")
    lines = buf.getvalue().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip().startswith("ncalls")), 0)
    print("\n".join(lines[start : start + a.top + 1]))
    return 0


def device_gaps(requests: list[tuple[float, float]], kernels: list[tuple[float, float, str]]) -> dict:
    """Per request (host range ``(start, end)``), from the device work that starts in it
    (``(start, end, name)``): the host's time before its first kernel, the device's idle
    time between its kernels, the time after its last one, the kernels' busy time and
    count; the idles with the kernel that ended each, and the last request's kernels as
    ``(idle before, time, name)``."""
    out: dict = {"before": [], "between": [], "after": [], "busy": [], "kernels": [], "idles": [], "last": []}
    kernels = sorted(kernels)
    for t0, t1 in sorted(requests):
        ks = [k for k in kernels if t0 <= k[0] <= t1]
        if not ks:
            continue
        out["kernels"].append(len(ks))
        out["before"].append(ks[0][0] - t0)
        out["after"].append(t1 - max(k[1] for k in ks))
        end, gaps, listed = ks[0][0], 0.0, []
        for start, stop, name in ks:
            g = max(0.0, start - end)
            if g > 0:
                gaps += g
                out["idles"].append((g, name[:60]))
            listed.append((g, stop - start, name))
            end = max(end, stop)
        out["between"].append(gaps)
        out["busy"].append(sum(k[1] - k[0] for k in ks))
        out["last"] = listed
    return out


def timeline(engine, q, seqs, fused, iters):
    """Where the device waits within a request: torch.profiler's kernel intervals against the
    request's host interval (median over ``iters`` requests, one synchronized each)."""
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            torch.cuda.synchronize()
            with record_function(f"request{i}"):
                engine.prefill_context(q, seqs, fused=fused)
                torch.cuda.synchronize()
    ev = prof.events()
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    # each request's host range; its device work: kernels and copies (not the requests' own
    # ranges, which the profiler also shows on the device's timeline)
    reqs = [(e.time_range.start, e.time_range.end) for e in ev if e.device_type == cpu and e.name.startswith("request")]
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in ev
               if e.device_type == cuda and not e.name.startswith("request")]
    cpu_ops = [e for e in ev if e.device_type == cpu and not e.name.startswith("request")]
    gaps = device_gaps(reqs, kernels)
    before, between, after, busy, n_k, idles, last = (gaps[k] for k in ("before", "between", "after", "busy", "kernels",
                                                                      "idles", "last"))
    med = statistics.median
    print(f"timeline over {len(before)} profiled requests (us, median): host before the first kernel "
          f"{med(before):.0f}, device idle between kernels {med(between):.0f}, after the last kernel "
          f"{med(after):.0f}; kernels busy {med(busy):.0f} in {med(n_k):.0f} kernels")
    print("longest device idles, by the kernel that ended them (us total over the profiled requests):")
    by = {}
    for g, name in idles:
        by[name] = by.get(name, 0.0) + g
    for name, g in sorted(by.items(), key=lambda x: -x[1])[:8]:
        print(f"  {g:9.0f}  {name}")
    print("the last profiled request's kernels (us): idle before it, its time, its name")
    for idle, took, name in last:
        print(f"  {idle:7.1f} {took:8.1f}  {name[:70]}")
    top = {}
    for e in cpu_ops:
        top[e.name] = top.get(e.name, 0.0) + e.self_cpu_time_total
    print("host ops by own time (us per request):")
    for name, t in sorted(top.items(), key=lambda x: -x[1])[:12]:
        print(f"  {t / max(len(before), 1):9.1f}  {name[:70]}")


if __name__ == "__main__":
    sys.exit(main())
