#!/usr/bin/env python3
"""Bounded load on loopback: does the server degrade the way it says it does?

Starts ``ctxprefill serve`` (CPU unless ``--device``) with a small ``--queue-size``, or
drives ``--target``, and runs closed-loop clients (each sends its next request when
the last one answered) in two phases:

- ``below``: as many clients as the queue admits (``--queue-size``): no request may fail;
- ``above``: ``--clients`` (default 64) clients, far more than the queue admits: the
  only failures allowed are RESOURCE_EXHAUSTED, and they must come back promptly
  (p99 < ``--max-reject-p99-ms``, default 50 ms). A refused client waits
  ``--reject-backoff-ms`` (uniform jitter) before it tries again, as a real one would.

It reports, per phase: requests by status code, throughput of answered requests,
p50/p99 latency of answered and of refused requests; and the server's resident
memory (VmRSS from /proc) after the warm-up and at the end — it must not grow by more
than ``--rss-slack-mib`` (or 5 %) over the run. Exit code 0 when every criterion holds.

    python scripts/loadtest.py                       # 64 clients, 60 s per phase (the issue's figure)
    python scripts/loadtest.py --duration 4 --json out.json   # the CI version
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("client", "server"):
    if os.path.join(ROOT, sub) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, sub))

import grpc  # noqa: E402
import grpc.aio  # noqa: E402
import numpy as np  # noqa: E402

from ctxprefill_api import pb  # noqa: E402
from ctxprefill_client import encode_tensor, float32_to_bf16_bits, float32_to_fp8_e4m3_bits  # noqa: E402

METHOD = "/ctxprefill.v1.PrefillContextService/PrefillContext"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    return float(np.percentile(np.asarray(xs), p))


class Server:
    def __init__(self, ns):
        self.port, self.metrics_port = _free_port(), _free_port()
        args = [sys.executable, "-m", "ctxprefill.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--device", ns.device, "--heads", str(ns.heads),
                "--block-size", "16", "--num-blocks", str(ns.num_blocks), "--workspace-tokens", str(ns.workspace),
                "--queue-size", str(ns.queue_size), "--grace-seconds", "30"]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "server"), os.path.join(ROOT, "client"),
                                             env.get("PYTHONPATH", "")])
        # the load generator runs on the same machine: leave it a core (torch's intra-op
        # threads would otherwise spin on every core the clients need)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.log = open(ns.server_log, "w") if ns.server_log else subprocess.DEVNULL
        self.proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        t_end = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > t_end:
                raise SystemExit("the server did not become ready")
            time.sleep(0.1)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int | None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


def make_request(info: pb.GetServerInfoResponse, rows: int, context: int) -> bytes:
    H, D, bs = info.num_heads, info.qk_nope_head_dim + info.qk_rope_head_dim, info.block_size
    x = np.random.default_rng(0).standard_normal((rows, H, D)).astype(np.float32)
    if info.prefill_dtype == "fp8":
        q = encode_tensor(float32_to_fp8_e4m3_bits(x), pb.DATA_TYPE_FP8_E4M3)
    else:
        q = encode_tensor(float32_to_bf16_bits(x), pb.DATA_TYPE_BF16)
    blocks = [b % info.num_blocks for b in range(-(-context // bs))]
    return pb.PrefillContextRequest(q=q, sequences=[pb.Sequence(query_len=rows, context_len=context,
                                                                block_table=blocks)]).SerializeToString()


async def run_phase(target: str, payload: bytes, clients: int, duration: float, backoff_ms: float,
                    backoff_cap_ms: float, timeout: float, metadata) -> dict:
    ok_lat: list[float] = []
    rej_lat: list[float] = []
    other_lat: list[float] = []
    codes: Counter = Counter()
    details: dict[str, str] = {}
    channels = [grpc.aio.insecure_channel(target) for _ in range(clients)]
    t_start = time.monotonic()
    t_stop = t_start + duration

    async def client(i: int) -> None:
        call = channels[i].unary_unary(METHOD)
        rng = random.Random(i)
        refused = 0  # refusals in a row
        while time.monotonic() < t_stop:
            t = time.monotonic()
            try:
                await call(payload, timeout=timeout, metadata=metadata)
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                code = e.code()
                details.setdefault(code.name, e.details() or "")
            dt = time.monotonic() - t
            codes[code.name] += 1
            if code == grpc.StatusCode.OK:
                ok_lat.append(dt)
                refused = 0
            elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                rej_lat.append(dt)
                # exponential backoff with full jitter (the client library's policy), reset by a success
                await asyncio.sleep(rng.uniform(0, min(backoff_cap_ms, backoff_ms * 2**refused)) / 1000)
                refused += 1
            else:
                other_lat.append(dt)
                await asyncio.sleep(0.01)

    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.monotonic() - t_start
    for ch in channels:
        await ch.close()
    ms = 1000.0
    return {
        "clients": clients,
        "seconds": round(wall, 2),
        "requests": sum(codes.values()),
        "codes": dict(codes),
        "other_details": {k: v for k, v in details.items() if k != "RESOURCE_EXHAUSTED"},
        "ok_per_s": round(len(ok_lat) / wall, 1),
        "ok_p50_ms": _r(pct(ok_lat, 50), ms),
        "ok_p99_ms": _r(pct(ok_lat, 99), ms),
        "rejected_per_s": round(len(rej_lat) / wall, 1),
        "rejected_p50_ms": _r(pct(rej_lat, 50), ms),
        "rejected_p99_ms": _r(pct(rej_lat, 99), ms),
        "rejected_max_ms": _r(max(rej_lat) if rej_lat else None, ms),
    }


def _r(x: float | None, scale: float) -> float | None:
    return None if x is None else round(x * scale, 2)


async def sample_rss(pid: int, out: list[tuple[float, int]], stop: asyncio.Event, t0: float) -> None:
    while not stop.is_set():
        out.append((time.monotonic() - t0, rss_bytes(pid)))
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass
    out.append((time.monotonic() - t0, rss_bytes(pid)))


async def main_async(ns, target: str, pid: int | None) -> dict:
    metadata = (("authorization", f"Bearer {ns.token}"),) if ns.token else ()
    async with grpc.aio.insecure_channel(target) as ch:
        info = pb.GetServerInfoResponse.FromString(
            await ch.unary_unary("/ctxprefill.v1.PrefillContextService/GetServerInfo")(b"", timeout=30,
                                                                                     metadata=metadata))
    payload = make_request(info, ns.rows, ns.context)
    report = {"config": {"target": target, "device": info.device, "heads": info.num_heads, "cpus": os.cpu_count(),
                         "queue_size": ns.queue_size, "rows": ns.rows, "context_tokens": ns.context,
                         "duration_s": ns.duration, "clients_above": ns.clients,
                         "reject_backoff_ms": ns.reject_backoff_ms,
                         "reject_backoff_cap_ms": ns.reject_backoff_cap_ms}, "phases": {}}
    rss: list[tuple[float, int]] = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    sampler = asyncio.create_task(sample_rss(pid, rss, stop, t0)) if pid else None
    phases = [p for p in ns.phases.split(",") if p]
    for name in phases:
        clients = ns.queue_size if name == "below" else ns.clients
        cpu0, me0 = (cpu_seconds(pid) if pid else 0.0), time.process_time()
        r = await run_phase(target, payload, clients, ns.duration, ns.reject_backoff_ms, ns.reject_backoff_cap_ms,
                            ns.timeout, metadata)
        if pid:
            r["server_cpu_cores"] = round((cpu_seconds(pid) - cpu0) / r["seconds"], 2)
        r["client_cpu_cores"] = round((time.process_time() - me0) / r["seconds"], 2)
        report["phases"][name] = r
        print(f"[loadtest] {name}: {json.dumps(report['phases'][name])}", file=sys.stderr)
    if sampler:
        stop.set()
        await sampler
        warm_t = min(ns.warmup, 0.25 * ns.duration * len(phases))
        warm = next((b for t, b in rss if t >= warm_t), rss[0][1])
        end = rss[-1][1]
        report["rss"] = {"after_warmup_mib": round(warm / 2**20, 1), "end_mib": round(end / 2**20, 1),
                         "max_mib": round(max(b for _, b in rss) / 2**20, 1),
                         "growth_mib": round((end - warm) / 2**20, 1), "warmup_s": round(warm_t, 1),
                         "samples": len(rss)}
    return report


def judge(report: dict, ns) -> list[str]:
    fails = []
    below = report["phases"].get("below")
    if below is not None:
        bad = {k: v for k, v in below["codes"].items() if k != "OK"}
        if bad:
            fails.append(f"below capacity, requests failed: {bad}")
        if not below["codes"].get("OK"):
            fails.append("below capacity, nothing answered")
    above = report["phases"].get("above")
    if above is not None:
        bad = {k: v for k, v in above["codes"].items() if k not in ("OK", "RESOURCE_EXHAUSTED")}
        if bad:
            fails.append(f"above capacity, codes other than OK/RESOURCE_EXHAUSTED: {bad} {above['other_details']}")
        if not above["codes"].get("RESOURCE_EXHAUSTED"):
            fails.append("above capacity, nothing was refused")
        if not above["codes"].get("OK"):
            fails.append("above capacity, nothing was answered")
        p99 = above["rejected_p99_ms"]
        if p99 is not None and p99 >= ns.max_reject_p99_ms:
            fails.append(f"refusals not prompt: p99 {p99} ms >= {ns.max_reject_p99_ms} ms")
    rss = report.get("rss")
    if rss is not None:
        slack = max(ns.rss_slack_mib, 0.05 * rss["after_warmup_mib"])
        if rss["growth_mib"] > slack:
            fails.append(f"resident memory grew {rss['growth_mib']} MiB after warm-up (slack {slack:.1f} MiB)")
    return fails


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="drive this server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --target: the server's pid, for its memory")
    p.add_argument("--token", default=os.environ.get("CTXPREFILL_AUTH_TOKEN"), help="bearer token, if needed")
    p.add_argument("--clients", type=int, default=64, help="clients in the above-capacity phase")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    p.add_argument("--phases", default="below,above", help="comma-separated: below, above")
    p.add_argument("--queue-size", type=int, default=8, help="the server's --queue-size (the below phase's clients)")
    p.add_argument("--rows", type=int, default=4, help="query rows per request")
    p.add_argument("--context", type=int, default=128, help="context tokens per request")
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--workspace", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of each request, seconds")
    p.add_argument("--reject-backoff-ms", type=float, default=10.0,
                   help="after its n-th refusal in a row a client waits uniform(0, min(cap, this * 2**n)) ms "
                        "before it tries again (0: a refusal flood, no backoff)")
    p.add_argument("--reject-backoff-cap-ms", type=float, default=1000.0)
    p.add_argument("--max-reject-p99-ms", type=float, default=50.0)
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before the first memory reading that counts")
    p.add_argument("--rss-slack-mib", type=float, default=16.0)
    p.add_argument("--server-log", default=None, help="write the started server's log here")
    p.add_argument("--json", default=None, help="write the report here")
    ns = p.parse_args(argv)

    server = None
    if ns.target:
        target, pid = ns.target, ns.pid
    else:
        server = Server(ns)
        target, pid = server.target, server.proc.pid
    try:
        report = asyncio.run(main_async(ns, target, pid))
    finally:
        rc = server.stop() if server else 0
    if server is not None:
        report["server_exit_code"] = rc
    fails = judge(report, ns)
    if server is not None and rc != 0:
        fails.append(f"the server exited with {rc}")
    report["failures"] = fails
    text = json.dumps(report, indent=2)
    print(text)
    if ns.json:
        with open(ns.json, "w") as f:
            f.write(text + "\n")
    for f in fails:
        print(f"[loadtest] FAIL: {f}", file=sys.stderr)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
