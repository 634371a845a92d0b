"""The work of one PrefillContext is bounded (docs/RELIABILITY.md "Work bounds").

The attack: a 268 KB request whose block table repeats block 0 (legal) asks for
4,194,304 context tokens; with a 1 s deadline the client gives up at 1 s, and an engine
that computes on delays every request queued behind it by the whole of that work.

- ``--max-context-token-heads`` (context tokens summed over the sequences × heads
  served) refuses it up front: RESOURCE_EXHAUSTED naming the limit and the figure,
  before the block table is read;
- a request whose deadline passes, or whose caller cancels, stops at the next chunk
  boundary (``StopSignal``, asked by the chunk loop), writes nothing (its
  ``cache_write`` included), and frees the engine for the next request;
- against a real CPU server: an admitted request planned to take many seconds, with a
  1 s deadline, is stopped after a fraction of its chunks (metrics) and the request
  queued behind it is answered long before the attacker's work could have finished
  (measured against the calibrated chunk time, not a fixed figure); a cancelled client
  does the same, and the queue depth goes back to 0.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch

from ctxprefill.config import CacheConfig, EngineConfig, ModelShape
from ctxprefill.engine.request import (
    PrefillRequest,
    ReadRequest,
    SequenceSpec,
    StopSignal,
    WriteRequest,
    validate_prefill,
)
from ctxprefill.errors import Cancelled, ConfigError, DeadlineExceeded, ResourceExhausted
from ctxprefill.service.interceptors.status import status_of
from ctxprefill_api import pb, pb_grpc
from ctxprefill_client import PrefillContextClient, encode_tensor, float32_to_bf16_bits
from engine_helpers import bits, make_engine
from service_process import ServerProcess, sample_sum, wait_for

ATTACK_CONTEXT = 4_194_304  # tokens: block 0 repeated 262,144 times (block 16)
BS = 16


class _UnreadTable:
    """A block table that may only be measured: reading an entry fails the test (the cap
    must refuse before the table is read)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: object) -> int:
        raise AssertionError("the block table was read before the work cap refused the request")

    def __iter__(self) -> Iterator[int]:
        raise AssertionError("the block table was read before the work cap refused the request")


# ------------------------------------------------------------------------------ the cap


def _config(heads: int, **kw) -> EngineConfig:
    return EngineConfig(shape=ModelShape(heads=heads), cache=CacheConfig(block_size=BS, num_blocks=8), **kw)


def test_the_default_cap_refuses_the_attack_up_front_naming_limit_and_figure():
    cfg = _config(128)
    assert cfg.max_context_token_heads == 1 << 27
    q = torch.zeros((1, 128, 192), dtype=torch.bfloat16)
    table = _UnreadTable(ATTACK_CONTEXT // BS)
    with pytest.raises(ResourceExhausted) as ei:
        validate_prefill(PrefillRequest(q, [SequenceSpec(1, ATTACK_CONTEXT, table)]), cfg, "x")
    msg = str(ei.value)
    assert msg.startswith("sequences[0].context_len: ")
    assert "--max-context-token-heads 134217728" in msg
    assert f"{ATTACK_CONTEXT * 128}" in msg and "128 heads" in msg
    assert status_of(ei.value)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_legitimate_large_request_passes_the_default_cap():
    cfg = _config(128, workspace_tokens=65536)
    q = torch.zeros((8, 128, 192), dtype=torch.bfloat16)
    ctx = 1 << 20  # 1 Mi tokens over 128 heads: exactly the default cap
    checked = validate_prefill(PrefillRequest(q, [SequenceSpec(8, ctx, np.zeros(ctx // BS, np.int64))]), cfg, "x")
    assert sum(checked.context_lens) == ctx and len(checked.chunks) == 16


def test_the_cap_counts_every_sequence_and_is_a_setting():
    cfg = _config(2, max_context_token_heads=1000)
    q = torch.zeros((2, 2, 192), dtype=torch.bfloat16)
    ok = [SequenceSpec(1, 250, [0] * 16), SequenceSpec(1, 250, [0] * 16)]
    validate_prefill(PrefillRequest(q, ok), cfg, "x")  # 500 tokens x 2 heads = 1000: at the limit
    over = [SequenceSpec(1, 250, [0] * 16), SequenceSpec(1, 251, [0] * 16)]
    with pytest.raises(ResourceExhausted, match=r"^sequences\[1\]\.context_len: .*= 1002 .* 1000"):
        validate_prefill(PrefillRequest(q, over), cfg, "x")
    with pytest.raises(ConfigError, match="--max-context-token-heads"):
        _config(2, max_context_token_heads=0)


# ------------------------------------------------------------------------------ stopping in the engine


@pytest.fixture(scope="module")
def engine():
    return make_engine(heads=2, block_size=BS, num_blocks=16, workspace_tokens=32)


def _request(stop: StopSignal | None = None, write: WriteRequest | None = None) -> PrefillRequest:
    q = (torch.arange(5 * 2 * 192, dtype=torch.float32).reshape(5, 2, 192) % 7 - 3).to(torch.bfloat16)
    seqs = [SequenceSpec(3, 160, list(range(10))), SequenceSpec(2, 40, [10, 11, 12])]
    return PrefillRequest(q, seqs, cache_write=write, stop=stop)


def _fill(engine) -> None:
    g = torch.Generator().manual_seed(3)
    n = 13 * BS
    engine.write(WriteRequest(torch.arange(n), torch.randn(n, 512, generator=g), torch.randn(n, 64, generator=g)))


def test_a_cancelled_request_stops_between_chunks_and_writes_nothing(engine):
    _fill(engine)
    reference = engine.start_prefill(_request()).result()
    planned = len(reference.stats.chunks)
    assert planned >= 5
    slots = torch.arange(14 * BS, 15 * BS)  # block 14: never written
    before = engine.read(ReadRequest(slots))
    stop = StopSignal()
    ran: list[int] = []

    def observer(i, *_):
        ran.append(i)
        if i == 2:
            stop.cancel()  # as the service does when the call is cancelled, from any thread

    write = WriteRequest(slots, torch.ones(BS, 512), torch.ones(BS, 64))
    with pytest.raises(Cancelled) as ei:
        engine.start_prefill(_request(stop, write), observer=observer)
    assert ran == [0, 1, 2]  # the chunk under way finished; the next never started
    assert (ei.value.chunks_done, ei.value.chunks_planned) == (3, planned)
    assert status_of(ei.value)[0] == grpc.StatusCode.CANCELLED
    assert torch.equal(engine.read(ReadRequest(slots)), before)  # its cache_write was not written
    # the engine goes on: the same request again is bit for bit the reference
    again = engine.start_prefill(_request(StopSignal(time.monotonic() + 3600))).result()
    assert torch.equal(bits(again.out), bits(reference.out)) and torch.equal(bits(again.lse), bits(reference.lse))


def test_a_passed_deadline_stops_before_the_first_chunk(engine):
    with pytest.raises(DeadlineExceeded) as ei:
        engine.start_prefill(_request(StopSignal(time.monotonic() - 1.0)))
    assert ei.value.chunks_done == 0 and "deadline" in str(ei.value)
    assert status_of(ei.value)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    gone = StopSignal(gone=lambda: True)  # a request ring let go
    with pytest.raises(Cancelled):
        engine.start_prefill(_request(gone))
    late = StopSignal(time.monotonic() - 1.0)
    late.cancel("deadline")
    assert late.reason() == "deadline"


# ------------------------------------------------------------------------------ against a CPU server

HEADS, W = 4, 4096
CAP = 1 << 23  # context-token-heads: 2 Mi tokens over 4 heads; the attack's 4 Mi tokens are 16 Mi
FLAGS = {"heads": HEADS, "block_size": BS, "num_blocks": 8, "workspace_tokens": W, "seed": 1, "queue_size": 4,
         "max_context_token_heads": CAP}
TARGET_SECONDS = 20.0  # the admitted attacker's full work, when the cap allows that much on this machine
DEADLINE = 1.0
FOLLOWER = (2, 16 * BS)  # the request queued behind the attacker: 2 query rows over 256 context tokens


def _q(rows: int) -> pb.Tensor:
    q = np.random.default_rng(rows).standard_normal((rows, HEADS, 192)).astype(np.float32)
    return encode_tensor(float32_to_bf16_bits(q), pb.DATA_TYPE_BF16)


def _prefill(rows: int, context: int, write_block: int | None = None) -> pb.PrefillContextRequest:
    """``rows`` query rows over ``context`` tokens of block 0 repeated; with ``write_block``,
    a cache_write of that block's slots."""
    req = pb.PrefillContextRequest(q=_q(rows), sequences=[
        pb.Sequence(query_len=rows, context_len=context, block_table=[0] * (-(-context // BS)))])
    if write_block is not None:
        slots = np.arange(write_block * BS, (write_block + 1) * BS, dtype=np.int64)
        req.cache_write.CopyFrom(pb.CacheWrite(
            slot_mapping=encode_tensor(slots), kv_c=encode_tensor(np.ones((BS, 512), np.float32)),
            k_pe=encode_tensor(np.ones((BS, 64), np.float32))))
    return req


def _value(proc: ServerProcess, name: str, **labels) -> float:
    return sample_sum(proc.scrape()[name], **labels)


@pytest.fixture(scope="module")
def server():
    with ServerProcess(FLAGS, grace_seconds=5) as p:
        with PrefillContextClient(p.target, retries=0) as c:
            rng = np.random.default_rng(0)
            c.write_cache(np.arange(BS), rng.standard_normal((BS, 512)), rng.standard_normal((BS, 64)))
        yield p


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as ch:
        yield pb_grpc.PrefillContextServiceStub(ch)


@pytest.fixture(scope="module")
def attack(stub) -> tuple[int, float]:
    """(chunks of the admitted attacker, seconds one chunk takes here): as many chunks as
    take TARGET_SECONDS, at most what the cap admits. Prints the follower's own time."""
    probe = 8
    stub.PrefillContext(_prefill(1, probe * W), timeout=120)  # warm
    t = time.monotonic()
    stub.PrefillContext(_prefill(1, probe * W), timeout=120)
    chunk_s = (time.monotonic() - t) / probe
    chunks = max(64, min(CAP // (HEADS * W), int(TARGET_SECONDS / chunk_s) + 1))
    alone = []
    for _ in range(5):
        t = time.monotonic()
        stub.PrefillContext(_prefill(*FOLLOWER), timeout=120)
        alone.append(time.monotonic() - t)
    print(f"\nthe follower alone: {sorted(alone)[2] * 1e3:.1f} ms (median of 5)")
    return chunks, chunk_s


def _start_attacker(server, stub, chunks: int, timeout: float, write_block: int | None = None):
    """The attacker, returned once it runs, a small request queued behind it, and when the
    attacker was sent (``time.monotonic()``)."""
    started = _value(server, "grpc_server_started_total", grpc_method="PrefillContext")
    t_sent = time.monotonic()
    attacker = stub.PrefillContext.future(_prefill(1, chunks * W, write_block), timeout=timeout)
    wait_for(lambda: _value(server, "grpc_server_started_total", grpc_method="PrefillContext") > started,
             timeout=60, what="the attacker admitted")
    follower = stub.PrefillContext.future(_prefill(*FOLLOWER), timeout=300)  # one chunk
    # queued behind it (or, on a machine slow to answer these scrapes, the attacker's deadline came first)
    wait_for(lambda: attacker.done() or _value(server, "ctxprefill_queue_depth") == 1,
             timeout=60, what="the small request queued behind the attacker")
    return attacker, follower, t_sent


def test_the_cap_refuses_the_268_kb_attack_at_once(server, stub):
    req = _prefill(1, ATTACK_CONTEXT)
    assert len(req.SerializeToString()) < 300_000
    m0 = server.scrape()
    with pytest.raises(grpc.RpcError) as ei:
        stub.PrefillContext(req, timeout=30)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = ei.value.details()
    assert details.startswith("sequences[0].context_len: ")
    assert f"--max-context-token-heads {CAP}" in details and f"{ATTACK_CONTEXT * HEADS}" in details
    m1 = server.scrape()
    for name in ("ctxprefill_chunks_total", "ctxprefill_request_duration_seconds_count"):  # nothing computed
        assert sample_sum(m1[name]) == sample_sum(m0[name])


def test_an_attacker_whose_deadline_passes_stops_and_frees_the_engine(server, stub, attack):
    chunks, chunk_s = attack
    planned_s = chunks * chunk_s
    assert planned_s > 4 * DEADLINE, f"the attacker's work ({planned_s:.1f} s) is too short to show anything"
    m0 = server.scrape()
    attacker, follower, t0 = _start_attacker(server, stub, chunks, DEADLINE)
    with pytest.raises(grpc.RpcError) as ei:
        attacker.result()
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    answer = follower.result()
    t_follower = time.monotonic() - t0
    assert answer.stats.query_tokens == 2
    outcomes = ("ctxprefill_stopped_requests_total", "ctxprefill_rejected_requests_total")

    def counted() -> dict[tuple[str, str], float]:
        m = server.scrape()
        return {(n, lab["reason"]): v - sample_sum(m0[n], **lab) for n in outcomes for lab, v in m[n]
                if v != sample_sum(m0[n], **lab)}

    wait_for(lambda: bool(counted()), timeout=60, what="the attacker's end counted")
    # it ran (the small request was queued behind it) and was stopped between chunks
    assert counted() == {("ctxprefill_stopped_requests_total", "deadline"): 1}
    m1 = server.scrape()
    computed = sample_sum(m1["ctxprefill_chunks_total"]) - sample_sum(m0["ctxprefill_chunks_total"]) - 1
    print(f"\nattacker: {chunks} chunks planned ({planned_s:.1f} s at {chunk_s * 1e3:.1f} ms), {computed:.0f} "
          f"computed; the request behind it answered {t_follower:.2f} s after the attacker was sent, "
          f"{t_follower - DEADLINE:.2f} s after the attacker's deadline")
    assert 0 < computed < chunks / 2
    assert t_follower < DEADLINE + (planned_s - DEADLINE) / 2  # long before the attacker's work could end
    assert sample_sum(m1["ctxprefill_queue_depth"]) == 0


def test_a_cancelled_attacker_stops_writes_nothing_and_frees_the_engine(server, stub, attack):
    chunks, chunk_s = attack
    m0 = server.scrape()
    attacker, follower, _ = _start_attacker(server, stub, chunks, 300, write_block=1)
    t0 = time.monotonic()
    assert attacker.cancel()  # it was running (the small request queued behind it)
    answer = follower.result()
    t_follower = time.monotonic() - t0
    assert answer.stats.query_tokens == 2
    wait_for(lambda: _value(server, "ctxprefill_stopped_requests_total", reason="cancelled")
             == sample_sum(m0["ctxprefill_stopped_requests_total"], reason="cancelled") + 1,
             timeout=60, what="the cancelled attacker counted")
    m1 = server.scrape()
    computed = sample_sum(m1["ctxprefill_chunks_total"]) - sample_sum(m0["ctxprefill_chunks_total"]) - 1
    print(f"\ncancelled attacker: {chunks} chunks planned, {computed:.0f} computed; the request behind it answered "
          f"{t_follower:.2f} s after the cancel")
    assert computed < chunks / 2
    assert t_follower < (chunks * chunk_s) / 2
    assert sample_sum(m1["ctxprefill_queue_depth"]) == 0
    with PrefillContextClient(server.target, retries=0) as c:  # its cache_write (block 1) never happened
        assert not c.read_cache(np.arange(BS, 2 * BS)).any()
