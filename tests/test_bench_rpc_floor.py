"""bench/bench_rpc_floor.py on the CPU: every round trip and the two Python timings are
measured and written (the figures themselves are the host's)."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rpc_floor_measures_every_kind(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_rpc_floor", os.path.join(ROOT, "bench", "bench_rpc_floor.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "floor.json"
    assert mod.main(["--n", "40", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    keys = ("sync_unary_us", "sync_stream_us", "aio_unary_us", "aio_stream_us", "python_work_hot_us",
            "python_work_after_5ms_idle_us")
    assert all(0 < d[k] < 1e6 for k in keys), d
    assert d["cpu_latency"] == "not requested" and d["cpus"] == os.cpu_count()
    printed = capsys.readouterr().out
    assert all(k in printed for k in keys)
