"""Requests answered in-band: PrefillContextStream's (many requests on one call) and
request rings' (requests in shared-memory slots, no call at all). A failed request does
not end its stream or ring: its answer carries the status a unary call would end with
(``RequestError``), counted by code (``ctxprefill_stream_requests_total``,
``ctxprefill_ring_requests_total``)."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Counter

from ctxprefill_api import SERVICE_NAME, pb
from ctxprefill_api.wire import nest

from . import codec, inline_views
from .engine_worker import oom_guarded
from .interceptors import RpcStatusError, status_for
from .logs import request_id_for_logs, request_id_var
from .metrics import Metrics
from .prefill import PrefillCall
from .request_ring import AttachedRing
from .shared_memory import caller_peer

STREAM_METHOD = f"/{SERVICE_NAME}/PrefillContextStream"  # what an in-band error's log line names
RING_METHOD = f"/{SERVICE_NAME}/AttachRequestRing"


def in_band_error(e: Exception, where: str, counter: Counter, request_id: str) -> pb.PrefillContextStreamResponse:
    """The answer to a stream's or a ring's failed request: the status a unary call would
    end with (logged), counted by code; the request id as sent (cut to what decoding
    allows: it may be why the request failed)."""
    code, message = status_for(e, where)
    counter.labels(grpc_code=code.name).inc()
    return pb.PrefillContextStreamResponse(error=pb.RequestError(code=code.value[0], message=message),
                                           request_id=request_id[:codec.MAX_REQUEST_ID])


async def answer_one(prefill: Callable[[Any, str], Awaitable[Any]], msg: Any, metrics: Metrics) -> Any:
    """A stream's request run as PrefillContext (``prefill(msg, request_id)``), its
    answer or its error in-band."""
    request_id = msg.request_id or uuid.uuid4().hex
    try:
        resp = await prefill(msg, request_id)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - answered in-band, with the status a unary call would get
        return in_band_error(e, STREAM_METHOD, metrics.stream_requests, request_id)
    metrics.stream_requests.labels(grpc_code="OK").inc()
    return nest(pb.PrefillContextStreamResponse(request_id=request_id), "response", resp)


async def answer_stream(request_iterator: AsyncIterator[Any], answer: Callable[[Any], Awaitable[Any]], room: int,
                        draining: asyncio.Event) -> AsyncIterator[Any]:
    """The answers of one PrefillContextStream call, in order. Requests are read (and
    started: ``answer`` of each) as they arrive, while earlier ones run, at most
    ``room`` read and not yet answered: a client that sends without reading is held
    back by gRPC flow control, not by our memory. Once ``draining`` is set the stream
    ends with UNAVAILABLE as soon as every request read so far has its answer."""
    pending: asyncio.Queue[Any] = asyncio.Queue()
    end = object()
    space = asyncio.Semaphore(room)
    requests = request_iterator.__aiter__()

    async def read() -> None:
        try:
            while True:
                await space.acquire()
                msg = await anext(requests, None)
                if msg is None:
                    break
                request = inline_views.submessage(msg, "request")  # with its inline tensors' views
                pending.put_nowait(asyncio.ensure_future(answer(request)))
        finally:
            pending.put_nowait(end)

    reader = asyncio.ensure_future(read())
    drained = asyncio.ensure_future(draining.wait())
    get = None
    try:
        while True:
            if drained.done():
                if pending.empty():
                    # every request read has its answer: end the stream now, not when the
                    # grace period runs out, so that the caller reconnects elsewhere at once
                    raise RpcStatusError(grpc.StatusCode.UNAVAILABLE,
                                         "the server is draining: this stream ends after answering every "
                                         "request it read; open a new one (to another instance)", "draining")
                task = pending.get_nowait()
            else:
                get = asyncio.ensure_future(pending.get())
                await asyncio.wait((get, drained), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()  # an item it was about to take stays in the queue
                    continue
                task = get.result()
            if task is end:
                break
            response = await task
            space.release()
            yield response
        await reader  # a message that did not parse ends the stream (INVALID_ARGUMENT)
    finally:
        drained.cancel()
        if get is not None:
            get.cancel()
        reader.cancel()
        while not pending.empty():
            task = pending.get_nowait()
            if task is not end:
                task.cancel()


def start_ring_request(ring: AttachedRing, slot: int, payload: bytes | None, defer: list[Callable[[], None]], *,
                       open_call: Callable[[Any, str, int], PrefillCall], metrics: Metrics,
                       release: Callable[[], int] | None = None) -> Callable[[], bytes]:
    """On the engine thread: one ring request (from ``slot``), run as PrefillContext —
    parsed, opened (``open_call(msg, request_id, t0)``) and its device work queued;
    returns a function that waits for it (a stream-ordered ring's: that does not) and
    returns the answer's bytes (a PrefillContextStreamResponse: the response, or the
    error in-band; at once for a request refused before it reached the device).
    ``defer`` takes what may run once the answer is written."""
    t0 = time.perf_counter_ns()
    request_id = ""
    try:
        if payload is None:
            raise RpcStatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"length: the request's length is more than a slot's {ring.payload_bytes} "
                                 f"payload bytes", "invalid")
        try:
            # the payload is this thread's own copy of the slot: q may stay a view of it
            msg = inline_views.parse(pb.PrefillContextRequest, payload)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError
            raise RpcStatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                 "the slot does not hold a serialized PrefillContextRequest", "invalid") from None
        request_id = msg.request_id or uuid.uuid4().hex
        request_id_var.set(request_id_for_logs(request_id))
        caller_peer.set(ring.peer)  # the regions it names are used as the attaching caller's
        call = open_call(msg, request_id, t0)
        call.stop.gone = ring.stopped.done  # the ring let go: the request stops between chunks
        try:
            order = ring.order.slot(slot) if ring.order is not None else None
            finish = oom_guarded(functools.partial(call.start, defer, order), metrics, release)
        finally:
            call.abandon()  # releases only if the work never started
    except Exception as e:  # noqa: BLE001 - answered in-band, with the status a unary call would get
        data = in_band_error(e, RING_METHOD, metrics.ring_requests, request_id).SerializeToString()
        return lambda: data

    def answer() -> bytes:
        request_id_var.set(request_id_for_logs(request_id))  # the next request may have set it
        try:
            done = None if finish is None else oom_guarded(finish, metrics, release)
            data: bytes = nest(pb.PrefillContextStreamResponse(request_id=request_id), "response",
                               call.response(done)).SerializeToString()
            if len(data) > ring.payload_bytes:
                raise RpcStatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"the answer takes {len(data)} bytes, a slot holds {ring.payload_bytes}: ask "
                                     f"for output_region and lse_region, or attach a ring with larger slots",
                                     "answer_too_large")
            defer.append(lambda: metrics.ring_requests.labels(grpc_code="OK").inc())
            return data
        except Exception as e:  # noqa: BLE001 - answered in-band
            return in_band_error(e, RING_METHOD, metrics.ring_requests, request_id).SerializeToString()

    return answer
