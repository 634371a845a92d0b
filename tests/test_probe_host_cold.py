"""bench/probe_host_cold.py on a CPU engine: it times the replay's host steps on a request
the engine accepts, hot and cold, and reports each step."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import probe_host_cold  # noqa: E402


def test_probe_reports_every_step_hot_and_cold(capsys):
    assert probe_host_cold.main(["--context", "4096", "--new", "64", "--rounds", "5", "--evict-mb", "1"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["context"], got["new"], got["evict_mb"]) == (4096, 64, 1)
    for case, names in (("hot_us", probe_host_cold.STEPS), ("cold_us", probe_host_cold.STEPS),
                        ("quick_hot_us", probe_host_cold.QUICK_STEPS), ("quick_cold_us", probe_host_cold.QUICK_STEPS)):
        steps = got[case]
        assert set(steps) == {*names, "total"}
        assert all(steps[s] > 0 for s in names)
        assert abs(steps["total"] - sum(steps[s] for s in names)) < 0.05
