"""Messages whose tensor bytes are not copied into the protobuf message.

A request's big inline tensors (PrefillContext's q, WriteCache's latents) would go
numpy → ``bytes`` → the ``Tensor`` message → ``SerializeToString`` (upb: 21 ms for 25 MB
on the CPU machine, 7× a memcpy) → gRPC: four copies of every byte before gRPC's own. An
:class:`OutgoingMessage` keeps the message without those bytes and appends each
tensor's ``data`` field at serialization, from the numpy buffer, in one ``bytes.join``:
protobuf merges a submessage field that occurs twice, so ``q {dtype shape}`` followed
by ``q {data}`` parses as one ``q`` (the server sees the same message).

The client's stubs for WriteCache and PrefillContext serialize with
:func:`serialize_request`, which takes a plain message too; the server sends its
inline results (PrefillContext's output and LSE, ReadCache's slots) the same way. The tensor's memory is read
when the request is sent (again on a retry): leave it unchanged until the call returns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ctxprefill_api import pb

_DATA_FIELD = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_LEN = 2  # wire type of bytes and submessages


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _header(field_number: int, nbytes: int) -> bytes:
    """The bytes before an ``nbytes`` buffer in ``field_number { data: ... }`` on the wire."""
    inner = _varint((_DATA_FIELD << 3) | _LEN) + _varint(nbytes)
    return _varint((field_number << 3) | _LEN) + _varint(len(inner) + nbytes) + inner


def _data_field(field_number: int, bits: np.ndarray) -> list[bytes | memoryview]:
    """``field_number { data: bits }`` on the wire: the header, then the buffer itself."""
    buf = np.ascontiguousarray(bits).data.cast("B")
    return [_header(field_number, buf.nbytes), buf]


class OutgoingMessage:
    """A message plus tensor bytes that travel beside it until serialization.

    Attribute access reads the message (``req.q.shape``); the message's tensors have
    their dtype and shape but no ``data`` (:meth:`full_message` makes the whole one).
    """

    __slots__ = ("msg", "_payloads")

    def __init__(self, msg: Any, payloads: list[tuple[int, np.ndarray]]):
        self.msg = msg
        self._payloads = payloads  # (field number in msg, bits)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.msg, name)

    def parts(self) -> list[bytes | memoryview]:
        """The serialized message as buffers to join: the message, then each tensor's bytes."""
        parts: list[bytes | memoryview] = [self.msg.SerializeToString()]
        for number, bits in self._payloads:
            parts += _data_field(number, bits)
        return parts

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf message method's name
        return b"".join(self.parts())

    def ByteSize(self) -> int:  # noqa: N802
        """The serialized size, computed (nothing is copied)."""
        size: int = self.msg.ByteSize()
        return size + sum(len(_header(number, bits.nbytes)) + bits.nbytes for number, bits in self._payloads)

    def full_message(self) -> Any:
        """The same request as one protobuf message (copies the bytes in: for tests)."""
        return type(self.msg).FromString(self.SerializeToString())


class NestedMessage:
    """``outer`` with ``inner`` (an :class:`OutgoingMessage`) as its submessage field
    ``number``, serialized in one join: the stream RPC's wrappers
    (``PrefillContextStreamRequest.request``, ``...StreamResponse.response``) carry
    inline tensors without copying their bytes into messages."""

    __slots__ = ("outer", "number", "inner")

    def __init__(self, outer: Any, number: int, inner: OutgoingMessage):
        self.outer, self.number, self.inner = outer, number, inner

    def _head(self) -> bytes:
        return _varint((self.number << 3) | _LEN) + _varint(self.inner.ByteSize())

    def SerializeToString(self) -> bytes:  # noqa: N802
        return b"".join([self.outer.SerializeToString(), self._head(), *self.inner.parts()])

    def ByteSize(self) -> int:  # noqa: N802
        size: int = self.outer.ByteSize()
        return size + len(self._head()) + self.inner.ByteSize()


def nest(outer: Any, field: str, inner: Any) -> Any:
    """``outer`` with ``inner`` in its submessage ``field``: a :class:`NestedMessage` when
    ``inner`` is an :class:`OutgoingMessage`, else ``outer`` itself with ``inner`` copied in."""
    if isinstance(inner, OutgoingMessage):
        return NestedMessage(outer, outer.DESCRIPTOR.fields_by_name[field].number, inner)
    getattr(outer, field).CopyFrom(inner)
    return outer


def place_tensor(msg: Any, field: str, value: Any, payloads: list[tuple[int, np.ndarray]]) -> None:
    """Put ``value`` into ``msg.<field>``: a ``Tensor`` message (a shared-memory reference)
    by ``CopyFrom``; ``(wire dtype, bits)`` as dtype and shape, its bytes to ``payloads``."""
    target = getattr(msg, field)
    if isinstance(value, pb.Tensor):
        target.CopyFrom(value)
        return
    wire, bits = value
    target.dtype = wire
    target.shape.extend(int(s) for s in bits.shape)
    if bits.size:
        payloads.append((msg.DESCRIPTOR.fields_by_name[field].number, bits))


def finish(msg: Any, payloads: list[tuple[int, np.ndarray]]) -> Any:
    """``msg`` itself when it carries no inline tensor bytes, else an :class:`OutgoingMessage`."""
    return OutgoingMessage(msg, payloads) if payloads else msg


def serialize_request(request: Any) -> bytes:
    """The stubs' request serializer: a protobuf message or an :class:`OutgoingMessage`."""
    data: bytes = request.SerializeToString()
    return data


_SERVICE = "/" + pb.DESCRIPTOR.services_by_name["PrefillContextService"].full_name + "/"


def use_outgoing_requests(stub: Any, channel: Any) -> None:
    """Give ``stub`` (a generated ``PrefillContextServiceStub``, sync or aio) WriteCache,
    PrefillContext and PrefillContextStream callables that serialize with
    :func:`serialize_request`."""
    stub.WriteCache = channel.unary_unary(_SERVICE + "WriteCache", request_serializer=serialize_request,
                                          response_deserializer=pb.WriteCacheResponse.FromString)
    stub.PrefillContext = channel.unary_unary(_SERVICE + "PrefillContext", request_serializer=serialize_request,
                                              response_deserializer=pb.PrefillContextResponse.FromString)
    stub.PrefillContextStream = channel.stream_stream(
        _SERVICE + "PrefillContextStream", request_serializer=serialize_request,
        response_deserializer=pb.PrefillContextStreamResponse.FromString)
