"""PrefillContextStream (in-process server on the CPU): requests over one call give what
PrefillContext gives, in request order, several in flight; a failed request is answered
in-band and the stream goes on; a message that does not parse ends the stream; the
client's AsyncPrefillStream maps in-band errors to the unary call's exceptions; both
clients' streams refuse misuse with an error that says so and report a stream past its
deadline as DEADLINE_EXCEEDED."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import numpy as np
import pytest

from ctxprefill.service.interceptors import INTERNAL_MESSAGE
from ctxprefill_api import pb
from ctxprefill_client import (
    AsyncPrefillContextClient,
    CtxPrefillError,
    CtxPrefillRpcError,
    PrefillContextClient,
    ServerRestartedError,
)
from inprocess_service import Harness, prefill_req, small_engine
from service_process import parse_metrics, sample_sum

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

@pytest.fixture(scope="module")
def engine():
    return small_engine()


TIMINGS = {"stage_nanos", "total_nanos", "validate_nanos", "queue_nanos", "input_nanos", "compute_nanos",
           "output_nanos"}


def _stats_without_timings(st: pb.Stats) -> dict:
    return {f.name: v for f, v in st.ListFields() if f.name not in TIMINGS}


def _stream_count(h: Harness, code: str) -> float:
    return sample_sum(parse_metrics(h.metrics.render().decode())["ctxprefill_stream_requests_total"],
                      grpc_code=code)


def test_stream_answers_equal_unary_calls_in_request_order(engine):
    async def main():
        async with Harness(engine, queue_size=8) as h:
            reqs = []
            for i, (rows, ctx) in enumerate(((1, 20), (3, 32), (2, 0), (4, 17))):
                r = prefill_req(rows=rows, context=ctx)
                r.request_id = f"r{i}"
                reqs.append(r)
            unary = [await h.stub.PrefillContext(r, timeout=30) for r in reqs]
            call = h.stub.PrefillContextStream(timeout=30)
            for r in reqs:  # all sent before any answer is read
                await call.write(pb.PrefillContextStreamRequest(request=r))
            got = [await call.read() for _ in reqs]
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
            for r, u, g in zip(reqs, unary, got):
                assert g.request_id == r.request_id and not g.HasField("error")
                resp = g.response
                assert resp.request_id == r.request_id and resp.instance_id == u.instance_id
                assert resp.output.data == u.output.data and list(resp.output.shape) == list(u.output.shape)
                assert resp.lse.data == u.lse.data
                assert _stats_without_timings(resp.stats) == _stats_without_timings(u.stats)
                assert resp.stats.total_nanos > 0
            assert _stream_count(h, "OK") == len(reqs)
            assert h.handled("PrefillContextStream", "OK") == 1  # the stream, once

    asyncio.run(main())


def test_a_failed_request_is_answered_in_band_and_the_stream_goes_on(engine):
    async def main():
        async with Harness(engine) as h:
            good = prefill_req(rows=2, context=20)
            bad_block = prefill_req(rows=2, context=20)
            bad_block.sequences[0].block_table[1] = 99  # outside [0, 8)
            bad_block.request_id = "bad-1"
            bad_rows = prefill_req(rows=2, context=20)
            bad_rows.sequences[0].query_len = 3
            call = h.stub.PrefillContextStream(timeout=30)
            answers = []
            for r in (bad_block, good, bad_rows, good):
                await call.write(pb.PrefillContextStreamRequest(request=r))
                answers.append(await call.read())
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
            a, b, c, d = answers
            assert a.error.code == grpc.StatusCode.OUT_OF_RANGE.value[0] and not a.HasField("response")
            assert "sequences[0].block_table[1]" in a.error.message and a.request_id == "bad-1"
            assert c.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "query_len" in c.error.message
            assert c.request_id  # made up by the server, as for a unary call
            assert b.response.output.data == d.response.output.data and not b.HasField("error")
            assert _stream_count(h, "OUT_OF_RANGE") == 1 and _stream_count(h, "INVALID_ARGUMENT") == 1
            assert _stream_count(h, "OK") == 2
            assert h.handled("PrefillContextStream", "OK") == 1

    asyncio.run(main())


def test_a_message_that_does_not_parse_ends_the_stream(engine):
    async def main():
        async with Harness(engine) as h:
            raw = h.channel.stream_stream(f"/{pb.DESCRIPTOR.services_by_name['PrefillContextService'].full_name}"
                                          f"/PrefillContextStream", request_serializer=lambda b: b,
                                          response_deserializer=pb.PrefillContextStreamResponse.FromString)
            call = raw(timeout=30)
            await call.write(pb.PrefillContextStreamRequest(request=prefill_req()).SerializeToString())
            first = await call.read()
            assert not first.HasField("error")
            await call.write(b"\x0a\xff\xff\xff")  # field 1, a length past the end
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request" in e.value.details()
            assert h.handled("PrefillContextStream", "INVALID_ARGUMENT") == 1
            # the server goes on
            assert (await h.stub.PrefillContext(prefill_req(), timeout=30)).output.data == first.response.output.data

    asyncio.run(main())


def test_async_client_stream(engine):
    async def main():
        async with Harness(engine, queue_size=8) as h:
            async with AsyncPrefillContextClient("in-process", channel=h.channel, timeout=30, retries=0) as c:
                q = np.random.default_rng(1).standard_normal((3, 1, 192), dtype=np.float32)
                seqs = [(3, 20, [3, 4])]
                want = await c.prefill_context(q, seqs)
                async with c.prefill_stream() as s:
                    got = await s.prefill_context(q, seqs, request_id="a")
                    assert got.request_id == "a"
                    np.testing.assert_array_equal(got.output_bits, want.output_bits)
                    np.testing.assert_array_equal(got.lse.view(np.uint32), want.lse.view(np.uint32))
                    assert got.stats["phase_nanos"]["compute"] > 0
                    with pytest.raises(CtxPrefillRpcError) as e:
                        await s.prefill_context(q, [(3, 20, [3, 99])])
                    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE and e.value.method == "PrefillContextStream"
                    assert s.is_open  # an in-band error leaves the stream usable
                    await s.submit(q, seqs, request_id="b")
                    await s.submit(q, seqs, request_id="c")
                    assert s.in_flight == 2
                    with pytest.raises(CtxPrefillError, match="in flight"):  # prefill_context: one at a time
                        await s.prefill_context(q, seqs)
                    assert [(await s.result()).request_id for _ in range(2)] == ["b", "c"]
                    assert s.in_flight == 0
                assert not s.is_open
            # a client that expects another instance: the in-band FAILED_PRECONDITION is a restart
            async with AsyncPrefillContextClient("in-process", channel=h.channel, timeout=30, retries=0,
                                                 expected_instance_id="gone") as c:
                async with c.prefill_stream() as s:
                    with pytest.raises(ServerRestartedError):
                        await s.prefill_context(q, seqs)
            assert h.handled("PrefillContextStream", "OK") == 2

    asyncio.run(main())


def test_a_stream_ends_with_unavailable_when_the_server_drains(engine, monkeypatch):
    """Draining: a request running on the stream is answered, then the stream ends at once
    with UNAVAILABLE (not when the grace period runs out); an idle stream ends at once."""
    gate, started = threading.Event(), threading.Event()
    orig = engine.start_prefill  # what the service calls

    def slow(*a, **kw):
        started.set()
        assert gate.wait(20)
        return orig(*a, **kw)

    async def main():
        async with Harness(engine) as h:
            idle = h.stub.PrefillContextStream(timeout=30)
            await idle.write(pb.PrefillContextStreamRequest(request=prefill_req()))
            assert not (await idle.read()).HasField("error")
            busy = h.stub.PrefillContextStream(timeout=30)
            monkeypatch.setattr(engine, "start_prefill", slow)
            await busy.write(pb.PrefillContextStreamRequest(request=prefill_req(rows=3)))
            await asyncio.get_running_loop().run_in_executor(None, started.wait, 20)
            h.servicer.start_draining()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await idle.read()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
            assert h.servicer.in_flight == 1  # ended while the busy request still runs
            gate.set()  # the running request completes and is answered before the stream ends
            answer = await busy.read()
            assert not answer.HasField("error") and list(answer.response.output.shape)[0] == 3
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await busy.read()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert h.handled("PrefillContextStream", "UNAVAILABLE") == 2

    try:
        asyncio.run(main())
    finally:
        gate.set()


def test_a_stream_reads_no_more_than_the_queue_holds(engine, monkeypatch):
    """A client that sends without reading answers: the server reads at most queue_size
    requests of the stream ahead (the rest wait in gRPC flow control, not in our memory),
    none is refused for a full queue, and all are answered in order once the engine runs."""
    gate = threading.Event()
    orig = engine.start_prefill  # what the service calls

    def slow(*a, **kw):
        assert gate.wait(20)
        return orig(*a, **kw)

    monkeypatch.setattr(engine, "start_prefill", slow)

    def received(h) -> float:
        return sample_sum(parse_metrics(h.metrics.render().decode())["grpc_server_msg_received_total"],
                          grpc_method="PrefillContextStream")

    async def main():
        async with Harness(engine, queue_size=4) as h:
            call = h.stub.PrefillContextStream(timeout=60)
            reqs = []
            for i in range(12):
                r = prefill_req(rows=1 + i % 3)
                r.request_id = f"n{i}"
                reqs.append(r)
                await call.write(pb.PrefillContextStreamRequest(request=r))
            await asyncio.sleep(0.5)
            assert received(h) == 4  # the reader waits for room before reading a fifth
            gate.set()
            got = [await call.read() for _ in reqs]
            assert [g.request_id for g in got] == [r.request_id for r in reqs]
            assert not any(g.HasField("error") for g in got)
            assert received(h) == 12
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK

    try:
        asyncio.run(main())
    finally:
        gate.set()


def test_an_unexpected_error_is_internal_in_band_and_the_stream_goes_on(engine, monkeypatch, caplog):
    """As for a unary call (test_service_inprocess): INTERNAL with a generic message, the
    details only in the server log; the next request on the stream is answered."""
    orig = engine.start_prefill  # what the service calls
    calls = []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("secret detail")
        return orig(*a, **kw)

    monkeypatch.setattr(engine, "start_prefill", flaky)

    async def main():
        async with Harness(engine) as h:
            call = h.stub.PrefillContextStream(timeout=30)
            answers = []
            for _ in range(2):
                await call.write(pb.PrefillContextStreamRequest(request=prefill_req()))
                answers.append(await call.read())
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
            bad, good = answers
            assert bad.error.code == grpc.StatusCode.INTERNAL.value[0] and bad.error.message == INTERNAL_MESSAGE
            assert not good.HasField("error") and good.response.output.data
            assert _stream_count(h, "INTERNAL") == 1 and _stream_count(h, "OK") == 1

    with caplog.at_level(logging.ERROR, logger="ctxprefill.service"):
        asyncio.run(main())
    assert any("secret detail" in r.getMessage() and "PrefillContextStream" in r.getMessage() for r in caplog.records)


def test_client_streams_refuse_misuse_and_cancel_what_is_in_flight_on_close(engine):
    """Both clients' streams: a result with none in flight and a request on a closed stream
    are errors that say so; closing with a request in flight cancels the call (no answer
    waited for); a stream past its deadline reports DEADLINE_EXCEEDED naming the method."""
    q = np.random.default_rng(2).standard_normal((3, 1, 192), dtype=np.float32)
    seqs = [(3, 20, [3, 4])]

    def sync_client(target: str) -> None:
        with PrefillContextClient(target, timeout=30, retries=0) as c:
            s = c.prefill_stream()
            with pytest.raises(CtxPrefillError, match="no request in flight"):
                s.result()
            s.submit(q, seqs)
            s.close()
            assert not s.is_open and s.in_flight == 0
            with pytest.raises(CtxPrefillError, match="the stream is closed"):
                s.submit(q, seqs)
            s.close()  # again: nothing to do
            with c.prefill_stream(timeout=0.2) as late:
                time.sleep(0.5)
                late.submit(q, seqs)
                with pytest.raises(CtxPrefillRpcError) as e:
                    late.result()
                assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and e.value.method == "PrefillContextStream"

    async def main():
        async with Harness(engine, queue_size=8) as h:
            await asyncio.get_running_loop().run_in_executor(None, sync_client, h.target)
            async with AsyncPrefillContextClient("in-process", channel=h.channel, timeout=30, retries=0) as c:
                s = c.prefill_stream()
                with pytest.raises(CtxPrefillError, match="no request in flight"):
                    await s.result()
                await s.submit(q, seqs)
                await s.close()
                assert not s.is_open and s.in_flight == 0
                with pytest.raises(CtxPrefillError, match="the stream is closed"):
                    await s.submit(q, seqs)
                await s.close()
                late = c.prefill_stream(timeout=0.2)
                await asyncio.sleep(0.5)
                with pytest.raises(CtxPrefillRpcError) as e:
                    await late.submit(q, seqs)
                    await late.result()
                assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and e.value.method == "PrefillContextStream"
                assert late.in_flight == 0  # a request the ended call never took is not left pending
                await late.close()

    asyncio.run(main())
