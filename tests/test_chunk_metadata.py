"""The chunk loop's metadata (engine/loop.py ``_chunk_metadata``): every chunk's vectors as
the planner's chunks say, equal vectors uploaded once and shared, the block table after
them — on the CPU (the CUDA upload from pinned memory: tests/gpu/test_upload_gpu.py)."""

import dataclasses

import numpy as np
import pytest
import torch

from ctxprefill.engine.loop import LoopInputs, _chunk_metadata
from ctxprefill.engine.plan import plan_chunks
from ctxprefill.ops.pack import keys_last_starts


def _inputs(query_lens, context_lens, workspace, block_size=16):
    blocks = [-(-n // block_size) for n in context_lens]
    bt = np.zeros((len(context_lens), max(max(blocks), 1)), dtype=np.int32)
    for i, b in enumerate(blocks):
        bt[i, :b] = np.arange(b) + 100 * i
    return LoopInputs(q=None, query_lens=query_lens, block_table=bt,
                      chunks=plan_chunks(context_lens, workspace, block_size), cache=None, cache_dtype="auto",
                      k_scale=1.0, block_size=block_size, workspace=None, weight=None, kv_b_proj_bf16=True,
                      gather_raw_fp8=False, fp8_prefill=False, scale=1.0, heads=1)


@pytest.mark.parametrize("keys_last", [False, True])
@pytest.mark.parametrize("query_lens,context_lens,workspace", [
    ([1024], [65536], 16384),  # one sequence in 4 equal chunks: cu_k and cu_q shared
    ([3, 0, 5, 7], [40, 0, 1000, 33], 256),  # ragged, continuations, an empty sequence
    ([2, 2], [0, 0], 64),  # no context at all
])
def test_each_chunk_gets_its_own_values(query_lens, context_lens, workspace, keys_last):
    x = _inputs(query_lens, context_lens, workspace)
    dm = _chunk_metadata(x, "cpu", keys_last)
    meta = dm.chunks
    assert np.array_equal(dm.block_table.numpy(), x.block_table)
    q_off = np.concatenate([[0], np.cumsum(query_lens)])
    assert len(meta) == len(x.chunks)
    for c, m in zip(x.chunks, meta, strict=True):
        want_k = np.concatenate([[0], np.cumsum(c.context_lens)])
        want_q = np.concatenate([[0], np.cumsum([query_lens[s] for s in c.sequences])])
        assert m.cu_seqlens_k.tolist() == want_k.tolist() and m.cu_seqlens_q.tolist() == want_q.tolist()
        assert m.cu_seqlens_k.dtype == m.cu_seqlens_q.dtype == m.context_starts.dtype == torch.int32
        assert m.context_starts.tolist() == list(c.context_starts)
        assert (m.q0, m.q1) == (q_off[c.first_sequence], q_off[c.first_sequence + c.num_sequences])
        assert m.max_q == max([query_lens[s] for s in c.sequences], default=0)
        assert m.max_k == max(c.context_lens) > 0
        layout = m.keys_last
        if keys_last:
            assert layout.cu_k == want_k.tolist() and layout.cu_v == keys_last_starts(want_k.tolist())
            assert layout.cu_v_dev.tolist() == layout.cu_v and layout.cu_k_dev.tolist() == layout.cu_k
        else:
            assert layout is None


def test_equal_vectors_are_one_tensor():
    x = _inputs([1024], [65536], 16384)
    meta = _chunk_metadata(x, "cpu").chunks
    assert len(meta) == 4
    # cu_k, cu_q: one view each
    assert all(m.cu_seqlens_k is meta[0].cu_seqlens_k and m.cu_seqlens_q is meta[0].cu_seqlens_q for m in meta)
    assert len({id(m.context_starts) for m in meta}) == 4  # the starts differ
    assert [m.context_starts.item() for m in meta] == [0, 16384, 32768, 49152]


def test_metadata_is_frozen():
    dm = _chunk_metadata(_inputs([3, 5], [40, 90], 64), "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        dm.chunks[0].q0 = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        dm.block_table = dm.block_table


def test_layout_names_what_a_captured_loop_bakes_in():
    """engine/graphs.py keys a captured loop by the metadata's layout: equal for requests
    of the same lengths whatever their block ids, different when a length differs or
    equal vectors share differently."""
    from ctxprefill.engine.loop import host_metadata

    a = _inputs([3, 0, 5, 7], [40, 0, 1000, 33], 256)
    other_blocks = dataclasses.replace(a, block_table=a.block_table[:, ::-1].copy() + 7)
    ha, hb = host_metadata(a), host_metadata(other_blocks)
    assert ha.layout() == hb.layout() and not np.array_equal(ha.host, hb.host)
    assert host_metadata(_inputs([3, 0, 5, 7], [40, 0, 1001, 33], 256)).layout() != ha.layout()
    assert host_metadata(a, keys_last=True).layout() != ha.layout()
    # the upload is the vectors then the block table, as sized
    assert sum(ha.sizes) == ha.host.size and ha.sizes[-1] == a.block_table.size
    assert np.array_equal(ha.host[-a.block_table.size:], a.block_table.ravel())


def test_a_remembered_shape_gives_what_is_built_afresh():
    """A request shape's vectors are remembered: a second request of the shape with other
    block ids gets the same vectors and layout (one object: the graph key's lookup) and
    its own block table."""
    from ctxprefill.engine.loop import _chunk_vectors, host_metadata

    a = _inputs([3, 0, 5, 7], [40, 0, 1000, 33], 256)
    b = dataclasses.replace(a, block_table=a.block_table + 1)
    ha, hb = host_metadata(a), host_metadata(b)
    fresh = _chunk_vectors(a.query_lens, a.chunks, False)
    assert ha.chunk_layout is hb.chunk_layout and ha.chunk_layout == fresh.layout
    assert list(ha.spans) == list(fresh.spans) and ha.sizes == [*fresh.sizes, a.block_table.size]
    for h, x in ((ha, a), (hb, b)):
        assert np.array_equal(h.host, np.concatenate([fresh.host, x.block_table.ravel()]))


def test_large_shapes_are_not_remembered():
    """The memory the remembered shapes hold is bounded: a request of more sequences (or
    chunks) than the limits is built afresh, not kept."""
    from ctxprefill.engine import loop

    loop._remembered_vectors.cache_clear()
    n = loop.REMEMBER_SEQUENCES + 1
    big = _inputs([1] * n, [16] * n, 64)
    loop.host_metadata(big)
    long = _inputs([1], [16 * (loop.REMEMBER_CHUNKS + 1)], 16)  # one chunk per block
    assert len(long.chunks) == loop.REMEMBER_CHUNKS + 1
    loop.host_metadata(long)
    assert loop._remembered_vectors.cache_info().currsize == 0
    loop.host_metadata(_inputs([1] * (n - 1), [16] * (n - 1), 64))
    assert loop._remembered_vectors.cache_info().currsize == 1


def test_a_graph_key_is_the_requests_shape():
    """engine/graphs.py replays a captured loop for requests of equal keys: equal whatever
    their block ids, different for another layer (its weight and cache are baked in),
    another context length, other query lengths of the same total, or another q dtype."""
    from ctxprefill.engine.graphs import LoopGraphs

    q = torch.empty((15, 1, 192), dtype=torch.bfloat16)
    w = torch.empty((256, 512), dtype=torch.bfloat16)

    def key(x, layer=0, q=q):  # per layer: an engine without one cache allocation
        return LoopGraphs().shape(layer, True, True, q, w, x.query_lens, x.chunks, x.block_table, False)[0]

    a = _inputs([3, 0, 5, 7], [40, 0, 1000, 33], 256)
    assert key(a) == key(dataclasses.replace(a, block_table=a.block_table + 5))
    assert key(a) != key(a, layer=1)
    assert key(a) != key(_inputs([3, 0, 5, 7], [40, 0, 1001, 33], 256))
    assert key(a) != key(_inputs([3, 1, 4, 7], [40, 0, 1000, 33], 256))
    assert key(a) != key(a, q=q.to(torch.float8_e4m3fn))


def test_a_graph_key_serves_every_layer_of_one_cache():
    """engine/graphs.py over the engine's one cache allocation: a request's key is its shape
    whatever its layer (the layer's block ids offset into the whole cache, its weight a
    value copied in: only the weight's shape and dtype in the key); without one, the layer
    is in the key and block ids are the layer's own."""
    from ctxprefill.engine.graphs import LoopGraphs

    q = torch.empty((15, 1, 192), dtype=torch.bfloat16)
    w = torch.empty((256, 512), dtype=torch.bfloat16)
    shared, per_layer = LoopGraphs(torch.empty((4 * 100, 8), dtype=torch.uint8), blocks_per_layer=100), LoopGraphs()

    def shape(graphs, x, layer=0, weight=w):
        return graphs.shape(layer, True, True, q, weight, x.query_lens, x.chunks, x.block_table, False)

    a = _inputs([3, 0, 5, 7], [40, 0, 1000, 33], 256)
    n = a.block_table.size
    (k0, h0), (k2, h2) = shape(shared, a), shape(shared, a, layer=2)
    assert k0 == k2 and h0.chunk_layout is h2.chunk_layout
    assert np.array_equal(h0.host[-n:], a.block_table.ravel())
    assert np.array_equal(h2.host[-n:], a.block_table.ravel() + 200) and h2.host.dtype == np.int32
    assert shape(shared, a, weight=w.float())[0] != k0
    assert shape(per_layer, a)[0] != shape(per_layer, a, layer=2)[0]
    assert np.array_equal(shape(per_layer, a, layer=2)[1].host[-n:], a.block_table.ravel())


def test_a_shared_graph_copies_a_layers_weight_only_when_it_holds_another():
    """engine/graphs.py ``CapturedLoop.load``: every replay copies the metadata and q into the
    graph's buffers; the layer's weight only when the buffer holds another layer's (the copies
    recorded as copies_async's (dst, src, bytes) triples, staging's event recorded by the same
    call; no device needed)."""
    from types import SimpleNamespace

    from ctxprefill.engine.graphs import CapturedLoop

    calls: list[list[int]] = []
    meta, q_buf, w_buf = torch.empty(8, dtype=torch.int32), torch.empty((4, 1, 192)), torch.empty((256, 512))
    layers = [torch.empty((256, 512)) for _ in range(2)]
    events: list[int] = []
    event = SimpleNamespace(synchronize=lambda: None, cuda_event=3)
    loop = CapturedLoop(None, q_buf, meta, torch.empty(8, dtype=torch.int32), event, None, None, None, True, [],
                        SimpleNamespace(cuda_stream=0),
                        lambda args, stream, event: (calls.append(list(args)), events.append(event)), w_buf,
                        holds=layers[0].data_ptr())
    hm = SimpleNamespace(fill=lambda out: out.__setitem__(slice(None), np.arange(8, dtype=np.int32)))
    q = torch.empty((4, 1, 192))
    for layer in (0, 0, 1, 1, 0):
        loop.load(hm, q, layers[layer])
    triples = [[c[i:i + 3] for i in range(0, len(c), 3)] for c in calls]
    assert all(t[0][0] == meta.data_ptr() and t[1] == [q_buf.data_ptr(), q.data_ptr(), q_buf.nbytes] for t in triples)
    assert [t[2][1] if len(t) == 3 else None for t in triples] == [None, None, layers[1].data_ptr(), None,
                                                                    layers[0].data_ptr()]
    assert all(t[2][0] == w_buf.data_ptr() and t[2][2] == w_buf.nbytes for t in triples if len(t) == 3)
    assert loop.holds == layers[0].data_ptr()
    assert events == [3] * 5


def test_a_replay_through_the_extension_queues_its_copies_stage_and_graph_in_order(monkeypatch):
    """engine/graphs.py ``CapturedLoop.replay`` where the extension's graph_launch and the
    graph's exec handle are at hand: the metadata written into staging, one graph_launch
    (the copies in, the staging's event, the stage's start, the exec handle), then one
    copies_async of out and LSE into new tensors with the stage's end; the staging's event
    waited on only while the replay before it is unfinished (no device needed: the
    extension's calls and the timer are recorded)."""
    from types import SimpleNamespace

    from ctxprefill.engine import graphs
    from ctxprefill.engine.graphs import GRAPH_STAGE, CapturedLoop

    class Timer:  # a CUDA StageTimer's bookkeeping, events as handles
        def __init__(self, device, stream):
            self.last, self.calls = None, []

        def begin_recorded_by_caller(self, name):
            self.calls.append(("begin", name))
            return (name, 11), 11

        def end_recorded_by_caller(self, started):
            self.calls.append(("end", started[0]))
            self.last = 12
            return 12

    monkeypatch.setattr(graphs, "StageTimer", Timer)
    calls: list[tuple] = []
    waits: list[int] = []
    meta, q_buf = torch.empty(8, dtype=torch.int32), torch.empty((4, 1, 192))
    out_buf, lse_buf = torch.full((4, 1, 128), 3.0), torch.full((1, 4), 5.0)
    staged = SimpleNamespace(synchronize=lambda: waits.append(1), cuda_event=77)
    loop = CapturedLoop(SimpleNamespace(raw_cuda_graph_exec=lambda: 999), q_buf, meta,
                        torch.empty(8, dtype=torch.int32), staged, out_buf, lse_buf, {"attention": 3}, True, [],
                        SimpleNamespace(cuda_stream=5), lambda args, stream, event=0: calls.append(
                            ("copies", list(args), stream, event)), None,
                        launch=lambda *a: calls.append(("launch", *a)))
    values = [np.arange(8, dtype=np.int32), np.arange(8, 16, dtype=np.int32)]
    q = torch.empty((4, 1, 192))
    got = []
    for i, v in enumerate(values):
        pending = loop.replay(SimpleNamespace(fill=lambda out, v=v: out.__setitem__(slice(None), v)), q, q_buf)
        got.append(pending)
        assert np.array_equal(loop.staging.numpy(), v)
        if i == 0:
            loop.reader.last = None  # the first replay finished before the second one's metadata
    assert waits == [1]  # the first replay (none before it known finished) waited; the second did not
    launch = [c for c in calls if c[0] == "launch"]
    assert launch == [("launch", [meta.data_ptr(), loop.staging.data_ptr(), meta.nbytes, q_buf.data_ptr(),
                                  q.data_ptr(), q_buf.nbytes], 77, 11, 999, 5)] * 2
    for p, c in zip(got, [c for c in calls if c[0] == "copies"], strict=True):
        assert p.out.data_ptr() not in (out_buf.data_ptr(),) and p.out.shape == out_buf.shape
        assert c == ("copies", [p.out.data_ptr(), out_buf.data_ptr(), out_buf.nbytes, p.lse.data_ptr(),
                                lse_buf.data_ptr(), lse_buf.nbytes], 5, 12)
        assert p.timer.calls == [("begin", GRAPH_STAGE), ("end", GRAPH_STAGE)]
        assert p.counts == {"attention": 3, GRAPH_STAGE: 2}
    assert [c[0] for c in calls] == ["launch", "copies"] * 2


def test_a_replay_through_the_extension_copies_a_layers_weight_only_when_it_holds_another(monkeypatch):
    """The extension's path of ``CapturedLoop.replay`` on a graph serving every layer: the
    layer's weight is among graph_launch's copies only when the buffer holds another
    layer's, and the buffer is marked as holding it once that launch is queued (a launch
    that raises leaves it holding the one before)."""
    from types import SimpleNamespace

    from ctxprefill.engine import graphs
    from ctxprefill.engine.graphs import CapturedLoop

    class Timer:
        def __init__(self, device, stream):
            self.last = None

        def begin_recorded_by_caller(self, name):
            return (name, 1), 1

        def end_recorded_by_caller(self, started):
            return 2

    monkeypatch.setattr(graphs, "StageTimer", Timer)
    launched: list[list[int]] = []
    fail = [False]

    def launch(args, *rest):
        if fail[0]:
            raise RuntimeError("graph_launch: cudaGraphLaunch of graph 0 failed")
        launched.append(list(args))

    meta, q_buf, w_buf = torch.empty(8, dtype=torch.int32), torch.empty((4, 1, 192)), torch.empty((256, 512))
    layers = [torch.empty((256, 512)) for _ in range(2)]
    loop = CapturedLoop(SimpleNamespace(raw_cuda_graph_exec=lambda: 9), q_buf, meta, torch.empty(8, dtype=torch.int32),
                        SimpleNamespace(synchronize=lambda: None, cuda_event=7), torch.empty((4, 1, 128)),
                        torch.empty((1, 4)), {}, True, [], SimpleNamespace(cuda_stream=0),
                        lambda *a, **k: None, w_buf, holds=layers[0].data_ptr(), launch=launch)
    hm = SimpleNamespace(fill=lambda out: None)
    q = torch.empty((4, 1, 192))
    for layer in (0, 1, 1, 0):
        loop.replay(hm, q, layers[layer])
    assert [a[7] if len(a) == 9 else None for a in launched] == [None, layers[1].data_ptr(), None,
                                                                 layers[0].data_ptr()]
    fail[0] = True
    with pytest.raises(RuntimeError, match="cudaGraphLaunch"):
        loop.replay(hm, q, layers[1])
    assert loop.holds == layers[0].data_ptr()
