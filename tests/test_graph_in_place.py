"""engine/graphs.py: a replay that reads q and writes out and LSE in place (the extension's
GraphPatch, found and checked at capture), and what falls back to copying.

No device needed: the extension's calls, the patch and the timer are recorded fakes; the
GraphPatch itself and the capture's check run on the GPU (tests/gpu/test_graphs_gpu.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ctxprefill.engine import graphs
from ctxprefill.engine.graphs import GRAPH_STAGE, IN_PLACE_ALIGN, CapturedLoop, LoopGraphs


class Timer:  # a CUDA StageTimer's bookkeeping, events as handles
    def __init__(self, device, stream):
        self.last = None

    def begin_recorded_by_caller(self, name):
        return (name, 11), 11

    def end_recorded_by_caller(self, started):
        self.last = 12
        return 12

    def begin(self, name):  # torch's path (a strided q)
        return (name, 11)

    def end(self, started):
        self.last = 12


class Patch:  # the extension's GraphPatch: launches and applies recorded
    def __init__(self, calls: list, fail: bool = False):
        self.calls, self.fail, self.counts = calls, fail, [2, 1, 1]

    def launch(self, bases, triples, staged, begin, graph_exec, stream):
        if self.fail:
            raise RuntimeError("graph_patch: cuGraphExecKernelNodeSetParams failed (CUresult 1)")
        self.calls.append(("in place", list(bases), list(triples), staged, begin, graph_exec, stream))
        return 0.0

    def apply(self, bases):
        self.calls.append(("apply", list(bases)))


def loop_with(calls: list, patch: Patch | None, in_place: bool = True) -> CapturedLoop:
    meta, q_buf = torch.empty(8, dtype=torch.int32), torch.empty((4, 1, 192))
    loop = CapturedLoop(SimpleNamespace(raw_cuda_graph_exec=lambda: 999), q_buf, meta,
                        torch.empty(8, dtype=torch.int32),
                        SimpleNamespace(synchronize=lambda: None, cuda_event=77, record=lambda stream: None),
                        torch.empty((4, 1, 128)), torch.empty((1, 4)), {"attention": 3}, True, [],
                        SimpleNamespace(cuda_stream=5),
                        lambda args, stream, event=0: calls.append(("copies", list(args), stream, event)), None,
                        launch=lambda *a: calls.append(("launch", *a)), patch=patch)
    loop.copies_because = "" if in_place else "not checked"
    return loop


def aligned(shape: tuple[int, ...], offset_bytes: int = 0) -> torch.Tensor:
    """A contiguous float32 tensor whose data starts ``offset_bytes`` past an IN_PLACE_ALIGN boundary."""
    n = int(np.prod(shape))
    big = torch.empty(n + 2 * IN_PLACE_ALIGN)
    skip = (-big.data_ptr() % IN_PLACE_ALIGN + offset_bytes) // 4
    return big[skip:skip + n].view(shape)


HM = SimpleNamespace(fill=lambda out: out.__setitem__(slice(None), 1))


def test_an_in_place_replay_points_the_graph_at_the_requests_tensors_and_copies_nothing_but_metadata(monkeypatch):
    """One call redirects the arguments to (q, the new out, the new LSE) and queues the
    metadata's copy (no q), the staging's event, the stage's start and the graph; the stage
    ends with no copy out, and the launches counted are the captured loop's alone."""
    monkeypatch.setattr(graphs, "StageTimer", Timer)
    calls: list[tuple] = []
    loop = loop_with(calls, Patch(calls))
    q = aligned((4, 1, 192))
    p = loop.replay(HM, q, torch.empty(1))
    [(kind, bases, triples, staged, begin, exe, stream), copies] = calls
    assert kind == "in place" and bases == [q.data_ptr(), p.out.data_ptr(), p.lse.data_ptr()]
    assert triples == [loop.meta.data_ptr(), loop.staging.data_ptr(), loop.meta.nbytes]
    assert (staged, begin, exe, stream) == (77, 11, 999, 5)
    assert copies == ("copies", [], 5, 12)
    assert p.out.data_ptr() != loop.out.data_ptr() and p.out.shape == loop.out.shape
    assert p.counts == {"attention": 3}
    assert GRAPH_STAGE not in p.counts


@pytest.mark.parametrize("how", ["strided", "unaligned", "not checked"])
def test_a_replay_that_cannot_go_in_place_restores_the_graphs_buffers_and_copies(monkeypatch, how):
    """A strided q (torch's copy), a q off the alignment or a graph whose check failed:
    the arguments are pointed back at the graph's own q, out and LSE, then the copying
    replay runs (q copied in, out and LSE copied out, two launches more)."""
    monkeypatch.setattr(graphs, "StageTimer", Timer)
    calls: list[tuple] = []
    loop = loop_with(calls, Patch(calls), in_place=how != "not checked")
    if how == "strided":
        loop.graph = SimpleNamespace(replay=lambda: calls.append(("replay",)))
        q = aligned((4, 2, 192))[:, :1].normal_()
    else:
        q = aligned((4, 1, 192), offset_bytes=16 if how == "unaligned" else 0)
    assert not loop.takes_in_place(q)
    p = loop.replay(HM, q, torch.empty(1))
    if how == "strided":  # torch's copies into the graph's buffers, its replay, clones of out and LSE
        assert calls == [("apply", loop.captured), ("replay",)] and torch.equal(loop.q, q)
        assert p.counts == {"attention": 3, GRAPH_STAGE: 2}
        return
    assert calls[0] == ("apply", loop.captured)
    assert calls[1][0] == "launch" and calls[1][1][3:6] == [loop.q.data_ptr(), q.data_ptr(), loop.q.nbytes]
    assert calls[2] == ("copies", [p.out.data_ptr(), loop.out.data_ptr(), loop.out.nbytes, p.lse.data_ptr(),
                                   loop.lse.data_ptr(), loop.lse.nbytes], 5, 12)
    assert p.counts == {"attention": 3, GRAPH_STAGE: 2}


def test_the_patch_is_asked_for_the_captured_buffers_in_q_out_lse_order():
    loop = loop_with([], Patch([]))
    assert loop.captured == [loop.q.data_ptr(), loop.out.data_ptr(), loop.lse.data_ptr()]
    assert loop.launch_in_place == loop.patch.launch
    assert loop_with([], None).launch_in_place is None


def test_a_patch_that_fails_drops_its_graph_and_the_request_runs_eagerly(monkeypatch):
    """A launch whose redirection fails leaves the graph's arguments unknown: the shape's
    graph is dropped for good (LoopGraphs.replay returns None: the engine runs the loop
    eagerly) and never captured again; another error of a replay is raised as it was."""
    monkeypatch.setattr(graphs, "StageTimer", Timer)
    lg = LoopGraphs()
    calls: list[tuple] = []
    lg._graphs["shape"] = loop_with(calls, Patch(calls, fail=True))
    q = aligned((4, 1, 192))
    assert lg.replay("shape", HM, q, torch.empty(1), None, 1) is None
    assert "shape" not in lg and "shape" in lg._failed and lg.replays == 0

    def broken(*a):
        raise RuntimeError("graph_launch: cudaGraphLaunch of graph 0 failed")

    lg._graphs["other"] = loop_with(calls, None, in_place=False)
    lg._graphs["other"].launch = broken
    with pytest.raises(RuntimeError, match="cudaGraphLaunch"):
        lg.replay("other", HM, q, torch.empty(1), None, 1)
    assert "other" in lg


def test_a_replays_mode_reaches_its_stats_and_the_metrics(monkeypatch):
    """PendingLoop's mode ("in_place", "copying"; "" for an eager loop) is the request's
    ``PrefillStats.replay`` and counts under ``ctxprefill_graph_replays_total{mode}``, whose
    two series exist from the start."""
    from collections import Counter

    from ctxprefill.engine.engine import PrefillStats
    from ctxprefill.service.metrics import Metrics
    from service_process import parse_metrics, sample_sum

    monkeypatch.setattr(graphs, "StageTimer", Timer)
    calls: list[tuple] = []
    assert loop_with(calls, Patch(calls)).replay(HM, aligned((4, 1, 192)), torch.empty(1)).replay == "in_place"
    assert loop_with(calls, None, in_place=False).replay(HM, aligned((4, 1, 192)), torch.empty(1)).replay == "copying"
    m = Metrics()

    def series(mode: str) -> float:
        return sample_sum(parse_metrics(m.render().decode())["ctxprefill_graph_replays_total"], mode=mode)

    assert series("in_place") == series("copying") == 0
    fp8 = {"cache_dtype": "auto", "kv_b_proj_dtype": "bf16", "prefill_dtype": "bf16"}
    for mode in ("in_place", "in_place", "copying", ""):
        m.observe_prefill(PrefillStats([], Counter(), "fused", fp8, {}, 1, 0, 0, replay=mode), 0.001)
    assert (series("in_place"), series("copying")) == (2, 1)


def test_clear_drops_every_graph_and_the_pool():
    """Out of memory, the engine drops its graphs (engine_worker.oom_guarded's release):
    every captured loop waits for its staging and goes, the shared pool is let go, and the
    shapes counted start again (captured from their next second request)."""
    lg = LoopGraphs()
    waited: list[str] = []
    for key in ("a", "b"):
        lg._graphs[key] = loop_with([], None)
        lg._graphs[key].staged = SimpleNamespace(synchronize=lambda key=key: waited.append(key))
        lg._seen[key] = 2
    lg._pool = (0, 1)
    assert lg.clear() == 2
    assert len(lg) == 0 and not lg._seen and lg._pool is None and waited == ["a", "b"]
    assert lg.clear() == 0


def test_the_shapes_not_captured_are_bounded(monkeypatch):
    """The shapes whose capture failed (for good, or out of memory until the graphs release
    theirs) are kept up to MAX_SEEN each, the oldest forgotten first: a client sending ever
    new shapes cannot grow them."""
    monkeypatch.setattr(graphs, "MAX_SEEN", 3)
    lg = LoopGraphs()
    for i in range(5):
        lg._not_captured(("failed", i), RuntimeError("operation not permitted when stream is capturing"))
        lg._not_captured(("oom", i), torch.OutOfMemoryError("CUDA out of memory"))
    assert list(lg._failed) == [("failed", i) for i in (2, 3, 4)]
    assert list(lg._short_of_memory) == [("oom", i) for i in (2, 3, 4)]
    lg.clear()
    assert not lg._short_of_memory and len(lg._failed) == 3
