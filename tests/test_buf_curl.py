"""`buf curl` — a client that knows nothing of our proto files — calls GetServerInfo on a
running server through gRPC server reflection."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from service_process import ServerProcess

BUF_VERSION = "1.75.0"


def buf_binary() -> str | None:
    if os.environ.get("BUF"):
        return os.environ["BUF"]
    tools = os.environ.get("CTXPREFILL_TOOLS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ctxprefill-tools")
    cached = os.path.join(tools, f"buf-{BUF_VERSION}", "node_modules", ".bin", "buf")
    return cached if os.access(cached, os.X_OK) else shutil.which("buf")


def test_buf_curl_get_server_info_through_reflection(tmp_path):
    buf = buf_binary()
    if buf is None:
        pytest.skip("buf not installed (scripts/lint_proto.sh installs it; CI runs that first)")
    srv = ServerProcess({"heads": 2, "block_size": 16, "num_blocks": 8, "workspace_tokens": 64})
    try:
        srv.wait_ready()
        r = subprocess.run(
            [buf, "curl", "--protocol", "grpc", "--http2-prior-knowledge", "--data", "{}",
             f"http://{srv.target}/ctxprefill.v1.PrefillContextService/GetServerInfo"],
            capture_output=True, text=True, timeout=60, cwd=str(tmp_path))  # no proto files around: reflection only
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        assert len(info["instanceId"]) == 32 and info["numHeads"] == 2 and info["kvLoraRank"] == 512
        assert info["cacheDtype"] == "auto" and int(info["numBlocks"]) == 8
    finally:
        srv.kill()
