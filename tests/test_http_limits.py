"""The HTTP port (metrics, health) cannot starve the gRPC port (docs/RELIABILITY.md,
"Threat model", attack 4).

A real server whose file-descriptor limit is lowered to 1,024, and 2,000 connections to
its HTTP port from eight loopback addresses, each sending only a partial request line:
unbounded, they would take every descriptor and gRPC clients would get DEADLINE_EXCEEDED.
Here GetServerInfo answers throughout (a fresh channel each call), /healthz answers an
address that holds no connection (as the kubelet's probe) throughout, the server never holds
more descriptors for them than the cap (256, and 32 kept for new addresses), closes every
idle connection within the request-head timeout, and its log grows by less than 1 MB.

In-process: the request-head and size limits on uvicorn's protocol, /metrics through
prometheus_client (OpenMetrics by Accept, gzip by Accept-Encoding), and the log filter
that lets a repeated line through once a second with a count.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import os
import resource
import select
import socket
import sys
import time

import grpc
import pytest

from ctxprefill.service import http as http_mod
from ctxprefill.service.http import (
    HEADER_TIMEOUT_S,
    MAX_CONNECTIONS,
    RESERVED_FOR_NEW_PEERS,
    HttpApp,
    RateLimitFilter,
    bind_socket,
    make_uvicorn_server,
)
from ctxprefill.service.metrics import Metrics
from ctxprefill_api import pb, pb_grpc
from service_process import ServerProcess, http_get

FLAGS = {"heads": 1, "block_size": 16, "num_blocks": 8, "workspace_tokens": 64}
FLOOD = 2000  # idle connections (5,000 scaled to fit CI)
SOURCES = [f"127.0.0.{i}" for i in range(1, 9)]  # loopback source addresses: past the per-address cap too
HEALTH_SOURCE = "127.0.0.200"  # the probe's own address, as the kubelet's
SERVER_NOFILE = 1024  # the server's descriptor limit during the flood: fewer than FLOOD
PARTIAL = b"GET /metrics HTTP/1.1\r\n"  # a request line, and never the headers' end


def _raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"this test holds {need} sockets; RLIMIT_NOFILE's hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _healthz_from(source: str, port: int) -> int | str:
    """GET /healthz from loopback address ``source``: the status, or the error's name."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            s.bind((source, 0))
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head = s.recv(64)
        except OSError as e:
            return type(e).__name__
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else repr(head)


def _server_info(target: str) -> None:
    """GetServerInfo on a new channel, a few seconds' deadline: raises grpc.RpcError on failure."""
    with grpc.insecure_channel(target) as ch:
        pb_grpc.PrefillContextServiceStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts the server's descriptors in /proc")
def test_idle_http_connections_cannot_starve_grpc():
    _raise_nofile(FLOOD + 256)
    srv = ServerProcess(FLAGS, grace_seconds=2)
    socks: list[socket.socket] = []
    try:
        srv.wait_ready(timeout=120)
        pid = srv.proc.pid
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (SERVER_NOFILE, SERVER_NOFILE))
        _server_info(srv.target)
        fds_before, log_before = _open_fds(pid), len(srv.log().encode())

        # -- the flood: connect and send a partial request line (a connection the server
        # closes at once shows as a failed connect or send: counted, it is what the cap does)
        refused_early, t_start = 0, time.monotonic()
        for i in range(FLOOD):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.bind((SOURCES[i % len(SOURCES)], 0))
                s.connect(("127.0.0.1", srv.metrics_port))
                s.sendall(PARTIAL)
            except OSError:
                refused_early += 1
                s.close()
                continue
            socks.append(s)
        t_flood = time.monotonic()

        # -- while they are held: gRPC answers, the server's descriptors stay bounded;
        # wait (bounded) for the server to close every one of them
        poller = select.poll()
        by_fd = {s.fileno(): s for s in socks}
        for fd in by_fd:
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        open_left, calls, max_fds, health = set(by_fd), 0, fds_before, []
        deadline = t_flood + HEADER_TIMEOUT_S + 15
        while (open_left or calls < 10) and time.monotonic() < deadline:
            _server_info(srv.target)  # raises on DEADLINE_EXCEEDED / UNAVAILABLE
            calls += 1
            if open_left:  # the pool is full: an address that holds nothing still gets in
                health.append(_healthz_from(HEALTH_SOURCE, srv.metrics_port))
            max_fds = max(max_fds, _open_fds(pid))
            for fd, _ in poller.poll(200):
                if fd in open_left:
                    with contextlib.suppress(OSError):
                        assert by_fd[fd].recv(4096) == b"", "the server answered a request that never ended"
                    open_left.discard(fd)
                    poller.unregister(fd)
        assert not open_left, (f"{len(open_left)} of {len(socks)} idle connections still open "
                               f"{HEADER_TIMEOUT_S + 15:.0f} s after they were opened")
        cap = MAX_CONNECTIONS + RESERVED_FOR_NEW_PEERS
        assert max_fds <= fds_before + cap + 8, (max_fds, fds_before)  # 8: gRPC calls, a refusal
        assert health and all(status == 200 for status in health), health
        assert max_fds < SERVER_NOFILE

        # -- afterwards: the HTTP port serves again, gRPC still does, the log stayed small
        assert http_get(srv.metrics_url + "/healthz")[0] == 200
        _server_info(srv.target)
        log = srv.log()
        grown = len(log.encode()) - log_before
        assert grown < 1 << 20, f"the server's log grew by {grown} bytes"
        assert "out of system resource" not in log  # accept() never ran out of descriptors
        refused_lines = log.count('"HTTP connection refused: too many open"')
        assert 1 <= refused_lines <= time.monotonic() - t_start + 2  # once a second at most
        print(f"\n{len(socks)} held + {refused_early} refused at once (flood {t_flood - t_start:.1f} s); {calls} "
              f"GetServerInfo calls answered, /healthz from another address {len(health)} of {len(health)}; "
              f"server descriptors {fds_before} -> at most {max_fds} (limit {SERVER_NOFILE}); log +{grown} B")
    finally:
        for s in socks:
            s.close()
        srv.terminate(10)
        srv.kill()


# ------------------------------------------------------------------------------ in-process


@contextlib.asynccontextmanager
async def _uvicorn(app):
    sock = bind_socket("127.0.0.1", 0)
    server = make_uvicorn_server(app, sock)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)


async def _exchange(port: int, data: bytes, read_for: float) -> tuple[bytes, bool]:
    """Send ``data``; what came back, and whether the server closed the connection within ``read_for`` s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    got = b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), timeout=read_for)
            if not chunk:
                return got, True
            got += chunk
    except TimeoutError:
        return got, False
    except ConnectionResetError:
        return got, True
    finally:
        writer.close()


def test_request_head_deadline_and_size(monkeypatch):
    """A head that never ends is closed at the deadline even if bytes keep trickling in
    (uvicorn's keep-alive timer alone is cancelled by any byte); a head over the size
    limit gets 400; a full request gets its answer and the connection stays for the next."""
    monkeypatch.setattr(http_mod, "HEADER_TIMEOUT_S", 0.5)
    app = HttpApp(Metrics(), is_ready=lambda: True)

    async def main():
        async with _uvicorn(app) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\n")
            closed, t0 = False, time.monotonic()
            while not closed and time.monotonic() - t0 < 4:  # two bytes of header every 0.1 s, for up to 4 s
                try:
                    writer.write(b"X-")
                    await writer.drain()
                    closed = await asyncio.wait_for(reader.read(100), timeout=0.1) == b""
                except TimeoutError:
                    continue
                except ConnectionError:
                    closed = True
            writer.close()
            assert closed, "a trickling request head was never closed"
            got, _ = await _exchange(port, b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 5)
            assert got.startswith(b"HTTP/1.1 400"), got[:100]
            got, closed = await _exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 0.3)
            assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"ok\n") and not closed

    asyncio.run(main())


def test_metrics_page_negotiates_openmetrics_and_gzip():
    app = HttpApp(Metrics(), is_ready=lambda: True)

    async def main():
        async with _uvicorn(app) as port:
            # HTTP/1.0: the body comes unchunked, as it is
            got, _ = await _exchange(port, b"GET /metrics HTTP/1.0\r\nHost: x\r\n"
                                           b"Accept: application/openmetrics-text; version=1.0.0\r\n"
                                           b"Accept-Encoding: gzip\r\n\r\n", 5)
            head, _, body = got.partition(b"\r\n\r\n")
            head = head.lower()
            assert head.startswith(b"http/1.1 200 ") and b"content-type: application/openmetrics-text" in head
            assert b"content-encoding: gzip" in head
            page = gzip.decompress(body)
            assert b"ctxprefill_queue_depth" in page and page.rstrip().endswith(b"# EOF")
            got, _ = await _exchange(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 5)
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and body == b""

    asyncio.run(main())


def test_rate_limit_filter_passes_a_repeated_line_once_a_second_with_a_count():
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("ctxprefill.test.rate_limited")
    logger.propagate = False
    handler = Keep()
    logger.addHandler(handler)
    flt = RateLimitFilter(interval=0.3)
    logger.addFilter(flt)

    async def burst():
        for _ in range(10_000):  # what asyncio does per accept attempt when descriptors run out
            logger.error("socket.accept() out of system resource\nsocket: <fd=13>", exc_info=OSError(24, "EMFILE"))
        await asyncio.sleep(0.6)  # the burst's summary comes at the end of its interval

    try:
        asyncio.run(burst())
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(flt)
    assert len(records) == 2, [r.getMessage() for r in records]
    assert not hasattr(records[0], "suppressed") and records[1].suppressed == 9_999
    # another message is limited on its own
    logger.addHandler(handler)
    logger.addFilter(flt)
    try:
        logger.warning("Invalid HTTP request received.")
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(flt)
    assert len(records) == 3


def test_rate_limit_filter_off_the_event_loop_and_under_many_messages(monkeypatch):
    """Without a running loop the held-back count rides on the next line that passes; the
    windows kept are bounded (MAX_KEYS), so a flood of distinct lines costs no growing memory."""
    now = [100.0]
    monkeypatch.setattr("ctxprefill.service.http.time.monotonic", lambda: now[0])
    flt = RateLimitFilter(interval=1.0)

    def rec(msg: str) -> logging.LogRecord:
        return logging.LogRecord("ctxprefill.test", logging.WARNING, __file__, 1, msg, None, None)

    assert flt.filter(rec("busy")) and not flt.filter(rec("busy")) and not flt.filter(rec("busy"))
    now[0] += 1.0
    r = rec("busy")
    assert flt.filter(r) and r.suppressed == 2  # no loop: counted on the next line that passes
    flt.MAX_KEYS = 8
    for i in range(20):
        assert flt.filter(rec(f"distinct {i}"))
        assert len(flt._windows) <= 8
