"""``ctxprefill bench`` runs end to end on the CPU and records both paths (tiny grid)."""

import json

from ctxprefill.cli import main


def test_bench_tiny_grid(tmp_path):
    out = tmp_path / "b.json"
    rc = main(["bench", "--device", "cpu", "--heads", "2", "--new", "4", "--context", "300", "--cache-dtype", "fp8",
               "--prefill-dtype", "bf16", "fp8", "--workspace-tokens", "128", "--iters", "1", "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["bit_identical"] and r["chunks"] == 3 for r in rows)
    fp8 = [r for r in rows if r["prefill_dtype"] == "fp8"][0]
    assert fp8["fused_launches"]["pack"] == 3 and fp8["generic_launches"]["pack"] == 15
