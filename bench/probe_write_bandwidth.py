#!/usr/bin/env python3
"""How fast the H200 streams writes, by every way we can write (for the bf16 pack).

The bf16 pack reads 1 byte for every 1.5 it writes and measured 84-86 % of the 2 GiB
copy's bandwidth; ``bench_kernels.py`` explains it with writes streaming at 3.38 TB/s
(torch's ``fill_``) against reads at 4.46. If that write figure is torch's fill kernel
rather than the memory, a pack with other stores could reach the issue's 90 %. Measured
here, one process, 2 GiB each, no L2 flush (every buffer is 40x the L2):

  copy          torch ``copy_`` (read + write, the ceiling of bench_kernels)
  read          torch ``max`` over int32 (read only)
  triton-copy   a Triton copy, plain loads and stores (1 byte written per byte read;
                ``bench/mix_copy.py``, 1 GiB read)
  triton-copy-1.5  the same also writing every block folded to half its length: 1.5
                bytes written per byte read, the bf16 pack's mix on contiguous addresses
  fill / zero   torch ``fill_(1)`` / ``zero_()``
  memset        ``cudaMemsetAsync`` from the CUDA runtime torch loads (ctypes)
  triton-st     a Triton kernel storing 16 KiB per program, plain stores
  triton-st-cs  the same with streaming stores (``cache_modifier=".cs"``: the pack's)
  triton-tma    the same through a TMA tensor descriptor (bulk stores from shared memory)

and the bf16 pack itself (k[t,h] = [k_nope[t,h] | k_pe[t]], T·H = 2**20 at H=128 and H=16),
effective bytes over time against the copy: our CUDA kernel (``ops.pack.fused_mla_kv_concat``)
and a Triton pack with plain stores (and TMA stores at H=128), each on the engine's
interleaved kv_b_proj output ([T, H, 256]: a token's k_nope is every other 256 bytes) and
on a blocked one ([T, 2, H, 128]: every head's k_nope, then every head's v — the kv_b_proj
weight's rows permuted). What it found on the H200 (2026-12-01, bench/results): plain
stores write at 107 % of copy, so the memory's write rate does not hold the pack; the
layout makes no difference; a plain copy writing 1.5 bytes per byte read runs at 90 % of
torch's copy — the mix is what costs (the pack, rewritten after it, is at 88 %).

  python bench/probe_write_bandwidth.py --out /tmp/write_bw.json
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import mix_copy  # noqa: E402
from ctxprefill_bench import run_info  # noqa: E402
from mix_copy import MixCopy  # noqa: E402
from progress import log  # noqa: E402

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - the triton rows are skipped without it
    triton = tl = None

BLOCK = 8192  # bf16 elements a program writes: 16 KiB
TMA_ROWS, TMA_COLS = 64, 128  # a TMA store tile: 64 x 128 bf16 = 16 KiB

if triton is not None:

    @triton.jit
    def _store(y, n, CS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        val = tl.full([BLOCK], 1.0, tl.float32).to(y.dtype.element_ty)
        if CS:
            tl.store(y + offs, val, mask=offs < n, cache_modifier=".cs")
        else:
            tl.store(y + offs, val, mask=offs < n)

    @triton.jit
    def _store_tma(y, rows, ROWS: tl.constexpr, COLS: tl.constexpr):
        desc = tl.make_tensor_descriptor(y, [rows, COLS], [COLS, 1], [ROWS, COLS])
        desc.store([tl.program_id(0) * ROWS, 0], tl.full([ROWS, COLS], 1.0, tl.float32).to(y.dtype.element_ty))


    @triton.jit
    def _pack(kn, kn_s0, kn_s1, pe, pe_s0, k, T, H, BT: tl.constexpr, TMA: tl.constexpr):
        """k [T, H, 192] = [k_nope | k_pe] for BT tokens of one head: k_nope's row (t, h) at
        kn + t·kn_s0 + h·kn_s1, k_pe's at pe + t·pe_s0; plain or TMA stores."""
        t0 = tl.program_id(0) * BT
        h = tl.program_id(1)
        t = t0 + tl.arange(0, BT)
        ok = (t < T)[:, None]
        c128, c64 = tl.arange(0, 128), tl.arange(0, 64)
        nope = tl.load(kn + t.to(tl.int64)[:, None] * kn_s0 + h * kn_s1 + c128[None, :], mask=ok)
        rope = tl.load(pe + t.to(tl.int64)[:, None] * pe_s0 + c64[None, :], mask=ok)
        if TMA:  # k as [T, H·192]: this head's 192 columns of BT rows, two boxes
            dn = tl.make_tensor_descriptor(k, [T, H * 192], [H * 192, 1], [BT, 128])
            dr = tl.make_tensor_descriptor(k, [T, H * 192], [H * 192, 1], [BT, 64])
            dn.store([t0, h * 192], nope)
            dr.store([t0, h * 192 + 128], rope)
        else:
            row = (t.to(tl.int64) * H + h)[:, None] * 192
            tl.store(k + row + c128[None, :], nope, mask=ok, cache_modifier=".cs")
            tl.store(k + row + 128 + c64[None, :], rope, mask=ok, cache_modifier=".cs")


def pack_inputs(T: int, H: int, device, layout: str = "interleaved"):
    """The engine's views: k_nope = kv_b_proj output [T, H, 256][..., :128], k_pe = the
    workspace [T, 576][:, 512:]. ``layout="blocked"``: the kv_b_proj output as [T, 2, H, 128]
    (every head's k_nope, then every head's v: the weight's rows permuted), so that a token's
    k_nope is one contiguous span rather than every other 256 bytes."""
    ws = torch.randn(T, 576, device=device).to(torch.bfloat16)
    if layout == "blocked":
        return torch.randn(T, 2, H, 128, device=device).to(torch.bfloat16)[:, 0], ws[:, 512:]
    kv = torch.randn(T, H, 256, device=device).to(torch.bfloat16)
    return kv[..., :128], ws[:, 512:]


def triton_pack(k_nope, k_pe, k, tma: bool, bt: int = 64):
    T, H = k_nope.shape[:2]
    _pack[(triton.cdiv(T, bt), H)](k_nope, k_nope.stride(0), k_nope.stride(1), k_pe, k_pe.stride(0), k, T, H,
                                   BT=bt, TMA=tma)
    return k


def memset_fn():
    """``cudaMemsetAsync`` on torch's current stream, from the runtime torch loaded, or None."""
    site = os.path.dirname(os.path.dirname(torch.__file__))  # torch's own, then the toolkit's
    libs = [p for d in (os.path.join(site, "nvidia"), os.path.dirname(torch.__file__), "/usr/local/cuda") for p in
            sorted(glob.glob(os.path.join(d, "**", "libcudart.so*"), recursive=True))]
    for name in libs + ["libcudart.so"]:
        try:
            rt = ctypes.CDLL(name)
            f = rt.cudaMemsetAsync
        except OSError:
            continue
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
        f.restype = ctypes.c_int

        def run(t):
            rc = f(t.data_ptr(), 0, t.numel() * t.element_size(), torch.cuda.current_stream().cuda_stream)
            if rc != 0:
                raise RuntimeError(f"cudaMemsetAsync returned {rc}")

        return run, name
    return None, "no libcudart found"


def ways(y: torch.Tensor) -> dict:
    """name -> a function writing all of ``y`` (bf16, 1-D), and why one is missing."""
    n = y.numel()
    out = {"fill": lambda: y.fill_(1.0), "zero": lambda: y.zero_()}
    ms, where = memset_fn()
    out["memset"] = (lambda: ms(y)) if ms else where
    if triton is None:
        return out | {"triton-st": "triton not importable"}
    grid = (triton.cdiv(n, BLOCK),)
    out["triton-st"] = lambda: _store[grid](y, n, CS=False, BLOCK=BLOCK)
    out["triton-st-cs"] = lambda: _store[grid](y, n, CS=True, BLOCK=BLOCK)
    if n % TMA_COLS == 0 and torch.cuda.get_device_capability(y.device) >= (9, 0):
        rows = n // TMA_COLS
        out["triton-tma"] = lambda: _store_tma[(triton.cdiv(rows, TMA_ROWS),)](y, rows, ROWS=TMA_ROWS, COLS=TMA_COLS)
    else:
        out["triton-tma"] = "needs sm_90 and a multiple of 128 elements"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/probe_write.json")
    ap.add_argument("--gib", type=float, default=2.0, help="buffer size")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_write_bandwidth.py needs a CUDA device")
    from bench_kernels import do_bench

    if triton is not None:  # scratch for the device-side TMA descriptors (triton-tma, pack-triton-tma)
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))

    n = int(a.gib * (1 << 30)) // 2 // TMA_COLS * TMA_COLS
    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    nbytes = n * 2
    rows = []
    runs = [("copy", lambda: y.copy_(x), 2 * nbytes), ("read", lambda: x.view(torch.int32).max(), nbytes)]
    if triton is not None:  # copies by plain loads and stores: 1 byte written per byte read, and 1.5 (the pack's mix)
        mc = MixCopy(n // 2 // mix_copy.BLOCK * mix_copy.BLOCK, "cuda")  # half the size: its outputs fit beside x, y
        runs += [("triton-copy", *mc.runner(1.0)), ("triton-copy-1.5", *mc.runner(1.5))]
    for name, fn, moved in runs:
        ms = do_bench(fn, rep_ms=100, flush=False)
        rows.append(dict(way=name, ms=ms, tbps=moved / ms / 1e9))
    mc = None
    for name, fn in ways(y).items():
        if isinstance(fn, str):
            rows.append(dict(way=name, error=fn))
            continue
        try:
            ms = do_bench(fn, rep_ms=100, flush=False)
            y_ok = bool((y[:: max(1, n // 4096)] == (0 if name in ("zero", "memset") else 1)).all())
            rows.append(dict(way=name, ms=ms, tbps=nbytes / ms / 1e9, values_ok=y_ok))
        except Exception as e:  # noqa: BLE001 - a way that does not run here is a result too
            rows.append(dict(way=name, error=f"{type(e).__name__}: {str(e)[:200]}"))
    x = y = None  # 4 GiB back before the pack's inputs
    torch.cuda.empty_cache()
    # the bf16 pack: effective bytes (k_nope and k_pe read once, k written once), at T·H = 2**20
    # with the engine's interleaved kv_b_proj output and with a blocked one (k_nope of every
    # head, then v): is the pack held by reading every other 256 bytes?
    try:
        from ctxprefill.ops import _cuda
        from ctxprefill.ops.pack import fused_mla_kv_concat

        cuda_pack = fused_mla_kv_concat if _cuda.load() is not None \
            else f"the CUDA extension did not load: {_cuda.why_not()}"
    except Exception as e:  # noqa: BLE001
        cuda_pack = f"{type(e).__name__}: {e}"
    for T, H, layout in [(8192, 128, "interleaved"), (8192, 128, "blocked"),
                         (65536, 16, "interleaved"), (65536, 16, "blocked")]:
        kn, pe = pack_inputs(T, H, "cuda", layout)
        nbytes = T * H * 128 * 2 + T * 64 * 2 + T * H * 192 * 2
        ref = torch.cat([kn, pe[:, None, :].expand(T, H, 64)], dim=-1)
        tag = "" if layout == "interleaved" else "-blocked"
        packs = {"pack-cuda" + tag: cuda_pack if isinstance(cuda_pack, str)
                 else (lambda kn=kn, pe=pe: cuda_pack(kn, pe))}
        if triton is not None:
            k = torch.empty(T, H, 192, dtype=torch.bfloat16, device="cuda")
            packs["pack-triton-st" + tag] = lambda kn=kn, pe=pe, k=k: triton_pack(kn, pe, k, tma=False)
            if layout == "interleaved" and H == 128:
                packs["pack-triton-tma"] = lambda kn=kn, pe=pe, k=k: triton_pack(kn, pe, k, tma=True)
        for name, fn in packs.items():
            if isinstance(fn, str):
                rows.append(dict(way=name, error=fn))
                continue
            try:
                ok = bool(torch.equal(fn(), ref))
                ms = do_bench(fn, rep_ms=100, flush=True)
                rows.append(dict(way=name, ms=ms, tbps=nbytes / ms / 1e9, values_ok=ok, T=T, H=H, layout=layout))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(way=name, error=f"{type(e).__name__}: {str(e)[:200]}"))
        kn = pe = ref = k = None
        torch.cuda.empty_cache()
    copy = rows[0]["tbps"]
    for r in rows:
        shape = f"T={r['T']} H={r['H']} " if "T" in r else ""
        got = (f"{r['tbps']:.3f} TB/s ({r['tbps'] / copy:.1%} of copy)"
               + ("" if r.get("values_ok", True) else "  WRONG VALUES")) if "tbps" in r else r["error"]
        log(f"{r['way']:<22} {shape}{got}")
    with open(a.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), date=run_info.utc_now(), commit=run_info.commit(),
                       torch=torch.__version__, triton=getattr(triton, "__version__", None), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
