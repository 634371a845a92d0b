"""Benchmark: what the transport costs on top of the engine (docs/TRANSPORT.md).

One request shape (default: one sequence of 4,096 new tokens over 65,536 cached tokens,
16 heads, ``auto`` (bf16) cache, bf16 prefill), measured in ONE run seven ways:

1. ``engine``: the in-process engine (``build_engine`` + ``prefill_context`` on a q
   already on the device, device synchronized), as ``ctxprefill bench`` times it;
2. ``inline``: end to end through gRPC with q, output and LSE inline as protobuf bytes;
3. ``system``: q, output and LSE in a POSIX shared-memory segment (``--shared-memory``);
4. ``cuda``: q, output and LSE as CUDA tensors of this process registered by their IPC
   handles (only when the device is CUDA): q used in place, results written into them;
5. ``cuda-stream``: the same, with every request on one open PrefillContextStream call;
6. ``system-ring``, ``cuda-ring``: 3. and 4. with the requests through a request ring
   (``serve --request-ring``): no gRPC call per request; "RPC" is then the ring's round trip.

For each gRPC mode: the median end-to-end time and its ratio to the engine's, split
into client encode (building the request: for inline the q bytes copy, for system the
write into the segment), the RPC (serialization, transport, the server's handling) and
client decode (turning the response into arrays: views, no float32 copy); the server's
own time (Stats.total_nanos); payload bytes through gRPC and their rate. Every mode's
output and LSE must equal the inline ones bit for bit (and inline the in-process
engine's); the exit code says so. Target: cuda ≤ 1.1× the engine.

The server is started here as a subprocess on the chosen device (``python -m
ctxprefill.cli serve``, same seed and settings as the in-process engine, ``--shared-memory
all``). On a CPU it runs with small shapes too (tests/test_bench_transport.py):

  PYTHONPATH=server:client python3 bench/bench_transport.py --out bench/results/bench_transport.json
  PYTHONPATH=server:client python3 bench/bench_transport.py --device cpu --heads 2 --new 8 --context 256 \\
      --block-size 16 --workspace-tokens 128 --iters 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("client", "server", "bench"):
    if os.path.join(ROOT, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _sub))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import pm_qos  # noqa: E402
from ctxprefill_bench import run_info  # noqa: E402
from progress import log  # noqa: E402
from server_process import ServerProcess  # noqa: E402

ALIGN = 4096


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ----------------------------------------------------------------------------- the workload


class Workload:
    """One sequence: ``new`` query rows over ``context`` cached tokens in shuffled blocks."""

    def __init__(self, ns: argparse.Namespace):
        from ctxprefill_client import float32_to_bf16_bits, float32_to_fp8_e4m3_bits, slot_mapping

        bs = ns.block_size
        self.num_blocks = -(-ns.context // bs) + 1
        rng = np.random.default_rng(ns.seed)
        self.table = rng.permutation(self.num_blocks)[: -(-ns.context // bs)].tolist()
        self.slots = slot_mapping(self.table, 0, ns.context, bs)
        self.kv_c = float32_to_bf16_bits(rng.standard_normal((ns.context, 512), dtype=np.float32))
        self.k_pe = float32_to_bf16_bits(rng.standard_normal((ns.context, 64), dtype=np.float32))
        q = rng.standard_normal((ns.new, ns.heads, 192), dtype=np.float32)
        self.fp8 = ns.prefill_dtype == "fp8"
        self.q_bits = float32_to_fp8_e4m3_bits(q) if self.fp8 else float32_to_bf16_bits(q)
        self.seqs = [(ns.new, ns.context, self.table)]
        self.q_bytes = self.q_bits.nbytes
        self.out_bytes = ns.new * ns.heads * 128 * 2
        self.lse_bytes = ns.heads * ns.new * 4

    @property
    def q_wire(self) -> int:
        from ctxprefill_client import BF16, FP8_E4M3

        return FP8_E4M3 if self.fp8 else BF16

    def q_torch(self) -> torch.Tensor:
        if self.fp8:
            return torch.from_numpy(self.q_bits.copy()).view(torch.float8_e4m3fn)
        return torch.from_numpy(self.q_bits.view(np.int16).copy()).view(torch.bfloat16)

    def chunks(self, n: int = 8192):
        for a in range(0, len(self.slots), n):
            yield self.slots[a : a + n], self.kv_c[a : a + n], self.k_pe[a : a + n]


def settings_kw(ns, w: Workload) -> dict:
    return dict(heads=ns.heads, block_size=ns.block_size, num_blocks=w.num_blocks, cache_dtype=ns.cache_dtype,
                prefill_dtype=ns.prefill_dtype, kv_b_proj_dtype=ns.kv_b_proj_dtype,
                workspace_tokens=ns.workspace_tokens, backend=ns.backend, seed=ns.seed)


def run_engine(ns, w: Workload, dev: torch.device) -> dict:
    from ctxprefill.app import build_engine
    from ctxprefill.engine.engine import SequenceSpec
    from ctxprefill.settings import ServeSettings

    log("in-process engine: building, writing the context")
    engine = build_engine(ServeSettings(device=str(dev), **settings_kw(ns, w)))
    for s, c, p in w.chunks():
        engine.write_cache(torch.from_numpy(s), torch.from_numpy(c.view(np.int16).copy()).view(torch.bfloat16),
                           torch.from_numpy(p.view(np.int16).copy()).view(torch.bfloat16))
    q = w.q_torch().to(dev)  # as the service hands it over: q already on the device
    # the block table as an int64 array, as the service's validation hands it over: from a
    # Python list the engine would convert it (30-43 us for 1,024 blocks on the CPU
    # machine), work the transports do not pay, which would flatter their ratio
    seqs = [SequenceSpec(n, c, np.asarray(t, dtype=np.int64)) for n, c, t in w.seqs]
    for _ in range(ns.warmup):
        engine.prefill_context(q, seqs)
    times = []
    for _ in range(ns.iters):
        _sync(dev)
        t = time.perf_counter()
        r = engine.prefill_context(q, seqs)
        _sync(dev)
        times.append(time.perf_counter() - t)
    out = r.out.view(torch.int16).cpu().numpy().view(np.uint16)
    lse = r.lse.cpu().numpy()
    res = {"median_s": statistics.median(times), "times_s": times, "chunks": len(r.stats.chunks),
           "backend": engine.backend.name, "fused_kernels_active": engine.fused_kernels_active}
    log(f"in-process engine: {res['median_s'] * 1e3:.3f} ms median of {ns.iters} ({res['chunks']} chunks, "
        f"backend {res['backend']})")
    del engine, q, r
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res, out, lse


# ----------------------------------------------------------------------------- the modes


PHASES = ("validate", "queue", "input", "compute", "output")


def rpc_floor(client, n: int = 300) -> float:
    """Median round trip of the cheapest RPC this server answers (GetServerInfo, a
    cached message): what gRPC, the interceptor and the two processes cost per call."""
    for _ in range(20):
        client.server_info()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        client.server_info()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def timed(ns, encode, rpc, decode) -> tuple[dict, object]:
    """Medians of encode / rpc / decode / total over ``ns.iters`` runs (after warm-up)."""
    for _ in range(ns.warmup):
        res = decode(rpc(encode()))
    rows = []
    for _ in range(ns.iters):
        t0 = time.perf_counter()
        req = encode()
        t1 = time.perf_counter()
        resp = rpc(req)
        t2 = time.perf_counter()
        res = decode(resp)
        t3 = time.perf_counter()
        st = resp.stats
        rows.append({"encode_s": t1 - t0, "rpc_s": t2 - t1, "decode_s": t3 - t2, "total_s": t3 - t0,
                     "server_s": st.total_nanos / 1e9, "request_bytes": req.ByteSize(),
                     "response_bytes": resp.ByteSize(),
                     # the server's parts (Stats), and the RPC's time outside the handler
                     **{f"server_{k}_s": getattr(st, f"{k}_nanos") / 1e9 for k in PHASES},
                     "outside_handler_s": (t2 - t1) - st.total_nanos / 1e9})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["payload_bytes"] = med["request_bytes"] + med["response_bytes"]
    med["payload_bytes_per_s"] = med["payload_bytes"] / med["rpc_s"] if med["rpc_s"] else float("nan")
    med["totals_s"] = [r["total_s"] for r in rows]
    return med, res


def run_inline(ns, client, w: Workload):
    from ctxprefill_client._common import build_prefill_request, parse_prefill_response

    def encode():
        return build_prefill_request(w.q_bits, w.seqs, request_id=None, workspace_tokens=None, plan=None,
                                     expected=None, q_dtype=w.q_wire, server_prefill_dtype=None)

    med, res = timed(ns, encode, lambda r: client._stub.PrefillContext(r, timeout=ns.timeout),
                     lambda resp: parse_prefill_response(resp, ns.new, float_output=False))
    return med, np.array(res.output_bits), np.array(res.lse)


def run_system(ns, client, w: Workload, over_ring: bool = False):
    from ctxprefill_client import SystemSharedMemoryRegion
    from ctxprefill_client._common import build_prefill_request, parse_prefill_response

    o_at = _align(w.q_bytes)
    l_at = o_at + _align(w.out_bytes)
    shm = SystemSharedMemoryRegion("bench-system", l_at + _align(w.lse_bytes))
    try:
        client.register_system_shared_memory(shm)
        out_ref, lse_ref = shm.ref(o_at, w.out_bytes), shm.ref(l_at, w.lse_bytes)

        def encode():
            q_in = shm.write(w.q_bits, 0, w.q_wire)  # the caller's copy of q into the segment
            return build_prefill_request(q_in, w.seqs, request_id=None, workspace_tokens=None, plan=None,
                                         expected=None, q_dtype=None, server_prefill_dtype=None,
                                         output_region=out_ref, lse_region=lse_ref)

        ring = RingRpc(client) if over_ring else None
        rpc = ring or (lambda r: client._stub.PrefillContext(r, timeout=ns.timeout))
        med, res = timed(ns, encode, rpc,
                         lambda resp: parse_prefill_response(resp, ns.new, out_ref, lse_ref, float_output=False))
        out, lse = np.array(res.output_bits), np.array(res.lse)
        del res
        if ring is not None:
            ring.close()
        client.unregister_shared_memory("bench-system")
    finally:
        shm.close()
        shm.unlink()
    return med, out, lse


def stream_rpc(client, timeout: float):
    """An rpc(request) -> response for :func:`timed` over one PrefillContextStream call
    (the same request message, wrapped; the split of encode / RPC / decode stays)."""
    from ctxprefill_api import pb
    from ctxprefill_api.wire import nest

    stream = client.prefill_stream(timeout=timeout)

    def rpc(req):
        stream._outbox.put(nest(pb.PrefillContextStreamRequest(), "request", req))
        msg = next(stream._call)
        if msg.HasField("error"):
            raise RuntimeError(f"stream request failed: {msg.error.code} {msg.error.message}")
        return msg.response

    return stream, rpc


class RingRpc:
    """An rpc(request) -> response for :func:`timed` through a request ring (in its own
    small system shared-memory region; the request message is the same one)."""

    def __init__(self, client):
        from ctxprefill_client import SystemSharedMemoryRegion

        self.client = client
        self.region = SystemSharedMemoryRegion("bench-ring", 2 * (1 << 16))
        client.register_system_shared_memory(self.region)
        self.ring = client.attach_request_ring(self.region, num_slots=2, slot_bytes=1 << 16)

    def __call__(self, req):
        self.ring.send(req)
        msg = self.ring.receive()
        if msg.HasField("error"):
            raise RuntimeError(f"ring request failed: {msg.error.code} {msg.error.message}")
        return msg.response

    def close(self):
        self.ring.close()
        self.client.unregister_shared_memory(self.region.name)
        self.region.close()
        self.region.unlink()


def run_cuda(ns, client, w: Workload, dev: torch.device, over_stream: bool = False, over_ring: bool = False):
    from ctxprefill_client import CudaSharedMemoryRegion
    from ctxprefill_client._common import build_prefill_request, parse_prefill_response

    q = w.q_torch().to(dev)
    out = torch.empty((ns.new, ns.heads, 128), dtype=torch.bfloat16, device=dev)
    lse = torch.empty((ns.heads, ns.new), dtype=torch.float32, device=dev)
    regions = [CudaSharedMemoryRegion(f"bench-cuda-{n}", t) for n, t in (("q", q), ("out", out), ("lse", lse))]
    for r in regions:
        client.register_cuda_shared_memory(r)
    torch.cuda.current_stream(dev).synchronize()  # q is written before the server reads it
    q_in, out_ref, lse_ref = regions[0].input(), regions[1].ref(), regions[2].ref()

    def encode():
        return build_prefill_request(q_in, w.seqs, request_id=None, workspace_tokens=None, plan=None, expected=None,
                                     q_dtype=None, server_prefill_dtype=None, output_region=out_ref,
                                     lse_region=lse_ref)

    if over_ring:
        stream = rpc = RingRpc(client)
    elif over_stream:
        stream, rpc = stream_rpc(client, ns.timeout)
    else:
        stream, rpc = None, lambda r: client._stub.PrefillContext(r, timeout=ns.timeout)
    med, _ = timed(ns, encode, rpc, lambda resp: parse_prefill_response(resp, ns.new, out_ref, lse_ref,
                                                                        float_output=False))
    if stream is not None:
        stream.close()
    out_bits = out.view(torch.int16).cpu().numpy().view(np.uint16)
    lse_np = lse.cpu().numpy()
    client.unregister_shared_memory("")
    for r in regions:
        r.close()
    return med, out_bits, lse_np


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:N")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--new", type=int, default=4096, help="new (query) tokens")
    p.add_argument("--context", type=int, default=65536, help="cached context tokens")
    p.add_argument("--cache-dtype", default="auto")
    p.add_argument("--prefill-dtype", default="bf16")
    p.add_argument("--kv-b-proj-dtype", default="bf16")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--workspace-tokens", type=int, default=16384)
    p.add_argument("--backend", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=40,
                   help="timed requests per mode (10 varied by ~1 ms on the H200 host)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["inline", "system", "system-ring", "cuda", "cuda-stream",
                                                    "cuda-ring"],
                   choices=["inline", "system", "system-ring", "cuda", "cuda-stream", "cuda-ring"],
                   help="cuda-stream: CUDA IPC with the requests on one PrefillContextStream call; *-ring: the "
                        "requests through a request ring (serve --request-ring)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="serve with --no-shared-memory-pin: system regions stay pageable (the A/B baseline)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of each RPC, seconds")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds the server may take to start")
    p.add_argument("--cpu-latency-us", type=int, default=None,
                   help="hold /dev/cpu_dma_latency at this many microseconds while measuring (bench/pm_qos.py; "
                        "root only): idle CPUs then wake fast")
    p.add_argument("--out", default=None, help="write JSON results here")
    ns = p.parse_args(argv)

    from ctxprefill.settings import resolve_device

    dev = resolve_device(ns.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    log(f"device {dev} ({gpu or 'cpu'}); torch {torch.__version__}; request: {ns.new} new tokens over {ns.context} "
        f"context, H={ns.heads}, cache {ns.cache_dtype}, prefill {ns.prefill_dtype}, W={ns.workspace_tokens}")
    w = Workload(ns)
    with pm_qos.cpu_latency(ns.cpu_latency_us) as qos:
        log(f"CPU wake-up latency: {qos}")
        return _measure(ns, w, dev, gpu, qos)


def _measure(ns, w: Workload, dev: torch.device, gpu: str | None, qos: str) -> int:
    from ctxprefill_client import PrefillContextClient

    engine, ref_out, ref_lse = run_engine(ns, w, dev)

    rows: dict[str, dict] = {}
    floor_s = float("nan")
    skipped: dict[str, str] = {}
    identical: dict[str, bool] = {}
    with tempfile.TemporaryDirectory() as logdir:
        server = ServerProcess("server", {"device": str(dev), "grace_seconds": 5, "shared_memory": "all",
                                          "shared_memory_pin": ns.pin, "request_ring": True, **settings_kw(ns, w)},
                               logdir)
        log("starting the server: " + server.cmd)
        try:
            server.wait_ready(ns.ready_timeout)
            with PrefillContextClient(server.target, timeout=ns.timeout, retries=0,
                                      max_message_bytes=1 << 30) as client:
                info = client.server_info()
                log(f"server ready: {info.device}, backend {info.attention_backend}, shared memory "
                    f"{', '.join(info.shared_memory_kinds) or 'off'}; writing the context")
                for s, c, q in w.chunks():
                    client.write_cache(s, c, q)
                floor_s = rpc_floor(client)
                log(f"GetServerInfo round trip (the RPC floor): {floor_s * 1e6:.0f} us")
                results = {}
                for mode in ns.modes:
                    if mode.startswith("cuda") and "cuda" not in info.shared_memory_kinds:
                        skipped[mode] = ("not a CUDA device" if dev.type != "cuda"
                                         else "the server does not offer CUDA shared memory")
                        log(f"{mode}: skipped ({skipped[mode]})")
                        continue
                    if mode.startswith("system") and "system" not in info.shared_memory_kinds:
                        skipped[mode] = "the server does not offer system shared memory"
                        continue
                    log(f"{mode}: {ns.warmup} warm-up + {ns.iters} timed requests")
                    if mode == "inline":
                        med, out, lse = run_inline(ns, client, w)
                    elif mode.startswith("system"):
                        med, out, lse = run_system(ns, client, w, over_ring=mode == "system-ring")
                    else:
                        med, out, lse = run_cuda(ns, client, w, dev, over_stream=mode == "cuda-stream",
                                                 over_ring=mode == "cuda-ring")
                    med["ratio_to_engine"] = med["total_s"] / engine["median_s"]
                    rows[mode] = med
                    results[mode] = (out, lse)
                    log(f"{mode}: {med['total_s'] * 1e3:.3f} ms end to end ({med['ratio_to_engine']:.2f}x engine)")
        finally:
            server.stop(timeout=15)
            server_log = server.tail(60)

    def same(a, b):
        return a[0].shape == b[0].shape and np.array_equal(a[0], b[0]) and np.array_equal(
            a[1].view(np.uint32), b[1].view(np.uint32))

    for mode, r in results.items():
        identical[mode] = same(r, results["inline"]) if "inline" in results else same(r, (ref_out, ref_lse))
    engine_vs_inline = same(results["inline"], (ref_out, ref_lse)) if "inline" in results else None

    print()
    print(f"{'mode':>11} {'total ms':>9} {'x engine':>8} {'encode ms':>9} {'rpc ms':>8} {'decode ms':>9} "
          f"{'server ms':>9} {'payload MB':>10} {'MB/s':>8} {'bit-identical':>13}")
    print(f"{'engine':>11} {engine['median_s'] * 1e3:9.3f} {1.0:8.2f}")
    for mode, m in rows.items():
        print(f"{mode:>11} {m['total_s'] * 1e3:9.3f} {m['ratio_to_engine']:8.2f} {m['encode_s'] * 1e3:9.3f} "
              f"{m['rpc_s'] * 1e3:8.3f} {m['decode_s'] * 1e3:9.3f} {m['server_s'] * 1e3:9.3f} "
              f"{m['payload_bytes'] / 1e6:10.3f} {m['payload_bytes_per_s'] / 1e6:8.0f} {str(identical[mode]):>13}")
    for mode, why in skipped.items():
        print(f"{mode:>11} skipped: {why}")
    print()
    print("where the time goes (ms, medians): client encode | outside the handler (gRPC both ways, the hand-back, "
          "Stats) | server: " + " / ".join(PHASES) + f" | client decode; GetServerInfo round trip {floor_s * 1e3:.3f}")
    for mode, m in rows.items():
        parts = " / ".join(f"{m[f'server_{k}_s'] * 1e3:.3f}" for k in PHASES)
        print(f"{mode:>11} {m['encode_s'] * 1e3:.3f} | {m['outside_handler_s'] * 1e3:.3f} | {parts} | "
              f"{m['decode_s'] * 1e3:.3f}   (non-engine: {(m['total_s'] - m['server_compute_s']) * 1e3:.3f} ms)")
    if engine_vs_inline is not None:
        print(f"inline vs in-process engine: {'bit-identical' if engine_vs_inline else 'DIFFERENT'}")
    for mode in ("cuda", "cuda-stream", "cuda-ring"):
        if mode in rows:
            r = rows[mode]["ratio_to_engine"]
            print(f"target {mode} <= 1.1x engine: {'met' if r <= 1.1 else 'NOT met'} ({r:.3f}x)")

    if ns.out:
        meta = {"date": run_info.utc_now(), "device": str(dev), "gpu": gpu,
                "cpu_latency": qos,
                "torch": torch.__version__, "commit": run_info.commit(), "args": vars(ns),
                "request": {"q_bytes": w.q_bytes, "output_bytes": w.out_bytes, "lse_bytes": w.lse_bytes}}
        with open(ns.out, "w") as f:
            json.dump({"meta": meta, "engine": engine, "rpc_floor_s": floor_s, "modes": rows, "skipped": skipped,
                       "bit_identical": identical,
                       "inline_vs_engine_bit_identical": engine_vs_inline, "server_log_tail": server_log}, f,
                      indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
        log(f"wrote {ns.out}")
    ok = all(identical.values()) and engine_vs_inline is not False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
