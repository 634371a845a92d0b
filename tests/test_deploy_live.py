"""The monitoring set-up of deploy/ against real processes: a Prometheus started from
deploy/prometheus/prometheus.yml (scrape interval 1 s, our alert rules loaded)
scraping three real ``ctxprefill serve`` processes on the CPU, one per dtype
configuration (one of them on the generic path and accepting shared memory, one with a
queue of 1), while they serve requests (one in three through shared memory where it is
accepted), bad requests and refused ones.

Then every PromQL expression of the Grafana dashboard (deploy/grafana/ctxprefill.json,
with ``$__rate_interval`` -> 30s and ``$instance`` -> ``.*``) and of the alert rules
goes through Prometheus's HTTP API: each must parse, the dashboard's must return
data, every rule must evaluate without error, and on this healthy CPU set-up the
alerts about outages, server errors, readiness, the cache, the queue and the
generic path must find nothing. deploy/healthcheck.py is run against a live server.

With ``CTXPREFILL_DASHBOARD_DATA=path.json`` the panels' time series are saved there;
``python scripts/render_dashboard.py path.json docs/dashboard.png`` draws them (the
test also renders them to a temporary file where matplotlib is installed).

Needs the ``prometheus`` binary (Debian package "prometheus"); skipped, with that
reason, without it. Every wait is bounded; every process is stopped in ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse

import numpy as np
import pytest

from context_layout import tables_and_slots
from ctxprefill_client import BF16, CtxPrefillRpcError, PrefillContextClient
from ctxprefill_client.shared_memory import SystemSharedMemoryRegion
from service_process import ROOT, ServerProcess, env_with_sources, free_port, http_get, stop_process

yaml = pytest.importorskip("yaml", reason="PyYAML not installed (pip install pyyaml)")

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not on PATH (Debian package 'prometheus': apt-get install -y prometheus)")

DEPLOY = os.path.join(ROOT, "deploy")
DASHBOARD = os.path.join(DEPLOY, "grafana", "ctxprefill.json")
RULES = os.path.join(DEPLOY, "prometheus", "rules", "ctxprefill.rules.yml")
PROM_CONFIG = os.path.join(DEPLOY, "prometheus", "prometheus.yml")
HEALTHCHECK = os.path.join(DEPLOY, "healthcheck.py")

RATE_WINDOW = "10s"  # Grafana's $__rate_interval; the test scrapes every second
TEMPLATE = {"$__rate_interval": RATE_WINDOW, "${__rate_interval}": RATE_WINDOW, "$instance": ".*",
            "${instance}": ".*"}
TRAFFIC_S = 15.0

BS = 16
COMMON = {"heads": 2, "block_size": BS, "num_blocks": 64, "workspace_tokens": 128, "seed": 3}
# (flags, extra environment); CTXPREFILL_GENERIC because --generic takes no value
SERVERS = {
    "bf16": ({**COMMON, "cache_dtype": "auto", "kv_b_proj_dtype": "bf16", "prefill_dtype": "bf16",
              "queue_size": 1}, {}),
    # shared memory accepted (the dashboard's transport panels need its series)
    "fp8-generic": ({**COMMON, "cache_dtype": "fp8", "kv_b_proj_dtype": "bf16", "prefill_dtype": "bf16",
                     "k_scale": 0.5, "shared_memory": "system", "request_ring": True}, {"CTXPREFILL_GENERIC": "1"}),
    "fp8_ds_mla-fp8": ({**COMMON, "cache_dtype": "fp8_ds_mla", "kv_b_proj_dtype": "fp8", "prefill_dtype": "fp8"},
                       {}),
}
# the seed's case (CONTRACT §10): continuation chunks and an empty sequence
CONTEXTS, QUERIES = [200, 48, 32, 0], [8, 4, 6, 5]
# alerts that must find nothing on a healthy CPU set-up
QUIET_ALERTS = ("CtxprefillDown", "CtxprefillTargetMissing", "CtxprefillNotReady", "CtxprefillErrorRatioHigh",
                "CtxprefillQueueSaturated", "CtxprefillCacheNearlyFull", "CtxprefillGenericPathOnGpu")


# ------------------------------------------------------------------------------ helpers


def dashboard_targets() -> list[dict]:
    """[{panel, title, type, unit, expr (templated), legend}] of every panel target."""
    dash = json.load(open(DASHBOARD))
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"]
            for k, v in TEMPLATE.items():
                expr = expr.replace(k, v)
            out.append({"panel": p["id"], "title": p["title"], "type": p["type"],
                        "unit": p.get("fieldConfig", {}).get("defaults", {}).get("unit", ""),
                        "expr": expr, "legend": t.get("legendFormat", "")})
    return out


def rule_exprs() -> list[tuple[str, str]]:
    doc = yaml.safe_load(open(RULES))
    return [(r.get("alert") or r.get("record"), r["expr"]) for g in doc["groups"] for r in g["rules"]]


def prom_api(url: str, path: str, **params) -> dict:
    status, body = http_get(f"{url}{path}?{urllib.parse.urlencode(params)}", timeout=10)
    try:
        data = json.loads(body)
    except ValueError:
        data = {"status": "error", "error": f"HTTP {status}: {body[:300]}"}
    return data


@contextlib.contextmanager
def environ(extra: dict[str, str]):
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Traffic:
    """Requests against one server for a while: good ones over several workspace sizes,
    bad ones (INVALID_ARGUMENT, OUT_OF_RANGE), and bursts of concurrent requests
    against a queue of 1 (RESOURCE_EXHAUSTED, reason queue_full)."""

    def __init__(self, name: str, proc: ServerProcess, burst: bool):
        self.name, self.proc, self.burst = name, proc, burst
        self.ok = 0
        self.codes: dict[str, int] = {}
        self.error: BaseException | None = None

    def _count(self, e: CtxPrefillRpcError) -> None:
        name = e.code.name if e.code is not None else "?"
        self.codes[name] = self.codes.get(name, 0) + 1

    def run(self, until: float) -> None:
        try:
            self._run(until)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def _run(self, until: float) -> None:
        rng = np.random.default_rng(7)
        with PrefillContextClient(self.proc.target, timeout=30, retries=0) as c:
            info = c.server_info()
            nb = info.num_blocks
            perm = rng.permutation(nb).tolist()
            tables, slots = tables_and_slots(CONTEXTS, BS, perm)
            c.write_cache(slots, rng.standard_normal((len(slots), info.kv_lora_rank), dtype=np.float32),
                          rng.standard_normal((len(slots), info.qk_rope_head_dim), dtype=np.float32))
            q = rng.standard_normal((sum(QUERIES), info.num_heads, info.qk_head_dim), dtype=np.float32)
            seqs = list(zip(QUERIES, CONTEXTS, tables))
            with contextlib.ExitStack() as stack:
                shm = None
                if "system" in info.shared_memory_kinds:  # one request in three through shared memory
                    shm = stack.enter_context(SystemSharedMemoryRegion(f"live-{self.name}", 1 << 20))
                    c.register_system_shared_memory(shm)
                stream = stack.enter_context(c.prefill_stream())  # one request in three on a stream
                ring = None
                if shm is not None and info.request_ring_max:  # the w=16 requests through a ring in the region
                    ring = stack.enter_context(c.attach_request_ring(shm, num_slots=2, slot_bytes=1 << 16,
                                                                     offset=7 << 17))
                self._loop(c, q, seqs, nb, shm, stream, until, ring)

    def _loop(self, c: PrefillContextClient, q, seqs, nb: int, shm, stream, until: float, ring=None) -> None:
        tq, h = q.shape[0], q.shape[1]
        bad_table = [(n, ctx, [nb] * len(t)) if ctx else (n, ctx, t) for n, ctx, t in seqs]
        i = 0
        while time.monotonic() < until:
            for w in (16, 64, 128):
                if shm is not None and w == 64:
                    c.prefill_context(shm.write(q, 0, BF16), seqs, workspace_tokens=w,
                                      output_region=shm.ref(1 << 19, tq * h * 128 * 2),
                                      lse_region=shm.ref(3 << 18, h * tq * 4))
                elif w == 128:
                    stream.prefill_context(q, seqs, workspace_tokens=w)
                elif ring is not None:
                    ring.prefill_context(q, seqs, workspace_tokens=w)
                else:
                    c.prefill_context(q, seqs, workspace_tokens=w)
                self.ok += 1
            if i % 3 == 0:
                for bad in (lambda: c.prefill_context(q[:1], seqs),  # rows != sum(query_len)
                            lambda: c.read_cache([nb * BS]),  # slot out of range
                            lambda: stream.prefill_context(q, bad_table)):  # in-band OUT_OF_RANGE
                    try:
                        bad()
                    except CtxPrefillRpcError as e:
                        self._count(e)
            if self.burst and i % 4 == 0:
                self._burst(c, q, seqs)
            i += 1
            time.sleep(0.15)

    def _burst(self, c: PrefillContextClient, q, seqs, n: int = 6) -> None:
        barrier = threading.Barrier(n)

        def one():
            barrier.wait(timeout=10)
            try:
                c.prefill_context(q, seqs, workspace_tokens=16)
            except CtxPrefillRpcError as e:
                self._count(e)

        threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)


def run_healthcheck(metrics_port: int, *args: str) -> subprocess.CompletedProcess:
    env = env_with_sources()
    env.pop("CTXPREFILL_HEALTH_URL", None)
    env["CTXPREFILL_METRICS_PORT"] = str(metrics_port)
    return subprocess.run([sys.executable, HEALTHCHECK, *args], env=env, capture_output=True, text=True,
                          timeout=30)


# ------------------------------------------------------------------------------ the test


def test_dashboard_and_alert_queries_against_a_live_prometheus(tmp_path):
    t_test = time.monotonic()
    servers: dict[str, ServerProcess] = {}
    prom = prom_log = None
    try:
        # -- three servers, one per dtype configuration
        for name, (flags, env) in SERVERS.items():
            with environ(env):
                servers[name] = ServerProcess(flags, grace_seconds=5)

        # -- Prometheus from the shipped config: our targets, 1 s, rules by absolute path
        cfg = yaml.safe_load(open(PROM_CONFIG))
        cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
        cfg["rule_files"] = [RULES]
        jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
        assert "ctxprefill" in jobs, "deploy/prometheus/prometheus.yml: no job 'ctxprefill'"
        jobs["ctxprefill"]["static_configs"] = [
            {"targets": [f"127.0.0.1:{s.metrics_port}" for s in servers.values()]}]
        prom_port = free_port()
        jobs.pop("prometheus", None)
        cfg["scrape_configs"] = list(jobs.values())
        cfg_path = tmp_path / "prometheus.yml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        prom_url = f"http://127.0.0.1:{prom_port}"
        prom_log = open(tmp_path / "prometheus.log", "w+")
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg_path}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=prom_log, stderr=subprocess.STDOUT, cwd=tmp_path)

        def prom_failed(what: str) -> None:
            prom_log.seek(0)
            pytest.fail(f"{what}\nprometheus log:\n{prom_log.read()[-4000:]}")

        for s in servers.values():
            s.wait_ready(timeout=60)

        # -- wait until Prometheus scrapes all three
        t_end = time.monotonic() + 30
        up = {}
        while time.monotonic() < t_end:
            if prom.poll() is not None:
                prom_failed(f"prometheus exited with {prom.returncode}")
            with contextlib.suppress(OSError):
                r = prom_api(prom_url, "/api/v1/query", query='up{job="ctxprefill"}')
                up = {x["metric"]["instance"]: x["value"][1] for x in r.get("data", {}).get("result", [])}
                if len(up) == 3 and set(up.values()) == {"1"}:
                    break
            time.sleep(0.5)
        else:
            prom_failed(f"Prometheus did not scrape the 3 servers within 30 s: up = {up}")

        # -- health check script against a live server (readiness and overall), and a dead port
        s0 = servers["bf16"]
        for args in ((), ("ready",), ("live",)):
            r = run_healthcheck(s0.metrics_port, *args)
            assert r.returncode == 0 and ": 200 " in r.stdout, (args, r.stdout, r.stderr)
        r = run_healthcheck(free_port())
        assert r.returncode == 1, (r.stdout, r.stderr)

        # -- traffic on all three at once
        t_traffic = time.time()
        until = time.monotonic() + TRAFFIC_S
        traffic = [Traffic(name, s, burst=(name == "bf16")) for name, s in servers.items()]
        threads = [threading.Thread(target=t.run, args=(until,), daemon=True) for t in traffic]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=TRAFFIC_S + 60)
        for t in traffic:
            assert t.error is None, f"{t.name}: {t.error!r}\n{t.proc.log()[-3000:]}"
            assert t.ok > 0 and t.codes.get("INVALID_ARGUMENT") and t.codes.get("OUT_OF_RANGE"), (t.name, t.codes)
        # bursts against a queue of 1: some refused (the refused-by-reason panel needs a series)
        burst = next(t for t in traffic if t.burst)
        assert burst.codes.get("RESOURCE_EXHAUSTED"), burst.codes
        time.sleep(3)  # the last scrapes and rule evaluations

        # -- every dashboard expression parses and returns data
        targets = dashboard_targets()
        assert targets
        empty, failed = [], []
        for t in targets:
            assert "$" not in t["expr"], f"untemplated variable in {t['title']!r}: {t['expr']}"
            r = prom_api(prom_url, "/api/v1/query", query=t["expr"])
            if r.get("status") != "success":
                failed.append((t["title"], t["expr"], r.get("error")))
            elif not r["data"]["result"]:
                empty.append((t["title"], t["expr"]))
        assert not failed, f"dashboard expressions Prometheus refused: {failed}"
        assert not empty, f"dashboard expressions without data: {empty}"

        # -- every rule expression parses; the rules evaluate without error
        rules = rule_exprs()
        assert rules
        for name, expr in rules:
            r = prom_api(prom_url, "/api/v1/query", query=expr)
            assert r.get("status") == "success", f"{name}: {r.get('error')}\n{expr}"
            if name in QUIET_ALERTS:
                assert r["data"]["result"] == [], f"{name} finds something on a healthy set-up: {r['data']}"
        t_end = time.monotonic() + 15
        while True:
            groups = prom_api(prom_url, "/api/v1/rules")["data"]["groups"]
            loaded = {r["name"]: r for g in groups for r in g["rules"]}
            assert set(loaded) == {n for n, _ in rules}, f"rules loaded: {sorted(loaded)}"
            if all(r["health"] == "ok" for r in loaded.values()) or time.monotonic() > t_end:
                break
            time.sleep(0.5)
        bad = {n: (r["health"], r.get("lastError")) for n, r in loaded.items() if r["health"] != "ok"}
        assert not bad, f"rules that did not evaluate cleanly: {bad}"

        # -- the panels' series over the traffic window (for scripts/render_dashboard.py)
        t_now = time.time()
        panels: dict[int, dict] = {}
        for t in targets:
            p = panels.setdefault(t["panel"], {"id": t["panel"], "title": t["title"], "type": t["type"],
                                               "unit": t["unit"], "targets": []})
            if t["type"] == "table":
                r = prom_api(prom_url, "/api/v1/query", query=t["expr"])
                series = [{"labels": x["metric"], "values": [x["value"]]} for x in r["data"]["result"]]
            else:
                r = prom_api(prom_url, "/api/v1/query_range", query=t["expr"], start=f"{t_traffic - 3:.3f}",
                             end=f"{t_now:.3f}", step="1")
                assert r.get("status") == "success", (t["title"], r.get("error"))
                series = [{"labels": x["metric"], "values": x["values"]} for x in r["data"]["result"]]
            p["targets"].append({"expr": t["expr"], "legend": t["legend"], "series": series})
        data = {
            "dashboard": json.load(open(DASHBOARD))["title"],
            "source": "tests/test_deploy_live.py: 3 CPU servers (" + ", ".join(SERVERS) + f"), rate window "
                      f"{RATE_WINDOW}, scrape 1 s, {TRAFFIC_S:.0f} s of traffic",
            "start": t_traffic - 3, "end": t_now,
            "panels": list(panels.values()),
        }
        out = os.environ.get("CTXPREFILL_DASHBOARD_DATA")
        if out:
            with open(out, "w") as f:
                json.dump(data, f, indent=1)
        data_path = tmp_path / "dashboard-data.json"
        data_path.write_text(json.dumps(data))
    finally:
        if prom is not None:
            stop_process(prom)
        if prom_log is not None:
            prom_log.close()
        for s in servers.values():
            s.terminate(10)
            s.kill()

    # -- the renderer draws what was captured (where matplotlib is installed)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        png = tmp_path / "dashboard.png"
        r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "render_dashboard.py"), str(data_path),
                            str(png)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"\nthe live deploy test took {time.monotonic() - t_test:.0f} s")  # a figure, not a bound

