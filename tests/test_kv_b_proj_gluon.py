"""The persistent warp-specialized kv_b_proj GEMM (ops/kv_b_proj_gluon.py) on a machine
without a GPU: every configuration probe_gemm tries cross-compiles for the H200 (sm_90)
with Triton 3.6's ptxas — wgmma 64×BN×16 only, no spills, shared memory within 227 KiB,
registers moved by ``setmaxnreg`` (loader 24, consumers 240), the result stored by TMA
from ``stmatrix``-written shared memory. Its numbers, every tile of partial ones
included, are checked on the GPU (tests/gpu/test_kv_b_proj_gluon_gpu.py)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="triton is not importable")

import cross_compile  # noqa: E402
from ctxprefill.ops import kv_b_proj_gluon as kg  # noqa: E402

# jobs: [kernel name, configuration change]; per job one dict of facts
_XCOMPILE_GEMM = cross_compile.RESOURCES + r"""
import json, re, sys
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from ctxprefill.ops import kv_b_proj_gluon as kg

PTRS = {"A": "*bf16", "B": "*bf16", "Y": "*bf16", "KIN": "*bf16", "KOUT": "*bf16", "BT": "*i32", "CU": "*i32",
        "ST": "*i32"}
out = []
for name, cfg in json.loads(sys.argv[1]):
    fn = getattr(kg, name)
    names = fn.arg_names
    cfg = dict(kg.CONFIG, **cfg)
    sig = {n: PTRS.get(n, "i32") for n in names}
    assert not [n for n in names if n.isupper() and n not in cfg and n not in PTRS and n not in ("M", "N", "K")]
    for n in cfg:
        sig[n] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")
             or n.startswith("stride_")}
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in cfg.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=kg._MAXNREG))
    regs, stack = resources(k)
    ptx = k.asm["ptx"]
    out.append(dict(cfg=cfg, regs=regs, stack=stack, smem=k.metadata.shared,
                    wgmma=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
                    mma_sync=len(re.findall(r"\bmma\.sync", ptx)),
                    stmatrix=len(re.findall(r"\bstmatrix\b", ptx)),
                    tma_load=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx)),
                    tma_store=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)),
                    setmaxnreg=sorted(set(int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                                      ptx)))))
print(json.dumps(out))
"""


def _common(res: dict) -> None:
    """What every configuration of both kernels must show."""
    print(res)
    assert res["wgmma"] == [f"m64n{res['cfg']['BN']}k16"] and res["mma_sync"] == 0, res
    assert res["stack"] == 0, f"register spills: {res}"
    assert res["smem"] <= 232448, res
    assert {24, 240} <= set(res["setmaxnreg"]), res


@pytest.mark.skipif(not triton.__version__.startswith("3.6") or bool(kg.GLUON_ERR),
                    reason="sm_90 cross-compile check of the Gluon GEMM written for Triton 3.6")
def test_gemm_configs_cross_compile_for_sm90():
    for res in cross_compile.cross_compile(_XCOMPILE_GEMM, [["_kv_b_proj_ws", c] for c in kg.TUNING]):
        _common(res)
        assert res["stmatrix"] > 0 and res["tma_store"] > 0, res



@pytest.mark.skipif(not triton.__version__.startswith("3.6") or bool(kg.GLUON_ERR),
                    reason="sm_90 cross-compile check of the Gluon GEMM written for Triton 3.6")
def test_paged_gemm_cross_compiles_for_sm90():
    """The GEMM that reads its latent from the paged cache (launch_paged): the default
    configuration, and with ``STORE_UNDER_MMA``, compiles to the same wgmma, no spills (the
    loader's slot lookups within its 24 registers), within 227 KiB of shared memory with its
    k_pe buffer; per tile two A loads (one per 64-row half) beside B's, and per row of tiles
    two k_pe loads and two stores."""
    jobs = [["_kv_b_proj_paged_ws", {}], ["_kv_b_proj_paged_ws", {"STORE_UNDER_MMA": True}]]
    for res in cross_compile.cross_compile(_XCOMPILE_GEMM, jobs):
        _common(res)
        assert res["tma_load"] == 5 and res["tma_store"] >= 3, res
