"""Overload, the CI version of ``scripts/loadtest.py`` (docs/RELIABILITY.md): a real CPU
server with ``--queue-size 8``, driven by the script's closed-loop clients, 8 (at
capacity) for a few seconds, then 64 (far above it). Behaviour only:

- at capacity no request fails;
- above it the overflow is refused with RESOURCE_EXHAUSTED (the server counts each as
  ``rejected{reason="queue_full"}``) and nothing else fails;
- every admitted request is answered: each PrefillContext call the server started has
  ended, and its OK count is the clients' own;
- the queue depth is back to 0 once the clients stop;
- the server's resident memory does not grow after the warm-up (16 MiB / 5 % slack);
- the server drains and exits 0.

The latency figures (the refusals' p99 among them) are a benchmark's:
``bench/bench_overload.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from service_process import ROOT, ServerProcess, sample_sum

SCRIPT = os.path.join(ROOT, "scripts", "loadtest.py")
QUEUE = 8
METHOD = {"grpc_service": "ctxprefill.v1.PrefillContextService", "grpc_method": "PrefillContext"}


def _settled(srv: ServerProcess, limit_s: float = 60.0) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The metrics once no PrefillContext call is in progress (every started one handled,
    nothing queued), or the last page after ``limit_s``: the assertions then say what is off."""
    t_end = time.monotonic() + limit_s
    while True:
        m = srv.scrape()
        started = sample_sum(m["grpc_server_started_total"], **METHOD)
        handled = sample_sum(m["grpc_server_handled_total"], **METHOD)
        if (started == handled and sample_sum(m["ctxprefill_queue_depth"]) == 0) or time.monotonic() > t_end:
            return m
        time.sleep(0.2)


@pytest.fixture(scope="module")
def overload(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("overload")
    # OMP_NUM_THREADS=1: the clients run on the same cores (docs/RELIABILITY.md)
    srv = ServerProcess({"heads": 1, "block_size": 16, "num_blocks": 64, "workspace_tokens": 256,
                         "queue_size": QUEUE}, grace_seconds=30, env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_ready()
        out = tmp / "report.json"
        # the script judges refusal latency too: unbounded here, that figure is the benchmark's
        r = subprocess.run([sys.executable, SCRIPT, "--target", srv.target, "--pid", str(srv.proc.pid),
                            "--duration", "4", "--queue-size", str(QUEUE), "--clients", "64",
                            "--max-reject-p99-ms", "inf", "--json", str(out)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.exists(), f"no report (exit {r.returncode}):\n{r.stderr[-3000:]}"
        report = json.loads(out.read_text())
        print(f"phases: {json.dumps(report['phases'])} rss={report.get('rss')} failures={report['failures']}")
        metrics = _settled(srv)
        exit_code = srv.terminate(60)
        return {"report": report, "metrics": metrics, "exit_code": exit_code, "log": srv.log()[-3000:]}
    finally:
        srv.terminate(10)
        srv.kill()


def test_at_capacity_nothing_fails(overload: dict[str, Any]) -> None:
    below = overload["report"]["phases"]["below"]
    assert below["clients"] == QUEUE
    assert set(below["codes"]) == {"OK"} and below["codes"]["OK"] > 0, below


def test_overflow_is_refused_with_resource_exhausted(overload: dict[str, Any]) -> None:
    above = overload["report"]["phases"]["above"]
    assert above["clients"] == 64
    assert set(above["codes"]) == {"OK", "RESOURCE_EXHAUSTED"}, above
    refused = above["codes"]["RESOURCE_EXHAUSTED"]
    m = overload["metrics"]
    assert sample_sum(m["grpc_server_handled_total"], grpc_code="RESOURCE_EXHAUSTED", **METHOD) == refused
    assert sample_sum(m["ctxprefill_rejected_requests_total"], reason="queue_full") == refused


def test_every_admitted_request_is_answered(overload: dict[str, Any]) -> None:
    phases = overload["report"]["phases"]
    answered = phases["below"]["codes"]["OK"] + phases["above"]["codes"]["OK"]
    m = overload["metrics"]
    started = sample_sum(m["grpc_server_started_total"], **METHOD)
    assert sample_sum(m["grpc_server_handled_total"], **METHOD) == started
    assert sample_sum(m["grpc_server_handled_total"], grpc_code="OK", **METHOD) == answered
    assert started == sum(p["requests"] for p in phases.values())


def test_queue_drains_to_zero(overload: dict[str, Any]) -> None:
    m = overload["metrics"]
    assert sample_sum(m["ctxprefill_queue_depth"]) == 0
    assert sample_sum(m["ctxprefill_queue_capacity"]) == QUEUE


def test_memory_stays_flat_and_the_server_exits_cleanly(overload: dict[str, Any]) -> None:
    rss = overload["report"]["rss"]
    assert rss["growth_mib"] <= max(16.0, 0.05 * rss["after_warmup_mib"]), rss
    assert overload["report"]["failures"] == []
    assert overload["exit_code"] == 0, overload["log"]
