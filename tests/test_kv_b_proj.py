"""ops/kv_b_proj.py's choices around the GEMM, on the CPU: which chunks the paged GEMM takes
(``chunk_pages_aligned``, ``chunk_reads_cache``), where it reads the cache (``reads_cache``),
and the GEMM as an engine's setting (``EngineConfig.kv_b_proj_gemm``). The kernels are
cross-compiled in tests/test_kv_b_proj_gluon.py and checked on the GPU in
tests/gpu/test_kv_b_proj_gluon_gpu.py."""

from __future__ import annotations

import pytest
import torch

from ctxprefill.ops import kv_b_proj as kvb
from ctxprefill.ops import kv_b_proj_gluon as kg


def test_chunk_pages_aligned():
    assert kvb.chunk_pages_aligned([0, 16384], (0,)) and kvb.chunk_pages_aligned([0, 640, 1000], (64, 128))
    assert kvb.chunk_pages_aligned([0, 100], (16384,))  # the last sequence may end anywhere
    assert not kvb.chunk_pages_aligned([0, 100, 200], (0, 0))  # the second sequence starts at row 100
    assert not kvb.chunk_pages_aligned([0, 128], (32,))  # its first context token is mid-page
    # "paged" takes what was measured: one sequence
    assert kvb.chunk_reads_cache((16384,), (16384,)) and not kvb.chunk_reads_cache((640, 360), (64, 128))
    assert not kvb.chunk_reads_cache((100,), (32,))  # one sequence, off the pages


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


def test_both_gemm_launchers_launch_persistent_programs(monkeypatch):
    """launch and launch_paged on CPU stand-ins for their kernels: at most one program per SM
    (one per tile below that), the default configuration's knobs, their own arguments in the
    kernels' order, and a new [M, N] bf16 output each."""
    if kg.GLUON_ERR:
        pytest.skip(kg.GLUON_ERR)
    calls = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((self.name, grid, args, kw))

    monkeypatch.setattr(kg, "_kv_b_proj_ws", Kernel("gemm"))
    monkeypatch.setattr(kg, "_kv_b_proj_paged_ws", Kernel("paged"))
    monkeypatch.setattr(kg, "_device_facts", lambda index: (9, 132))
    knobs = {k: kg.CONFIG[k] for k in ("BM", "BN", "BK", "STAGES", "GROUP_M", "PINGPONG", "STORE_UNDER_MMA")}
    w = torch.zeros((4096, 512), dtype=torch.bfloat16)
    latent = torch.zeros((16384, 512), dtype=torch.bfloat16)
    out = kg.launch(latent, w)  # 128 x 16 tiles: one program per SM
    assert out.shape == (16384, 4096) and out.dtype == torch.bfloat16
    name, grid, args, kw = calls.pop()
    assert (name, grid, kw) == ("gemm", (132,), dict(knobs, num_warps=4, maxnreg=kg._MAXNREG))
    assert args[:6] == (latent, w, out, 16384, 4096, 512) and args[0] is latent
    cache = torch.zeros((256, 1152), dtype=torch.uint8)
    ws = torch.zeros((200, 576), dtype=torch.bfloat16)
    table, cu, st = (torch.zeros((1, 4), dtype=torch.int32), torch.tensor([0, 200], dtype=torch.int32),
                     torch.zeros(1, dtype=torch.int32))
    out = kg.launch_paged(cache, table, cu, st, 64, ws, w)  # 2 x 16 tiles
    assert out.shape == (200, 4096)
    name, grid, args, kw = calls.pop()
    assert (name, grid, kw) == ("paged", (32,), dict(knobs, num_warps=4, maxnreg=kg._MAXNREG))
    assert args[2:4] == (w, out) and args[5:11] == (table, cu, st, 200, 4096, 512) and args[11:14] == (256, 1, 64)
    # the cache's bf16 rows, their k_pe columns and the workspace's k_pe columns, as views
    view, k_pe, ws_pe = args[0], args[1], args[4]
    assert view.dtype == torch.bfloat16 and view.shape == (256, 576) and view.data_ptr() == cache.data_ptr()
    assert k_pe.shape == (256, 64) and k_pe.data_ptr() == cache.data_ptr() + 512 * 2
    assert ws_pe.shape == (200, 64) and ws_pe.data_ptr() == ws.data_ptr() + 512 * 2
    assert not calls
