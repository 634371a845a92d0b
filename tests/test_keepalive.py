"""A client that stops reading its connection is closed by the server's keepalive
(docs/RELIABILITY.md "Memory bounds"), before ``--send-timeout-s`` (its own test:
``test_send_timeout.py``): an answer waiting on it stays charged to
``--max-inflight-bytes`` for as long as the call lives. The server pings every connection
each ``--keepalive-time-s``;
a ping not acknowledged within ``--keepalive-timeout-s`` closes the connection, its
calls end, and what their answers held is given back.

A raw HTTP/2 client (``h2``) sends a ReadCache whose answer is 39 MB (under
``--max-answer-bytes``) and, once the answer has started, never reads its socket again:

- with the default 64 KiB window the server has sent what the window allows and waits;
  its ping goes unacknowledged: GOAWAY ``ping_timeout``;
- with a 2 GiB window the server's writes fill the socket buffers and stall (a zero TCP
  window); Linux aborts the connection after the TCP_USER_TIMEOUT that gRPC sets from
  ``--keepalive-timeout-s``.

Either way: while the answer is held a second such request finds no room
(RESOURCE_EXHAUSTED naming the bytes held); after the close it is served.
"""

from __future__ import annotations

import re
import time

import grpc
import numpy as np
import pytest

from ctxprefill.errors import ConfigError
from ctxprefill.service.server import grpc_options
from ctxprefill.settings import ServeSettings, check_serve_settings
from ctxprefill_client import CtxPrefillRpcError, PrefillContextClient
from service_process import ServerProcess
from test_hostile_memory import BYTES_PER_SLOT, MiB, RawH2, read_request

SLOTS = 34_000  # a 39 MB answer: more than loopback's socket buffers hold; its request is 272 KB
KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S = 3, 2
# one 64 MiB message read at a time next to one such answer (charged twice), not two
FLAGS = {"heads": 1, "block_size": 16, "num_blocks": 8, "workspace_tokens": 64, "max_message_bytes": 64 * MiB,
         "max_inflight_bytes": 128 * MiB, "max_answer_bytes": 64 * MiB, "receive_timeout_s": 0.5,
         "keepalive_time_s": KEEPALIVE_TIME_S, "keepalive_timeout_s": KEEPALIVE_TIMEOUT_S}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(FLAGS) as p:
        yield p


def read_slots(target: str) -> np.ndarray:
    """ReadCache of ``SLOTS`` slots (the answer these tests hold) through a gRPC client."""
    with PrefillContextClient(target, retries=0) as c:
        return c.read_cache(np.zeros(SLOTS, np.int64), timeout=30)


@pytest.mark.parametrize("window", [65535, 2**31 - 1], ids=["window-64KiB", "window-2GiB"])
def test_an_answer_never_read_is_ended_by_keepalive_and_its_budget_given_back(server, window):
    answer = SLOTS * BYTES_PER_SLOT
    assert 2 * answer + FLAGS["max_message_bytes"] > FLAGS["max_inflight_bytes"]  # no room for a second
    with RawH2(server.port, window=window) as raw:
        sid = raw.open("ReadCache", body=read_request(SLOTS), end=True)
        # frames are read (window updates for the request) until the answer has started; never after
        assert raw.run(30, until=lambda: sid in raw.answering), raw.status
        assert sid not in raw.status
        t_stop = time.monotonic()
        with pytest.raises(CtxPrefillRpcError) as ei:  # the answer holds the budget
            read_slots(server.target)
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-inflight-bytes" in str(ei.value)
        held = re.search(r"calls hold (\d+) of", str(ei.value))
        assert held and int(held.group(1)) >= 2 * answer, str(ei.value)
        # the client never acknowledges the server's ping: the connection is closed, the call
        # ends, and the same request is served again (60 s: a bound for a hung test only)
        t_end = time.monotonic() + 60
        while True:
            try:
                assert read_slots(server.target).shape[0] == SLOTS
                break
            except CtxPrefillRpcError as e:
                assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < t_end, e
        released_s = time.monotonic() - t_stop
        ended = raw.drain(10)
        print(f"\n{answer} B answer never read (window {window}): {int(held.group(1))} B held; served again "
              f"{released_s:.2f} s after the client stopped reading; connection {ended} "
              f"{raw.terminated!r}, {raw.received} B received")
        assert ended != "open"  # the server closed it
        if window == 65535:
            assert ended == "goaway" and raw.terminated == b"ping_timeout"
        assert sid not in raw.status and raw.received < answer  # the answer was never delivered


def test_keepalive_flags_reach_grpc_and_are_checked():
    opts = dict(grpc_options(ServeSettings(keepalive_time_s=60, keepalive_timeout_s=20)))
    assert opts["grpc.keepalive_time_ms"] == 60_000 and opts["grpc.keepalive_timeout_ms"] == 20_000
    assert opts["grpc.http2.ping_timeout_ms"] == 20_000  # what closes the connection in grpcio
    assert opts["grpc.keepalive_permit_without_calls"] == 1 and opts["grpc.http2.max_pings_without_data"] == 0
    assert dict(grpc_options(ServeSettings(keepalive_time_s=0.5)))["grpc.keepalive_time_ms"] == 500
    for kw, flag in (({"keepalive_time_s": 0.05}, "--keepalive-time-s"),
                     ({"keepalive_time_s": float("nan")}, "--keepalive-time-s"),
                     ({"keepalive_timeout_s": 0.0}, "--keepalive-timeout-s"),
                     ({"keepalive_timeout_s": 7200.0}, "--keepalive-timeout-s")):
        with pytest.raises(ConfigError, match=flag):
            check_serve_settings(ServeSettings(**kw))
