"""What a gRPC round trip costs on this host, without ctxprefill (docs/TRANSPORT.md).

The transport's fixed cost per request is mostly Python gRPC and waking threads; it
differs a lot between machines (the CPU machine: ~340 µs for a unary call; the H200
host: 0.75 ms for our cheapest RPC). This measures, in one run, against a bare
``grpc.aio`` echo server in a subprocess (2 kB messages, medians):

- unary calls: the sync client, the asyncio client;
- one bidirectional stream, a message and its echo at a time: the sync client (requests
  from a queue, as ``PrefillStream`` sends them) and the asyncio client;
- the same Python work (a fixed small workload) run back to back and after a 5 ms sleep
  each time: how much a thread that wakes from idle loses (CPU frequency, C-states).

  python3 bench/bench_rpc_floor.py [--out bench/results/bench_rpc_floor.json] [--cpu-latency-us 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pm_qos  # noqa: E402
from ctxprefill_bench import run_info  # noqa: E402


def _ident(b):
    return b


async def _serve(port: int) -> None:
    server = grpc.aio.server()

    async def echo(req, ctx):
        return req

    async def stream(it, ctx):
        async for m in it:
            yield m

    h = grpc.method_handlers_generic_handler("floor.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=_ident, response_serializer=_ident),
        "Stream": grpc.stream_stream_rpc_method_handler(stream, request_deserializer=_ident,
                                                        response_serializer=_ident)})
    server.add_generic_rpc_handlers((h,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _median_us(f, n: int, warmup: int = 200) -> float:
    for _ in range(warmup):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


async def _amedian_us(f, n: int, warmup: int = 200) -> float:
    """:func:`_median_us` of a coroutine function."""
    for _ in range(warmup):
        await f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        await f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


async def _aio(target: str, payload: bytes, n: int) -> dict:
    async with grpc.aio.insecure_channel(target) as ch:
        unary = ch.unary_unary("/floor.Echo/Echo", request_serializer=_ident, response_deserializer=_ident)
        call = ch.stream_stream("/floor.Echo/Stream", request_serializer=_ident, response_deserializer=_ident)()

        async def ping():
            await call.write(payload)
            return await call.read()

        out = {"aio_unary_us": await _amedian_us(lambda: unary(payload), n),
               "aio_stream_us": await _amedian_us(ping, n)}
        await call.done_writing()
    return out


def _work() -> None:
    import numpy as np

    np.asarray(list(range(1024)), dtype=np.int64).sum()
    d = {}
    for i in range(200):
        d[str(i)] = i


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000, help="round trips per measurement")
    p.add_argument("--cpu-latency-us", type=int, default=None,
                   help="hold /dev/cpu_dma_latency at this value while measuring (bench/pm_qos.py; root only)")
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    with pm_qos.cpu_latency(ns.cpu_latency_us) as qos:
        print(f"CPU wake-up latency: {qos}")
        res = _measure(ns)
    res["cpu_latency"] = qos
    res.update(date=run_info.utc_now(), commit=run_info.commit(), gpu=run_info.gpu_name())
    for k, v in res.items():
        print(f"{k:>30}: {v:.0f}" if isinstance(v, float) else f"{k:>30}: {v}")
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


def _measure(ns) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    server = subprocess.Popen([sys.executable, "-c", f"import asyncio, sys; sys.path.insert(0, {here!r}); "
                               f"import bench_rpc_floor as m; asyncio.run(m._serve({port}))"])
    try:
        target = f"127.0.0.1:{port}"
        ch = grpc.insecure_channel(target)
        grpc.channel_ready_future(ch).result(timeout=30)
        payload = b"x" * 2000
        res = {"cpus": os.cpu_count()}
        f = ch.unary_unary("/floor.Echo/Echo", request_serializer=_ident, response_deserializer=_ident)
        res["sync_unary_us"] = _median_us(lambda: f(payload), ns.n)
        q: queue.SimpleQueue = queue.SimpleQueue()
        end = object()
        responses = ch.stream_stream("/floor.Echo/Stream", request_serializer=_ident,
                                     response_deserializer=_ident)(iter(q.get, end))

        def ping():
            q.put(payload)
            next(responses)

        res["sync_stream_us"] = _median_us(ping, ns.n)
        q.put(end)
        res.update(asyncio.run(_aio(target, payload, ns.n)))
        res["python_work_hot_us"] = _median_us(_work, 500, 50)

        def cold():
            time.sleep(0.005)
            t = time.perf_counter()
            _work()
            return time.perf_counter() - t

        res["python_work_after_5ms_idle_us"] = statistics.median(cold() for _ in range(200)) * 1e6
        ch.close()
    finally:
        server.kill()
        server.wait(timeout=10)
    return res


if __name__ == "__main__":
    sys.exit(main())
