"""The scraped /metrics page against the Prometheus tools (CONTRACT §9).

- ``promtool check metrics`` must pass on the page of a server that has served
  requests (all metric families present, gRPC codes other than OK included).
- A real Prometheus server scraping that page every second must see
  ``sum(ctxprefill_kernel_launches_total)`` equal to the launches reported in the
  requests' Stats (plus one insert launch per WriteCache that wrote something).

Both binaries come with the Debian package ``prometheus``
(``apt-get install -y prometheus``); each test is skipped, with that reason, where
its binary is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from context_layout import tables_and_slots
from ctxprefill_client import CtxPrefillRpcError, PrefillContextClient, float32_to_bf16_bits
from service_process import ServerProcess, free_port, http_get, parse_metrics, sample_sum, stop_process

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
BS, NB, H = 16, 64, 2


@pytest.fixture(scope="module")
def server_with_traffic():
    proc = ServerProcess({"heads": H, "block_size": BS, "num_blocks": NB, "workspace_tokens": 64})
    try:
        proc.wait_ready()
        rng = np.random.default_rng(0)
        launches_from_stats = 0
        inserts = 0
        with PrefillContextClient(proc.target, retries=0, timeout=60) as c:
            info = c.server_info()
            contexts, queries = [100, 0, 37], [3, 2, 4]
            tables, slots = tables_and_slots(contexts, BS)
            c.write_cache(slots, rng.standard_normal((len(slots), 512), dtype=np.float32),
                          rng.standard_normal((len(slots), 64), dtype=np.float32))
            inserts += 1
            q = float32_to_bf16_bits(rng.standard_normal((sum(queries), H, info.qk_head_dim), dtype=np.float32))
            seqs = list(zip(queries, contexts, tables))
            for W in (16, 64):
                res = c.prefill_context(q, seqs, workspace_tokens=W)
                launches_from_stats += sum(res.stats["kernel_launches"].values())
            with pytest.raises(CtxPrefillRpcError):
                c.prefill_context(q[:1], seqs)  # INVALID_ARGUMENT: rows != sum(query_len)
            with pytest.raises(CtxPrefillRpcError):
                c.read_cache([NB * BS])  # OUT_OF_RANGE
        with grpc.insecure_channel(proc.target) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        yield proc, launches_from_stats, inserts
    finally:
        proc.terminate(15)
        proc.kill()


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not on PATH (Debian package 'prometheus': "
                                             "apt-get install -y prometheus)")
def test_metrics_page_passes_promtool(server_with_traffic):
    proc, _, _ = server_with_traffic
    status, page = http_get(proc.metrics_url + "/metrics")
    assert status == 200
    for family in ("ctxprefill_kernel_launches_total", "ctxprefill_fp8_path_total", "ctxprefill_chunks_total",
                   "ctxprefill_context_tokens_total", "ctxprefill_query_tokens_total",
                   "ctxprefill_request_duration_seconds_bucket", "ctxprefill_stage_duration_seconds_bucket",
                   "ctxprefill_queue_depth", "ctxprefill_cache_slots_used", "ctxprefill_cache_slots_total",
                   "ctxprefill_cache_capacity_slots", "ctxprefill_build_info", "grpc_server_started_total",
                   "grpc_server_handled_total", "grpc_server_msg_received_total", "grpc_server_msg_sent_total",
                   "grpc_server_handling_seconds_bucket", "ctxprefill_cache_usage_ratio", "process_cpu_seconds_total",
                   "process_resident_memory_bytes", "process_open_fds", "process_start_time_seconds"):
        assert f"\n{family}" in page, family
    assert 'grpc_code="INVALID_ARGUMENT"' in page and 'grpc_code="OUT_OF_RANGE"' in page
    samples = parse_metrics(page)
    capacity = sample_sum(samples["ctxprefill_cache_capacity_slots"])
    assert capacity == sample_sum(samples["ctxprefill_cache_slots_total"]) == NB * BS
    assert 0 < sample_sum(samples["ctxprefill_cache_slots_used"]) <= capacity
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"promtool check metrics failed:\n{r.stdout}\n{r.stderr}"


def test_zero_series_carry_each_methods_grpc_type_and_the_cache_gauges_follow_writes():
    from ctxprefill.service.metrics import Metrics
    from ctxprefill_api import pb

    m = Metrics()
    before = parse_metrics(m.render().decode())
    assert sample_sum(before["ctxprefill_cache_capacity_slots"]) == 0  # no cache yet
    m.init_grpc_methods(pb.DESCRIPTOR.services_by_name["PrefillContextService"])
    m.init_engine(version="v", backend="reference", device="cpu", num_slots=1000, path="generic",
                  fp8_path={"cache_dtype": "bf16", "kv_b_proj_dtype": "bf16", "prefill_dtype": "bf16"})
    m.observe_insert(1, "generic", 250)
    page = parse_metrics(m.render().decode())
    types = {}
    for labels, _ in page["grpc_server_started_total"]:
        types.setdefault(labels["grpc_method"], set()).add(labels["grpc_type"])
    assert types["PrefillContextStream"] == {"bidi_stream"}
    assert types["AttachRequestRing"] == {"server_stream"}
    assert types["PrefillContext"] == types["WriteCache"] == {"unary"}
    assert all(len(t) == 1 for t in types.values()), types
    assert sample_sum(page["ctxprefill_cache_slots_total"]) == 1000
    # the capacity as a gauge (vLLM's way), beside the contract's counter of the same number
    assert sample_sum(page["ctxprefill_cache_capacity_slots"]) == 1000
    kinds = {f.name: f.type for f in m.registry.collect()}
    assert kinds["ctxprefill_cache_capacity_slots"] == kinds["ctxprefill_cache_slots_used"] == "gauge"
    assert kinds["ctxprefill_cache_usage_ratio"] == "gauge" and kinds["ctxprefill_cache_slots"] == "counter"
    assert sample_sum(page["ctxprefill_cache_slots_used"]) == 250
    assert sample_sum(page["ctxprefill_cache_usage_ratio"]) == 0.25
    assert sample_sum(page["process_resident_memory_bytes"]) > 0


def _query(prom_url: str, expr: str) -> float | None:
    status, body = http_get(f"{prom_url}/api/v1/query?query={urllib.parse.quote(expr)}", timeout=5)
    if status != 200:
        return None
    data = json.loads(body)
    result = data.get("data", {}).get("result", [])
    if data.get("status") != "success" or not result:
        return None
    return float(result[0]["value"][1])


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not on PATH (Debian package 'prometheus': "
                                                "apt-get install -y prometheus)")
def test_prometheus_scrapes_the_launch_counts(server_with_traffic):
    proc, from_stats, inserts = server_with_traffic
    page = proc.scrape()
    kl = page["ctxprefill_kernel_launches_total"]
    assert sample_sum(kl, stage="insert") == inserts  # one insert launch per WriteCache that wrote
    assert sample_sum(kl) - inserts == from_stats > 0
    expected = from_stats + inserts

    port = free_port()
    prom_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "prometheus.yml")
        with open(cfg, "w") as f:
            f.write(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                "scrape_configs:\n  - job_name: ctxprefill\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
                f"    static_configs:\n      - targets: ['127.0.0.1:{proc.metrics_port}']\n"
            )
        log = open(os.path.join(tmp, "prometheus.log"), "w+")
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={os.path.join(tmp, 'data')}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
        )
        try:
            value = up = None
            t_end = time.monotonic() + 60
            while time.monotonic() < t_end:
                if prom.poll() is not None:
                    log.seek(0)
                    pytest.fail(f"prometheus exited with {prom.returncode}:\n{log.read()[-4000:]}")
                try:
                    up = _query(prom_url, 'up{job="ctxprefill"}')
                    value = _query(prom_url, "sum(ctxprefill_kernel_launches_total)")
                except OSError:
                    value = None
                if up == 1.0 and value is not None:
                    break
                time.sleep(0.5)
            log.seek(0)
            assert up == 1.0, f"prometheus did not scrape the server within 60 s:\n{log.read()[-4000:]}"
            assert value == expected
            assert _query(prom_url, 'sum(ctxprefill_kernel_launches_total{stage!="insert"})') == from_stats
        finally:
            stop_process(prom)
            log.close()
