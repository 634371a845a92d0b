"""PrefillContext requests over one open call (``PrefillContextStream``).

A new gRPC call costs more than a message on an open one: on the CPU machine a unary
round trip took 340 µs and a stream's message round trip 150–180 µs; on the H200 host
the cheapest unary call took 0.75 ms. For a same-host orchestrator that sends request
after request with its tensors in shared memory, that fixed cost is most of what the
transport adds (docs/TRANSPORT.md), so it can keep one stream open instead:

    with client.prefill_stream() as stream:
        res = stream.prefill_context(q_in, seqs, output_region=out_ref, lse_region=lse_ref)
        ...
        stream.submit(q2, seqs2)          # several requests may be in flight;
        stream.submit(q3, seqs3)
        r2, r3 = stream.result(), stream.result()   # answers come in request order

Each request is checked and run exactly as a ``prefill_context`` call; a request that
fails raises the same exception as the unary call would (the server answers it
in-band and the stream goes on). A broken stream (the server stopped, the stream's
deadline passed) raises :class:`CtxPrefillRpcError` for ``PrefillContextStream``; open
a new one. Requests on a stream are not retried. The stream's ``timeout`` (default: the
client's) bounds the whole stream: give a long-lived stream a long one.
"""

from __future__ import annotations

import asyncio
import collections
import queue
from collections.abc import Iterable
from typing import Any

import grpc

from ctxprefill_api import pb
from ctxprefill_api.wire import nest

from ._common import (
    CtxPrefillError,
    PrefillResult,
    build_prefill_request,
    in_band_error,
    map_rpc_error,
    parse_prefill_response,
    status_error,
)
from ._trace_context import with_trace_context
from .shared_memory import SharedMemoryRef

__all__ = ["AsyncPrefillStream", "PrefillStream"]

METHOD = "PrefillContextStream"
_END = object()


class Pending:
    """What parsing a request's answer needs to know about the request (streams, rings)."""

    __slots__ = ("rows", "output_region", "lse_region", "float_output", "expected")

    def __init__(self, rows: int, output_region: SharedMemoryRef | None, lse_region: SharedMemoryRef | None,
                 float_output: bool, expected: str | None) -> None:
        self.rows, self.output_region, self.lse_region = rows, output_region, lse_region
        self.float_output, self.expected = float_output, expected


def prefill_request(client: Any, q: Any, sequences: Iterable[Any], request_id: str | None,
                    workspace_tokens: int | None, plan: Iterable[Any] | None, q_dtype: int | None,
                    output_region: SharedMemoryRef | None, lse_region: SharedMemoryRef | None,
                    float_output: bool, layer: int | None = None, cache_write: Any = None) -> tuple[Any, Pending]:
    """A PrefillContextRequest as ``client.prefill_context`` builds it, and what its answer
    will be parsed with."""
    expected = client._tracker.expected()
    info = client._info
    req = build_prefill_request(q, sequences, request_id=request_id, workspace_tokens=workspace_tokens, plan=plan,
                                expected=expected, q_dtype=q_dtype,
                                server_prefill_dtype=info.prefill_dtype if info else None,
                                output_region=output_region, lse_region=lse_region, layer=layer,
                                cache_write=cache_write)
    rows = int(req.q.shape[0]) if len(req.q.shape) else 0
    return req, Pending(rows, output_region, lse_region, float_output, expected)


def _request(client: Any, *args: Any) -> tuple[Any, Pending]:
    req, pending = prefill_request(client, *args)
    return nest(pb.PrefillContextStreamRequest(), "request", req), pending


def answer_to_result(client: Any, msg: pb.PrefillContextStreamResponse, p: Pending,
                     method: str = METHOD) -> PrefillResult:
    """An answer in the stream format (also a request ring's): the result, or the
    exception a unary call would have raised for its in-band error."""
    if msg.HasField("error"):
        raise in_band_error(method, msg.error, p.expected)
    resp = msg.response
    client._tracker.observe(method, resp.instance_id)
    return parse_prefill_response(resp, p.rows, p.output_region, p.lse_region, p.float_output)


class PrefillStream:
    """One ``PrefillContextStream`` call of a :class:`PrefillContextClient` (from its
    ``prefill_stream()``). Not thread-safe: one thread sends and reads."""

    def __init__(self, client: Any, timeout: float | None = None) -> None:
        self._client = client
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: collections.deque[Pending] = collections.deque()
        deadline = client.timeout if timeout is None else float(timeout)
        # gRPC's thread takes requests from the queue as they are put
        self._call = client._stub.PrefillContextStream(iter(self._outbox.get, _END), timeout=deadline,
                                                       metadata=with_trace_context(client._metadata))
        self._closed = False

    def submit(self, q: Any, sequences: Iterable[Any], *, request_id: str | None = None,
               workspace_tokens: int | None = None, plan: Iterable[Any] | None = None, q_dtype: int | None = None,
               output_region: SharedMemoryRef | None = None, lse_region: SharedMemoryRef | None = None,
               float_output: bool = True, layer: int | None = None, cache_write: Any = None) -> None:
        """Send one request (arguments as ``PrefillContextClient.prefill_context``); its
        answer is a later :meth:`result`. The memory of its tensors is read when gRPC
        sends it: leave it unchanged until its result is back."""
        if self._closed:
            raise CtxPrefillError("the stream is closed")
        msg, pending = _request(self._client, q, sequences, request_id, workspace_tokens, plan, q_dtype,
                                output_region, lse_region, float_output, layer, cache_write)
        self._pending.append(pending)
        self._outbox.put(msg)

    def result(self) -> PrefillResult:
        """The answer to the oldest request without one (blocks until it arrives)."""
        if not self._pending:
            raise CtxPrefillError("no request in flight on this stream")
        p = self._pending.popleft()
        try:
            msg = next(self._call)
        except grpc.RpcError as err:
            raise map_rpc_error(METHOD, err, p.expected) from err
        except StopIteration:
            raise CtxPrefillError("the server ended the stream before answering every request") from None
        return answer_to_result(self._client, msg, p)

    def prefill_context(self, q: Any, sequences: Iterable[Any], **kwargs: Any) -> PrefillResult:
        """:meth:`submit` then :meth:`result` (no other request may be in flight)."""
        if self._pending:
            raise CtxPrefillError(f"{len(self._pending)} earlier requests are still in flight: read their results "
                                  f"first")
        self.submit(q, sequences, **kwargs)
        return self.result()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def is_open(self) -> bool:
        """False once closed or ended by the server (then open a new one)."""
        return not self._closed and not self._call.done()

    def close(self) -> None:
        """End the stream: half-close, and cancel it if answers are still outstanding."""
        if self._closed:
            return
        self._closed = True
        self._outbox.put(_END)
        if self._pending:
            self._call.cancel()
            self._pending.clear()
            return
        try:
            for _ in self._call:  # the server ends the stream once every answer is out
                pass
        except grpc.RpcError:
            pass

    def __enter__(self) -> PrefillStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncPrefillStream:
    """One ``PrefillContextStream`` call of an :class:`AsyncPrefillContextClient` (from its
    ``prefill_stream()``): the same methods, as coroutines."""

    def __init__(self, client: Any, timeout: float | None = None) -> None:
        self._client = client
        self._pending: collections.deque[Pending] = collections.deque()
        deadline = client.timeout if timeout is None else float(timeout)
        self._call = client._stub.PrefillContextStream(timeout=deadline, metadata=with_trace_context(client._metadata))
        self._closed = False

    async def submit(self, q: Any, sequences: Iterable[Any], *, request_id: str | None = None,
                     workspace_tokens: int | None = None, plan: Iterable[Any] | None = None,
                     q_dtype: int | None = None, output_region: SharedMemoryRef | None = None,
                     lse_region: SharedMemoryRef | None = None, float_output: bool = True,
                     layer: int | None = None, cache_write: Any = None) -> None:
        if self._closed:
            raise CtxPrefillError("the stream is closed")
        msg, pending = _request(self._client, q, sequences, request_id, workspace_tokens, plan, q_dtype,
                                output_region, lse_region, float_output, layer, cache_write)
        self._pending.append(pending)
        try:
            await self._call.write(msg)
        except grpc.RpcError as err:
            self._pending.remove(pending)
            raise map_rpc_error(METHOD, err, pending.expected) from err
        except asyncio.InvalidStateError:  # the call has ended (its deadline passed, the server stopped)
            self._pending.remove(pending)
            code, details = await self._call.code(), await self._call.details()
            if code == grpc.StatusCode.OK:
                raise CtxPrefillError("the server ended the stream") from None
            raise status_error(METHOD, code, details or "", pending.expected) from None

    async def result(self) -> PrefillResult:
        if not self._pending:
            raise CtxPrefillError("no request in flight on this stream")
        p = self._pending.popleft()
        try:
            msg = await self._call.read()
        except grpc.RpcError as err:
            raise map_rpc_error(METHOD, err, p.expected) from err
        if msg is grpc.aio.EOF:
            raise CtxPrefillError("the server ended the stream before answering every request")
        return answer_to_result(self._client, msg, p)

    async def prefill_context(self, q: Any, sequences: Iterable[Any], **kwargs: Any) -> PrefillResult:
        if self._pending:
            raise CtxPrefillError(f"{len(self._pending)} earlier requests are still in flight: read their results "
                                  f"first")
        await self.submit(q, sequences, **kwargs)
        return await self.result()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def is_open(self) -> bool:
        return not self._closed and not self._call.done()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pending:
            self._call.cancel()
            self._pending.clear()
            return
        try:
            await self._call.done_writing()
            while await self._call.read() is not grpc.aio.EOF:
                pass
        except grpc.RpcError:
            pass

    async def __aenter__(self) -> AsyncPrefillStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
