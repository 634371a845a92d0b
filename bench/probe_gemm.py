"""Where kv_b_proj's GEMM stands against the matrix rate, and whether a persistent TMA
kernel with its epilogue overlapped beats cuBLAS on its shapes.

kv_b_proj is ``latent [rows, 512] @ W^T`` with ``W [H * 256, 512]``: a short reduction
(K = 512, eight 64-wide steps), so a tile's epilogue (storing 128 × 256 bf16) is as long
as a good part of its main loop. A non-persistent kernel runs them back to back; a
persistent one can start the next tile's loads while it stores. This probe times, in one
process and alternating, torch's GEMM (cuBLAS, and cuBLASLt: torch's other route, with
its own heuristics), a Triton persistent TMA kernel and the persistent warp-specialized
Gluon kernel (``ops/kv_b_proj_gluon.py``: a loader warp running ahead across tiles, TMA
stores draining under the next tile's MMAs) on the headline shapes (16 and 128 heads,
16k and 64k rows), next to a large square GEMM's burst rate, and reports how far each
result is from cuBLAS's (bits may differ: the accumulation order does). Times are the
device's (a sleep kernel queued ahead of each call hides its launch); the host's time to
launch cuBLAS and the best Gluon configuration is reported beside them, since an eager
request pays it where the device waits on the host.

    PYTHONPATH=server:client:bench python bench/probe_gemm.py [--out PATH.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ctxprefill.ops import kv_b_proj_gluon as kg
from ctxprefill_bench import run_info

K_LATENT = 512
HEAD_COLS = 256  # P + V per head


@triton.jit
def _gemm_nt_persistent(a_desc, b_desc, c_desc, M, N, K,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                        NUM_SMS: tl.constexpr, SPLIT: tl.constexpr):
    # C[M, N] = A[M, K] @ B[N, K]^T, bf16 in and out, fp32 accumulation; tiles grouped by
    # GROUP_M rows of tiles so that neighbouring programs share B's columns in L2
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    per_group = GROUP_M * num_n
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
        first_m = (tile // per_group) * GROUP_M
        rows = min(num_m - first_m, GROUP_M)
        om = (first_m + tile % rows) * BM
        on = ((tile % per_group) // rows) * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([om, ki * BK])
            b = b_desc.load([on, ki * BK])
            acc = tl.dot(a, b.T, acc)
        if SPLIT:  # two half-width stores: half the registers staged at a time
            acc = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
            lo, hi = tl.split(acc)
            c_desc.store([om, on], lo.to(tl.bfloat16))
            c_desc.store([om, on + BN // 2], hi.to(tl.bfloat16))
        else:
            c_desc.store([om, on], acc.to(tl.bfloat16))


CONFIGS = [  # (BM, BN, BK, GROUP_M, stages, warps, split)
    (128, 256, 64, 8, 3, 8, True),
    (128, 256, 64, 8, 4, 8, True),
    (128, 128, 64, 8, 4, 8, False),
    (128, 128, 64, 8, 5, 4, False),
    (256, 128, 64, 8, 3, 8, False),
]


def triton_gemm(a: torch.Tensor, w: torch.Tensor, cfg: tuple, sms: int) -> torch.Tensor:
    """a [M, K] bf16, w [N, K] bf16 -> [M, N] bf16."""
    bm, bn, bk, group, stages, warps, split = cfg
    M, K = a.shape
    N = w.shape[0]
    c = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    a_d = TensorDescriptor.from_tensor(a, [bm, bk])
    b_d = TensorDescriptor.from_tensor(w, [bn, bk])
    c_d = TensorDescriptor.from_tensor(c, [bm, bn // 2 if split else bn])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    _gemm_nt_persistent[(min(sms, tiles),)](a_d, b_d, c_d, M, N, K, BM=bm, BN=bn, BK=bk, GROUP_M=group,
                                            NUM_SMS=sms, SPLIT=split, num_stages=stages, num_warps=warps)
    return c


#: cycles of the sleep kernel queued ahead of each timed call (~0.5 ms): longer than any
#: launch here takes on the host, so the call's kernels start as soon as they are queued
SLEEP_CYCLES = 1_000_000


def calls(fn, reps: int = 20) -> tuple[float, float]:
    """Median device and host seconds of ``fn()`` over ``reps`` calls. Each call's CUDA
    events are queued behind a sleep kernel: the host's launch (timed around the call) runs
    while the device sleeps, so the events time the kernels alone, not the gap a slow launch
    leaves on an idle device."""
    fn()
    torch.cuda.synchronize()
    device, host = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        b.record()
        b.synchronize()
        device.append(a.elapsed_time(b) / 1e3)
    return statistics.median(device), statistics.median(host)


def timed(fn, reps: int = 20) -> float:
    """Median device seconds of ``fn()`` (:func:`calls`)."""
    return calls(fn, reps)[0]


def timed_with_blas(library: str, fn, reps: int = 20) -> float:
    """:func:`timed` with torch's matmul routed through ``library`` (``"cublaslt"``:
    cuBLASLt and its own heuristics, instead of cuBLAS's ``gemmEx``), then back."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return timed(fn, reps)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows here (JSON)")
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_gemm: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    big = torch.randn((8192, 8192), generator=g, device=dev).to(torch.bfloat16)
    t_big = timed(lambda: big @ big.t(), reps=10)
    burst = 2 * 8192**3 / t_big
    print(f"burst: 8192^3 bf16 GEMM {burst / 1e12:.1f} TFLOP/s", flush=True)
    rows_out = []
    for heads in (16, 128):
        for m in (16384, 65536):
            n = heads * HEAD_COLS
            a = torch.randn((m, K_LATENT), generator=g, device=dev).to(torch.bfloat16)
            w = (torch.randn((n, K_LATENT), generator=g, device=dev) * K_LATENT**-0.5).to(torch.bfloat16)
            flops = 2 * m * n * K_LATENT
            ref = a @ w.t()
            row = {"heads": heads, "rows": m, "n": n, "k": K_LATENT, "burst_tflops": burst / 1e12}
            t_cublas, host_cublas = calls(lambda: a @ w.t())
            t_lt = timed_with_blas("cublaslt", lambda: a @ w.t())
            t_cublas = min(t_cublas, timed(lambda: a @ w.t()))
            row.update({"cublaslt_s": t_lt, "cublaslt_tflops": flops / t_lt / 1e12})
            best = None
            for cfg in CONFIGS:
                try:
                    got = triton_gemm(a, w, cfg, sms)
                except Exception as e:  # a config that does not fit (shared memory, registers)
                    print(f"  {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                    continue
                diff = (got.float() - ref.float()).abs().max().item()
                t = timed(lambda cfg=cfg: triton_gemm(a, w, cfg, sms))
                t_cublas = min(t_cublas, timed(lambda: a @ w.t()))  # alternating: the same clock state
                print(f"  H={heads} M={m} {cfg}: {flops / t / 1e12:7.1f} TFLOP/s  max|diff| {diff:.3g}",
                      flush=True)
                if best is None or t < best[0]:
                    best = (t, cfg, diff)
            gall = []  # every tuning entry: its change to CONFIG, time, rate, max |diff|, host time
            for cfg in kg.TUNING if not kg.problem(a, w) else []:
                got = kg.kv_b_proj_gluon(a, w, config=cfg)
                diff = (got.float() - ref.float()).abs().max().item()
                t, host = calls(lambda cfg=cfg: kg.kv_b_proj_gluon(a, w, config=cfg))
                t_cublas = min(t_cublas, timed(lambda: a @ w.t()))
                print(f"  H={heads} M={m} gluon {cfg}: {flops / t / 1e12:7.1f} TFLOP/s  max|diff| {diff:.3g}",
                      flush=True)
                gall.append({"change": cfg, "s": t, "tflops": flops / t / 1e12, "max_abs_diff": diff, "host_s": host})
            row.update({"cublas_s": t_cublas, "cublas_host_s": host_cublas, "cublas_tflops": flops / t_cublas / 1e12,
                        "cublas_of_burst": flops / t_cublas / burst, "cublaslt_over_cublas": t_cublas / t_lt})
            gbest = min(gall, key=lambda c: c["s"]) if gall else None
            if gbest is not None:
                row.update({"gluon_s": gbest["s"], "gluon_tflops": gbest["tflops"],
                            "gluon_of_burst": flops / gbest["s"] / burst,
                            "gluon_config": dict(kg.CONFIG, **gbest["change"]),
                            "gluon_max_abs_diff": gbest["max_abs_diff"], "gluon_over_cublas": t_cublas / gbest["s"],
                            "gluon_host_s": gbest["host_s"], "gluon_configs": gall})
            if best is not None:
                row.update({"triton_s": best[0], "triton_tflops": flops / best[0] / 1e12,
                            "triton_of_burst": flops / best[0] / burst, "triton_config": list(best[1]),
                            "triton_max_abs_diff": best[2], "triton_over_cublas": t_cublas / best[0]})
            print(f"H={heads:3d} M={m:6d} N={n:6d}: cuBLAS {row['cublas_tflops']:.1f} TFLOP/s "
                  f"({row['cublas_of_burst']:.0%} of burst), cuBLASLt {row['cublaslt_tflops']:.1f}"
                  + (f", Triton persistent {row['triton_tflops']:.1f} ({row['triton_of_burst']:.0%}), "
                     f"{row['triton_over_cublas']:.2f}x cuBLAS" if best else "")
                  + (f", Gluon WS {row['gluon_tflops']:.1f} ({row['gluon_of_burst']:.0%}), "
                     f"{row['gluon_over_cublas']:.2f}x cuBLAS" if gbest else ""), flush=True)
            rows_out.append(row)
    if ns.out:
        meta = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(dev),
                "date": run_info.utc_now(), "commit": run_info.commit()}
        with open(ns.out, "w") as f:
            json.dump({"meta": meta, "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
