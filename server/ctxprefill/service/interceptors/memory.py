"""The memory that calls hold, bounded: every message read and every answer sent
counts against one budget, ``--max-inflight-bytes`` (CONTRACT §8; docs/RELIABILITY.md
"Memory bounds").

gRPC buffers a whole message before a handler sees it (once a read is asked of it, the
stream's flow-control window opens to the length its prefix announces), and holds an
answer until the client has taken it. This interceptor, the outermost, therefore has
gRPC drive every method with a streamed request and does the reading itself:

- a call whose behavior needs no request (refused by the token check: ``auth.py``) is
  answered without its message ever being read: what the client sends is dropped with
  the stream;
- a read reserves ``--max-message-bytes`` from the moment it is asked of gRPC until the
  message is in, then holds the message's size: a unary request's until its handler
  returns, a stream's message until an answer is sent after it (the streams here answer
  message by message) or the call ends. No room: a unary read waits its turn for the
  call's deadline or ``--receive-timeout-s`` at most, then is refused with
  RESOURCE_EXHAUSTED naming the flag; a stream's next read waits as long as it takes
  (the client sees flow control);
- a unary request not in within ``--receive-timeout-s`` ends its call (DEADLINE_EXCEEDED);
- an answer is charged when its handler returns it (``charge_answer``, from the wire
  interceptor: twice its size, the serialized bytes and gRPC's copy of them; refused at
  once with RESOURCE_EXHAUSTED when the budget has no room) until gRPC has sent it or
  the call has ended;
- an answer not taken within ``--send-timeout-s`` of being handed to gRPC closes its
  client's connection (grpcio's server cannot cancel a call whose answer waits on the
  client's flow-control window: ``connections.py``), every call on it ends and what
  they held is given back. Keepalive (``--keepalive-time-s``) closes a connection whose
  client stopped reading it altogether sooner or later; the send timeout also ends a
  client that reads its connection, acknowledging pings, but never opens its window.

The transport's own checks (``transport.py``) ask :func:`answer_room` before anything
is allocated.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from ..connections import ConnectionCloser
from .handlers import HandlerInterceptor, behavior_of, reads_request, rebuild
from .status import RpcStatusError

log = logging.getLogger("ctxprefill.service")

#: stands for "the client half-closed before a message" in a read's result
_EOF = object()


@dataclasses.dataclass(frozen=True)
class MemoryLimits:
    """The flags of CONTRACT §8 this interceptor enforces."""

    max_message_bytes: int
    max_inflight_bytes: int
    max_answer_bytes: int
    receive_timeout_s: float
    send_timeout_s: float = 60.0


class Budget:
    """Bytes held by all calls together, at most ``capacity``; waiters served in order."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.held = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def room(self) -> int:
        return self.capacity - self.held

    def try_take(self, n: int) -> bool:
        if self.held + n > self.capacity:
            return False
        self.held += n
        return True

    async def take(self, n: int, timeout: float | None) -> bool:
        """Wait, behind the earlier waiters, until ``n`` bytes fit; False after
        ``timeout`` seconds (None: no limit)."""
        if not self._waiters and self.try_take(n):
            return True
        if timeout is not None and timeout <= 0:
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, waiter))
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
            return True
        except BaseException as e:
            if waiter.done() and not waiter.cancelled():
                self.give(n)  # granted just as it gave up
            else:
                waiter.cancel()
                self._wake()  # the next waiter may fit now
            if isinstance(e, TimeoutError):
                return False
            raise

    def give(self, n: int) -> None:
        self.held -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, waiter = self._waiters[0]
            if waiter.done():  # gave up
                self._waiters.popleft()
                continue
            if not self.try_take(n):
                return
            self._waiters.popleft()
            waiter.set_result(None)


class CallMemory:
    """What one call holds of the budget, given back as its messages are answered and
    all of it when the call ends."""

    def __init__(self, budget: Budget, limits: MemoryLimits, refused: Callable[[str], None] = lambda reason: None):
        self.budget, self.limits = budget, limits
        self.refused = refused  # counts an answer refused for ``reason``
        self.held = 0
        self.messages: collections.deque[int] = collections.deque()  # bytes of messages read, not yet answered
        self.answers: collections.deque[int] = collections.deque()  # bytes charged to answers not yet sent
        self.inner_ran = False  # its handler ran: the inner interceptors counted the call
        self.timer: asyncio.TimerHandle | None = None  # the send timeout of the answer gRPC is sending

    def take_now(self, n: int) -> bool:
        if not self.budget.try_take(n):
            return False
        self.held += n
        return True

    async def take(self, n: int, timeout: float | None) -> bool:
        if not await self.budget.take(n, timeout):
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        n = min(n, self.held)
        self.held -= n
        self.budget.give(n)

    def answered(self) -> None:
        """One answer sent: it and the message it answers are given back (a stream's)."""
        if self.answers:
            self.give(self.answers.popleft())
        if self.messages:
            self.give(self.messages.popleft())

    def sending(self, expire: Callable[[], None]) -> None:
        """An answer handed to gRPC: ``expire`` runs unless it is sent (:meth:`sent`) or
        the call ends within ``--send-timeout-s``."""
        self.timer = asyncio.get_running_loop().call_later(self.limits.send_timeout_s, expire)

    def sent(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def on_done(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.close()

    def close(self) -> None:
        self.sent()
        self.messages.clear()
        self.answers.clear()
        self.give(self.held)


_CALL: contextvars.ContextVar[CallMemory | None] = contextvars.ContextVar("ctxprefill_call_memory", default=None)


def _no_room(what: str, nbytes: int, budget: Budget) -> RpcStatusError:
    return RpcStatusError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"{what} needs {nbytes} bytes and the server's calls hold {budget.held} of --max-inflight-bytes "
        f"{budget.capacity}; retry later", "inflight_bytes")


def answer_room(field: str, nbytes: int) -> None:
    """Refuse, before anything is allocated, an answer carrying ``nbytes`` bytes of
    tensor data over ``--max-answer-bytes`` or over what the budget has free now
    (RESOURCE_EXHAUSTED naming the flag). Outside a call under :class:`MemoryInterceptor`
    (request rings; servers built without limits) there is nothing to check."""
    call = _CALL.get()
    if call is None:
        return
    limit = call.limits.max_answer_bytes
    if nbytes > limit:
        call.refused("answer_bytes")
        raise RpcStatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{field}: the answer would carry {nbytes} bytes of tensor data, over the server's "
                             f"--max-answer-bytes {limit}; split the request", "answer_bytes")
    if 2 * nbytes > call.budget.room():
        call.refused("inflight_bytes")
        raise _no_room(f"{field}: the answer", 2 * nbytes, call.budget)


def charge_answer(response: Any) -> None:
    """Charge an answer a handler returned to its call: twice its serialized size (the
    bytes, and gRPC's copy of them until they are sent); RESOURCE_EXHAUSTED at once when
    the budget has no room. Nothing outside a call under :class:`MemoryInterceptor`."""
    call = _CALL.get()
    if call is None or response is None:
        return
    n = 2 * int(response.ByteSize())
    if not call.take_now(n):
        call.refused("inflight_bytes")
        raise _no_room("the answer", n, call.budget)
    call.answers.append(n)


def _passthrough(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes]:
    """The serializer gRPC gets: answers serialized here go as they are (a handler's own
    ``context.write`` of a message, as the health service's Watch does, is serialized)."""
    def serialize_response(response: Any) -> bytes:
        if isinstance(response, bytes):
            return response
        assert serialize is not None
        return serialize(response)

    return serialize_response


def _sizing(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], tuple[int, Any]]:
    """The deserializer gRPC gets: each message with its size, ``(bytes, message)``."""
    def deserialize_request(raw: bytes) -> tuple[int, Any]:
        return len(raw), raw if deserialize is None else deserialize(raw)

    return deserialize_request


async def _no_messages() -> AsyncIterator[Any]:
    nothing: tuple[Any, ...] = ()
    for r in nothing:
        yield r


class Refusal(Exception):
    """A call this interceptor ends itself (it is outside the status interceptor)."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str):
        super().__init__(message)
        self.code, self.message, self.reason = code, message, reason


#: what records a call this interceptor ended: (method, kind, code, reason, counted by the inner interceptors)
Recorder = Callable[[str, str, grpc.StatusCode, str, bool], None]


class MemoryInterceptor(HandlerInterceptor):
    """Outermost: every method driven with a streamed request, its messages read and
    its answers charged under :class:`MemoryLimits`. ``record`` counts the calls it
    ends itself (the metrics interceptor's :meth:`~.metrics.MetricsInterceptor.record`);
    ``closer`` closes the connection of an answer past its send timeout."""

    per_method = True  # a call's own state is made when it starts (``_Driven._open``)

    def __init__(self, limits: MemoryLimits, record: Recorder, closer: ConnectionCloser | None = None):
        super().__init__()
        self.limits = limits
        self.budget = Budget(limits.max_inflight_bytes)
        self.record = record
        self.closer = closer if closer is not None else ConnectionCloser()

    def wrap(self, handler: grpc.RpcMethodHandler[Any, Any], kind: str,
             details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        driven = _Driven(self, handler, kind, details.method)
        streaming = handler.response_streaming
        return rebuild(handler, behavior=driven.stream if streaming else driven.unary,
                       shape="bidi_stream" if streaming else "client_stream",
                       deserializer=_sizing(handler.request_deserializer), serializer=driven.serialize)


class _Driven:
    """One method's calls: each one's request read, its handler run, its answers
    serialized, under the call's own :class:`CallMemory`."""

    def __init__(self, owner: MemoryInterceptor, handler: grpc.RpcMethodHandler[Any, Any], kind: str, method: str):
        self.owner, self.kind, self.method = owner, kind, method
        self.inner = behavior_of(handler)
        self.unary_request = not handler.request_streaming
        self.needs_request = reads_request(handler)
        self.serialize = _passthrough(handler.response_serializer)

    def _answer_refused(self, reason: str) -> None:
        self.owner.record(self.method, self.kind, grpc.StatusCode.RESOURCE_EXHAUSTED, reason, True)

    def _open(self, context: grpc.aio.ServicerContext[Any, Any]) -> CallMemory:
        """The call's memory, given back when it ends; its own task (and the tasks it
        starts) see it (``_CALL``)."""
        call = CallMemory(self.owner.budget, self.owner.limits, self._answer_refused)
        context.add_done_callback(call.on_done)  # type: ignore[arg-type]  # the stubs want their own class
        _CALL.set(call)
        return call

    async def read(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any],
                   call: CallMemory) -> Any:
        """The next message (``_EOF`` at the end), read under the budget."""
        lim = self.owner.limits
        wait: float | None = None  # a stream's next read waits for room: its client sees flow control
        if self.unary_request:
            remaining = context.time_remaining()
            wait = lim.receive_timeout_s if remaining is None else min(lim.receive_timeout_s, remaining)
        if not await call.take(lim.max_message_bytes, wait):
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"no room to receive the request: the server's calls hold {call.budget.held} of "
                          f"--max-inflight-bytes {call.budget.capacity}, and a message being read reserves "
                          f"--max-message-bytes ({lim.max_message_bytes}); retry later", "inflight_bytes")
        got: Any = _EOF
        try:
            if self.unary_request:
                try:
                    got = await asyncio.wait_for(anext(requests, _EOF), lim.receive_timeout_s)
                except TimeoutError:
                    raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"the request was not received within --receive-timeout-s "
                                  f"{lim.receive_timeout_s:g}", "receive_timeout") from None
            else:
                got = await anext(requests, _EOF)
        finally:
            kept = min(got[0], lim.max_message_bytes) if got is not _EOF else 0
            call.give(lim.max_message_bytes - kept)  # in: it holds its own size from now on
            if kept:
                call.messages.append(kept)
        return _EOF if got is _EOF else got[1]

    async def messages(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any],
                       call: CallMemory) -> AsyncIterator[Any]:
        while (message := await self.read(requests, context, call)) is not _EOF:
            yield message

    async def request(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any],
                      call: CallMemory) -> Any:
        """What the inner behavior gets: the unary request, or the stream's messages."""
        if not self.needs_request:
            return None if self.unary_request else _no_messages()
        if not self.unary_request:
            return self.messages(requests, context, call)
        request = await self.read(requests, context, call)
        if request is _EOF:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "request: the call ended before its message",
                          "no_message")
        return request

    def refused(self, context: grpc.aio.ServicerContext[Any, Any], e: Refusal, call: CallMemory) -> None:
        log.info("%s -> %s: %s", self.method, e.code.name, e.message, extra={"method": self.method,
                                                                            "code": e.code.name})
        context.set_code(e.code)
        context.set_details(e.message)
        self.owner.record(self.method, self.kind, e.code, e.reason, call.inner_ran)

    def _send_timed_out(self, context: grpc.aio.ServicerContext[Any, Any], call: CallMemory) -> None:
        """The answer was not taken within ``--send-timeout-s``: close its connection."""
        call.timer = None
        peer = context.peer()
        closed = self.owner.closer.close(peer)
        log.warning("%s: the answer was not taken within --send-timeout-s %g; %s", self.method,
                    self.owner.limits.send_timeout_s,
                    "its connection is closed" if closed else "its connection was not found (keepalive bounds it)",
                    extra={"method": self.method, "peer": peer, "closed": closed})
        self.owner.record(self.method, self.kind, grpc.StatusCode.CANCELLED, "send_timeout", True)

    async def unary(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """A unary answer, serialized; its charge is given back once gRPC has sent it
        (or the call ended)."""
        call = self._open(context)
        try:
            request = await self.request(requests, context, call)
            call.inner_ran = True
            response = await self.inner(request, context)
            del request
            while call.messages:  # the handler is done with its request
                call.give(call.messages.popleft())
            code = context.code()
            if response is None or (code is not None and code != grpc.StatusCode.OK):
                return None
            raw = self.serialize(response)  # the bytes only: the tensors they were made of go now
            call.sending(lambda: self._send_timed_out(context, call))  # until the call ends
            return raw
        except Refusal as e:
            self.refused(context, e, call)
            return None

    async def stream(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
                     ) -> AsyncIterator[bytes]:
        """Streamed answers, serialized; each one's charge (and the message it answers)
        given back once gRPC has sent it."""
        call = self._open(context)
        try:
            request = await self.request(requests, context, call)
            call.inner_ran = True
            result = self.inner(request, context)
            del request
            if not inspect.isasyncgen(result):  # a handler that writes with context.write
                await result
                return
            async for response in result:
                raw = self.serialize(response)
                del response
                call.sending(lambda: self._send_timed_out(context, call))
                yield raw  # back here once gRPC has sent it
                call.sent()
                del raw
                call.answered()
        except Refusal as e:
            self.refused(context, e, call)
