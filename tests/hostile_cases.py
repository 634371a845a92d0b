"""Hostile requests against a running ctxprefill server, and what each must get back.

Used by ``tests/test_hostile_input.py`` (hypothesis draws the mutations) and by
``scripts/hostile_under_sanitizer.sh`` (``python tests/hostile_cases.py --target ...``
draws them from a seeded ``random.Random``). No server code is imported: everything
about the server comes from GetServerInfo and from its answers.

A :class:`Workload` fills every slot of the cache with random latents, snapshots the
cache bytes (ReadCache of all slots) and computes the reference answer of a valid
PrefillContext request (four sequences, one without context, a request workspace
that gives continuation chunks) — all before any hostile request. Each mutation then
takes one valid request, breaks exactly one thing, and says which status codes may
come back and which field the message must name. Some "mutations" are valid on
purpose (NaN/inf in q, all-skipped writes of NaN latents, the server's own plan sent
back as an explicit plan): they must succeed, bit for bit.

NaN and inf (decided in docs/RELIABILITY.md): they are values, not malformed input.
q may hold them — only the rows that hold them are affected (CONTRACT §3: "nothing is NaN
unless an input is"); kv_c / k_pe may hold them — the cache stores them per CONTRACT §2
(NaN stays NaN, fp8 saturates ±inf). No request field but tensor data is a float.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable

import grpc
import numpy as np

try:
    from ctxprefill_api import pb
    from ctxprefill_client import encode_tensor, float32_to_bf16_bits, float32_to_fp8_e4m3_bits
except ImportError:  # run as a script from the repository root
    import os

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(_root, "client"))
    from ctxprefill_api import pb
    from ctxprefill_client import encode_tensor, float32_to_bf16_bits, float32_to_fp8_e4m3_bits

SERVICE = "/ctxprefill.v1.PrefillContextService/"
IA = grpc.StatusCode.INVALID_ARGUMENT
OOR = grpc.StatusCode.OUT_OF_RANGE
FP = grpc.StatusCode.FAILED_PRECONDITION
OK = grpc.StatusCode.OK
#: what a malformed request may get; never UNKNOWN or INTERNAL
REFUSALS = (IA, OOR, FP)

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
ALL_DTYPES = (pb.DATA_TYPE_UNSPECIFIED, pb.DATA_TYPE_BF16, pb.DATA_TYPE_FP16, pb.DATA_TYPE_FP32,
              pb.DATA_TYPE_FP8_E4M3, pb.DATA_TYPE_INT32, pb.DATA_TYPE_INT64, pb.DATA_TYPE_UINT8)
ITEMSIZE = {pb.DATA_TYPE_BF16: 2, pb.DATA_TYPE_FP16: 2, pb.DATA_TYPE_FP32: 4, pb.DATA_TYPE_FP8_E4M3: 1,
            pb.DATA_TYPE_INT32: 4, pb.DATA_TYPE_INT64: 8, pb.DATA_TYPE_UINT8: 1}


# ------------------------------------------------------------------------------ drawing


class Drawer:
    """Where the randomness comes from: hypothesis (``HypothesisDrawer``) or a seeded
    ``random.Random`` (``RandomDrawer``)."""

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def choice(self, seq):
        return seq[self.integer(0, len(seq) - 1)]

    def boolean(self) -> bool:
        return self.integer(0, 1) == 1

    def outside(self, lo: int, hi: int, min_value: int, max_value: int) -> int:
        """An integer in [min_value, max_value] but not in [lo, hi] (one side must be non-empty)."""
        sides = []
        if min_value <= lo - 1:
            sides.append((min_value, lo - 1))
        if hi + 1 <= max_value:
            sides.append((hi + 1, max_value))
        a, b = self.choice(sides)
        return self.integer(a, b)


class RandomDrawer(Drawer):
    """Seeded; biased towards the ends of each range (where the off-by-ones live)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        r = self.rng.random()
        if r < 0.15:
            return lo
        if r < 0.3:
            return hi
        if r < 0.4:
            return min(hi, lo + 1)
        return self.rng.randint(lo, hi)


class HypothesisDrawer(Drawer):
    def __init__(self, data):
        from hypothesis import strategies as st

        self._st = st
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(self._st.integers(min_value=lo, max_value=hi))


# ------------------------------------------------------------------------------ cases


@dataclasses.dataclass
class Case:
    kind: str
    method: str
    payload: bytes
    codes: tuple  # the status codes allowed
    field: str | None = None  # must appear in the details of a refusal
    check: Callable[[bytes], None] | None = None  # for a success: checks the response bytes

    @property
    def hostile(self) -> bool:
        return OK not in self.codes


def _copy(msg):
    m = type(msg)()
    m.CopyFrom(msg)
    return m


class Workload:
    """A valid workload on the server behind ``channel`` and the reference answers."""

    CONTEXTS = (40, 0, 17, 33)
    QUERIES = (3, 2, 4, 1)

    def __init__(self, channel: grpc.Channel, seed: int = 0, metadata=()):
        self.channel = channel
        self.metadata = tuple(metadata)
        self.rpc = {m: channel.unary_unary(SERVICE + m) for m in ("GetServerInfo", "WriteCache", "ReadCache",
                                                                   "PrefillContext")}
        info = pb.GetServerInfoResponse.FromString(self.call("GetServerInfo", b""))
        self.info = info
        self.H, self.D = info.num_heads, info.qk_nope_head_dim + info.qk_rope_head_dim
        self.L, self.R, self.V = info.kv_lora_rank, info.qk_rope_head_dim, info.v_head_dim
        self.bs, self.num_blocks = info.block_size, info.num_blocks
        self.num_slots = self.bs * self.num_blocks
        self.bps = info.bytes_per_slot
        self.fp8 = info.prefill_dtype == "fp8"
        self.q_wire = pb.DATA_TYPE_FP8_E4M3 if self.fp8 else pb.DATA_TYPE_BF16
        self.other_q_wire = pb.DATA_TYPE_BF16 if self.fp8 else pb.DATA_TYPE_FP8_E4M3
        self.server_W = info.workspace_tokens
        self.W = 2 * self.bs  # the request's workspace: continuation chunks
        assert self.server_W >= self.W, "the hostile workload needs a server workspace of at least 2 blocks"
        self.max_message_bytes = info.max_message_bytes
        self.instance_id = info.instance_id
        rng = np.random.default_rng(seed)
        need = [math.ceil(c / self.bs) for c in self.CONTEXTS]
        assert sum(need) <= self.num_blocks
        perm = rng.permutation(self.num_blocks).tolist()
        self.tables, at = [], 0
        for n in need:
            self.tables.append(perm[at:at + n] + perm[at + n:at + n + 1])  # one spare entry past the used prefix
            at += n
        Tq = sum(self.QUERIES)
        x = rng.standard_normal((Tq, self.H, self.D)).astype(np.float32)
        self.q_bits = float32_to_fp8_e4m3_bits(x) if self.fp8 else float32_to_bf16_bits(x)
        self.rng = rng

    # -- plumbing -----------------------------------------------------------------------
    def call(self, method: str, payload: bytes, timeout: float = 60.0) -> bytes:
        return self.rpc[method](payload, timeout=timeout, metadata=self.metadata)

    def prefill_request(self, plan: bool = False) -> pb.PrefillContextRequest:
        req = pb.PrefillContextRequest(
            request_id="hostile-base",
            q=encode_tensor(self.q_bits, self.q_wire),
            sequences=[pb.Sequence(query_len=q, context_len=c, block_table=bt)
                       for q, c, bt in zip(self.QUERIES, self.CONTEXTS, self.tables)],
            workspace_tokens=self.W,
        )
        if plan:
            req.plan.extend(self.plan)
        return req

    def write_request(self, T: int = 4) -> pb.WriteCacheRequest:
        slots = self.rng.integers(0, self.num_slots, T).astype(np.int64)
        kv_c = self.rng.standard_normal((T, self.L)).astype(np.float32)
        k_pe = self.rng.standard_normal((T, self.R)).astype(np.float32)
        return pb.WriteCacheRequest(slot_mapping=encode_tensor(slots), kv_c=encode_tensor(kv_c),
                                    k_pe=encode_tensor(k_pe))

    def read_request(self, T: int = 4) -> pb.ReadCacheRequest:
        return pb.ReadCacheRequest(slot_mapping=encode_tensor(self.rng.integers(0, self.num_slots, T).astype(np.int64)))

    # -- set-up: every slot written, the cache snapshot, the reference answers -------------
    def setup(self) -> None:
        per = max(1, min(self.num_slots, (self.max_message_bytes // 2) // ((self.L + self.R) * 4)))
        for s0 in range(0, self.num_slots, per):
            n = min(per, self.num_slots - s0)
            req = pb.WriteCacheRequest(
                slot_mapping=encode_tensor(np.arange(s0, s0 + n, dtype=np.int64)),
                kv_c=encode_tensor((self.rng.standard_normal((n, self.L)) * 2).astype(np.float32)),
                k_pe=encode_tensor(self.rng.standard_normal((n, self.R)).astype(np.float32)))
            assert pb.WriteCacheResponse.FromString(self.call("WriteCache", req.SerializeToString())).slots_written == n
        self.snapshot = self.read_all()
        raw = self.call("PrefillContext", self.prefill_request().SerializeToString())
        resp = pb.PrefillContextResponse.FromString(raw)
        self.ref_out = np.frombuffer(resp.output.data, np.uint16).reshape(sum(self.QUERIES), self.H, self.V).copy()
        self.ref_lse = np.frombuffer(resp.lse.data, np.uint32).reshape(self.H, sum(self.QUERIES)).copy()
        assert resp.stats.num_chunks > 2
        self.plan = [_copy(c) for c in resp.stats.chunks]
        assert any(c.context_start[0] > 0 for c in self.plan)  # a continuation chunk

    def read_all(self) -> np.ndarray:
        per = max(1, (self.max_message_bytes // 2) // self.bps)
        parts = []
        for s0 in range(0, self.num_slots, per):
            n = min(per, self.num_slots - s0)
            req = pb.ReadCacheRequest(slot_mapping=encode_tensor(np.arange(s0, s0 + n, dtype=np.int64)))
            r = pb.ReadCacheResponse.FromString(self.call("ReadCache", req.SerializeToString()))
            parts.append(np.frombuffer(r.slots.data, np.uint8).reshape(n, self.bps))
        return np.concatenate(parts)

    # -- checks of valid answers -------------------------------------------------------------
    def check_prefill(self, poisoned_rows=()) -> Callable[[bytes], None]:
        keep = np.ones(sum(self.QUERIES), bool)
        keep[list(poisoned_rows)] = False

        def check(raw: bytes) -> None:
            r = pb.PrefillContextResponse.FromString(raw)
            out = np.frombuffer(r.output.data, np.uint16).reshape(self.ref_out.shape)
            lse = np.frombuffer(r.lse.data, np.uint32).reshape(self.ref_lse.shape)
            assert np.array_equal(out[keep], self.ref_out[keep]), "output differs from the reference"
            assert np.array_equal(lse[:, keep], self.ref_lse[:, keep]), "lse differs from the reference"
            assert r.instance_id == self.instance_id

        return check

    def check_read(self, slots: np.ndarray) -> Callable[[bytes], None]:
        def check(raw: bytes) -> None:
            r = pb.ReadCacheResponse.FromString(raw)
            got = np.frombuffer(r.slots.data, np.uint8).reshape(len(slots), self.bps)
            assert np.array_equal(got, self.snapshot[slots]), "ReadCache bytes differ from the snapshot"

        return check


# ------------------------------------------------------------------------------ mutations
# Each takes (drawer, workload) and returns one Case that breaks exactly one thing.


def _bad_dtype(d: Drawer, allowed: tuple) -> int:
    bad = [t for t in ALL_DTYPES if t not in allowed]
    if d.integer(0, 3) == 0:  # an enum value no release knows
        return d.choice([d.integer(8, I32_MAX), d.integer(I32_MIN, -1)])
    return d.choice(bad)


def _resize(data: bytes, d: Drawer) -> bytes:
    """data with a different length: truncated, emptied or extended."""
    how = d.integer(0, 2)
    if how == 0 and len(data) > 0:
        return data[: d.integer(0, len(data) - 1)]
    if how == 1:
        return data + b"\xa5" * d.integer(1, 4096)
    return data + b"\x00"


def _bad_shape(d: Drawer, good: list[int]) -> list[int]:
    """A shape other than ``good`` (the data is left as it is)."""
    while True:
        how = d.integer(0, 5)
        shape = list(good)
        if how == 0:  # another number of dimensions
            nd = d.choice([k for k in range(0, 10) if k != len(good)])
            shape = [d.integer(0, 8) for _ in range(nd)]
        elif how == 1:  # one extent changed, any int64
            i = d.integer(0, len(good) - 1)
            shape[i] = d.integer(I64_MIN, I64_MAX)
        elif how == 2:  # a negative extent
            shape[d.integer(0, len(good) - 1)] = d.integer(I64_MIN, -1)
        elif how == 3:  # huge extents whose product overflows int64
            shape = [d.integer(2**31, I64_MAX) for _ in good]
        elif how == 4:  # an extent off by a little
            i = d.integer(0, len(good) - 1)
            shape[i] = max(0, shape[i] + d.choice([-1, 1, 2, 7]))
        else:  # too many dimensions, all 1
            shape = [1] * d.integer(9, 64)
        if shape != list(good):
            return shape


def _garbage(payload: bytes, message_type, d: Drawer) -> bytes:
    """Bytes that are not a valid ``message_type``: a valid message cut, a bad UTF-8
    string, or noise — always followed by a length prefix that runs past the end."""
    how = d.integer(0, 2)
    if how == 0 and payload:
        raw = payload[: d.integer(0, len(payload) - 1)]
    elif how == 1:
        bad = bytes([0xC3, 0x28, 0xFF, 0xFE][: d.integer(1, 4)])
        raw = payload + b"\x0a" + bytes([len(bad)]) + bad  # field 1 (a string where it is one) with bad UTF-8
        if _parses(raw, message_type):
            raw += b"\x0a\x7f"
    else:
        raw = bytes(d.integer(0, 255) for _ in range(d.integer(0, 24)))
    if _parses(raw, message_type):
        raw += b"\x1a\xff\xff\x03"  # field 3, length-delimited, 65535 bytes that never come
    assert not _parses(raw, message_type)
    return raw


def _parses(raw: bytes, message_type) -> bool:
    try:
        message_type.FromString(raw)
        return True
    except Exception:  # noqa: BLE001 - DecodeError
        return False


# -- PrefillContext ------------------------------------------------------------------------


def m_q_dtype(d, w):
    req = w.prefill_request()
    if d.boolean():  # the other prefill dtype, bytes resized to match the shape
        req.q.dtype = w.other_q_wire
        n = math.prod(req.q.shape) * ITEMSIZE[w.other_q_wire]
        req.q.data = (req.q.data * 2)[:n]
        kind = "q fp8 on a bf16 server" if w.other_q_wire == pb.DATA_TYPE_FP8_E4M3 else "q bf16 on an fp8 server"
    else:
        req.q.dtype = _bad_dtype(d, (w.q_wire,))
        kind = "q dtype"
    return Case(kind, "PrefillContext", req.SerializeToString(), (IA,), "q")


def m_q_shape(d, w):
    req = w.prefill_request()
    shape = _bad_shape(d, list(req.q.shape))
    del req.q.shape[:]
    req.q.shape.extend(shape)
    return Case("q shape", "PrefillContext", req.SerializeToString(), (IA,), "q")


def m_q_data(d, w):
    req = w.prefill_request()
    req.q.data = _resize(req.q.data, d)
    return Case("q data length", "PrefillContext", req.SerializeToString(), (IA,), "q")


def m_q_rows(d, w):
    req = w.prefill_request()
    rows = sum(w.QUERIES)
    if d.boolean():  # q with another number of rows (its bytes matching)
        new_rows = d.choice([k for k in range(0, rows + 4) if k != rows])
        bits = np.resize(w.q_bits, (new_rows, w.H, w.D))
        req.q.CopyFrom(encode_tensor(bits, w.q_wire))
    else:  # a query_len changed (kept >= 0)
        i = d.integer(0, len(w.QUERIES) - 1)
        req.sequences[i].query_len = d.choice([k for k in range(0, w.QUERIES[i] + 4) if k != w.QUERIES[i]])
    return Case("query rows disagree", "PrefillContext", req.SerializeToString(), (IA,), "sequences")


def m_negative_len(d, w):
    req = w.prefill_request()
    i = d.integer(0, len(w.QUERIES) - 1)
    name = d.choice(["query_len", "context_len"])
    setattr(req.sequences[i], name, d.integer(I32_MIN, -1))
    return Case("negative length", "PrefillContext", req.SerializeToString(), (IA,), f"sequences[{i}].{name}")


def m_block_table_short(d, w):
    req = w.prefill_request()
    i = d.choice([k for k, c in enumerate(w.CONTEXTS) if c])
    need = math.ceil(w.CONTEXTS[i] / w.bs)
    if d.boolean():  # fewer entries than the context needs
        keep = d.integer(0, need - 1)
        del req.sequences[i].block_table[keep:]
    else:  # a context longer than the table covers (any int32)
        req.sequences[i].context_len = d.integer(len(w.tables[i]) * w.bs + 1, I32_MAX)
    return Case("block table too short", "PrefillContext", req.SerializeToString(), (IA,), f"sequences[{i}]")


def m_block_id_range(d, w):
    req = w.prefill_request()
    i = d.choice([k for k, c in enumerate(w.CONTEXTS) if c])
    j = d.integer(0, math.ceil(w.CONTEXTS[i] / w.bs) - 1)
    req.sequences[i].block_table[j] = d.outside(0, w.num_blocks - 1, I32_MIN, I32_MAX)
    return Case("block id out of range", "PrefillContext", req.SerializeToString(), (OOR,),
                f"sequences[{i}].block_table[{j}]")


def m_many_sequences(d, w):
    """Too many sequences, or a block-table matrix (sequences x longest table) too large
    to build: refused before anything is allocated. (Serialized by hand: empty
    ``Sequence`` messages are the two bytes 1a 00.)"""
    req = w.prefill_request()
    del req.sequences[:]
    req.q.CopyFrom(pb.Tensor(dtype=w.q_wire, shape=[0, w.H, w.D]))
    empty = b"\x1a\x00"
    if d.boolean():
        n = d.integer(65537, 70000)
        return Case("too many sequences", "PrefillContext", req.SerializeToString() + empty * n, (IA,), "sequences")
    blocks = d.integer(4096, 8192)
    n = (1 << 24) // blocks + d.integer(1, 64)
    req.sequences.add(context_len=blocks * w.bs, block_table=[0] * blocks)  # first: refused at sequence 0
    return Case("block-table matrix too large", "PrefillContext", req.SerializeToString() + empty * (n - 1), (IA,),
                "sequences[0].context_len")


def m_many_plan_chunks(d, w):
    """More plan chunks than a request may list: refused before any is read. (Empty
    ``ContextChunk`` messages, field 6, are the two bytes 32 00.)"""
    n = d.integer(65537, 70000)
    return Case("too many plan chunks", "PrefillContext", w.prefill_request().SerializeToString() + b"\x32\x00" * n,
                (IA,), "plan")


def m_workspace(d, w):
    req = w.prefill_request()
    req.workspace_tokens = d.outside(w.bs, w.server_W, I64_MIN, I64_MAX)
    return Case("workspace_tokens", "PrefillContext", req.SerializeToString(), (IA,), "workspace_tokens")


def m_instance(d, w, method="PrefillContext"):
    req = {"PrefillContext": w.prefill_request, "WriteCache": w.write_request, "ReadCache": w.read_request}[method]()
    other = "".join(d.choice("0123456789abcdef-x") for _ in range(d.integer(0, 40)))
    if other == w.instance_id:
        other += "0"
    req.expected_instance_id = other
    return Case(f"{method} stale instance", method, req.SerializeToString(), (FP,), "expected_instance_id")


def m_request_id(d, w):
    req = w.prefill_request()
    req.request_id = "r" * d.integer(1025, 8192)
    return Case("request_id too long", "PrefillContext", req.SerializeToString(), (IA,), "request_id")


def m_plan(d, w):
    req = w.prefill_request(plan=True)
    plan = req.plan
    k = d.integer(0, len(plan) - 1)
    c = plan[k]
    how = d.integer(0, 10)
    field = "plan"
    if how == 0:
        c.num_sequences = d.integer(I32_MIN, 0)
        field = f"plan[{k}].num_sequences"
    elif how == 1:
        name = d.choice(["context_start", "context_len"])
        rep = getattr(c, name)
        if d.boolean() or len(rep) == 0:
            rep.append(d.integer(0, 64))
        else:
            del rep[d.integer(0, len(rep) - 1)]
        field = f"plan[{k}].{name}"
    elif how == 2:
        c.first_sequence = d.outside(0, len(w.CONTEXTS) - c.num_sequences, I32_MIN, I32_MAX)
        field = f"plan[{k}]"
    elif how == 3:  # a context length changed (over the workspace, past the sequence, or short)
        j = d.integer(0, len(c.context_len) - 1)
        old = c.context_len[j]
        c.context_len[j] = d.choice([x for x in (old + 1, old + w.bs, old + w.W, old - 1, I32_MAX, 0) if x != old])
    elif how == 4:  # a negative start or length
        j = d.integer(0, len(c.context_len) - 1)
        name = d.choice(["context_start", "context_len"])
        getattr(c, name)[j] = d.integer(I32_MIN, -1)
    elif how == 5:  # a continuation that is not the chunk's first sequence
        if len(c.context_start) < 2:
            return m_plan(d, w)
        j = d.integer(1, len(c.context_start) - 1)
        c.context_start[j] = d.integer(1, I32_MAX)
        field = f"plan[{k}].context_start[{j}]"
    elif how == 6:  # a chunk dropped
        del plan[k]
        if not len(plan):
            field = "sequences"  # pragma: no cover - the workload's plan has several chunks
    elif how == 7:  # a chunk twice
        plan.add().CopyFrom(c)
    elif how == 8:  # two chunks that share a sequence swapped (chunks of disjoint sequences may come in any order)
        def seqs(x):
            return set(range(x.first_sequence, x.first_sequence + x.num_sequences))

        pairs = [(a, b) for a in range(len(plan)) for b in range(a + 1, len(plan)) if seqs(plan[a]) & seqs(plan[b])]
        if not pairs:  # pragma: no cover - the workload's plan has continuation chunks
            return m_plan(d, w)
        k, k2 = d.choice(pairs)
        a, b = _copy(plan[k]), _copy(plan[k2])
        plan[k].CopyFrom(b)
        plan[k2].CopyFrom(a)
    elif how == 9:  # a start moved
        j = d.integer(0, len(c.context_start) - 1)
        old = c.context_start[j]
        c.context_start[j] = d.choice([x for x in (old + 1, old - 1, old + w.bs, I32_MAX) if x != old and x >= 0])
    else:  # an empty chunk added
        e = plan.add()
        e.first_sequence, e.num_sequences = 1, 1
        e.context_start.append(0)
        e.context_len.append(0)
    return Case("bad plan", "PrefillContext", req.SerializeToString(), (IA,), field)


def m_prefill_garbage(d, w):
    return Case("PrefillContext bytes", "PrefillContext",
                _garbage(w.prefill_request(plan=d.boolean()).SerializeToString(), pb.PrefillContextRequest, d),
                (IA,), "request")


# -- WriteCache (nothing may be written) ---------------------------------------------------


def m_write_slots(d, w):
    req = w.write_request(T=d.integer(1, 8))
    T = req.slot_mapping.shape[0]
    how = d.integer(0, 3)
    if how == 0:  # one slot out of range: any int64 but [-1, num_slots)
        i = d.integer(0, T - 1)
        slots = np.frombuffer(req.slot_mapping.data, np.int64).copy()
        slots[i] = d.outside(-1, w.num_slots - 1, I64_MIN, I64_MAX)
        req.slot_mapping.data = slots.tobytes()
        return Case("write slot out of range", "WriteCache", req.SerializeToString(), (OOR,), f"slot_mapping[{i}]")
    if how == 1:
        req.slot_mapping.dtype = _bad_dtype(d, (pb.DATA_TYPE_INT64,))
    elif how == 2:
        shape = _bad_shape(d, [T])
        del req.slot_mapping.shape[:]
        req.slot_mapping.shape.extend(shape)
        return Case("write slot shape", "WriteCache", req.SerializeToString(), (IA,), "slot_mapping")
    else:
        req.slot_mapping.data = _resize(req.slot_mapping.data, d)
    return Case("write slot_mapping", "WriteCache", req.SerializeToString(), (IA,), "slot_mapping")


def m_write_latent(d, w):
    req = w.write_request(T=d.integer(1, 8))
    name = d.choice(["kv_c", "k_pe"])
    t = getattr(req, name)
    how = d.integer(0, 3)
    if how == 0:
        t.dtype = _bad_dtype(d, (pb.DATA_TYPE_BF16, pb.DATA_TYPE_FP32))
    elif how == 1:
        shape = _bad_shape(d, list(t.shape))
        del t.shape[:]
        t.shape.extend(shape)
    elif how == 2:  # a well-formed tensor of another shape (data matching)
        T, width = t.shape
        new = (T + d.choice([-1, 1, 3]), width) if d.boolean() else (T, width + d.choice([-64, -1, 1, 64]))
        new = (max(new[0], 0), max(new[1], 0))
        t.CopyFrom(encode_tensor(np.zeros(new, np.float32)))
    else:
        t.data = _resize(t.data, d)
    return Case(f"write {name}", "WriteCache", req.SerializeToString(), (IA,), name)


def m_write_garbage(d, w):
    return Case("WriteCache bytes", "WriteCache",
                _garbage(w.write_request(T=2).SerializeToString(), pb.WriteCacheRequest, d), (IA,), "request")


# -- ReadCache ------------------------------------------------------------------------------


def m_read(d, w):
    req = w.read_request(T=d.integer(1, 8))
    T = req.slot_mapping.shape[0]
    how = d.integer(0, 4)
    if how == 0:  # -1 is not a slot here
        i = d.integer(0, T - 1)
        slots = np.frombuffer(req.slot_mapping.data, np.int64).copy()
        slots[i] = d.outside(0, w.num_slots - 1, I64_MIN, I64_MAX)
        req.slot_mapping.data = slots.tobytes()
        return Case("read slot out of range", "ReadCache", req.SerializeToString(), (OOR,), f"slot_mapping[{i}]")
    if how == 1:
        req.slot_mapping.dtype = _bad_dtype(d, (pb.DATA_TYPE_INT64,))
    elif how == 2:
        shape = _bad_shape(d, [T])
        del req.slot_mapping.shape[:]
        req.slot_mapping.shape.extend(shape)
    elif how == 3:
        req.slot_mapping.data = _resize(req.slot_mapping.data, d)
    else:  # an answer larger than a message may be
        n = (w.max_message_bytes // w.bps) + d.integer(1, 64)
        req.slot_mapping.CopyFrom(encode_tensor(np.zeros(n, np.int64)))
    return Case("read slot_mapping", "ReadCache", req.SerializeToString(), (IA,), "slot_mapping")


def m_read_garbage(d, w):
    return Case("ReadCache bytes", "ReadCache",
                _garbage(w.read_request(T=2).SerializeToString(), pb.ReadCacheRequest, d), (IA,), "request")


def m_info_garbage(d, w):
    return Case("GetServerInfo bytes", "GetServerInfo", _garbage(b"", pb.GetServerInfoRequest, d), (IA,), "request")


# -- valid on purpose ---------------------------------------------------------------------


def v_prefill(d, w):
    plan = d.boolean()
    return Case("valid prefill" + (" (its own plan)" if plan else ""), "PrefillContext",
                w.prefill_request(plan=plan).SerializeToString(), (OK,), check=w.check_prefill())


def v_prefill_nonfinite(d, w):
    """NaN / inf in some rows of q: allowed; every other row equals the reference."""
    req = w.prefill_request()
    bits = w.q_bits.copy()
    rows = sorted({d.integer(0, bits.shape[0] - 1) for _ in range(d.integer(1, 3))})
    if w.fp8:
        specials = [0x7F, 0xFF]  # e4m3fn has NaN, no inf
    else:
        specials = [0x7FC0, 0xFFC0, 0x7F80, 0xFF80]  # NaN, -NaN, +inf, -inf
    for r in rows:
        bits[r, d.integer(0, w.H - 1), d.integer(0, w.D - 1)] = d.choice(specials)
    req.q.CopyFrom(encode_tensor(bits, w.q_wire))
    return Case("valid prefill, NaN/inf in q", "PrefillContext", req.SerializeToString(), (OK,),
                check=w.check_prefill(rows))


def v_write_skipped(d, w):
    """NaN / inf latents to slot -1 only: allowed, nothing written."""
    T = d.integer(1, 4)
    kv_c = np.full((T, w.L), d.choice([np.nan, np.inf, -np.inf, 1e38]), np.float32)
    k_pe = np.full((T, w.R), np.nan, np.float32)
    req = pb.WriteCacheRequest(slot_mapping=encode_tensor(np.full(T, -1, np.int64)), kv_c=encode_tensor(kv_c),
                               k_pe=encode_tensor(k_pe))

    def check(raw: bytes) -> None:
        assert pb.WriteCacheResponse.FromString(raw).slots_written == 0

    return Case("valid write, all skipped", "WriteCache", req.SerializeToString(), (OK,), check=check)


def v_read(d, w):
    slots = np.asarray([d.integer(0, w.num_slots - 1) for _ in range(d.integer(1, 4))], np.int64)
    req = pb.ReadCacheRequest(slot_mapping=encode_tensor(slots))
    return Case("valid read", "ReadCache", req.SerializeToString(), (OK,), check=w.check_read(slots))


HOSTILE = (m_q_dtype, m_q_shape, m_q_data, m_q_rows, m_negative_len, m_block_table_short, m_block_id_range,
           m_workspace, m_instance, m_request_id, m_many_sequences, m_many_plan_chunks, m_plan, m_plan, m_plan,
           m_prefill_garbage, m_write_slots, m_write_latent, m_write_garbage, m_read, m_read_garbage, m_info_garbage,
           lambda d, w: m_instance(d, w, "WriteCache"), lambda d, w: m_instance(d, w, "ReadCache"))
VALID = (v_prefill, v_prefill_nonfinite, v_write_skipped, v_read)


def draw_batch(d: Drawer, w: Workload, hostile: int, valid: int) -> list[Case]:
    cases = [d.choice(HOSTILE)(d, w) for _ in range(hostile)] + [d.choice(VALID)(d, w) for _ in range(valid)]
    order = sorted(range(len(cases)), key=lambda i: d.integer(0, 1 << 16))
    return [cases[i] for i in order]


# ------------------------------------------------------------------------------ sending


@dataclasses.dataclass
class Outcome:
    case: Case
    code: grpc.StatusCode
    details: str
    problem: str | None  # None: as expected


def send_batch(w: Workload, cases: list[Case], timeout: float = 60.0) -> list[Outcome]:
    """All cases at once (concurrently on the channel), then every answer judged."""
    futures = [w.rpc[c.method].future(c.payload, timeout=timeout, metadata=w.metadata) for c in cases]
    out = []
    for c, f in zip(cases, futures):
        try:
            raw = f.result()
            code, details = OK, ""
        except grpc.RpcError as e:
            raw, code, details = None, e.code(), e.details() or ""
        problem = None
        if code not in c.codes:
            problem = f"got {code.name}, expected {'/'.join(x.name for x in c.codes)}: {details}"
        elif code != OK and c.field and c.field not in details:
            problem = f"{code.name} without naming {c.field!r}: {details}"
        elif code == OK and c.check is not None:
            try:
                c.check(raw)
            except AssertionError as e:
                problem = f"wrong answer: {e}"
        out.append(Outcome(c, code, details, problem))
    return out


# ------------------------------------------------------------------------------ CLI


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="send hostile requests to a running ctxprefill server and judge "
                                            "every answer (exit 1 on any unexpected one)")
    p.add_argument("--target", required=True, help="host:port of the gRPC server (plaintext)")
    p.add_argument("--count", type=int, default=2000, help="hostile requests to send")
    p.add_argument("--batch", type=int, default=50, help="hostile requests sent concurrently per batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token", default=None, help="bearer token, if the server wants one")
    ns = p.parse_args(argv)
    md = (("authorization", f"Bearer {ns.token}"),) if ns.token else ()
    t0 = time.monotonic()
    with grpc.insecure_channel(ns.target, options=[("grpc.max_receive_message_length", 1 << 30),
                                                   ("grpc.max_send_message_length", 1 << 30)]) as ch:
        grpc.channel_ready_future(ch).result(timeout=60)
        w = Workload(ch, seed=ns.seed, metadata=md)
        w.setup()
        d = RandomDrawer(ns.seed)
        sent, bad, codes = 0, [], Counter()
        while sent < ns.count:
            for o in send_batch(w, draw_batch(d, w, min(ns.batch, ns.count - sent), 2)):
                codes[o.code.name] += 1
                if o.problem:
                    bad.append(f"{o.case.kind} ({o.case.method}): {o.problem}")
            sent += min(ns.batch, ns.count - sent)
        after = w.read_all()
    unchanged = np.array_equal(after, w.snapshot)
    print(f"hostile requests: {sent}; answers by code: {dict(codes)}; unexpected: {len(bad)}; "
          f"cache bytes unchanged: {unchanged}; {time.monotonic() - t0:.1f} s")
    for b in bad[:20]:
        print("  " + b)
    return 0 if not bad and unchanged else 1


if __name__ == "__main__":
    sys.exit(main())
