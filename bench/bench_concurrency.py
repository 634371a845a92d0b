"""Throughput under concurrency: requests/s and context tokens/s against the number of clients.

Starts a ``ctxprefill serve`` subprocess per (heads, cache dtype, prefill dtype) of the
shapes asked for (``python -m ctxprefill.cli serve``, ``server/`` and ``client/`` put on
PYTHONPATH; ``--device`` auto picks cuda when present) — or drives a running server
(``--target host:port``; its cache blocks are overwritten: not for a server in use).
Through the client library it writes one random context per shape into the cache
(WriteCache, shuffled blocks), checks one request, then for every client count of
``--clients`` runs that many clients (threads by default, each a synchronous
``PrefillContextClient`` on its own channel; ``--processes``: one process each, away
from this process's GIL) that issue the same PrefillContext back to back for
``--warmup-s`` + ``--seconds``. Requests completed inside the timed window count:
requests/s, context and query tokens/s, client latency p50/p90/p99, the server's time
per request (``Stats.total_nanos``: queue wait included) and its compute time (the sum
of ``Stats.stage_nanos``), and errors by gRPC status code. The clients do not retry
(``retries=0``): an error is counted, not hidden.

``--transport`` (one or more of ``inline``, ``system``, ``cuda``; default ``inline``)
says how q goes in and output/LSE come back (docs/TRANSPORT.md); with several, every
client count is measured for each transport in turn, and every row names its transport:

- ``inline``: q, output and LSE as protobuf bytes (the client decodes the output to
  float32, as ``prefill_context`` does by default);
- ``system``: each client creates its own POSIX shared-memory segment, registers it once
  under a unique name, writes q into it once, and every request passes q by reference
  and has the server write output and LSE into the segment (``float_output=False``: the
  results stay there as bf16 bits); unregistered at the end of the client count;
- ``cuda``: each client allocates q, output and LSE as torch CUDA tensors on the server's
  GPU, registers them once by CUDA IPC handle (``CudaSharedMemoryRegion``), writes q and
  synchronizes its stream once; every request then only names the regions. Needs torch
  with CUDA in this process and a server on the same GPU of this host; otherwise the
  transport is skipped (the reason recorded).

``--stream-depth N`` (N > 0): each client sends its requests on one PrefillContextStream
call with N of them in flight (the server reads, validates and queues the next while
one runs), instead of one PrefillContext call each; rows say ``stream_depth``.
``--ring-depth N``: each client attaches a request ring of N slots (in a system segment of
its own; started servers get ``--request-ring``) and keeps N requests in flight through
it — no gRPC call per request (docs/TRANSPORT.md); rows say ``ring_depth``.

Started servers get ``--shared-memory system|cuda|all`` as the transports need (none for
inline alone). Before the timed runs, one request per shared-memory transport is checked
bit for bit against the inline answer (``check_matches_inline`` in its rows).

    PYTHONPATH=server:client python3 bench/bench_concurrency.py --out bench/results/bench_concurrency.json
    # also H=128:  --shape 16:1024:65536 128:1024:65536
    # transports side by side on a GPU:  --transport inline system cuda

Only numpy and the client package are imported here (torch only for ``--transport
cuda``); GPU, torch version and device come from the server's GetServerInfo.
``--budget-s`` skips client counts that no longer fit (recorded as skipped); the JSON is
rewritten after every client count.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("client", "server", "bench"):
    if os.path.join(ROOT, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _sub))

import numpy as np  # noqa: E402

from ctxprefill_bench import run_info  # noqa: E402
from progress import T0, elapsed, log  # noqa: E402
from server_process import ServerProcess  # noqa: E402

# ----------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    heads: int
    new: int
    context: int
    cache_dtype: str = "auto"
    prefill_dtype: str = "bf16"

    @classmethod
    def parse(cls, text: str, cache_dtype: str, prefill_dtype: str) -> Shape:
        """``H:NEW:CTX`` or ``H:NEW:CTX:CACHE:PREFILL``."""
        p = text.split(":")
        if len(p) not in (3, 5):
            raise argparse.ArgumentTypeError(f"--shape {text!r}: expected H:NEW:CTX or H:NEW:CTX:CACHE:PREFILL")
        try:
            h, n, c = (int(x) for x in p[:3])
        except ValueError:
            raise argparse.ArgumentTypeError(f"--shape {text!r}: H, NEW and CTX must be integers") from None
        return cls(h, n, c, *(p[3:] if len(p) == 5 else (cache_dtype, prefill_dtype)))

    @property
    def server_key(self) -> tuple:
        return (self.heads, self.cache_dtype, self.prefill_dtype)

    @property
    def label(self) -> str:
        return f"H={self.heads} {self.new}/{self.context} {self.cache_dtype}/{self.prefill_dtype}"


# ----------------------------------------------------------------------------- workload


TRANSPORTS = ("inline", "system", "cuda")
_Q_CACHE: dict[tuple, np.ndarray] = {}
_Q_LOCK = threading.Lock()


def make_q_bits(tq: int, heads: int, head_dim: int, prefill_dtype: str, seed: int) -> np.ndarray:
    """q as the wire wants it: bf16 bits (uint16) or fp8 e4m3 bits (uint8). Made once per
    process and spec (every client of a shape sends the same q; the array is only read)."""
    from ctxprefill_client import float32_to_bf16_bits, float32_to_fp8_e4m3_bits

    key = (tq, heads, head_dim, prefill_dtype, seed)
    with _Q_LOCK:
        q = _Q_CACHE.get(key)
        if q is None:
            x = np.random.default_rng(seed).standard_normal((tq, heads, head_dim), dtype=np.float32)
            q = float32_to_fp8_e4m3_bits(x) if prefill_dtype == "fp8" else float32_to_bf16_bits(x)
            _Q_CACHE[key] = q
    return q


def _align(n: int, a: int = 4096) -> int:
    return -(-n // a) * a


def cuda_available() -> tuple[bool, str]:
    """Whether this process can make CUDA tensors (torch with CUDA); else why not."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means no cuda transport
        return False, f"torch is not importable in the client process ({type(e).__name__}: {e})"[:300]
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} in the client process has no CUDA device"
    return True, ""


def cuda_index(device: str) -> int | None:
    """'cuda:1 (NVIDIA H200)' -> 1, 'cuda (…)' -> 0; None for a non-CUDA device."""
    if not device.startswith("cuda"):
        return None
    head = device.split(" ", 1)[0]
    return int(head.split(":", 1)[1]) if ":" in head else 0


class TransportHandles:
    """One client's side of a transport, set up once (per client and client count):
    ``q`` is what every request passes as q, ``kwargs`` the rest (where output and LSE
    go); :meth:`close` unregisters the regions and frees the memory.

    ``opts``: ``v_head_dim`` (system, cuda), ``cuda_device`` (cuda: the server's GPU index
    as this process numbers it), ``name`` (region name prefix; default a fresh unique one).
    """

    def __init__(self, transport: str):
        self.transport = transport
        self.q = None
        self.kwargs: dict = {}
        self.names: list[str] = []
        self._shm = None
        self._tensors: tuple = ()
        self._cuda_regions: list = []  # closed after unregistering: torch may then reuse the memory

    @classmethod
    def open(cls, transport: str, client, q_spec: tuple, opts: dict) -> TransportHandles:
        s = cls(transport)
        try:
            if transport == "inline":
                s.q = make_q_bits(*q_spec)
            elif transport == "system":
                s._open_system(client, q_spec, opts)
            elif transport == "cuda":
                s._open_cuda(client, q_spec, opts)
            else:
                raise ValueError(f"unknown transport {transport!r}")
        except BaseException:
            try:
                s.close(client)
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise
        return s

    @staticmethod
    def _name(opts: dict) -> str:
        return opts.get("name") or f"bench-conc-{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def _open_system(self, client, q_spec: tuple, opts: dict) -> None:
        from ctxprefill_client import BF16, FP8_E4M3, SystemSharedMemoryRegion

        tq, heads, _, prefill_dtype, _ = q_spec
        q = make_q_bits(*q_spec)
        out_bytes, lse_bytes = tq * heads * int(opts["v_head_dim"]) * 2, heads * tq * 4
        o_at = _align(q.nbytes)
        l_at = o_at + _align(out_bytes)
        self._shm = SystemSharedMemoryRegion(self._name(opts), l_at + _align(lse_bytes))
        self.q = self._shm.write(q, 0, FP8_E4M3 if prefill_dtype == "fp8" else BF16)  # q into the segment, once
        client.register_system_shared_memory(self._shm)
        self.names.append(self._shm.name)
        self.kwargs = {"output_region": self._shm.ref(o_at, out_bytes), "lse_region": self._shm.ref(l_at, lse_bytes),
                       "float_output": False}

    def _open_cuda(self, client, q_spec: tuple, opts: dict) -> None:
        import torch

        from ctxprefill_client import CudaSharedMemoryRegion

        tq, heads, _, prefill_dtype, _ = q_spec
        dev = torch.device("cuda", int(opts.get("cuda_device") or 0))
        q = make_q_bits(*q_spec)
        q_host = (torch.from_numpy(q).view(torch.float8_e4m3fn) if prefill_dtype == "fp8"
                  else torch.from_numpy(q.view(np.int16)).view(torch.bfloat16))
        q_dev = q_host.to(dev, copy=True)
        out = torch.empty((tq, heads, int(opts["v_head_dim"])), dtype=torch.bfloat16, device=dev)
        lse = torch.empty((heads, tq), dtype=torch.float32, device=dev)
        self._tensors = (q_dev, out, lse)
        name = self._name(opts)
        regions = [CudaSharedMemoryRegion(f"{name}-{k}", t) for k, t in zip(("q", "out", "lse"), self._tensors)]
        self._cuda_regions = regions
        torch.cuda.current_stream(dev).synchronize()  # q is written before the server reads it (on its own stream)
        for r in regions:
            client.register_cuda_shared_memory(r)
            self.names.append(r.name)
        self.q = regions[0].input()
        self.kwargs = {"output_region": regions[1].ref(), "lse_region": regions[2].ref(), "float_output": False}

    def close(self, client) -> None:
        """Unregister (every region, even after an error), then unmap / free. Results that
        are views of the memory must be gone."""
        errors, failed = [], set()
        for n in self.names:
            try:
                client.unregister_shared_memory(n)
            except Exception as e:  # noqa: BLE001 - reported after the rest is freed
                errors.append(f"unregister {n}: {type(e).__name__}: {e}"[:300])
                failed.add(n)
        for r in self._cuda_regions:  # one the server may still hold keeps torch's hold on its memory
            if r.name not in failed:
                r.close()
        self.names, self.q, self.kwargs, self._cuda_regions = [], None, {}, []
        if self._shm is not None:
            shm, self._shm = self._shm, None
            try:
                shm.close()
            finally:
                shm.unlink()
        self._tensors = ()
        if errors:
            raise RuntimeError("; ".join(errors))


def write_context(client, num_tokens: int, blocks: list[int], block_size: int, seed: int,
                  piece: int = 16384) -> None:
    """Random latents of tokens 0..num_tokens-1 into the slots of ``blocks``, in pieces."""
    from ctxprefill_client import slot_mapping

    g = np.random.default_rng(seed)
    table = np.asarray(blocks, dtype=np.int64)
    for a in range(0, num_tokens, piece):
        slots = slot_mapping(table, a, min(num_tokens, a + piece), block_size)
        kv_c = g.standard_normal((len(slots), 512), dtype=np.float32)
        k_pe = g.standard_normal((len(slots), 64), dtype=np.float32)
        n = client.write_cache(slots, kv_c, k_pe)
        if n != len(slots):
            raise RuntimeError(f"WriteCache wrote {n} of {len(slots)} slots")


def _code_of(e: BaseException) -> str:
    code = getattr(e, "code", None)
    if code is not None and hasattr(code, "name"):
        return code.name
    return type(e).__name__


def _record(recs: list, first_errors: list, t: float, result) -> None:
    """One request's record: (t_send, t_done, code, server total ns, server compute ns,
    context tokens, query tokens); ``result`` is the PrefillResult or the exception."""
    if isinstance(result, BaseException):
        recs.append((t, time.time(), _code_of(result), 0, 0, 0, 0))
        if len(first_errors) < 3:
            first_errors.append(f"{type(result).__name__}: {result}"[:300])
        return
    st = result.stats
    recs.append((t, time.time(), "", int(st["total_nanos"]), int(sum(st["stage_nanos"].values())),
                 int(st["context_tokens"]), int(st["query_tokens"])))


def _drive_calls(client, handles, seqs: list, end_at: float, recs: list, first_errors: list) -> None:
    """A PrefillContext call per request, back to back, until ``end_at``."""
    while time.time() < end_at:
        t = time.time()
        try:
            r = client.prefill_context(handles.q, seqs, **handles.kwargs)
        except Exception as e:  # noqa: BLE001 - counted by code and reported
            _record(recs, first_errors, t, e)
            time.sleep(0.01)  # do not spin on a refusing server
            continue
        _record(recs, first_errors, t, r)
        del r  # results placed in shared memory are views of it: none may outlive the transport's regions


def _drive_pipelined(channel, handles, seqs: list, end_at: float, depth: int, recs: list, first_errors: list,
                     reopen=None) -> None:
    """Requests through ``channel`` (a PrefillContextStream or a request ring: submit /
    result / is_open), ``depth`` in flight, until ``end_at``. A request that fails in-band
    is recorded and the channel goes on; a channel that closed is reopened by ``reopen()``
    (answers still owed on it are lost) or, without one, ends this client."""
    sent: collections.deque = collections.deque()
    while True:
        while len(sent) < depth and time.time() < end_at:
            sent.append(time.time())
            channel.submit(handles.q, seqs, **handles.kwargs)
        if not sent:
            return
        t = sent.popleft()
        try:
            r = channel.result()
        except Exception as e:  # noqa: BLE001 - counted by code and reported
            _record(recs, first_errors, t, e)
            if not channel.is_open:
                if reopen is None:
                    return
                channel.close()
                sent.clear()
                time.sleep(0.01)
                channel = reopen()
            continue
        _record(recs, first_errors, t, r)
        del r


def _drive_stream(client, handles, seqs: list, end_at: float, depth: int, recs: list, first_errors: list) -> None:
    """Requests on one PrefillContextStream (reopened if it breaks), ``depth`` in flight."""
    streams = [client.prefill_stream()]

    def reopen():
        streams.append(client.prefill_stream())
        return streams[-1]

    try:
        _drive_pipelined(streams[0], handles, seqs, end_at, depth, recs, first_errors, reopen)
    finally:
        streams[-1].close()


def _ring_slot_bytes(q_spec: tuple, transport: str) -> int:
    """A slot holds the request and its answer: q and the results too when they travel inline."""
    tq, heads, head_dim = q_spec[:3]
    inline = tq * heads * (head_dim + 128) * 2 + heads * tq * 4 if transport == "inline" else 0
    return -(-(inline + (1 << 16)) // 64) * 64


def drive(target: str, q_spec: tuple, seqs: list, start_at: float, end_at: float, timeout: float,
          client_kwargs: dict, transport: str = "inline", transport_opts: dict | None = None,
          stream_depth: int = 0, ring_depth: int = 0) -> dict:
    """One client: PrefillContext back to back from ``start_at`` until ``end_at`` (time.time()),
    through ``transport`` (its regions registered once, before ``start_at``, and unregistered
    at the end); with ``stream_depth`` > 0 on one PrefillContextStream with that many
    requests in flight instead of a call each, with ``ring_depth`` > 0 through a request
    ring of that many slots. Returns per request (t_send, t_done, code,
    server total ns, server compute ns, context tokens, query tokens); code "" on success;
    and the set-up time."""
    from ctxprefill_client import PrefillContextClient

    recs: list[tuple] = []
    first_errors: list[str] = []
    setup_s = ready_at = setup_error = None
    handles = ring = ring_region = None
    client = PrefillContextClient(target, timeout=timeout, retries=0, **client_kwargs)
    try:
        client.server_info()  # connect (and remember the instance) before the clock starts
        t = time.time()
        try:
            handles = TransportHandles.open(transport, client, q_spec, transport_opts or {})
            if ring_depth:
                from ctxprefill_client import SystemSharedMemoryRegion

                slot = _ring_slot_bytes(q_spec, transport)
                ring_region = SystemSharedMemoryRegion(f"bench-ring-{uuid.uuid4().hex[:12]}", ring_depth * slot)
                client.register_system_shared_memory(ring_region)
                ring = client.attach_request_ring(ring_region, num_slots=ring_depth, slot_bytes=slot)
        except Exception as e:  # noqa: BLE001 - recorded: this client sends nothing
            setup_error = f"{transport} set-up: {type(e).__name__}: {e}"[:500]
            first_errors.append(setup_error[:300])
        ready_at = time.time()
        setup_s = ready_at - t
        delay = start_at - time.time()
        if handles is not None and delay > 0:
            time.sleep(delay)
        if ring is not None:
            _drive_pipelined(ring, handles, seqs, end_at, ring_depth, recs, first_errors)
        elif handles is not None and ring_depth:
            pass  # the ring did not attach: recorded above
        elif handles is not None and stream_depth:
            _drive_stream(client, handles, seqs, end_at, stream_depth, recs, first_errors)
        elif handles is not None:
            _drive_calls(client, handles, seqs, end_at, recs, first_errors)
    finally:
        try:
            if ring_region is not None:
                try:
                    if ring is not None:
                        ring.close()
                    client.unregister_shared_memory(ring_region.name)
                except Exception as e:  # noqa: BLE001 - reported with the row
                    first_errors.append(f"ring tear-down: {type(e).__name__}: {e}"[:300])
                finally:
                    ring_region.close()
                    ring_region.unlink()
            if handles is not None:
                try:
                    handles.close(client)
                except Exception as e:  # noqa: BLE001 - reported with the row
                    first_errors.append(f"{transport} tear-down: {type(e).__name__}: {e}"[:300])
        finally:
            client.close()
    return {"records": recs, "first_errors": first_errors, "setup_s": setup_s, "ready_at": ready_at,
            "setup_error": setup_error}


def percentiles(xs: list[float], ps=(50, 90, 99)) -> dict:
    """Nearest-rank percentiles (and mean, max) of ``xs``; None when empty."""
    xs = sorted(xs)
    n = len(xs)
    out = {f"p{p}": (xs[min(n - 1, max(0, math.ceil(p / 100 * n) - 1))] if n else None) for p in ps}
    out["mean"] = sum(xs) / n if n else None
    out["max"] = xs[-1] if n else None
    return out


def summarize(parts: list[dict], window_start: float, window_end: float) -> dict:
    """Throughput and latency of the requests completed inside [window_start, window_end]."""
    recs = [r for p in parts for r in p["records"]]
    inside = [r for r in recs if window_start <= r[1] <= window_end]
    ok = [r for r in inside if not r[2]]
    window = window_end - window_start
    errors: dict[str, int] = {}
    for r in recs:
        if r[2]:
            errors[r[2]] = errors.get(r[2], 0) + 1
    rps = len(ok) / window if window > 0 else 0.0
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    lat = percentiles([r[1] - r[0] for r in ok])
    srv = percentiles([r[3] / 1e9 for r in ok])
    cmp_ = percentiles([r[4] / 1e9 for r in ok])
    return {
        "requests": len(ok), "window_s": window, "requests_per_s": rps,
        "context_tokens_per_s": sum(r[5] for r in ok) / window if window > 0 else 0.0,
        "query_tokens_per_s": sum(r[6] for r in ok) / window if window > 0 else 0.0,
        "latency_ms": {k: ms(v) for k, v in lat.items()},
        "server_total_ms": {k: ms(v) for k, v in srv.items()},
        "server_compute_ms": {k: ms(v) for k, v in cmp_.items()},
        # the engine's busy fraction: compute time of the completed requests over the window
        "device_busy_fraction": (sum(r[4] for r in ok) / 1e9 / window) if window > 0 else None,
        "errors": errors, "errors_in_window": sum(1 for r in inside if r[2]),
        "requests_all": len(recs), "first_errors": [e for p in parts for e in p["first_errors"]][:5],
        # clients' transport set-up (regions registered, q written): the slowest, how many were
        # not ready when the timed window opened, how many failed (and so sent nothing)
        "client_setup_s_max": max((p["setup_s"] for p in parts if p.get("setup_s") is not None), default=None),
        "clients_late": sum(1 for p in parts if p.get("ready_at") is not None and p["ready_at"] > window_start),
        "setup_errors": sum(1 for p in parts if p.get("setup_error")),
    }


def lead_s(processes: bool, transport: str) -> float:
    """Seconds between launching the clients of a count and its start: client processes
    import numpy/grpc (and torch for cuda); every client registers its regions meanwhile."""
    if processes:
        return 12.0 if transport == "cuda" else 6.0
    return 0.5 if transport == "inline" else 1.0


def run_level(target: str, q_spec: tuple, seqs: list, clients: int, warmup_s: float, seconds: float,
              timeout: float, processes: bool, client_kwargs: dict, transport: str = "inline",
              transport_opts: dict | None = None, stream_depth: int = 0, ring_depth: int = 0) -> dict:
    start_at = time.time() + lead_s(processes, transport)
    end_at = start_at + warmup_s + seconds
    args = (target, q_spec, seqs, start_at, end_at, timeout, client_kwargs, transport, transport_opts,
            stream_depth, ring_depth)
    if processes:
        with concurrent.futures.ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("spawn")) as pool:
            futs = [pool.submit(drive, *args) for _ in range(clients)]
            parts = [f.result() for f in futs]
    else:
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            futs = [pool.submit(drive, *args) for _ in range(clients)]
            parts = [f.result() for f in futs]
    return summarize(parts, start_at + warmup_s, end_at)


def check_transport(client, transport: str, q_spec: tuple, seqs: list, opts: dict, ref_out: np.ndarray,
                    ref_lse: np.ndarray) -> tuple[bool, float]:
    """One request through ``transport`` (its own regions, unregistered after); whether its
    output bits and LSE equal the inline answer's, and its client time in s."""
    s = TransportHandles.open(transport, client, q_spec, {**opts, "name": f"bench-check-{uuid.uuid4().hex[:12]}"})
    try:
        t = time.monotonic()
        r = client.prefill_context(s.q, seqs, request_id=f"bench-check-{transport}", **s.kwargs)
        dt = time.monotonic() - t
        if r.output_tensor is not None:  # cuda: views of this process's tensors
            import torch

            out = r.output_tensor.view(torch.int16).cpu().numpy().view(np.uint16)
            lse = r.lse_tensor.cpu().numpy()
        else:
            out, lse = np.array(r.output_bits), np.array(r.lse)
        del r
    finally:
        s.close(client)
    same = (out.shape == ref_out.shape and lse.shape == ref_lse.shape and np.array_equal(out, ref_out)
            and np.array_equal(lse.view(np.uint32), np.ascontiguousarray(ref_lse, dtype=np.float32).view(np.uint32)))
    return bool(same), dt


# ----------------------------------------------------------------------------- facts


def gpu_name(device: str) -> str | None:
    """'cuda:0 (NVIDIA H200)' -> 'NVIDIA H200'; None for a CPU server."""
    if device.startswith("cuda") and "(" in device:
        return device[device.index("(") + 1 : device.rindex(")")]
    return None


def write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':36} {'transport':9} {'clients':>7} {'requests':>8} {'req/s':>8} {'ctx Mtok/s':>10} "
          f"{'q ktok/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'srv p50':>8} {'cmp p50':>8} {'busy':>5}  "
          "errors", flush=True)
    f = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    for r in rows:
        tr = r.get("transport", "inline") + (f"/s{r['stream_depth']}" if r.get("stream_depth") else "") + (
            f"/r{r['ring_depth']}" if r.get("ring_depth") else "")
        if "skipped" in r:
            print(f"{r['shape_label']:36} {tr:9} {r['clients']:7d} skipped ({r['skipped']})", flush=True)
            continue
        busy = r["device_busy_fraction"]
        print(f"{r['shape_label']:36} {tr:9} {r['clients']:7d} {r['requests']:8d} {r['requests_per_s']:8.2f} "
              f"{r['context_tokens_per_s'] / 1e6:10.2f} {r['query_tokens_per_s'] / 1e3:9.1f} "
              f"{f(r['latency_ms']['p50']):>8} {f(r['latency_ms']['p90']):>8} {f(r['latency_ms']['p99']):>8} "
              f"{f(r['server_total_ms']['p50']):>8} {f(r['server_compute_ms']['p50']):>8} "
              f"{'n/a' if busy is None else f'{busy:.2f}':>5}  "
              f"{', '.join(f'{k}={v}' for k, v in sorted(r['errors'].items())) or '-'}"
              + (f" (set-up failed in {r['setup_errors']} clients)" if r.get("setup_errors") else ""), flush=True)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="host:port of a running server (else one is started per shape "
                                                   "group); its --heads must match the shapes'")
    ap.add_argument("--shape", nargs="+", default=["16:1024:65536"],
                    help="H:NEW:CTX[:CACHE:PREFILL] (default 16:1024:65536; add 128:1024:65536 for H=128)")
    ap.add_argument("--cache-dtype", default="auto", help="cache dtype of shapes that do not name one")
    ap.add_argument("--prefill-dtype", default="bf16", help="prefill dtype of shapes that do not name one")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--seconds", type=float, default=8.0, help="timed seconds per client count")
    ap.add_argument("--warmup-s", type=float, default=1.0, help="untimed seconds before each timed window")
    ap.add_argument("--processes", action="store_true", help="one client process each (default: threads)")
    ap.add_argument("--transport", nargs="+", choices=TRANSPORTS, default=["inline"],
                    help="how q, output and LSE travel (docs/TRANSPORT.md): inline protobuf bytes, system (POSIX "
                         "shared memory) and/or cuda (CUDA IPC; torch with CUDA here, server on this host's GPU); "
                         "several: each measured at every client count (default: inline)")
    ap.add_argument("--stream-depth", type=int, default=0,
                    help="each client sends on one PrefillContextStream with this many requests in flight "
                         "(0: a PrefillContext call per request)")
    ap.add_argument("--ring-depth", type=int, default=0,
                    help="each client sends through a request ring with this many slots, all in flight (started "
                         "servers get --request-ring; 0: not)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="deadline of each PrefillContext, s")
    ap.add_argument("--device", default="auto", help="started servers: auto, cpu, cuda, cuda:N")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--workspace-tokens", type=int, default=16384)
    ap.add_argument("--kv-b-proj-dtype", default="bf16")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--queue-size", type=int, default=None,
                    help="started servers' --queue-size (running + waiting); default max(64, 2 x most clients), "
                         "so that a closed loop of clients is never refused")
    ap.add_argument("--server-flag", action="append", default=[], metavar="FLAG=VALUE",
                    help="extra flag of the started servers, e.g. --server-flag grace-seconds=5, or a bare switch "
                         "such as --server-flag no-request-ring-overlap (repeatable)")
    ap.add_argument("--start-timeout", type=float, default=180.0, help="seconds for a started server to be ready")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget: a client count that no longer fits is skipped (recorded)")
    ap.add_argument("--out", default=None, help="JSON results path (rewritten after every client count)")
    ns = ap.parse_args(argv)

    from ctxprefill_client import PrefillContextClient

    shapes = [Shape.parse(s, ns.cache_dtype, ns.prefill_dtype) for s in ns.shape]
    clients = sorted(set(ns.clients))
    if not clients or clients[0] < 1:
        ap.error("--clients must be >= 1")
    if ns.ring_depth and ns.stream_depth:
        ap.error("--ring-depth and --stream-depth: one or the other")
    queue_size = ns.queue_size or max(64, 2 * clients[-1])
    deadline = T0 + ns.budget_s if ns.budget_s is not None else None
    groups: dict[tuple, list[Shape]] = {}
    for s in shapes:
        groups.setdefault(s.server_key if ns.target is None else ("target",), []).append(s)
    transports = list(dict.fromkeys(ns.transport))
    transport_skipped: dict[str, str] = {}  # transports this run cannot measure at all, and why
    if "cuda" in transports:
        if ns.target is None and ns.device == "cpu":
            transport_skipped["cuda"] = "started servers run on --device cpu"
        else:
            have, why = cuda_available()
            if not have:
                transport_skipped["cuda"] = why
        if "cuda" in transport_skipped:
            log(f"transport cuda: skipped ({transport_skipped['cuda']})")
    shm_kinds = tuple(t for t in ("system", "cuda") if t in transports and t not in transport_skipped)
    if ns.ring_depth:  # a ring lives in a system region
        shm_kinds = tuple(dict.fromkeys(("system", *shm_kinds)))
    shm_mode = {(): None, ("system",): "system", ("cuda",): "cuda"}.get(shm_kinds, "all")
    level_s = {t: ns.warmup_s + ns.seconds + lead_s(ns.processes, t) + 2.0 for t in transports}  # with slack

    result: dict = {"meta": {
        "kind": "concurrency", "date": run_info.utc_now(),
        "commit": run_info.commit(), "gpu": None, "torch": None, "device": None, "target": ns.target,
        "spawned_servers": ns.target is None, "client_mode": "processes" if ns.processes else "threads",
        "client_host_cpus": os.cpu_count(), "queue_size": queue_size if ns.target is None else None,
        "transports": transports, "transport_skipped": transport_skipped,
        "shared_memory": shm_mode if ns.target is None else None, "args": vars(ns), "servers": [],
    }, "rows": []}
    rows = result["rows"]
    ok = True
    logdir = tempfile.mkdtemp(prefix="bench_concurrency_")
    measurable = [t for t in transports if t not in transport_skipped]
    for key, group in groups.items():
        server = None
        left = deadline - time.monotonic() if deadline is not None else math.inf
        need_s = min((level_s[t] for t in measurable), default=math.inf)
        if not measurable or need_s > left:  # nothing to measure, or not even one client count fits: no server
            why = f"budget: {left:.1f} s left, {need_s:.1f} s needed per client count"
            for s in group:
                rows += [{"shape_label": s.label, "heads": s.heads, "new": s.new, "context": s.context,
                          "cache_dtype": s.cache_dtype, "prefill_dtype": s.prefill_dtype, "transport": t,
                          "clients": n, "skipped": transport_skipped.get(t, why)} for n in clients for t in transports]
            log(f"{[s.label for s in group]}: skipped ({why if measurable else 'no transport can be measured'})")
            continue
        try:
            if ns.target is None:
                H, cd, pd = key
                need = max(math.ceil(s.context / ns.block_size) for s in group)
                flags = {"device": ns.device, "heads": H, "cache_dtype": cd, "prefill_dtype": pd,
                         "block_size": ns.block_size, "num_blocks": need + 1,
                         "workspace_tokens": ns.workspace_tokens, "kv_b_proj_dtype": ns.kv_b_proj_dtype,
                         "backend": ns.backend, "queue_size": queue_size, "seed": ns.seed, "grace_seconds": 5}
                if shm_mode:  # 1 (system) or 3 (cuda) regions per client (+1 ring), unregistered after each count
                    flags["shared_memory"] = shm_mode
                    flags["shared_memory_max_regions"] = max(64, 5 * clients[-1] + 16)
                if ns.ring_depth:
                    flags["request_ring"] = True
                    flags["request_ring_max"] = max(16, clients[-1] + 4)
                for kv in ns.server_flag:  # FLAG=VALUE, or a bare FLAG (a switch: no-request-ring-overlap)
                    k, eq, v = kv.partition("=")
                    flags[k.lstrip("-").replace("-", "_")] = v if eq else True
                server = ServerProcess(f"H{H}_{cd}_{pd}", flags, logdir)
                log(f"start server: {server.cmd}")
                t_ready = server.wait_ready(ns.start_timeout)
                log(f"server ready in {t_ready:.1f} s (log {server.log_path})")
                target = server.target
            else:
                flags, target, t_ready = None, ns.target, None
            with PrefillContextClient(target, timeout=max(120.0, ns.request_timeout), retries=2) as c:
                info = c.server_info()
                meta = result["meta"]
                meta["gpu"] = meta["gpu"] or gpu_name(info.device)
                meta["torch"] = meta["torch"] or info.versions.get("torch")
                meta["device"] = meta["device"] or info.device
                meta["servers"].append({
                    "flags": flags, "target": target, "ready_s": t_ready, "device": info.device,
                    "versions": info.versions, "heads": info.num_heads, "cache_dtype": info.cache_dtype,
                    "prefill_dtype": info.prefill_dtype, "kv_b_proj_dtype": info.kv_b_proj_dtype,
                    "attention_backend": info.attention_backend, "fused_kernels_active": info.fused_kernels_active,
                    "workspace_tokens": info.workspace_tokens, "num_blocks": info.num_blocks,
                    "block_size": info.block_size, "shared_memory_kinds": list(info.shared_memory_kinds)})
                group_skipped = dict(transport_skipped)  # + what this server cannot take
                cuda_dev = cuda_index(info.device)
                for t in ("system", "cuda"):
                    if t not in transports or t in group_skipped:
                        continue
                    if t == "cuda" and cuda_dev is None:
                        group_skipped[t] = f"the server's device is {info.device}, not a CUDA device"
                    elif t not in info.shared_memory_kinds:
                        group_skipped[t] = (f"the server does not offer {t} shared memory (GetServerInfo."
                                            f"shared_memory_kinds: {', '.join(info.shared_memory_kinds) or 'none'})")
                    if t in group_skipped:
                        log(f"transport {t}: skipped on this server ({group_skipped[t]})")
                transport_opts = {"v_head_dim": info.v_head_dim, "cuda_device": cuda_dev}
                log(f"{info.device}: backend {info.attention_backend}, fused kernels {info.fused_kernels_active}, "
                    f"H={info.num_heads} cache={info.cache_dtype} prefill={info.prefill_dtype} "
                    f"blocks={info.num_blocks}x{info.block_size} workspace={info.workspace_tokens}")
                for s in group:
                    if ns.target is not None and (s.heads, s.cache_dtype, s.prefill_dtype) != (
                            info.num_heads, info.cache_dtype, info.prefill_dtype):
                        log(f"note: shape {s.label} measured as the target's H={info.num_heads} "
                            f"{info.cache_dtype}/{info.prefill_dtype}")
                shapes_here = [dataclasses.replace(s, heads=info.num_heads, cache_dtype=info.cache_dtype,
                                                   prefill_dtype=info.prefill_dtype) for s in group]
                bs = info.block_size
                for si, s in enumerate(shapes_here):
                    nb = math.ceil(s.context / bs)
                    if nb > info.num_blocks:
                        raise RuntimeError(f"{s.label}: needs {nb} blocks, the server has {info.num_blocks}")
                    blocks = np.random.default_rng(ns.seed + si).permutation(info.num_blocks)[:nb].tolist()
                    t = time.monotonic()
                    write_context(c, s.context, blocks, bs, ns.seed + 100 + si)
                    log(f"{s.label}: wrote {s.context} context tokens in {time.monotonic() - t:.1f} s")
                    seqs = [(s.new, s.context, blocks)]
                    q_spec = (s.new, info.num_heads, info.qk_head_dim, s.prefill_dtype, ns.seed + 200 + si)
                    q = make_q_bits(*q_spec)
                    for k in range(2):  # first request of a shape may compile; check the answer
                        t = time.monotonic()
                        r = c.prefill_context(q, seqs, request_id=f"bench-check-{k}")
                        log(f"{s.label}: check request {k}: {(time.monotonic() - t) * 1e3:.1f} ms "
                            f"(server {r.stats['total_nanos'] / 1e6:.1f} ms, {r.stats['num_chunks']} chunks, "
                            f"path {r.stats['path']})")
                    if r.output.shape != (s.new, info.num_heads, info.v_head_dim) or not np.isfinite(r.lse).all():
                        raise RuntimeError(f"{s.label}: unexpected answer: output {r.output.shape}, "
                                           f"LSE finite {bool(np.isfinite(r.lse).all())}")
                    base = {"shape_label": s.label, "heads": s.heads, "new": s.new, "context": s.context,
                            "cache_dtype": s.cache_dtype, "prefill_dtype": s.prefill_dtype,
                            "chunks": r.stats["num_chunks"], "path": r.stats["path"]}
                    ref_out, ref_lse = np.array(r.output_bits), np.array(r.lse)
                    del r
                    shape_skipped = dict(group_skipped)
                    bases = {}
                    for tr in transports:
                        bases[tr] = {**base, "transport": tr, "float_output": tr == "inline",
                                     "stream_depth": ns.stream_depth, "ring_depth": ns.ring_depth}
                        if tr == "inline" or tr in shape_skipped:
                            continue
                        try:  # one request through the transport, against the inline answer
                            same, dt = check_transport(c, tr, q_spec, seqs, transport_opts, ref_out, ref_lse)
                        except Exception as e:  # noqa: BLE001 - this transport is not measured; the rest go on
                            ok = False
                            shape_skipped[tr] = f"check request failed: {type(e).__name__}: {e}"[:500]
                            log(f"{s.label}: {tr}: {shape_skipped[tr]}")
                            continue
                        bases[tr]["check_matches_inline"] = same
                        ok = ok and same
                        log(f"{s.label}: {tr} check request: {dt * 1e3:.1f} ms, output and LSE "
                            + ("bit-identical to inline" if same else "DIFFERENT from inline"))
                    for n in clients:
                        for tr in transports:
                            if tr in shape_skipped:
                                rows.append({**bases[tr], "clients": n, "skipped": shape_skipped[tr]})
                                continue
                            left = deadline - time.monotonic() if deadline is not None else math.inf
                            if level_s[tr] > left:
                                why = f"budget: {left:.1f} s left, {level_s[tr]:.1f} s needed"
                                rows.append({**bases[tr], "clients": n, "skipped": why})
                                log(f"{s.label}: {tr}: {n} clients skipped ({why})")
                                continue
                            log(f"{s.label}: {tr}: {n} client{'s' if n > 1 else ''} for {ns.warmup_s:g} + "
                                f"{ns.seconds:g} s ...")
                            rec = run_level(target, q_spec, seqs, n, ns.warmup_s, ns.seconds, ns.request_timeout,
                                            ns.processes, {}, tr, transport_opts, ns.stream_depth, ns.ring_depth)
                            row = {**bases[tr], "clients": n, **rec}
                            rows.append(row)
                            ok = ok and not rec["errors"] and rec["requests"] > 0 and not rec["setup_errors"]
                            log(f"{s.label}: {tr}: {n} clients: {rec['requests']} requests, "
                                f"{rec['requests_per_s']:.2f} req/s, "
                                f"{rec['context_tokens_per_s'] / 1e6:.2f} M context tokens/s, p50 "
                                f"{rec['latency_ms']['p50'] or 0:.1f} ms, p99 {rec['latency_ms']['p99'] or 0:.1f} ms, "
                                f"server p50 {rec['server_total_ms']['p50'] or 0:.1f} ms (compute "
                                f"{rec['server_compute_ms']['p50'] or 0:.1f}), errors {rec['errors'] or 0}"
                                + (f", set-up {rec['client_setup_s_max']:.2f} s" if tr != "inline"
                                   and rec["client_setup_s_max"] is not None else "")
                                + (f", {rec['clients_late']} clients late" if rec["clients_late"] else "")
                                + (f" {rec['first_errors'][:1]}" if rec["first_errors"] else ""))
                            if ns.out:
                                write_json(ns.out, result)
        except Exception as e:  # noqa: BLE001 - recorded; the other groups go on
            ok = False
            log(f"FAILED {key}: {type(e).__name__}: {e}")
            if server is not None:
                log(f"--- server log tail\n{server.tail(15)}")
            result.setdefault("errors", []).append({"group": list(key), "error": f"{type(e).__name__}: {e}"[:2000]})
        finally:
            if server is not None:
                rc = server.stop()
                log(f"server stopped (exit code {rc})")
    if ok:  # the servers' logs are kept (and named in the log) only when something failed
        shutil.rmtree(logdir, ignore_errors=True)
    result["meta"]["wall_s"] = round(elapsed(), 1)
    print_table(rows)
    if ns.out:
        write_json(ns.out, result)
        log(f"wrote {ns.out}")
    return 0 if ok and rows else 1


if __name__ == "__main__":
    sys.exit(main())
