"""The chunk loop replayed as a CUDA graph, per request shape (``--cuda-graphs``).

A 16-head request's Python issues its ~27 launches about as fast as the device runs
them, so the device waits on the host inside the loop; a graph replays the same kernels
with the same arguments in one launch (the same bits, tested: tests/gpu/test_graphs_gpu.py).
The host still checks every request and makes its chunk metadata (remembered per shape),
and copies the metadata, q and the layer's weight into the graph's buffers; after the
replay the output and LSE are copied out of them (the next replay overwrites them).
Where the CUDA extension is loaded, a replay is two calls into it — the copies in, the
stage's start event and the graph's launch; the copies out and the stage's end event —
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
the least recently used dropped. A replay has no per-stage times: its stats carry one
stage, ``graph``, the replay's device time with the copies of out and LSE out of the
graph's buffers (the copies in come before it, as the eager loop's uploads come before
its first stage). Requests that want more (an observer, a
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


@dataclasses.dataclass
class CapturedLoop:
    """One shape's loop as a graph, over its static buffers."""

    graph: torch.cuda.CUDAGraph
    q: torch.Tensor  # [Tq, H, 192]: the request's q is copied here
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

    def __post_init__(self) -> None:
        self._staging = self.staging.numpy()
        self._stream = self.stream.cuda_stream
        # copies_async's (dst, src, bytes) triples: the metadata, q, the weight (their sources per request)
        self._copy_args = [self.meta.data_ptr(), self.staging.data_ptr(), self.meta.nbytes,
                           self.q.data_ptr(), 0, self.q.nbytes]
        if self.weight is not None:
            self._copy_args += [self.weight.data_ptr(), 0, self.weight.nbytes]
        raw_exec = getattr(self.graph, "raw_cuda_graph_exec", None)  # absent from older torch releases
        # the copies out are raw byte copies into tensors made like out and LSE: dense ones
        raw_ok = self.launch is not None and self.copies is not None and self.out.is_contiguous() \
            and self.lse.is_contiguous()
        self._exec = raw_exec() if raw_ok and raw_exec else 0

    def _stage(self, hm: Upload, weight: torch.Tensor) -> bool:
        """Write a request's metadata into staging once the copy out of it before is done;
        whether the layer's weight goes in too (another layer's is in the buffer: a 32 MB
        copy at 128 heads; :attr:`holds` is set once its copy is queued)."""
        if self.reader is None or self.reader.last is not None:  # no replay before, or one not finished
            self.staged.synchronize()
        hm.fill(self._staging)
        return self.weight is not None and weight.data_ptr() != self.holds

    def _copy_args_for(self, q: torch.Tensor, weight: torch.Tensor, new_weight: bool) -> list[int]:
        args = self._copy_args
        args[4] = q.data_ptr()
        if new_weight:
            args[7] = weight.data_ptr()
            return args
        return args[:6]

    def load(self, hm: Upload, q: torch.Tensor, weight: torch.Tensor) -> None:
        """Copy a request's metadata, q (and its layer's weight, where the graph serves every
        layer) into the graph's buffers: the request's first device work (queued, the host
        does not wait)."""
        new_weight = self._stage(hm, weight)
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
        of the graph's buffers (the ``graph`` stage, timed)."""
        timer = StageTimer(self.q.device, self.stream)
        if self._exec and q.is_contiguous():
            # the copies in, the stage's start and the graph's launch in one call, the copies
            # out and the stage's end in another: torch's replay would also refill its
            # random-number seeds (two kernels) for a loop that draws none
            new_weight = self._stage(hm, weight)
            started, begin = timer.begin_recorded_by_caller(GRAPH_STAGE)
            self.launch(self._copy_args_for(q, weight, new_weight), self.staged.cuda_event, begin, self._exec,
                        self._stream)
            if new_weight:
                self.holds = weight.data_ptr()
            out, lse = torch.empty_like(self.out), torch.empty_like(self.lse)
            self.copies([out.data_ptr(), self.out.data_ptr(), out.nbytes, lse.data_ptr(), self.lse.data_ptr(),
                         lse.nbytes], self._stream, timer.end_recorded_by_caller(started))
        else:
            self.load(hm, q, weight)
            started = timer.begin(GRAPH_STAGE)
            self.graph.replay()
            out, lse = self.out.clone(), self.lse.clone()  # the next replay writes into self.out, self.lse
            timer.end(started)  # the stage holds the copies out: its work, as its launch count says
        self.reader = timer
        counts = Counter(self.launches)
        counts[GRAPH_STAGE] += 2  # the two copies out
        return PendingLoop(out, lse, counts, timer, self.unpacked_keys)


def _extension_calls() -> tuple[Any, Any]:
    """The CUDA extension's (copies_async, graph_launch) where it is loaded and has them, else None each."""
    ext = _cuda.load()
    return getattr(ext, "copies_async", None), getattr(ext, "graph_launch", None)


class LoopGraphs:
    """The captured loops of one engine (one device, one stream: the engine's lock held).

    ``cache``: every layer's cache as one allocation (layer i's block b is its block
    ``i * blocks_per_layer + b``), where the engine has one: then a shape's graph serves
    every layer — it reads the whole cache through block ids offset by the request's
    layer, and the layer's weight is copied into it with q — and the graphs share one
    memory pool (their replays never overlap, and each replay's output is copied out
    before the next). Without it each layer's shape is its own graph."""

    def __init__(self, cache: torch.Tensor | None = None, blocks_per_layer: int = 0, max_graphs: int = 8):
        self.cache, self.blocks_per_layer = cache, blocks_per_layer
        self.max_graphs = max_graphs
        self._graphs: collections.OrderedDict[Hashable, CapturedLoop] = collections.OrderedDict()
        self._seen: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._failed: set[Hashable] = set()
        self._pool: Any = None  # the graphs' shared memory pool (torch.cuda.graph_pool_handle)
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
        pending = cap.replay(hm, q, weight)
        self.replays += 1
        return pending

    def start_eager(self, x: LoopInputs, backend: AttentionBackend, fused: bool, key: Hashable,
                    hm: HostMetadata) -> PendingLoop:
        """Queue ``x``'s loop eagerly, its shape ``key`` having no graph (:meth:`replay`
        returned None), and capture the shape the second time it comes."""
        seen = self._seen.pop(key, 0) + 1
        self._seen[key] = seen
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
        if self.cache is not None:  # hm's block ids address the whole cache
            x = dataclasses.replace(x, cache=self.cache)
        pending = start_chunk_loop(x, backend, fused, metadata=upload_metadata(hm, x.q.device))
        if seen >= 2 and key not in self._failed:
            self._capture(key, x, hm, backend, fused)
        return pending

    def _capture(self, key: Hashable, x: LoopInputs, hm: HostMetadata, backend: AttentionBackend,
                 fused: bool) -> None:
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
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(x.q.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(x.q.device))
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    looped = start_chunk_loop(xs, backend, fused, metadata=device_metadata(hm, meta),
                                              launch_orders=orders, timed=False)
                finally:
                    graph.capture_end()
        except Exception as e:  # a kernel that cannot be captured: this shape runs eagerly
            self._failed.add(key)
            log.warning("chunk loop not captured as a CUDA graph (%s: %s); the shape runs eagerly",
                        type(e).__name__, str(e).splitlines()[0][:200])
            return
        finally:
            torch.cuda.current_stream(x.q.device).wait_stream(stream)
        copies, launch = _extension_calls()
        self._graphs[key] = CapturedLoop(graph, q, meta, staging, staged, looped.out, looped.lse,
                                         looped.counts, use_unpacked_keys(backend, fused, x.unpacked_keys,
                                                                          x.fp8_prefill), orders,
                                         torch.cuda.current_stream(x.q.device), copies, weight,
                                         x.weight.data_ptr() if weight is not None else 0, launch)
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            _, dropped = self._graphs.popitem(last=False)
            dropped.staged.synchronize()  # its page-locked staging goes back to torch's pool: not while read
