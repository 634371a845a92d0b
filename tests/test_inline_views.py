"""The server's zero-copy parse of inline tensors (server/ctxprefill/service/inline_views.py):
the message it yields, with the views put back as ``data``, equals protobuf's own parse of
the same bytes — for the client's requests, for protobuf's merge rules, and for thousands
of damaged messages (where it either agrees or fails exactly as protobuf does); the views
share gRPC's buffer (no copy); requests without inline tensors come back as plain messages."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ctxprefill.service import inline_views
from ctxprefill.service.inline_views import InlineRequest, data_views, parse
from ctxprefill_api import pb
from ctxprefill_api.wire import serialize_request
from ctxprefill_client._common import build_prefill_request

BF16 = pb.DATA_TYPE_BF16


@pytest.fixture(autouse=True)
def _cut_every_size(monkeypatch):
    """The walk over messages of every size (the server leaves those under MIN_CUT_BYTES to
    protobuf: test_small_messages_go_to_protobuf_as_they_are)."""
    monkeypatch.setattr(inline_views, "MIN_CUT_BYTES", 0)


def test_small_messages_go_to_protobuf_as_they_are(monkeypatch):
    monkeypatch.undo()  # the server's threshold
    n = inline_views.MIN_CUT_BYTES
    for rows, cut in ((1, False), (n // (4 * 192 * 2) + 1, True)):
        raw = serialize_request(build_prefill_request(
            np.ones((rows, 4, 192), np.uint16), [(rows, 0, [])], request_id=None, workspace_tokens=None, plan=None,
            expected=None, q_dtype=None, server_prefill_dtype=None))
        r = parse(pb.PrefillContextRequest, raw)
        assert isinstance(r, InlineRequest) is cut and (len(raw) >= n) is cut
        assert _restored(r, pb.PrefillContextRequest) == pb.PrefillContextRequest.FromString(raw)


def _restored(r, cls):
    """``r`` as protobuf would have parsed it: the views put back as ``data``."""
    if not isinstance(r, InlineRequest):
        return r
    m = cls()
    m.CopyFrom(r.msg)
    for path, view in r.inline.items():
        t = m
        for name in path:
            t = getattr(t, name)
        t.data = bytes(view)
    return m


def _prefill_bytes(rng, cache_write: bool) -> bytes:
    q = rng.integers(0, 1 << 16, size=(5, 2, 192), dtype=np.uint16)
    req = build_prefill_request(q, [(3, 10, [0]), (2, 0, [])], request_id="r", workspace_tokens=None, plan=None,
                                expected=None, q_dtype=BF16, server_prefill_dtype=None)
    raw = serialize_request(req)
    if cache_write:  # appended as its own occurrence: protobuf merges it into the message
        cw = pb.PrefillContextRequest(cache_write=pb.CacheWrite(
            slot_mapping=pb.Tensor(dtype=pb.DATA_TYPE_INT64, shape=[5], data=np.arange(5, dtype=np.int64).tobytes()),
            kv_c=pb.Tensor(dtype=BF16, shape=[5, 512], data=rng.bytes(5 * 512 * 2)),
            k_pe=pb.Tensor(dtype=BF16, shape=[5, 64], data=rng.bytes(5 * 64 * 2))))
        raw += cw.SerializeToString()
    return raw


@pytest.mark.parametrize("cache_write", [False, True])
def test_the_client_s_requests_parse_as_protobuf_parses_them_without_copying_the_tensors(cache_write):
    raw = _prefill_bytes(np.random.default_rng(0), cache_write)
    r = parse(pb.PrefillContextRequest, raw)
    assert isinstance(r, InlineRequest)
    assert _restored(r, pb.PrefillContextRequest) == pb.PrefillContextRequest.FromString(raw)
    assert r.msg.q.data == b"" and r.q.shape == [5, 2, 192] and r.request_id == "r"  # attributes read the message
    want = {("q",)} | ({("cache_write", n) for n in ("slot_mapping", "kv_c", "k_pe")} if cache_write else set())
    assert set(r.inline) == want
    assert all(v.obj is raw for v in r.inline.values())  # views of gRPC's buffer
    assert set(data_views(r, "cache_write")) == ({"slot_mapping", "kv_c", "k_pe"} if cache_write else set())
    assert data_views(pb.PrefillContextRequest.FromString(raw)) == {}

    # the same request as a PrefillContextStream message: its request keeps the views
    wrapped = pb.PrefillContextStreamRequest(request=pb.PrefillContextRequest.FromString(raw)).SerializeToString()
    s = parse(pb.PrefillContextStreamRequest, wrapped)
    inner = inline_views.submessage(s, "request")
    assert isinstance(inner, InlineRequest) and set(inner.inline) == want
    assert _restored(inner, pb.PrefillContextRequest) == pb.PrefillContextRequest.FromString(raw)
    assert inline_views.submessage(pb.PrefillContextStreamRequest.FromString(wrapped), "request") == \
        pb.PrefillContextRequest.FromString(raw)


def test_write_cache_request_and_protobuf_merge_rules():
    kv = pb.Tensor(dtype=BF16, shape=[1, 512], data=b"\x01" * 1024)
    first = pb.WriteCacheRequest(kv_c=kv, layer=3).SerializeToString()
    # a second kv_c occurrence with other data (the last wins) and one without data (merged)
    later = pb.WriteCacheRequest(kv_c=pb.Tensor(data=b"\x02" * 1024)).SerializeToString()
    shape_only = pb.WriteCacheRequest(kv_c=pb.Tensor(shape=[1, 512])).SerializeToString()
    for raw in (first, first + later, first + later + shape_only, later + first):
        r = parse(pb.WriteCacheRequest, raw)
        assert _restored(r, pb.WriteCacheRequest) == pb.WriteCacheRequest.FromString(raw)
    assert bytes(parse(pb.WriteCacheRequest, first + later).inline[("kv_c",)]) == b"\x02" * 1024


def test_a_message_of_many_fields_goes_to_protobuf_s_parser(monkeypatch):
    """The walk is a Python loop per field: past MAX_FIELDS it leaves the message to protobuf
    (the same result, with protobuf's copies) instead of looping a gigabyte of tiny fields."""
    budgets: list[list[int]] = []
    cut = inline_views._cut

    def counting_cut(*args):
        if args[-1] not in budgets:
            budgets.append(args[-1])  # the walk's budget: one list shared by every level
        return cut(*args)

    monkeypatch.setattr(inline_views, "_cut", counting_cut)
    q = pb.Tensor(dtype=BF16, shape=[1, 1, 192], data=b"\x01" * 384)
    few = pb.PrefillContextRequest(q=q, sequences=[pb.Sequence(query_len=1)] * 10).SerializeToString()
    many = pb.PrefillContextRequest(q=q, sequences=[pb.Sequence(query_len=1)] * 100_000).SerializeToString()
    assert isinstance(parse(pb.PrefillContextRequest, few), InlineRequest)
    assert [b[0] >= 0 for b in budgets] == [True]  # walked to the end within the budget
    budgets.clear()
    r = parse(pb.PrefillContextRequest, many)
    assert isinstance(r, pb.PrefillContextRequest) and r == pb.PrefillContextRequest.FromString(many)
    # one walk, given up at the field past MAX_FIELDS: not a Python loop over 100,000 sequences
    assert [b[0] for b in budgets] == [-1]


def test_requests_without_inline_bytes_stay_plain_messages():
    shm = pb.PrefillContextRequest(q=pb.Tensor(dtype=BF16, shape=[1, 1, 192],
                                               shared_memory=pb.SharedMemoryRef(region="r", byte_size=384)))
    r = parse(pb.PrefillContextRequest, shm.SerializeToString())
    assert isinstance(r, pb.PrefillContextRequest) and r == shm
    assert parse(pb.PrefillContextRequest, b"") == pb.PrefillContextRequest()


def test_damaged_messages_parse_or_fail_exactly_as_protobuf_does():
    prng = random.Random(1)
    small = lambda n: pb.Tensor(dtype=BF16, shape=[n], data=bytes(range(2 * n)))  # noqa: E731
    seeds = [
        (pb.PrefillContextRequest, pb.PrefillContextRequest(
            request_id="r", q=small(4), sequences=[pb.Sequence(query_len=2, context_len=3, block_table=[1])],
            cache_write=pb.CacheWrite(slot_mapping=small(2), kv_c=small(3), k_pe=small(1))).SerializeToString()
         + pb.PrefillContextRequest(q=pb.Tensor(data=b"\x05" * 6)).SerializeToString()),
        (pb.WriteCacheRequest, pb.WriteCacheRequest(slot_mapping=small(2), kv_c=small(5), layer=2).SerializeToString()),
    ]
    agreed = gave_up = 0
    for k in range(4000):
        cls, seed = seeds[k % 2]
        raw = bytearray(seed)
        for _ in range(prng.randrange(1, 3)):  # overwrite, insert or drop a byte
            at = prng.randrange(len(raw)) if raw else 0
            op = prng.randrange(3)
            if op == 0 and raw:
                raw[at] = prng.randrange(256)
            elif op == 1:
                raw.insert(at, prng.randrange(256))
            elif raw:
                del raw[at]
        raw = bytes(raw)
        try:
            want = cls.FromString(raw)
        except Exception as e:  # noqa: BLE001
            with pytest.raises(type(e)):
                parse(cls, raw)
            gave_up += 1
            continue
        assert _restored(parse(cls, raw), cls) == want, raw
        agreed += 1
    assert agreed > 400 and gave_up > 400  # both outcomes exercised


def test_layouts_name_every_tensor_field_of_the_requests():
    """A Tensor field added to a request must be listed in LAYOUTS, or its bytes are copied."""
    def tensor_fields(desc, prefix=()):
        out = set()
        for f in desc.fields:
            if f.message_type is pb.Tensor.DESCRIPTOR:
                out.add(prefix + (f.name,))
            elif f.message_type is not None and len(prefix) < 3:  # the messages that hold tensors
                out |= tensor_fields(f.message_type, prefix + (f.name,))
        return out

    def listed(layout, prefix=()):
        out = set()
        for v in layout.values():
            out |= {prefix + (v,)} if isinstance(v, str) else listed(v[1], prefix + (v[0],))
        return out

    for cls, layout in inline_views.LAYOUTS.items():
        assert listed(layout) == tensor_fields(cls.DESCRIPTOR), cls


def test_the_server_parses_prefill_and_write_cache_this_way():
    """The interceptor's table names real methods of the service, with their request types."""
    from ctxprefill.service.interceptors import INLINE_PARSED

    service = pb.DESCRIPTOR.services_by_name["PrefillContextService"]
    for path, cls in INLINE_PARSED.items():
        method = service.methods_by_name[path.rsplit("/", 1)[1]]
        assert path == f"/{service.full_name}/{method.name}" and method.input_type is cls.DESCRIPTOR
    assert set(INLINE_PARSED.values()) == set(inline_views.LAYOUTS)
