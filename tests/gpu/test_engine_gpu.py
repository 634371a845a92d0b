"""The fused chunk loop equals the generic one on the GPU, bit for bit (CONTRACT §5, §10),
and the launch metric equals the CUDA profiler's kernel count (CONTRACT §9).

Fused vs generic: q, k, v, out and LSE of every chunk and the merged result, atol =
rtol = 0, over cache {auto, fp8, fp8_ds_mla} x kv_b_proj {bf16, fp8} x prefill
{bf16, fp8} x backend out mode {honor, not}, on the seed's case and a larger one.
The two paths share every op but the pack, so this pins the fused pack kernels (and
the CUDA gather / merge / insert both paths run) inside the real loop.

Launch count: one ``prefill_context`` under torch.profiler (CUDA activity); device
kernels (host transfers and memsets excluded; device-to-device copies, which torch
runs as a DtoD memcpy, counted) against ``sum(result.stats.launches.values())``,
with a test backend of exactly two fill kernels per call, and with the kernel backend
``auto`` takes here (gluon on Hopper, else triton).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import os
import sys

import pytest
import torch

from ctxprefill.backends.base import AttentionBackend, BackendCaps
from ctxprefill.backends.reference import ReferenceBackend
from ctxprefill.config import CacheConfig, EngineConfig, ModelShape
from ctxprefill.engine.engine import Engine, SequenceSpec
from ctxprefill.weights import prepare, random_kv_b_proj
from ctxprefill_client import slot_mapping

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from device_profile import device_work, fail_unless_counts_match  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device: the GPU engine tests run on the GPU machine")]

DEV = "cuda"
FP8 = torch.float8_e4m3fn
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

CASES = {
    # the seed's case: a continuation chunk, an empty sequence, W = 128, block 16, H = 2
    "seed": dict(contexts=[200, 48, 32, 0], queries=[8, 4, 6, 5], W=128, block=16, heads=2, blocks=64),
    # larger: H = 16, several sequences, continuations, empty ones, W = 1024, block 64
    "larger": dict(contexts=[3000, 0, 1500, 64, 700, 1, 0, 2100], queries=[17, 5, 9, 3, 12, 1, 4, 30], W=1024,
                   block=64, heads=16, blocks=160),
}
COMBOS = list(itertools.product(["auto", "fp8", "fp8_ds_mla"], ["bf16", "fp8"], ["bf16", "fp8"], [True, False]))


@pytest.fixture(autouse=True)
def _ext(cuda_ext):
    return cuda_ext


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT[t.element_size()])


def make_engine(case: str | dict, cache_dtype: str, kvb: str, prefill: str, backend: AttentionBackend) -> Engine:
    c = CASES[case] if isinstance(case, str) else case
    shape = ModelShape(heads=c["heads"])
    t = random_kv_b_proj(shape, kvb, seed=0)
    w = prepare(kvb, t["kv_b_proj.weight"], t.get("kv_b_proj.weight_scale_inv"))
    # fp8 prefill on an fp8 cache copies raw bytes: k_scale must be 1 there; elsewhere
    # a k_scale != 1 exercises the dequantizing gather
    k_scale = 1.0 if (cache_dtype == "fp8" and prefill == "fp8") else 0.5
    cfg = EngineConfig(shape=shape, cache=CacheConfig(cache_dtype, c["block"], c["blocks"], k_scale),
                       kv_b_proj_dtype=kvb, prefill_dtype=prefill, workspace_tokens=c["W"])
    return Engine(cfg, w, DEV, backend=backend)


def make_request(engine: Engine, case: str | dict, seed: int = 1):
    """Write every sequence's context into shuffled cache blocks; a matching q."""
    c = CASES[case] if isinstance(case, str) else case
    cfg = engine.config
    bs = cfg.cache.block_size
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / bs) for n in c["contexts"]]
    perm = torch.randperm(cfg.cache.num_blocks, generator=g)[: sum(need)].tolist()
    seqs, at = [], 0
    for n, nb, qn in zip(c["contexts"], need, c["queries"]):
        blocks = perm[at : at + nb]
        at += nb
        if n:
            slots = torch.from_numpy(slot_mapping(blocks, 0, n, bs))
            scale = torch.exp(torch.randn((n, 1), generator=g))
            engine.write_cache(slots, torch.randn((n, 512), generator=g) * scale, torch.randn((n, 64), generator=g))
        seqs.append(SequenceSpec(qn, n, blocks))
    q = torch.randn((sum(c["queries"]), c["heads"], 192), generator=g)
    q = q.clamp(-448, 448).to(FP8) if cfg.prefill_dtype == "fp8" else q.to(torch.bfloat16)
    return q.to(DEV), seqs


def record(engine: Engine, q, seqs, fused: bool):
    seen = []

    def observer(i, chunk, q_c, k, v, o, lse):
        seen.append(tuple(t.detach().clone() for t in (q_c, k, v, o, lse)))

    r = engine.prefill_context(q, seqs, fused=fused, observer=observer)
    return r, seen


@pytest.mark.parametrize("cache_dtype,kvb,prefill,honor_out", COMBOS,
                         ids=[f"{a}-kvb_{b}-prefill_{c}-{'out' if d else 'noout'}" for a, b, c, d in COMBOS])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_equals_generic_on_gpu(case, cache_dtype, kvb, prefill, honor_out):
    eng = make_engine(case, cache_dtype, kvb, prefill, ReferenceBackend(honor_out=honor_out))
    assert eng.fused_kernels_active
    q, seqs = make_request(eng, case)
    fused, fch = record(eng, q, seqs, fused=True)
    generic, gch = record(eng, q, seqs, fused=False)
    assert fused.stats.path == "fused" and generic.stats.path == "generic"
    assert len(fch) == len(gch) == len(fused.stats.chunks) > 0
    if case == "larger" or case == "seed":
        assert any(c.is_continuation for c in fused.stats.chunks), "the case must have a continuation chunk"
    for i, (a, b) in enumerate(zip(fch, gch)):
        for name, x, y in zip(("q", "k", "v", "out", "lse"), a, b):
            assert x.device.type == DEV and x.dtype == y.dtype and x.shape == y.shape, (i, name)
            n = int((bits(x) != bits(y)).sum())
            assert n == 0, f"chunk {i}: {name} differs in {n} of {x.numel()} elements"
        if prefill == "fp8":
            assert a[1].dtype == FP8 and a[2].dtype == FP8
    assert torch.equal(bits(fused.out), bits(generic.out)), "merged out differs"
    assert torch.equal(bits(fused.lse), bits(generic.lse)), "merged lse differs"
    # sanity of the result itself: rows of the empty sequence are 0 / -inf
    c = CASES[case]
    q0 = 0
    for n, qn in zip(c["contexts"], c["queries"]):
        if n == 0:
            assert bool((fused.out[q0 : q0 + qn] == 0).all())
            assert bool((fused.lse[:, q0 : q0 + qn] == float("-inf")).all())
        q0 += qn
    assert not bool(fused.out.float().isnan().any()) and not bool(fused.lse.isnan().any())
    n = len(fused.stats.chunks)
    assert fused.stats.launches["pack"] == n


# ---- launch count against the profiler -----------------------------------------------------


class FillBackend(AttentionBackend):
    """Exactly two device kernels per call (an out fill, an LSE fill): a backend whose
    launch count is known, so that the count of everything else is tested exactly."""

    name = "fill-test"
    caps = BackendCaps(q_dtypes=frozenset({torch.bfloat16, torch.float8_e4m3fn}), launches_per_call=2)

    def __init__(self, honor_out: bool = True):
        self.honor_out = honor_out
        self.caps = dataclasses.replace(type(self).caps, supports_out=honor_out)

    def run_context_chunk(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, *, out=None, causal=False,
                          k_rope=None, v_layout="thd", cu_seqlens_v=None, launch_order=None):
        Tq, H = q.shape[0], q.shape[1]
        if out is not None and self.honor_out:
            out.fill_(0.25)
        else:
            out = torch.full((Tq, H, 128), 0.25, dtype=torch.bfloat16, device=q.device)
        lse = torch.full((H, Tq), 1.5, dtype=torch.float32, device=q.device)
        return out, lse


def _triton_backend():
    """The kernel backend ``auto`` takes here: gluon on Hopper (the warp-specialized kernel,
    with the Triton kernel for the chunks it does not take), else triton."""
    try:
        from ctxprefill.backends.triton_attention import GluonAttentionBackend, TritonAttentionBackend
    except Exception as e:  # noqa: BLE001
        return None, f"ctxprefill.backends.triton_attention does not import: {e!r}"
    cuda = torch.device("cuda")
    if GluonAttentionBackend.unavailable_reason(cuda, torch.bfloat16) is None:
        return GluonAttentionBackend(), ""
    why = TritonAttentionBackend.unavailable_reason(cuda, torch.bfloat16)
    if why is not None:
        return None, why
    return TritonAttentionBackend(), ""



LAUNCH_COMBOS = [("auto", "bf16", "bf16"), ("fp8", "bf16", "bf16"), ("fp8", "fp8", "fp8"),
                 ("fp8_ds_mla", "fp8", "bf16"), ("fp8_ds_mla", "bf16", "fp8")]


@pytest.mark.parametrize("backend_name", ["fill", "triton"])
@pytest.mark.parametrize("honor_out", [True, False], ids=["out", "noout"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "generic"])
@pytest.mark.parametrize("cache_dtype,kvb,prefill", LAUNCH_COMBOS, ids=["-".join(c) for c in LAUNCH_COMBOS])
@pytest.mark.parametrize("case", list(CASES))
def test_launch_count_matches_profiler(case, cache_dtype, kvb, prefill, fused, honor_out, backend_name,
                                       record_property):
    if backend_name == "triton":
        if not honor_out:
            pytest.skip("the Triton backend always honours out")
        backend, why = _triton_backend()
        if backend is None:
            pytest.skip(f"Triton backend unavailable: {why}")
    else:
        backend = FillBackend(honor_out)
    eng = make_engine(case, cache_dtype, kvb, prefill, backend)
    q, seqs = make_request(eng, case)
    eng.prefill_context(q, seqs, fused=fused)  # warm-up: compiles, cuBLAS handles, allocator
    r, kernels, dtod = device_work(lambda: eng.prefill_context(q, seqs, fused=fused))
    noted = sum(r.stats.launches.values())
    line = (f"[launches] {case} {cache_dtype}/{kvb}/{prefill} {'fused' if fused else 'generic'} "
            f"{backend_name} out={honor_out}: profiler {len(kernels)} kernels + {len(dtod)} DtoD copies, "
            f"stats {noted} ({dict(r.stats.launches)})")
    print(line)
    record_property("profiler_kernels", len(kernels))
    record_property("profiler_dtod_copies", len(dtod))
    record_property("stats_launches", noted)
    seen = len(kernels) + len(dtod)
    if eng.weights.compute.dtype == torch.float32:
        # The fp32-GEMM fallback of block-scaled fp8 weights (docs/DESIGN.md): cuBLAS
        # picks 1 or 2 kernels for one fp32 GEMM depending on the shape (seen: 2 on the
        # seed case), which the engine cannot know; it notes one. Everything else must
        # match exactly: the GEMM kernels count as one launch per chunk.
        gemms = sum("gemm" in n.lower() for n in kernels)
        n_chunks = len(r.stats.chunks)
        assert n_chunks <= gemms <= 2 * n_chunks, line
        seen = seen - gemms + n_chunks
    fail_unless_counts_match(line, seen, noted, kernels + dtod)


@pytest.mark.parametrize("cache_dtype,kvb,prefill", [("auto", "bf16", "bf16"), ("fp8", "fp8", "fp8")],
                         ids=["bf16", "fp8"])
def test_packed_launch_order_in_the_engine_changes_no_bit(cache_dtype, kvb, prefill):
    """A ragged request whose chunk the gluon backend gives a packed launch order (4
    sequences in one 32k-row chunk at H=16: 544 tiles, over 128- and 256-key blocks alike:
    ``tile_order`` packs it for both dtypes' defaults) — the engine copies it to the device
    before the chunk's attention — gives the same bits, fused and generic, as the same
    backend with no order (every tile computes the same either way), and one launch of
    attention."""
    backend, why = _triton_backend()
    if backend is None or not backend.caps.launch_order:
        pytest.skip(f"no backend with a launch order here (gluon needs Hopper): {why or backend.name}")
    case = dict(contexts=[9280, 2320, 6960, 3472], queries=[256, 2048, 640, 1408], W=32768, block=64, heads=16,
                blocks=400)
    eng = make_engine(case, cache_dtype, kvb, prefill, backend)
    q, seqs = make_request(eng, case)
    from ctxprefill_bench.engine_bench import launch_orders_given

    runs = [launch_orders_given(eng, q, seqs, fused=f) for f in (True, False)]
    given, ordered = [g for gave, _ in runs for g in gave], [r for _, r in runs]
    assert len(given) == 2 and all(g is not None for g in given), "no packed order: the case no longer tests it"
    backend.launch_order = lambda *a, **kw: None
    plain = [eng.prefill_context(q, seqs, fused=f) for f in (True, False)]
    del backend.launch_order
    for a, b in zip(ordered + ordered[:1], plain + ordered[1:]):
        assert torch.equal(bits(a.out), bits(b.out)) and torch.equal(bits(a.lse), bits(b.lse))
    assert ordered[0].stats.launches["attention"] == len(ordered[0].stats.chunks) == 1


@pytest.mark.parametrize("cache_dtype,kvb", [("auto", "bf16"), ("fp8", "fp8")], ids=["auto-bf16", "fp8-fp8"])
def test_p_in_registers_in_the_engine(cache_dtype, kvb, monkeypatch):
    """fp8 prefill through the gluon backend with P·V's operand in registers (``P_REGS``,
    serial over 256-key blocks: the keys-last default): every K the engine hands attention,
    fused and generic, holds the rows past its end that P_REGS reads, and every launch runs
    it; the two paths give the same bits chunk by chunk; the result is P staged's within
    fp8's bound."""
    backend, why = _triton_backend()
    if backend is None or backend.name != "gluon":
        pytest.skip(f"P_REGS is the gluon kernel's (Hopper): {why or backend.name}")
    from ctxprefill.backends import gluon_attention as ga
    from ctxprefill.backends import triton_attention as ta

    c = dict(contexts=[40000, 9000, 0, 20000, 333], queries=[300, 1000, 20, 700, 5], W=16384, block=64, heads=16,
             blocks=1200)
    eng = make_engine(c, cache_dtype, kvb, "fp8", backend)
    q, seqs = make_request(eng, c)
    assert ta.KEYS_LAST_FP8["WS"]["P_REGS"]
    monkeypatch.setattr(ta, "KEYS_LAST_FP8", dict(ta.KEYS_LAST_FP8, WS=dict(ta.KEYS_LAST_FP8["WS"], P_REGS=False)))
    staged = eng.prefill_context(q, seqs, fused=True)
    monkeypatch.undo()
    launched = []
    real_launch = ga.launch
    signature = inspect.signature(real_launch)

    def launch(*args, **kwargs):  # the config each attention launch ran with
        launched.append(bool(signature.bind(*args, **kwargs).arguments["config"]["P_REGS"]))
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(ga, "launch", launch)
    runs = []
    for fused in (True, False):
        seen, slack = [], []

        def observer(i, chunk, q_c, k, v, o, lse, seen=seen, slack=slack):
            slack.append(ga.rows_readable(k) - k.shape[0])
            seen.append(tuple(t.detach().clone() for t in (q_c, k, v, o, lse)))

        runs.append((eng.prefill_context(q, seqs, fused=fused, observer=observer), seen, slack))
    (fused, fch, fslack), (generic, gch, gslack) = runs
    assert len(fch) == len(gch) == len(fused.stats.chunks) > 1
    assert min(fslack + gslack) >= ga.P_REGS_SLACK_ROWS, (fslack, gslack)
    assert launched and all(launched), launched  # every chunk's attention ran with P in registers
    for i, (a, b) in enumerate(zip(fch, gch)):
        for name, x, y in zip(("q", "k", "v", "out", "lse"), a, b):
            assert int((bits(x) != bits(y)).sum()) == 0, f"chunk {i}: {name} fused != generic"
    assert torch.equal(bits(fused.out), bits(generic.out)) and torch.equal(bits(fused.lse), bits(generic.lse))
    rows = torch.isfinite(staged.lse).all(0)
    assert torch.isfinite(fused.lse[:, rows]).all() and not bool(fused.out.float().isnan().any())
    err = (fused.out.float() - staged.out.float()).abs().max() / staged.out.float().abs().max()
    assert err < 5e-2 and (fused.lse[:, rows] - staged.lse[:, rows]).abs().max() < 5e-2, err



def _gemm_case(prefill: str):
    """The GEMM kernels' engine case (skipped off Hopper): a bf16 cache, 16 heads, chunks of
    16k rows over five sequences, an engine with the kernel backend; (engine, q, seqs)."""
    from ctxprefill.ops import kv_b_proj_gluon as kg

    backend, why = _triton_backend()
    if kg.GLUON_ERR or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"a Hopper kernel: {kg.GLUON_ERR or 'not sm_90'}")
    backend = backend if backend is not None else ReferenceBackend()
    c = dict(contexts=[40000, 9000, 0, 20000, 333], queries=[300, 1000, 20, 700, 5], W=16384, block=64, heads=16,
             blocks=1200)
    eng = make_engine(c, "auto", "bf16", prefill, backend)
    return (eng, *make_request(eng, c))


@pytest.mark.parametrize("prefill", ["bf16", "fp8"])
def test_gluon_gemm_in_the_engine(prefill, monkeypatch):
    """kv_b_proj's GEMM through the persistent Gluon kernel (``kv_b_proj_gemm =
    "gluon"``, bf16 weights): fused and generic give the same bits chunk by chunk, every
    chunk's GEMM ran the kernel, and the result is cuBLAS's within one bf16 rounding of
    k_nope and V (fp8 prefill: within fp8's)."""
    from ctxprefill.ops import kv_b_proj_gluon as kg

    eng, q, seqs = _gemm_case(prefill)
    cublas = eng.prefill_context(q, seqs, fused=True)
    monkeypatch.setattr(eng, "config", dataclasses.replace(eng.config, kv_b_proj_gemm="gluon"))
    calls = []
    real = kg.launch  # what kv_b_proj calls once problem() accepts the operands
    monkeypatch.setattr(kg, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    runs = []
    for fused in (True, False):
        seen: list = []
        runs.append((eng.prefill_context(q, seqs, fused=fused, observer=lambda i, chunk, *t, seen=seen: seen.append(
            tuple(x.detach().clone() for x in t))), seen))
    (fused, fch), (generic, gch) = runs
    assert len(fch) == len(gch) == len(fused.stats.chunks) > 1 and len(calls) == 2 * len(fch)
    for i, (a, b) in enumerate(zip(fch, gch)):
        for name, x, y in zip(("q", "k", "v", "out", "lse"), a, b):
            assert int((bits(x) != bits(y)).sum()) == 0, f"chunk {i}: {name} fused != generic"
    assert torch.equal(bits(fused.out), bits(generic.out)) and torch.equal(bits(fused.lse), bits(generic.lse))
    rows = torch.isfinite(cublas.lse).all(0)
    err = (fused.out.float() - cublas.out.float()).abs().max() / cublas.out.float().abs().max()
    assert err < (5e-2 if prefill == "fp8" else 2e-2), err
    assert (fused.lse[:, rows] - cublas.lse[:, rows]).abs().max() < 5e-2

@pytest.mark.parametrize("prefill", ["bf16", "fp8"])
def test_paged_gemm_in_the_engine(prefill, monkeypatch):
    """kv_b_proj reading the paged cache (``kv_b_proj_gemm = "paged"``, a bf16 cache, 16
    heads): the chunks of one sequence starting on a 64-row page go through the paged GEMM
    and launch no gather, the others through the gather and cuBLAS; fused and generic give the
    same bits chunk by chunk, and every chunk's q, k, v, out and LSE are the bits of the
    gather followed by the same kernel (``"gluon"``), or by cuBLAS."""
    from ctxprefill.ops import kv_b_proj as kvb
    from ctxprefill.ops import kv_b_proj_gluon as kg

    eng, q, seqs = _gemm_case(prefill)
    runs, paged_calls = {}, []
    real = kg.launch_paged
    for gemm in ("cublas", "gluon", "paged"):
        monkeypatch.setattr(eng, "config", dataclasses.replace(eng.config, kv_b_proj_gemm=gemm))
        with monkeypatch.context() as m:
            m.setattr(kg, "launch_paged", lambda *a, **k: paged_calls.append(gemm) or real(*a, **k))
            for fused in (True, False):
                runs[gemm, fused] = record(eng, q, seqs, fused)
    chunks = runs["paged", True][0].stats.chunks
    aligned = [kvb.chunk_reads_cache(ch.context_lens, ch.context_starts) for ch in chunks]
    assert 0 < sum(aligned) < len(chunks), aligned  # the case has chunks of both kinds
    assert paged_calls == ["paged"] * 2 * sum(aligned)
    for fused in (True, False):
        seen = runs["paged", fused][1]
        for i, a in enumerate(seen):
            want = runs["gluon" if aligned[i] else "cublas", fused][1][i]
            for name, x, y in zip(("q", "k", "v", "out", "lse"), a, want):
                assert torch.equal(bits(x), bits(y)), f"chunk {i} (paged: {aligned[i]}): {name} differs"
    (fr, fch), (_, gch) = runs["paged", True], runs["paged", False]
    for i, (a, b) in enumerate(zip(fch, gch, strict=True)):
        for name, x, y in zip(("q", "k", "v", "out", "lse"), a, b):
            assert torch.equal(bits(x), bits(y)), f"chunk {i}: {name} fused != generic"
    assert fr.stats.launches["gather"] == len(chunks) - sum(aligned)  # a paged chunk launches no gather


UNPACKED_COMBOS = list(itertools.product(["auto", "fp8", "fp8_ds_mla"], ["bf16", "fp8"]))


@pytest.mark.parametrize("cache_dtype,kvb", UNPACKED_COMBOS, ids=["-".join(c) for c in UNPACKED_COMBOS])
@pytest.mark.parametrize("case", list(CASES) + ["long"])
def test_unpacked_keys_with_triton_equal_generic(case, cache_dtype, kvb):
    """bf16 prefill with the kernel backend (gluon on Hopper, else triton): the fused path
    packs no K (attention reads k_nope from the kv_b_proj output and k_pe from the
    workspace, a 0 head stride) and gives, chunk by chunk, the generic path's out and LSE
    bit for bit — and the fused path with its K pack (unpacked_keys=False) the same; no
    pack launch when unpacked."""
    backend, why = _triton_backend()
    if backend is None:
        pytest.skip(f"Triton backend unavailable: {why}")
    c = CASES.get(case) or dict(contexts=[40000, 9000, 0, 20000], queries=[300, 1000, 20, 700], W=16384, block=64,
                                heads=16, blocks=1100)
    eng = make_engine(c, cache_dtype, kvb, "bf16", backend)
    q, seqs = make_request(eng, c)
    fused, fch = record(eng, q, seqs, fused=True)
    generic, gch = record(eng, q, seqs, fused=False)
    seen = []
    packed = eng.prefill_context(q, seqs, fused=True, unpacked_keys=False,
                                 observer=lambda i, ch, *t: seen.append(tuple(x.detach().clone() for x in t)))
    assert fused.stats.unpacked_keys and not packed.stats.unpacked_keys and not generic.stats.unpacked_keys
    n = len(fused.stats.chunks)
    assert fused.stats.launches["pack"] == 0 and packed.stats.launches["pack"] == n
    assert len(fch) == len(gch) == len(seen) == n
    for i, (a, b, p) in enumerate(zip(fch, gch, seen)):
        for name, x, y, z in zip(("q", "k", "v", "out", "lse"), a, b, p):
            assert x.shape == y.shape == z.shape, (i, name)
            assert int((bits(x) != bits(y)).sum()) == 0, f"chunk {i}: {name} unpacked != generic"
            assert int((bits(z) != bits(y)).sum()) == 0, f"chunk {i}: {name} packed != generic"
    for r in (fused, packed):
        assert torch.equal(bits(r.out), bits(generic.out)) and torch.equal(bits(r.lse), bits(generic.lse))
    assert not bool(fused.out.float().isnan().any())
