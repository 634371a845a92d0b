"""bench/results/README.md and the top-level README's results block, made from the JSON in bench/results/.

bench/results/ holds one run per benchmark: ``<file>.json`` is what ``scripts/gpu_run.sh``
writes to ``$OUT/<file>.json`` for the step named in ``BENCHMARKS``. Each table names the
run's GPU, date and commit (read from the JSON: ``meta`` or its top level).

    python bench/make_tables.py                      # write bench/results/README.md
    python bench/make_tables.py --readme README.md   # rewrite the block between the results markers
    python bench/make_tables.py --check [--readme README.md]   # exit 1 where a file differs from the JSON
    python bench/make_tables.py bench/results/bench_engine.json   # print one file's table
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ctxprefill_bench import growth  # noqa: E402
from plot_engine import ctx_label, kind, run_line, tokens_label  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
Doc = dict[str, Any]


def _num(x: Any, fmt: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return format(x, fmt)


def _ms(s: float | None, fmt: str = ".2f") -> str:
    return _num(None if s is None else s * 1e3, fmt)


def _us(s: float | None, fmt: str = ".0f") -> str:
    return _num(None if s is None else s * 1e6, fmt)


def run_of(d: Doc) -> dict[str, str]:
    """date (YYYY-MM-DD), gpu, torch, commit of a result file, wherever its script put them."""
    meta = d.get("meta") if isinstance(d.get("meta"), dict) else {}

    def get(k: str) -> Any:
        return meta.get(k) if meta.get(k) is not None else d.get(k)

    gpu = get("gpu")
    if not gpu and get("gpus"):
        names = [g["name"] for g in get("gpus")]
        gpu = f"{len(names)}× {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    dev = get("device")
    if not gpu and isinstance(dev, str) and not dev.startswith(("cuda", "cpu")):
        gpu = dev
    return {"date": str(get("date") or "?")[:10], "gpu": str(gpu or "cpu"), "torch": str(get("torch") or "?"),
            "commit": short_sha(str(get("commit") or "?"))}


def short_sha(commit: str) -> str:
    """A full hex commit as its 7-character abbreviation ('+dirty' and other labels kept)."""
    sha, sep, rest = commit.partition("+")
    return (sha[:7] if len(sha) == 40 and all(c in "0123456789abcdef" for c in sha) else sha) + sep + rest


def _run_line(d: Doc) -> str:
    """'_2026-12-02 · NVIDIA H200 · torch 2.11.0+cu130 · commit 3412ee5_' (no torch where the file names none)."""
    r = run_of(d)
    return f"_{r['date']} · {r['gpu']} · " + (f"torch {r['torch']} · " if r["torch"] != "?" else "") + \
        f"commit {r['commit']}_"


# ------------------------------------------------------------------------------- engine


def _per_chunk(r: dict, path: str) -> float | None:
    v = r.get(f"{path}_launches_per_chunk")
    if v is None and r.get(f"{path}_launches") is not None and r.get("chunks"):
        v = sum(r[f"{path}_launches"].values()) / r["chunks"]
    return v


def _ratio(r: dict, num: str, den: str) -> float | None:
    """``r[num] / r[den]`` where the row has both (and den is not 0), else None: a --gemm-ab
    row's replay over the other GEMM's, a --merges-ab row's replay beside over in line."""
    if not r.get(den) or num not in r:
        return None
    return r[num] / r[den]


#: the CUDA graph A/Bs of ``ctxprefill bench`` (--merges-ab, --graph-variants-ab): the replay's
#: field with the switch off and on, and the three columns' heads
GRAPH_AB_COLUMNS = (
    ("merges_in_line_replay_s", "merges_beside_replay_s",
     "replay, merges in line ms | replay, merges beside ms | beside / in line"),
    ("graph_variants_off_replay_s", "graph_variants_on_replay_s",
     "replay, attention's eager variant ms | replay, its captured variant ms | captured / eager"),
)
#: --eager-variants-ab: the eager request with attention's q and K descriptors made by every
#: program and by the launch (``triton_attention.EAGER_WS``): the request, as ``GRAPH_AB_COLUMNS``
EAGER_AB_COLUMNS = (
    ("eager_variants_off_s", "eager_variants_on_s",
     "eager, descriptors per program ms | eager, descriptors by the launch ms | launch / per program"),
)


def engine_table(d: dict, bold_speedup: float = 1.4) -> str:
    """A ``ctxprefill bench`` JSON: one row per configuration; failed or skipped rows listed below."""
    meta = d.get("meta", {})
    lines = [f"_{run_line(meta)}_", ""]
    ceil = meta.get("ceilings") or {}
    if ceil.get("matmul_flops_per_s") and ceil.get("copy_bytes_per_s"):
        lines += [f"Floor: kv_b_proj + attention FLOPs at {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s (bf16 "
                  f"GEMM) + gather/pack bytes at {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s (copy), both measured "
                  f"in the run (the pack's bytes only where the fused path packs).", ""]
    # runs with unpacked keys: the fused request with its K pack, timed beside it
    packed = any("fused_packed_s" in r for r in d.get("rows", []))
    # runs with the fused request's chunk loop also replayed as a CUDA graph
    graph = any("fused_graph_s" in r for r in d.get("rows", []))
    # runs with --gemm-ab: the fused request with the other GEMM kernel, timed right after
    ab = next((r["gemm_ab"] for r in d.get("rows", []) if "gemm_ab" in r), None)
    # runs with --merges-ab / --graph-variants-ab / --eager-variants-ab: a switch off and on, interleaved rounds
    gabs = [g for g in (*GRAPH_AB_COLUMNS, *EAGER_AB_COLUMNS) if any(g[1] in r for r in d.get("rows", []))]
    lines += ["| H | new | ctx | cache | prefill | chunks | generic ms | " + ("fused + K pack ms | " if packed else "")
              + "fused ms | speed-up | floor ms | fused / floor | fused gap ms | "
              + ("fused, CUDA graph ms | graph / floor | graph: host outside the replay ms | " if graph else "")
              + (f"GEMM {ab}: fused ms | GEMM {ab}: graph ms | replay / {ab}'s | " if ab else "")
              + "".join(f"{head} | " for _, _, head in gabs)
              + "launches/chunk generic→fused | bit-identical |",
              "|---|---|---|---|---|---|---|" + ("---|" if packed else "") + "---|---|---|---|---|"
              + ("---|---|---|" if graph else "") + ("---|---|---|" if ab else "") + "---|---|---|" * len(gabs)
              + "---|---|"]
    notes = []
    for r in d.get("rows", []):
        if "speedup" not in r:
            what = f"skipped ({r['skipped']})" if "skipped" in r else f"failed: {r.get('error', '?')}"
            notes.append(f"- H={r['heads']}, {r['new']} new over {ctx_label(r['context'])}, "
                         f"{r['cache_dtype']}/{r['prefill_dtype']}: {what}")
            continue
        floor = r.get("floor_s")
        ratio = r.get("fused_over_floor")
        if ratio is None and floor:
            ratio = r["fused_s"] / floor
        sp = f"{r['speedup']:.2f}"
        if r["speedup"] >= bold_speedup:
            sp = f"**{sp}**"
        lg, lf = _per_chunk(r, "generic"), _per_chunk(r, "fused")
        gap = r.get("fused_host_gap_s")
        if gap is None and r.get("fused_stage_s") is not None:  # files without the field
            gap = r["fused_s"] - sum(r["fused_stage_s"].values())
        lines.append(
            f"| {r['heads']} | {r['new']} | {ctx_label(r['context'])} | {r['cache_dtype']} | {r['prefill_dtype']} "
            f"| {r['chunks']} | {r['generic_s'] * 1e3:.2f} | "
            + (f"{_ms(r.get('fused_packed_s'))} | " if packed else "")
            + f"{r['fused_s'] * 1e3:.2f} | {sp} "
            f"| {_ms(floor or None)} | {_num(ratio, '.2f')} "
            f"| {_ms(gap)} | "
            + (f"{_ms(r.get('fused_graph_s'))} "
               f"| {_num(r.get('fused_graph_over_floor'), '.2f')} "
               f"| {_ms(r.get('fused_graph_outside_s'))} | "
               if graph else "")
            + (f"{_ms(r.get('fused_ab_s'))} "
               f"| {_ms(r.get('fused_graph_ab_s'))} "
               f"| {_num(_ratio(r, 'fused_graph_replay_s', 'fused_graph_ab_replay_s'), '.3f')} | " if ab else "")
            + "".join(f"{_ms(r.get(off), '.3f')} | {_ms(r.get(on), '.3f')} | {_num(_ratio(r, on, off), '.3f')} | "
                      for off, on, _ in gabs)
            + f"{_num(lg, '.0f')} → {_num(lf, '.0f')} "
            f"| {'yes' if r.get('bit_identical') else '**NO**'} |")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------- concurrency


def concurrency_table(d: dict) -> str:
    """A ``bench/bench_concurrency.py`` JSON: one row per shape, transport and client count."""
    meta = d.get("meta", {})
    qs = meta.get("queue_size")
    lines = [f"_{run_line(meta)}_; clients: {meta.get('client_mode', 'threads')}"
             + (f"; server --queue-size {qs}" if qs else ""), "",
             "| shape | transport | clients | requests | req/s | context Mtok/s | query ktok/s | p50 ms | p90 ms "
             "| p99 ms | server p50 ms | compute p50 ms | device busy | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d.get("rows", []):
        tr = r.get("transport", "inline")
        if r.get("stream_depth"):
            tr += f" (stream, {r['stream_depth']} in flight)"
        elif r.get("ring_depth"):
            tr += f" (ring, {r['ring_depth']} in flight)"
        if "requests_per_s" not in r:
            lines.append(f"| {r['shape_label']} | {tr} | {r['clients']} | skipped ({r.get('skipped', '?')}) "
                         "| | | | | | | | | | |")
            continue
        lat, srv, cmp_ = r["latency_ms"], r["server_total_ms"], r["server_compute_ms"]
        errs = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "0"
        if r.get("setup_errors"):
            errs += f"; set-up failed in {r['setup_errors']} clients"
        if r.get("check_matches_inline") is False:
            errs += "; check request **differs from inline**"
        lines.append(
            f"| {r['shape_label']} | {tr} | {r['clients']} | {r['requests']} | {r['requests_per_s']:.2f} "
            f"| {r['context_tokens_per_s'] / 1e6:.2f} | {r['query_tokens_per_s'] / 1e3:.1f} "
            f"| {_num(lat['p50'], '.1f')} | {_num(lat['p90'], '.1f')} | {_num(lat['p99'], '.1f')} "
            f"| {_num(srv['p50'], '.1f')} | {_num(cmp_['p50'], '.1f')} | {_num(r.get('device_busy_fraction'), '.2f')} "
            f"| {errs} |")
    for e in d.get("errors", []):
        lines.append(f"\n- server group {e.get('group')}: {e.get('error')}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ kernels


def kernels_table(d: Doc) -> str:
    """``bench/bench_kernels.py``: pack, gather and merge against the copy bandwidth."""
    mix = ", ".join(f"{w}: {t:.2f}" for w, t in d.get("mix_copies_tbps", {}).items())
    lines = [_run_line(d), "",
             f"Copy {d['copy_tbps']:.2f} TB/s (read + written), read only {d['read_only_tbps']:.2f}, write only "
             f"{d['write_only_tbps']:.2f}; plain copies by bytes written per byte read: {mix} TB/s. "
             f"Time: {d['method']}. Every kernel row bit-equal to its reference: "
             f"{'yes' if d.get('all_bit_equal') else '**NO**'}; every target met: "
             f"{'yes' if d.get('targets_met') else '**NO**'}.", "",
             "| op | variant | shape | ms | TB/s | % of copy | % of same-size copy | % of mix copy | target % "
             "| × generic/torch |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        shape = f"{r['rows']:,} rows" if "rows" in r else f"H={r['H']} T={r['T']:,}"
        target = ""
        if "target_pct" in r:
            target = f"{r['target_pct']:.0f}" + ("" if r.get("meets_target") else " **missed**")
        x = r.get("speedup_vs_generic", r.get("speedup_vs_torch"))
        eq = " **not bit-equal**" if r.get("bit_equal_to_reference") is False else ""
        lines.append(f"| {r['op']} | {r['variant']}{eq} | {shape} | {r['ms']:.4f} | {r['tbps']:.2f} "
                     f"| {r['pct_copy']:.1f} | {r['pct_same_size_copy']:.1f} | {r['pct_mix_roofline']:.1f} "
                     f"| {target} | {_num(x, '.2f') if x is not None else ''} |")
    return "\n".join(lines) + "\n"


def write_table(d: Doc) -> str:
    """``bench/probe_write_bandwidth.py``: every way to stream writes, and the bf16 pack's."""
    lines = [_run_line(d), "", "| way | shape | ms | TB/s | values right |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        shape = f"H={r['H']} T={r['T']:,} ({r['layout']})" if "T" in r else ""
        ok = "" if "values_ok" not in r else ("yes" if r["values_ok"] else "**NO**")
        lines.append(f"| {r['way']} | {shape} | {r['ms']:.4f} | {r['tbps']:.2f} | {ok} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- attention


def _provider(r: dict) -> str:
    return f"{r['provider']} {r['dtype']}" + (" causal" if r.get("causal") else "")


def _pivot(rows: list[dict], row_key: Callable[[dict], str], col_key: Callable[[dict], str],
           first: str) -> list[str]:
    """A TFLOP/s table: one row per ``row_key``, one column per ``col_key``, in order of appearance."""
    rks: list[str] = []
    cks: list[str] = []
    cell: dict[tuple[str, str], float] = {}
    for r in rows:
        rk, ck = row_key(r), col_key(r)
        rks += [rk] if rk not in rks else []
        cks += [ck] if ck not in cks else []
        cell[(rk, ck)] = r["tflops"]
    out = [f"| {first} | " + " | ".join(cks) + " |", "|---|" + "---|" * len(cks)]
    for rk in rks:
        out.append(f"| {rk} | " + " | ".join(_num(cell.get((rk, ck)), ".1f") if (rk, ck) in cell else "–"
                                            for ck in cks) + " |")
    return out


#: bench_attention.py's FLASHINFER_VERDICT: the records of ours against FlashInfer in interleaved rounds
FLASHINFER_VERDICT = "ours / flashinfer fa3"
KEY_SCAN_VERDICT = "key scan: " + FLASHINFER_VERDICT  # (--key-scan's rounds)
AHEAD_OF_FLASHINFER = 1.05  # bench_attention.py's: the factor over FA3 the frontier asks


def _flashinfer_rounds(d: Doc) -> list[dict]:
    """``bench/bench_attention.py``'s interleaved rounds of ours against FlashInfer's FA3."""
    return [r for r in d["results"] if r.get("verdict") == FLASHINFER_VERDICT and "ratio_median" in r]


def _need_over_gemm(r: dict) -> float:
    """A FlashInfer round's target rate (AHEAD_OF_FLASHINFER × FA3's median TFLOP/s) over the
    median of the GEMM timed in the same rounds (``tflops_gemm``)."""
    return AHEAD_OF_FLASHINFER * statistics.median(r["tflops_theirs"]) / statistics.median(r["tflops_gemm"])


def attention_table(d: Doc) -> str:
    """``bench/bench_attention.py``: TFLOP/s of useful work by provider and shape, and the verdict lines."""
    meta = d["meta"]
    rows = [r for r in d["results"] if "tflops" in r and "case" in r]
    lines = [_run_line(d), "", f"TFLOP/s (FLOPs counted as {meta['flops_rule']}); \"triton\" is the engine's "
             "attention (the warp-specialized kernel where it applies" + (", with the variants a CUDA graph's "
             "launch takes: `--captured`" if meta.get("captured") else "") + (
             f", with `--ws-over {json.dumps(meta['ws_over'], separators=(',', ':'))}` over its defaults"
             if meta.get("ws_over") else "") + "); – : not run (no such path, or "
             "past the run's time budget).", ""]
    lines += _pivot(rows, _provider, lambda r: f"H={r['H']} {r['case']}", "provider")
    rounds = [r for r in d["results"] if "ratio_median" in r]  # the interleaved rounds' records
    verdict = [r for r in rounds if r.get("verdict") not in (FLASHINFER_VERDICT, KEY_SCAN_VERDICT)]
    if verdict:
        lines += ["", "Ragged ×4 over 4×1024 of equal work (interleaved rounds):", "",
                  "| H | dtype | provider | rounds | median | min | max |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['H']} | {r['dtype']} | {r['provider']} | {r['rounds']} | {r['ratio_median']:.3f} "
                  f"| {r['ratio_min']:.3f} | {r['ratio_max']:.3f} |" for r in verdict]
    ahead = _flashinfer_rounds(d)
    if ahead:
        # a GEMM measured in the same rounds (bench_attention's tflops_gemm): the matrix rate at
        # the clock the power cap leaves, and the target's rate (1.05 x FA3's) as a share of it
        gemm = all(r.get("tflops_gemm") for r in ahead)
        lines += ["", "Ours over FlashInfer's FA3, bf16 (interleaved rounds; TFLOP/s medians" + (
                  f"; an {ahead[0]['gemm_n']}³ bf16 GEMM (cuBLAS) measured in the same rounds, and "
                  f"{AHEAD_OF_FLASHINFER} × FA3's rate over the GEMM's" if gemm else "") + "):", "",
                  "| H | shape | rounds | ours | FlashInfer | ratio median | min | max |"
                  + f" GEMM | {AHEAD_OF_FLASHINFER} × FA3 / GEMM |" * gemm,
                  "|---|---|---|---|---|---|---|---|" + "---|---|" * gemm]
        lines += [f"| {r['H']} | {r['case']} | {r['rounds']} | {statistics.median(r['tflops_ours']):.1f} "
                  f"| {statistics.median(r['tflops_theirs']):.1f} | {r['ratio_median']:.3f} | {r['ratio_min']:.3f} "
                  f"| {r['ratio_max']:.3f} |"
                  + (f" {statistics.median(r['tflops_gemm']):.1f} | {_need_over_gemm(r):.3f} |" if gemm else "")
                  for r in ahead]
    fits = [r["fit"] for r in d["results"] if "fit" in r]
    if fits:
        gemm = all("gemm_tflops" in f for f in fits)
        lines += ["", "Where a launch's time goes (`--key-scan`): one segment of 8,192 queries over "
                  f"{', '.join(f'{k:,}' for k in fits[0]['keys'])} keys, ours and FA3 in turn per round (bf16); per "
                  "kernel a line through the median times: its slope is the key loop's rate, its intercept the time "
                  "the launch pays once per tile, whatever the keys (start, first loads, epilogue)" + (
                  "; the GEMM measured in the same rounds, and each key loop's rate over it" if gemm else "")
                  + ".", "",
                  "| H | kernel | key loop TFLOP/s | fixed ms | fixed share at 16,384 keys |"
                  + (" GEMM TFLOP/s | key loop / GEMM |" if gemm else ""),
                  "|---|---|---|---|---|" + ("---|---|" if gemm else "")]
        lines += [f"| {f['H']} | {who} | {f[k]['rate_tflops']:.1f} | {f[k]['fixed_ms']:.3f} "
                  f"| {100 * f[k]['fixed_share_16k']:.1f} % |"
                  + (f" {f['gemm_tflops']:.1f} | {f[k]['rate_tflops'] / f['gemm_tflops']:.3f} |" if gemm else "")
                  for f in fits for k, who in (("ours", "ours"), ("theirs", "FlashInfer FA3"))]
    if meta.get("targets"):
        lines += ["", "Targets (CONTRACT §6):", ""]
        lines += [f"- {t['line']}" + ("" if t["met"] else " — **missed**") for t in meta["targets"]]
    return "\n".join(lines) + "\n"


def _config(c: dict) -> str:
    return ", ".join(f"{k}({_config(v)})" if isinstance(v, dict) else f"{k}={v}" for k, v in c.items())


def ab_table(d: Doc) -> str:
    """``bench/bench_attention.py --ab``: config B against config A per shape, interleaved rounds."""
    rows = d["results"]
    # runs that compared B's output and LSE with A's once (``same_bits``): a column for it
    bits = any("same_bits" in r for r in rows)
    lines = [_run_line(d), "", "B / A: the median (least, largest) of the per-round TFLOP/s ratios, the two "
             "measured in turn in every round; TFLOP/s medians" + ("; same bits: B's output and LSE equal to A's"
                                                                  if bits else "") + ".", ""]

    def pair(r: dict) -> tuple[str, str, str]:
        return r["dtype"], _config(r["config_a"]), _config(r["config_b"])

    for dt, a, b in dict.fromkeys(pair(r) for r in rows):
        lines += [f"{dt}: A = {a}; B = {b}.", "",
                  "| H | shape | rounds | A | B | B / A | min | max |" + (" same bits |" if bits else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|" if bits else "")]
        for r in rows:
            if pair(r) != (dt, a, b):
                continue
            same = (" yes |" if r["same_bits"] else " **no** |") if "same_bits" in r else " |" if bits else ""
            if "ratio_median" not in r:
                lines.append(f"| {r['H']} | {r['case']} | – | – | – | {r.get('error', r.get('skipped'))} | | |"
                             + same)
                continue
            lines.append(f"| {r['H']} | {r['case']} | {r['rounds']} | {statistics.median(r['tflops_a']):.1f} "
                         f"| {statistics.median(r['tflops_b']):.1f} | {r['ratio_median']:.3f} "
                         f"| {r['ratio_min']:.3f} | {r['ratio_max']:.3f} |" + same)
        lines.append("")
    return "\n".join(lines)


def sweep_table(d: Doc) -> str:
    """``bench/bench_attention.py --sweep``: TFLOP/s by kernel configuration and shape."""
    rows = [r for r in d["results"] if "tflops" in r]
    dflt = "; ".join(f"{k.split('.')[-1]}: {_config(v)}" for k, v in d["meta"]["configs"].items())
    lines = [_run_line(d), "", f"TFLOP/s; configurations as the kernel takes them. The backend's defaults in this "
             f"run: {dflt}.", ""]
    # a configuration measured again in the same run gets a row per round; another provider
    # (FlashInfer beside the sweep) a row of its own
    def shape(r: dict) -> str:
        return f"H={r['H']} {r['case']}"

    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    label: dict[int, str] = {}  # id(record) -> its row
    for r in rows:
        rk = f"{r['dtype']} {_config(r['config']) if 'config' in r else r['provider']}"
        seen[(rk, shape(r))] += 1
        n = seen[(rk, shape(r))]
        label[id(r)] = rk if n == 1 else f"{rk} (round {n})"
    lines += _pivot(rows, lambda r: label[id(r)], shape, "config")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- transport


def transport_table(d: Doc) -> str:
    """``bench/bench_transport.py``: one request through each transport against the in-process engine."""
    meta, req = d["meta"], d["meta"]["request"]
    a = meta["args"]
    floor = d.get("rpc_floor_s")
    lines = [_run_line(d), "",
             f"One request: {a['new']:,} new tokens × {a['heads']} heads over {a['context']:,} context, "
             f"{a['cache_dtype']}/{a['prefill_dtype']}, {a['iters']} requests per mode (median); q "
             f"{req['q_bytes'] / 2**20:.1f} MiB, output {req['output_bytes'] / 2**20:.1f} MiB. In-process engine "
             f"{_ms(d['engine']['median_s'], '.3f')} ms"
             + (f"; an empty RPC {_ms(floor, '.3f')} ms" if floor is not None else "")
             + f"; idle CPUs: {meta.get('cpu_latency', 'not requested')}"
             + ("; system regions page-locked" if a.get("pin", True) else "; system regions pageable") + ".", "",
             "| mode | total ms | / engine | client encode ms | RPC ms | client decode ms | server ms "
             "| server validate ms | server compute ms | outside the handler ms | bit-identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, m in d["modes"].items():
        same = d.get("bit_identical", {}).get(mode)
        lines.append(f"| {mode} | {_ms(m['total_s'], '.3f')} | {m['ratio_to_engine']:.3f} "
                     f"| {_ms(m['encode_s'], '.3f')} "
                     f"| {_ms(m['rpc_s'], '.3f')} | {_ms(m['decode_s'], '.3f')} | {_ms(m.get('server_s'), '.3f')} "
                     f"| {_ms(m.get('server_validate_s'), '.3f')} | {_ms(m.get('server_compute_s'), '.3f')} "
                     f"| {_ms(m.get('outside_handler_s'), '.3f')} | {'yes' if same else '**NO**'} |")
    for mode, why in d.get("skipped", {}).items():
        lines.append(f"| {mode} | skipped ({why}) | | | | | | | | | |")
    return "\n".join(lines) + "\n"


def rpc_floor_table(d: Doc) -> str:
    """``bench/bench_rpc_floor.py``: an empty gRPC call on this host, µs (median)."""
    keys = [("sync_unary_us", "sync unary"), ("sync_stream_us", "sync stream"), ("aio_unary_us", "asyncio unary"),
            ("aio_stream_us", "asyncio stream"), ("python_work_hot_us", "Python work, hot"),
            ("python_work_after_5ms_idle_us", "the same after 5 ms idle")]
    return "\n".join([
        _run_line(d), "", f"{d['cpus']} CPUs; idle CPUs: {d.get('cpu_latency', 'not held')}. µs, median.", "",
        "| " + " | ".join(t for _, t in keys) + " |", "|" + "---|" * len(keys),
        "| " + " | ".join(f"{d[k]:.1f}" for k, _ in keys) + " |"]) + "\n"


def inline_parse_table(d: Doc) -> str:
    """``bench/bench_inline_parse.py``: the event loop's parse of an inline request."""
    meta = d["meta"]
    lines = [_run_line(d), "", f"The host's CPU ({meta['cpu']}, {meta['cores']} cores), Python {meta['python']}; "
             "context and heads as the request would carry them.", "",
             "| new tokens | heads | q MB | protobuf parse ms | inline views ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['tokens']:,} | {r['heads']} | {r['q_bytes'] / 1e6:.1f} | {r['protobuf_ms']:.3f} "
              f"| {r['views_ms']:.3f} |" for r in d["rows"]]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------- host, shards

_STEPS = ("validate", "inputs", "metadata", "copies in", "to first stage", "issue+device", "sync+readout", "return")


def _first_copy_queued(d: Doc) -> bool:
    """Whether a probe_host file marks the extension path's first copy where the copies were queued
    (graph_launch's return) rather than at the end of the call that also launches the graph."""
    return str(d["meta"].get("graph_first_copy", "")).startswith("the copies queued")


def _in_place_rounds(rows: list[dict]) -> str:
    """The README's words for probe_host's interleaved rounds of in-place and copying
    replays (medians, ms outside the stages)."""
    return ("; in interleaved rounds later in the run, replayed in place against copying q in and out and LSE out: "
            + " / ".join(f"{statistics.median(x['in_place_outside_s']) * 1e3:.3f} against "
                         f"{statistics.median(x['copies_outside_s']) * 1e3:.3f}"
                         for x in (r["replay_launch_rounds"] for r in rows)))


def host_table(d: Doc) -> str:
    """``bench/probe_host_issue.py``: where a request's host time goes, the device held."""
    first = ("the time that call returns for the copies queued" if _first_copy_queued(d)
             else "that call's return, an upper bound")
    lines = [_run_line(d), "", "ms for the request, its time outside the stages, the device span and the host before "
             "the first stage (device held); µs per host step and from the call to the first device copy queued "
             "(median; graph: the fused path replayed as a CUDA graph, which takes no loop inputs, queued through the "
             f"CUDA extension, whose one call queues the copies in and launches the graph: its first copy is {first}; "
             "q is read and out and LSE written in place; graph_copies: the same replay copying q into the graph's "
             "buffer and out and LSE out of it; graph_torch: the same replay queued through torch's calls, copying, "
             "beside it).", "",
             "| H | new | ctx | prefill | path | request ms | outside the stages ms | device span ms | "
             "before stages ms | " + " | ".join(f"{s} µs" for s in _STEPS) + " | to the first copy µs |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(_STEPS) + "---|"]
    for r in d["rows"]:
        for p in ("generic", "fused", "graph", "graph_copies", "graph_torch"):
            st = r.get(f"{p}_host_steps_us")
            if st is None:
                continue
            lines.append(f"| {r['heads']} | {r['new']} | {ctx_label(r['context'])} | {r['prefill_dtype']} | {p} "
                         f"| {_ms(r[f'{p}_request_s'], '.3f')} | {_ms(r.get(f'{p}_outside_s'), '.3f')} "
                         f"| {_ms(r[f'{p}_span_s'], '.3f')} | {_ms(r[f'{p}_before_stages_s'], '.3f')} | "
                         + " | ".join(_num(st.get(s), ".1f") for s in (*_STEPS, "first copy")) + " |")
    costs = [("event_record_us", "event record"), ("event_elapsed_us", "event elapsed"), ("empty_us", "torch.empty"),
             ("h2d_pinned_4k_us", "4 KiB H2D pinned"), ("validate_us", "validation"),
             ("attention_call_us", "attention call")]
    order = ", ".join(f"H={r['heads']} {r['prefill_dtype']}" for r in d["rows"])
    ab = [(r, r["replay_launch_rounds"]) for r in d["rows"]]
    lines += ["", "A replay in place against one copying q in and out and LSE out, both through the CUDA "
              f"extension, {len(ab[0][1]['in_place_outside_s'])} interleaved rounds (median of each, µs; "
              "outside the stage, then the stage): " + "; ".join(
                  f"H={r['heads']} {r['prefill_dtype']} "
                  + ("" if x["in_place"] else "(not in place: the capture's check failed) ")
                  + f"outside {statistics.median(x['in_place_outside_s']) * 1e6:.1f} against "
                  f"{statistics.median(x['copies_outside_s']) * 1e6:.1f}, stage "
                  f"{statistics.median(x['in_place_stage_s']) * 1e6:.1f} against "
                  f"{statistics.median(x['copies_stage_s']) * 1e6:.1f} (saving, median over rounds: "
                  f"{x['median_saving_outside_s'] * 1e6:.1f} and {x['median_saving_stage_s'] * 1e6:.1f})"
                  + (f", the call to its first copy {statistics.median(x['in_place_first_copy_us']):.1f} against "
                     f"{statistics.median(x['copies_first_copy_us']):.1f} (validation "
                     f"{statistics.median(x['in_place_validate_us']):.1f} against "
                     f"{statistics.median(x['copies_validate_us']):.1f})" if "in_place_first_copy_us" in x else "")
                  for r, x in ab) + "."]
    lines += ["", f"Host cost of one call, µs ({order}): " + "; ".join(
        f"{t} " + ", ".join(_num(r.get(k), ".1f") for r in d["rows"]) for k, t in costs) + "."]
    waits = [r["validate_after_wait_us"] for r in d["rows"] if "validate_after_wait_us" in r]
    if len(waits) == len(d["rows"]):
        lines += ["", f"One validation, µs, by what the host did just before it ({order}): " + "; ".join(
            f"{k} " + ", ".join(f"{w[k]:.1f}" for w in waits) for k in waits[0]) + " (hot: in a loop; "
            "1.5 ms, 12 ms: after waiting that long for a spin kernel; 12 ms gemm: for GEMMs, the device at "
            "its power cap, queued as " + d["meta"]["gemm_wait"] + "; 12 ms busy: "
            "after 12 ms spent validating while the spin kernel ran"
            + ("; 12 ms polled: after 12 ms asking the stream from Python, nothing else; yielding: the same "
               "with sched_yield between asks; asleep: after sleeping 13 ms" if "12 ms polled" in waits[0] else "")
            + ")."]
    return "\n".join(lines) + "\n"


def gemm_table(d: Doc) -> str:
    """``bench/probe_gemm.py``: kv_b_proj's GEMM, cuBLAS against a persistent TMA kernel."""
    rows = d["rows"]
    lines = [_run_line(d), "", f"bf16, K = {rows[0]['k']}; burst: an 8192³ GEMM in the same process, "
             f"{rows[0]['burst_tflops']:.0f} TFLOP/s.", "",
             "| H | rows | N | cuBLAS TFLOP/s | of burst | Triton persistent TFLOP/s | of burst | Triton / cuBLAS | "
             "config (BM, BN, BK, group, stages, warps, split) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['heads']} | {r['rows']:,} | {r['n']:,} | {r['cublas_tflops']:.1f} "
                     f"| {r['cublas_of_burst']:.0%} | {_num(r.get('triton_tflops'), '.1f')} "
                     f"| {_num(r.get('triton_of_burst'), '.0%')} "
                     f"| {_num(r.get('triton_over_cublas'), '.2f')} | {r.get('triton_config', '—')} |")
    if any("cublaslt_tflops" in r for r in rows):  # torch's matmul through cuBLASLt, where the run had it
        lt = [f"H={r['heads']} {r['rows']:,} rows {_num(r.get('cublaslt_tflops'), '.1f')} "
              f"({_num(r.get('cublaslt_over_cublas'), '.2f')}×)" for r in rows]
        lines += ["", "torch's matmul through cuBLASLt (`torch.backends.cuda.preferred_blas_library`), TFLOP/s "
                  "(× cuBLAS): " + "; ".join(lt) + "."]
    if any("gluon_tflops" in r for r in rows):  # ops/kv_b_proj_gluon.py, where the run had it
        lines += ["", "The persistent warp-specialized Gluon kernel (`ops/kv_b_proj_gluon.py`), best of its "
                  "tuning list:", ""]
        host = any("gluon_host_s" in r for r in rows)  # the host's launch time, where the run had it
        lines += ["| H | rows | Gluon TFLOP/s | of burst | Gluon / cuBLAS | max abs diff from cuBLAS | "
                  + ("host µs a call, cuBLAS / Gluon | " if host else "") + "config |",
                  "|---|---|---|---|---|---|" + ("---|" if host else "") + "---|"]
        lines += [f"| {r['heads']} | {r['rows']:,} | {_num(r.get('gluon_tflops'), '.1f')} "
                  f"| {_num(r.get('gluon_of_burst'), '.0%')} | {_num(r.get('gluon_over_cublas'), '.2f')} "
                  f"| {_num(r.get('gluon_max_abs_diff'), '.3g')} "
                  + (f"| {_us(r.get('cublas_host_s'))} / {_us(r.get('gluon_host_s'))} "
                     if host else "")
                  + f"| {r.get('gluon_config', '—')} |" for r in rows]
    if any("gluon_configs" in r for r in rows):  # every configuration of the tuning list, where the run kept them
        each = [f"H={r['heads']} {r['rows']:,} rows: "
                + ", ".join(f"{_change(c['change'])} {c['tflops']:.1f}" for c in r["gluon_configs"])
                for r in rows if "gluon_configs" in r]
        lines += ["", "Each configuration of the tuning list (changes to `CONFIG`), TFLOP/s: " + "; ".join(each) + "."]
    return "\n".join(lines) + "\n"


def _change(change: dict[str, Any]) -> str:
    """A tuning entry's changes to the kernel's CONFIG, as ``BN=128 STAGES=5`` (``defaults`` for none)."""
    return " ".join(f"{k}={v}" for k, v in change.items()) or "defaults"


def sharded_table(d: Doc) -> str:
    """``bench/bench_sharded.py``: one server against head-sharded workers."""
    meta, eq, a = d["meta"], d["equality"], d["meta"]["args"]
    lines = [_run_line(d), "",
             f"H={a['heads']}, {a['new_tokens']:,} new over {a['context']:,} context, {a['concurrency']} clients for "
             f"{a['seconds']:.0f} s; whole on {meta['device_whole']}, shards on {', '.join(meta['devices_shards'])}. "
             f"Sharded = whole bit for bit: output {'yes' if eq['output_bit_equal'] else '**NO**'}, LSE "
             f"{'yes' if eq['lse_bit_equal'] else '**NO**'}. Throughput ×{d['speedup_requests_per_s']:.2f}.", "",
             "| mode | servers | requests | req/s | context Mtok/s | p50 s | p99 s | server ms (mean) | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in d["phases"]:
        lat = p["latency_s"]
        lines.append(f"| {p['mode']} | {len(p['targets'])} | {p['requests']} | {p['requests_per_s']:.2f} "
                     f"| {p['context_tokens_per_s'] / 1e6:.3f} | {lat['p50']:.3f} | {lat['p99']:.3f} "
                     f"| {p['server_ms_mean']:.1f} | {p['errors']} |")
    return "\n".join(lines) + "\n"


def growth_table(d: Doc) -> str:
    """The lines fitted along context (ctxprefill_bench/growth.py, from the rows: what
    ``ctxprefill bench`` records beside them). Per context token: the fused request's growth,
    its replay's (where the run had one), the floor's, and the slopes between neighbouring
    lengths (a step from re-allocation or re-planning shows as one far above the line)."""
    fitted = growth.growth(d.get("rows", []))
    if not fitted:
        return ""
    graph = all("graph_ns_per_token" in g for g in fitted)
    lines = ["| H | new | cache | prefill | context tokens | fused ns / token | "
             + ("CUDA graph ns / token | " if graph else "") + "floor ns / token | fused / floor growth "
             "| fused between neighbouring points, ns / token | fused line at no tokens, ms |",
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if graph else "")]
    for g in fitted:
        xs = g["tokens"]
        nb = g["fused_neighbour_ns_per_token"]
        lines.append(f"| {g['heads']} | {g['new']:,} | {g['cache_dtype']} | {g['prefill_dtype']} "
                     f"| {ctx_label(min(xs))}–{ctx_label(max(xs))} ({len(xs)}) "
                     f"| {g['fused_ns_per_token']:.2f} | "
                     + (f"{g['graph_ns_per_token']:.2f} | " if graph else "")
                     + f"{_num(g.get('floor_ns_per_token'), '.2f')} | {_num(g.get('fused_over_floor_growth'), '.2f')} "
                     f"| {min(nb):.2f}–{max(nb):.2f} | {g['fused_fixed_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def model_prefill_table(d: Doc) -> str:
    """``bench/bench_model_prefill.py``: a DeepSeek-V3 model's chunked prefill through ctxprefill, per chunk."""
    meta, m, srv = d["meta"], d["meta"]["model"], d["meta"].get("server") or {}
    tr = d["transports"]
    lines = [_run_line(d), "",
             f"A random DeepSeek-V3 model (transformers {meta['transformers']}): {m['layers']} layers × {m['heads']} "
             f"heads, hidden {m['hidden']:,}, q LoRA {m['q_lora_rank']}, YaRN RoPE, bf16 weights computing in "
             f"{m.get('dtype', 'bfloat16')}, a {m['shards']}-shard "
             f"checkpoint served by `serve --model` ({srv.get('attention_backend', '?')} backend, workspace "
             f"{_num(srv.get('workspace_tokens'), ',')} tokens); one prompt of {meta['prompt_tokens']:,} tokens in "
             f"chunks of {meta['chunk_tokens']:,}. Per chunk, ms: local = the model's own work (device synchronized), "
             f"remote = the client's wall time in its {m['layers']} ctxprefill calls, server = their Stats (total, "
             f"compute). The last of {meta['args']['repeats']} prefills per transport.", "",
             "| transport | chunk | context tokens | local ms | remote ms | server total ms | server compute ms "
             "| remote − server ms |", "|---|---|---|---|---|---|---|---|"]
    for name, r in tr.items():
        for row in [*r["rows"], {"chunk": "**all**", "context_tokens": "", **r["totals"]}]:
            ctx = f"{row['context_tokens']:,}" if row["context_tokens"] != "" else ""
            lines.append(f"| {name} | {row['chunk']} | {ctx} | {row['local_ms']:.2f} | {row['remote_ms']:.2f} "
                         f"| {row['server_total_ms']:.2f} | {row['server_compute_ms']:.2f} "
                         f"| {row['remote_ms'] - row['server_total_ms']:.2f} |")
    tol = d["tolerances"]
    lines += ["", f"Relative error ‖a − b‖ / ‖b‖ against transformers' forward of the whole prompt "
              f"({m['reference_attention']} attention; limits {tol['attention']:g} per layer, {tol['logits']:g} "
              f"logits); the controls: every chunk alone, without its context, and transformers' own chunked "
              f"prefill (its KV cache, the same chunks).", "",
              "| | largest layer attention | logits | within limits |", "|---|---|---|---|"]
    for name, r in tr.items():
        ok = d["within_tolerance"].get(name)
        lines.append(f"| {name} | {r['max_attention_error']:.2e} | {r['errors']['logits']:.2e} "
                     f"| {'yes' if ok else '**NO**'} |")
    c = d.get("control_errors")
    if c:
        worst = max(v for k, v in c.items() if k != "logits")
        lines.append(f"| control: no context | {worst:.2e} | {c['logits']:.2e} | |")
    own = d.get("transformers_chunked_errors")
    if own:
        worst = max(v for k, v in own.items() if k != "logits")
        lines.append(f"| control: transformers chunked | {worst:.2e} | {own['logits']:.2e} | |")
    return "\n".join(lines) + "\n"


def _period(r: dict) -> str:
    """A stream-ordered run's median time between results on the caller's stream, ms ('—' otherwise)."""
    p = [row["result_period_ms"] for row in r["rows"] if row.get("result_period_ms") is not None]
    return f"{statistics.median(p):.3f}" if p else "—"


def _prefill(r: dict) -> str:
    """A workload run's prefill dtype (its server's), with its cache's where not bf16."""
    cache = r["server"]["cache_dtype"]
    return r["server"]["prefill_dtype"] + ("" if cache == "auto" else f" ({cache} cache)")


def _mps(r: dict) -> str:
    """A --mps-ab run's MPS cell and its separator: "on (2) | "."""
    return f"{'on' if r['mps'] else 'off'} ({r['round']}) | "


def model_workload_table(d: Doc) -> str:
    """``bench/bench_model_workload.py``: a DeepSeek-V3-shaped model's prefill through the request ring, per head
    count, against the sum of its calls' floors."""
    meta, a = d["meta"], d["meta"]["args"]
    ab = any("mps" in r for r in d["runs"])  # a --mps-ab run
    lines = [_run_line(d), "",
             f"One sequence: {a['new']:,} new tokens in {a['chunk']:,}-token chunks over a context growing to "
             f"{a['max_context']:,} tokens, every layer's PrefillContext through a request ring (tensors in "
             f"{meta['shared_memory']} shared memory, cache_write {a['cache_write']}), each answer read before "
             f"the next layer's call"
             + (" (the server with --cuda-graphs: a step's shape captured once, replayed for the other layers)"
                if a.get("cuda_graphs") else "")
             + ". Order host: an answer comes once the call's device work is done, so the device waits for both "
             "hosts between calls; order stream (a stream-ordered ring, on the same server): each layer's q is "
             "written on the caller's stream, the server's work waits for it on the device and is answered once "
             "queued, and a chunk's wall time ends when its device work has. "
             "Floor: each call's kv_b_proj and attention FLOPs at the measured bf16 GEMM rate (fp8 prefill's "
             "attention too: fp8's tensor cores are rated at twice that, so its floor is a yardstick, not its limit) "
             f"plus its gather/pack bytes at the measured copy bandwidth, summed over the calls (held: at the GEMM "
             f"rate held for {a['sustained_gemm_s']:g} s, the clock the power cap leaves). Context tokens/s: "
             f"the context tokens the calls attended, summed, per second (one GPU)."
             + (f" `--mps-ab {a['mps_ab']}`: the same run without and with the caller and the server under one CUDA "
                f"MPS daemon, in turn, {a['mps_ab']} round{'s' if a['mps_ab'] != 1 else ''} (MPS column: on or off, "
                f"the round)."
                if a.get("mps_ab") else ""), "",
             "| heads | prefill | order | " + ("MPS | " if ab else "") + "layers | chunks | calls | wall s "
             "| server compute s | floor sum s | wall / floor | wall / held floor | context tokens/s | at the floor "
             "| SM clock MHz (median, power cap share) | float64 check |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if ab else "")]
    for r in d["runs"]:
        check = ", ".join(f"layer {c['layer']}: {c['output_error']:.1e}" for c in r["checks"]) or "n/a"
        ck = r.get("clocks")
        clock = (f"{ck['sm_mhz_median']:.0f} ({ck['reasons'].get('sw_power_cap', 0.0):.0%})" if ck else "n/a")
        lines.append(f"| {r['heads']} | {_prefill(r)} | {r.get('order', 'host')} | {_mps(r) if ab else ''}"
                     f"{r['layers']} | {r['chunks']} "
                     f"| {r['calls']} "
                     f"| {r['wall_s']:.3f} "
                     f"| {r['server_compute_s']:.3f} | {_num(r['floor_s'], '.3f')} | {_num(r['ratio'], '.2f')} "
                     f"| {_num(r['ratio_held'], '.2f')} "
                     f"| {_num(r['context_tokens_per_s'], '.3g')} | {_num(r['floor_context_tokens_per_s'], '.3g')} "
                     f"| {clock} | {check} |")
    for f in meta.get("failed", []):  # a configuration that did not run to its end
        lines.append(f"| {f['heads']} | {f['prefill_dtype']} | failed: {f['error'][:200]} |")
    if all("server_phase_s" in r for r in d["runs"]):
        lines += ["", "Per call, ms: the caller's wait (submit to answer), the server's host phases (validate: "
                  "parse and decode; compute: the engine call, its device work waited for), the device time of its "
                  "stages (a replayed CUDA graph is one stage), and what is left of the caller's wait outside the "
                  "server (the ring's hand-offs, the answer's parse). In stream order the answer comes once the "
                  "work is queued: compute is the host's queueing, no device time is reported, the caller's wait "
                  "includes the server holding a request until one of the ring's unfinished ones is done (at most "
                  "one per slot), and the period is the median time from one layer's result reaching the caller's "
                  "stream to the next's (the device's time per call).", "",
                  "| heads | prefill | order | " + ("MPS | " if ab else "") + "caller | server | validate | compute "
                  "| device stages | compute − device | outside the server | period on the caller's stream |",
                  "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if ab else "")]
        for r in d["runs"]:
            n, ph = r["calls"], r["server_phase_s"]
            dev = sum(r["stage_s"].values())
            timed = bool(r["stage_s"])
            dev_ms = f"{dev / n * 1e3:.3f}" if timed else "—"
            beyond_ms = f"{(ph['compute'] - dev) / n * 1e3:.3f}" if timed else "—"
            lines.append(f"| {r['heads']} | {_prefill(r)} | {r.get('order', 'host')} | {_mps(r) if ab else ''}"
                         f"{r['calls_s'] / n * 1e3:.3f} "
                         f"| {r['server_total_s'] / n * 1e3:.3f} "
                         f"| {ph['validate'] / n * 1e3:.3f} | {ph['compute'] / n * 1e3:.3f} "
                         f"| {dev_ms} | {beyond_ms} "
                         f"| {(r['calls_s'] - r['server_total_s']) / n * 1e3:.3f} | {_period(r)} |")
    replays = {(r["heads"], _prefill(r)): r["server"]["graph_replays"] for r in d["runs"]
               if (r.get("server") or {}).get("graph_replays")}
    if a.get("cuda_graphs") and replays:
        lines += ["", "Requests replayed as CUDA graphs, per server (its orders together; "
                  "`ctxprefill_graph_replays_total`), in place / copying: " + "; ".join(
                      f"{h} heads {p} {g.get('in_place', 0):.0f} / {g.get('copying', 0):.0f}"
                      for (h, p), g in replays.items()) + "."]
    return "\n".join(lines) + "\n"


def table(d: Doc) -> str:
    """The table of any result file, by its shape."""
    if kind(d) == "model_prefill":
        return model_prefill_table(d)
    if kind(d) == "model_workload":
        return model_workload_table(d)
    if "results" in d and "copy_tbps" in d:
        return kernels_table(d)
    if "results" in d:
        mode = d["meta"].get("mode")
        return sweep_table(d) if mode == "sweep" else ab_table(d) if mode == "ab" else attention_table(d)
    if "modes" in d:
        return transport_table(d)
    if "sync_unary_us" in d:
        return rpc_floor_table(d)
    if "phases" in d:
        return sharded_table(d)
    rows = d.get("rows", [])
    if rows and "way" in rows[0]:
        return write_table(d)
    if rows and "protobuf_ms" in rows[0]:
        return inline_parse_table(d)
    if rows and "fused_host_steps_us" in rows[0]:
        return host_table(d)
    if rows and "cublas_tflops" in rows[0]:
        return gemm_table(d)
    if kind(d) == "concurrency":
        return concurrency_table(d)
    fitted = growth_table(d)
    return engine_table(d) + ("\nGrowth with context (least squares over the rows above):\n\n" + fitted
                              if fitted else "")


# ---------------------------------------------------------------------------- benchmarks


@dataclasses.dataclass(frozen=True)
class Bench:
    title: str
    step: str  # the GPU_RUN_STEPS entry of scripts/gpu_run.sh that writes the files
    files: tuple[str, ...]  # bench/results/<file>.json
    what: str
    env: str = ""  # more environment for gpu_run.sh
    plots: tuple[str, ...] = ()
    note: str = ""  # after the command


BENCHMARKS = (
    Bench("The whole request, fused vs generic (headline rows)", "bench_engine",
          ("bench_engine", "bench_engine_h200"),
          "`ctxprefill bench` at 16 and 128 heads, 1,024 new tokens over 64k context, every cache and prefill dtype: "
          "one engine in one process runs the same request through the fused and the generic path (bit for bit "
          "the same answer), timed per stage, beside the floor (kv_b_proj and attention FLOPs at the measured GEMM "
          "rate + gather/pack bytes at the measured copy bandwidth). Two runs: an H100 (`bench_engine`; the plot) "
          "and an H200 (`bench_engine_h200`).",
          plots=("engine_stages.png",), note=" (`BENCH_ENGINE_FILE=bench_engine_h200` names the second file)"),
    Bench("The gather folded into kv_b_proj's GEMM, and the merges beside it: paged against cuBLAS, merges "
          "beside against in line", "bench_engine",
          ("bench_engine_paged",),
          "`ctxprefill bench --gemm paged --gemm-ab cublas`: the headline rows with kv_b_proj's GEMM reading each "
          "chunk's latents from the cache (`--kv-b-proj-gemm paged`: no gather where the cache is bf16 and the "
          "weight narrower than 16,384 columns; elsewhere the gather and cuBLAS), and each row's fused request "
          "again, eager and as a CUDA graph, with cuBLAS right after it in the same process. The replays' ratio "
          "is device time; rows the paged GEMM does not take show how much the order alone moves it. Then each "
          "row's CUDA graph captured with its merges in line (after each attention) and on a branch of their own "
          "(beside the next chunk's GEMM: engine/graphs.py), in 3 interleaved rounds.",
          env='BENCH_ENGINE_FILE=bench_engine_paged GPU_RUN_ENGINE_ARGS="--gemm paged --gemm-ab cublas --merges-ab 3"'),
    Bench("Attention's variant for CUDA graphs, and paged against cuBLAS: in one run", "bench_engine",
          ("bench_engine_graph_variants",),
          "`ctxprefill bench --gemm paged --gemm-ab cublas --graph-variants-ab 3`: the headline rows with the "
          "paged GEMM, each row's fused request again with cuBLAS right after it (as above), then each row's CUDA "
          "graph captured with attention told it is captured (the Gluon kernel's q and K descriptors made by the "
          "launch, `HOST_DESC`: engine/graphs.py) and not, in 3 interleaved rounds.",
          env='BENCH_ENGINE_FILE=bench_engine_graph_variants '
              'GPU_RUN_ENGINE_ARGS="--gemm paged --gemm-ab cublas --graph-variants-ab 3"'),
    Bench("Ragged requests", "bench_engine_ragged", ("bench_engine_ragged",),
          "`ctxprefill bench --sequences 4 --workspace-tokens 65536`: the request split unevenly over 4 sequences "
          "in one 64k-row chunk."),
    Bench("The whole request, 108-shape grid", "bench_engine_full", ("bench_engine_full",),
          "`ctxprefill bench --grid full`: H ∈ {16, 128} × new ∈ {512, 1,024, 8,192} × context ∈ {8k, 64k, 256k} × "
          "cache {auto, fp8, fp8_ds_mla} × prefill {bf16, fp8}."),
    Bench("Where a request's host time goes", "probe_host", ("probe_host", "probe_host_quiet"),
          "`bench/probe_host_issue.py`: the engine's host steps for one request, the device held busy so that the "
          "host never waits on it. Two runs on two GPU machines of the same kind: on the first (`probe_host`) a "
          "12 ms wait for the device costs the next host step 10–15× its time, on the second (`probe_host_quiet`) "
          "~2× (the last table of each).", env='PROBE_HOST_HEADS="16 128"',
          note=" (`PROBE_HOST_FILE=probe_host_quiet` names the second file)"),
    Bench("kv_b_proj's GEMM: cuBLAS against a persistent kernel", "probe_gemm", ("probe_gemm",),
          "`bench/probe_gemm.py`: the GEMM of kv_b_proj (K = 512) at 16 and 128 heads over 16k and 64k rows, "
          "torch's (cuBLAS) against a Triton persistent TMA kernel whose epilogue overlaps the next tile's loads "
          "and the Gluon kernel, alternating in one process, beside an 8192³ GEMM's burst rate; each call's "
          "device time (a sleep kernel queued ahead hides its launch), and the host's time to launch it."),
    Bench("Kernels against the copy bandwidth", "bench_kernels", ("bench_kernels",),
          "`bench/bench_kernels.py`: the fused pack, gather and merge kernels against their generic / torch forms "
          "and against a device-to-device copy (and plain copies of the same read/write mix, `bench/mix_copy.py`), "
          "L2 flushed before every repetition."),
    Bench("Write bandwidth by way of writing", "probe_write", ("probe_write",),
          "`bench/probe_write_bandwidth.py`: fill, zero, memset and Triton stores against copy and read, and the "
          "bf16 pack in CUDA against Triton packs."),
    Bench("Attention against other kernels", "bench_attention_flashinfer", ("bench_attention",),
          "`bench/bench_attention.py --flashinfer`: chunk attention with LSE (192-wide q·k, 128-wide v) by the "
          "engine's Triton/Gluon kernels, FlashInfer's FA3 ragged prefill, cuDNN, torch's flash (v padded to 192) "
          "and flex attention, on equal, single and ragged batches; the same data for every provider. "
          "(`GPU_RUN_STEPS=bench_attention` runs it without FlashInfer.)"),
    Bench("Attention against FA3 with a CUDA graph's launch variants", "bench_attention_flashinfer",
          ("bench_attention_captured",),
          "`bench/bench_attention.py --flashinfer --captured --key-scan`: ours with the variants a CUDA graph's "
          "launch takes (q's and K's descriptors from the launch, `HOST_DESC`) beside FlashInfer's FA3, and where "
          "each launch's time goes by key count.",
          env='GPU_RUN_FI_ARGS="--providers triton flashinfer --no-flex --budget-s 200 --key-scan --captured" '
              "BENCH_ATTENTION_FILE=bench_attention_captured"),
    Bench("Warp-specialized attention configurations", "attention_sweep_ws", ("attention_sweep_ws",),
          "`bench/bench_attention.py --sweep ws`: the warp-specialized (Gluon) kernel's pipelining, key block and "
          "stages."),
    Bench("Where the pipelined kernel rescales O", "attention_sweep_ws", ("attention_sweep_ws-rescale",),
          "`bench/bench_attention.py --sweep ws-rescale`: the pipelined bf16 kernel rescaling O after its P·V "
          "(the default) or right after issuing the next block's Q·Kᵀ (FA3's order, `RESCALE_EARLY`), twice each "
          "in turn, FlashInfer's FA3 beside them.", env="GPU_RUN_WS_SWEEP=ws-rescale GPU_RUN_SWEEP_FLASHINFER=1"),
    Bench("Two kernel configurations in interleaved rounds", "attention_ab", ("attention_ab_ws-wait",),
          "`bench/bench_attention.py --ab ws-wait`: pairs of the warp-specialized kernel's configurations, B "
          "against A measured in turn for 5 rounds per shape: bf16 pipelined with P·V's wait held after the "
          "softmax (`PV_WAIT_LATE`) against without, and with turns at the tensor cores (`PINGPONG`) against "
          "without; fp8 pipelined with the late wait, with and without turns, against serial.",
          env="GPU_RUN_AB=ws-wait"),
    Bench("fp8 over 256-key blocks, in interleaved rounds", "attention_ab", ("attention_ab_ws-fp8-wide",),
          "`bench/bench_attention.py --ab ws-fp8-wide`: fp8 keys-last, serial consumers over 256-key blocks in 2 "
          "stages, with and without turns (B), against the pipelined kernel over 128-key blocks in 3 stages with "
          "turns and the late wait (A), 5 rounds per shape.", env="GPU_RUN_AB=ws-fp8-wide"),
    Bench("fp8 with P·V's operand in registers, in interleaved rounds", "attention_ab",
          ("attention_ab_ws-fp8-regs",),
          "`bench/bench_attention.py --ab ws-fp8-regs`: fp8 keys-last with P·V's operand in registers (`P_REGS`): "
          "serial consumers over 256-key blocks, without and with turns, and pipelined consumers over 128-key "
          "blocks in 4 stages (B), against pipelined consumers over 256-key blocks with P staged in shared memory, "
          "the late wait and turns (A), 5 rounds per shape.", env="GPU_RUN_AB=ws-fp8-regs"),
    Bench("q's and K's descriptors made by the launch, in interleaved rounds", "attention_ab",
          ("attention_ab_ws-host-desc",),
          "`bench/bench_attention.py --ab ws-host-desc`: the defaults of both dtypes with q's and K's TMA "
          "descriptors made once by the launch (`HOST_DESC`, B) against made by every program (A), over 1k, 4k "
          "and 16k keys and a ragged batch, 5 rounds per shape: the device's side of the variant a CUDA graph "
          "captures (do_bench's figures; at 16 heads over 1k keys, ~0.2 ms kernels, the rounds vary too much "
          "to tell).", env="GPU_RUN_AB=ws-host-desc"),
    Bench("K and V slots released without a barrier, in interleaved rounds", "attention_ab",
          ("attention_ab_ws-arrive-nosync",),
          "`bench/bench_attention.py --ab ws-arrive-nosync`: the defaults of both dtypes with each K and V slot "
          "released by one thread of a consumer warpgroup once its wgmma wait returns, without the warpgroup "
          "barrier before it (`ARRIVE_NOSYNC`, B), against with it (A), 5 rounds per shape.",
          env="GPU_RUN_AB=ws-arrive-nosync"),
    Bench("O rescaled only when a row's max moved, in interleaved rounds", "attention_ab",
          ("attention_ab_ws-lazy-rescale",),
          "`bench/bench_attention.py --ab ws-lazy-rescale --verdict-rounds 21`: bf16 pipelined consumers that keep "
          "a row's max until it grows past 2⁸ in p and skip O's rescale when no row of the warpgroup moved "
          "(`LAZY_RESCALE`, B), against rescaling every key block (A), 21 rounds per shape.",
          env="GPU_RUN_AB=ws-lazy-rescale GPU_RUN_AB_ROUNDS=21"),
    Bench("Persistent programs, in interleaved rounds", "attention_ab", ("attention_ab_ws-persist",),
          "`bench/bench_attention.py --ab ws-persist --verdict-rounds 11`: the defaults of both dtypes with one "
          "program per SM taking tile after tile (`PERSIST`, B) against a program per tile (A), 11 rounds per "
          "shape; a ragged batch's order laid out for the persistent walk where one beats the grid's (16 heads), "
          "the grid's order otherwise.", env="GPU_RUN_AB=ws-persist GPU_RUN_AB_ROUNDS=11"),
    Bench("Where persistent bf16 programs lose, in interleaved rounds", "attention_ab",
          ("attention_ab_ws-persist-bf16",),
          "`bench/bench_attention.py --ab ws-persist-bf16 --verdict-rounds 9`: bf16 persistent programs against "
          "q's and K's descriptors made by the launch alone (`HOST_DESC`), without the lazy rescale, with serial "
          "consumers and with turns at the tensor cores (`PINGPONG`), each against the same without `PERSIST`, "
          "9 rounds per shape (B without the lazy rescale computes other bits, as it should).",
          env="GPU_RUN_AB=ws-persist-bf16 GPU_RUN_AB_ROUNDS=9"),
    Bench("Persistent programs as a launch takes them, in interleaved rounds", "attention_ab",
          ("attention_ab_ws-persist-launch",),
          "`bench/bench_attention.py --ab ws-persist-launch --ws-over '{\"PERSIST\":true}' --verdict-rounds 9`: "
          "bf16 with turns at the tensor cores (`PINGPONG`) and fp8 as it was, `PERSIST` set for every launch and "
          "decided per launch (B) — persistent programs over one segment or in an order laid out for them, a "
          "program per tile for several segments without one (`persistent_launch`: here 4x1024q, and ragged4 at "
          "128 heads) — against a program per tile without turns (A), 9 rounds per shape.",
          env="GPU_RUN_AB=ws-persist-launch GPU_RUN_AB_ROUNDS=9 GPU_RUN_AB_ARGS='--ws-over {\"PERSIST\":true}'"),
    Bench("Throughput under concurrency", "bench_concurrency", ("bench_concurrency",),
          "`bench/bench_concurrency.py`: 1 to 16 clients against one server per shape, inline tensors and CUDA IPC "
          "regions."),
    Bench("Pipelining on a stream", "bench_concurrency_stream", ("bench_concurrency_stream",),
          "`bench/bench_concurrency.py --stream-depth 2`: two requests in flight per client on one "
          "PrefillContextStream, CUDA IPC."),
    Bench("Request rings under load", "bench_concurrency_ring", ("bench_concurrency_ring",),
          "`bench/bench_concurrency.py --ring-depth 2`: a CUDA IPC request ring per client, two requests in flight.",
          plots=("concurrency.png",)),
    Bench("The request ring's overlap, on / off / on", "bench_ring_overlap",
          ("bench_ring_overlap_on", "bench_ring_overlap_off", "bench_ring_overlap_on2"),
          "`bench/bench_concurrency.py --ring-depth 2` at 16 heads with the server's `--request-ring-overlap` on, "
          "off (`--no-request-ring-overlap`) and on again, one after another (the bracketing shows the drift "
          "between runs)."),
    Bench("Calls overlapping on the device, on / off / on", "bench_request_overlap",
          ("bench_request_overlap_on", "bench_request_overlap_off", "bench_request_overlap_on2"),
          "`bench/bench_concurrency.py --transport cuda` at 16 and 128 heads, a unary call per request, with the "
          "server's `--request-overlap` on (the engine thread starts the next queued request before it finishes "
          "the one running), off (`--no-request-overlap`) and on again, one after another (the bracketing shows "
          "the drift between runs)."),
    Bench("Transports against the engine", "bench_transport", ("bench_transport",),
          "`bench/bench_transport.py`: one request through a real server by every transport (inline, system "
          "shared memory, its request ring, CUDA IPC, on a stream, its request ring), against the same request "
          "in process; client and server time split."),
    Bench("System regions page-locked or pageable", "bench_transport_pin",
          ("bench_transport_pin", "bench_transport_nopin", "bench_transport_pin2", "bench_transport_nopin2"),
          "`bench/bench_transport.py --modes system system-ring`, the server's system regions page-locked (default) "
          "and pageable (`--no-pin`), alternating."),
    Bench("Transports with idle CPUs held awake", "bench_transport_awake", ("bench_transport_awake",),
          "`bench/bench_transport.py --cpu-latency-us 0`: `/dev/cpu_dma_latency` held at 0 (`bench/pm_qos.py`)."),
    Bench("The host's gRPC floor", "bench_rpc_floor", ("bench_rpc_floor",),
          "`bench/bench_rpc_floor.py`: an empty unary / streaming call, sync and asyncio, on the GPU machine's "
          "host."),
    Bench("The host's gRPC floor, idle CPUs held awake", "bench_rpc_floor_awake", ("bench_rpc_floor_awake",),
          "`bench/bench_rpc_floor.py --cpu-latency-us 0`."),
    Bench("Inline request parse", "bench_inline_parse", ("bench_inline_parse",),
          "`bench/bench_inline_parse.py`: the server's parse of an inline request (protobuf's copies against the "
          "inline views, `server/ctxprefill/service/inline_views.py`) on the GPU machine's host."),
    Bench("Head-sharded workers", "bench_sharded", ("bench_sharded",),
          "`bench/bench_sharded.py --num-shards 2`: one server with every head against two workers with half the "
          "heads each (one GPU each), the answer merged by the client.",
          note=" on a machine with two GPUs (`SHARDED_CONCURRENCY` sets the clients)"),
    Bench("Cost against context length", "bench_engine_scaling", ("bench_engine_scaling",),
          "`ctxprefill bench --context 8192 … 1048576`: 1,024 new tokens over 8k to 1M context, 16 and 128 heads, "
          "bf16 and fp8 prefill, plotted on log axes; the growth per context token fitted below.",
          plots=("engine_latency.png",)),
    Bench("Cost against new tokens", "bench_engine_new", ("bench_engine_new",),
          "`ctxprefill bench --new 128 1024 4096 16384`: 128 to 16k new tokens over 64k context, 16 and 128 heads, "
          "plotted on log axes.", plots=("engine_latency_new.png",)),
    Bench("A DeepSeek-V3 model's chunked prefill over CUDA IPC", "bench_model_prefill",
          ("bench_model_prefill", "bench_model_prefill_fp32"),
          "`bench/bench_model_prefill.py`: a random transformers DeepSeek-V3 model (4 layers, 16 heads) prefills "
          "an 8,192-token prompt in 1,024-token chunks, every layer's context attention from a `serve --model` "
          "server through one registered CUDA region (`DeepseekV3ChunkedPrefill(transport=\"cuda\")`), and "
          "inline for comparison; each chunk's time split into local and remote work; every layer's attention "
          "output and the logits against transformers' forward of the whole prompt; the model in bf16, then the same "
          "weights computing in float32 (`--dtype float32 --transports cuda`), which takes the model's own bf16 "
          "rounding out of the comparison."),
    Bench("A DeepSeek-V3-shaped model's prefill through the request ring", "bench_model_workload",
          ("bench_model_workload", "bench_model_workload_graphs"),
          "`bench/bench_model_workload.py --prefill-dtype bf16 fp8`: 61 layers at 128 and at 16 heads, bf16 and fp8 "
          "prefill (a server each), 8,192 new tokens in 1,024-token chunks "
          "over a context growing to 128k, every layer's call through a CUDA IPC request ring as an engine issues "
          "them (its cache_write writing the chunk's latents), against the sum of the calls' floors; each answer "
          "awaited with its work done (host order), then through a stream-ordered ring on the same server (stream "
          "order); the last chunk's answers checked against float64; then the same served with `--cuda-graphs` "
          "(bf16 and fp8). "
          "Per call: where its time goes — the device's stages, the server's host phases, the hand-offs."),
    Bench("The same prefill with and without CUDA MPS", "bench_model_workload_mps", ("bench_model_workload_mps",),
          "`bench/bench_model_workload.py --heads 16 128 --prefill-dtype bf16 --mps-ab 2`: the bf16 workload "
          "above at 16 and 128 heads, in turn without and with the caller and the server as clients of one CUDA MPS "
          "daemon (their work in one GPU context instead of two time-sliced ones), two rounds, each run a process "
          "of its own."),
)


def files() -> list[str]:
    """The JSON files (names without .json) the steps of scripts/gpu_run.sh write for bench/results."""
    return [f for b in BENCHMARKS for f in b.files]


def load(name: str, results: str = RESULTS) -> Doc:
    with open(os.path.join(results, f"{name}.json")) as fh:
        d: Doc = json.load(fh)
    return d


def _steps_cmd(b: Bench) -> str:
    return f"`{b.env + ' ' if b.env else ''}GPU_RUN_STEPS={b.step} bash scripts/gpu_run.sh`{b.note}"


def _anchor(title: str) -> str:
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def results_readme(results: str = RESULTS) -> str:
    """bench/results/README.md, from the JSON files beside it."""
    docs = {f: load(f, results) for f in files()}
    out = ["# Benchmark results", "",
           "One run per benchmark, the JSON each benchmark wrote beside this file; every table names its GPU, date "
           "and commit. Runs come from an H200 or an H100 (both sm_90a), so a figure is compared only with "
           "others of its own run, where its baseline ran beside it. "
           "This file is generated: `python bench/make_tables.py` (and `--check` fails where it "
           "differs from the JSON).", "",
           "To measure again, on the GPU machine from the repository root:", "",
           "    CTXPREFILL_COMMIT=$(git rev-parse --short HEAD) GPU_RUN_STEPS=\"bench_engine bench_transport\" "
           "bash scripts/gpu_run.sh", "",
           "Each step writes `$OUT/<file>.json` (`$OUT` defaults to `./.out`) under the name it has here: copy the "
           "files over these, then run `python bench/make_tables.py`, `python bench/make_tables.py --readme "
           "README.md` and, for the plots, `python bench/plot_engine.py bench/results/bench_engine.json "
           "bench/results/bench_concurrency_ring.json --only engine_stages.png concurrency.png` and `python "
           "bench/plot_engine.py bench/results/bench_engine_scaling.json bench/results/bench_engine_new.json --only "
           "engine_latency.png engine_latency_new.png` (the files share plot names: each command keeps the ones "
           "listed below).", "",
           "| benchmark | file | step | GPU | date | commit |", "|---|---|---|---|---|---|"]
    for b in BENCHMARKS:
        for f in b.files:
            r = run_of(docs[f])
            out.append(f"| [{b.title}](#{_anchor(b.title)}) | [`{f}.json`]({f}.json) | `{b.step}` | {r['gpu']} "
                       f"| {r['date']} | {r['commit']} |")
    for b in BENCHMARKS:
        out += ["", f"## {b.title}", "", f"{b.what} Reproduce: {_steps_cmd(b)}.", ""]
        for p in b.plots:
            out += [f"![{p}]({p})", ""]
        for f in b.files:
            if len(b.files) > 1:
                out += [f"`{f}.json`:", ""]
            out += [table(docs[f]).rstrip("\n"), ""]
        out.pop()
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------ the README block


def _row(records: list[dict], **kv: Any) -> dict:
    """The one record with these fields."""
    (r,) = [r for r in records if all(r.get(k) == v for k, v in kv.items())]
    return r


def _ahead_of_flashinfer(d: Doc) -> str:
    """The README's attention row's tail: ours over FlashInfer's FA3 (bf16), the interleaved
    rounds' median ratios, per head count over the shapes (empty where they did not run)."""
    got: dict[int, list[float]] = collections.defaultdict(list)
    rounds = _flashinfer_rounds(d)
    for r in rounds:
        got[r["H"]].append(r["ratio_median"])
    if not got:
        return ""
    tail = ""
    if all(r.get("tflops_gemm") for r in rounds):  # the GEMM timed in the same rounds: the target against it
        gemm = [statistics.median(r["tflops_gemm"]) for r in rounds]
        need = [_need_over_gemm(r) for r in rounds]
        tail = (f"; an {rounds[0]['gemm_n']}³ GEMM in the same rounds {min(gemm):.1f}–{max(gemm):.1f}, "
                f"{AHEAD_OF_FLASHINFER} × FA3 {min(need):.3f}–{max(need):.3f} of it")
    return "; ours / FlashInfer FA3 in interleaved rounds (bf16, median per shape), " + ", ".join(
        f"{h} heads {min(v):.3f}–{max(v):.3f}" for h, v in sorted(got.items())) + tail


def headline_rows(results: str = RESULTS) -> list[tuple[str, str, str]]:
    """(measure, result, file) for the README block: every figure in ``result`` is a field of the file
    (seconds shown as ms)."""
    rows: list[tuple[str, str, str]] = []
    eng = load("bench_engine", results)["rows"]
    for h in (16, 128):
        cells = []
        for pd in ("bf16", "fp8"):
            r = _row(eng, heads=h, new=1024, context=65536, cache_dtype="auto", prefill_dtype=pd)
            cells.append(f"{pd}: fused {_ms(r['fused_s'])} ms, generic {_ms(r['generic_s'])} ms "
                         f"({r['speedup']:.2f}×), "
                         + (f"fused as a CUDA graph {_ms(r['fused_graph_s'])} ms, " if "fused_graph_s" in r else "")
                         + f"floor {_ms(r['floor_s'])} ms")
        # the issue's bar: every cache and prefill dtype as a CUDA graph against its floor
        every = _graph_rows(eng, h)
        what = ""
        if every:
            cells.append(f"every cache and prefill dtype as a CUDA graph {_graph_floor_range(every)}")
            what = f"; the {len(every)} cache × prefill dtypes as CUDA graphs against their floors"
        rows.append((f"Whole request, {h} heads, bf16 and fp8 prefill, 1,024 new over 64k{what}", "; ".join(cells),
                     "bench_engine"))
    rows.append(_engine_graph_row("bench_engine_h200", results))
    for name, where in (("probe_host", ""), ("probe_host_quiet", ", a second machine of the kind")):
        probe = load(name, results)
        host = [r for r in probe["rows"] if "graph_host_steps_us" in r]
        if not host:
            continue
        # the call to the replay's first device copy: the median over the interleaved in-place
        # rounds where the probe recorded it there, else its first pass
        in_rounds = all("in_place_first_copy_us" in r["replay_launch_rounds"] for r in host)
        first_us = [statistics.median(r["replay_launch_rounds"]["in_place_first_copy_us"]) if in_rounds
                    else r["graph_host_steps_us"]["first copy"] for r in host]
        waits = [r.get("validate_after_wait_us") for r in host]
        rows.append((f"Host time of a request{where}, 1,024 new over 64k, " + " / ".join(
                         f"H={r['heads']} {r['prefill_dtype']}" for r in host)
                     + ": outside the stages, eager → as a CUDA graph (ms); the call to its first device copy, "
                       + ("as a CUDA graph (µs" if _first_copy_queued(probe) else
                          "as a CUDA graph (µs; at most: the call that queues the copies also launches the graph")
                       + ("; median of the interleaved rounds in place)" if in_rounds else ")"),
                     " / ".join(f"{_ms(r['fused_outside_s'], '.3f')} → {_ms(r['graph_outside_s'], '.3f')}"
                                for r in host) + "; "
                     + " / ".join(f"{us:.0f}" for us in first_us)
                     + _in_place_rounds(host)
                     + ("; one validation in a loop against right after a 12 ms wait for the device (µs): "
                        + " / ".join(f"{w['hot']:.1f} against {w['12 ms']:.1f}" for w in waits)
                        if all(waits) else ""), name))
    ad = load("bench_attention", results)
    att = [r for r in ad["results"] if r.get("case") == "1x8192q/16384k" and not r.get("causal") and "tflops" in r]

    def tf(provider: str, h: int, dtype: str = "bf16") -> str:
        return f"{_row(att, provider=provider, H=h, dtype=dtype)['tflops']:.1f}"

    fi = ad["meta"].get("flashinfer") or ""
    rows.append(("Attention, 8,192 q over 16k keys, 16 / 128 heads (TFLOP/s): bf16; fp8 (V keys-last); against "
                 "FlashInfer on 1×8192, 4×1024, 1×1024 q and a ragged batch over 16k keys",
                 f"ours {tf('triton', 16)} / {tf('triton', 128)}, FlashInfer {fi} FA3 {tf('flashinfer fa3', 16)} / "
                 f"{tf('flashinfer fa3', 128)}; ours {tf('triton pv_fp8 v-keys-last', 16, 'fp8')} / "
                 f"{tf('triton pv_fp8 v-keys-last', 128, 'fp8')}" + _ahead_of_flashinfer(ad), "bench_attention"))
    rows += [_cost_row("bench_engine_scaling", "context", results), _cost_row("bench_engine_new", "new", results)]
    k = load("bench_kernels", results)
    kr = k["results"]

    def pct(**kv: Any) -> str:
        return f"{_row(kr, **kv)['pct_copy']:.1f} %"

    rows.append(("Kernels, % of copy bandwidth: pack bf16 / fp8 (128 heads, 32,768 tokens), gather fp8→bf16 "
                 "(262,144 rows), merge (16 heads, 65,536 tokens)",
                 f"{pct(op='pack', variant='fused bf16', H=128, T=32768)} / "
                 f"{pct(op='pack', variant='fused fp8 v-keys-last 4 segs', H=128, T=32768)}, "
                 f"{pct(op='gather', variant='kernel fp8->bf16', rows=262144)}, "
                 f"{pct(op='merge', variant='kernel', H=16, T=65536)} of {k['copy_tbps']:.2f} TB/s",
                 "bench_kernels"))
    t = load("bench_transport", results)
    ring, call = t["modes"]["cuda-ring"], t["modes"]["cuda"]
    rows.append(("CUDA IPC request ring against the in-process engine (4,096 new over 64k, 16 heads)",
                 f"{_ms(ring['total_s'], '.3f')} ms against {_ms(t['engine']['median_s'], '.3f')} ms: "
                 f"{ring['ratio_to_engine']:.3f}× (a call each: {call['ratio_to_engine']:.3f}×)", "bench_transport"))
    c = load("bench_concurrency_ring", results)["rows"]
    top = max(r["clients"] for r in c)
    rows.append((f"Request rings, {top} clients, 1,024 new over 64k, 16 / 128 heads (req/s)",
                 f"{_row(c, heads=16, clients=top)['requests_per_s']:.1f} / "
                 f"{_row(c, heads=128, clients=top)['requests_per_s']:.1f}", "bench_concurrency_ring"))
    wl = load("bench_model_workload", results)
    a = wl["meta"]["args"]
    heads = sorted({r["heads"] for r in wl["runs"]}, reverse=True)
    parts = []
    for prefill, order in [(p, o) for p in sorted({_prefill(r) for r in wl["runs"]}) for o in ("stream", "host")]:
        runs = sorted((r for r in wl["runs"] if r.get("order", "host") == order and _prefill(r) == prefill),
                      key=lambda r: -r["heads"])
        if runs:
            parts.append(f"{prefill} prefill, {order} order: wall "
                         + " / ".join(f"{r['wall_s']:.2f}" for r in runs) + " s, "
                         + " / ".join(f"{r['ratio']:.2f}×" for r in runs) + " the floor sums ("
                         + " / ".join(f"{r['floor_s']:.2f}" for r in runs) + " s), "
                         + " / ".join(f"{r['ratio_held']:.2f}×" for r in runs) + " the held floor, "
                         + " / ".join(f"{r['context_tokens_per_s'] / 1e6:.2f}" for r in runs)
                         + " M context tokens/s against the floor's "
                         + " / ".join(f"{r['floor_context_tokens_per_s'] / 1e6:.2f}" for r in runs))
    rows.append((f"A DeepSeek-V3-shaped prefill through the CUDA IPC request ring: {wl['runs'][0]['layers']} layers, "
                 f"{a['new']:,} new tokens in {a['chunk']:,}-token chunks up to 128k context, "
                 + " / ".join(str(h) for h in heads) + " heads",
                 "; ".join(parts), "bench_model_workload"))
    ab = load("bench_model_workload_mps", results)
    ab_heads = sorted({r["heads"] for r in ab["runs"]})

    def both(runs: list[dict], fmt: str) -> str:  # the rounds without → with MPS
        return " → ".join(" / ".join(fmt.format(r) for r in runs if bool(r["mps"]) is on) for on in (False, True))

    mps_parts = []
    for h in ab_heads:
        for order in ("stream", "host"):
            runs = [r for r in ab["runs"] if r["heads"] == h and r.get("order", "host") == order]
            if {bool(r["mps"]) for r in runs} == {False, True}:
                mps_parts.append(f"{h} heads, {order} order: wall {both(runs, '{0[wall_s]:.3f}')} s, "
                                 f"{both(runs, '{0[ratio]:.2f}×')} the floor sums")
    first = ab["runs"][0]
    rows.append((f"The same prefill at {' / '.join(map(str, ab_heads))} heads, {_prefill(first)} prefill, without → "
                 f"with the caller and the server under one CUDA MPS daemon (alternating, "
                 f"{ab['meta']['args']['mps_ab']} rounds each)", "; ".join(mps_parts), "bench_model_workload_mps"))
    mp = load("bench_model_prefill_fp32", results)
    m, cuda = mp["meta"]["model"], mp["transports"]["cuda"]
    rows.append((f"A transformers DeepSeek-V3 model ({m['layers']} layers, {m['heads']} heads, computing in "
                 f"{m['dtype']}) prefilling {mp['meta']['prompt_tokens']:,} tokens in "
                 f"{mp['meta']['chunk_tokens']:,}-token chunks, context attention from ctxprefill through CUDA IPC",
                 f"every layer's attention within {cuda['max_attention_error']:.4f} of its monolithic forward, "
                 f"logits {cuda['errors']['logits']:.4f}; remote {cuda['totals']['remote_ms']:.0f} ms, local "
                 f"{cuda['totals']['local_ms']:.0f} ms", "bench_model_prefill_fp32"))
    return rows


def _engine_graph_row(name: str, results: str) -> tuple[str, str, str]:
    """A README row of a second ``ctxprefill bench`` headline run: per head count, the bf16
    request as a CUDA graph, its floor, every cache and prefill dtype's graph against its floor,
    and the host's time outside the replay."""
    d = load(name, results)
    cells, dtypes = [], set()
    for h in (16, 128):
        every = _graph_rows(d["rows"], h)
        if not every:
            continue
        r = _row(every, cache_dtype="auto", prefill_dtype="bf16")
        outside = [x["fused_graph_outside_s"] for x in every]
        dtypes |= {(x["cache_dtype"], x["prefill_dtype"]) for x in every}
        cells.append(f"{h} heads: bf16 as a CUDA graph {_ms(r['fused_graph_s'])} ms, floor {_ms(r['floor_s'])} ms; "
                     f"every cache and prefill dtype {_graph_floor_range(every)}"
                     + f", the host outside the replay {_ms(min(outside), '.3f')}–{_ms(max(outside), '.3f')} ms")
    return (f"Whole request on {run_of(d)['gpu']}, 16 / 128 heads, 1,024 new over 64k: the {len(dtypes)} cache × "
            "prefill dtypes as CUDA graphs against their floors", "; ".join(cells), name)


def _graph_rows(rows: list[dict], heads: int) -> list[dict]:
    """The headline shape's rows (1,024 new over 64k) at ``heads`` that have a CUDA graph's
    ratio to the floor: one per cache and prefill dtype."""
    return [r for r in rows if r["heads"] == heads and r["new"] == 1024 and r["context"] == 65536
            and r.get("fused_graph_over_floor") is not None]


def _graph_floor_range(rows: list[dict]) -> str:
    """ "a–b× the floor" over ``rows``' CUDA graphs, with the held GEMM rate's range where known."""
    g = [r["fused_graph_over_floor"] for r in rows]
    return f"{min(g):.2f}–{max(g):.2f}× the floor" + _held_range(rows)


def _held_range(rows: list[dict]) -> str:
    """ ", a–b× at the held GEMM rate" where every row has its graph's ratio to the held floor."""
    held = [r.get("fused_graph_over_sustained_floor") for r in rows]
    return "" if None in held else f" ({min(held):.2f}–{max(held):.2f}× at the held GEMM rate)"


def _cost_row(name: str, axis: str, results: str) -> tuple[str, str, str]:
    """A README row of a ``ctxprefill bench`` grid along ``axis`` (context or new tokens):
    per head count and prefill dtype (cache dtype auto), the fused request and its floor at
    the axis' ends, and along context the fitted growth per token where the run recorded it."""
    d = load(name, results)
    rows = [r for r in d["rows"] if "fused_s" in r and r["cache_dtype"] == "auto"]
    keys = sorted({(r["heads"], r["prefill_dtype"]) for r in rows})
    xs = sorted({r[axis] for r in rows})
    other = growth.AXES[axis]
    held = ", ".join(tokens_label(n, other) for n in sorted({r[other] for r in rows}))
    where = (f"{tokens_label(xs[0], axis)} → {tokens_label(xs[-1], axis)} "
             + (f"context ({len(xs)} lengths), {held} new" if axis == "context" else
                f"new tokens ({len(xs)} counts) over {held} context"))
    fitted = {(g["heads"], g["prefill_dtype"]): g for g in d.get("growth", []) if g["axis"] == axis
              and g["cache_dtype"] == "auto"}
    cells = []
    for h, pd in keys:
        ends = [_row(rows, heads=h, prefill_dtype=pd, **{axis: x}) for x in (xs[0], xs[-1])]
        cell = (f"{_ms(ends[0]['fused_s'])} → {_ms(ends[1]['fused_s'])} against {_ms(ends[0]['floor_s'])} → "
                f"{_ms(ends[1]['floor_s'])}")
        g = fitted.get((h, pd))
        if g is not None:
            nb = g["fused_neighbour_ns_per_token"]
            cell += (f", {g['fused_ns_per_token']:.2f} against {g['floor_ns_per_token']:.2f} ns a token "
                     f"({min(nb):.2f}–{max(nb):.2f} between neighbours)")
        cells.append(cell)
    what = ("fused and floor ms at the ends" + (", fitted growth per context token and its range between "
                                                "neighbouring lengths" if fitted else "")
            + " (ctxprefill bench; the fit and the plot: bench/results)" if axis == "context" else
            "fused and floor ms at the ends (the plot: bench/results)")
    return (f"Cost against work, {where}, " + " / ".join(f"H={h} {pd}" for h, pd in keys) + f": {what}",
            " / ".join(cells), name)


def readme_block(readme_dir: str, results: str = RESULTS) -> str:
    """The lines between the markers (exclusive), links relative to ``readme_dir``."""
    rel = os.path.relpath(results, readme_dir).replace(os.sep, "/")
    out = ["| measured | result | GPU | date | commit | data |", "|---|---|---|---|---|---|"]
    for measure, result, f in headline_rows(results):
        r = run_of(load(f, results))
        out.append(f"| {measure} | {result} | {r['gpu']} | {r['date']} | {r['commit']} "
                   f"| [`{f}.json`]({rel}/{f}.json) |")
    return "\n".join(out) + "\n"


def replace_block(text: str, block: str) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"expected one {BEGIN} line followed by one {END} line")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="*", help="print the table of these files instead")
    ap.add_argument("--results", default=RESULTS, help="the results folder (default: bench/results)")
    ap.add_argument("--readme", default=None,
                    help="rewrite the block between the results markers of this README (and nothing else)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 where bench/results/README.md or the README's block (--readme, "
                         "default the top-level README.md) differs from the JSON")
    ns = ap.parse_args(argv)
    if ns.json:
        for p in ns.json:
            with open(p) as fh:
                sys.stdout.write(f"<!-- {p} -->\n" + table(json.load(fh)) + "\n")
        return 0
    targets: list[tuple[str, str, str, str]] = []  # path, text, text made from the JSON, command that makes it
    if not ns.readme or ns.check:
        path = os.path.join(ns.results, "README.md")
        old = ""
        if os.path.exists(path):
            with open(path) as fh:
                old = fh.read()
        targets.append((path, old, results_readme(ns.results), "python bench/make_tables.py"))
    readme = ns.readme or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    if ns.readme or ns.check:
        with open(readme) as fh:
            text = fh.read()
        if ns.readme or BEGIN in text:
            new = replace_block(text, readme_block(os.path.dirname(os.path.abspath(readme)), ns.results))
            targets.append((readme, text, new, f"python bench/make_tables.py --readme {readme}"))
    stale = [(p, cmd) for p, old, new, cmd in targets if old != new]
    if ns.check:
        for p, cmd in stale:
            print(f"make_tables: {p} differs from the JSON in {ns.results}: run {cmd}", file=sys.stderr)
        return 1 if stale else 0
    for p, old, new, _ in targets:
        if old != new:
            with open(p, "w") as fh:
                fh.write(new)
        print(f"{p}: {'written' if old != new else 'unchanged'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
