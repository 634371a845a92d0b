"""Requests whose tensor bytes are appended at serialization (ctxprefill_client/wire.py)
parse, on the server's side, to the same message as one built the plain protobuf way;
every documented form of a sequence and a plan chunk makes the same message."""

from __future__ import annotations

import numpy as np
import pytest

from ctxprefill_api import pb
from ctxprefill_api.wire import NestedMessage, OutgoingMessage, nest, serialize_request
from ctxprefill_client import BF16, FP8_E4M3, FP32, RawTensor
from ctxprefill_client._common import build_prefill_request, build_write_request

SEQS = [(3, 40, [2, 7, 1]), (2, 0, [])]


def _prefill(q, **kw):
    args = dict(request_id="r1", workspace_tokens=64, plan=None, expected="inst", q_dtype=None,
                server_prefill_dtype=None)
    args.update(kw)
    return build_prefill_request(q, SEQS, **args)


@pytest.mark.parametrize("make", [
    lambda rng: rng.integers(0, 1 << 16, size=(5, 4, 192), dtype=np.uint16),  # bf16 bits
    lambda rng: rng.integers(0, 256, size=(5, 4, 192), dtype=np.uint8),  # fp8 bits
    lambda rng: rng.standard_normal((5, 4, 192), dtype=np.float32),  # rounded to bf16
    lambda rng: RawTensor(FP8_E4M3, rng.integers(0, 256, size=(5, 4, 192), dtype=np.uint8)),
    lambda rng: np.asfortranarray(rng.integers(0, 1 << 16, size=(5, 4, 192), dtype=np.uint16)),  # not C-contiguous
], ids=["bf16-bits", "fp8-bits", "float32", "raw-fp8", "fortran"])
def test_prefill_request_parses_to_the_plain_message(make):
    q = make(np.random.default_rng(1))
    req = _prefill(q)
    assert isinstance(req, OutgoingMessage)
    assert req.q.data == b"" and list(req.q.shape) == [5, 4, 192]  # the message holds no tensor bytes
    got = pb.PrefillContextRequest.FromString(serialize_request(req))
    bits = np.asarray(q.bits if isinstance(q, RawTensor) else q)
    if bits.dtype == np.float32:
        from ctxprefill_client import float32_to_bf16_bits

        bits = float32_to_bf16_bits(bits)
    want = pb.PrefillContextRequest(request_id="r1", workspace_tokens=64, expected_instance_id="inst")
    want.q.dtype = FP8_E4M3 if bits.dtype == np.uint8 else BF16
    want.q.shape.extend([5, 4, 192])
    want.q.data = np.ascontiguousarray(bits).tobytes()
    for ql, cl, bt in SEQS:
        want.sequences.add(query_len=ql, context_len=cl, block_table=bt)
    assert got == want
    assert req.full_message() == want
    # on the wire: the same bytes plus one more tag and length for the second "q"
    assert req.ByteSize() == len(serialize_request(req)) and 0 < req.ByteSize() - want.ByteSize() <= 12


def test_write_request_parses_to_the_plain_message():
    rng = np.random.default_rng(2)
    kv = rng.standard_normal((7, 512), dtype=np.float32)
    pe = rng.integers(0, 1 << 16, size=(7, 64), dtype=np.uint16)
    req = build_write_request(np.arange(7), kv, pe, "inst")
    got = pb.WriteCacheRequest.FromString(serialize_request(req))
    assert got.kv_c.dtype == FP32 and got.kv_c.data == kv.tobytes() and list(got.kv_c.shape) == [7, 512]
    assert got.k_pe.dtype == BF16 and got.k_pe.data == pe.tobytes() and list(got.k_pe.shape) == [7, 64]
    assert np.frombuffer(got.slot_mapping.data, np.int64).tolist() == list(range(7))
    assert got.expected_instance_id == "inst"


def test_empty_tensors_and_plain_messages_pass_through():
    req = _prefill(np.zeros((0, 4, 192), np.uint16), request_id="", expected=None)
    assert isinstance(req, pb.PrefillContextRequest)  # nothing to append: the message itself
    assert list(req.q.shape) == [0, 4, 192] and serialize_request(req) == req.SerializeToString()


def test_a_nested_request_parses_to_the_plain_wrapper():
    """The stream's wrapper around an outgoing request (wire.nest): the same message as the
    wrapper built the plain way, its size computed without serializing; a plain request
    is copied in."""
    q = np.random.default_rng(3).integers(0, 1 << 16, size=(5, 4, 192), dtype=np.uint16)
    req = _prefill(q)
    msg = nest(pb.PrefillContextStreamRequest(), "request", req)
    assert isinstance(msg, NestedMessage)
    raw = serialize_request(msg)
    assert pb.PrefillContextStreamRequest.FromString(raw) == pb.PrefillContextStreamRequest(request=req.full_message())
    assert msg.ByteSize() == len(raw)
    plain = pb.PrefillContextRequest(request_id="p")
    wrapped = nest(pb.PrefillContextStreamRequest(), "request", plain)
    assert isinstance(wrapped, pb.PrefillContextStreamRequest) and wrapped.request == plain


@pytest.mark.parametrize("table, want", [
    ([2, 7, 1], [2, 7, 1]),  # a list of ints: protobuf takes it as it is
    (np.array([2, 7, 1], np.int32), [2, 7, 1]),  # arrays through numpy's tolist
    (np.array([[2, 7], [1, 9]]), [2, 7, 1, 9]),  # flattened
    ((2, 7, 1), [2, 7, 1]),
    ([np.int64(2), np.int32(7), 1], [2, 7, 1]),  # numpy ints in a list
    ([2.0, 7.9, 1], [2, 7, 1]),  # floats in a list: int() each, as before the list fast path
    ([True, 3], [1, 3]),  # bools likewise (protobuf alone refuses them)
])
def test_block_tables_of_every_form_give_the_same_field(table, want):
    req = build_prefill_request(np.zeros((1, 4, 192), np.uint16), [(1, 3, table)], request_id=None,
                                workspace_tokens=None, plan=None, expected=None, q_dtype=None,
                                server_prefill_dtype=None)
    assert list(req.sequences[0].block_table) == want


def test_a_block_table_entry_out_of_int32_range_is_refused():
    for table in ([1, 2**40], np.array([1, 2**40])):
        with pytest.raises(ValueError):
            build_prefill_request(np.zeros((1, 4, 192), np.uint16), [(1, 3, table)], request_id=None,
                                  workspace_tokens=None, plan=None, expected=None, q_dtype=None,
                                  server_prefill_dtype=None)


def test_every_sequence_and_plan_form_gives_the_same_request():
    """Sequences as Sequence, pb.Sequence, dict or tuple, and plan chunks as ContextChunk,
    pb.ContextChunk, dict or 4-tuple, make the same message; anything else is a TypeError
    naming its index."""
    from ctxprefill_client import ContextChunk, Sequence

    q = np.zeros((5, 4, 192), np.uint16)
    seq_forms = [
        [(3, 40, [2, 7, 1]), (2, 0)],
        [Sequence(3, 40, (2, 7, 1)), Sequence(2, 0)],
        [pb.Sequence(query_len=3, context_len=40, block_table=[2, 7, 1]), pb.Sequence(query_len=2)],
        [{"query_len": 3, "context_len": 40, "block_table": [2, 7, 1]}, {"query_len": 2, "context_len": 0}],
    ]
    chunk = (0, 1, (0,), (40,))
    plan_forms = [
        [chunk],
        [ContextChunk(*chunk)],
        [pb.ContextChunk(first_sequence=0, num_sequences=1, context_start=[0], context_len=[40])],
        [{"first_sequence": 0, "num_sequences": 1, "context_start": [0], "context_len": [40]}],
    ]

    def build(seqs, plan):
        return serialize_request(build_prefill_request(q, seqs, request_id=None, workspace_tokens=None, plan=plan,
                                                       expected=None, q_dtype=None, server_prefill_dtype=None))

    want = build(seq_forms[0], plan_forms[0])
    assert {build(s, p) for s in seq_forms for p in plan_forms} == {want}
    parsed = pb.PrefillContextRequest.FromString(want)
    assert [(s.query_len, s.context_len, list(s.block_table)) for s in parsed.sequences] == [(3, 40, [2, 7, 1]),
                                                                                           (2, 0, [])]
    with pytest.raises(TypeError, match=r"^sequences\[1\]"):
        build([(3, 40, [2, 7, 1]), 5], None)
    with pytest.raises(TypeError, match=r"^sequences\[0\]"):
        build([(3,)], None)
    with pytest.raises(TypeError, match=r"^plan\[0\]"):
        build(seq_forms[0], [(0, 1, (0,))])


def test_q_takes_the_servers_prefill_dtype_unless_told():
    """A float q is rounded to bf16, or to fp8 e4m3 for an fp8-prefill server; bits keep their
    own dtype; q_dtype wins; a shared-memory q of another dtype than q_dtype is refused."""
    from ctxprefill_client import SharedMemoryRef, SharedMemoryTensor, float32_to_fp8_e4m3_bits

    q = np.random.default_rng(3).standard_normal((2, 4, 192), dtype=np.float32)

    def sent(x, q_dtype=None, server=None):
        req = build_prefill_request(x, [(2, 0, [])], request_id=None, workspace_tokens=None, plan=None,
                                    expected=None, q_dtype=q_dtype, server_prefill_dtype=server)
        return pb.PrefillContextRequest.FromString(serialize_request(req)).q

    assert sent(q).dtype == BF16 and sent(q, server="bf16").dtype == BF16
    fp8 = sent(q, server="fp8")
    assert fp8.dtype == FP8_E4M3 and fp8.data == float32_to_fp8_e4m3_bits(q).tobytes()
    assert sent(q, q_dtype=BF16, server="fp8").dtype == BF16
    assert sent(np.zeros((2, 4, 192), np.uint16), server="fp8").dtype == BF16  # bits say what they are
    shm = SharedMemoryTensor(BF16, (2, 4, 192), SharedMemoryRef("r", 0, 2 * 4 * 192 * 2))
    with pytest.raises(ValueError, match="^q: the shared-memory tensor is BF16, q_dtype asks for FP8_E4M3$"):
        sent(shm, q_dtype=FP8_E4M3)
