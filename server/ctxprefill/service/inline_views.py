"""Inline tensor bytes as views of the received message instead of copies.

A PrefillContext request carrying q inline (25 MB for 4,096 tokens at 16 heads) would
cost the server two copies of those bytes before it reads them: protobuf's parse copies
every ``bytes`` field into the message, and each access of ``Tensor.data`` builds a new
Python ``bytes`` (on the CPU machine 18 ms and 17 ms for 25 MB). gRPC hands the
deserializer the whole message as one ``bytes`` object, which nobody writes into: here
the ``data`` fields of the request's tensors are cut out of it, the rest is parsed by
protobuf as usual, and each tensor's bytes stay a ``memoryview`` of gRPC's buffer
(:class:`InlineRequest`). The message protobuf sees is the request minus those fields;
``codec.decode`` gets the view through its ``data`` argument and checks it exactly as it
checks ``Tensor.data``.

The cut follows the protobuf wire format, over untrusted bytes: every tag, varint and
length is bounds-checked, and anything unexpected (a group, a truncated field, a tensor
field with the wrong wire type, more than ``MAX_FIELDS`` fields) gives up and lets
protobuf parse the original bytes — which then answers exactly as it would have (the
request, or INVALID_ARGUMENT for bytes that do not parse). Protobuf's merge rules are
kept: a submessage field that occurs twice is one message (the client sends
``q {dtype shape}`` then ``q {data}``: ``ctxprefill_api.wire``), and of several
``data`` occurrences the last one wins.
"""

from __future__ import annotations

from ctxprefill_api import pb

_LEN, _VARINT, _I64, _I32 = 2, 0, 1, 5
_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number

#: per request type, its tensor fields and the submessages that hold tensor fields
#: (field number -> name, or -> (name, nested layout))
_CACHE_WRITE = {1: "slot_mapping", 2: "kv_c", 3: "k_pe"}
_PREFILL = {2: "q", 10: ("cache_write", _CACHE_WRITE)}
LAYOUTS = {
    pb.PrefillContextRequest: _PREFILL,
    pb.WriteCacheRequest: dict(_CACHE_WRITE),
    pb.PrefillContextStreamRequest: {1: ("request", _PREFILL)},
}


#: fields the cut walks at most (all levels): a Python loop over each field, so a message of
#: many small fields (a legal one has up to 65,536 sequences; a hostile one could pack a
#: gigabyte of two-byte fields) goes to protobuf's C parser instead, with its copies
MAX_FIELDS = 1024
#: messages shorter than this are parsed by protobuf as they are: the walk costs a small
#: request (a shared-memory one: block tables, references) 10-25 us of Python, more than
#: protobuf's two copies of at most this many tensor bytes (a few us)
MIN_CUT_BYTES = 64 << 10


class _GiveUp(Exception):
    """The bytes are not what the cut expects; protobuf parses them as they are."""


class InlineRequest:
    """A request message whose inline tensor bytes are held beside it: ``inline`` maps a
    field path (``("q",)``, ``("cache_write", "kv_c")``) to a memoryview of the bytes the
    request carried in that tensor's ``data``. Attributes read the message."""

    __slots__ = ("msg", "inline")

    def __init__(self, msg, inline: dict):
        self.msg, self.inline = msg, inline

    def __getattr__(self, name):
        return getattr(self.msg, name)


def data_views(request, *prefix: str) -> dict[str, memoryview]:
    """``{tensor field name: its inline bytes}`` of the submessage at ``prefix`` (empty for
    a plain message: its tensors' ``data`` are in the message itself)."""
    inline = request.inline if isinstance(request, InlineRequest) else None
    if not inline:
        return {}
    n = len(prefix)
    return {path[n]: v for path, v in inline.items() if len(path) == n + 1 and path[:n] == prefix}


def submessage(request, name: str):
    """``request.<name>``, with the inline bytes of its tensors when ``request`` has them
    (a stream's message: its ``request``)."""
    msg = getattr(request, name)
    views = {path[1:]: v for path, v in request.inline.items() if path[0] == name} \
        if isinstance(request, InlineRequest) else None
    return InlineRequest(msg, views) if views else msg


def _varint(buf: memoryview, i: int, end: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if i >= end or shift > 63:
            raise _GiveUp
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, i
        shift += 7


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _skip(buf: memoryview, i: int, end: int, wire: int) -> int:
    """The end of a field's value starting at ``i``."""
    if wire == _VARINT:
        return _varint(buf, i, end)[1]
    if wire == _LEN:
        n, i = _varint(buf, i, end)
        if n > end - i:
            raise _GiveUp
        return i + n
    if wire in (_I64, _I32):
        j = i + (8 if wire == _I64 else 4)
        if j > end:
            raise _GiveUp
        return j
    raise _GiveUp  # groups (3, 4) and unknown wire types


def _cut(buf: memoryview, start: int, end: int, layout, path: tuple, views: dict,
         in_tensor: bool, budget: list) -> tuple[list, bool]:
    """The pieces of ``buf[start:end]`` with the tensors' ``data`` fields left out (their
    views recorded in ``views``), and whether anything was cut. ``budget``: ``[fields the
    walk may still read]``, shared by every level."""
    pieces, run, i, cut = [], start, start, False
    while i < end:
        budget[0] -= 1
        if budget[0] < 0:
            raise _GiveUp
        tag_at = i
        tag, i = _varint(buf, i, end)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise _GiveUp
        value_end = _skip(buf, i, end, wire)
        inner = None if in_tensor else layout.get(field)
        if in_tensor and field == _DATA:
            if wire != _LEN:
                raise _GiveUp
            n, data_at = _varint(buf, i, end)
            views[path] = buf[data_at:data_at + n]  # the last occurrence wins, as in protobuf
            pieces.append(buf[run:tag_at])
            run, cut = value_end, True
        elif inner is not None:
            if wire != _LEN:
                raise _GiveUp
            n, body = _varint(buf, i, end)
            name, sub = (inner, None) if isinstance(inner, str) else inner
            sub_pieces, sub_cut = _cut(buf, body, body + n, sub, path + (name,), views, sub is None, budget)
            if sub_cut:
                size = sum(len(p) for p in sub_pieces)
                pieces += [buf[run:tag_at], _encode_varint(tag), _encode_varint(size)] + sub_pieces
                run, cut = value_end, True
        i = value_end
    pieces.append(buf[run:end])
    return pieces, cut


def parse(cls, raw: bytes):
    """``cls.FromString(raw)``, as an :class:`InlineRequest` when tensor bytes were cut out
    (see the module's docstring); the plain message when there were none, the bytes are
    not what the cut expects, or the message is shorter than ``MIN_CUT_BYTES``."""
    if len(raw) < MIN_CUT_BYTES:
        return cls.FromString(raw)
    layout = LAYOUTS[cls]
    views: dict = {}
    try:
        buf = memoryview(raw)
        pieces, cut = _cut(buf, 0, len(buf), layout, (), views, False, [MAX_FIELDS])
    except _GiveUp:
        return cls.FromString(raw)
    if not cut:
        return cls.FromString(raw)
    return InlineRequest(cls.FromString(b"".join(pieces)), views)
