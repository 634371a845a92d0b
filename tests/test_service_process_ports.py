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
