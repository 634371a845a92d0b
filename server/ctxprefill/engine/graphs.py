"""The chunk loop replayed as a CUDA graph, per request shape (``--cuda-graphs``).

A 16-head request's Python issues its ~27 launches about as fast as the device runs
them, so the device waits on the host inside the loop; a graph replays the same kernels
with the same arguments in one launch (the same bits, tested: tests/gpu/test_graphs_gpu.py).
The host still checks every request and makes its chunk metadata (remembered per shape),
and copies the metadata (and the layer's weight, where another layer's is in) into the
graph's buffers. q, the output and LSE stay where they are: the kernel arguments that
point into the captured q, out and LSE buffers (raw addresses and TMA descriptors) are
found once at capture and pointed at the request's tensors before each launch
(csrc/graph_patch.h), a copy in of 50 MB and out of 34 MB saved at 128 heads. A capture
checks this once (and waits for it: the capturing request's host work does not overlap
its device work): a replay in place, with the captured q overwritten by NaN, must give
the eager loop's bits, else the shape's replays copy q in and out and LSE out of the
graph's buffers (as they do for a q that is strided or not 256-byte aligned).
A capture can put the merges on a branch of their own (``LoopGraphs.merges_beside``, off:
docs/DESIGN.md has the measurements): each chunk's merge then follows its attention
beside the next chunk's gather and GEMM, which do not read what it writes, and the next
attention waits for it; the same kernels on the same inputs, so the same bits (tested).
A capture tells attention it is captured (``LoopGraphs.graph_variants``, on), and a backend
whose caps have ``graph_variants`` may take a variant that costs the host more per launch
and the device less (the Gluon kernel's launch-made descriptors): the same bits (tested).
Where the CUDA extension is loaded, a replay is two calls into it — the arguments
redirected, the copies in, the stage's start event and the graph's launch; the copies out
(if any) and the stage's end event —
since each of torch's calls (copy, event record, replay) dispatches and checks on the host,
microseconds a replay.

A shape is what the captured launches bake in: the path, q's shape and dtype, the
weight's, the query lengths, and the metadata's layout (chunk sizes, context lengths,
where each vector lies in the upload: :meth:`HostMetadata.layout`). Block ids, context
starts, q, the weight and the cache's contents are values in device buffers, refilled
per request: the engine's layers are one cache allocation, addressed by block ids offset
by the layer, so one graph serves every layer (the layers of a model's step share its
shape). A shape is captured the second time it comes (the first ran eagerly and warmed
every kernel), after that request's loop is queued; at most ``max_graphs`` are kept,
the least recently used dropped, and all of them, with their memory pool, when a request
runs out of memory (:meth:`LoopGraphs.clear`). A replay has no per-stage times: its stats carry one
stage, ``graph``, the replay's device time (with the copies of out and LSE out of the
graph's buffers, where it makes them; the copies in come before it, as the eager loop's
uploads come before its first stage). Requests that want more (an observer, a
traced timeline) or that could stop part way (a stop signal over more than
``STOP_AHEAD`` chunks: a replay runs to its end) run eagerly.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from ..backends.base import AttentionBackend, LaunchOrder
from ..ops import _cuda
from .loop import (
    STOP_AHEAD,
    HostMetadata,
    LoopInputs,
    PendingLoop,
    Upload,
    device_metadata,
    host_metadata_of,
    launch_orders,
    start_chunk_loop,
    upload_metadata,
    use_unpacked_keys,
)
from .plan import ContextChunk
from .request import StopSignal
from .timing import StageTimer

log = logging.getLogger("ctxprefill.engine")

#: shapes counted before their second request, at most (the oldest forgotten first)
MAX_SEEN = 4096
GRAPH_STAGE = "graph"
#: a request's q, out and LSE are read and written in place where their addresses keep
#: the captured buffers' alignment to this (the kernels were specialized for it;
#: GraphPatch.apply, csrc/graph_patch.cu, refuses any other)
IN_PLACE_ALIGN = 256


@dataclasses.dataclass
class CapturedLoop:
    """One shape's loop as a graph, over its static buffers."""

    graph: torch.cuda.CUDAGraph
    q: torch.Tensor  # [Tq, H, 192]: the request's q is copied here (a replay that copies)
    meta: torch.Tensor  # int32 [n]: the chunk metadata and block table (HostMetadata.host)
    staging: torch.Tensor  # int32 [n], page-locked: meta's source
    staged: torch.cuda.Event  # the last copy out of staging is done
    out: torch.Tensor  # [Tq, H, V] bf16, written by the replay
    lse: torch.Tensor  # [H, Tq] float32
    launches: Counter[str]  # the captured loop's kernel launches by stage
    unpacked_keys: bool
    orders: list[LaunchOrder | None]  # kept alive: the replay reads them
    stream: torch.cuda.Stream  # the engine's, where the replays run
    copies: Any  # the CUDA extension's copies_async, or None: torch's copy_
    weight: torch.Tensor | None  # [N, L]: the request's layer's kv_b_proj weight is copied here (shared graphs)
    holds: int = 0  # data_ptr of the layer weight ``weight`` holds a copy of (weights never change)
    launch: Any = None  # the CUDA extension's graph_launch where it and the graph's exec handle are at hand
    reader: StageTimer | None = None  # the last replay's timer: once it has finished, staging is free
    patch: Any = None  # the extension's GraphPatch over (q, out, lse) where found (a kept graph)
    copies_because: str = "not checked"  # why replays copy q in and out and LSE out ("": in place)
    launch_in_place: Any = None  # patch.launch

    def __post_init__(self) -> None:
        self._staging = self.staging.numpy()
        self._stream = self.stream.cuda_stream
        self._meta_copy = [self.meta.data_ptr(), self.staging.data_ptr(), self.meta.nbytes]
        raw_exec = getattr(self.graph, "raw_cuda_graph_exec", None)  # absent from older torch releases
        # the copies out are raw byte copies into tensors made like out and LSE: dense ones
        raw_ok = self.launch is not None and self.copies is not None and self.out.is_contiguous() \
            and self.lse.is_contiguous()
        self._exec = raw_exec() if raw_ok and raw_exec else 0
        self.captured: list[int] = []  # the patch's buffers: the graph's q, out and LSE
        if self.patch is not None:
            self.captured = [self.q.data_ptr(), self.out.data_ptr(), self.lse.data_ptr()]
            self.launch_in_place = self.patch.launch

    def _stage(self, hm: Upload, weight: torch.Tensor) -> bool:
        """Write a request's metadata into staging once the copy out of it before is done;
        whether the layer's weight goes in too (another layer's is in the buffer: a 32 MB
        copy at 128 heads; :attr:`holds` is set once its copy is queued)."""
        if self.reader is None or self.reader.last is not None:  # no replay before, or one not finished
            self.staged.synchronize()
        hm.fill(self._staging)
        return self.weight is not None and weight.data_ptr() != self.holds

    def _copy_args_for(self, q: torch.Tensor | None, weight: torch.Tensor, new_weight: bool) -> list[int]:
        """copies_async's (dst, src, bytes) triples: the metadata, q (None: read in place),
        the layer's weight where it is new."""
        args = self._meta_copy if q is None else [*self._meta_copy, self.q.data_ptr(), q.data_ptr(), self.q.nbytes]
        if new_weight:
            assert self.weight is not None
            return [*args, self.weight.data_ptr(), weight.data_ptr(), self.weight.nbytes]
        return args

    @property
    def in_place(self) -> bool:
        """Replays read q and write out and LSE in place (the capture's check passed)."""
        return not self.copies_because

    def takes_in_place(self, q: torch.Tensor) -> bool:
        """Whether a replay for ``q`` reads it (and writes out and LSE) in place."""
        return self.in_place and bool(self._exec) and q.is_contiguous() and q.data_ptr() % IN_PLACE_ALIGN == 0

    def restore(self) -> None:
        """The kernels' arguments back on the graph's own q, out and LSE (a replay that copies)."""
        if self.patch is not None:
            self.patch.apply(self.captured)

    def load(self, hm: Upload, q: torch.Tensor, weight: torch.Tensor) -> None:
        """Copy a request's metadata, q (and its layer's weight, where the graph serves every
        layer) into the graph's buffers: the request's first device work (queued, the host
        does not wait)."""
        new_weight = self._stage(hm, weight)
        self.restore()
        if self.copies is not None and q.is_contiguous():
            # every copy in one call (torch's copy_ dispatches and checks each), staging's event after them
            self.copies(self._copy_args_for(q, weight, new_weight), self._stream, self.staged.cuda_event)
        else:
            self.meta.copy_(self.staging, non_blocking=True)
            self.staged.record(self.stream)
            self.q.copy_(q, non_blocking=True)
            if new_weight:
                assert self.weight is not None
                self.weight.copy_(weight, non_blocking=True)
        if new_weight:
            self.holds = weight.data_ptr()

    def replay(self, hm: Upload, q: torch.Tensor, weight: torch.Tensor) -> PendingLoop:
        """Queue a request's replay: its copies in, the graph, the copies of out and LSE out
        of the graph's buffers where it does not write them in place (the ``graph`` stage,
        timed). Raises RuntimeError where redirecting the arguments failed (the graph's
        arguments are then unknown: the caller drops it)."""
        timer = StageTimer(self.q.device, self.stream)
        in_place = self.takes_in_place(q)
        if self._exec and q.is_contiguous():
            # the copies in, the stage's start and the graph's launch in one call, the copies
            # out and the stage's end in another: torch's replay would also refill its
            # random-number seeds (two kernels) for a loop that draws none
            new_weight = self._stage(hm, weight)
            out, lse = torch.empty_like(self.out), torch.empty_like(self.lse)
            started, begin = timer.begin_recorded_by_caller(GRAPH_STAGE)
            if in_place:
                self.launch_in_place([q.data_ptr(), out.data_ptr(), lse.data_ptr()],
                                     self._copy_args_for(None, weight, new_weight), self.staged.cuda_event, begin,
                                     self._exec, self._stream)
                back = []
            else:
                self.restore()
                self.launch(self._copy_args_for(q, weight, new_weight), self.staged.cuda_event, begin, self._exec,
                            self._stream)
                back = [out.data_ptr(), self.out.data_ptr(), out.nbytes, lse.data_ptr(), self.lse.data_ptr(),
                        lse.nbytes]
            if new_weight:
                self.holds = weight.data_ptr()
            self.copies(back, self._stream, timer.end_recorded_by_caller(started))
        else:
            self.load(hm, q, weight)
            started = timer.begin(GRAPH_STAGE)
            self.graph.replay()
            out, lse = self.out.clone(), self.lse.clone()  # the next replay writes into self.out, self.lse
            timer.end(started)  # the stage holds the copies out: its work, as its launch count says
        self.reader = timer
        counts = Counter(self.launches)
        if not in_place:
            counts[GRAPH_STAGE] += 2  # the two copies out
        return PendingLoop(out, lse, counts, timer, self.unpacked_keys, "in_place" if in_place else "copying")

    def check_in_place(self, q: torch.Tensor, want: PendingLoop) -> str:
        """Turn in-place replays on where one, for ``q`` (the capturing request's, whose
        metadata and weight the graph's buffers hold) with the graph's own q overwritten by
        NaN, gives ``want`` (that request's eager loop) bit for bit; "" then, else why not.
        The arguments go back on the graph's buffers either way. (Called where a patch was found.)"""
        assert self.patch is not None
        if not self._exec:
            return "no exec handle"
        found = list(self.patch.counts)
        if not all(found):
            return f"arguments found per buffer (q, out, lse): {found}"
        if not (q.is_contiguous() and q.data_ptr() % IN_PLACE_ALIGN == 0):
            return "the capturing request's q is strided or unaligned"
        self.q.view(torch.uint8).fill_(0xFF)  # NaN in bf16 and e4m3fn: a read of the graph's q shows
        out, lse = torch.empty_like(self.out), torch.empty_like(self.lse)
        begin = torch.cuda.Event()  # type: ignore[no-untyped-call]
        begin.record(self.stream)  # torch makes the cudaEvent_t at the first record
        try:
            self.launch_in_place([q.data_ptr(), out.data_ptr(), lse.data_ptr()], [], self.staged.cuda_event,
                                 begin.cuda_event, self._exec, self._stream)
        except RuntimeError as e:  # the driver refused a redirection: replays copy (a restore that fails raises)
            self.restore()
            self.patch = self.launch_in_place = None
            return str(e).splitlines()[0][:200]
        self.restore()
        self.stream.synchronize()
        same = torch.equal(out.view(torch.int16), want.out.view(torch.int16)) and \
            torch.equal(lse.view(torch.int32), want.lse.view(torch.int32))
        return "" if same else "an in-place replay differed from the eager loop"


def _remember(shapes: collections.OrderedDict[Hashable, Any], key: Hashable, value: Any) -> None:
    """``shapes[key] = value`` as its newest entry; past ``MAX_SEEN`` the oldest are forgotten."""
    shapes.pop(key, None)
    shapes[key] = value
    while len(shapes) > MAX_SEEN:
        shapes.popitem(last=False)


def _extension_calls() -> tuple[Any, Any, Any]:
    """The CUDA extension's (copies_async, graph_launch, GraphPatch) where it is loaded and
    has them, else None each."""
    ext = _cuda.load()
    return getattr(ext, "copies_async", None), getattr(ext, "graph_launch", None), getattr(ext, "GraphPatch", None)


def _new_graph() -> tuple[torch.cuda.CUDAGraph, bool]:
    """(a graph, whether it keeps its cudaGraph_t: GraphPatch reads its nodes; it is then
    instantiated by the caller after the capture), where torch offers that."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:  # an older torch: no kept graph, no patch
        return torch.cuda.CUDAGraph(), False


def _find_patch(graph: torch.cuda.CUDAGraph, kept: bool, patch_type: Any, q: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor) -> tuple[Any, str]:
    """(the extension's GraphPatch over ``graph``'s kernel arguments into q, out and LSE,
    "") or (None, why the graph cannot be patched); ``kept``: the graph kept its
    cudaGraph_t; ``patch_type``: the extension's GraphPatch where its graph_launch is at hand."""
    if patch_type is None:
        return None, "the CUDA extension has no GraphPatch"
    if not kept:
        return None, "torch keeps no cudaGraph_t (CUDAGraph(keep_graph=True))"
    try:
        return patch_type(graph.raw_cuda_graph(), graph.raw_cuda_graph_exec(),
                          [q.data_ptr(), q.nbytes, out.data_ptr(), out.nbytes, lse.data_ptr(), lse.nbytes]), ""
    except (RuntimeError, ValueError) as e:
        return None, str(e).splitlines()[0][:200]


class LoopGraphs:
    """The captured loops of one engine (one device, one stream: the engine's lock held).

    ``cache``: every layer's cache as one allocation (layer i's block b is its block
    ``i * blocks_per_layer + b``), where the engine has one: then a shape's graph serves
    every layer — it reads the whole cache through block ids offset by the request's
    layer, and the layer's weight is copied into it — and the graphs share one memory
    pool (their replays never overlap, and each replay's output is written to tensors of
    its own or copied out before the next). Without it each layer's shape is its own graph."""

    def __init__(self, cache: torch.Tensor | None = None, blocks_per_layer: int = 0, max_graphs: int = 8):
        self.cache, self.blocks_per_layer = cache, blocks_per_layer
        self.max_graphs = max_graphs
        self._graphs: collections.OrderedDict[Hashable, CapturedLoop] = collections.OrderedDict()
        self._seen: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        # shapes not captured: for good, or until clear (their capture ran out of memory);
        # each at most MAX_SEEN, the oldest forgotten first (a shape forgotten may be tried again)
        self._failed: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._short_of_memory: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._pool: Any = None  # the graphs' shared memory pool (torch.cuda.graph_pool_handle)
        # every capture on this one stream: torch's allocator reuses a freed block only on the
        # stream that allocated it, so a capture on a stream of its own would keep the pool's
        # blocks of every earlier capture and add its own (as torch.cuda.graph shares one)
        self._capture_stream: torch.cuda.Stream | None = None
        # a capture's merges on a branch of their own, beside the next chunk's gather and
        # GEMM, rather than in line after each attention: off, as measured (docs/DESIGN.md;
        # ctxprefill bench --merges-ab times both)
        self.merges_beside = False
        self._merge_stream: torch.cuda.Stream | None = None
        # attention told it is captured (caps.graph_variants: the Gluon kernel's launch-made
        # descriptors, which cost the host per launch and the device less; ctxprefill bench
        # --graph-variants-ab times both)
        self.graph_variants = True
        self.replays = 0
        self.captures = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        """Whether shape ``key`` has a captured loop."""
        return key in self._graphs

    @staticmethod
    def eligible(timeline: bool, stop: StopSignal | None, chunks: int) -> bool:
        """Whether a request may run as a replay: no timeline, and no stop signal over
        more chunks than the eager loop queues at once anyway."""
        return not timeline and (stop is None or chunks <= STOP_AHEAD)

    def shape(self, layer: int, fused: bool, unpacked_keys: bool, q: torch.Tensor, weight: torch.Tensor,
              query_lens: Sequence[int], chunks: Sequence[ContextChunk], block_table: np.ndarray,
              keys_last: bool) -> tuple[Hashable, HostMetadata]:
        """(a request's shape: what its captured loop bakes in, the request's metadata).
        ``layer``: its position among the engine's layers; ``weight``: that layer's."""
        offset = 0
        if self.cache is None:
            where: tuple[object, ...] = (layer,)
        else:  # the whole cache, addressed by block ids offset by the layer
            where = (weight.shape, weight.dtype)
            offset = layer * self.blocks_per_layer
        hm = host_metadata_of(query_lens, chunks, block_table, keys_last, offset)
        return (*where, fused, unpacked_keys, q.shape, q.dtype, *hm.layout()), hm

    def replay(self, key: Hashable, hm: Upload, q: torch.Tensor, weight: torch.Tensor,
               stop: StopSignal | None, chunks: int) -> PendingLoop | None:
        """Queue the replay of shape ``key``'s graph for a request (``q`` on the device,
        ``weight``: its layer's), or None where the shape has none."""
        cap = self._graphs.get(key)
        if cap is None:
            return None
        self._graphs.move_to_end(key)
        if stop is not None:
            stop.check(0, chunks)
        try:
            pending = cap.replay(hm, q, weight)
        except RuntimeError as e:  # its arguments half redirected: the shape runs eagerly from now on
            if not str(e).startswith("graph_patch:"):
                raise
            self._forget(key)
            _remember(self._failed, key, None)
            log.warning("captured loop dropped (%s); the shape runs eagerly", str(e).splitlines()[0][:200])
            return None
        self.replays += 1
        return pending

    def clear(self) -> int:
        """Drop every graph and the shared pool (torch frees a pool once no graph holds it:
        the allocator's next ``empty_cache`` gives its memory back); how many were dropped.
        Shapes are captured again from their second request on, those whose capture ran
        out of memory included."""
        dropped = len(self._graphs)
        for key in list(self._graphs):
            self._forget(key)
        self._seen.clear()
        self._short_of_memory.clear()
        self._pool = None
        return dropped

    def _not_captured(self, key: Hashable, e: Exception) -> None:
        """Shape ``key``'s capture raised ``e``: the shape runs eagerly, for good, or, where
        the graph found no memory, until the graphs give theirs back (:meth:`clear`)."""
        oom = isinstance(e, torch.OutOfMemoryError)
        _remember(self._short_of_memory if oom else self._failed, key, None)
        log.warning("chunk loop not kept as a CUDA graph (%s: %s); the shape runs eagerly%s",
                    type(e).__name__, str(e).splitlines()[0][:200],
                    " until the graphs release their memory" if oom else "")

    def _forget(self, key: Hashable) -> None:
        """Drop shape ``key``'s graph."""
        dropped = self._graphs.pop(key)
        dropped.staged.synchronize()  # its page-locked staging goes back to torch's pool: not while read

    def start_eager(self, x: LoopInputs, backend: AttentionBackend, fused: bool, key: Hashable,
                    hm: HostMetadata) -> PendingLoop:
        """Queue ``x``'s loop eagerly, its shape ``key`` having no graph (:meth:`replay`
        returned None), and capture the shape the second time it comes."""
        seen = self._seen.get(key, 0) + 1
        _remember(self._seen, key, seen)
        if self.cache is not None:  # hm's block ids address the whole cache
            x = dataclasses.replace(x, cache=self.cache)
        pending = start_chunk_loop(x, backend, fused, metadata=upload_metadata(hm, x.q.device))
        if seen >= 2 and key not in self._failed and key not in self._short_of_memory:
            try:
                self._capture(key, x, hm, backend, fused, pending)
            except Exception as e:  # noqa: BLE001 - a graph is a cache: its request runs eagerly all the same
                self._not_captured(key, e)
        return pending

    def _capture(self, key: Hashable, x: LoopInputs, hm: HostMetadata, backend: AttentionBackend,
                 fused: bool, eager: PendingLoop) -> None:
        """Capture ``x``'s loop as shape ``key``'s graph; ``eager``: the same request's
        eager loop, which an in-place replay must equal (:meth:`CapturedLoop.check_in_place`).
        Raises what stopped it (a kernel that cannot be captured, no memory for the graph's
        buffers or pool, arguments that could not be pointed back): no graph is kept."""
        staging = torch.from_numpy(hm.host).pin_memory()
        meta = torch.empty(hm.size, dtype=torch.int32, device=x.q.device)
        meta.copy_(staging, non_blocking=True)
        staged = torch.cuda.Event()  # type: ignore[no-untyped-call]  # (torch's is unannotated)
        staged.record()
        orders = launch_orders(backend, x)
        q = x.q.clone()
        weight = x.weight.clone() if self.cache is not None else None
        xs = dataclasses.replace(x, q=q, stop=None, weight=x.weight if weight is None else weight)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, kept = _new_graph()
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(x.q.device)  # type: ignore[no-untyped-call]
        stream = self._capture_stream
        if self.merges_beside and self._merge_stream is None:
            self._merge_stream = torch.cuda.Stream(x.q.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(x.q.device))
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    looped = start_chunk_loop(xs, backend, fused, metadata=device_metadata(hm, meta),
                                              launch_orders=orders, timed=False,
                                              merge_stream=self._merge_stream if self.merges_beside else None,
                                              captured=self.graph_variants)
                finally:
                    graph.capture_end()
            if kept:
                graph.instantiate()
        finally:
            torch.cuda.current_stream(x.q.device).wait_stream(stream)
        copies, launch, patch_type = _extension_calls()
        patch, why = _find_patch(graph, kept, patch_type if launch is not None else None, q, looped.out, looped.lse)
        cap = CapturedLoop(graph, q, meta, staging, staged, looped.out, looped.lse, looped.counts,
                           use_unpacked_keys(backend, fused, x.unpacked_keys, x.fp8_prefill), orders,
                           torch.cuda.current_stream(x.q.device), copies, weight,
                           x.weight.data_ptr() if weight is not None else 0, launch, patch=patch)
        cap.copies_because = cap.check_in_place(x.q, eager) if patch is not None else why
        if cap.copies_because:
            log.info("captured loop replays through its own q, out and LSE (%s)", cap.copies_because)
        self._graphs[key] = cap
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._forget(next(iter(self._graphs)))  # the least recently used
