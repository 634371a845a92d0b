"""Benchmark: one worker of all the heads vs N head-sharded workers (docs/SHARDING.md).

Starts, as subprocesses (``python3 -m ctxprefill.cli serve``, environment inherited,
``server/`` and ``client/`` put on PYTHONPATH):
- one unsharded worker of ``--heads`` heads on cuda:0;
- ``--num-shards`` N workers ``--num-shards N --shard-index i``, worker i on cuda:i
  (``--shared-gpu``: all on cuda:0);
all with the same seed, weights dtype, cache dtype and workspace. Writes one
``--context``-token context into every worker's cache, checks that one request's
output and LSE from the sharded workers (through ``ShardedPrefillClient``) equal the
unsharded worker's **bit for bit**, then for ``--seconds`` each drives first the
unsharded worker, then the shards, with ``--concurrency`` C client processes sending
requests of ``--new-tokens`` query tokens over the whole context. Reports
requests/s, context tokens/s, latency percentiles and the server-side time per
request (Stats.total_nanos; for the shards the slowest shard's), and writes JSON.

  PYTHONPATH=server:client python3 bench/bench_sharded.py --num-shards 2 --out bench/results/bench_sharded.json

Only numpy and the client package are imported here (no torch, no CUDA context in this
process); the GPUs are described by nvidia-smi and the servers' GetServerInfo. Finishes
in well under 4 minutes with the defaults (``--budget-s`` shortens the timed phases if
start-up was slow).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("client", "server", "bench"):
    if os.path.join(ROOT, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _sub))

import numpy as np  # noqa: E402

from ctxprefill_bench import run_info  # noqa: E402
from progress import elapsed, log  # noqa: E402
from server_process import ServerProcess, wait_all_ready  # noqa: E402

# ----------------------------------------------------------------------------- workload


def make_q_bits(tq: int, heads: int, prefill_dtype: str, seed: int) -> np.ndarray:
    from ctxprefill_client import float32_to_bf16_bits, float32_to_fp8_e4m3_bits

    x = np.random.default_rng(seed).standard_normal((tq, heads, 192), dtype=np.float32)
    return float32_to_fp8_e4m3_bits(x) if prefill_dtype == "fp8" else float32_to_bf16_bits(x)


def drive(mode: str, targets: list[str], q_spec: tuple, seqs: list, start_at: float, end_at: float,
          timeout: float) -> dict:
    """One client process: requests back to back from start_at until end_at."""
    from ctxprefill_client import PrefillContextClient, ShardedPrefillClient

    q = make_q_bits(*q_spec)
    client = (ShardedPrefillClient(targets, timeout=timeout, retries=2) if mode == "sharded"
              else PrefillContextClient(targets[0], timeout=timeout, retries=2))
    lat, server_ns, errors = [], [], []
    finished_at = start_at
    try:
        client.server_info()
        delay = start_at - time.time()
        if delay > 0:
            time.sleep(delay)
        while time.time() < end_at:
            t = time.time()
            try:
                r = client.prefill_context(q, seqs)
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(e).__name__}: {e}"[:300])
                if len(errors) > 20:
                    break
                continue
            finished_at = time.time()
            lat.append(finished_at - t)
            server_ns.append(int(r.stats["total_nanos"]))
    finally:
        client.close()
    return dict(latencies_s=lat, server_ns=server_ns, errors=errors, finished_at=finished_at)


def run_phase(mode: str, targets: list[str], q_spec: tuple, seqs: list, concurrency: int, seconds: float,
              context_tokens: int, new_tokens: int, timeout: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 6.0  # the client processes import numpy/grpc and build q meanwhile
    end_at = start_at + seconds
    log(f"{mode}: {concurrency} client processes, {seconds:.0f} s from +6 s ...")
    with concurrent.futures.ProcessPoolExecutor(concurrency, mp_context=ctx) as pool:
        futs = [pool.submit(drive, mode, targets, q_spec, seqs, start_at, end_at, timeout) for _ in range(concurrency)]
        while not all(f.done() for f in futs):
            time.sleep(5)
            if not all(f.done() for f in futs):
                log(f"{mode}: running ({max(0.0, min(seconds, time.time() - start_at)):.0f}/{seconds:.0f} s)")
        parts = [f.result() for f in futs]
    lat = sorted(x for p in parts for x in p["latencies_s"])
    sns = [x for p in parts for x in p["server_ns"]]
    errors = [e for p in parts for e in p["errors"]]
    elapsed = max([p["finished_at"] for p in parts] + [start_at + 1e-9]) - start_at
    n = len(lat)
    rps = n / elapsed if elapsed > 0 else 0.0

    def pct(p):
        return lat[min(n - 1, int(math.ceil(p / 100 * n)) - 1)] if n else None

    rec = dict(mode=mode, targets=targets, concurrency=concurrency, seconds=seconds, requests=n, elapsed_s=elapsed,
               requests_per_s=rps, context_tokens_per_s=rps * context_tokens, query_tokens_per_s=rps * new_tokens,
               latency_s=dict(mean=(sum(lat) / n) if n else None, p50=pct(50), p90=pct(90), p99=pct(99),
                              max=lat[-1] if n else None),
               server_ms_mean=(sum(sns) / len(sns) / 1e6) if sns else None,
               errors=len(errors), first_errors=errors[:5])
    log(f"{mode}: {n} requests in {elapsed:.1f} s: {rps:.2f} req/s, {rps * context_tokens / 1e6:.1f} M context "
        f"tokens/s, p50 {fmt_s(rec['latency_s']['p50'])}, p99 {fmt_s(rec['latency_s']['p99'])}, server "
        f"{rec['server_ms_mean'] or 0:.1f} ms/request" + (f", {len(errors)} errors: {errors[:2]}" if errors else ""))
    return rec


def fmt_s(x):
    return "n/a" if x is None else f"{x * 1e3:.0f} ms"


def write_context(write, num_tokens: int, block_size: int, seed: int, piece: int = 16384) -> None:
    """Tokens 0..num_tokens-1 into slots 0..num_tokens-1 (blocks 0.. in order), in pieces."""
    g = np.random.default_rng(seed)
    for a in range(0, num_tokens, piece):
        b = min(num_tokens, a + piece)
        kv_c = g.standard_normal((b - a, 512), dtype=np.float32)
        k_pe = g.standard_normal((b - a, 64), dtype=np.float32)
        assert write(np.arange(a, b, dtype=np.int64), kv_c, k_pe) == b - a


# ----------------------------------------------------------------------------- facts


def gpus() -> list[dict]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = []
    for line in out.strip().splitlines():
        p = [x.strip() for x in line.split(",")]
        if len(p) == 4:
            rows.append(dict(index=int(p[0]), name=p[1], memory=p[2], driver=p[3]))
    return rows


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-shards", type=int, default=2, help="head shards N (one worker each)")
    ap.add_argument("--shared-gpu", action="store_true", help="all shards on cuda:0 (else shard i on cuda:i)")
    ap.add_argument("--heads", type=int, default=128, help="the model's heads")
    ap.add_argument("--context", type=int, default=65536, help="context tokens of every request")
    ap.add_argument("--new-tokens", type=int, default=1024, help="query tokens of every request")
    ap.add_argument("--concurrency", type=int, default=4, help="client processes per phase")
    ap.add_argument("--seconds", type=float, default=25.0, help="timed seconds per phase")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--workspace-tokens", type=int, default=65536)
    ap.add_argument("--cache-dtype", default="auto")
    ap.add_argument("--kv-b-proj-dtype", default="bf16")
    ap.add_argument("--prefill-dtype", default="bf16")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="every worker on the CPU (a smoke test of this script)")
    ap.add_argument("--start-timeout", type=float, default=150.0, help="seconds for the servers to become ready")
    ap.add_argument("--budget-s", type=float, default=225.0, help="the timed phases shrink to end by then")
    ap.add_argument("--out", default="bench/results/bench_sharded.json", help="JSON results path")
    args = ap.parse_args()
    N = args.num_shards
    if N < 1 or args.heads % N:
        sys.exit(f"--heads {args.heads} must be divisible by --num-shards {N}")
    gpu_list = gpus()
    if not args.cpu and not args.shared_gpu and N > max(1, len(gpu_list)):
        sys.exit(f"{N} shards need {N} GPUs, nvidia-smi lists {len(gpu_list)}: use --shared-gpu")

    from ctxprefill_client import PrefillContextClient, ShardedPrefillClient

    bs = args.block_size
    nblocks = math.ceil(args.context / bs)
    common = dict(heads=args.heads, block_size=bs, num_blocks=nblocks + 8, workspace_tokens=args.workspace_tokens,
                  cache_dtype=args.cache_dtype, kv_b_proj_dtype=args.kv_b_proj_dtype,
                  prefill_dtype=args.prefill_dtype, backend=args.backend, seed=args.seed)
    logdir = tempfile.mkdtemp(prefix="bench_sharded_")
    log(f"GPUs: {[g['name'] for g in gpu_list]}; {N} shards {'on cuda:0' if args.shared_gpu else 'one per GPU'}; "
        f"server logs in {logdir}")
    servers: list[ServerProcess] = []
    result: dict = {}
    try:
        dev = (lambda i: "cpu") if args.cpu else (lambda i: "cuda:0" if args.shared_gpu else f"cuda:{i}")
        whole = ServerProcess("whole", {"device": dev(0), "grace_seconds": 5, **common}, logdir)
        shards = [ServerProcess(f"shard{i}", {"device": dev(i), "grace_seconds": 5, **common, "num_shards": N,
                                              "shard_index": i}, logdir) for i in range(N)]
        servers = [whole, *shards]
        for s in servers:
            log(f"start {s.name}: {s.cmd}")
        wait_all_ready(servers, args.start_timeout)
        log("all servers ready")

        single = PrefillContextClient(whole.target, timeout=300.0, retries=2)
        sharded = ShardedPrefillClient([s.target for s in shards], timeout=300.0, retries=2)
        info = single.server_info()
        infos = sharded.server_info()
        log(f"whole: {info.device}, backend {info.attention_backend}, fused kernels {info.fused_kernels_active}; "
            f"shards: {[(i.device, i.head_start, i.head_end) for i in infos]}")

        t = time.time()
        write_context(single.write_cache, args.context, bs, args.seed + 1)
        write_context(sharded.write_cache, args.context, bs, args.seed + 1)
        log(f"wrote a {args.context}-token context to every worker in {time.time() - t:.1f} s")
        probe = np.arange(0, args.context, max(1, args.context // 257), dtype=np.int64)
        same_cache = bool(np.array_equal(sharded.read_cache(probe, verify=True), single.read_cache(probe)))

        seqs = [(args.new_tokens, args.context, list(range(nblocks)))]
        q_spec = (args.new_tokens, args.heads, args.prefill_dtype, args.seed + 2)
        q = make_q_bits(*q_spec)
        for k in range(2):  # warm-up (first big shapes may compile) and the equality check
            t = time.time()
            r1 = single.prefill_context(q, seqs, request_id=f"eq-whole-{k}")
            t1 = time.time() - t
            t = time.time()
            rN = sharded.prefill_context(q, seqs, request_id=f"eq-sharded-{k}")
            tN = time.time() - t
            log(f"request {k}: whole {t1 * 1e3:.0f} ms ({r1.stats['total_nanos'] / 1e6:.1f} ms on the server), "
                f"sharded {tN * 1e3:.0f} ms ({rN.stats['total_nanos'] / 1e6:.1f} ms on the slowest shard)")
        out_eq = bool(np.array_equal(rN.output_bits, r1.output_bits))
        lse_eq = bool(np.array_equal(rN.lse.view(np.uint32), r1.lse.view(np.uint32)))
        diff = np.abs(rN.output.astype(np.float64) - r1.output.astype(np.float64))
        fin = np.isfinite(r1.lse)
        equality = dict(
            output_bit_equal=out_eq, lse_bit_equal=lse_eq, cache_bytes_equal=same_cache,
            output_elements_differing=int(np.count_nonzero(rN.output_bits != r1.output_bits)),
            output_max_abs_diff=float(diff.max()) if diff.size else 0.0,
            lse_max_abs_diff=float(np.abs(rN.lse[fin].astype(np.float64) - r1.lse[fin]).max()) if fin.any() else 0.0,
            heads_differing=[int(h) for h in np.nonzero((rN.output_bits != r1.output_bits).any(axis=(0, 2)))[0]][:16],
            chunks=r1.stats["num_chunks"],
        )
        log(f"EQUALITY sharded vs whole: output bit-equal {out_eq}, LSE bit-equal {lse_eq}, cache equal "
            f"{same_cache} (max |d out| {equality['output_max_abs_diff']:.3g}, "
            f"max |d lse| {equality['lse_max_abs_diff']:.3g}, {equality['output_elements_differing']} elements differ)")
        single.close()
        sharded.close()

        left = args.budget_s - elapsed() - 2 * 12.0  # per phase: client start-up and the tail
        seconds = max(5.0, min(args.seconds, left / 2))
        if seconds < args.seconds:
            log(f"start-up took {elapsed():.0f} s: timed phases shortened to {seconds:.0f} s each")
        phases = [
            run_phase("whole", [whole.target], q_spec, seqs, args.concurrency, seconds, args.context,
                      args.new_tokens, 300.0),
            run_phase("sharded", [s.target for s in shards], q_spec, seqs, args.concurrency, seconds, args.context,
                      args.new_tokens, 300.0),
        ]
        speedup = (phases[1]["requests_per_s"] / phases[0]["requests_per_s"]) if phases[0]["requests_per_s"] else None
        log(f"RESULT 1 worker x {args.heads} heads: {phases[0]['requests_per_s']:.2f} req/s "
            f"({phases[0]['context_tokens_per_s'] / 1e6:.1f} M ctx tok/s); {N} workers x {args.heads // N} heads: "
            f"{phases[1]['requests_per_s']:.2f} req/s ({phases[1]['context_tokens_per_s'] / 1e6:.1f} M ctx tok/s); "
            f"speedup {speedup:.2f}x" if speedup else "RESULT: no completed requests in the unsharded phase")
        result = dict(
            meta=dict(date=run_info.utc_now(),
                      gpus=gpu_list, torch=info.versions.get("torch"), cuda=info.versions.get("cuda"),
                      server_version=info.versions.get("server"), python=info.versions.get("python"),
                      commit=run_info.commit(), device_whole=info.device, devices_shards=[i.device for i in infos],
                      attention_backend=info.attention_backend, fused_kernels_active=info.fused_kernels_active,
                      args=vars(args), wall_s=None),
            equality=equality, phases=phases, speedup_requests_per_s=speedup,
        )
        ok = out_eq and lse_eq and same_cache and all(p["errors"] == 0 for p in phases)
    except Exception as e:  # noqa: BLE001 - reported in the JSON too
        log(f"FAILED: {type(e).__name__}: {e}")
        for s in servers:
            log(f"--- log tail of {s.name}\n{s.tail(15)}")
        result = dict(meta=dict(date=run_info.utc_now(),
                                gpus=gpu_list, commit=run_info.commit(), args=vars(args)),
                      error=f"{type(e).__name__}: {e}"[:2000], **({} if not result else result))
        ok = False
    finally:
        for s in servers:
            s.stop(timeout=10)
    result.setdefault("meta", {})["wall_s"] = round(elapsed(), 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {args.out} ({'ok' if ok else 'NOT ok'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
