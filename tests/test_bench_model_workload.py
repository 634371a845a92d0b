"""bench/bench_model_workload.py end to end on the CPU with tiny shapes: a server per head count
(system shared memory, a request ring), the cache filled by WriteCache, every layer's call of
every chunk through the ring with its cache_write (or a WriteCache after it), the last chunk's
answers against float64 attention over the latents written, the floors summed by
engine_bench's model, JSON written."""

import importlib.util
import json
import os
import re

import pytest

from ctxprefill.config import CacheConfig, EngineConfig, ModelShape
from ctxprefill_bench.engine_bench import floor_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# finite ceilings (a CPU's are NaN), so that the floors and ratios are computed
CEIL = {"copy_bytes_per_s": 1e12, "matmul_flops_per_s": 1e14, "matmul_sustained_flops_per_s": 5e13}
TINY = ["--device", "cpu", "--layers", "2", "--new", "32", "--chunk", "16", "--max-context", "96",
        "--block-size", "16", "--check-heads", "2"]

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm: POSIX shared memory")


def _run(tmp_path, monkeypatch, *args, patch=None):
    spec = importlib.util.spec_from_file_location("bench_model_workload",
                                                  os.path.join(ROOT, "bench", "bench_model_workload.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod.engine_bench, "measure_ceilings", lambda dev, sustained_s=0.0: dict(CEIL))
    if patch is not None:
        patch(mod)
    out = tmp_path / "w.json"
    rc = mod.main([*TINY, *args, "--out", str(out)])
    return rc, json.loads(out.read_text())


def _floor(heads, context, new, rate, packs, cache="auto", prefill="bf16"):
    cfg = EngineConfig(shape=ModelShape(heads=heads), cache=CacheConfig(cache, 16, 7), prefill_dtype=prefill)
    return floor_seconds(cfg, [context], [new], CEIL, rate=rate, pack=packs)["total_s"]


def test_workload_through_the_ring_matches_float64(tmp_path, monkeypatch):
    rc, d = _run(tmp_path, monkeypatch, "--heads", "2", "4", "--check-layers", "0", "1")
    assert rc == 0
    meta = d["meta"]
    assert meta["kind"] == "model_workload" and meta["shared_memory"] == "system" and meta["gpu"] is None
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}T.*", meta["date"]) and meta["commit"]
    assert meta["ceilings"] == CEIL and meta["args"]["layers"] == 2
    assert [r["heads"] for r in d["runs"]] == [2, 4]
    for r in d["runs"]:
        H = r["heads"]
        assert (r["layers"], r["chunks"], r["calls"], r["context_start"]) == (2, 2, 4, 64)
        rows = r["rows"]
        assert [x["context_tokens"] for x in rows] == [64, 80] and [x["new_tokens"] for x in rows] == [16, 16]
        assert all(x["wall_ms"] >= x["calls_ms"] > 0 and x["server_compute_ms"] > 0 for x in rows)
        assert all(x["write_ms"] == 0 for x in rows) and r["cache_write_s"] == 0  # written with the calls
        assert r["wall_s"] == pytest.approx(sum(x["wall_ms"] for x in rows) / 1e3)
        assert r["fill"]["tokens"] == 2 * 64 and r["fill"]["seconds"] > 0
        # every call's floor, by engine_bench's model, summed over the layers and chunks
        packs = r["packs_k"]
        assert r["floor_s"] == pytest.approx(sum(2 * _floor(H, c, 16, "matmul_flops_per_s", packs) for c in (64, 80)))
        assert r["floor_held_s"] == pytest.approx(
            sum(2 * _floor(H, c, 16, "matmul_sustained_flops_per_s", packs) for c in (64, 80)))
        assert r["ratio"] == pytest.approx(r["wall_s"] / r["floor_s"])
        assert r["context_tokens"] == 2 * (64 + 80)
        assert r["context_tokens_per_s"] == pytest.approx(r["context_tokens"] / r["wall_s"])
        assert r["floor_context_tokens_per_s"] == pytest.approx(r["context_tokens"] / r["floor_s"])
        # the last chunk's answers came from the context the fill and the first chunk's cache_write
        # wrote: within bf16 rounding of float64, and far from it without the chunk's latents
        assert [c["layer"] for c in r["checks"]] == [0, 1] and r["check_ok"]
        for c in r["checks"]:
            assert (c["heads"], c["rows"], c["context_tokens"]) == (2, 16, 80)
            assert c["ok"] and c["output_error"] <= 1e-2 and c["lse_error"] <= 1e-2
            assert c["control_output_error"] > 0.1
        assert "--layers 2" in r["server"]["cmd"] and "--request-ring" in r["server"]["cmd"]
        assert r["server"]["graph_replays"] == {"in_place": 0.0, "copying": 0.0}  # scraped: none on a CPU


def test_a_failed_configuration_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    """A configuration whose server or calls fail (a server out of memory, say) is recorded
    in the JSON's meta with its error, the configurations after it still run, and the exit
    code says that one failed."""
    def fail_first(mod):
        orig = mod.run_heads

        def run_heads(ns, H, *a):
            if H == 4:
                raise RuntimeError("AttachRequestRing failed: RESOURCE_EXHAUSTED: out of memory for this request")
            return orig(ns, H, *a)

        monkeypatch.setattr(mod, "run_heads", run_heads)

    rc, d = _run(tmp_path, monkeypatch, "--heads", "4", "2", patch=fail_first)
    assert rc == 1 and [r["heads"] for r in d["runs"]] == [2] and d["runs"][0]["check_ok"]
    assert d["meta"]["failed"] == [{"heads": 4, "prefill_dtype": "bf16", "error": "RuntimeError: AttachRequestRing "
                                    "failed: RESOURCE_EXHAUSTED: out of memory for this request"}]


def test_separate_cache_writes_are_timed_apart(tmp_path, monkeypatch):
    rc, d = _run(tmp_path, monkeypatch, "--heads", "2", "--cache-write", "separate")
    assert rc == 0
    (r,) = d["runs"]
    assert all(x["wall_ms"] >= x["calls_ms"] + x["write_ms"] - 1e-6 and x["write_ms"] > 0 for x in r["rows"])
    assert r["cache_write_s"] == pytest.approx(sum(x["write_ms"] for x in r["rows"]) / 1e3)
    assert [c["layer"] for c in r["checks"]] == [1] and r["check_ok"]  # default: the last layer
    assert r["checks"][0]["control_output_error"] > 0.1


def test_two_orders_on_one_server_share_one_fill_and_each_is_checked(tmp_path, monkeypatch):
    # "host host": the CPU has no stream order, but the second run on the same server is the
    # path a stream-ordered run takes after a host-ordered one (the cache filled once)
    rc, d = _run(tmp_path, monkeypatch, "--heads", "2", "--orders", "host", "host")
    assert rc == 0
    first, second = d["runs"]
    assert first["order"] == second["order"] == "host"
    assert first["fill"] == second["fill"]  # one fill, reported by both
    assert first["server"]["cmd"] == second["server"]["cmd"]
    for r in (first, second):
        assert r["check_ok"] and r["checks"][0]["control_output_error"] > 0.1
        assert r["clocks"] is None  # no NVML on the CPU
        assert all(x["result_period_ms"] is None for x in r["rows"])  # host order has no stream period


def test_fp8_prefill_sends_fp8_q_and_checks_within_the_fp8_bound(tmp_path, monkeypatch):
    # one server per prefill dtype, both over an fp8 cache: fp8's q travels as e4m3, its k and v
    # are quantized by the server, its answer is checked within the engine's fp8 bound and its
    # floor is the model's for fp8 prefill (the quantize pass's bytes)
    rc, d = _run(tmp_path, monkeypatch, "--heads", "2", "--prefill-dtype", "bf16", "fp8", "--cache-dtype", "fp8")
    assert rc == 0
    assert [(r["heads"], r["server"]["prefill_dtype"], r["server"]["cache_dtype"]) for r in d["runs"]] == [
        (2, "bf16", "fp8"), (2, "fp8", "fp8")]
    bf16, fp8 = d["runs"]
    assert "--prefill-dtype fp8" in fp8["server"]["cmd"] and "--cache-dtype fp8" in fp8["server"]["cmd"]
    assert fp8["server"]["prefill_dtype"] == "fp8" and bf16["server"]["prefill_dtype"] == "bf16"
    assert bf16["checks"][0]["tolerance"] == 1e-2 and fp8["checks"][0]["tolerance"] == 6e-2
    for r in (bf16, fp8):
        c = r["checks"][0]
        assert r["check_ok"] and c["output_error"] <= c["tolerance"] and c["control_output_error"] > 0.1
        want = sum(2 * _floor(2, c, 16, "matmul_flops_per_s", r["packs_k"], "fp8", r["server"]["prefill_dtype"])
                   for c in (64, 80))
        assert r["floor_s"] == pytest.approx(want)
    assert fp8["floor_s"] > bf16["floor_s"]  # fp8 prefill also reads v and writes it quantized
    assert fp8["packs_k"] and "pack" in fp8["stage_s"]  # fp8 prefill always packs: it quantizes k
