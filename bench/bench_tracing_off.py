"""What OpenTelemetry tracing costs a request while it is off (docs/DEPLOY.md "Tracing"),
side by side in one process on the CPU.

Off, the server has no tracing interceptor and never imports OpenTelemetry
(tests/test_tracing.py checks both). What stays on a PrefillContext request's path is
``tracing.current()`` in ``PrefillCall.open`` (one ContextVar lookup, None) and two
``is not None`` checks of its result. Two variants of one in-process server (built by
``app.build_server`` with tracing off, a real engine of one head on the CPU), called
from an asyncio client over loopback gRPC, one call at a time:

- ``off``: as shipped;
- ``removed``: ``PrefillCall.open`` recompiled from its source without its
  ``trace=tracing.current()`` argument (the tracing code taken off the path).

They alternate in blocks of calls (the first block of each is warm-up and dropped); the
result is each variant's median per call, their difference (and the median of adjacent
blocks' differences), and the spread of the block medians within each variant (the
noise), with the residual's own time measured by itself (``timeit`` of
``tracing.current()``).

    python bench/bench_tracing_off.py [--calls 4000] [--block 200] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import platform
import re
import statistics
import sys
import textwrap
import time
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "server"), os.path.join(ROOT, "client"), os.path.join(ROOT, "bench")]

import numpy as np  # noqa: E402

from ctxprefill import app  # noqa: E402
from ctxprefill.service import prefill, tracing  # noqa: E402
from ctxprefill.service.security import load_security  # noqa: E402
from ctxprefill.settings import ServeSettings  # noqa: E402
from ctxprefill_api import pb, pb_grpc  # noqa: E402
from ctxprefill_bench import run_info  # noqa: E402
from progress import log  # noqa: E402

SETTINGS = ServeSettings(device="cpu", heads=1, block_size=16, num_blocks=8, workspace_tokens=64)


def open_without_tracing():
    """``PrefillCall.open`` compiled from its source with ``trace=tracing.current()`` taken
    out (the dataclass's default, None, in its place)."""
    src = textwrap.dedent(inspect.getsource(prefill.PrefillCall.open.__func__))
    src, n = re.subn(r",\s*trace=tracing\.current\(\)", "", src)
    if n != 1:
        raise SystemExit("PrefillCall.open no longer passes trace=tracing.current(): update this benchmark")
    namespace = dict(vars(prefill))
    exec(compile(src, prefill.__file__, "exec"), namespace)  # the repository's own source, one argument out
    return namespace["open"]


def request() -> pb.PrefillContextRequest:
    """Two query rows of one head over 20 cached tokens (one chunk)."""
    q = np.full((2, 1, 192), 0x3F80, np.uint16)  # bf16 1.0
    return pb.PrefillContextRequest(
        q=pb.Tensor(dtype=pb.DATA_TYPE_BF16, shape=list(q.shape), data=q.tobytes()),
        sequences=[pb.Sequence(query_len=2, context_len=20, block_table=[3, 4])])


async def measure(calls: int, block: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, warm-up blocks dropped."""
    import grpc

    engine = app.build_engine(SETTINGS)
    parts = await app.build_server(SETTINGS, load_security(SETTINGS), tracing=None)
    parts.servicer.attach_engine(engine)
    parts.servicer.set_ready()
    port = parts.grpc_server.add_insecure_port("127.0.0.1:0")
    await parts.grpc_server.start()
    shipped, removed = vars(prefill.PrefillCall)["open"], open_without_tracing()
    variants = {"off": shipped, "removed": removed}
    times: dict[str, list[list[float]]] = {k: [] for k in variants}
    msg = request()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.PrefillContextServiceStub(ch)
            for b in range(calls // block + 1):
                for name, open_ in variants.items():
                    prefill.PrefillCall.open = open_
                    ts = []
                    for _ in range(block):
                        t = time.perf_counter()
                        await stub.PrefillContext(msg, timeout=30)
                        ts.append(time.perf_counter() - t)
                    times[name].append(ts)
                if b % 5 == 0:
                    log(f"block {b}: " + ", ".join(f"{k} {statistics.median(v[-1]) * 1e6:.0f} us"
                                                   for k, v in times.items()))
    finally:
        prefill.PrefillCall.open = shipped
        await parts.grpc_server.stop(0)
        parts.worker.stop(5)  # the engine thread ends before the process exits
    return {k: v[1:] for k, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=4000, help="calls per variant (warm-up block not counted)")
    p.add_argument("--block", type=int, default=200, help="calls of one variant before switching to the other")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    ns = p.parse_args(argv)
    for k in [k for k in os.environ if k.startswith("OTEL_")]:
        del os.environ[k]  # tracing off whatever the shell sets
    assert tracing.from_settings(SETTINGS.otlp_endpoint) is None
    blocks = asyncio.run(measure(ns.calls, ns.block))
    n = 200_000
    residual_ns = min(timeit.repeat(tracing.current, number=n, repeat=5)) / n * 1e9
    res: dict = {}
    for name, bl in blocks.items():
        flat = [t for b in bl for t in b]
        med = [statistics.median(b) * 1e6 for b in bl]
        res[name] = {"calls": len(flat), "median_us": statistics.median(flat) * 1e6,
                     "block_median_min_us": min(med), "block_median_max_us": max(med),
                     "block_median_stdev_us": statistics.stdev(med) if len(med) > 1 else 0.0}
    diff = res["off"]["median_us"] - res["removed"]["median_us"]
    noise = max(res[k]["block_median_stdev_us"] for k in res)
    # adjacent blocks share the machine's state: their differences drift less than the blocks do
    paired = statistics.median(statistics.median(a) - statistics.median(b)
                               for a, b in zip(blocks["off"], blocks["removed"])) * 1e6
    res.update(difference_us=diff, paired_block_difference_us=paired, noise_us=noise, within_noise=abs(diff) <= noise,
               residual_current_ns=residual_ns,
               meta={"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                     "python": platform.python_version(), "commit": run_info.commit(), "date": run_info.utc_now(),
                     "args": vars(ns)})
    for name in blocks:
        r = res[name]
        print(f"{name:>8}: median {r['median_us']:.1f} us per call over {r['calls']} calls "
              f"(block medians {r['block_median_min_us']:.1f}-{r['block_median_max_us']:.1f} us, "
              f"stdev {r['block_median_stdev_us']:.1f} us)")
    print(f"off - removed: {diff:+.1f} us per call (median of adjacent blocks' differences {paired:+.1f} us); "
          f"noise (stdev of block medians) {noise:.1f} us: {'within' if res['within_noise'] else 'outside'} noise")
    print(f"tracing.current() alone: {residual_ns:.0f} ns per call")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
