"""OpenTelemetry tracing (``ctxprefill.service.tracing``, docs/DEPLOY.md "Tracing"): the
span tree of a PrefillContext call in-process (the SDK's InMemorySpanExporter), its
parent the caller's span through the client's ``traceparent``; a stream's requests; a
refused call; nothing at all when tracing is off or the call is not sampled; the
settings (flag, OTEL_* variables); the stage timer's places; the client without
OpenTelemetry; and ``ctxprefill serve --otlp-endpoint`` exporting to a collector."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed (pip install '.[tracing]')")

from opentelemetry import trace as otel_trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from ctxprefill.engine import loop  # noqa: E402
from ctxprefill.engine.timing import DetailedStageTimer, StageTimer  # noqa: E402
from ctxprefill.service import tracing  # noqa: E402
from ctxprefill.service.interceptors import TracingInterceptor, server_interceptors  # noqa: E402
from ctxprefill.service.metrics import Metrics  # noqa: E402
from ctxprefill_api import pb  # noqa: E402
from ctxprefill_client import float32_to_bf16_bits  # noqa: E402
from ctxprefill_client._trace_context import with_trace_context  # noqa: E402
from ctxprefill_client.aio import AsyncPrefillContextClient  # noqa: E402
from inprocess_service import Harness, prefill_req, small_engine  # noqa: E402
from service_process import ROOT, env_with_sources  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

SERVICE = "ctxprefill.v1.PrefillContextService"
STAGES = {"gather", "cast", "kv_b_proj", "pack", "attention", "merge"}


@pytest.fixture(scope="module")
def engine():
    return small_engine()


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    t = tracing.make_tracing(SimpleSpanProcessor(exporter), "test")
    yield t, exporter
    t.shutdown()


def _caller():
    """The caller's own tracer (another provider: its spans are not the server's)."""
    return TracerProvider().get_tracer("caller")


def _children(spans, parent):
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def _one(spans, name):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def _check_request_tree(spans, parent, chunks: int):
    """``parent``'s children are one PrefillContext request's: validate, queue, input, plan,
    ``chunks`` chunk spans with their stage events, output; all within the request."""
    kids = _children(spans, parent)
    names = sorted(s.name for s in kids)
    assert names == sorted(["validate", "queue", "input", "plan", "output"] + ["chunk"] * chunks), names
    by = {s.name: s for s in kids}
    assert by["validate"].end_time <= by["queue"].start_time + 1000  # one after the other (ns, rounding)
    assert by["plan"].attributes["ctxprefill.chunks"] == chunks
    chunk_spans = sorted((s for s in kids if s.name == "chunk"), key=lambda s: s.attributes["ctxprefill.chunk.index"])
    assert [s.attributes["ctxprefill.chunk.index"] for s in chunk_spans] == list(range(chunks))
    for i, c in enumerate(chunk_spans):
        assert c.attributes["ctxprefill.chunk.continuation"] == (i > 0)
        events = [e.name for e in c.events]
        assert events[0] == "gather" and {"kv_b_proj", "attention"} <= set(events) <= STAGES, events
        for e in c.events:
            assert e.attributes["ctxprefill.stage.duration_ns"] >= 0
            assert c.start_time <= e.timestamp <= c.end_time
        assert by["plan"].end_time <= c.start_time and c.end_time <= by["output"].start_time + 1000
    for s in kids:
        assert parent.start_time <= s.start_time <= s.end_time <= parent.end_time, s.name


def test_prefill_span_tree_under_the_callers_span(engine, traced):
    t, exporter = traced

    async def main():
        async with Harness(engine, tracing=t) as h:
            async with AsyncPrefillContextClient(h.target, retries=0, timeout=30) as c:
                q = float32_to_bf16_bits(np.ones((2, 1, 192), np.float32))
                with _caller().start_as_current_span("orchestrator step") as caller:
                    await c.prefill_context(q, [(2, 20, [3, 4])], workspace_tokens=16, request_id="traced-1")
                return caller

    caller = asyncio.run(main())
    spans = exporter.get_finished_spans()
    rpc = _one(spans, f"{SERVICE}/PrefillContext")
    assert rpc.kind == otel_trace.SpanKind.SERVER
    assert rpc.context.trace_id == caller.get_span_context().trace_id
    assert rpc.parent is not None and rpc.parent.span_id == caller.get_span_context().span_id
    assert rpc.parent.is_remote
    a = rpc.attributes
    assert (a["rpc.system"], a["rpc.service"], a["rpc.method"]) == ("grpc", SERVICE, "PrefillContext")
    assert a["rpc.grpc.status_code"] == 0 and a["ctxprefill.request_id"] == "traced-1"
    assert a["ctxprefill.chunks"] == 2 and a["ctxprefill.context_tokens"] == 20 and a["ctxprefill.query_tokens"] == 2
    assert a["ctxprefill.stage_clock"] == "host"
    assert rpc.status.status_code == otel_trace.StatusCode.UNSET
    assert rpc.resource.attributes["service.name"] == "ctxprefill"
    assert rpc.resource.attributes["service.version"] == "test"
    _check_request_tree(spans, rpc, chunks=2)


def test_without_traceparent_the_rpc_span_is_a_root(engine, traced):
    t, exporter = traced

    async def main():
        async with Harness(engine, tracing=t) as h:
            await h.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
            await h.stub.PrefillContext(prefill_req(), timeout=30)  # one chunk

    asyncio.run(main())
    spans = exporter.get_finished_spans()
    info = _one(spans, f"{SERVICE}/GetServerInfo")
    assert info.parent is None and not _children(spans, info)
    rpc = _one(spans, f"{SERVICE}/PrefillContext")
    assert rpc.parent is None
    _check_request_tree(spans, rpc, chunks=1)


def test_a_refused_call_has_its_code_and_no_stage_spans(engine, traced):
    t, exporter = traced

    async def main():
        async with Harness(engine, tracing=t) as h:
            bad = prefill_req(rows=2)
            bad.sequences[0].query_len = 3  # rows != sum(query_len)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await h.stub.PrefillContext(bad, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(main())
    spans = exporter.get_finished_spans()
    rpc = _one(spans, f"{SERVICE}/PrefillContext")
    assert rpc.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert rpc.status.status_code == otel_trace.StatusCode.UNSET  # the caller's error, not the server's
    assert not _children(spans, rpc)


def test_a_server_error_marks_the_span_as_an_error(engine, traced, monkeypatch):
    """INTERNAL (an unexpected exception in the engine) is the server's error: the RPC span's
    status is ERROR with the code, where a caller's error leaves it unset."""
    t, exporter = traced

    def broken(*a, **kw):
        raise ValueError("secret detail")

    monkeypatch.setattr(engine, "start_prefill", broken)

    async def main():
        async with Harness(engine, tracing=t) as h:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await h.stub.PrefillContext(prefill_req(), timeout=30)
            assert e.value.code() == grpc.StatusCode.INTERNAL

    asyncio.run(main())
    rpc = _one(exporter.get_finished_spans(), f"{SERVICE}/PrefillContext")
    assert rpc.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    assert rpc.status.status_code == otel_trace.StatusCode.ERROR and rpc.status.description == "INTERNAL"
    assert "secret detail" not in str(dict(rpc.attributes))  # the details stay in the server's log


def test_stream_requests_get_a_span_each(engine, traced):
    t, exporter = traced

    async def main():
        async with Harness(engine, tracing=t, queue_size=8) as h:
            call = h.stub.PrefillContextStream(timeout=30)
            for i, ctx in enumerate((20, 40)):
                r = prefill_req(context=ctx)
                r.request_id, r.workspace_tokens = f"s{i}", 16
                r.sequences[0].block_table.append(5)  # 3 blocks of 16 hold 40 tokens
                await call.write(pb.PrefillContextStreamRequest(request=r))
            got = [await call.read() for _ in range(2)]
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert all(not g.HasField("error") for g in got)

    asyncio.run(main())
    spans = exporter.get_finished_spans()
    rpc = _one(spans, f"{SERVICE}/PrefillContextStream")
    requests = sorted(_children(spans, rpc), key=lambda s: s.attributes["ctxprefill.request_id"])
    assert [s.name for s in requests] == ["request", "request"]
    assert [s.attributes["ctxprefill.request_id"] for s in requests] == ["s0", "s1"]
    for s, chunks in zip(requests, (2, 3)):  # 20 and 40 context tokens in 16-token chunks
        _check_request_tree(spans, s, chunks)


def test_off_creates_no_span_and_keeps_no_stage_places(engine, monkeypatch):
    assert not any(isinstance(i, TracingInterceptor) for i in server_interceptors(Metrics()))
    asked, stats = [], []
    start = engine.start_prefill

    def start_prefill(request, **kw):
        asked.append(kw.get("timeline", False))
        pending = start(request, **kw)
        result = pending.result

        def keep():
            r = result()
            stats.append(r.stats)
            return r

        pending.result = keep
        return pending

    def never(*a, **k):
        raise AssertionError("tracing is off: nothing may be recorded")

    monkeypatch.setattr(engine, "start_prefill", start_prefill)
    monkeypatch.setattr(tracing, "record_prefill", never)
    monkeypatch.setattr(loop, "DetailedStageTimer", never)

    async def main():
        async with Harness(engine) as h:
            r = prefill_req()
            r.workspace_tokens = 16
            await h.stub.PrefillContext(r, timeout=30)

    asyncio.run(main())
    assert asked == [False]
    assert stats[0].stages is None and stats[0].checked_ns is None and len(stats[0].chunks) == 2


#: run in a fresh interpreter: the composition root's server with tracing off, a raw stub (the
#: client package would import opentelemetry-api for its traceparent), a profiler recording every
#: Python call into the tracing modules or OpenTelemetry while the calls are handled
_OFF_PATH = r"""
import asyncio, json, os, sys, threading
import grpc, numpy as np
from ctxprefill import app
from ctxprefill.service import interceptors, tracing
from ctxprefill.service.interceptors import tracing as tracing_interceptor
from ctxprefill.service.security import load_security
from ctxprefill.settings import ServeSettings
from ctxprefill_api import pb, pb_grpc

s = ServeSettings(device="cpu", heads=1, block_size=16, num_blocks=8, workspace_tokens=64)
assert tracing.from_settings(s.otlp_endpoint) is None
chain, made = [], interceptors.server_interceptors
interceptors.server_interceptors = lambda *a, **k: chain.extend(made(*a, **k)) or chain
watched = {tracing.__file__, tracing_interceptor.__file__}
calls, on = set(), threading.Event()

def profile(frame, event, arg):
    f = frame.f_code.co_filename
    if on.is_set() and event == "call" and (f in watched or os.sep + "opentelemetry" + os.sep in f):
        calls.add(os.path.relpath(f, os.path.dirname(app.__file__)) + ":" + frame.f_code.co_name)

q = np.full((2, 1, 192), 0x3F80, np.uint16)
req = pb.PrefillContextRequest(q=pb.Tensor(dtype=pb.DATA_TYPE_BF16, shape=[2, 1, 192], data=q.tobytes()),
                               sequences=[pb.Sequence(query_len=2, context_len=20, block_table=[3, 4])],
                               workspace_tokens=16)

async def main():
    engine = app.build_engine(s)
    threading.setprofile(profile)  # the engine thread, started by build_server
    sys.setprofile(profile)  # the event loop
    parts = await app.build_server(s, load_security(s), tracing=None)
    parts.servicer.attach_engine(engine)
    parts.servicer.set_ready()
    port = parts.grpc_server.add_insecure_port("127.0.0.1:0")
    await parts.grpc_server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.PrefillContextServiceStub(ch)
            on.set()
            await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
            r = await stub.PrefillContext(req, timeout=30)
            assert r.stats.num_chunks == 2, r.stats
            call = stub.PrefillContextStream(timeout=30)
            await call.write(pb.PrefillContextStreamRequest(request=req))
            got = await call.read()
            assert not got.HasField("error"), got
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF and await call.code() == grpc.StatusCode.OK
            on.clear()
    finally:
        sys.setprofile(None)
        await parts.grpc_server.stop(0)
        parts.worker.stop(5)  # the engine thread ends before the process exits

asyncio.run(main())
print(json.dumps({"chain": [type(i).__name__ for i in chain], "calls": sorted(calls),
                  "otel": sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")}))
"""


def test_off_the_served_path_has_no_interceptor_no_opentelemetry_and_one_lookup():
    """The server as ``ctxprefill serve`` builds it (``app.build_server``) with tracing off:
    its interceptor chain has no tracing interceptor, OpenTelemetry is never imported (so
    no tracer, provider or propagator runs), and of the tracing module only
    ``tracing.current()`` (one ContextVar lookup per PrefillContext request; the cost
    bench/bench_tracing_off.py measures) runs while GetServerInfo, PrefillContext and a
    PrefillContextStream request are handled."""
    env = {k: v for k, v in env_with_sources().items() if not k.startswith("OTEL_")}
    r = subprocess.run([sys.executable, "-c", _OFF_PATH], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["chain"] and "TracingInterceptor" not in got["chain"], got["chain"]
    assert got["otel"] == [], got["otel"]
    assert got["calls"] == ["service/tracing.py:current"], got["calls"]


def test_a_call_not_sampled_records_nothing(engine, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")  # the SDK's sampler from the environment
    exporter = InMemorySpanExporter()
    t = tracing.make_tracing(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "record_prefill", lambda *a, **k: pytest.fail("recorded a span not sampled"))
    monkeypatch.setattr(loop, "DetailedStageTimer", lambda *a: pytest.fail("kept stage places, not sampled"))

    async def main():
        async with Harness(engine, tracing=t) as h:
            await h.stub.PrefillContext(prefill_req(), timeout=30)

    asyncio.run(main())
    assert exporter.get_finished_spans() == ()
    t.shutdown()


# ------------------------------------------------------------------------------ settings


@pytest.mark.parametrize("flag,env,want", [
    (None, {}, None),
    ("http://collector:4317", {}, "http://collector:4317"),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ""),
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, ""),
    (None, {"OTEL_TRACES_EXPORTER": "otlp"}, ""),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, None),
    ("http://collector:4317", {"OTEL_SDK_DISABLED": "true"}, None),
])
def test_when_tracing_is_on(flag, env, want):
    assert tracing.otlp_endpoint(flag, env) == want


def test_from_settings_builds_the_otlp_exporter_and_reads_otel_service_name(monkeypatch):
    for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER",
              "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(k, raising=False)
    assert tracing.from_settings(None) is None
    monkeypatch.setenv("OTEL_SERVICE_NAME", "prefill-east")
    t = tracing.from_settings("http://127.0.0.1:9", "1.2.3")
    assert t is not None
    try:
        res = t.provider.resource.attributes
        assert res["service.name"] == "prefill-east" and res["service.version"] == "1.2.3"
    finally:
        t.shutdown()  # nothing batched: returns without reaching the endpoint


# ------------------------------------------------------------------------------ the stage timer


def test_detailed_stage_timer_keeps_each_stage_place():
    t = DetailedStageTimer("cpu")
    with t.stage("merge"):
        pass
    for i in range(2):
        t.chunk = i
        for name in ("gather", "kv_b_proj", "attention"):
            with t.stage(name):
                time.sleep(0.001)
    stage_ns, _ = t.finish()
    assert t.stages is not None
    assert [(s.stage, s.chunk) for s in t.stages] == [("merge", -1)] + [
        (n, i) for i in range(2) for n in ("gather", "kv_b_proj", "attention")]
    starts = [s.start_ns for s in t.stages]
    assert starts == sorted(starts)
    for a, b in zip(t.stages, t.stages[1:]):
        assert a.start_ns + a.duration_ns <= b.start_ns
    for name, ns in stage_ns.items():
        assert sum(s.duration_ns for s in t.stages if s.stage == name) == ns
    plain = StageTimer("cpu")
    with plain.stage("gather"):
        pass
    plain.finish()
    assert plain.stages is None


def test_engine_timeline_is_kept_only_when_asked(engine):
    from ctxprefill.engine.engine import SequenceSpec
    from ctxprefill.engine.request import PrefillRequest

    q = torch.zeros((2, 1, 192), dtype=torch.bfloat16)
    req = PrefillRequest(q, [SequenceSpec(2, 20, [3, 4])], 16)
    plain = engine.start_prefill(req).result().stats
    assert plain.stages is None and plain.checked_ns is None
    timed = engine.start_prefill(req, timeline=True).result().stats
    a, b = timed.checked_ns
    assert a <= b <= timed.stages[0].start_ns
    assert {s.chunk for s in timed.stages} == {0, 1}
    assert set(timed.stage_ns) == set(plain.stage_ns)
    for name, ns in timed.stage_ns.items():
        assert sum(s.duration_ns for s in timed.stages if s.stage == name) == ns


# ------------------------------------------------------------------------------ the client


def test_client_injects_the_current_traceparent():
    md = (("authorization", "Bearer x"),)
    assert with_trace_context(md) == md  # outside a span: as given
    with _caller().start_as_current_span("step") as span:
        got = dict(with_trace_context(md))
    ctx = span.get_span_context()
    assert got["authorization"] == "Bearer x"
    version, trace_id, span_id, flags = got["traceparent"].split("-")
    assert (version, trace_id, span_id) == ("00", f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    assert int(flags, 16) & 1  # sampled


def test_client_imports_and_calls_without_opentelemetry():
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "import ctxprefill_client, ctxprefill_client.aio\n"
            "from ctxprefill_client._trace_context import with_trace_context, _AVAILABLE\n"
            "assert not _AVAILABLE and with_trace_context((('a', 'b'),)) == (('a', 'b'),)\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_with_sources(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# ------------------------------------------------------------------------------ serve --otlp-endpoint


def test_serve_exports_spans_to_an_otlp_collector():
    """A real ``ctxprefill serve --otlp-endpoint`` and an OTLP/gRPC collector (the
    TraceService of opentelemetry-proto, in this process): the spans arrive by the end of
    the drain, in the caller's trace."""
    from concurrent import futures

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    from ctxprefill_client import PrefillContextClient
    from service_process import ServerProcess

    received: list = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    proc = ServerProcess({"heads": 1, "block_size": 16, "num_blocks": 8, "workspace_tokens": 64,
                          "otlp_endpoint": f"http://127.0.0.1:{port}"}, env={"OTEL_SERVICE_NAME": "prefill-test"})
    try:
        proc.wait_ready()
        with PrefillContextClient(proc.target, retries=0, timeout=60) as c:
            q = float32_to_bf16_bits(np.ones((2, 1, 192), np.float32))
            with _caller().start_as_current_span("caller") as caller:
                c.prefill_context(q, [(2, 20, [3, 4])], workspace_tokens=16)
        assert proc.terminate(30) == 0, proc.log()
    finally:
        proc.kill()
        collector.stop(0)
    spans = [(rs.resource, s) for req in received for rs in req.resource_spans for ss in rs.scope_spans
             for s in ss.spans]
    by_name: dict[str, list] = {}
    for _, s in spans:
        by_name.setdefault(s.name, []).append(s)
    rpc = by_name[f"{SERVICE}/PrefillContext"][0]
    assert rpc.trace_id == caller.get_span_context().trace_id.to_bytes(16, "big")
    assert rpc.parent_span_id == caller.get_span_context().span_id.to_bytes(8, "big")
    assert len(by_name["chunk"]) == 2 and len(by_name["plan"]) == 1
    assert all(s.parent_span_id == rpc.span_id for s in by_name["chunk"] + by_name["validate"] + by_name["output"])
    names = {a.key: a.value.string_value for a in spans[0][0].attributes}
    assert names["service.name"] == "prefill-test"
