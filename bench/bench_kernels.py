#!/usr/bin/env python3
"""The fused CUDA kernels against their generic / torch forms, on the GPU, in one process.

  python bench/bench_kernels.py --out bench/results/bench_kernels.json

Measured, in this order, in the same process:
- device-to-device copy bandwidth: a 2 GiB bf16 copy, bytes read + written — the
  ceiling every other number is a percentage of;
- pack: fused (one kernel) vs generic (torch.cat of the strided views; for fp8 the
  saturating casts after it), bf16 and fp8, H=16 T in {2048, 8192, 65536}, H=128 T
  in {2048, 8192, 32768}, on the strided halves of a real kv_b_proj output
  ([k_nope | v] per head) and the k_pe view of a workspace. (A layout with every
  head's k_nope rows first, so that a token's k_nope is one dense span, was measured
  on 2026-11-29: no difference, 84.5 % either way for bf16);
- gather, every cache dtype / out dtype: the kernel vs ``gather_reference``; and the
  engine's 16k-row chunk (bf16 cache) after a read flush and after a write flush ("L2
  dirty"): what the write-back of dirty lines costs a gather that follows kernels that wrote;
- merge (in place, strided out / LSE): the kernel vs ``merge_reference``.

Time: median of CUDA-event timings after warm-up, with the L2 cache flushed before
every repetition by a 256 MB *read* (``triton.testing.do_bench`` zeroes a buffer
instead, which leaves the L2 full of dirty lines that are written back during the
measured kernel: up to 50 MB of extra traffic, a third of a 150 MB gather).
Each row also gives ``pct_same_size_copy``: against a torch copy of the same bytes
(half read, half written), measured the same way — what a plain copy reaches at
that size, launch and tail included.
Each row's ``pct_mix_roofline`` ("% mix") is against a plain streaming copy that writes
as many bytes per byte read as the kernel does (``bench/mix_copy.py``, scaled so that the
1:1 copy gives torch's): the memory's ceiling for that mix, which a 50/50 copy does not
give.
Effective bandwidth counts every input read once and every output written once.
Targets (CONTRACT §6): the fused pack >= 90 % of the copy bandwidth for T·H >= 2**20
(the V keys-last fp8 pack included: the engine runs it for fp8 prefill on Hopper);
gather and merge >= 85 % at the same scale — gathers of >= 2**18 rows, merges of
T·H >= 2**20 — where a copy of the same bytes reaches the copy bandwidth (docs/DESIGN.md,
"Where the bandwidth targets apply"). Smaller rows are reported ("% same" beside them)
and are not targets. Results go to stdout as a table and to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("server", "client", "bench"):
    if os.path.join(ROOT, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _sub))

import torch  # noqa: E402

from ctxprefill_bench import run_info  # noqa: E402

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
_flush = None


def target_pct(row: dict) -> float | None:
    """The % of copy bandwidth a result row is held to, or None (not a target)."""
    if row["op"] == "pack":
        fused = row["variant"] in ("fused bf16", "fused fp8") or row["variant"].startswith("fused fp8 v-keys-last")
        return 90.0 if fused and row["H"] * row["T"] >= 2**20 else None
    if row["op"] == "gather" and row["variant"].startswith("kernel"):
        return 85.0 if row["rows"] >= 2**18 else None
    if row["op"] == "merge" and row["variant"].startswith("kernel"):
        return 85.0 if row["H"] * row["T"] >= 2**20 else None
    return None


def do_bench(fn, rep_ms: float = 60.0, warmup_ms: float = 15.0, flush: bool = True, dirty: bool = False) -> float:
    """Median milliseconds of ``fn`` on the current stream. ``dirty``: the flush writes its
    256 MB instead (the L2 left full of dirty lines, as after a kernel that wrote)."""
    global _flush
    if flush and _flush is None:
        _flush = torch.ones(64 << 20, dtype=torch.int32, device="cuda")  # 256 MB
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(3):
        fn()
    e.record()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e) / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(5, min(500, int(rep_ms / est)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        if flush:
            # evict the L2 by READING 256 MB: the L2 (50 MB) is left holding clean lines.
            # A write flush (``dirty``) leaves up to 50 MB of dirty lines whose write-back
            # then lands inside the measured kernel's time.
            if dirty:
                _flush.fill_(1)
            else:
                _flush.max()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends))


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "bench_kernels.json"),
                    help="JSON results path")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device", file=sys.stderr)
        return 2
    from ctxprefill.ops import _cuda
    from ctxprefill.ops.gather import gather_reference
    from ctxprefill.ops.insert import insert_reference
    from ctxprefill.ops.merge import merge_reference
    from ctxprefill.ops.pack import generic_kv_concat, generic_kv_concat_quant_fp8
    from ctxprefill.ops.slot_format import bytes_per_slot

    ext = _cuda.load()
    if ext is None:
        print(f"bench_kernels: the CUDA extension did not load: {_cuda.why_not()}", file=sys.stderr)
        return 1
    rep = 25.0 if args.quick else 60.0
    t_start = time.time()
    dev = "cuda"
    results: list[dict] = []

    # ---- the ceiling -------------------------------------------------------------------
    x = torch.empty(1 << 30, dtype=BF16, device=dev)  # 2 GiB
    x.fill_(1.0)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), rep_ms=max(rep, 100), flush=False)
    copy_tbps = 2 * x.numel() * 2 / ms / 1e9
    # HBM's bus is shared by reads and writes: a kernel's ceiling depends on how many bytes
    # it writes per byte read (the bf16 pack 1.5, the fp8 pack 0.625, the merge 0.5, the
    # dequantizing gathers 1.75-2). Plain Triton streaming copies at those mixes
    # (bench/mix_copy.py), scaled so that the 1:1 one gives torch's copy, are each kernel's
    # "% mix" ceiling. Without Triton, the old model: t = R/read-only + W/write-only (fill).
    write_tbps = x.numel() * 2 / do_bench(lambda: y.fill_(0), rep_ms=max(rep, 100), flush=False) / 1e9
    xi = x.view(torch.int32)
    read_tbps = x.numel() * 2 / do_bench(lambda: xi.max(), rep_ms=max(rep, 100), flush=False) / 1e9
    model_copy = 2 / (1 / read_tbps + 1 / write_tbps)
    x = y = xi = None  # freed (not del: the timed lambdas name them)
    torch.cuda.empty_cache()
    print(f"device-to-device copy: {copy_tbps:.3f} TB/s (2 GiB bf16, read + write, {ms:.3f} ms); "
          f"write-only (fill) {write_tbps:.3f} TB/s, read-only (max) {read_tbps:.3f} TB/s; "
          f"the no-overlap model predicts the copy at {model_copy:.3f} TB/s")
    mix_table = {}
    try:
        import mix_copy

        if mix_copy.triton is None:
            raise ImportError("triton is not importable")
        mc = mix_copy.MixCopy(1 << 29, dev)  # 1 GiB read
        for w in mix_copy.RATIOS:
            run, moved = mc.runner(w)
            mix_table[w] = moved / do_bench(run, rep_ms=max(rep, 100), flush=False) / 1e9
        mc = run = None  # freed (not del: the timed lambdas name them)
        torch.cuda.empty_cache()
        print("plain streaming copies, TB/s by bytes written per byte read: "
              + ", ".join(f"{w:g}: {t:.3f} ({100 * t / copy_tbps:.1f} % of copy)" for w, t in mix_table.items()))
    except Exception as e:  # noqa: BLE001 - the model below stands in
        print(f"mixed-ratio copies not measured ({type(e).__name__}: {e}); '% mix' uses the read/write model")

    def mix_tbps(rd, wr):
        """The ceiling for a kernel reading rd and writing wr bytes: the plain copy of that
        mix (interpolated), scaled to torch's copy at 1:1; or the no-overlap model."""
        if mix_table:
            return mix_copy.ceiling(mix_table, wr / max(rd, 1)) * copy_tbps / mix_table[1.0]
        return (rd + wr) / (rd / read_tbps + wr / write_tbps) * copy_tbps / model_copy

    def add(op, variant, ms, rw, equal=None, **shape):
        rd, wr = rw
        nbytes = rd + wr
        tbps = nbytes / ms / 1e9
        r = dict(op=op, variant=variant, ms=round(ms, 5), bytes=int(nbytes), read_bytes=int(rd), write_bytes=int(wr),
                 tbps=round(tbps, 4), pct_copy=round(100 * tbps / copy_tbps, 1),
                 pct_mix_roofline=round(100 * tbps / mix_tbps(rd, wr), 1), **shape)
        if equal is not None:
            r["bit_equal_to_reference"] = bool(equal)
        results.append(r)
        return r

    # ---- pack ------------------------------------------------------------------------
    for H, Ts in ((16, (2048, 8192, 65536)), (128, (2048, 8192, 32768))):
        w = (torch.randn((H * 256, 512), device=dev) / math.sqrt(512)).to(BF16)
        for T in Ts:
            c = torch.randn((T, 512), device=dev).to(BF16)
            kv = (c @ w.t()).view(T, H, 256)
            k_nope, v = kv[..., :128], kv[..., 128:]
            ws = torch.randn((T, 576), device=dev).to(BF16)
            k_pe = ws[:, 512:]
            rd_bf16 = T * H * 128 * 2 + T * 64 * 2
            wr_bf16 = T * H * 192 * 2
            rd_fp8 = T * H * 256 * 2 + T * 64 * 2
            wr_fp8 = T * H * (192 + 128)
            eq = torch.equal(bits(ext.fused_mla_kv_concat(k_nope, k_pe)), bits(generic_kv_concat(k_nope, k_pe)))
            f = add("pack", "fused bf16", do_bench(lambda: ext.fused_mla_kv_concat(k_nope, k_pe), rep),
                    (rd_bf16, wr_bf16), eq, H=H, T=T)
            g = add("pack", "generic bf16", do_bench(lambda: generic_kv_concat(k_nope, k_pe), rep),
                    (rd_bf16, wr_bf16), H=H, T=T)
            f["speedup_vs_generic"] = round(g["ms"] / f["ms"], 2)
            a, b = ext.fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v), generic_kv_concat_quant_fp8(k_nope, k_pe, v)
            eq = torch.equal(bits(a[0]), bits(b[0])) and torch.equal(bits(a[1]), bits(b[1]))
            f = add("pack", "fused fp8", do_bench(lambda: ext.fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v), rep),
                    (rd_fp8, wr_fp8), eq, H=H, T=T)
            g = add("pack", "generic fp8", do_bench(lambda: generic_kv_concat_quant_fp8(k_nope, k_pe, v), rep),
                    (rd_fp8, wr_fp8), H=H, T=T)
            f["speedup_vs_generic"] = round(g["ms"] / f["ms"], 2)
            # V keys-last (what the engine's fp8 pack writes for the Triton attention): one
            # segment, and four ragged ones (each from a 16-aligned column)
            from ctxprefill.ops.pack import keys_last_layout

            for segs, cu in (("1 seg", [0, T]), ("4 segs", [0, T // 4 + 3, T // 2 + 1, 3 * T // 4 + 7, T])):
                lay = keys_last_layout(cu, dev)
                run = lambda: ext.fused_mla_kv_concat_quant_fp8_vt(k_nope, k_pe, v, lay.cu_k_dev, lay.cu_v_dev,
                                                                   lay.v_cols)
                a = run()
                b = generic_kv_concat_quant_fp8(k_nope, k_pe, v, v_keys_last=lay)
                eq = torch.equal(bits(a[0]), bits(b[0])) and torch.equal(bits(a[1]), bits(b[1]))
                wr = T * H * 192 + H * 128 * lay.v_cols
                f = add("pack", f"fused fp8 v-keys-last {segs}", do_bench(run, rep), (rd_fp8, wr), eq, H=H, T=T)
                g = add("pack", f"generic fp8 v-keys-last {segs}",
                        do_bench(lambda: generic_kv_concat_quant_fp8(k_nope, k_pe, v, v_keys_last=lay), rep),
                        (rd_fp8, wr), H=H, T=T)
                f["speedup_vs_generic"] = round(g["ms"] / f["ms"], 2)
            c = kv = k_nope = v = ws = k_pe = a = b = None  # freed (not del: the timed lambdas name them)
        torch.cuda.empty_cache()

    # ---- gather ----------------------------------------------------------------------
    bs = 64
    # a 64k workspace; a whole 256k context; and the engine's 16k-row chunk after a clean and
    # after a dirty L2 (the engine's gather follows kernels that wrote: kv_b_proj, attention)
    cases = [(rows, cd_od, False) for rows, cd_od in itertools.product(
        (65536, 262144), (("auto", BF16), ("fp8", BF16), ("fp8", FP8), ("fp8_ds_mla", BF16)))]
    cases += [(16384, ("auto", BF16), False), (16384, ("auto", BF16), True)]
    for rows, (cd, od), dirty in cases:
        lens = [rows - 3 * 4096, 4096, 4096, 4096]
        nblocks = rows // bs + 16
        cache = torch.zeros((nblocks * bs, bytes_per_slot(cd)), dtype=torch.uint8, device=dev)
        insert_reference(cache, torch.randn((nblocks * bs, 512), device=dev),
                         torch.randn((nblocks * bs, 64), device=dev),
                         torch.arange(nblocks * bs, device=dev), cd, 1.0)
        perm = torch.randperm(nblocks, device=dev).to(torch.int32)
        maxb = max(math.ceil(n / bs) for n in lens)
        bt = torch.stack([perm[(i * 97) % (nblocks - maxb):][:maxb] for i in range(len(lens))])
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)
        st = torch.zeros(len(lens), dtype=torch.int32, device=dev)
        out = torch.empty((rows, 576), dtype=od, device=dev)
        ref = torch.empty_like(out)
        ext.gather(cache, bt, cu, st, out, cd, 1.0, bs)
        gather_reference(cache, bt, cu, st, ref, cd, 1.0, bs)
        eq = torch.equal(bits(out), bits(ref))
        nbytes = (rows * bytes_per_slot(cd), rows * 576 * od.itemsize)
        name = f"{cd}->{'fp8' if od == FP8 else 'bf16'}" + (", L2 dirty" if dirty else "")
        f = add("gather", f"kernel {name}",
                do_bench(lambda: ext.gather(cache, bt, cu, st, out, cd, 1.0, bs), rep, dirty=dirty),
                nbytes, eq, rows=rows, block_size=bs)
        g = add("gather", f"torch {name}",
                do_bench(lambda: gather_reference(cache, bt, cu, st, ref, cd, 1.0, bs), rep, dirty=dirty), nbytes,
                rows=rows, block_size=bs)
        f["speedup_vs_torch"] = round(g["ms"] / f["ms"], 2)
        cache = out = ref = None  # freed (not del: the timed lambdas name them)
    torch.cuda.empty_cache()

    # ---- merge -----------------------------------------------------------------------
    for H, T in ((16, 8192), (16, 65536), (128, 8192)):
        out = torch.randn((T, H, 128), device=dev).to(BF16)
        lse = torch.randn((H, T), device=dev)
        part = torch.randn((T, H, 128), device=dev).to(BF16)
        plse = torch.randn((H, T), device=dev)
        o1, l1, o2, l2 = out.clone(), lse.clone(), out.clone(), lse.clone()
        ext.merge(o1, l1, part, plse)
        merge_reference(o2, l2, part, plse)
        eq = torch.equal(bits(o1), bits(o2)) and torch.equal(bits(l1), bits(l2))
        nbytes = (2 * T * H * 128 * 2 + 2 * T * H * 4, T * H * 128 * 2 + T * H * 4)
        f = add("merge", "kernel", do_bench(lambda: ext.merge(out, lse, part, plse), rep), nbytes, eq, H=H, T=T)
        g = add("merge", "torch", do_bench(lambda: merge_reference(out, lse, part, plse), rep), nbytes, H=H, T=T)
        f["speedup_vs_torch"] = round(g["ms"] / f["ms"], 2)
        out = lse = part = plse = o1 = l1 = o2 = l2 = None  # freed (not del: the timed lambdas name them)
    torch.cuda.empty_cache()

    # ---- a plain copy of the same bytes, for each size measured ----------------------------
    same = {}
    for nbytes in sorted({r["bytes"] for r in results}):
        half = (nbytes // 2 + 15) // 16 * 16
        src = torch.ones(half, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        same[nbytes] = 2 * half / do_bench(lambda: dst.copy_(src), rep) / 1e9
        src = dst = None  # freed (not del: the timed lambdas name them)
    torch.cuda.empty_cache()
    for r in results:
        r["same_size_copy_tbps"] = round(same[r["bytes"]], 4)
        r["pct_same_size_copy"] = round(100 * r["tbps"] / same[r["bytes"]], 1)

    # ---- targets and report --------------------------------------------------------------
    targets = [(r, goal) for r in results if (goal := target_pct(r)) is not None]
    for r, goal in targets:
        r["target_pct"] = goal
        r["meets_target"] = r["pct_copy"] >= goal
    hdr = (f"{'op':<7} {'variant':<34} {'shape':<16} {'ms':>9} {'TB/s':>7} "
           f"{'% copy':>7} {'% same':>7} {'% mix':>6}  note")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        shape = f"H={r['H']} T={r['T']}" if "H" in r else f"rows={r['rows']}"
        note = []
        for k in ("speedup_vs_generic", "speedup_vs_torch"):
            if k in r:
                note.append(f"x{r[k]}")
        if "meets_target" in r:
            note.append(("ok" if r["meets_target"] else "BELOW") + f" {r['target_pct']:.0f}%")
        if r.get("bit_equal_to_reference") is False:
            note.append("NOT BIT-EQUAL")
        print(f"{r['op']:<7} {r['variant']:<34} {shape:<16} {r['ms']:>9.4f} {r['tbps']:>7.3f} {r['pct_copy']:>6.1f}% "
              f"{r['pct_same_size_copy']:>6.1f}% {r['pct_mix_roofline']:>5.1f}%  "
              + " ".join(note))
    doc = dict(
        date=run_info.utc_now(),
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda, commit=run_info.commit(),
        copy_tbps=round(copy_tbps, 4), write_only_tbps=round(write_tbps, 4), read_only_tbps=round(read_tbps, 4),
        mix_model=("plain Triton streaming copies at the kernel's bytes written per byte read (bench/mix_copy.py), "
                   "interpolated, scaled so that the 1:1 copy gives the measured copy" if mix_table else
                   "t = read_bytes/read_only + write_bytes/write_only, scaled to the measured copy"),
        mix_copies_tbps={str(w): round(t, 4) for w, t in mix_table.items()},
        method="median CUDA-event time, L2 flushed by a 256 MB read before each repetition (a write for the "
               "rows marked L2 dirty)",
        all_bit_equal=all(r.get("bit_equal_to_reference", True) for r in results),
        targets_met=all(r["meets_target"] for r, _ in targets), seconds=round(time.time() - t_start, 1),
        results=results,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"targets met: {doc['targets_met']}; all bit-equal: {doc['all_bit_equal']}; "
          f"{doc['seconds']} s; written {args.out}")
    return 0 if doc["all_bit_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
