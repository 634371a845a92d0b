"""A one-sequence request of a shape that replayed before takes the quick path
(``Engine._quick_replay``): only its layer, block ids (and cache_write) are checked, the shape's
plan, chunk vectors and graph reused. On the CPU the engine has no CUDA graphs, so a
stand-in ``LoopGraphs`` records what a replay would stage; every request is also checked in
full (``validate_prefill``) and staged the full path's way (``LoopGraphs.shape``), and the
two must agree byte for byte, or fail with the same error. On the GPU the same path is
held bit for bit to the eager loop (tests/gpu/test_graphs_gpu.py)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

from ctxprefill.app import build_engine
from ctxprefill.engine.engine import SequenceSpec
from ctxprefill.engine.graphs import LoopGraphs
from ctxprefill.engine.loop import PendingLoop, RowMetadata, host_metadata_of
from ctxprefill.engine.plan import ContextChunk
from ctxprefill.engine.request import (
    PrefillRequest,
    StopSignal,
    WriteRequest,
    block_row,
    validate_prefill,
)
from ctxprefill.engine.timing import StageTimer
from ctxprefill.errors import CtxPrefillError, DeadlineExceeded
from ctxprefill.settings import ServeSettings

BS, NB, H = 16, 40, 2


class StandInGraphs(LoopGraphs):
    """Captures a shape the second time it comes (as LoopGraphs does) by remembering its
    upload's size; a replay records the bytes it would stage and the layer weight it takes."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.staged: list[tuple[object, np.ndarray, int]] = []

    def _capture(self, key, x, hm, backend, fused, eager):
        self._graphs[key] = hm.size
        self.captures += 1

    def replay(self, key, hm, q, weight, stop, chunks):
        size = self._graphs.get(key)
        if size is None:
            return None
        if stop is not None:
            stop.check(0, chunks)
        staging = np.full(size + 4, -7, dtype=np.int32)  # past the upload: must stay untouched
        hm.fill(staging[:size])
        self.staged.append((key, staging, weight.data_ptr()))
        self.replays += 1
        out = torch.zeros((q.shape[0], q.shape[1], 128), dtype=torch.bfloat16)
        return PendingLoop(out, torch.zeros((q.shape[1], q.shape[0])), Counter(), StageTimer(q.device), False)


@pytest.fixture
def engine():
    eng = build_engine(ServeSettings(device="cpu", heads=H, block_size=BS, num_blocks=NB, workspace_tokens=64,
                                     layers=3, seed=0))
    eng.graphs = StandInGraphs(eng.cache_storage, NB)
    return eng


def _q(tq: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((tq, H, 192), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _full_staging(eng, request: PrefillRequest) -> np.ndarray:
    """What the full path stages for ``request``: its checks, then LoopGraphs.shape's metadata."""
    c = validate_prefill(request, eng.config, eng.instance_id)
    _, hm = eng.graph_shape(eng.graphs, c, True, True, c.q)
    return hm.host


def _run(eng, request: PrefillRequest):
    return eng.start_prefill(request, graphs_on=True)


def test_the_third_request_of_a_shape_is_quick_and_stages_the_full_paths_bytes(engine):
    eng, g = engine, engine.graphs
    table = list(range(5, 5 + 9))  # 130 tokens: 9 blocks of 16, over 3 chunks of 64
    req = PrefillRequest(_q(8), [SequenceSpec(8, 130, table)], layer=1)
    for _ in range(3):
        _run(eng, req)
    assert (g.captures, g.replays, eng.quick_replays) == (1, 1, 1)
    (key, staged, weight), = g.staged
    want = _full_staging(eng, req)
    assert np.array_equal(staged[: want.size], want) and (staged[want.size:] == -7).all()
    assert weight == eng._gemm_weights[1].data_ptr()
    # the same shape with other block ids, given as int64 and int32 arrays and a tuple
    rng = np.random.default_rng(0)
    for make in (lambda b: np.asarray(b, dtype=np.int64), lambda b: np.asarray(b, dtype=np.int32), tuple):
        blocks = make(rng.permutation(NB)[:12])  # a longer table than the context uses
        r = dataclasses.replace(req, q=_q(8, 1), sequences=[SequenceSpec(8, 130, blocks)])
        pending = _run(eng, r)
        assert g.staged[-1][0] == key and np.array_equal(g.staged[-1][1][: want.size], _full_staging(eng, r))
        assert [c.context_lens for c in pending._stats["chunks"]] == [(64,), (64,), (2,)]
        assert pending._stats["context_tokens"] == 130 and pending._stats["query_tokens"] == 8
    assert eng.quick_replays == 4


def test_another_layer_of_the_shape_stages_its_own_block_offset(engine):
    eng, g = engine, engine.graphs
    table = np.arange(9, dtype=np.int64)
    reqs = {layer: PrefillRequest(_q(8), [SequenceSpec(8, 130, table)], layer=layer) for layer in (0, 2)}
    for layer in (0, 0, 0, 2, 2):
        _run(eng, reqs[layer])
    # replays: layer 0's third request and layer 2's both, all quick (the shape and the graph
    # are every layer's; the layer is checked per request)
    assert g.replays == 3 and eng.quick_replays == 3
    for (_, staged, weight), layer in zip(g.staged, (0, 2, 2), strict=True):
        want = _full_staging(eng, reqs[layer])
        assert np.array_equal(staged[: want.size], want) and weight == eng._gemm_weights[layer].data_ptr()
    assert (g.staged[-1][1][want.size - 9: want.size] == table + 2 * NB).all()
    # a layer the engine does not hold: the full checks refuse it, naming the field
    bad = dataclasses.replace(reqs[2], layer=3)
    want_error = _error(lambda: validate_prefill(bad, eng.config, eng.instance_id))
    assert want_error[1].startswith("layer") and _error(lambda: _run(eng, bad)) == want_error
    assert eng.quick_replays == 3


def _error(fn):
    with pytest.raises(CtxPrefillError) as e:
        fn()
    return type(e.value), str(e.value)


@pytest.mark.parametrize("table", [
    [0, 1, 2, 3, 4, 5, 6, 7, NB],  # an id past the cache
    [0, 1, 2, 3, -1, 5, 6, 7, 8],  # a negative id
    [0, 1, 2, 3, 4, 5, 6, 7],  # one block short
    np.asarray([0, 1, 2, 3, 4, 5, 6, 7, 2**33], dtype=np.int64),  # wraps to 0 as int32
    np.asarray([0, 1, 2, 3, 4, 5, 6, 7, 8], dtype=np.float64),  # not ids: the full checks decide
    torch.arange(9),
])
def test_a_request_the_quick_checks_refuse_gets_the_full_paths_answer(engine, table):
    eng = engine
    good = PrefillRequest(_q(8), [SequenceSpec(8, 130, list(range(9)))], layer=1)
    for _ in range(3):
        _run(eng, good)
    assert eng.quick_replays == 1
    bad = dataclasses.replace(good, sequences=[SequenceSpec(8, 130, table)])
    try:
        want = validate_prefill(bad, eng.config, eng.instance_id)
    except CtxPrefillError as e:
        assert _error(lambda: _run(eng, bad)) == (type(e), str(e))
    else:  # valid after all (float ids, a tensor): the full path replays it
        replays = eng.graphs.replays
        _run(eng, bad)
        assert eng.graphs.replays == replays + 1 and want.block_table.tolist() == [list(range(9))]
    assert eng.quick_replays == 1


def test_what_the_shape_does_not_cover_goes_the_full_way(engine):
    eng = engine
    seq = SequenceSpec(8, 130, list(range(9)))
    req = PrefillRequest(_q(8), [seq], layer=1)
    for _ in range(3):
        _run(eng, req)
    assert eng.quick_replays == 1
    plan = [ContextChunk(0, (0,), (64,)), ContextChunk(0, (64,), (64,)), ContextChunk(0, (128,), (2,))]
    for other in (dataclasses.replace(req, plan=plan), dataclasses.replace(req, workspace_tokens=64),
                  dataclasses.replace(req, expected_instance_id=eng.instance_id),
                  dataclasses.replace(req, q=_q(8).to(torch.float32))):
        try:
            validate_prefill(other, eng.config, eng.instance_id)
        except CtxPrefillError as e:
            assert _error(lambda: _run(eng, other)) == (type(e), str(e))
        else:
            _run(eng, other)
    assert eng.quick_replays == 2  # the expected instance is this one: quick
    assert _error(lambda: _run(eng, dataclasses.replace(req, expected_instance_id="elsewhere")))[0].__name__ == \
        "FailedPrecondition"
    # a stop signal over more chunks than run ahead: eagerly (the full path), not replayed
    many = PrefillRequest(_q(8), [SequenceSpec(8, 600, list(range(38)))], layer=1)
    for _ in range(3):
        _run(eng, many)
    quick = eng.quick_replays
    _run(eng, dataclasses.replace(many, stop=StopSignal(deadline=1e18)))
    assert eng.quick_replays == quick
    # a passed deadline within the chunks a replay may run: stopped, as the full path stops it
    with pytest.raises(DeadlineExceeded):
        _run(eng, dataclasses.replace(req, stop=StopSignal(deadline=0.0)))


def test_a_cache_write_is_checked_as_the_full_path_checks_it(engine):
    eng = engine
    req = PrefillRequest(_q(8), [SequenceSpec(8, 130, list(range(9)))], layer=1)
    for _ in range(3):
        _run(eng, req)
    slots = torch.arange(130, 138, dtype=torch.int64)
    bad = WriteRequest(slots, torch.zeros((8, 512)), torch.zeros((7, 64)))
    want = _error(lambda: validate_prefill(dataclasses.replace(req, cache_write=bad), eng.config, eng.instance_id))
    assert want[1].startswith("cache_write.k_pe")
    assert _error(lambda: _run(eng, dataclasses.replace(req, cache_write=bad))) == want
    good = WriteRequest(slots, torch.ones((8, 512)), torch.ones((8, 64)))
    pending = _run(eng, dataclasses.replace(req, cache_write=good))
    assert eng.quick_replays == 2
    assert pending.write_cache().slots_written == 8 and eng.caches[1].slots_used == 8


def test_row_metadata_fills_what_host_metadata_fills():
    rng = np.random.default_rng(3)
    for _ in range(50):
        need = int(rng.integers(1, 40))
        row = rng.integers(0, 1000, need)
        offset = int(rng.choice([0, 7000]))
        chunks = [ContextChunk(0, (0,), (need * BS,))]
        hm = host_metadata_of([5], chunks, row.reshape(1, -1).astype(np.int32), block_offset=offset)
        for ids in (row.astype(np.int64), row.astype(np.int32)):
            out = np.full(hm.size + 3, -1, dtype=np.int32)
            RowMetadata(hm.vectors, ids, offset).fill(out)
            assert np.array_equal(out[: hm.size], hm.host) and (out[hm.size:] == -1).all()


def test_block_row():
    ok = [3, 1, 2]
    for table in (ok, tuple(ok), np.asarray(ok), np.asarray(ok, dtype=np.int32), [3, 1, 2, 99]):
        row = block_row(table, 3, 4)
        assert row is not None and row.tolist() == ok
    for table in ([3, 1], [3, 1, 4], [3, -1, 2], np.asarray([3, 1, 2], dtype=np.uint8), np.asarray([[3, 1, 2]]),
                  torch.tensor(ok), np.asarray([3, 1, 2**32 + 1]), [3, 1, 2**70], ["x", 1, 2]):
        assert block_row(table, 3, 4) is None, table


def test_the_shapes_remembered_are_bounded_the_oldest_forgotten(engine, monkeypatch):
    """A client that sends ever new shapes grows nothing without bound: at most MAX_KNOWN
    shapes are remembered (the oldest forgotten first: its next request goes the full way),
    and the graphs count at most MAX_SEEN shapes towards their capture."""
    import ctxprefill.engine.graphs as graphs_mod

    eng = engine
    monkeypatch.setattr(eng, "MAX_KNOWN", 3)
    monkeypatch.setattr(graphs_mod, "MAX_SEEN", 2)
    table = list(range(5, 5 + 9))
    reqs = [PrefillRequest(_q(tq), [SequenceSpec(tq, 130, table)], layer=0) for tq in range(1, 6)]
    for r in reqs:
        _run(eng, r)
    assert len(eng._known) == 3 and len(eng.graphs._seen) == 2 and eng.graphs.captures == 0

    def known(r):
        return eng.known_shape(r, eng.shape_key(r, eng.graphs, True, True)) is not None

    assert [known(r) for r in reqs] == [False, False, True, True, True]


class FailingCaptures(LoopGraphs):
    """Every capture raises ``error`` (as ``LoopGraphs._capture`` does where a kernel cannot
    be captured or the graph finds no memory); counts the attempts."""

    def __init__(self, error: Exception, *a, **k):
        super().__init__(*a, **k)
        self.error, self.attempts = error, 0

    def _capture(self, key, x, hm, backend, fused, eager):
        self.attempts += 1
        raise self.error


@pytest.mark.parametrize("oom", [True, False], ids=["out_of_memory", "cannot_capture"])
def test_a_capture_out_of_memory_is_tried_again_once_the_graphs_release_theirs(engine, oom):
    """A shape whose capture found no memory runs eagerly, without another attempt per
    request, until the graphs give their memory back (``Engine.release_graphs``, what an
    out-of-memory request calls): from then on it is captured at its second request again.
    A capture that failed otherwise is never tried again."""
    eng = engine
    error = torch.OutOfMemoryError("CUDA out of memory") if oom else RuntimeError("operation not permitted")
    g = eng.graphs = FailingCaptures(error, eng.cache_storage, NB)
    req = PrefillRequest(_q(8), [SequenceSpec(8, 130, list(range(9)))], layer=0)
    want = eng.start_prefill(req, graphs_on=False).result()
    for _ in range(4):
        got = _run(eng, req).result()
        assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)
    assert g.attempts == 1 and len(g) == 0 and g.replays == 0
    eng.release_graphs()
    for _ in range(3):
        _run(eng, req).result()
    assert g.attempts == (2 if oom else 1)
