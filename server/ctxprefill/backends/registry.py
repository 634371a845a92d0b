"""Attention backends by name, and ``auto``: the best one this device supports.

Names (``--backend``):

* ``gluon`` — the warp-specialized Gluon kernel (``gluon_attention``) on Hopper (sm_90)
  for the chunks it takes (non-causal; bf16, or fp8 with V keys-last), in a launch order
  packed per SM on the host; the Triton kernel for the rest. bf16 and fp8.
* ``triton`` — the Triton kernel (``triton_attention``) on every chunk, any GPU from
  sm_80 (fp8 from sm_89). bf16 and fp8.
* ``cudnn-frontend`` — cuDNN's ragged SDPA through the frontend's graph API, one graph per
  shape bucket (~1.3 s each to build). bf16, sm_90 or later.
* ``cudnn`` — torch's dense cuDNN SDPA for one-segment chunks (a plan build per new length
  pair), a kernel backend for the rest. bf16, sm_90 or later.
* ``reference`` — the torch reference (float32 loops): any device, any dtype.

Each backend declares what it can do (``caps``, a :class:`~.base.BackendCaps`) and says
why it cannot serve a device and dtype (``unavailable_reason``); the registry asks nothing
else. ``auto`` without a probe shape takes the first usable backend of ``_AUTO_ORDER``
(static). With a :class:`ProbeShape` (the chunk shape the caller will run, e.g.
``workspace_tokens`` keys under a query count, its head count) and a CUDA device, it takes
the first usable backend of ``_PROBE_FIRST`` and times it and every usable one of
``_PROBE_OTHERS`` on that chunk after a warm-up (which also pays one-time costs: Triton
compiles, cuDNN graph builds), keeping the first unless another is ``_PROBE_MARGIN``
faster; a candidate whose probe raises is skipped with the reason. Where the engine's
fused path reads the keys unpacked (bf16 prefill: ``ProbeShape.pack``), each candidate is
timed as that path would run it: a backend with unpacked keys over the two parts where they
lie, any other behind the K pack it would need. A CPU device always gets ``reference``,
unprobed.
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
    "gluon": "ctxprefill.backends.triton_attention:GluonAttentionBackend",
    "triton": "ctxprefill.backends.triton_attention:TritonAttentionBackend",
    "reference": "ctxprefill.backends.reference:ReferenceBackend",
}
# best first; ``auto`` takes the first that can serve the device and dtype: gluon on
# Hopper (5-28 % faster than the Triton kernel on the H200, docs/DESIGN.md), triton on
# other GPUs, reference on a CPU. cudnn is NOT in it: measured on the H200 it runs
# one-segment bf16 chunks at 672 TFLOP/s against Triton's 552, but every new (q, k) length
# pair costs a 60-75 ms cuDNN plan build, and a serving workload's lengths rarely repeat.
# Ask for it with --backend cudnn where chunk shapes do repeat (docs/DESIGN.md).
# cudnn-frontend is not in it either (a ~1.3 s graph build per new shape bucket); ``auto``
# with a probe shape measures it against the first (``_PROBE_OTHERS``).
_AUTO_ORDER = ("gluon", "triton", "reference")
# ``auto`` with a probe shape on a CUDA device: the first usable of these is the candidate
# to beat (the kernel ``auto`` takes unprobed) ...
_PROBE_FIRST = ("gluon", "triton")
# ... and these are timed against it (ties: the first)
_PROBE_OTHERS = ("cudnn-frontend",)
# A later candidate replaces the first only when the probe finds it this much faster: the
# probe does not see what a cuDNN graph costs on each new shape bucket in service (50 ms
# to 1.8 s measured, on the request that meets it). Measured on the H200 (bench_attention.py,
# 2026-11-29) cudnn-frontend ran bf16 chunks 1-7 % faster than triton: not worth that.
_PROBE_MARGIN = 0.10

log = logging.getLogger("ctxprefill.backends")

#: the engine's K pack: (k_nope [Tk, H, 128], k_pe [Tk, 64]) -> k [Tk, H, 192]
KPack = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``_auto_by_probe``'s measurement: (backend, device, q dtype, shape) -> milliseconds
Measure = Callable[[AttentionBackend, torch.device, torch.dtype, "ProbeShape"], float]


@dataclasses.dataclass(frozen=True)
class ProbeShape:
    """A representative chunk for ``auto``'s start-up probe: ``segments`` sequences of
    equal length sharing ``q_tokens`` queries and ``k_tokens`` keys, ``heads`` heads.

    ``pack`` (the engine's K pack, :data:`KPack`): given when the engine's fused path packs
    no K for a backend with unpacked keys (bf16 prefill). Each candidate is then timed with
    the keys as that path would hand them over: k_nope and v as views of one
    ``kv_b_proj``-shaped buffer, and either ``k_rope=`` (head stride 0) or K packed by
    ``pack`` inside the timing — so that a backend is not chosen for an attention the pack
    it needs makes slower overall."""

    heads: int
    q_tokens: int
    k_tokens: int
    segments: int = 1
    warmup: int = 2
    iters: int = 5
    scale: float = 192**-0.5
    pack: KPack | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
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
    got: type[AttentionBackend] = getattr(importlib.import_module(mod), cls)
    return got


def requested(name: str, device: torch.device, q_dtype: torch.dtype) -> type[AttentionBackend]:
    """The class of backend ``name`` (not "auto") where it can serve ``q_dtype`` on
    ``device``; ValueError saying why not (ImportError where its module cannot load)."""
    cls = backend_class(name)
    why = cls.unavailable_reason(torch.device(device), q_dtype)
    if why is not None:
        raise ValueError(f"attention backend {name!r} is not available for {q_dtype} on {device}: {why}")
    return cls


def create(name: str, device: torch.device, q_dtype: torch.dtype,
           probe: ProbeShape | None = None) -> tuple[AttentionBackend, str]:
    """(backend, why it was chosen). ``name="auto"`` picks the first usable one, or, given
    a ``probe`` shape on a CUDA device, the one the probe finds fastest on that shape (by
    the margin ``_PROBE_MARGIN`` over the first)."""
    device = torch.device(device)
    if name != "auto":
        return requested(name, device, q_dtype)(), "requested"
    if probe is not None and device.type == "cuda":
        return _auto_by_probe(device, q_dtype, probe)
    usable, skipped = _usable(_AUTO_ORDER, device, q_dtype, first_only=True)
    if not usable:
        raise ValueError(f"no attention backend for {q_dtype} on {device}: {'; '.join(skipped)}")
    return usable[0][1](), "auto" + (f" (skipped {'; '.join(skipped)})" if skipped else "")


def _usable(candidates: tuple[str, ...], device: torch.device, q_dtype: torch.dtype,
            first_only: bool = False) -> tuple[list[tuple[str, type[AttentionBackend]]], list[str]]:
    """([(name, class)] that can serve ``q_dtype`` on ``device``, in order — only the first
    with ``first_only`` —, [why each one before it or not in it cannot])."""
    usable: list[tuple[str, type[AttentionBackend]]] = []
    skipped: list[str] = []
    for candidate in candidates:
        try:
            cls = backend_class(candidate)
        except ImportError as e:  # e.g. triton not installed
            skipped.append(f"{candidate}: {e}")
            continue
        why = cls.unavailable_reason(device, q_dtype)
        if why is None:
            usable.append((candidate, cls))
            if first_only:
                break
        else:
            skipped.append(f"{candidate}: {why}")
    return usable, skipped


def _auto_by_probe(device: torch.device, q_dtype: torch.dtype, probe: ProbeShape,
                   measure: Measure | None = None) -> tuple[AttentionBackend, str]:
    """``auto`` with a probe: the first usable candidate of ``_PROBE_FIRST`` or a usable one
    of ``_PROBE_OTHERS``, whichever is fastest on ``probe`` (another must beat the first
    by ``_PROBE_MARGIN``). ``measure`` (tests pass a stand-in): :data:`Measure`."""
    run = measure or _measure
    first, skipped = _usable(_PROBE_FIRST, device, q_dtype, first_only=True)
    others, skipped_others = _usable(_PROBE_OTHERS, device, q_dtype)
    usable, skipped = first + others, skipped + skipped_others
    if len(usable) == 1:  # nothing to compare: no probe
        name, cls = usable[0]
        return cls(), f"auto: {name}, the only candidate" + (f" (skipped {'; '.join(skipped)})" if skipped else "")
    timed: list[tuple[float, int, str, AttentionBackend]] = []  # (ms, order, name, instance)
    for i, (name, cls) in enumerate(usable):
        try:
            be = cls()
            ms = float(run(be, device, q_dtype, probe))
        except Exception as e:  # noqa: BLE001  a candidate that cannot run the probe is not chosen
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            skipped.append(f"{name}: probe failed ({msg})")
            log.warning("attention backend auto: %s failed its probe: %s", name, msg)
            continue
        timed.append((ms, i, name, be))
    if not timed:
        raise ValueError(f"no attention backend for {q_dtype} on {device}: {'; '.join(skipped)}")
    best = min(timed, key=lambda r: (r[0], r[1]))
    lead = min(timed, key=lambda r: r[1])
    kept = best is not lead and best[0] > lead[0] * (1 - _PROBE_MARGIN)
    if kept:  # not faster by the margin: keep the first candidate
        best = lead
    per_q, per_k = probe.q_tokens // probe.segments, probe.k_tokens // probe.segments
    shape = f"H={probe.heads} {probe.segments}x({per_q}q/{per_k}k)" + (
        "; K packed in the timing where a backend cannot read it unpacked" if probe.pack is not None else "")
    why = (f"auto: {', '.join(f'{n} {ms:.3f} ms' for ms, _, n, _ in timed)} -> {best[2]} ({shape}"
           + (f"; others must be {_PROBE_MARGIN:.0%} faster to replace {lead[2]})" if kept else ")")
           + (f" (skipped {'; '.join(skipped)})" if skipped else ""))
    log.info("attention backend %s", why)
    return best[3], why


def _measure(be: AttentionBackend, device: torch.device, q_dtype: torch.dtype, probe: ProbeShape) -> float:
    """Milliseconds per ``run_context_chunk`` on random data of the probe shape (CUDA events,
    after ``probe.warmup`` calls), writing into a caller-given ``out`` when supported."""
    H, S = probe.heads, probe.segments
    gen = torch.Generator(device=device).manual_seed(0)

    def split(total: int) -> tuple[torch.Tensor, int]:
        per = [total // S] * S
        per[-1] += total - sum(per)
        cu = [0]
        for n in per:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32, device=device), max(per)

    def rnd(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, device=device, dtype=torch.float32, generator=gen)
        return x.clamp(-448, 448).to(q_dtype)

    with torch.cuda.device(device):
        Tk = probe.k_tokens
        q = rnd(probe.q_tokens, H, 192)
        (cu_q, max_q), (cu_k, max_k) = split(probe.q_tokens), split(Tk)
        out = torch.empty(probe.q_tokens, H, 128, dtype=torch.bfloat16, device=device) if be.caps.supports_out \
            else None
        # the keys as the path hands them over: packed, or (probe.pack) kv_b_proj's output and the
        # workspace's k_pe — read unpacked where the backend can, else packed inside the timing
        pack = probe.pack
        if pack is None:
            k, v = rnd(Tk, H, 192), rnd(Tk, H, 128)
            k_rope = None
        else:
            kv, k_pe = rnd(Tk, H, 256), rnd(Tk, 64)
            k, v = kv[..., :128], kv[..., 128:]
            k_rope = k_pe.unsqueeze(1).expand(Tk, H, 64) if q_dtype in be.caps.unpacked_keys else None

        def run() -> None:
            if pack is not None and k_rope is None:
                be.run_context_chunk(q, pack(k, k_pe), v, cu_q, cu_k, max_q, max_k, probe.scale, out=out)
            else:
                be.run_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, probe.scale, out=out, k_rope=k_rope)
        for _ in range(probe.warmup):
            run()
        torch.cuda.synchronize(device)
        # (torch's Event is unannotated)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        t0 = time.perf_counter()
        start.record()
        for _ in range(probe.iters):
            run()
        end.record()
        end.synchronize()
        ms = float(start.elapsed_time(end)) / probe.iters
    log.debug("probe of %s: %.3f ms (%.1f s wall)", be.name, ms, time.perf_counter() - t0)
    return ms
