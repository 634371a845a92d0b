"""An answer its client does not take within ``--send-timeout-s`` closes the client's
connection (docs/RELIABILITY.md "Memory bounds"): grpcio's server has no per-call
cancel, so the server shuts down the connection's socket (``service/connections.py``)
and gRPC ends every call on it, giving back what their answers held.

The client here defeats keepalive: a raw HTTP/2 client (``h2``) sends a ReadCache whose
answer is 39 MB and keeps reading frames — acknowledging every ping — but never opens
its 64 KiB window. Through several keepalive periods the connection stays open and the
answer holds the budget (a second such request is RESOURCE_EXHAUSTED); at the send
timeout the connection is closed, the metric counts it and the request is served again.
"""

from __future__ import annotations

import re
import time

import grpc
import numpy as np
import pytest

from ctxprefill.errors import ConfigError
from ctxprefill.service.connections import ConnectionCloser, parse_peer
from ctxprefill.settings import ServeSettings, check_serve_settings
from ctxprefill_client import CtxPrefillRpcError, PrefillContextClient
from service_process import ServerProcess, sample_sum
from test_hostile_memory import BYTES_PER_SLOT, RawH2, read_request
from test_keepalive import FLAGS as KEEPALIVE_FLAGS
from test_keepalive import SLOTS, read_slots

SEND_TIMEOUT_S = 4.0
KEEPALIVE_S = 0.5  # pings every 0.5 s, each acknowledged: keepalive never closes this client
FLAGS = {**KEEPALIVE_FLAGS, "keepalive_time_s": KEEPALIVE_S, "keepalive_timeout_s": KEEPALIVE_S,
         "send_timeout_s": SEND_TIMEOUT_S}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(FLAGS) as p:
        yield p


def test_an_answer_whose_window_never_opens_is_ended_by_the_send_timeout(server):
    answer = SLOTS * BYTES_PER_SLOT
    assert 2 * answer + FLAGS["max_message_bytes"] > FLAGS["max_inflight_bytes"]  # no room for a second
    with RawH2(server.port) as raw:
        sid = raw.open("ReadCache", body=read_request(SLOTS), end=True)
        assert raw.run(30, until=lambda: sid in raw.answering), raw.status
        t_answering = time.monotonic()
        # reading on, never opening the window, for several keepalive periods
        raw.run(SEND_TIMEOUT_S / 2, until=lambda: raw.ended)
        assert not raw.ended and raw.pings >= 2, (raw.ended, raw.pings)
        with pytest.raises(CtxPrefillRpcError) as ei:  # the answer holds the budget
            read_slots(server.target)
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-inflight-bytes" in str(ei.value)
        held = re.search(r"calls hold (\d+) of", str(ei.value))
        assert held and int(held.group(1)) >= 2 * answer, str(ei.value)
        # the send timeout closes the connection (30 s: a bound for a hung test only)
        assert raw.run(30, until=lambda: raw.ended), "the connection stayed open"
        closed_s = time.monotonic() - t_answering
        print(f"\n{answer} B answer, window never opened, {raw.pings} pings acknowledged: connection closed "
              f"{closed_s:.2f} s after the answer started (--send-timeout-s {SEND_TIMEOUT_S:g}), "
              f"{raw.received} B received")
        assert closed_s >= SEND_TIMEOUT_S - 1.0  # the timeout, not keepalive, ended it
        assert sid not in raw.status and raw.received < answer  # the answer was never delivered
    assert read_slots(server.target).shape[0] == SLOTS  # the budget is whole again
    m = server.scrape()
    assert sample_sum(m["ctxprefill_rejected_requests_total"], reason="send_timeout") == 1
    assert "--send-timeout-s" in server.log() and "its connection is closed" in server.log()


def test_an_answer_taken_in_time_keeps_its_connection(server):
    """An answer taken is no longer timed: a channel that stays open past the send
    timeout after its answers keeps its connection and serves the next call."""
    def timed_out() -> float:
        return sample_sum(server.scrape()["ctxprefill_rejected_requests_total"], reason="send_timeout")

    before = timed_out()
    with PrefillContextClient(server.target, retries=0) as c:
        assert c.read_cache(np.zeros(SLOTS, np.int64), timeout=30).shape[0] == SLOTS
        time.sleep(SEND_TIMEOUT_S + 1)
        assert c.read_cache(np.zeros(SLOTS, np.int64), timeout=30).shape[0] == SLOTS
        assert c.server_info(timeout=10) is not None
    assert timed_out() == before


def test_peers_name_their_connection():
    assert parse_peer("ipv4:10.1.2.3:5000") == ("10.1.2.3", 5000)
    assert parse_peer("ipv6:[::1]:40000") == ("::1", 40000)
    assert parse_peer("ipv6:%5B::1%5D:40000") == ("::1", 40000)
    assert parse_peer("ipv6:[::ffff:127.0.0.1]:7") == ("127.0.0.1", 7)  # a dual-stack socket's IPv4 peer
    assert parse_peer("unix:/tmp/ctxprefill.sock") is None
    assert parse_peer("ipv4:nonsense") is None


def test_the_closer_shuts_down_the_named_connection_only():
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    accepted = [listener.accept()[0] for _ in clients]
    try:
        target = clients[0].getsockname()
        closer = ConnectionCloser({port})
        assert not ConnectionCloser({port + 1 if port < 65535 else port - 1}).close(f"ipv4:{target[0]}:{target[1]}")
        assert closer.close(f"ipv4:{target[0]}:{target[1]}")
        clients[0].settimeout(5)
        assert clients[0].recv(1) == b""  # shut down: the peer sees the end
        clients[1].sendall(b"x")
        assert accepted[1].recv(1) == b"x"  # the other connection is untouched
        assert not closer.close("unix:/tmp/none.sock")
    finally:
        for s in (*clients, *accepted, listener):
            s.close()


def test_send_timeout_flag_is_checked():
    for bad in (0.0, -1.0, float("nan"), 1e6):
        with pytest.raises(ConfigError, match="--send-timeout-s"):
            check_serve_settings(ServeSettings(send_timeout_s=bad))
