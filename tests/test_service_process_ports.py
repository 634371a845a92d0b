"""The test helper's server starts again on new ports when a picked port was taken
before the server could bind it (another process on the machine took it)."""

from __future__ import annotations

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import service_process  # noqa: E402


def test_server_restarts_on_new_ports_when_a_picked_port_is_taken(monkeypatch):
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    busy = taken.getsockname()[1]
    real = service_process.free_port
    picks = iter([busy])
    monkeypatch.setattr(service_process, "free_port", lambda: next(picks, None) or real())
    srv = service_process.ServerProcess({"heads": 2, "num_blocks": 8, "block_size": 16, "workspace_tokens": 64})
    try:
        assert srv.port == busy
        srv.wait_ready(60)
        assert srv.port != busy  # started again, on a port it could bind
        assert service_process.http_get(srv.metrics_url + "/readyz")[0] == 200
    finally:
        srv.kill()
        taken.close()


def test_a_picked_metrics_port_that_answers_another_protocol_is_not_ready(monkeypatch):
    """A picked metrics port taken by another process's gRPC port (it answers HTTP/2
    frames, not HTTP/1.1): readiness polling keeps waiting, the server fails to bind it and
    starts again on new ports."""
    import threading

    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(8)
    busy = squatter.getsockname()[1]
    stop = threading.Event()

    def answer():
        squatter.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = squatter.accept()
            except OSError:
                continue
            with conn:  # an HTTP/2 SETTINGS frame, as a gRPC server opens with
                conn.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x7f\xff\xff\xff")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    real = service_process.free_port
    picks = iter([real(), busy])  # the gRPC port, then the metrics port: the squatter's
    monkeypatch.setattr(service_process, "free_port", lambda: next(picks, None) or real())
    srv = service_process.ServerProcess({"heads": 2, "num_blocks": 8, "block_size": 16, "workspace_tokens": 64})
    try:
        assert srv.metrics_port == busy
        srv.wait_ready(60)
        assert srv.metrics_port != busy
        assert service_process.http_get(srv.metrics_url + "/readyz")[0] == 200
    finally:
        srv.kill()
        stop.set()
        t.join(5)
        squatter.close()


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """The OS may offer a port again once the probing socket is closed; free_port skips
    ports it has handed out, so two servers started together do not share one."""
    offered = iter([41000, 41001, 41000, 41002])

    class Probe:
        def __init__(self, *a):
            self.port = next(offered)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return None

        def bind(self, addr):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(service_process, "_GIVEN", set())
    monkeypatch.setattr(service_process.socket, "socket", Probe)
    assert [service_process.free_port() for _ in range(3)] == [41000, 41001, 41002]
