"""Overload, the CI version of ``scripts/loadtest.py`` (the full figure — 64 clients for
60 s per phase — is in docs/RELIABILITY.md): a real server with ``--queue-size 8``;
8 closed-loop clients (at capacity) for a few seconds, then 64 (far above it).

- at capacity no request fails;
- above it, the only failures are RESOURCE_EXHAUSTED, p99 of their latency < 50 ms;
- the server's resident memory does not grow after the warm-up (16 MiB / 5 % slack);
- the server drains and exits 0 afterwards.

A latency criterion on a shared 2-core machine can be hit by a neighbour's burst: when
that is the only criterion that failed, the run is repeated once (both reports are
printed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from service_process import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "loadtest.py")


def _run(tmp_path, attempt: int) -> dict:
    out = tmp_path / f"report{attempt}.json"
    r = subprocess.run([sys.executable, SCRIPT, "--duration", "4", "--queue-size", "8", "--clients", "64",
                        "--json", str(out), "--server-log", str(tmp_path / f"server{attempt}.log")],
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.exists(), f"no report (exit {r.returncode}):\n{r.stderr[-3000:]}"
    report = json.loads(out.read_text())
    report["_exit"] = r.returncode
    print(f"attempt {attempt}: {json.dumps(report['phases'])} rss={report.get('rss')} failures={report['failures']}")
    return report


def test_bounded_load_degrades_only_into_prompt_resource_exhausted(tmp_path):
    report = _run(tmp_path, 1)
    if report["failures"] and all(f.startswith("refusals not prompt") for f in report["failures"]):
        report = _run(tmp_path, 2)
    below, above = report["phases"]["below"], report["phases"]["above"]
    assert below["clients"] == 8 and above["clients"] == 64
    assert set(below["codes"]) == {"OK"} and below["codes"]["OK"] > 0, below
    assert set(above["codes"]) == {"OK", "RESOURCE_EXHAUSTED"}, above
    assert above["rejected_p99_ms"] < 50.0, above
    assert report["rss"]["growth_mib"] <= max(16.0, 0.05 * report["rss"]["after_warmup_mib"]), report["rss"]
    assert report["server_exit_code"] == 0
    assert report["failures"] == [] and report["_exit"] == 0, report["failures"]
