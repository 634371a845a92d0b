"""Benchmark: a whole DeepSeek-V3-shaped model's chunked prefill through the same-host request
ring, calls issued per layer as an engine issues them, against the sum of the calls' floors.

The workload: one sequence of ``--new`` new tokens (8,192) prefilled in ``--chunk``-token
chunks (1,024) on top of ``context_start = --max-context − --new`` cached tokens, so chunk
``j`` attends ``context_start + j·chunk`` tokens (122,880 … 130,048 at the defaults) and the
cache ends holding ``--max-context`` (128k). Per chunk, for each of ``--layers`` layers (61)
in order, one PrefillContext through a request ring (``serve --request-ring``) whose answer
is waited for before the next layer's call (an engine needs layer l's output before layer
l + 1), and whose ``cache_write`` puts the chunk's latents into that layer's cache after the
attention, as ``DeepseekV3ChunkedPrefill`` does (one call per layer and chunk; the ring
carries PrefillContext only). ``--cache-write separate`` writes them with a WriteCache call
after each layer's answer instead, timed apart.

Tensors: q ``[layers, chunk, H, 192]``, every chunk's latents ``kv_c [layers, new, 512]`` /
``k_pe [layers, new, 64]`` (bf16, random, made before the timing), output ``[layers, chunk,
H, 128]`` bf16 and LSE ``[layers, H, chunk]`` fp32 live in one registered region: a CUDA
tensor of this process (CUDA IPC) on a GPU, POSIX shared memory on a CPU; only references,
the block table and the slot mapping travel through the ring's slots. Every layer has its own
areas and every chunk its own latents, so nothing is rewritten while the server may still
read it (a cache_write reading CUDA memory may run after its answer) and nothing but the
calls runs inside the timing. Before the timing, each layer's cache is filled with
``context_start`` random latents by WriteCache through the same region (``fill`` in the JSON).

Floors: ``engine_bench.floor_seconds`` per call shape (kv_b_proj and attention FLOPs at the
bf16 GEMM rate, gather/pack bytes at the copy bandwidth, both measured here by
``engine_bench.measure_ceilings`` before any server starts; also at the GEMM rate held for
``--sustained-gemm-s``), the K pack counted only where the calls' Stats say they pack K;
summed over all calls. Context tokens/s: the context tokens attended, summed over calls, per
second of wall time (one server, one GPU), and the same at the floor. Nothing else runs
between the calls: the wall time is ctxprefill's part of an engine's prefill, the ring's
hand-offs included. Each layer's request is built (``RequestRing.prepare``) while the layer
before it runs, as an engine builds its next step ahead (``--no-build-ahead``: between the
calls, inside the wall time). ``rows``: per chunk, its layers' calls together (wall,
client-observed calls, separate writes, floor, the server's Stats total, its five phases and
the device time of each stage).

Check: for ``--check-layers`` (default the last), the last chunk's output and LSE (its first
``--check-rows`` rows, ``--check-heads`` heads: one head shard of the server's weights, which
keeps the float64 work small at 128k) against float64 attention
(``ctxprefill_bench.reference64``) over the latents this script wrote, and, as the control,
over the context without the earlier chunks' ``cache_write`` latents (what lost writes would
give). Exit code 1 when a check is over ``--tolerance``.

``--heads 128 16`` runs one server per head count, one after the other; ``--prefill-dtype
bf16 fp8`` one per dtype for each (fp8: q sent in fp8 e4m3, the server quantizing k and v;
its floor is the same model's, attention FLOPs at the bf16 GEMM rate, its check within the
engine's fp8 bound, 6e-2); the JSON is rewritten after each server.
``--mps`` runs the caller (a child of this process, which owns the daemon and is no client
of it) and the servers as clients of a CUDA MPS daemon started for the run
(``ctxprefill_bench/mps.py``): their work then shares one GPU context instead of the GPU
time-slicing between the two processes' contexts at every call.
``--mps-ab ROUNDS`` measures what that changes: the same run, in turn without and with
``--mps``, ROUNDS times, each a process of its own (MPS is set before CUDA starts), written
as one JSON whose runs carry ``mps`` and ``round``.

  PYTHONPATH=server:client:bench python3 bench/bench_model_workload.py --out bench/results/bench_model_workload.json
  PYTHONPATH=server:client:bench python3 bench/bench_model_workload.py --device cpu --layers 2 --heads 2 \\
      --new 32 --chunk 16 --max-context 96 --block-size 16
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("client", "server", "bench"):
    if os.path.join(ROOT, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _sub))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ctxprefill_bench import engine_bench, mps  # noqa: E402
from ctxprefill_bench.run_info import commit, utc_now  # noqa: E402
from progress import log  # noqa: E402
from server_process import ServerProcess  # noqa: E402

KIND = "model_workload"
L, R, QK, V = 512, 64, 192, 128  # latent, rope, q·k and value dims
FILL_PIECE = 16384  # tokens per WriteCache of the fill
PHASES = ("validate", "queue", "input", "compute", "output")  # the server's Stats.phase_nanos, in order
RING_SLOTS, RING_SLOT_BYTES = 2, 1 << 17  # a slot holds a request: refs, block table, slot mapping


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Workload:
    """The sequence's shape: chunk j has ``new[j]`` rows over ``context[j]`` cached tokens;
    ``table``: its blocks (shuffled), ``slots``: int64 ``[max_context]``, position → slot."""

    def __init__(self, ns: argparse.Namespace):
        self.context_start = ns.max_context - ns.new
        starts = range(0, ns.new, ns.chunk)
        self.new = [min(ns.chunk, ns.new - a) for a in starts]
        self.context = [self.context_start + a for a in starts]
        blocks = -(-ns.max_context // ns.block_size)
        self.num_blocks = blocks + 1
        self.table = np.random.default_rng(ns.seed).permutation(self.num_blocks)[:blocks].tolist()
        p = np.arange(ns.max_context)
        self.slots = np.asarray(self.table, np.int64)[p // ns.block_size] * ns.block_size + p % ns.block_size


class Tensors:
    """One registered region holding named tensors ``[layers, rows, ...]`` at 256-byte
    aligned offsets; ``t[name]`` is a torch view of each (on the device for CUDA IPC)."""

    def __init__(self, client: Any, kind: str, dev: torch.device, specs: dict[str, tuple[tuple[int, ...], Any]]):
        from ctxprefill_client import CudaSharedMemoryRegion, SystemSharedMemoryRegion

        self.kind, self.at, at = kind, {}, 0
        for name, (shape, dt) in specs.items():
            self.at[name] = (at, shape, dt)
            at += -(-math.prod(shape) * dt.itemsize // 256) * 256
        if kind == "cuda":
            self.buf = torch.zeros(at, dtype=torch.uint8, device=dev)
            self.region: Any = CudaSharedMemoryRegion("workload", self.buf)
            client.register_cuda_shared_memory(self.region)
        else:
            self.region = SystemSharedMemoryRegion("workload", at)
            self.buf = torch.from_numpy(self.region.ndarray(np.uint8, (at,)))
            client.register_system_shared_memory(self.region)
        self.t = {n: self.buf[o:o + math.prod(s) * d.itemsize].view(d).view(s) for n, (o, s, d) in self.at.items()}

    def offset(self, name: str, layer: int, row: int = 0) -> int:
        o, shape, dt = self.at[name]
        return o + (layer * shape[1] + row) * math.prod(shape[2:]) * dt.itemsize

    def input(self, name: str, layer: int, row: int, n: int) -> Any:
        """Rows ``[row, row + n)`` of layer ``layer`` as a request input (bf16, or fp8 for an fp8 q)."""
        from ctxprefill_client import BF16, FP8_E4M3

        _, shape, dt = self.at[name]
        return self.region.input(FP8_E4M3 if dt == torch.float8_e4m3fn else BF16, (n, *shape[2:]),
                                 self.offset(name, layer, row))

    def ref(self, name: str, layer: int, nbytes: int) -> Any:
        return self.region.ref(self.offset(name, layer), nbytes)

    def close(self, client: Any) -> None:
        client.unregister_shared_memory(self.region.name)
        self.t, self.buf = {}, None  # views of a system segment keep it from closing
        self.region.close()  # a CUDA region: torch may reuse the memory once it is freed
        if self.kind != "cuda":
            self.region.unlink()


def check_layer(ns: argparse.Namespace, H: int, w: Workload, t: Tensors, kept: list, layer: int,
                info: Any) -> dict[str, Any]:
    """The last chunk's answer for ``layer`` against float64 attention over the latents written
    (and, the control, over the context without the chunks' cache_write latents), as the
    server's cache holds them (``info.cache_dtype``); within ``--tolerance``,
    else the engine's bound for ``info.prefill_dtype``."""
    from ctxprefill.app import build_engine
    from ctxprefill.engine.request import SequenceSpec
    from ctxprefill.settings import ServeSettings
    from ctxprefill_bench.reference64 import prefill_context_float64
    from ctxprefill_bench.workload import FLOAT64_TOLERANCE, relative_error

    hs = max(d for d in range(1, min(H, ns.check_heads) + 1) if H % d == 0)  # heads [0, hs): one head shard
    n, ctx, cs = w.new[-1], w.context[-1], w.context_start
    rows = min(n, ns.check_rows)
    eng = build_engine(ServeSettings(device="cpu", heads=H, num_shards=H // hs, layers=1, first_layer=layer,
                                     seed=ns.seed, block_size=ns.block_size, num_blocks=w.num_blocks,
                                     workspace_tokens=ns.block_size, cache_dtype=info.cache_dtype,
                                     prefill_dtype=info.prefill_dtype))  # the server's weights, heads [0, hs)
    kv, pe = torch.cat([a for a, _ in kept]), torch.cat([b for _, b in kept])  # [max_context, L], [.., R] bf16
    slots = torch.from_numpy(w.slots)
    q = t.t["q"][layer, :rows, :hs].to("cpu", copy=True)
    out = t.t["out"][layer, :n].to("cpu", copy=True)[:rows, :hs]
    lse = t.t["lse"][layer].reshape(-1)[:H * n].to("cpu", copy=True).view(H, n)[:hs, :rows]
    eng.write_cache(slots[:cs], kv[:cs], pe[:cs])
    control, _ = prefill_context_float64(eng, q, [SequenceSpec(rows, cs, w.table)])
    eng.write_cache(slots[cs:ctx], kv[cs:ctx], pe[cs:ctx])
    ref_out, ref_lse = prefill_context_float64(eng, q, [SequenceSpec(rows, ctx, w.table)])
    err = {"layer": layer, "rows": rows, "heads": hs, "context_tokens": ctx,
           "output_error": relative_error(out, ref_out), "lse_error": (lse.double() - ref_lse).abs().max().item(),
           "control_output_error": relative_error(out, control)}
    tol = ns.tolerance if ns.tolerance is not None else FLOAT64_TOLERANCE[info.prefill_dtype]
    err["tolerance"] = tol
    err["ok"] = err["output_error"] <= tol and err["lse_error"] <= tol
    return err


class Calls:
    """One head count's requests over the registered tensors ``t``."""

    def __init__(self, ns: argparse.Namespace, H: int, w: Workload, t: Tensors):
        self.ns, self.H, self.w, self.t = ns, H, w, t

    def seq(self, j: int) -> Any:
        return [(self.w.new[j], self.w.context[j], self.w.table)]

    def results(self, layer: int, n: int) -> dict[str, Any]:
        t, H = self.t, self.H
        return {"output_region": t.ref("out", layer, n * H * V * 2), "lse_region": t.ref("lse", layer, H * n * 4),
                "float_output": False}

    def latents(self, j: int, layer: int) -> tuple[Any, Any, Any]:
        """Chunk j's cache_write for one layer: its slots, kv_c and k_pe rows."""
        w = self.w
        off, n = w.context[j] - w.context_start, w.new[j]
        return (w.slots[w.context[j]:w.context[j] + n], self.t.input("kv", layer, off, n),
                self.t.input("pe", layer, off, n))

    def build(self, ring: Any, j: int, layer: int) -> Any:
        """Chunk j's request for one layer, serialized (no slot taken); stream-ordered, its q
        is read from the one q buffer that the stream writes before each layer's call."""
        n = self.w.new[j]
        q = self.t.input("qbuf", 0, 0, n) if ring.stream_ordered else self.t.input("q", layer, 0, n)
        return ring.prepare(q, self.seq(j), layer=layer, **self.results(layer, n),
                            cache_write=self.latents(j, layer) if self.ns.cache_write == "with-prefill" else None)


def drive(ns: argparse.Namespace, H: int, w: Workload, client: Any, info: Any, kind: str, dev: torch.device,
          ceil: dict) -> list[dict[str, Any]]:
    """One head count on its server: the cache filled once, then per ``--orders`` entry (calls
    ordered by the caller's host, "host", or on the device, "stream") the warm-up, the timed
    chunks and the check."""
    from ctxprefill.config import CacheConfig, EngineConfig, ModelShape
    from ctxprefill_client import SystemSharedMemoryRegion

    Ly, C, cs, bs = ns.layers, ns.chunk, w.context_start, torch.bfloat16
    qt = torch.float8_e4m3fn if info.prefill_dtype == "fp8" else bs  # fp8 prefill: q arrives in fp8
    piece = max(1, min(FILL_PIECE, cs))
    t = Tensors(client, kind, dev, {"q": ((Ly, C, H, QK), qt), "qbuf": ((1, C, H, QK), qt),
                                    "kv": ((Ly, ns.new, L), bs), "pe": ((Ly, ns.new, R), bs),
                                    "out": ((Ly, C, H, V), bs), "lse": ((Ly, H, C), torch.float32),
                                    "fkv": ((1, piece, L), bs), "fpe": ((1, piece, R), bs)})
    ring_region = SystemSharedMemoryRegion("ring", RING_SLOTS * RING_SLOT_BYTES)
    client.register_system_shared_memory(ring_region)
    gen = torch.Generator(device=dev).manual_seed(ns.seed + H)
    keep = set(ns.check_layers if ns.check_layers is not None else [Ly - 1])
    kept: dict[int, list] = {layer: [] for layer in keep}

    def fill_random(x: torch.Tensor) -> None:  # (an fp8 q: normals, all inside e4m3's range, rounded)
        x.copy_(torch.randn(x.shape, generator=gen, device=dev))

    runs: list[dict[str, Any]] = []
    try:
        fill_s = 0.0
        for layer in range(Ly):  # the context before the prefill
            for a in range(0, cs, piece):
                n = min(piece, cs - a)
                kv, pe = t.t["fkv"][0, :n], t.t["fpe"][0, :n]
                fill_random(kv)
                fill_random(pe)
                if layer in keep:
                    kept[layer].append((kv.to("cpu", copy=True), pe.to("cpu", copy=True)))
                _sync(dev)
                t0 = time.perf_counter()
                client.write_cache(w.slots[a:a + n], t.input("fkv", 0, 0, n), t.input("fpe", 0, 0, n), layer=layer)
                fill_s += time.perf_counter() - t0
        fill = {"tokens": cs * Ly, "seconds": fill_s, "bytes_per_s": _div(cs * Ly * (L + R) * 2, fill_s)}
        log(f"H={H}: filled {Ly} layers x {cs} tokens in {fill_s:.2f} s of WriteCache")
        for layer in range(Ly):
            for name in ("q", "kv", "pe"):
                fill_random(t.t[name][layer])
        _sync(dev)
        for layer in keep:
            kept[layer].append((t.t["kv"][layer].to("cpu", copy=True), t.t["pe"][layer].to("cpu", copy=True)))
        cfg = EngineConfig(shape=ModelShape(heads=H), cache=CacheConfig(info.cache_dtype, ns.block_size, w.num_blocks),
                           prefill_dtype=info.prefill_dtype, workspace_tokens=info.workspace_tokens)
        calls = Calls(ns, H, w, t)
        for order in ns.orders:
            # every order writes the same chunks' latents into the same slots: the cache and the
            # check's latents hold for each; its results are checked, not an earlier order's
            t.t["out"].fill_(float("nan"))
            t.t["lse"].fill_(float("nan"))
            rows, packs, clocks = time_order(ns, H, w, client, calls, ring_region, dev, order)
            # the floor of each call shape (once per chunk: the layers' calls are alike)
            for r in rows:
                for key, rate in (("floor_ms", "matmul_flops_per_s"),
                                  ("floor_held_ms", "matmul_sustained_flops_per_s")):
                    fl = engine_bench.floor_seconds(cfg, [r["context_tokens"]], [r["new_tokens"]], ceil,
                                                    rate=rate, pack=packs) if rate in ceil else None
                    r[key] = Ly * fl["total_s"] * 1e3 if fl else None
            checks = [check_layer(ns, H, w, t, kept[layer], layer, info) for layer in sorted(keep)]
            for c in checks:
                log(f"H={H} layer {c['layer']} ({order} order): output error {c['output_error']:.2e}, LSE "
                    f"{c['lse_error']:.2e} against float64 ({'within' if c['ok'] else 'OVER'} {c['tolerance']:g}); "
                    f"without the chunks' writes {c['control_output_error']:.2e}")
            runs.append({"order": order, **summarize(ns, H, w, rows, fill, checks, packs), "clocks": clocks})
    finally:
        t.close(client)
        client.unregister_shared_memory(ring_region.name)
        ring_region.close()
        ring_region.unlink()
    return runs


def time_order(ns: argparse.Namespace, H: int, w: Workload, client: Any, calls: Calls, ring_region: Any,
               dev: torch.device, order: str) -> tuple[list[dict], bool, dict | None]:
    """One order's warm-up and timed chunks through a ring attached for it: (a row per chunk,
    whether the calls packed K, the SM clock and power sampled while they ran)."""
    from ctxprefill.clock_monitor import ClockMonitor

    Ly, t, ordered = ns.layers, calls.t, order == "stream"
    rows: list[dict] = []
    unpacked: set[bool] = set()
    # the ring's life is bounded by --timeout: a server that stops answering ends it
    with client.attach_request_ring(ring_region, num_slots=RING_SLOTS, slot_bytes=RING_SLOT_BYTES,
                                    timeout=ns.timeout, stream_ordered=ordered,
                                    device=dev if ordered else None) as ring:
        for _ in range(ns.warmup):  # every layer once at the first chunk's shape, no cache_write
            for layer in range(Ly):
                ring.prefill_context(t.input("q", layer, 0, w.new[0]), calls.seq(0), layer=layer,
                                     **calls.results(layer, w.new[0]))

        def timed_chunks() -> None:
            """The chunks, each layer's call in turn: the measured part."""
            for j, (n, ctx) in enumerate(zip(w.new, w.context)):
                calls_s = write_s = 0.0
                phases = dict.fromkeys(PHASES, 0)  # the server's time: its five phases make its total
                stages: collections.Counter[str] = collections.Counter()  # device time per stage
                marks: list[torch.cuda.Event] = []  # stream order: the caller's stream past each answer
                t_chunk = time.perf_counter()
                ahead = calls.build(ring, j, 0) if ns.build_ahead else None
                for layer in range(Ly):
                    t0 = time.perf_counter()
                    if ordered:  # the layer's q, written on the stream after the layer before has answered
                        t.t["qbuf"][0, :n].copy_(t.t["q"][layer, :n])
                    ring.submit_prepared(ahead if ahead is not None else calls.build(ring, j, layer))
                    # the next layer's request is built while this one runs, as an engine would
                    ahead = calls.build(ring, j, layer + 1) if ns.build_ahead and layer + 1 < Ly else None
                    st = ring.result().stats
                    if ordered:
                        marks.append(torch.cuda.Event(enable_timing=True))
                        marks[-1].record()
                    t1 = time.perf_counter()
                    if ns.cache_write == "separate":
                        client.write_cache(*calls.latents(j, layer), layer=layer)
                        write_s += time.perf_counter() - t1
                    calls_s += t1 - t0
                    for k in PHASES:
                        phases[k] += st["phase_nanos"][k]
                    stages.update(st["stage_nanos"])
                    unpacked.add(bool(st["unpacked_keys"]))
                if ordered:
                    _sync(dev)  # the chunk's device work: the calls were answered once queued
                wall = time.perf_counter() - t_chunk
                gaps = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
                rows.append({"chunk": j, "new_tokens": n, "context_tokens": ctx, "wall_ms": wall * 1e3,
                             "calls_ms": calls_s * 1e3, "write_ms": write_s * 1e3,
                             "server_total_ms": sum(phases.values()) / 1e6,
                             "server_compute_ms": phases["compute"] / 1e6,
                             "server_phase_ms": {k: v / 1e6 for k, v in phases.items()},
                             "stage_ms": {k: v / 1e6 for k, v in sorted(stages.items())},
                             # stream order: from one layer's result reaching the caller's stream to the next's
                             "result_period_ms": float(np.median(gaps)) if gaps else None})
                log(f"H={H} chunk {j + 1}/{len(w.new)} ({order} order): {Ly} layers over {ctx} context tokens "
                    f"in {wall * 1e3:.1f} ms (server compute {phases['compute'] / 1e6:.1f} ms)")

        # the SM clock and power while they run: a sustained load runs at the clock the power cap leaves
        monitor = ClockMonitor(dev) if dev.type == "cuda" else None
        clocks = None
        if monitor is not None and monitor.available:
            clocks = monitor.sample_during(timed_chunks)  # runs them once, sampled or not
        else:
            timed_chunks()
    return rows, not all(unpacked), clocks


def _div(a: float, b: float) -> float:
    return a / b if b else float("nan")


def summarize(ns: argparse.Namespace, H: int, w: Workload, rows: list[dict], fill: dict, checks: list[dict],
              packs: bool) -> dict[str, Any]:
    nan = float("nan")
    wall = sum(r["wall_ms"] for r in rows) / 1e3
    floor = sum(r["floor_ms"] for r in rows) / 1e3 if all(r["floor_ms"] is not None for r in rows) else nan
    held = sum(r["floor_held_ms"] for r in rows) / 1e3 if all(r["floor_held_ms"] is not None for r in rows) else nan
    ctx_tokens = ns.layers * sum(w.context)
    return {"heads": H, "layers": ns.layers, "chunks": len(rows), "calls": ns.layers * len(rows),
            "new_tokens": ns.new, "context_start": w.context_start, "max_context": ns.max_context,
            "wall_s": wall, "floor_s": floor, "floor_held_s": held, "ratio": _div(wall, floor),
            "ratio_held": _div(wall, held),
            "calls_s": sum(r["calls_ms"] for r in rows) / 1e3, "cache_write_s": sum(r["write_ms"] for r in rows) / 1e3,
            "server_compute_s": sum(r["server_compute_ms"] for r in rows) / 1e3,
            "server_total_s": sum(r["server_total_ms"] for r in rows) / 1e3,
            "server_phase_s": {k: sum(r["server_phase_ms"][k] for r in rows) / 1e3 for k in PHASES},
            "stage_s": {k: sum(r["stage_ms"].get(k, 0.0) for r in rows) / 1e3
                        for k in sorted({k for r in rows for k in r["stage_ms"]})},
            "context_tokens": ctx_tokens, "context_tokens_per_s": _div(ctx_tokens, wall),
            "floor_context_tokens_per_s": _div(ctx_tokens, floor), "prefill_tokens_per_s": _div(ns.new, wall),
            "packs_k": packs, "fill": fill, "rows": rows, "checks": checks,
            "check_ok": all(c["ok"] for c in checks)}


def run_heads(ns: argparse.Namespace, H: int, prefill: str, w: Workload, kind: str, dev: torch.device, ceil: dict,
              logdir: str) -> list[dict[str, Any]]:
    """One server for ``H`` heads and ``prefill`` dtype; one run per ``--orders`` entry on it, in turn."""
    from ctxprefill_client import PrefillContextClient

    flags: dict[str, object] = {"device": str(dev), "heads": H, "layers": ns.layers, "block_size": ns.block_size,
                                "num_blocks": w.num_blocks, "seed": ns.seed, "grace_seconds": 5,
                                "shared_memory": "all" if kind == "cuda" else "system", "request_ring": True,
                                "cache_dtype": ns.cache_dtype, "prefill_dtype": prefill}
    if ns.workspace_tokens:
        flags["workspace_tokens"] = ns.workspace_tokens
    if ns.cuda_graphs:
        flags["cuda_graphs"] = True
    if "stream" in ns.orders:
        flags["request_ring_stream_order"] = True
    server = ServerProcess(f"workload_h{H}_{prefill}", flags, logdir)
    log("starting the server: " + server.cmd)
    try:
        ready_s = server.wait_ready(ns.ready_timeout)
        with PrefillContextClient(server.target, timeout=ns.timeout, retries=0, max_message_bytes=1 << 30) as client:
            info = client.server_info()
            if info.num_layers != ns.layers:
                raise RuntimeError(f"the server holds {info.num_layers} layers, not {ns.layers}")
            log(f"server ready in {ready_s:.1f} s: {info.device}, backend {info.attention_backend}, fused "
                f"{info.fused_kernels_active}, workspace {info.workspace_tokens}")
            runs = drive(ns, H, w, client, info, kind, dev, ceil)
            about = {"cmd": server.cmd, "ready_s": ready_s, "attention_backend": info.attention_backend,
                     "fused_kernels_active": info.fused_kernels_active, "workspace_tokens": info.workspace_tokens,
                     "cache_dtype": info.cache_dtype, "prefill_dtype": info.prefill_dtype,
                     "num_blocks": info.num_blocks,
                     # the requests replayed as CUDA graphs, in place or copying (every order's)
                     "graph_replays": server.counter("ctxprefill_graph_replays_total", "mode")}
    finally:
        server.stop(timeout=15)
    about["log_tail"] = server.tail(20)
    return [{**r, "server": about} for r in runs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:N")
    p.add_argument("--heads", type=int, nargs="+", default=[128, 16], help="one server per head count")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--new", type=int, default=8192, help="new tokens of the prefill")
    p.add_argument("--chunk", type=int, default=1024, help="new tokens per chunk")
    p.add_argument("--max-context", type=int, default=131072, help="tokens cached once the prefill is done")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--prefill-dtype", nargs="+", choices=["bf16", "fp8"], default=["bf16"],
                   help="one server per dtype (serve --prefill-dtype; fp8: q sent in fp8, k and v quantized)")
    p.add_argument("--cache-dtype", choices=["auto", "fp8", "fp8_ds_mla"], default="auto",
                   help="the servers' cache (serve --cache-dtype)")
    p.add_argument("--workspace-tokens", type=int, default=None, help="the server's (default: its own)")
    p.add_argument("--shared-memory", choices=["auto", "cuda", "system"], default="auto",
                   help="where the tensors live: auto = cuda on a CUDA device, else system")
    p.add_argument("--cache-write", choices=["with-prefill", "separate"], default="with-prefill",
                   help="the chunk's latents: the ring request's cache_write, or a WriteCache call after it")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed passes over every layer at the first chunk's shape (no cache_write)")
    p.add_argument("--sustained-gemm-s", type=float, default=2.0, help="GEMM rate held this long, for floor_held")
    p.add_argument("--check-layers", type=int, nargs="*", default=None, help="default: the last layer")
    p.add_argument("--check-rows", type=int, default=16)
    p.add_argument("--check-heads", type=int, default=4)
    p.add_argument("--tolerance", type=float, default=None,
                   help="output relative error and LSE difference (default: the engine's bound for the prefill "
                        "dtype, ctxprefill_bench.workload.FLOAT64_TOLERANCE)")
    p.add_argument("--build-ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="build each layer's request while the layer before it runs (RequestRing.prepare)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="serve --cuda-graphs: each step's shape captured once and replayed for the other layers")
    p.add_argument("--orders", nargs="+", choices=["host", "stream"], default=["host"],
                   help="how the calls are ordered, one run each on the same server: host = each answer (its work "
                        "done) awaited before the next call; stream = a stream-ordered ring (serve "
                        "--request-ring-stream-order; CUDA): each layer's q written into one buffer on the caller's "
                        "stream, the calls ordered by CUDA events and answered once queued, the chunk's wall time "
                        "ending when its device work has")
    p.add_argument("--mps", action="store_true",
                   help="run the caller (a child of this process) and the servers as clients of a CUDA MPS daemon "
                        "started for the run (one shared GPU context instead of time-slicing between the processes')")
    p.add_argument("--mps-client", action="store_true", help=argparse.SUPPRESS)  # --mps's child, in the daemon
    p.add_argument("--mps-ab", type=int, default=0, metavar="ROUNDS",
                   help="ROUNDS rounds of this run without and then with --mps, each a process of its own, into "
                        "one JSON (--out) whose runs carry mps and round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of each RPC, seconds")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--out", default=None, help="write JSON results here (rewritten after each head count)")
    argv = sys.argv[1:] if argv is None else argv  # the children's arguments (--mps, --mps-ab)
    ns = p.parse_args(argv)
    if min(ns.layers, ns.new, ns.chunk, ns.block_size) < 1 or ns.max_context < ns.new:
        p.error("--layers, --new, --chunk, --block-size must be >= 1 and --max-context >= --new")
    if any(not 0 <= x < ns.layers for x in ns.check_layers or []):
        p.error("--check-layers: layers in [0, --layers)")
    if (ns.mps or ns.mps_ab) and not mps.available():
        p.error(f"--mps{'-ab' if ns.mps_ab else ''}: nvidia-cuda-mps-control is not on the PATH")
    if ns.mps_ab:
        if ns.mps_ab < 0 or ns.mps or not ns.out:
            p.error("--mps-ab: a number of rounds >= 1, with --out, without --mps (each round runs both)")
        return mps_ab(ns, argv)
    if ns.mps and not ns.mps_client:
        # the run is a child of the daemon's owner, which is no client of it (mps.py)
        with mps.mps_daemon() as env:
            return subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--mps-client"],
                                  env={**os.environ, **env}, check=False).returncode
    return run(ns, p)


def _without(argv: list[str], *options: str) -> list[str]:
    """``argv`` less ``options`` and their values (``--out x`` or ``--out=x``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in options)):
            out.append(a)
    return out


def mps_ab(ns: argparse.Namespace, argv: list[str]) -> int:
    """``--mps-ab``: this run without and with ``--mps`` in turn, ``ns.mps_ab`` rounds, each a
    child process; their runs, labelled ``mps`` and ``round``, in one JSON (rewritten after
    each). 0 when every child's checks held."""
    rest = _without(argv, "--mps-ab", "--out")
    meta: dict[str, Any] | None = None
    runs: list[dict] = []
    rc = 0
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(1, ns.mps_ab + 1):
            for on in (False, True):
                out = os.path.join(tmp, f"{rnd}-{int(on)}.json")
                log(f"--mps-ab round {rnd} of {ns.mps_ab}: MPS {'on' if on else 'off'}")
                done = subprocess.run([sys.executable, os.path.abspath(__file__), *rest, *(["--mps"] if on else []),
                                       "--out", out], check=False)
                rc = rc or done.returncode
                if not os.path.exists(out):
                    log(f"--mps-ab: the run with MPS {'on' if on else 'off'} wrote nothing (exit {done.returncode})")
                    return done.returncode or 1
                with open(out) as f:
                    doc = json.load(f)
                if meta is None:
                    meta = {**doc["meta"], "args": {**doc["meta"]["args"], "mps": None, "mps_ab": ns.mps_ab}}
                runs += [{**r, "mps": on, "round": rnd} for r in doc["runs"]]
                tmp_out = ns.out + ".tmp"
                with open(tmp_out, "w") as f:
                    json.dump({"meta": meta, "runs": runs}, f, indent=1)
                os.replace(tmp_out, ns.out)
    return rc


def run(ns: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """The servers, their runs and the JSON, for checked arguments; 0 when every check held."""
    from ctxprefill.settings import resolve_device

    dev = resolve_device(ns.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    kind = ns.shared_memory if ns.shared_memory != "auto" else ("cuda" if dev.type == "cuda" else "system")
    if kind == "cuda" and dev.type != "cuda":
        p.error("--shared-memory cuda needs a CUDA device")
    if "stream" in ns.orders and kind != "cuda":
        p.error("--orders stream needs the tensors in CUDA memory (a CUDA device)")
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    w = Workload(ns)
    ceil = engine_bench.measure_ceilings(dev, ns.sustained_gemm_s)
    log(f"device {dev} ({gpu or 'cpu'}), tensors in {kind} shared memory; {ns.layers} layers, {ns.new} new tokens "
        f"in {len(w.new)} chunks over {w.context[0]}..{w.context[-1]} context; copy "
        f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 GEMM {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    meta = {"kind": KIND, "date": utc_now(), "commit": commit(), "gpu": gpu, "device": str(dev),
            "torch": torch.__version__, "shared_memory": kind, "ceilings": ceil, "args": vars(ns),
            "failed": []}  # configurations whose server or calls failed: recorded, the others still run
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as logdir:
        for H, prefill in [(H, p) for H in ns.heads for p in ns.prefill_dtype]:
            try:
                got = run_heads(ns, H, prefill, w, kind, dev, ceil, logdir)
            except Exception as e:  # noqa: BLE001 - one configuration's failure is a result too
                why = f"{type(e).__name__}: {str(e)[:600]}"
                meta["failed"].append({"heads": H, "prefill_dtype": prefill, "error": why})
                log(f"H={H} ({prefill} prefill) FAILED: {why}")
                got = []
            runs += got
            for r in got:
                o = f"{r['order']} order, {prefill} prefill"
                log(f"H={H} ({o}): {r['calls']} calls in {r['wall_s']:.3f} s, floor sum {r['floor_s']:.3f} s "
                    f"(ratio {r['ratio']:.2f}); {r['context_tokens_per_s']:.3g} context tokens/s (floor "
                    f"{r['floor_context_tokens_per_s']:.3g})")
                per_call = {k: f"{v / r['calls'] * 1e3:.3f}" for k, v in r["server_phase_s"].items()}
                log(f"H={H} ({o}): device stages per call, ms: "
                    f"{ {k: round(v / r['calls'] * 1e3, 3) for k, v in r['stage_s'].items()} }")
                log(f"H={H} ({o}): per call, ms: client-observed {r['calls_s'] / r['calls'] * 1e3:.3f}, "
                    f"server {r['server_total_s'] / r['calls'] * 1e3:.3f} ({per_call})")
            if ns.out:
                tmp = ns.out + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(engine_bench._clean({"meta": meta, "runs": runs}), f, indent=1)
                os.replace(tmp, ns.out)
    print(f"\n{'H':>4} {'prefill':>7} {'order':>6} {'chunk':>5} {'context':>8} {'wall ms':>9} {'floor ms':>9} "
          f"{'ratio':>6} {'compute ms':>10}")
    for r in runs:
        for row in r["rows"]:
            fl = row["floor_ms"] if row["floor_ms"] is not None else float("nan")
            print(f"{r['heads']:4d} {r['server']['prefill_dtype']:>7} {r['order']:>6} {row['chunk']:5d} "
                  f"{row['context_tokens']:8d} {row['wall_ms']:9.2f} {fl:9.2f} {_div(row['wall_ms'], fl):6.2f} "
                  f"{row['server_compute_ms']:10.2f}")
    return 0 if all(r["check_ok"] for r in runs) and not meta["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
