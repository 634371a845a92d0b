"""Fused vs generic, chunk by chunk, bit for bit (CONTRACT §5, §10) — on the CPU.

The seed's method: q, k, v handed to attention and each chunk's output and LSE must
be identical between the paths, and so must the merged result, for every
combination of cache dtype × kv_b_proj dtype × out mode × prefill dtype.
"""

import dataclasses
import itertools

import pytest
import torch

from ctxprefill.backends.base import HostLaunchOrder
from ctxprefill.backends.reference import ReferenceBackend
from ctxprefill_bench.workload import make_request
from engine_helpers import bits, make_engine, record_chunks

COMBOS = list(itertools.product(["auto", "fp8", "fp8_ds_mla"], ["bf16", "fp8"], [True, False], ["bf16", "fp8"]))
CASES = {
    # the seed's case: continuation chunk, an empty sequence, W = 128, block 16, H = 2
    "seed": dict(contexts=[200, 48, 32, 0], queries=[8, 4, 6, 5], W=128, block=16, heads=2, blocks=64),
    # larger: several continuations, empty sequences in the middle and at the ends
    "larger": dict(contexts=[0, 700, 0, 65, 300, 0, 1, 130], queries=[3, 9, 2, 1, 7, 4, 5, 2], W=192, block=32,
                   heads=3, blocks=64),
    # one chunk, no empty row: the fast path without an accumulator
    "single": dict(contexts=[40, 17], queries=[5, 3], W=128, block=16, heads=4, blocks=16),
}


def run_case(case, cache_dtype, kvb, honor_out, prefill, scale_kind="block"):
    c = CASES[case]
    eng = make_engine(cache_dtype, kvb, prefill, heads=c["heads"], block_size=c["block"], num_blocks=c["blocks"],
                      workspace_tokens=c["W"], honor_out=honor_out, scale_kind=scale_kind)
    q, seqs = make_request(eng, c["contexts"], c["queries"], seed=1)
    fused, fchunks = record_chunks(eng, q, seqs, fused=True)
    generic, gchunks = record_chunks(eng, q, seqs, fused=False)
    return eng, fused, fchunks, generic, gchunks


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cache_dtype,kvb,honor_out,prefill", COMBOS)
def test_fused_equals_generic_chunk_by_chunk(case, cache_dtype, kvb, honor_out, prefill):
    eng, fused, fchunks, generic, gchunks = run_case(case, cache_dtype, kvb, honor_out, prefill)
    assert len(fchunks) == len(gchunks) == len(fused.stats.chunks) > 0
    names = ("q", "k", "v", "out", "lse")
    for i, (a, b) in enumerate(zip(fchunks, gchunks)):
        for name, x, y in zip(names, a, b):
            assert x.dtype == y.dtype and x.shape == y.shape, (i, name)
            assert torch.equal(bits(x), bits(y)), f"chunk {i}: {name} differs"
        if prefill == "fp8":
            assert a[1].dtype == torch.float8_e4m3fn and a[2].dtype == torch.float8_e4m3fn
    assert torch.equal(bits(fused.out), bits(generic.out))
    assert torch.equal(bits(fused.lse), bits(generic.lse))
    # exactly one pack launch per chunk on the fused path; more on the generic one when fp8
    n = len(fused.stats.chunks)
    assert fused.stats.launches["pack"] == n
    assert generic.stats.launches["pack"] == (5 * n if prefill == "fp8" else n)
    for st in (fused.stats, generic.stats):
        assert st.fp8_path == {"cache_dtype": cache_dtype, "kv_b_proj_dtype": kvb, "prefill_dtype": prefill}
    if case == "seed":
        assert [c.is_continuation for c in fused.stats.chunks] == [False, True, False]


@pytest.mark.parametrize("prefill", ["bf16", "fp8"])
def test_fp8_per_tensor_weights_fused_equals_generic(prefill):
    """fp8 weights with a scalar scale take the exact-bf16 GEMM; block scales the fp32 one."""
    eng, fused, fchunks, generic, gchunks = run_case("seed", "fp8", "fp8", True, prefill, scale_kind="tensor")
    assert eng.weights.compute.dtype == torch.bfloat16
    assert torch.equal(bits(fused.out), bits(generic.out)) and torch.equal(bits(fused.lse), bits(generic.lse))
    eng2 = run_case("seed", "fp8", "fp8", True, prefill, scale_kind="block")[0]
    assert eng2.weights.compute.dtype == torch.float32


def test_out_modes_agree_bit_for_bit():
    """Writing straight into out[token_slice] or copying a backend's own result is the same."""
    _, a, *_ = run_case("larger", "fp8_ds_mla", "bf16", True, "bf16")
    _, b, *_ = run_case("larger", "fp8_ds_mla", "bf16", False, "bf16")
    assert torch.equal(bits(a.out), bits(b.out)) and torch.equal(bits(a.lse), bits(b.lse))


class LyingBackend(ReferenceBackend):
    """Claims caps.supports_out but returns a buffer of its own."""

    def run_context_chunk(self, *args, out=None, **kw):
        return super().run_context_chunk(*args, out=None, **kw)


def test_backend_that_ignores_out_fails_loudly():
    c = CASES["seed"]
    eng = make_engine(workspace_tokens=c["W"], backend=LyingBackend(honor_out=True))
    q, seqs = make_request(eng, c["contexts"], c["queries"])
    with pytest.raises(RuntimeError, match="did not write into the out buffer"):
        eng.prefill_context(q, seqs)


def test_single_chunk_returns_backend_result_directly():
    c = CASES["single"]
    eng = make_engine(heads=c["heads"], workspace_tokens=c["W"], num_blocks=c["blocks"])
    q, seqs = make_request(eng, c["contexts"], c["queries"])
    r = eng.prefill_context(q, seqs)
    assert len(r.stats.chunks) == 1
    assert "merge" not in r.stats.launches  # no accumulator: no fill, copy or merge


def test_rows_without_context_are_exactly_zero_and_minus_inf():
    eng = make_engine(workspace_tokens=128)
    q, seqs = make_request(eng, [0, 50, 0], [3, 2, 4])
    r = eng.prefill_context(q, seqs)
    for rows in (slice(0, 3), slice(5, 9)):
        assert bool((r.out[rows] == 0).all()) and not torch.signbit(r.out[rows].float()).any()
        assert bool((r.lse[:, rows] == float("-inf")).all())
    assert bool(torch.isfinite(r.lse[:, 3:5]).all())


def test_no_context_at_all():
    eng = make_engine()
    q, seqs = make_request(eng, [0, 0], [2, 1])
    r = eng.prefill_context(q, seqs)
    assert r.stats.chunks == [] and bool((r.out == 0).all()) and bool((r.lse == float("-inf")).all())


def test_fresh_sequence_inside_a_continuation_chunk_starts_from_zero():
    """contexts [200, 0, 32], W=128: chunk 2 is a continuation of seq 0 that also holds
    all of seq 2 — seq 2's rows are reached only by a merge, so they must be
    initialised to 0 / -inf first (a trap for planners of this shape)."""
    from ctxprefill_bench.reference64 import prefill_context_float64
    from ctxprefill_bench.workload import relative_error

    eng = make_engine(workspace_tokens=128)
    q, seqs = make_request(eng, [200, 0, 32], [4, 2, 3])
    r = eng.prefill_context(q, seqs)
    assert r.stats.chunks[1].is_continuation and 2 in r.stats.chunks[1].sequences
    ref_out, ref_lse = prefill_context_float64(eng, q, seqs)
    assert relative_error(r.out[6:], ref_out[6:]) < 1e-2


def test_caller_plan_listing_an_empty_sequence_twice_still_initialises_the_rest():
    """A caller's plan may list a context-less sequence in two chunks; their row slices
    then overlap, and the rows no chunk reaches (sequence 3) must still be 0 / -inf."""
    from ctxprefill.engine.plan import ContextChunk

    eng = make_engine(workspace_tokens=64)
    q, seqs = make_request(eng, [10, 0, 5, 0], [2, 2, 2, 2])
    plan = [ContextChunk(0, (0, 0), (10, 0)), ContextChunk(1, (0, 0), (0, 5))]
    r = eng.prefill_context(q, seqs, plan=plan)
    assert bool((r.out[6:] == 0).all()) and bool((r.lse[:, 6:] == float("-inf")).all())
    assert bool(torch.isfinite(r.lse[:, :2]).all()) and bool(torch.isfinite(r.lse[:, 4:6]).all())


class KeysLastReference(ReferenceBackend):
    """The reference attention behind the keys-last V interface (what the kernel backends
    take for fp8): V [H, 128, columns], segment s from column cu_seqlens_v[s]."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.caps = dataclasses.replace(self.caps, v_keys_last=frozenset({torch.float8_e4m3fn}))
        self.layouts = []

    def run_context_chunk(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, *, out=None, causal=False, k_rope=None,
                          v_layout="thd", cu_seqlens_v=None, launch_order=None):
        if v_layout == "hdt":
            cu_v = cu_seqlens_v.tolist()
            assert all(c % 16 == 0 for c in cu_v), cu_v  # 16-byte aligned fp8 segment starts
            self.layouts.append((cu_k.tolist(), cu_v, v.shape[-1]))
            thd = torch.empty((k.shape[0], v.shape[0], v.shape[1]), dtype=v.dtype)
            for a, b, c in zip(cu_k.tolist(), cu_k.tolist()[1:], cu_v):
                thd[a:b] = v[:, :, c : c + b - a].permute(2, 0, 1)
            v = thd
        else:
            assert cu_seqlens_v is None
        return super().run_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, scale, out=out, causal=causal,
                                         k_rope=k_rope, launch_order=launch_order)


@pytest.mark.parametrize("case", ["seed", "larger", "single"])
@pytest.mark.parametrize("cache_dtype,kvb", [("auto", "bf16"), ("fp8", "fp8"), ("fp8_ds_mla", "bf16")])
def test_keys_last_v_fused_equals_generic_and_the_row_major_result(case, cache_dtype, kvb):
    """fp8 prefill with a backend that reads V keys-last: both packs write the same
    [H, 128, columns] bytes (each segment from a 16-aligned column, zeros between), the
    fused one in one launch; the result is bit-identical to V given row-major."""
    c = CASES[case]
    kw = dict(heads=c["heads"], block_size=c["block"], num_blocks=c["blocks"], workspace_tokens=c["W"])
    be = KeysLastReference(honor_out=True)
    eng = make_engine(cache_dtype, kvb, "fp8", backend=be, **kw)
    q, seqs = make_request(eng, c["contexts"], c["queries"], seed=1)
    fused, fchunks = record_chunks(eng, q, seqs, fused=True)
    generic, gchunks = record_chunks(eng, q, seqs, fused=False)
    n = len(fused.stats.chunks)
    assert len(be.layouts) == 2 * n > 0
    for i, (a, b) in enumerate(zip(fchunks, gchunks)):
        assert a[2].dim() == 3 and a[2].shape[:2] == (c["heads"], 128), "v keys-last"
        for name, x, y in zip(("q", "k", "v", "out", "lse"), a, b):
            assert x.shape == y.shape and torch.equal(bits(x), bits(y)), f"chunk {i}: {name} differs"
    assert torch.equal(bits(fused.out), bits(generic.out)) and torch.equal(bits(fused.lse), bits(generic.lse))
    eng.backend = ReferenceBackend(honor_out=True)  # the same cache, V row-major
    row_major = eng.prefill_context(q, seqs)
    assert torch.equal(bits(fused.out), bits(row_major.out)) and torch.equal(bits(fused.lse), bits(row_major.lse))
    # one pack launch per chunk fused; generic: 5 + a fill + one copy per non-empty segment
    assert fused.stats.launches["pack"] == n
    segs = sum(sum(1 for x in ch.context_lens if x > 0) for ch in fused.stats.chunks)
    assert generic.stats.launches["pack"] == 6 * n + segs


class OrderedReference(ReferenceBackend):
    """The reference attention with a launch order (as the gluon backend has one): codes
    made from the chunk's lengths, so that the test can tell them apart."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.caps = dataclasses.replace(self.caps, launch_order=True)
        self.asked, self.given = [], []

    def launch_order(self, q_lens, k_lens, heads, q_dtype, device):
        self.asked.append((list(q_lens), list(k_lens), heads, q_dtype))
        if len(q_lens) < 2:
            return None
        return HostLaunchOrder(tuple(1000 * q + k for q, k in zip(q_lens, k_lens, strict=True)), len(q_lens))

    def run_context_chunk(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, *, launch_order=None, **kw):
        self.given.append(None if launch_order is None else (launch_order.codes.tolist(), launch_order.m_tiles,
                                                                  launch_order.codes.dtype, launch_order.codes.device))
        return super().run_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, scale, **kw)


def test_launch_order_asked_per_chunk_and_given_on_the_device():
    """The engine asks the backend for a launch order per chunk with the chunk's host-side
    lengths (after launching the chunk's gather, kv_b_proj and pack), copies it to the
    device, and hands it to that chunk's attention call; where it gives none (None) the
    call has none; a backend without caps.launch_order is never asked. The result does
    not change."""
    c = CASES["larger"]
    kw = dict(heads=c["heads"], block_size=c["block"], num_blocks=c["blocks"], workspace_tokens=c["W"])
    be = OrderedReference(honor_out=True)
    eng = make_engine(backend=be, **kw)
    q, seqs = make_request(eng, c["contexts"], c["queries"], seed=1)
    r = eng.prefill_context(q, seqs)
    chunks = r.stats.chunks
    assert len(be.asked) == len(be.given) == len(chunks) > 1
    for ch, asked, given in zip(chunks, be.asked, be.given):
        q_lens = [c["queries"][s] for s in ch.sequences]
        assert asked == (q_lens, list(ch.context_lens), c["heads"], q.dtype)
        if len(q_lens) < 2:
            assert given is None
        else:
            assert given == ([1000 * a + b for a, b in zip(q_lens, ch.context_lens)], len(q_lens), torch.int32,
                             q.device)
    assert any(g is not None for g in be.given)
    be.asked.clear()
    be.caps = dataclasses.replace(be.caps, launch_order=False)  # not a capability: never asked
    r2 = eng.prefill_context(q, seqs)
    assert be.asked == [] and be.given[-len(chunks):] == [None] * len(chunks)
    eng.backend = ReferenceBackend(honor_out=True)  # the same cache, no launch order
    plain = eng.prefill_context(q, seqs)
    for x in (r, r2):
        assert torch.equal(bits(x.out), bits(plain.out)) and torch.equal(bits(x.lse), bits(plain.lse))


class _CapturedReference(ReferenceBackend):
    """The reference attention noting each call's ``captured`` (with or without the caps'
    ``graph_variants``)."""

    def __init__(self, graph_variants: bool):
        super().__init__(honor_out=True)
        self.caps = dataclasses.replace(self.caps, graph_variants=graph_variants)
        self.given = []

    def run_context_chunk(self, *args, **kw):
        self.given.append(kw.get("captured", "absent"))
        return super().run_context_chunk(*args, **kw)


@pytest.mark.parametrize("graph_variants", [False, True])
def test_a_captured_loop_tells_attention_only_where_its_caps_take_it(graph_variants):
    """start_chunk_loop(captured=True), as engine/graphs.py records a loop: every chunk's
    attention call gets ``captured=True`` where the backend's caps have ``graph_variants``,
    none at all otherwise (a backend refuses what its caps rule out), and an eager loop
    never; the result is the same bits."""
    from ctxprefill.engine.engine import PrefillRequest, validate_prefill
    from ctxprefill.engine.loop import start_chunk_loop

    c = CASES["larger"]
    be = _CapturedReference(graph_variants)
    eng = make_engine(backend=be, heads=c["heads"], block_size=c["block"], num_blocks=c["blocks"],
                      workspace_tokens=c["W"])
    q, seqs = make_request(eng, c["contexts"], c["queries"], seed=2)
    checked = validate_prefill(PrefillRequest(q, seqs), eng.config, eng.instance_id)
    got = [start_chunk_loop(eng.loop_inputs(checked), be, True, captured=cap).finish() for cap in (True, False)]
    n = len(checked.chunks)
    assert n > 1 and be.given == [True if graph_variants else "absent"] * n + ["absent"] * n
    assert torch.equal(bits(got[0].out), bits(got[1].out)) and torch.equal(bits(got[0].lse), bits(got[1].lse))
    if not graph_variants:
        with pytest.raises(ValueError, match="graph_variants"):
            be.run_context_chunk(q, q, q[..., :128], *[torch.zeros(2, dtype=torch.int32)] * 2, 1, 1, 1.0,
                                 captured=True)


class _RecordingUnpacked(ReferenceBackend):
    """The reference backend reading the keys unpacked; notes what each call was given."""

    def __init__(self, honor_out: bool):
        super().__init__(honor_out=honor_out, unpacked_keys=True)
        self.calls = []

    def run_context_chunk(self, q, k, v, *args, k_rope=None, **kw):
        self.calls.append((tuple(k.shape), None if k_rope is None else (tuple(k_rope.shape), k_rope.stride(1))))
        return super().run_context_chunk(q, k, v, *args, k_rope=k_rope, **kw)


@pytest.mark.parametrize("case", ["seed", "larger", "single"])
# every dtype combination with out honoured; the other out mode on the fp8 cache only (the
# unpacked keys change nothing in the accumulation, which test above covers in full)
@pytest.mark.parametrize("cache_dtype,kvb,honor_out,prefill", [c for c in COMBOS if c[2] or c[0] == "fp8"])
def test_unpacked_keys_equal_generic_chunk_by_chunk(case, cache_dtype, kvb, honor_out, prefill):
    """Fused path with a backend that reads the keys unpacked: bf16 prefill packs no K (no pack
    stage, no pack launch; attention gets k_nope [rows, H, 128] and k_pe with a 0 head
    stride) and equals the generic path chunk by chunk, bit for bit; fp8 prefill still
    packs (it quantizes); unpacked_keys=False packs K with the fused kernel, same bits."""
    c = CASES[case]
    be = _RecordingUnpacked(honor_out)
    eng = make_engine(cache_dtype, kvb, prefill, heads=c["heads"], block_size=c["block"], num_blocks=c["blocks"],
                      workspace_tokens=c["W"], backend=be)
    q, seqs = make_request(eng, c["contexts"], c["queries"], seed=1)
    generic, gchunks = record_chunks(eng, q, seqs, fused=False)
    assert all(rope is None for _, rope in be.calls), "the generic path packs K"
    be.calls.clear()
    fused, fchunks = record_chunks(eng, q, seqs, fused=True)
    packed, pchunks = record_chunks(eng, q, seqs, fused=True, unpacked_keys=False)
    n = len(fused.stats.chunks)
    H = c["heads"]
    if prefill == "bf16":
        assert fused.stats.unpacked_keys and not packed.stats.unpacked_keys and not generic.stats.unpacked_keys
        assert fused.stats.launches["pack"] == 0 and "pack" not in fused.stats.stage_ns
        assert [k for k, _ in be.calls[:n]] == [(ch.rows, H, 128) for ch in fused.stats.chunks]
        assert [r for _, r in be.calls[:n]] == [((ch.rows, H, 64), 0) for ch in fused.stats.chunks]
    else:
        assert not fused.stats.unpacked_keys and fused.stats.launches["pack"] == n
        assert all(rope is None for _, rope in be.calls[:n])
    assert all(rope is None for _, rope in be.calls[n:]), "unpacked_keys=False packs K"
    assert packed.stats.launches["pack"] == n
    for chunks in (fchunks, pchunks):
        assert len(chunks) == len(gchunks) == n
        for i, (a, b) in enumerate(zip(chunks, gchunks)):
            for name, x, y in zip(("q", "k", "v", "out", "lse"), a, b):
                assert x.dtype == y.dtype and x.shape == y.shape, (i, name)
                assert torch.equal(bits(x), bits(y)), f"chunk {i}: {name} differs"
    for r in (fused, packed):
        assert torch.equal(bits(r.out), bits(generic.out)) and torch.equal(bits(r.lse), bits(generic.lse))
