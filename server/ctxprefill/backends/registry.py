"""Attention backends by name, and ``auto``: the best one this device supports.

``auto`` without a probe shape takes the first usable backend of ``_AUTO_ORDER`` (static).
With a :class:`ProbeShape` (the chunk shape the caller will run, e.g. ``workspace_tokens``
keys under a query count, its head count) and a CUDA device, it times every usable
candidate of ``_PROBE_ORDER`` on that chunk after a warm-up (which also pays one-time
costs: Triton compiles, cuDNN graph builds) and keeps the first candidate unless another
is ``_PROBE_MARGIN`` faster; a candidate whose probe raises is skipped with the reason.
Where the engine's fused path reads K apart (bf16 prefill, unpacked keys: ``ProbeShape.pack``),
each candidate is timed as that path would run it: a backend that takes ``k_rope`` over the
two parts where they lie, any other behind the K pack it would need.
A CPU device always gets ``reference``, unprobed.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import time
from collections.abc import Callable

import torch

from .base import AttentionBackend

# name -> "module:Class"; imported lazily so that a CPU machine never imports triton.
_BACKENDS: dict[str, str] = {
    "cudnn": "ctxprefill.backends.cudnn_dense:CudnnDenseBackend",
    "cudnn-frontend": "ctxprefill.backends.cudnn_frontend:CudnnFrontendBackend",
    "triton": "ctxprefill.backends.triton_attention:TritonAttentionBackend",
    "reference": "ctxprefill.backends.reference:ReferenceBackend",
}
# best first; ``auto`` takes the first that is available and handles the dtype; a CPU
# device gets reference. cudnn is NOT in it: measured on the H200 it runs one-segment
# bf16 chunks at 672 TFLOP/s against Triton's 552, but every new (q, k) length pair
# costs a 60-75 ms cuDNN plan build, and a serving workload's lengths rarely repeat.
# Ask for it with --backend cudnn where chunk shapes do repeat (docs/DESIGN.md).
# cudnn-frontend is not in it either (a ~1.3 s graph build per new shape bucket); ``auto``
# with a probe shape measures it against triton (``_PROBE_ORDER``).
_AUTO_ORDER = ("triton", "reference")
# candidates ``auto`` times on a CUDA device when given a probe shape (ties: the first)
_PROBE_ORDER = ("triton", "cudnn-frontend")
# A later candidate replaces the first only when the probe finds it this much faster: the
# probe does not see what a cuDNN graph costs on each new shape bucket in service (50 ms
# to 1.8 s measured, on the request that meets it). Measured on the H200 (bench_attention.py,
# 2026-11-29) cudnn-frontend ran bf16 chunks 1-7 % faster than triton: not worth that.
_PROBE_MARGIN = 0.10

log = logging.getLogger("ctxprefill.backends")


@dataclasses.dataclass(frozen=True)
class ProbeShape:
    """A representative chunk for ``auto``'s start-up probe: ``segments`` sequences of
    equal length sharing ``q_tokens`` queries and ``k_tokens`` keys, ``heads`` heads.

    ``pack`` (the engine's K pack, ``(k_nope [Tk,H,128], k_pe [Tk,64]) -> k [Tk,H,192]``):
    given when the engine's fused path packs no K for a backend that ``takes_k_rope``
    (bf16 prefill, unpacked keys). Each candidate is then timed with the keys as that path
    would hand them over: k_nope and v as views of one ``kv_b_proj``-shaped buffer, and
    either ``k_rope=`` (head stride 0) or K packed by ``pack`` inside the timing — so that
    a backend is not chosen for an attention the pack it needs makes slower overall."""

    heads: int
    q_tokens: int
    k_tokens: int
    segments: int = 1
    warmup: int = 2
    iters: int = 5
    scale: float = 192**-0.5
    pack: Callable | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if min(self.heads, self.q_tokens, self.k_tokens, self.segments, self.iters) < 1 or self.warmup < 0:
            raise ValueError(f"probe shape needs positive sizes: {self}")
        if self.segments > min(self.q_tokens, self.k_tokens):
            raise ValueError(f"probe shape: {self.segments} segments need at least as many q and k tokens")


def names() -> list[str]:
    return list(_BACKENDS)


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {', '.join(_BACKENDS)}")
    mod, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def create(name: str, device: torch.device, q_dtype: torch.dtype,
           probe: ProbeShape | None = None) -> tuple[AttentionBackend, str]:
    """(backend, why it was chosen). ``name="auto"`` picks the first usable one, or, given
    a ``probe`` shape on a CUDA device, the one the probe finds fastest on that shape (by
    the margin ``_PROBE_MARGIN`` over the first)."""
    device = torch.device(device)
    if name != "auto":
        cls = backend_class(name)
        ok, why = cls.is_available(device)
        if not ok:
            raise ValueError(f"attention backend {name!r} is not available on {device}: {why}")
        if not cls.supports(device, q_dtype):
            raise ValueError(f"attention backend {name!r} does not support {q_dtype} on {device}")
        return cls(), "requested"
    if probe is not None and device.type == "cuda":
        return _auto_by_probe(device, q_dtype, probe)
    skipped = []
    for candidate in _AUTO_ORDER:
        try:
            cls = backend_class(candidate)
        except ImportError as e:  # e.g. triton not installed
            skipped.append(f"{candidate}: {e}")
            continue
        ok, why = cls.is_available(device)
        if ok and cls.supports(device, q_dtype):
            return cls(), "auto" + (f" (skipped {'; '.join(skipped)})" if skipped else "")
        skipped.append(f"{candidate}: {why or 'dtype not supported'}")
    raise ValueError(f"no attention backend for {q_dtype} on {device}: {'; '.join(skipped)}")


def _usable(candidates, device, q_dtype) -> tuple[list[tuple[str, type[AttentionBackend]]], list[str]]:
    """([(name, class)] usable here for q_dtype, [why each other one is not])."""
    usable, skipped = [], []
    for candidate in candidates:
        try:
            cls = backend_class(candidate)
        except ImportError as e:
            skipped.append(f"{candidate}: {e}")
            continue
        ok, why = cls.is_available(device)
        if ok and cls.supports(device, q_dtype):
            usable.append((candidate, cls))
        else:
            skipped.append(f"{candidate}: {why or 'dtype not supported'}")
    return usable, skipped


def _auto_by_probe(device: torch.device, q_dtype: torch.dtype, probe: ProbeShape,
                   measure=None) -> tuple[AttentionBackend, str]:
    """``auto`` with a probe: the usable candidate of ``_PROBE_ORDER`` fastest on ``probe``
    (a later one must beat the first by ``_PROBE_MARGIN``).
    ``measure(backend, device, q_dtype, probe) -> ms`` (tests pass a stand-in)."""
    measure = measure or _measure
    usable, skipped = _usable(_PROBE_ORDER, device, q_dtype)
    if len(usable) == 1:  # nothing to compare: no probe
        name, cls = usable[0]
        return cls(), f"auto: {name}, the only candidate" + (f" (skipped {'; '.join(skipped)})" if skipped else "")
    timed = []  # (ms, order, name, instance)
    for i, (name, cls) in enumerate(usable):
        try:
            be = cls()
            ms = float(measure(be, device, q_dtype, probe))
        except Exception as e:  # noqa: BLE001  a candidate that cannot run the probe is not chosen
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            skipped.append(f"{name}: probe failed ({msg})")
            log.warning("attention backend auto: %s failed its probe: %s", name, msg)
            continue
        timed.append((ms, i, name, be))
    if not timed:
        raise ValueError(f"no attention backend for {q_dtype} on {device}: {'; '.join(skipped)}")
    best = min(timed, key=lambda r: (r[0], r[1]))
    first = min(timed, key=lambda r: r[1])
    kept = best is not first and best[0] > first[0] * (1 - _PROBE_MARGIN)
    if kept:  # not faster by the margin: keep the first candidate
        best = first
    per_q, per_k = probe.q_tokens // probe.segments, probe.k_tokens // probe.segments
    shape = f"H={probe.heads} {probe.segments}x({per_q}q/{per_k}k)" + (
        "; K packed in the timing where a backend cannot read it apart" if probe.pack is not None else "")
    why = (f"auto: {', '.join(f'{n} {ms:.3f} ms' for ms, _, n, _ in timed)} -> {best[2]} ({shape}"
           + (f"; others must be {_PROBE_MARGIN:.0%} faster to replace {first[2]})" if kept else ")")
           + (f" (skipped {'; '.join(skipped)})" if skipped else ""))
    log.info("attention backend %s", why)
    return best[3], why


def _measure(be: AttentionBackend, device: torch.device, q_dtype: torch.dtype, probe: ProbeShape) -> float:
    """Milliseconds per ``run_context_chunk`` on random data of the probe shape (CUDA events,
    after ``probe.warmup`` calls), writing into a caller-given ``out`` when supported."""
    H, S = probe.heads, probe.segments
    gen = torch.Generator(device=device).manual_seed(0)

    def split(total):
        per = [total // S] * S
        per[-1] += total - sum(per)
        return torch.tensor([0] + torch.tensor(per).cumsum(0).tolist(), dtype=torch.int32, device=device), max(per)

    def rnd(*shape):
        x = torch.randn(*shape, device=device, dtype=torch.float32, generator=gen)
        return x.clamp(-448, 448).to(q_dtype)

    with torch.cuda.device(device):
        Tk = probe.k_tokens
        q = rnd(probe.q_tokens, H, 192)
        (cu_q, max_q), (cu_k, max_k) = split(probe.q_tokens), split(Tk)
        out = torch.empty(probe.q_tokens, H, 128, dtype=torch.bfloat16, device=device) if be.supports_out() else None
        if probe.pack is None:
            k, v = rnd(Tk, H, 192), rnd(Tk, H, 128)
            run = lambda: be.run_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, probe.scale, out=out)
        else:  # as the fused path hands them over: kv_b_proj's output and the workspace's k_pe
            kv, k_pe = rnd(Tk, H, 256), rnd(Tk, 64)
            k_nope, v = kv[..., :128], kv[..., 128:]
            if be.takes_k_rope(q_dtype):
                k_rope = k_pe.unsqueeze(1).expand(Tk, H, 64)
                run = lambda: be.run_context_chunk(q, k_nope, v, cu_q, cu_k, max_q, max_k, probe.scale, out=out,
                                                   k_rope=k_rope)
            else:
                run = lambda: be.run_context_chunk(q, probe.pack(k_nope, k_pe), v, cu_q, cu_k, max_q, max_k,
                                                   probe.scale, out=out)
        for _ in range(probe.warmup):
            run()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(probe.iters):
            run()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / probe.iters
    log.debug("probe of %s: %.3f ms (%.1f s wall)", be.name, ms, time.perf_counter() - t0)
    return ms
