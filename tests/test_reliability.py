"""Deadlines, cancellation, graceful drain and restarts, against real server processes.

A "slow" request is a real one: a long context (one block repeated) in large chunks,
a second or more of work on the CPU. Each test waits for states it can observe (the
servers' own metrics and health), not for fixed sleeps.

- an expired request is never executed: its deadline passes while it waits behind a
  slow one; ``rejected{reason="deadline"}`` counts it and the query-token counter
  shows that only the slow request ran;
- a cancelled request releases its queue slot at once: the queue depth goes back to
  0 while the slow request still runs, and a following request is admitted;
- SIGTERM with requests in flight: readiness goes NOT_SERVING first (health and
  /readyz) while they still run, new requests get UNAVAILABLE, every admitted request
  completes with the right answer, the process exits 0 within the grace period;
- a restarted server has a new instance_id; a request carrying the old one gets
  FAILED_PRECONDITION, which the client raises as ServerRestartedError.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ctxprefill_api import pb, pb_grpc
from ctxprefill_client import PrefillContextClient, ServerRestartedError, encode_tensor, float32_to_bf16_bits
from service_process import ServerProcess, http_get, parse_metrics, sample_sum, wait_for

SERVICE = "ctxprefill.v1.PrefillContextService"
BS = 16
FLAGS = {"heads": 2, "block_size": BS, "num_blocks": 8, "workspace_tokens": 4096, "seed": 1}


def prefill(rows: int, context: int, workspace: int = 4096) -> pb.PrefillContextRequest:
    """A request of ``rows`` query rows over ``context`` tokens (block 0 repeated)."""
    q = float32_to_bf16_bits(np.random.default_rng(rows).standard_normal((rows, 2, 192)).astype(np.float32))
    return pb.PrefillContextRequest(
        q=encode_tensor(q, pb.DATA_TYPE_BF16),
        sequences=[pb.Sequence(query_len=rows, context_len=context, block_table=[0] * (-(-context // BS)))],
        workspace_tokens=workspace)


SLOW_SECONDS = 3.0  # how long a "slow" request should take (calibrated on the machine at hand)


def counter(proc: ServerProcess, name: str, **labels) -> float:
    return sample_sum(proc.scrape()[name], **labels)


@pytest.fixture(scope="module")
def server():
    with ServerProcess({**FLAGS, "queue_size": 2}, grace_seconds=30) as p:
        # fill block 0 (the slow requests' whole context)
        with PrefillContextClient(p.target, retries=0) as c:
            rng = np.random.default_rng(0)
            c.write_cache(np.arange(BS), rng.standard_normal((BS, 512)), rng.standard_normal((BS, 64)))
        yield p


@pytest.fixture(scope="module")
def slow_context(server) -> int:
    """Context tokens of a request that takes about SLOW_SECONDS here: one request of 64
    chunks is timed, the context scaled from it (CPUs differ by far more than 2x)."""
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.PrefillContextServiceStub(ch)
        probe = 64 * 1024
        t = time.monotonic()
        stub.PrefillContext(prefill(4, probe, workspace=1024), timeout=120)
        dt = time.monotonic() - t
    chunks = max(64, min(64 * 256, int(64 * SLOW_SECONDS / max(dt, 1e-3))))
    return chunks * 1024


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as ch:
        yield pb_grpc.PrefillContextServiceStub(ch)


def _start_slow(server, stub, context: int, rows: int = 4):
    """A slow request, returned once the server has admitted it."""
    before = counter(server, "grpc_server_started_total", grpc_method="PrefillContext")
    fut = stub.PrefillContext.future(prefill(rows, context, workspace=1024), timeout=120)
    wait_for(lambda: counter(server, "grpc_server_started_total", grpc_method="PrefillContext") > before,
             what="the slow request admitted")
    return fut


def test_an_expired_request_is_never_executed(server, stub, slow_context):
    m0 = server.scrape()
    q0 = sample_sum(m0["ctxprefill_query_tokens_total"])
    d0 = sample_sum(m0["ctxprefill_rejected_requests_total"], reason="deadline")
    n0 = sample_sum(m0["ctxprefill_request_duration_seconds_count"])
    slow = _start_slow(server, stub, slow_context, rows=4)
    with pytest.raises(grpc.RpcError) as ei:
        stub.PrefillContext(prefill(7, 64), timeout=0.5)  # waits behind the slow one; its deadline passes
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # answered while the slow one still runs: not after it
    assert not slow.done(), "the slow request finished too early for this test to mean anything"
    wait_for(lambda: counter(server, "ctxprefill_rejected_requests_total", reason="deadline") == d0 + 1,
             what="the expired request counted")
    assert slow.result().stats.query_tokens == 4
    m1 = server.scrape()
    # only the slow request ran: its 4 query rows, not the expired one's 7
    assert sample_sum(m1["ctxprefill_query_tokens_total"]) == q0 + 4
    assert sample_sum(m1["ctxprefill_request_duration_seconds_count"]) == n0 + 1
    assert sample_sum(m1["ctxprefill_rejected_requests_total"], reason="deadline") == d0 + 1
    assert sample_sum(m1["ctxprefill_queue_depth"]) == 0
    handled = m1["grpc_server_handled_total"]
    assert sample_sum(handled, grpc_method="PrefillContext", grpc_code="DEADLINE_EXCEEDED") >= 1


def test_a_cancelled_request_releases_its_queue_slot(server, stub, slow_context):
    m0 = server.scrape()
    q0 = sample_sum(m0["ctxprefill_query_tokens_total"])
    c0 = sample_sum(m0["ctxprefill_rejected_requests_total"], reason="cancelled")
    slow = _start_slow(server, stub, slow_context, rows=4)  # admitted 1 of 2, running
    queued = stub.PrefillContext.future(prefill(5, 64), timeout=120)  # admitted 2 of 2, waiting
    wait_for(lambda: counter(server, "ctxprefill_queue_depth") == 1, what="the second request queued")
    with pytest.raises(grpc.RpcError) as ei:  # the queue is full
        stub.PrefillContext(prefill(6, 64), timeout=30)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # refused at once: while both admitted requests are still in the server, not after a slot freed
    assert not slow.done() and not queued.done()
    assert queued.cancel()
    # the slot is released at once, while the slow request still runs
    wait_for(lambda: counter(server, "ctxprefill_queue_depth") == 0, timeout=5, what="queue depth back to 0")
    wait_for(lambda: counter(server, "ctxprefill_rejected_requests_total", reason="cancelled") == c0 + 1, timeout=5,
             what="the cancellation counted")
    assert not slow.done(), "the slow request finished too early for this test to mean anything"
    following = stub.PrefillContext.future(prefill(3, 64), timeout=120)  # admitted: not RESOURCE_EXHAUSTED
    assert slow.result().stats.query_tokens == 4
    assert following.result().stats.query_tokens == 3
    # the cancelled request never ran: 4 + 3 query rows, not its 5
    assert counter(server, "ctxprefill_query_tokens_total") == q0 + 7
    assert counter(server, "ctxprefill_queue_depth") == 0


def _health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_sigterm_drains_every_admitted_request(slow_context):
    grace = 60.0
    p = ServerProcess({**FLAGS, "queue_size": 8}, grace_seconds=grace)
    try:
        p.wait_ready()
        with PrefillContextClient(p.target, retries=0) as c:
            rng = np.random.default_rng(0)
            c.write_cache(np.arange(BS), rng.standard_normal((BS, 512)), rng.standard_normal((BS, 64)))
        n, context = 4, slow_context // 3
        with grpc.insecure_channel(p.target) as ch:
            stub = pb_grpc.PrefillContextServiceStub(ch)
            ref = stub.PrefillContext(prefill(4, context, workspace=1024), timeout=120)  # the answer, before any drain
            before = counter(p, "grpc_server_started_total", grpc_method="PrefillContext")
            done_at: list[float] = []
            futs = [stub.PrefillContext.future(prefill(4, context, workspace=1024), timeout=120) for _ in range(n)]
            for f in futs:
                f.add_done_callback(lambda _f: done_at.append(time.monotonic()))
            wait_for(lambda: counter(p, "grpc_server_started_total", grpc_method="PrefillContext") == before + n,
                     what="all requests admitted")
            t_term = time.monotonic()
            p.proc.send_signal(15)
            # readiness goes first, while the admitted requests still run
            wait_for(lambda: _health(p.target, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5,
                     what="health NOT_SERVING")
            t_not_ready = time.monotonic()
            assert http_get(p.metrics_url + "/readyz")[0] == 503
            assert _health(p.target, "") == health_pb2.HealthCheckResponse.SERVING  # still alive
            with pytest.raises(grpc.RpcError) as ei:  # new requests are turned away
                stub.PrefillContext(prefill(2, 64), timeout=10)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
            assert len(done_at) < n, "the requests finished before the drain could be observed"
            results = [f.result() for f in futs]  # every admitted request completes
            assert min(done_at) > t_not_ready
        rc = p.proc.wait(timeout=grace + 10)
        t_exit = time.monotonic() - t_term
        assert rc == 0, p.log()
        assert t_exit < grace
        for r in results:  # ... with the right answer
            assert r.output.data == ref.output.data and r.lse.data == ref.lse.data
        log = p.log()
        assert '"left_running": 0' in log, log
    finally:
        p.kill()


_SLOW_WARM_UP = r"""
import sys, torch
from ctxprefill import app
from ctxprefill.settings import ServeSettings

def build_and_warm(s, weights):  # a warm-up that never ends, inside torch's C++ most of the time
    a = torch.ones(512, 512)
    while True:
        a = torch.mm(a, a) * 1e-3

app.build_and_warm = build_and_warm
sys.exit(app.serve(ServeSettings(device="cpu", port=int(sys.argv[1]), metrics_port=int(sys.argv[2]))))
"""


def test_sigterm_during_a_long_warm_up_exits_zero_after_the_wait(tmp_path):
    """SIGTERM while the engine thread still builds: the process waits ENGINE_STOP_S for
    it, says so, and exits 0 without interpreter shutdown (which would end the thread
    inside torch's C++ and abort: exit 134)."""
    import subprocess
    import sys

    from ctxprefill.service.server import ENGINE_STOP_S
    from service_process import ROOT, env_with_sources, free_port

    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _SLOW_WARM_UP, str(free_port()), str(free_port())],
                                cwd=ROOT, env=env_with_sources(), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: '"msg": "listening"' in log.read_text(), timeout=60, what="listening")
        time.sleep(0.3)  # the warm-up runs
        t0 = time.monotonic()
        proc.terminate()
        rc = proc.wait(timeout=ENGINE_STOP_S + 30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "stopped before the engine was ready" in text and "engine thread still running at exit" in text, text
    assert ENGINE_STOP_S <= took < ENGINE_STOP_S + 20, took


def test_a_restarted_server_is_detected():
    p1 = ServerProcess(FLAGS)
    p2 = None
    try:
        p1.wait_ready()
        client = PrefillContextClient(p1.target, retries=5, timeout=30)
        old = client.server_info().instance_id
        assert client.write_cache([0], np.ones((1, 512)), np.ones((1, 64))) == 1
        assert p1.terminate(20) == 0
        p2 = ServerProcess(FLAGS, port=p1.port, metrics_port=p1.metrics_port)  # same address
        p2.wait_ready()
        with PrefillContextClient(p2.target, retries=0) as fresh:
            new = fresh.server_info().instance_id
        assert new != old
        # the old client sends expected_instance_id=old: FAILED_PRECONDITION -> ServerRestartedError
        for call in (lambda: client.read_cache([0]), lambda: client.prefill_context(
                np.zeros((1, 2, 192), np.float32), [(1, 16, [0])]), lambda: client.write_cache(
                [1], np.ones((1, 512)), np.ones((1, 64)))):
            with pytest.raises(ServerRestartedError) as ei:
                call()
            assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert ei.value.expected_instance_id == old and "expected_instance_id" in ei.value.details
        # nothing was written by the refused write; after re-populating, the client goes on
        client.reset_instance()
        assert not client.read_cache([0, 1]).any()
        assert client.instance_id == new
        client.close()
    finally:
        p1.kill()
        if p2 is not None:
            p2.terminate(20)
            p2.kill()


def test_worker_bookkeeping_of_cancelled_calls():
    """The worker on its own: a cancelled call leaves the queue depth at once and is
    counted by reason; it never runs."""
    import asyncio

    from ctxprefill.service.engine_worker import EngineWorker
    from ctxprefill.service.metrics import Metrics

    async def main():
        m = Metrics()
        w = EngineWorker(m)
        gate, ran = threading.Event(), []
        first = w.submit(lambda: gate.wait(20))
        await asyncio.sleep(0.05)  # the first one runs (and blocks)
        second = w.submit(lambda: ran.append(2))
        third = w.submit(lambda: ran.append(3), deadline=time.monotonic() - 1)  # already expired
        fourth = w.submit(lambda: ran.append(4))
        assert w.waiting == 3
        second.cancel()
        third.cancel()
        await asyncio.sleep(0)
        assert w.waiting == 1  # at once, while the first still runs
        page = parse_metrics(m.render().decode())
        assert sample_sum(page["ctxprefill_queue_depth"]) == 1
        assert sample_sum(page["ctxprefill_rejected_requests_total"], reason="cancelled") == 1
        assert sample_sum(page["ctxprefill_rejected_requests_total"], reason="deadline") == 1
        gate.set()
        assert await first
        await fourth
        assert ran == [4] and w.waiting == 0
        w.stop()

    asyncio.run(main())


def test_worker_stop_waits_for_the_thread_within_its_bound():
    """``stop(wait_s)`` returns once the engine thread has ended (so the process can exit
    without a thread freeing tensors during interpreter shutdown), and gives up after
    ``wait_s`` while a call still runs; the queued call before the stop still runs."""
    import asyncio

    from ctxprefill.service.engine_worker import EngineWorker
    from ctxprefill.service.metrics import Metrics

    async def main():
        w = EngineWorker(Metrics())
        gate, ran = threading.Event(), []
        first = w.submit(lambda: gate.wait(20))
        second = w.submit(lambda: ran.append(np.ones(4)))
        t0 = time.monotonic()
        assert w.stop(0.2) is False and not w.ended
        assert 0.2 <= time.monotonic() - t0 < 5 and ran == []
        gate.set()
        assert w.stop(10) is True and w.ended
        assert await first and await second is None and len(ran) == 1

    asyncio.run(main())
