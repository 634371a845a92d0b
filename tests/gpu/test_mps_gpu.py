"""ctxprefill.mps against the real driver: a process is an MPS client exactly when it starts
CUDA with a running daemon's pipe directory in its environment, and a server started so
says it in GetServerInfo and its "serving" log line. The daemon is the benchmarks' private
one (bench/ctxprefill_bench/mps.py: its own pipe and log directories, told to quit on exit),
so nothing else on the machine is touched; this process stays out of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from ctxprefill_bench import mps as mps_daemon  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: MPS runs on the GPU machine"),
              pytest.mark.skipif(not mps_daemon.available(), reason=f"{mps_daemon.CONTROL} is not installed here")]

ASK = ("import sys, torch; sys.path[:0] = sys.argv[1:]; torch.zeros(1, device='cuda'); "
       "from ctxprefill.mps import mps_client; print(mps_client(torch.cuda.current_device()))")


def _ask(env: dict[str, str]) -> str:
    r = subprocess.run([sys.executable, "-c", ASK, os.path.join(ROOT, "server"), os.path.join(ROOT, "client")],
                       env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_a_process_is_a_client_only_under_a_daemon(tmp_path):
    # an empty pipe directory: no daemon there, so CUDA runs in a context of the process's own
    assert _ask({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) == "False"
    with mps_daemon.mps_daemon() as env:
        assert _ask(env) == "True"


def test_a_server_under_a_daemon_says_so():
    from ctxprefill_client import PrefillContextClient
    from service_process import ServerProcess

    flags = {"device": f"cuda:{torch.cuda.current_device()}", "heads": 1, "block_size": 16, "num_blocks": 8,
             "workspace_tokens": 64, "log_level": "INFO"}
    with mps_daemon.mps_daemon() as env:
        proc = ServerProcess(flags, env=env)
        try:
            proc.wait_ready(timeout=600)
            with PrefillContextClient(proc.target, retries=0, timeout=60) as c:
                assert c.server_info().mps_client is True
            assert proc.terminate(60) == 0  # the daemon quits only after its clients have exited
            serving = [g for g in map(json.loads, proc.log().splitlines()) if g.get("msg") == "serving"]
        finally:
            proc.kill()
    assert len(serving) == 1 and serving[0]["mps_client"] is True, serving
