"""One launch of each attention config under Nsight Compute (GPU): where a kernel's time goes.

The configs are those of one ``bench_attention.py --ab`` entry (each A and B once, in
order). Every config is compiled and run once first, then run once more inside an NVTX
range named ``profiled``, so that ``ncu --nvtx --nvtx-include profiled/`` profiles exactly
one launch per config, in the order it prints them (``--flashinfer``: FlashInfer's FA3 on
the same bf16 inputs last; ncu then without ``-k``, so that its kernels are profiled too).
What to read in ncu's report: the tensor pipe's share of cycles, the SM clock it ran at,
shared-memory wavefronts and the warps' stall reasons (math pipe throttle, MIO throttle,
barrier, long scoreboard).

  ncu --clock-control none --nvtx --nvtx-include profiled/ -k regex:_mla_attn_ws_fwd \\
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
      --section MemoryWorkloadAnalysis_Tables --csv --page details --log-file /tmp/ncu.csv \\
      python3 bench/profile_attention.py --ab ws-fp8-regs
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_attention as ba  # noqa: E402


def configs_of(ab: str) -> list[tuple[str, dict]]:
    """(dtype, config) of every A and B of ``bench_attention.AB[ab]``, each once, in order."""
    out: list[tuple[str, dict]] = []
    for dt, a, b in ba.AB[ab][0]:
        for cfg in (a, b):
            if (dt, cfg) not in out:
                out.append((dt, cfg))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ab", default="ws-fp8-regs", choices=list(ba.AB))
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--case", default="1x8192q/16384k",
                   help="a case of bench_attention's table, or one segment as \"1x8192q/1024k\" (shape_of)")
    p.add_argument("--flashinfer", action="store_true",
                   help="one launch of FlashInfer's FA3 (bf16) after ours, in the same range (ncu without -k)")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("profile_attention.py needs a CUDA device")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        ql, kl = ba.shape_of(a.case)
    except KeyError as e:
        p.error(str(e))
    x = ba.Inputs().get(a.heads, a.case, ql, kl)
    configs = configs_of(a.ab)
    fns = [ba.prov_triton(*x[dt], x["cq"], x["ck"], ql, kl, 192**-0.5, config=cfg) for dt, cfg in configs]
    if a.flashinfer:
        fns.append(ba.prov_flashinfer(*x["bf16"], x["cq"], x["ck"], ql, kl, 192**-0.5))
        configs.append(("bf16", {"provider": "flashinfer fa3"}))
    for fn in fns:  # compiled and warmed, outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profiled")
    for fn in fns:
        fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    rows = [dict(launch=i, dtype=dt, config=cfg, gflop=ba.gflop(ql, kl, a.heads))
            for i, (dt, cfg) in enumerate(configs)]
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
