"""The persistent warp-specialized kv_b_proj GEMM (ops/kv_b_proj_gluon.py) on a machine
without a GPU: every configuration probe_gemm tries cross-compiles for the H200 (sm_90)
with Triton 3.6's ptxas — wgmma 64×BN×16 only, no spills, shared memory within 227 KiB,
registers moved by ``setmaxnreg`` (loader 24, consumers 240), the result stored by TMA
from ``stmatrix``-written shared memory. Its numbers, every tile of partial ones
included, are checked on the GPU (tests/gpu/test_kv_b_proj_gluon_gpu.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable")

import cross_compile  # noqa: E402
from ctxprefill.ops import kv_b_proj as kvb  # noqa: E402
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
    configuration compiles to the same wgmma, no spills (the loader's slot lookups within its
    24 registers), within 227 KiB of shared memory with its k_pe buffer; per tile two A loads
    (one per 64-row half) beside B's, and per row of tiles two k_pe loads and two stores."""
    jobs = [["_kv_b_proj_paged_ws", {}]]
    for res in cross_compile.cross_compile(_XCOMPILE_GEMM, jobs):
        _common(res)
        assert res["tma_load"] == 5 and res["tma_store"] >= 3, res


def test_chunk_pages_aligned():
    assert kvb.chunk_pages_aligned([0, 16384], (0,)) and kvb.chunk_pages_aligned([0, 640, 1000], (64, 128))
    assert kvb.chunk_pages_aligned([0, 100], (16384,))  # the last sequence may end anywhere
    assert not kvb.chunk_pages_aligned([0, 100, 200], (0, 0))  # the second sequence starts at row 100
    assert not kvb.chunk_pages_aligned([0, 128], (32,))  # its first context token is mid-page
    # "paged" takes what was measured: one sequence
    assert kvb.chunk_reads_cache([0, 16384], (16384,)) and not kvb.chunk_reads_cache([0, 640, 1000], (64, 128))


def test_build_engine_gives_the_engine_its_gemm():
    """``--kv-b-proj-gemm`` is the built engine's (each engine its own, none process-wide),
    and reaches its chunk loops' inputs; an unknown one is refused, naming the field."""
    from ctxprefill.app import build_engine
    from ctxprefill.config import EngineConfig
    from ctxprefill.engine.engine import SequenceSpec
    from ctxprefill.engine.request import PrefillRequest, validate_prefill
    from ctxprefill.errors import ConfigError
    from ctxprefill.settings import ServeSettings

    paged = build_engine(ServeSettings(device="cpu", num_blocks=4, workspace_tokens=64, kv_b_proj_gemm="paged"))
    plain = build_engine(ServeSettings(device="cpu", num_blocks=4, workspace_tokens=64))
    assert (paged.config.kv_b_proj_gemm, plain.config.kv_b_proj_gemm) == ("paged", "cublas")
    q = torch.zeros((2, paged.config.shape.heads, 192), dtype=torch.bfloat16)
    for eng, want in ((paged, "paged"), (plain, "cublas")):
        checked = validate_prefill(PrefillRequest(q, [SequenceSpec(2, 10, [0])]), eng.config, eng.instance_id)
        assert eng.loop_inputs(checked).gemm == want
    with pytest.raises(ConfigError, match="kv_b_proj GEMM"):
        EngineConfig(kv_b_proj_gemm="tensorrt")


def test_reads_cache_only_where_paged_can(monkeypatch):
    """reads_cache: only gemm "paged", a bf16 cache on a GPU and a weight under PAGED_MAX_N rows,
    and what paged_problem accepts, asked once for the same cache and weight facts. A stand-in
    for a GPU cache (its attributes only) and a paged_problem that counts its calls."""
    import types

    asked = []
    monkeypatch.setattr(kg, "paged_problem", lambda cache, w, bs: asked.append(bs) or (None if bs == 64 else "no"))
    monkeypatch.setattr(kvb, "_READABLE", {})
    gpu_cache = types.SimpleNamespace(is_cuda=True, device="cuda:0", dtype=torch.uint8, shape=(4, 1152),
                                      data_ptr=lambda: 0)
    cpu_cache = torch.zeros((4, 1152), dtype=torch.uint8)
    w = torch.zeros((4096, 512), dtype=torch.bfloat16)
    assert not kvb.reads_cache(gpu_cache, "auto", w, 64, "cublas")
    assert kvb.reads_cache(gpu_cache, "auto", w, 64, "paged") and kvb.reads_cache(gpu_cache, "auto", w, 64, "paged")
    assert asked == [64]  # remembered
    assert not kvb.reads_cache(gpu_cache, "auto", w, 16, "paged") and asked == [64, 16]  # what paged_problem refuses
    assert not kvb.reads_cache(cpu_cache, "auto", w, 64, "paged")
    assert not kvb.reads_cache(gpu_cache, "fp8", w, 64, "paged")
    wide = torch.zeros((kvb.PAGED_MAX_N, 512), dtype=torch.bfloat16)
    assert not kvb.reads_cache(gpu_cache, "auto", wide, 64, "paged")
    assert asked == [64, 16]
