"""cuDNN-frontend ragged attention: one cuDNN SDPA graph per shape bucket, bf16 only.

The packed, token-major tensors of the interface — q/k ``[T, H, 192]``, v ``[T, H, 128]``,
out ``[Tq, H, 128]`` — are described to cuDNN as ``[B, H, S, D]`` tensors with strides
``(S·row, head, row, 1)`` (their own row and head strides, so v may be the tail of the
``kv_b_proj`` output) and a *ragged offset* per tensor: int64 ``[B+1, 1, 1, 1]`` element
offsets ``cu_seqlens · row_stride`` give each sequence's base. ``sdpa(use_padding_mask=True,
seq_len_q, seq_len_kv)`` takes the per-sequence lengths (int32 ``[B, 1, 1, 1]``), so the
``S`` dims are only upper bounds: one graph serves every batch whose sequences fit in its
``(B, S_q, S_kv)``. The graph is therefore cached per *bucket* — the next power of two of
B, max_q and max_k (at least 64 for the S dims, which keeps cuDNN off its special s_q == 1
path) — and a batch smaller than its B bucket is padded with empty sequences (length 0,
offset at the end; ``BUCKET_B = False`` keys on the exact B instead). A graph build costs
~1.3 s on the H200; an LRU keeps ``_MAX_GRAPHS`` of them, and a key whose build
failed is not built again (the error is raised at once).

Stats (cuDNN's natural-log LSE, fp32) are declared either

* ``packed`` (default): ``[B, H, S_q, 1]`` with strides ``(S_q·H, 1, H, 1)`` and the
  ragged offset ``cu_seqlens_q · H`` — written token-major, exactly ``[Tq, H]``; the same
  layout the frontend's own varlen op (``cudnn.sdpa.fwd.torch_op``) declares; or
* ``padded``: dense ``[B, H, S_q, 1]`` (the layout cuDNN measures fastest), which costs
  ``B·H·S_q`` floats of scratch per call.

One Triton kernel then writes our ``lse [H, Tq]`` from either layout and enforces the
the contract's empty rows exactly: a row that sees no key (its segment has no keys, or — causal —
nothing is visible yet) gets ``lse = -inf`` and ``out = 0``, whatever cuDNN left there.

Per call, with no host synchronisation (max_q / max_k are given as ints):

1. ``_prep`` (Triton): seq_len_q/kv and the five ragged-offset columns
   (q, k, v, o, stats) from ``cu_seqlens``, padded to the B bucket, in int64;
2. the cuDNN graph (``CUDNN_KERNELS`` device kernels: 2 measured on the H200 with cuDNN
   9.19, a ``qkv_tma_setup`` kernel and the SDPA kernel; checked against the profiler by
   the GPU test);
3. ``_finish`` (Triton, grid ``(cdiv(max_q, 64), B, H)``): lse from the stats, the
   empty-row fix-ups.

So ``2 + CUDNN_KERNELS`` launches (plus one copy when ``out`` is a view cuDNN cannot
address, or an input has to be copied first). The count depends on the path, so
``caps.launches_per_call`` is 0 and :meth:`run_context_chunk` notes its real count
(``ops.launches.note``), as the dense cudnn backend does. A call with no query rows
launches nothing; a call with no keys at all (max_k 0) only the fix-up kernel.

``causal=True`` uses ``diagonal_alignment=BOTTOM_RIGHT, diagonal_band_right_bound=0``
(per-sequence alignment through the padding mask); tests only.

fp8 is not supported (not in ``caps.q_dtypes``): on Hopper cuDNN's fp8 SDPA builds only with an
fp8 output, and our contract is a bf16 output.

Threads: graph builds are serialized by a lock; a built graph is immutable and is executed
with the calling thread's own cuDNN handle (cuDNN handles are not thread-safe), bound to
torch's current stream — as the frontend's own torch op does. The workspace comes from
torch's caching allocator per call (the same block is recycled, stream-ordered). Inputs
and ``out`` go to cuDNN as they are when it can address them (unit last stride, 16-byte
aligned base and row/head strides, token-major); otherwise an input is copied first, or
cuDNN writes a temporary that is then copied into ``out`` (``last_copy`` says which).

API used (nvidia-cudnn-frontend 1.32, ``cudnn/_pygraph.py`` and
``cudnn/sdpa/fwd/torch_op.py`` of the wheel): ``cudnn.pygraph(io_data_type=,
intermediate_data_type=, compute_data_type=, handle=)``, ``graph.tensor(name=, dim=,
stride=, data_type=, uid=)``, ``Tensor.set_ragged_offset``, ``graph.sdpa(q=, k=, v=,
generate_stats=True, attn_scale=, use_padding_mask=True, seq_len_q=, seq_len_kv=[,
diagonal_alignment=BOTTOM_RIGHT, diagonal_band_right_bound=0])`` returning ``[O, Stats]``,
``set_uid/set_output/set_dim/set_stride/set_data_type``, then ``validate``,
``build_operation_graph``, ``create_execution_plans([heur_mode.A, heur_mode.FALLBACK])``,
``check_support``, ``build_plans``, ``get_workspace_size``, and ``execute(buffers,
workspace, handle=, tensor_uids=)``; handles from ``cudnn.create_handle()`` and
``cudnn.set_stream(handle=, stream=)``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import threading
import time
from types import ModuleType
from typing import Any, no_type_check

import torch

from ..ops import launches
from ._triton import TRITON_ERR as _TRITON_ERR
from ._triton import tl, triton
from .base import AttentionBackend, BackendCaps, LaunchOrder, VLayout, cuda_reason, dtype_reason, hopper_reason

log = logging.getLogger("ctxprefill.backends")

D_QK, D_V = 192, 128

#: Device kernels one execution of the cuDNN SDPA graph launches (memsets not counted, as
#: everywhere in the launch metric). Measured on the H200 (cuDNN 9.19, frontend 1.32):
#: ``cudnn::fusion::qkv_tma_setup`` then ``cudnn_generated_fort_native_sdpa_sm90_flash_
#: fprop_wgmma_f16_knob_7_64x128x192``; ``test_gpu_launches_match_profiler`` checks it.
CUDNN_KERNELS = 2

#: default stats layout ("packed" or "padded"), see the module docstring
STATS_LAYOUT = "packed"

#: graphs kept (LRU); each is a built cuDNN execution plan
_MAX_GRAPHS = 32

#: pad B to its power-of-two bucket with empty sequences (False: one graph per exact B)
BUCKET_B = True

#: smallest S bucket (keeps cuDNN off the s_q == 1 decode path; 64 is its tile height)
_MIN_S_BUCKET = 64

#: grid-dimension limit of the fix-up kernel (B and H are its second and third grid dimensions)
_MAX_B = 65535

_FINISH_BLOCK_M = 64
_PREP_BLOCK = 256

# variant-pack uids (any distinct positive ints)
_UID = dict(q=1, k=2, v=3, o=4, stats=5, seq_len_q=6, seq_len_kv=7,
            ragged_q=8, ragged_k=9, ragged_v=10, ragged_o=11, ragged_stats=12)
#: order of the five offset columns written by ``_prep``
_OFFSET_COLUMNS = ("ragged_q", "ragged_k", "ragged_v", "ragged_o", "ragged_stats")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two ≥ max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def _cudnn_module() -> tuple[ModuleType | None, str]:
    """(module, "") or (None, why)."""
    try:
        import cudnn  # nvidia-cudnn-frontend
    except Exception as e:  # noqa: BLE001  ImportError, or a loader error from its extension
        return None, f"the cuDNN frontend (nvidia-cudnn-frontend) is not importable: {e!r}"
    if not hasattr(cudnn, "pygraph"):
        return None, f"cudnn {getattr(cudnn, '__version__', '?')} has no pygraph (need nvidia-cudnn-frontend >= 1.x)"
    return cudnn, ""


# ------------------------------------------------------------------------------ graph spec
@dataclasses.dataclass(frozen=True)
class GraphKey:
    """Everything a built graph depends on. Lengths are not in it: they are device data."""

    device: str
    H: int
    B: int  # bucket
    S_q: int  # bucket
    S_kv: int  # bucket
    q_stride: tuple[int, int]  # (row, head) in elements
    k_stride: tuple[int, int]
    v_stride: tuple[int, int]
    o_stride: tuple[int, int]
    scale: float
    causal: bool
    stats_layout: str


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    dim: tuple[int, ...]
    stride: tuple[int, ...]
    ragged: str | None = None  # name of the ragged-offset tensor


def graph_spec(key: GraphKey) -> dict[str, TensorSpec]:
    """The cuDNN tensor descriptions of a graph (pure; the CPU tests check it)."""
    B, H, Sq, Sk = key.B, key.H, key.S_q, key.S_kv

    def packed(S: int, D: int, st: tuple[int, int], ragged: str) -> TensorSpec:
        row, head = st
        return TensorSpec((B, H, S, D), (S * row, head, row, 1), ragged)

    spec = dict(
        q=packed(Sq, D_QK, key.q_stride, "ragged_q"),
        k=packed(Sk, D_QK, key.k_stride, "ragged_k"),
        v=packed(Sk, D_V, key.v_stride, "ragged_v"),
        o=packed(Sq, D_V, key.o_stride, "ragged_o"),
        seq_len_q=TensorSpec((B, 1, 1, 1), (1, 1, 1, 1)),
        seq_len_kv=TensorSpec((B, 1, 1, 1), (1, 1, 1, 1)),
    )
    if key.stats_layout == "packed":  # token-major [Tq, H]: element (b, h, s) at (cu_q[b] + s)·H + h
        spec["stats"] = TensorSpec((B, H, Sq, 1), (Sq * H, 1, H, 1), "ragged_stats")
    elif key.stats_layout == "padded":  # dense [B, H, S_q, 1]
        spec["stats"] = TensorSpec((B, H, Sq, 1), (H * Sq, Sq, 1, 1))
    else:
        raise ValueError(f"stats_layout must be 'packed' or 'padded', got {key.stats_layout!r}")
    for name in _OFFSET_COLUMNS:
        if name != "ragged_stats" or key.stats_layout == "packed":
            spec[name] = TensorSpec((B + 1, 1, 1, 1), (1, 1, 1, 1))
    return spec


def make_pygraph(cudnn: Any, key: GraphKey, handle: Any = None) -> tuple[Any, tuple[int, ...]]:
    """The cuDNN frontend graph of ``key``, declared but not validated or built.
    Returns ``(graph, uids)``: the variant-pack uids in the order :meth:`_execute` passes
    buffers (``_buffer_names(key)``)."""
    spec = graph_spec(key)
    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    i32, i64 = cudnn.data_type.INT32, cudnn.data_type.INT64
    g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    dtypes = dict(q=bf16, k=bf16, v=bf16, seq_len_q=i32, seq_len_kv=i32)
    t: dict[str, Any] = {}
    for name in ("q", "k", "v", "seq_len_q", "seq_len_kv", *_OFFSET_COLUMNS):
        if name not in spec:
            continue
        s = spec[name]
        t[name] = g.tensor(name=name, dim=list(s.dim), stride=list(s.stride), data_type=dtypes.get(name, i64),
                           uid=_UID[name])
    for name in ("q", "k", "v"):
        t[name].set_ragged_offset(t[f"ragged_{name}"])
    mask = {}
    if key.causal:  # bottom-right aligned, per sequence (padding mask lengths)
        mask = dict(diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0)
    o, stats = g.sdpa(name="ctx_attn", q=t["q"], k=t["k"], v=t["v"], generate_stats=True, attn_scale=float(key.scale),
                      use_padding_mask=True, seq_len_q=t["seq_len_q"], seq_len_kv=t["seq_len_kv"], **mask)
    so, ss = spec["o"], spec["stats"]
    o.set_uid(_UID["o"]).set_output(True).set_dim(list(so.dim)).set_stride(list(so.stride)).set_data_type(bf16)
    o.set_ragged_offset(t["ragged_o"])
    stats.set_uid(_UID["stats"]).set_output(True).set_dim(list(ss.dim)).set_stride(list(ss.stride)).set_data_type(f32)
    if ss.ragged:
        stats.set_ragged_offset(t["ragged_stats"])
    return g, tuple(_UID[n] for n in _buffer_names(key))


def _buffer_names(key: GraphKey) -> tuple[str, ...]:
    names = ["q", "k", "v", "o", "stats", "seq_len_q", "seq_len_kv", "ragged_q", "ragged_k", "ragged_v", "ragged_o"]
    if key.stats_layout == "packed":
        names.append("ragged_stats")
    return tuple(names)


@dataclasses.dataclass
class _Graph:
    key: GraphKey
    graph: Any  # cudnn.pygraph (or a test double)
    uids: tuple[int, ...]
    workspace_bytes: int
    build_s: float
    #: what serves it: "cudnn backend", or the name of a frontend python engine
    engine: str = ""


# ------------------------------------------------------------------------------ Triton kernels
if triton is not None:

    @triton.jit
    @no_type_check  # device code: Triton's compiler types it, not mypy
    def _prep(cu_q, cu_k, offs, lens, B, NB, P_OFF, P_LEN, sq, sk, sv, so, sst, BLOCK: tl.constexpr):
        """offs[c, i] = cu[min(i, B)]·stride_c (int64) for i ≤ NB; lens[0|1, i] = the q|k
        length of sequence i (0 for the padding sequences B ≤ i < NB). Grid: cdiv(NB+1, BLOCK)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i <= NB
        ci = tl.minimum(i, B)
        cn = tl.minimum(i + 1, B)
        cq = tl.load(cu_q + ci, mask=m, other=0).to(tl.int64)
        ck = tl.load(cu_k + ci, mask=m, other=0).to(tl.int64)
        cq1 = tl.load(cu_q + cn, mask=m, other=0).to(tl.int64)
        ck1 = tl.load(cu_k + cn, mask=m, other=0).to(tl.int64)
        tl.store(offs + i, cq * sq, mask=m)
        tl.store(offs + P_OFF + i, ck * sk, mask=m)
        tl.store(offs + 2 * P_OFF + i, ck * sv, mask=m)
        tl.store(offs + 3 * P_OFF + i, cq * so, mask=m)
        tl.store(offs + 4 * P_OFF + i, cq * sst, mask=m)
        real = i < B
        ml = i < NB
        tl.store(lens + i, tl.where(real, cq1 - cq, 0).to(tl.int32), mask=ml)
        tl.store(lens + P_LEN + i, tl.where(real, ck1 - ck, 0).to(tl.int32), mask=ml)

    @triton.jit
    @no_type_check
    def _finish(stats, lse, out, cu_q, cu_k, Tq, st_b, st_h, st_s, so_t, so_h,
                HAS_STATS: tl.constexpr, PACKED: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, DV: tl.constexpr):
        """lse[h, t] from cuDNN's stats; rows that see no key: lse = -inf, out = 0.
        Grid: (cdiv(max_q, BLOCK_M), B, H)."""
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2).to(tl.int64)
        q0 = tl.load(cu_q + b)
        q_len = tl.load(cu_q + b + 1) - q0
        k_len = tl.load(cu_k + b + 1) - tl.load(cu_k + b)
        s = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = s < q_len
        if CAUSAL:  # bottom-right: row s sees keys j <= s + k_len - q_len
            vis = tl.minimum(tl.maximum(s + 1 + k_len - q_len, 0), k_len)
        else:
            vis = tl.zeros([BLOCK_M], dtype=tl.int32) + k_len
        empty = vis <= 0
        t = (q0 + s).to(tl.int64)
        val = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        if HAS_STATS:
            if PACKED:
                src = t * st_s + h * st_h
            else:
                src = b.to(tl.int64) * st_b + h * st_h + s.to(tl.int64) * st_s
            val = tl.load(stats + src, mask=row_ok & ~empty, other=float("-inf"))
        val = tl.where(empty, float("-inf"), val)
        tl.store(lse + h * Tq + t, val, mask=row_ok)
        zero_rows = empty & row_ok
        if tl.sum(zero_rows.to(tl.int32), axis=0) > 0:
            d = tl.arange(0, DV)
            z = tl.zeros([BLOCK_M, DV], dtype=tl.float32).to(tl.bfloat16)
            tl.store(out + t[:, None] * so_t + h * so_h + d[None, :], z, mask=zero_rows[:, None])


# ------------------------------------------------------------------------------ the backend
def _addressable(t: torch.Tensor) -> bool:
    """Whether cuDNN can read/write ``t`` [T, H, D] in place: unit last stride, 16-byte
    aligned base and row/head strides (its SDPA moves 16-byte vectors), token-major
    (row stride ≥ H · head stride, heads not overlapping), as the ragged layout describes."""
    T, H, D = t.shape
    row, head, last = t.stride()
    es = t.element_size()
    if last != 1 or t.data_ptr() % 16 or (row * es) % 16 or (head * es) % 16:
        return False
    if H > 1 and head < D:
        return False
    return T <= 1 or row >= head * H


class CudnnFrontendBackend(AttentionBackend):
    """cuDNN SDPA through the cuDNN frontend's graph API, ragged (THD) layout, bf16."""

    name = "cudnn-frontend"
    # bf16 only (module docstring); launches: path-dependent, noted by the call
    caps = BackendCaps(q_dtypes=frozenset({torch.bfloat16}), supports_out=True, launches_per_call=0)

    def __init__(self, stats_layout: str | None = None, max_graphs: int = _MAX_GRAPHS):
        self.stats_layout = stats_layout or STATS_LAYOUT
        if self.stats_layout not in ("packed", "padded"):
            raise ValueError(f"stats_layout must be 'packed' or 'padded', got {self.stats_layout!r}")
        self.max_graphs = int(max_graphs)
        self._graphs: collections.OrderedDict[GraphKey, _Graph] = collections.OrderedDict()
        self._failed: dict[GraphKey, str] = {}  # keys whose build raised, and why
        self._lock = threading.Lock()
        self._tls = threading.local()
        #: graphs built by this instance, and the seconds each took (tests and the bench read them)
        self.builds = 0
        self.build_seconds: list[float] = []
        #: why the last call copied (an input or out cuDNN cannot address), "" if none
        self.last_copy = ""
        #: the graph the last call ran (None: no cuDNN call)
        self.last_graph: _Graph | None = None

    # -- selection ----------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls, device: torch.device, q_dtype: torch.dtype) -> str | None:
        device = torch.device(device)
        why = dtype_reason(cls.caps, q_dtype) or cuda_reason(cls.name, device) or hopper_reason(device)
        if why:
            return why
        if triton is None:  # the metadata and LSE kernels are Triton
            return _TRITON_ERR
        cudnn, why = _cudnn_module()
        if cudnn is None:
            return why
        try:
            ver = int(cudnn.backend_version())
        except Exception as e:  # noqa: BLE001
            return f"the cuDNN library is not loadable by the cuDNN frontend: {e!r}"
        if ver < 90000:
            return f"cuDNN {ver} is older than 9.0 (ragged SDPA needs cuDNN 9)"
        return None

    # -- graphs -------------------------------------------------------------------------
    def graphs(self) -> list[GraphKey]:
        """Keys of the cached graphs, least recently used first."""
        with self._lock:
            return list(self._graphs)

    def _handle(self, device: torch.device) -> Any:
        """This thread's cuDNN handle for ``device``, bound to torch's current stream."""
        cudnn, why = _cudnn_module()
        if cudnn is None:
            raise RuntimeError(why)
        handles = getattr(self._tls, "handles", None)
        if handles is None:
            handles = self._tls.handles = {}
        h = handles.get(device)
        if h is None:
            with torch.cuda.device(device):
                h = handles[device] = cudnn.create_handle()
        cudnn.set_stream(handle=h, stream=torch.cuda.current_stream(device).cuda_stream)
        return h

    def _build(self, key: GraphKey, device: torch.device) -> _Graph:
        """Declare, validate and build the graph of ``key`` (~1.3 s on the H200)."""
        cudnn, why = _cudnn_module()
        if cudnn is None:
            raise RuntimeError(why)
        t0 = time.perf_counter()
        with torch.cuda.device(device):
            g, uids = make_pygraph(cudnn, key, self._handle(device))
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
            ws = int(g.get_workspace_size())
            eng = getattr(g, "selected_engine", None)  # None: the cuDNN backend's own plan
        return _Graph(key, g, uids, ws, time.perf_counter() - t0, "cudnn backend" if eng is None else eng.name)

    def _graph(self, key: GraphKey, device: torch.device) -> _Graph:
        with self._lock:
            hit = self._graphs.get(key)
            if hit is not None:
                self._graphs.move_to_end(key)
                return hit
            if key in self._failed:  # do not pay a failing build again
                raise RuntimeError(f"cudnn-frontend: no graph for {key}: {self._failed[key]}")
            try:
                entry = self._build(key, device)  # under the lock: one build at a time
            except torch.OutOfMemoryError:
                raise
            except Exception as e:
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"
                self._failed[key] = msg
                log.warning("attention backend cudnn-frontend: building the graph for %s failed: %s", key, msg)
                raise
            self.builds += 1
            self.build_seconds.append(entry.build_s)
            log.info("attention backend cudnn-frontend: built graph %s in %.2f s (%s)", key, entry.build_s,
                     entry.engine)
            self._graphs[key] = entry
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
            return entry

    def _execute(self, entry: _Graph, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
        """Run a built graph on the current stream (the tests replace this on the CPU)."""
        handle = self._handle(device)
        workspace = torch.empty(max(entry.workspace_bytes, 1), dtype=torch.uint8, device=device)
        entry.graph.execute([buffers[n] for n in _buffer_names(entry.key)], workspace, handle=handle,
                            tensor_uids=entry.uids)

    # -- the call -------------------------------------------------------------------------
    @staticmethod
    def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               out: torch.Tensor | None) -> None:
        if q.dtype != torch.bfloat16 or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"cudnn-frontend: q/k/v must be bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError("cudnn-frontend: q, k, v must be [T, H, D]")
        Tq, H = q.shape[0], q.shape[1]
        Tk = k.shape[0]
        if q.shape[2] != D_QK or tuple(k.shape) != (Tk, H, D_QK) or tuple(v.shape) != (Tk, H, D_V):
            raise ValueError(f"cudnn-frontend: expected q [Tq,H,{D_QK}], k [Tk,H,{D_QK}], v [Tk,H,{D_V}]; got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        for name, t in (("k", k), ("v", v)):
            if t.device != q.device:
                raise ValueError(f"cudnn-frontend: {name} is on {t.device}, q on {q.device}")
        for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous() or t.device != q.device:
                raise ValueError(f"cudnn-frontend: {name} must be a contiguous 1-D int32 tensor on {q.device}; "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}")
        B = cu_q.numel() - 1
        if B < 0 or cu_k.numel() != B + 1 or B > _MAX_B:
            raise ValueError(f"cudnn-frontend: cu_seqlens_q and cu_seqlens_k must both have B+1 entries, "
                             f"0 <= B <= {_MAX_B}; got {cu_q.numel()} and {cu_k.numel()}")
        if out is not None and (tuple(out.shape) != (Tq, H, D_V) or out.dtype != torch.bfloat16
                                or out.stride(-1) != 1 or out.device != q.device):
            raise ValueError(f"cudnn-frontend: out must be bf16 [{Tq},{H},{D_V}] with unit last stride on "
                             f"{q.device}; got {out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")

    def run_context_chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_q: int,
        max_k: int,
        scale: float,
        *,
        out: torch.Tensor | None = None,
        causal: bool = False,
        k_rope: torch.Tensor | None = None,
        v_layout: VLayout = "thd",
        cu_seqlens_v: torch.Tensor | None = None,
        launch_order: LaunchOrder | None = None,
        captured: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.refuse_outside_caps(q.dtype, k_rope, v_layout, cu_seqlens_v, launch_order, captured)
        self._check(q, k, v, cu_seqlens_q, cu_seqlens_k, out)
        if q.device.type != "cuda" and not _interpreting():
            raise RuntimeError("cudnn-frontend runs CUDA tensors (CPU tensors only in the tests, under "
                               "TRITON_INTERPRET=1 with a stand-in for cuDNN)")
        if triton is None:
            raise RuntimeError(_TRITON_ERR)
        ctx = torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext()
        with ctx:
            return self._run(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_q), int(max_k), float(scale), out,
                             bool(causal))

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
             max_q: int, max_k: int, scale: float, out: torch.Tensor | None,
             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        dev = q.device
        Tq, H = q.shape[0], q.shape[1]
        B = cu_q.numel() - 1
        n = 0
        self.last_copy = ""
        self.last_graph = None
        lse = torch.empty((H, Tq), dtype=torch.float32, device=dev)
        o = out
        if o is None:
            o = torch.empty((Tq, H, D_V), dtype=torch.bfloat16, device=dev)
        if Tq == 0 or H == 0 or B == 0 or max_q <= 0:
            return o, lse  # nothing to compute: no launch
        target = o
        copies = []
        if not _addressable(o):
            target = torch.empty((Tq, H, D_V), dtype=torch.bfloat16, device=dev)
            copies.append("out")
        run_cudnn = max_k > 0 and k.shape[0] > 0
        stats = None
        st_b = st_h = st_s = 0
        packed = self.stats_layout == "packed"
        if run_cudnn:
            ins = []
            for name, t in (("q", q), ("k", k), ("v", v)):
                if not _addressable(t):
                    t = t.clone(memory_format=torch.contiguous_format)  # fresh, aligned, packed
                    n += 1
                    copies.append(name)
                ins.append(t)
            q_, k_, v_ = ins
            NB = bucket(B) if BUCKET_B else B
            key = GraphKey(device=str(dev), H=H, B=NB, S_q=bucket(max_q, _MIN_S_BUCKET),
                           S_kv=bucket(max_k, _MIN_S_BUCKET), q_stride=(q_.stride(0), q_.stride(1)),
                           k_stride=(k_.stride(0), k_.stride(1)), v_stride=(v_.stride(0), v_.stride(1)),
                           o_stride=(target.stride(0), target.stride(1)), scale=scale, causal=causal,
                           stats_layout=self.stats_layout)
            entry = self.last_graph = self._graph(key, dev)
            # metadata: 5 int64 offset columns of NB+1, 2 int32 length columns of NB; 16-byte aligned columns
            p_off = (NB + 2) // 2 * 2
            p_len = (NB + 3) // 4 * 4
            offs = torch.empty((5, p_off), dtype=torch.int64, device=dev)
            lens = torch.empty((2, p_len), dtype=torch.int32, device=dev)
            _prep[(triton.cdiv(NB + 1, _PREP_BLOCK),)](cu_q, cu_k, offs, lens, B, NB, p_off, p_len, q_.stride(0),
                                                       k_.stride(0), v_.stride(0), target.stride(0), H,
                                                       BLOCK=_PREP_BLOCK)
            n += 1
            if packed:
                stats = torch.empty((Tq, H), dtype=torch.float32, device=dev)
                st_h, st_s = 1, H
            else:
                stats = torch.empty((NB, H, key.S_q), dtype=torch.float32, device=dev)
                st_b, st_h, st_s = H * key.S_q, key.S_q, 1
            bufs = dict(q=q_, k=k_, v=v_, o=target, stats=stats,
                        seq_len_q=lens[0, :NB].view(NB, 1, 1, 1), seq_len_kv=lens[1, :NB].view(NB, 1, 1, 1))
            for i, name in enumerate(_OFFSET_COLUMNS):
                if name != "ragged_stats" or packed:
                    bufs[name] = offs[i, : NB + 1].view(NB + 1, 1, 1, 1)
            self._execute(entry, bufs, dev)
            n += CUDNN_KERNELS
        grid = (triton.cdiv(max_q, _FINISH_BLOCK_M), B, H)
        _finish[grid](stats if stats is not None else lse, lse, target, cu_q, cu_k, Tq, st_b, st_h, st_s,
                      target.stride(0), target.stride(1), HAS_STATS=stats is not None, PACKED=packed,
                      CAUSAL=causal, BLOCK_M=_FINISH_BLOCK_M, DV=D_V)
        n += 1
        if target is not o:
            o.copy_(target)
            n += 1
        self.last_copy = ",".join(copies)
        launches.note(n)
        return o, lse

