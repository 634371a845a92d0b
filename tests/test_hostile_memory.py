"""Hostile clients at the gRPC edge, for memory (docs/RELIABILITY.md "Memory bounds"):
real ``ctxprefill serve`` processes, and a raw HTTP/2 client (``h2``) that does what a
gRPC client does not — announces a message in its length prefix and never sends the
last byte, or never opens its receive window. The server's resident memory is read
from ``/proc/PID/status`` (VmRSS) while it is attacked.

- uploads without the token (8 streams x 64 MiB announced, all but one byte sent):
  UNAUTHENTICATED at once, the message never read, RSS growth < 64 MiB, a valid client
  served meanwhile;
- the same with the token: what is read at once is bounded by ``--max-inflight-bytes``
  (RESOURCE_EXHAUSTED naming it) and ``--receive-timeout-s`` (DEADLINE_EXCEEDED);
- both at full scale (8 x 536,870,000 bytes, ``--max-message-bytes`` 512 MiB) with
  ``CTXPREFILL_HOSTILE_STREAM_BYTES=536870000`` (default 64 MiB);
- answers larger than their requests (ReadCache's slots, PrefillContext's inline
  output) over ``--max-answer-bytes``: RESOURCE_EXHAUSTED naming it, before anything is
  allocated; the 7 MiB request for a 1 GiB answer scaled (16 KB for 2.3 MB), three
  times, to a client that never opens its window: RSS growth < 64 MiB;
- answers a client never reads: at most what ``--max-inflight-bytes`` holds, further
  ones refused, all of it given back when the client goes.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import select
import socket
import struct
import time
from collections.abc import Callable

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import numpy as np
import pytest

from ctxprefill.errors import ConfigError
from ctxprefill.service.interceptors.memory import Budget
from ctxprefill.settings import ServeSettings, check_serve_settings
from ctxprefill_api import pb, pb_grpc
from ctxprefill_client import CtxPrefillRpcError, PrefillContextClient, encode_tensor
from service_process import ServerProcess, sample_sum

SERVICE = "/ctxprefill.v1.PrefillContextService"
TOKEN = "tok-" + "5d1e9a3c7b2f4e6a8c0d1e2f3a4b5c6d"
MiB = 1 << 20
SMALL = {"heads": 1, "block_size": 16, "num_blocks": 8, "workspace_tokens": 64}
BYTES_PER_SLOT = 1152  # bf16 cache: (512 + 64) x 2
UNAUTHENTICATED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED = "16", "4", "8"
#: what each hostile upload announces; the server's --max-message-bytes (and budget) is the
#: power of two above it, at least 128 MiB. 536870000 is the full-scale attack (512 MiB messages)
STREAM_BYTES = int(os.environ.get("CTXPREFILL_HOSTILE_STREAM_BYTES", 64 * MiB))
EDGE_MESSAGE_BYTES = max(128 * MiB, 1 << (STREAM_BYTES - 1).bit_length())


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class RawH2:
    """A plaintext HTTP/2 client speaking just enough gRPC: a stream's message is its
    5-byte prefix (announcing ``announced`` bytes) then ``body`` (a view, never copied
    whole), sent as flow control allows. ``window``: the receive window of each stream
    (and, above the default, of the connection), never opened further (gRPC sends a
    refusal's status after an empty message: 5 bytes)."""

    def __init__(self, port: int, window: int = 65535):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        if window > 65535:
            self.conn.increment_flow_control_window(window - 65535)
        self.status: dict[int, tuple[str, str]] = {}  # stream -> (grpc-status, grpc-message), or ("reset", code)
        self.answering: set[int] = set()  # streams whose response headers came
        self.sent = 0  # message bytes sent, all streams
        self.received = 0  # bytes read from the socket
        self.terminated: bytes | None = None  # the server's GOAWAY, its debug data
        self.pings = 0  # the server's pings, each acknowledged (by h2) when the next frames go out
        self.ended = False  # the server closed the connection (EOF, reset or GOAWAY)
        self._todo: dict[int, tuple[bytes, memoryview, int, bool]] = {}  # stream -> (prefix, body, sent, end)
        self._flush()

    def __enter__(self) -> RawH2:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def _flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            self.sock.sendall(out)

    def open(self, method: str, *, body: bytes | memoryview, announced: int | None = None,
             metadata: tuple[tuple[str, str], ...] = (), end: bool = False) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", f"{SERVICE}/{method}"),
                                     (":authority", "localhost"), ("content-type", "application/grpc"),
                                     ("te", "trailers"), *metadata])
        prefix = struct.pack(">BI", 0, len(body) if announced is None else announced)
        self._todo[sid] = (prefix, memoryview(body), 0, end)
        self._pump()
        return sid

    def open_empty(self, method: str, metadata: tuple[tuple[str, str], ...] = ()) -> int:
        """A call that ends (half-closes) without sending any message."""
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", f"{SERVICE}/{method}"),
                                     (":authority", "localhost"), ("content-type", "application/grpc"),
                                     ("te", "trailers"), *metadata], end_stream=True)
        self._flush()
        return sid

    def _pump(self) -> None:
        for sid, (prefix, body, sent, end) in list(self._todo.items()):
            if sid in self.status:
                del self._todo[sid]
                continue
            total = len(prefix) + len(body)
            while sent < total:
                n = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size, total - sent)
                if n <= 0:
                    break
                head = prefix[sent:sent + n]  # the prefix, then the body
                start = max(0, sent - len(prefix))
                self.conn.send_data(sid, head + bytes(body[start:start + n - len(head)]))
                sent += n
                self.sent += n
            if sent == total:
                if end:
                    self.conn.end_stream(sid)
                del self._todo[sid]
            else:
                self._todo[sid] = (prefix, body, sent, end)
        self._flush()

    def run(self, seconds: float, until: Callable[[], bool], tick: Callable[[], None] = lambda: None) -> bool:
        """Send and receive (never opening the receive window beyond what was set) until
        ``until()`` or ``seconds`` pass; ``tick`` runs every round."""
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end and not until():
            tick()
            if not select.select([self.sock], [], [], 0.05)[0]:
                continue
            try:
                if not self._receive():
                    self.ended = True
                    break
                self._pump()
            except (ConnectionResetError, BrokenPipeError):
                self.ended = True
                break
        return until()

    def _receive(self, piece: int = 1 << 20) -> bool:
        """Read what the socket has and take in its frames, ``piece`` bytes at a time (under
        9, the size of a frame header, no two frames complete in one piece: what a frame
        that h2 refuses after a GOAWAY follows is kept); False once the connection ended."""
        data = self.sock.recv(1 << 20)
        if not data:
            return False
        self.received += len(data)
        return all(self._take(data[i:i + piece]) for i in range(0, len(data), piece))

    def _take(self, data: bytes) -> bool:
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            return False
        for ev in events:
            if isinstance(ev, (h2.events.TrailersReceived, h2.events.ResponseReceived)):
                self.answering.add(ev.stream_id)
                headers = dict(ev.headers)
                if "grpc-status" in headers:
                    self.status[ev.stream_id] = (headers["grpc-status"], headers.get("grpc-message", ""))
            elif isinstance(ev, h2.events.PingReceived):
                self.pings += 1
            elif isinstance(ev, h2.events.StreamReset):
                self.status.setdefault(ev.stream_id, ("reset", str(ev.error_code)))
            elif isinstance(ev, h2.events.ConnectionTerminated):
                self.terminated = ev.additional_data or b""
                return False
        return True

    def drain(self, seconds: float) -> str:
        """Read everything the server sent, sending nothing, until the connection ends or
        ``seconds`` pass: "goaway" (its debug data in ``terminated``), "eof", "reset", or
        "open" if it did not end."""
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            if not select.select([self.sock], [], [], 0.05)[0]:
                continue
            try:
                if not self._receive(piece=8):
                    return "eof" if self.terminated is None else "goaway"
            except ConnectionResetError:
                return "reset"
        return "open"


class Peak:
    """The largest RSS of ``pid`` seen by :meth:`sample`, in MiB."""

    def __init__(self, pid: int):
        self.pid = pid
        self.start = self.peak = rss_mib(pid)

    def sample(self) -> None:
        self.peak = max(self.peak, rss_mib(self.pid))

    @property
    def growth(self) -> float:
        self.sample()
        return self.peak - self.start


def read_request(slots: int) -> bytes:
    return pb.ReadCacheRequest(slot_mapping=encode_tensor(np.zeros(slots, np.int64))).SerializeToString()


# ----------------------------------------------------------------------------- requests


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    """The token required; one message read at a time (the budget is one message)."""
    token_file = tmp_path_factory.mktemp("edge") / "token"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    with ServerProcess({**SMALL, "auth_token_file": str(token_file), "max_message_bytes": EDGE_MESSAGE_BYTES,
                        "max_inflight_bytes": EDGE_MESSAGE_BYTES, "receive_timeout_s": 2}) as p:
        yield p


def _served(p: ServerProcess) -> float:
    """Seconds a GetServerInfo with the token took (it must answer)."""
    t = time.monotonic()
    with grpc.insecure_channel(p.target) as ch:
        info = pb_grpc.PrefillContextServiceStub(ch).GetServerInfo(
            pb.GetServerInfoRequest(), timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert info.instance_id
    return time.monotonic() - t


def _upload_body() -> memoryview:
    """All but the last byte of a STREAM_BYTES message: zero pages never touched (an
    anonymous mapping), so that the client's own memory stays small at full scale."""
    return memoryview(mmap.mmap(-1, STREAM_BYTES - 1))


def test_unauthenticated_uploads_are_refused_before_they_are_read(edge):
    body = _upload_body()
    peak = Peak(edge.proc.pid)
    served: list[float] = []
    with RawH2(edge.port) as raw:
        for _ in range(3):  # 3 waves of 8 streams
            sids = [raw.open("WriteCache", body=body, announced=STREAM_BYTES) for _ in range(8)]
            served.append(_served(edge))  # a valid client, while the streams are open
            assert raw.run(20, until=lambda: all(s in raw.status for s in sids), tick=peak.sample), raw.status  # noqa: B023
            for s in sids:
                assert raw.status[s][0] == UNAUTHENTICATED, raw.status[s]
                assert "authorization" in raw.status[s][1]
    growth = peak.growth
    time.sleep(1)
    print(f"\n24 uploads x {STREAM_BYTES} B announced without the token: RSS {peak.start:.0f} -> peak {peak.peak:.0f} "
          f"-> {rss_mib(edge.proc.pid):.0f} MiB 1 s after, {raw.sent} B sent before the refusals, codes "
          f"{sorted({c for c, _ in raw.status.values()})}; GetServerInfo with the token answered {len(served)} times "
          f"during the waves, in at most {max(served) * 1e3:.0f} ms")
    assert growth < 64, f"RSS grew {growth:.0f} MiB"
    m = edge.scrape()
    assert sample_sum(m["ctxprefill_rejected_requests_total"], reason="unauthenticated") >= 24
    assert sample_sum(m["grpc_server_msg_received_total"], grpc_method="WriteCache") == 0  # no message was read
    _served(edge)


def test_a_unary_call_that_ends_without_its_message_is_invalid_argument(edge):
    """A call half-closed before any message: INVALID_ARGUMENT naming the request (not the
    receive timeout's refusal), and the server goes on."""
    token = (("authorization", f"Bearer {TOKEN}"),)
    with RawH2(int(edge.target.rsplit(":", 1)[1])) as raw:
        sids = [raw.open_empty(m, token) for m in ("ReadCache", "PrefillContext", "WriteCache")]
        assert raw.run(10, lambda: all(s in raw.status for s in sids))
        for s in sids:
            assert raw.status[s] == ("3", "request: the call ended before its message"), raw.status
    assert _served(edge) < 5


def test_reads_are_bounded_by_the_inflight_budget_and_the_receive_timeout(edge):
    body = _upload_body()
    token = (("authorization", f"Bearer {TOKEN}"),)
    peak = Peak(edge.proc.pid)
    with RawH2(edge.port) as raw:
        sids = [raw.open("WriteCache", body=body, announced=STREAM_BYTES, metadata=token) for _ in range(8)]
        assert raw.run(30, until=lambda: all(s in raw.status for s in sids), tick=peak.sample), raw.status
    codes = [raw.status[s] for s in sids]
    assert {c for c, _ in codes} <= {DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED}, codes
    refused = [msg for c, msg in codes if c == RESOURCE_EXHAUSTED]
    timed_out = [msg for c, msg in codes if c == DEADLINE_EXCEEDED]
    assert refused and all("--max-inflight-bytes" in msg for msg in refused), codes
    assert timed_out and all("--receive-timeout-s" in msg for msg in timed_out), codes
    # one message being read at a time (the budget), not all 8
    growth = peak.growth
    print(f"\n8 uploads x {STREAM_BYTES} B with the token, budget {EDGE_MESSAGE_BYTES} B: RSS +{growth:.0f} MiB, "
          f"{len(timed_out)} x DEADLINE_EXCEEDED, {len(refused)} x RESOURCE_EXHAUSTED")
    assert growth < EDGE_MESSAGE_BYTES / MiB + 64, f"RSS grew {growth:.0f} MiB"
    m = edge.scrape()
    handled = m["grpc_server_handled_total"]
    assert sample_sum(handled, grpc_method="WriteCache", grpc_code="RESOURCE_EXHAUSTED") == len(refused)
    assert sample_sum(handled, grpc_method="WriteCache", grpc_code="DEADLINE_EXCEEDED") == len(timed_out)
    assert sample_sum(m["ctxprefill_rejected_requests_total"], reason="inflight_bytes") >= len(refused)
    assert sample_sum(m["ctxprefill_rejected_requests_total"], reason="receive_timeout") == len(timed_out)
    _served(edge)  # the budget is whole again


# ----------------------------------------------------------------------------- answers

ANSWER_LIMIT = 1 * MiB


@pytest.fixture(scope="module")
def answers():
    """Answers of at most 1 MiB, 8 MiB held at once (two 4 MiB messages being read)."""
    with ServerProcess({**SMALL, "max_message_bytes": 4 * MiB, "max_inflight_bytes": 8 * MiB,
                        "max_answer_bytes": ANSWER_LIMIT, "receive_timeout_s": 2}) as p:
        yield p


def test_answers_over_the_limit_are_refused_before_they_are_allocated(answers):
    # the amplification scaled: 16 KB asking for 2.3 MB (7 MiB for 1 GiB at full size), 3 calls,
    # from a client that takes 64 bytes of each answer and never opens its window further
    amplified = read_request(2000)
    assert 2000 * BYTES_PER_SLOT > ANSWER_LIMIT
    peak = Peak(answers.proc.pid)
    with RawH2(answers.port, window=64) as raw:
        sids = [raw.open("ReadCache", body=amplified, end=True) for _ in range(3)]
        assert raw.run(30, until=lambda: all(s in raw.status for s in sids), tick=peak.sample), raw.status
    for s in sids:
        code, msg = raw.status[s]
        assert code == RESOURCE_EXHAUSTED and "slot_mapping" in msg and "--max-answer-bytes" in msg, (code, msg)
    assert peak.growth < 64, f"RSS grew {peak.growth:.0f} MiB"
    with PrefillContextClient(answers.target, retries=0) as c:
        # PrefillContext's inline output: 4100 rows x 128 x 2 B + LSE, over 1 MiB
        with pytest.raises(CtxPrefillRpcError) as ei:
            c.prefill_context(np.zeros((4100, 1, 192), np.float32), [(4100, 0, [])], timeout=30)
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-answer-bytes" in str(ei.value) and "q" in str(ei.value)
        # within the limit: answered
        assert c.read_cache(np.zeros(900, np.int64), timeout=30).shape[0] == 900
    m = answers.scrape()
    assert sample_sum(m["ctxprefill_rejected_requests_total"], reason="answer_bytes") == 4
    assert sample_sum(m["grpc_server_handled_total"], grpc_method="ReadCache", grpc_code="RESOURCE_EXHAUSTED") == 3


def test_unread_answers_are_held_within_the_budget(answers):
    slots, calls = 900, 12  # 1.04 MB answers, charged twice: at most 4 held in 8 MiB
    assert slots * BYTES_PER_SLOT <= ANSWER_LIMIT
    request = read_request(slots)
    peak = Peak(answers.proc.pid)
    with RawH2(answers.port, window=64) as raw:  # takes 64 bytes of each answer
        sids = [raw.open("ReadCache", body=request, end=True) for _ in range(calls)]

        def refusals() -> list[str]:
            return [raw.status[s][1] for s in sids if s in raw.status]

        raw.run(20, until=lambda: len(refusals()) >= calls - 4, tick=peak.sample)
        raw.run(3, until=lambda: len(refusals()) == calls, tick=peak.sample)  # reads still waiting: 2 s at most
        assert calls - 4 <= len(refusals()) < calls, raw.status
        assert all(c == RESOURCE_EXHAUSTED for c, _ in raw.status.values()), raw.status
        assert all("--max-inflight-bytes" in msg for msg in refusals()), raw.status
        assert peak.growth < 64, f"RSS grew {peak.growth:.0f} MiB"
    # the client went: its calls end, and what they held is given back
    t_end = time.monotonic() + 20
    with PrefillContextClient(answers.target, retries=0) as c:
        while True:
            try:
                assert c.read_cache(np.zeros(slots, np.int64), timeout=30).shape[0] == slots
                break
            except CtxPrefillRpcError as e:
                assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < t_end, e
                time.sleep(0.2)


# ----------------------------------------------------------------------------- units


def test_budget_serves_waiters_in_order_and_times_out():
    async def main() -> None:
        b = Budget(10)
        assert await b.take(6, None)
        first = asyncio.ensure_future(b.take(6, 5))
        second = asyncio.ensure_future(b.take(3, 5))
        await asyncio.sleep(0.01)
        assert not first.done() and not second.done()  # 3 would fit, but it waits behind the first
        b.give(6)
        assert await first and await second and b.held == 9
        assert not await b.take(5, 0.05) and b.held == 9  # timed out: nothing taken
        waiter = asyncio.ensure_future(b.take(5, None))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        b.give(9)
        assert b.held == 0 and await b.take(10, 0)

    asyncio.run(main())


def test_memory_flags_are_checked():
    check_serve_settings(ServeSettings())
    for kw, flag in (({"max_message_bytes": 64 * MiB, "max_inflight_bytes": 32 * MiB}, "--max-inflight-bytes"),
                     ({"max_answer_bytes": 0}, "--max-answer-bytes"),
                     ({"receive_timeout_s": 0.0}, "--receive-timeout-s")):
        with pytest.raises(ConfigError, match=flag):
            check_serve_settings(ServeSettings(**kw))

