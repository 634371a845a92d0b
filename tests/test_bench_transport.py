"""bench/bench_transport.py runs end to end on the CPU with tiny shapes: the in-process
engine, then a server subprocess driven inline , through system shared memory and through a
request ring (CUDA IPC skipped with its reason), every mode bit-identical, JSON written."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm: POSIX shared memory is Linux-only here")
def test_bench_transport_tiny(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_transport", os.path.join(ROOT, "bench", "bench_transport.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "t.json"
    rc = mod.main(["--device", "cpu", "--heads", "2", "--new", "8", "--context", "300", "--block-size", "16",
                   "--workspace-tokens", "128", "--iters", "2", "--warmup", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    d = json.loads(out.read_text())
    assert d["engine"]["chunks"] == 3 and d["engine"]["median_s"] > 0
    assert set(d["modes"]) == {"inline", "system", "system-ring"}
    assert d["skipped"] == {m: "not a CUDA device" for m in ("cuda", "cuda-stream", "cuda-ring")}
    assert d["bit_identical"] == {"inline": True, "system": True, "system-ring": True}
    assert d["inline_vs_engine_bit_identical"]
    inline, system, ring = d["modes"]["inline"], d["modes"]["system"], d["modes"]["system-ring"]
    for m in (inline, system, ring):
        assert m["total_s"] >= m["rpc_s"] > 0 and m["ratio_to_engine"] > 0 and m["server_s"] > 0
    req = d["meta"]["request"]
    q, o, ls = req["q_bytes"], req["output_bytes"], req["lse_bytes"]
    assert inline["payload_bytes"] > q + o + ls  # the tensors travel inline
    assert system["payload_bytes"] < 2000 and ring["payload_bytes"] < 2000  # only references travel
    assert "x engine" in printed and "skipped: not a CUDA device" in printed
