"""The chunk loop replayed as a CUDA graph (engine/graphs.py) gives the eager loop's bits.

A shape runs eagerly the first time, is captured the second, and replays from the third:
out and LSE equal the eager loop's bit for bit over cache {auto, fp8, fp8_ds_mla} x
kv_b_proj {bf16, fp8} x prefill {bf16, fp8}, on a ragged request (continuation chunks,
empty sequences) and a long one in 4 chunks; a request of the same shape with other
block ids, cache contents and q replays with its own values; requests that need the
eager loop (an observer) get it; at most ``max_graphs`` shapes are kept.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import time
from collections import Counter

import pytest
import torch

from ctxprefill.backends import registry
from ctxprefill.config import CacheConfig, EngineConfig, ModelShape
from ctxprefill.engine.engine import Engine, SequenceSpec
from ctxprefill.engine.graphs import GRAPH_STAGE
from ctxprefill.errors import OutOfRange
from ctxprefill.weights import prepare, random_kv_b_proj
from ctxprefill_client import slot_mapping

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device: the GPU engine tests run on the GPU machine")]

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
CASES = {
    "ragged": dict(contexts=[3000, 0, 1500, 64, 700, 1, 0, 2100], queries=[17, 5, 9, 3, 12, 1, 4, 30], W=1024,
                   block=64, heads=16, blocks=400),
    "long": dict(contexts=[16384], queries=[256], W=4096, block=64, heads=16, blocks=300),
}
COMBOS = list(itertools.product(["auto", "fp8", "fp8_ds_mla"], ["bf16", "fp8"], ["bf16", "fp8"]))


@pytest.fixture(autouse=True)
def _ext(cuda_ext):
    return cuda_ext


def make_engine(c: dict, cache_dtype: str, kvb: str, prefill: str, layers: int = 1, gemm: str = "cublas") -> Engine:
    shape = ModelShape(heads=c["heads"])
    ws = []
    for seed in range(layers):
        t = random_kv_b_proj(shape, kvb, seed=seed)
        ws.append(prepare(kvb, t["kv_b_proj.weight"], t.get("kv_b_proj.weight_scale_inv")))
    k_scale = 1.0 if (cache_dtype == "fp8" and prefill == "fp8") else 0.5
    cfg = EngineConfig(shape=shape, cache=CacheConfig(cache_dtype, c["block"], c["blocks"], k_scale),
                       kv_b_proj_dtype=kvb, prefill_dtype=prefill, workspace_tokens=c["W"], cuda_graphs=True,
                       num_layers=layers, kv_b_proj_gemm=gemm)
    w = ws[0] if layers == 1 else ws
    q_dtype = FP8 if prefill == "fp8" else torch.bfloat16
    backend, _ = registry.create("auto", DEV, q_dtype)  # the kernel backend served here (gluon on Hopper)
    return Engine(cfg, w, DEV, backend=backend)


def make_request(engine: Engine, c: dict, seed: int, layer: int | None = None):
    """Every sequence's context written into shuffled blocks of ``layer``'s cache (another
    seed: other blocks, other values, the same shape); a matching q on the device."""
    bs = engine.config.cache.block_size
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / bs) for n in c["contexts"]]
    perm = torch.randperm(engine.config.cache.num_blocks, generator=g)[: sum(need)].tolist()
    seqs, at = [], 0
    for n, nb, qn in zip(c["contexts"], need, c["queries"]):
        blocks = perm[at : at + nb]
        at += nb
        if n:
            engine.write_cache(torch.from_numpy(slot_mapping(blocks, 0, n, bs)), torch.randn((n, 512), generator=g),
                               torch.randn((n, 64), generator=g), layer=layer)
        seqs.append(SequenceSpec(qn, n, blocks))
    q = torch.randn((sum(c["queries"]), c["heads"], 192), generator=g)
    q = q.clamp(-448, 448).to(FP8) if engine.config.prefill_dtype == "fp8" else q.to(torch.bfloat16)
    return q.to(DEV), seqs


def same_bits(a, b) -> bool:
    return torch.equal(a.out.view(torch.int16), b.out.view(torch.int16)) and \
        torch.equal(a.lse.view(torch.int32), b.lse.view(torch.int32))


@pytest.mark.parametrize("cache_dtype,kvb,prefill", COMBOS, ids=["-".join(c) for c in COMBOS])
@pytest.mark.parametrize("case", list(CASES))
def test_replay_equals_the_eager_loop_bit_for_bit(case, cache_dtype, kvb, prefill):
    c = CASES[case]
    eng = make_engine(c, cache_dtype, kvb, prefill)
    q, seqs = make_request(eng, c, seed=1)
    eager = eng.prefill_context(q, seqs, graphs_on=False)
    runs = [eng.prefill_context(q, seqs) for _ in range(3)]  # eager, eager + capture, replay
    assert eng.graphs is not None and (eng.graphs.captures, eng.graphs.replays) == (1, 1)
    assert [GRAPH_STAGE in r.stats.stage_ns for r in runs] == [False, False, True]
    assert set(runs[2].stats.stage_ns) == {GRAPH_STAGE} and runs[2].stats.stage_ns[GRAPH_STAGE] > 0
    for r in runs:
        assert same_bits(r, eager)
    # the capture found q's, out's and LSE's arguments and checked a replay in place: the
    # replay's launches are the captured loop's alone (no copies out)
    [loop] = eng.graphs._graphs.values()
    assert loop.in_place and all(loop.patch.counts), loop.copies_because
    assert dict(runs[2].stats.launches) == dict(eager.stats.launches)
    # each argument found, named: what counts and descriptor_counts count
    sites = loop.patch.sites
    for b, (n, nd) in enumerate(zip(loop.patch.counts, loop.patch.descriptor_counts, strict=True)):
        assert [len([x for x in sites if x["buffer"] == b and x["descriptor"] == d]) for d in (False, True)] \
            == [n - nd, nd], (b, sites)
    assert all(x["kernel"] and (x["offset"] >= 0) != (x["kernel"] in ("memcpy", "memset")) for x in sites), sites
    assert all((x["size"] > 0) == (x["offset"] >= 0) for x in sites), sites
    assert all(x["probe"] == -1 for x in sites if x["descriptor"] or x["offset"] < 0), sites
    # another request of the same shape (other blocks, cache contents, q) replays with its values
    q2, seqs2 = make_request(eng, c, seed=2)
    assert [s.block_table for s in seqs2] != [s.block_table for s in seqs]
    eager2 = eng.prefill_context(q2, seqs2, graphs_on=False)
    replay2 = eng.prefill_context(q2, seqs2)
    assert eng.graphs.replays == 2 and same_bits(replay2, eager2) and not same_bits(eager2, eager)
    # one sequence: both replays took the quick path (the shape's checks and metadata remembered)
    assert eng.quick_replays == (2 if len(c["contexts"]) == 1 else 0)


def test_the_replays_result_outlives_the_next_replay():
    """A result taken after the next request replays the same graph is still its own
    (the service answers a request after starting the next), and the next request's
    metadata waits for the first one's copy out of the page-locked staging: the device is
    held behind a spin kernel so that the first one's copies in are still queued when the
    second one's metadata (other block ids) is written."""
    c = CASES["long"]
    eng = make_engine(c, "auto", "bf16", "bf16")
    q, seqs = make_request(eng, c, seed=1)
    for _ in range(2):
        eng.prefill_context(q, seqs)
    q2, seqs2 = make_request(eng, c, seed=2)
    assert [s.block_table for s in seqs2] != [s.block_table for s in seqs]
    eager = eng.prefill_context(q, seqs, graphs_on=False)
    eager2 = eng.prefill_context(q2, seqs2, graphs_on=False)
    torch.cuda._sleep(50_000_000)  # ~25 ms of device time ahead of the two requests
    first = eng.prefill_context_start(q, seqs)
    second = eng.prefill_context_start(q2, seqs2)
    assert same_bits(first.result(), eager) and same_bits(second.result(), eager2)
    assert eng.graphs is not None and eng.graphs.replays == 2


def test_contiguous_replays_launch_through_the_extension(cuda_ext):
    """A contiguous, aligned q's replay is queued by the extension's GraphPatch.launch (the
    arguments pointed at q, out and LSE, the metadata's copy, the stage's start, the graph)
    and copies_async (the stage's end); with in-place replays off, by graph_launch (the copies
    in, the stage's start, the graph) and copies_async (the copies out, the stage's end).
    Both return the time the copies were queued on time.perf_counter's clock, and refuse a
    null handle before queuing."""
    c = CASES["long"]
    eng = make_engine(c, "auto", "bf16", "bf16")
    q, seqs = make_request(eng, c, seed=1)
    eager = eng.prefill_context(q, seqs, graphs_on=False)
    runs = [eng.prefill_context(q, seqs) for _ in range(2)]
    assert eng.graphs is not None
    [loop] = eng.graphs._graphs.values()
    assert loop.launch is cuda_ext.graph_launch and loop._exec != 0
    assert isinstance(loop.patch, cuda_ext.GraphPatch) and loop.launch_in_place == loop.patch.launch and loop.in_place
    times = []

    def timing(call):
        def timed(*args):
            t0 = time.perf_counter()
            queued = call(*args)
            times.append((t0, queued, time.perf_counter()))
            return queued
        return timed

    loop.launch, loop.launch_in_place = timing(cuda_ext.graph_launch), timing(loop.patch.launch)
    runs.append(eng.prefill_context(q, seqs))
    loop.copies_because = "copying, as the test asks"
    runs.append(eng.prefill_context(q, seqs))
    assert len(times) == 2
    for t0, queued, t1 in times:
        assert isinstance(queued, float) and t0 <= queued <= t1, times
    for r in runs[2:]:
        assert same_bits(r, eager) and r.stats.stage_ns[GRAPH_STAGE] > 0
    assert runs[2].stats.launches.get(GRAPH_STAGE, 0) == 0 and runs[3].stats.launches[GRAPH_STAGE] == 2
    with pytest.raises(ValueError, match="handles"):
        cuda_ext.graph_launch([], 0, 0, loop._exec, 0)
    with pytest.raises(ValueError, match="handles"):
        loop.patch.launch(loop.captured, [], 0, 0, loop._exec, 0)


def test_in_place_replays_read_the_requests_q_and_write_new_tensors(cuda_ext):
    """After the capture, the graph's own q buffer is never read by an in-place replay
    (overwritten here, the answers stay the eager loop's) and each result is a tensor of
    its own; a q off the 256-byte alignment replays copying, with the arguments pointed back
    at the graph's buffers, and the next aligned q in place again. GraphPatch refuses bases
    off the captured alignment and buffers that are not (base, bytes) pairs."""
    c = CASES["long"]
    eng = make_engine(c, "auto", "bf16", "bf16")
    q, seqs = make_request(eng, c, seed=1)
    for _ in range(2):
        eng.prefill_context(q, seqs)
    assert eng.graphs is not None
    [loop] = eng.graphs._graphs.values()
    assert loop.in_place
    loop.q.fill_(7.0)
    q2, seqs2 = make_request(eng, c, seed=2)
    eager2 = eng.prefill_context(q2, seqs2, graphs_on=False)
    a, b = eng.prefill_context(q2, seqs2), eng.prefill_context(q2, seqs2)
    assert same_bits(a, eager2) and same_bits(b, eager2)
    assert len({a.out.data_ptr(), b.out.data_ptr(), loop.out.data_ptr()}) == 3
    big = torch.empty(q2.numel() + 256, dtype=q2.dtype, device=DEV)
    off = big[64:64 + q2.numel()].view(q2.shape)  # 128 bytes past an allocation's start
    off.copy_(q2)
    assert off.data_ptr() % 256 and not loop.takes_in_place(off)
    copied = eng.prefill_context(off, seqs2)
    assert same_bits(copied, eager2) and copied.stats.launches[GRAPH_STAGE] == 2
    assert same_bits(eng.prefill_context(q2, seqs2), eager2)
    assert eng.graphs.replays == 4
    with pytest.raises(ValueError, match="alignment"):
        loop.patch.apply([loop.captured[0] + 16, *loop.captured[1:]])
    with pytest.raises(ValueError, match="pairs"):
        cuda_ext.GraphPatch(loop.graph.raw_cuda_graph(), loop._exec, [1, 2, 3])


def test_a_strided_q_replays_through_torchs_copy(cuda_ext):
    """The replay takes q in with the extension's raw copy where q is contiguous, and with
    torch's copy otherwise: a strided q of the same shape replays with its own values.
    The raw copy refuses what is not (dst, src, bytes) triples of addresses."""
    c = CASES["long"]
    eng = make_engine(c, "auto", "bf16", "bf16")
    q, seqs = make_request(eng, c, seed=1)
    for _ in range(3):
        eng.prefill_context(q, seqs)
    strided = torch.cat([q, q.flip(0)], dim=1)[:, q.shape[1]:]  # rows of 2H heads, the second half
    assert not strided.is_contiguous()
    eager = eng.prefill_context(strided, seqs, graphs_on=False)
    replay = eng.prefill_context(strided, seqs)
    assert eng.graphs is not None and eng.graphs.replays == 2 and same_bits(replay, eager)
    with pytest.raises(ValueError, match="triples"):
        cuda_ext.copies_async([1, 2], 0)
    with pytest.raises(ValueError, match="null address"):
        cuda_ext.copies_async([0, q.data_ptr(), 16], 0)


@pytest.mark.parametrize("kvb,prefill", [("bf16", "bf16"), ("fp8", "fp8")])
def test_one_graph_serves_every_layer(kvb, prefill):
    """An engine's layers are one cache allocation: a shape captured on one layer replays
    for the others with their own weight, cache and block ids, bit for bit their eager
    loops; the graphs of every shape share one memory pool."""
    c = CASES["ragged"]
    eng = make_engine(c, "auto", kvb, prefill, layers=3)
    assert eng.graphs is not None and eng.graphs.cache is eng.cache_storage
    reqs = [make_request(eng, c, seed=10 + layer, layer=layer) for layer in range(3)]
    eager = [eng.prefill_context(q, seqs, layer=layer, graphs_on=False) for layer, (q, seqs) in enumerate(reqs)]
    assert not same_bits(eager[0], eager[1])  # other weights, caches and queries
    # 0 eager, 1 eager + capture, then replays: a layer again (its weight already in the
    # graph's buffer, not copied) and back to another (copied)
    order = [0, 1, 2, 2, 0, 0, 1, 2, 2]
    runs = [eng.prefill_context(*reqs[layer], layer=layer) for layer in order]
    assert (eng.graphs.captures, eng.graphs.replays) == (1, 7) and eng.quick_replays == 0  # ragged: in full
    for layer, r in zip(order, runs, strict=True):
        assert same_bits(r, eager[layer]), layer
    [loop] = eng.graphs._graphs.values()
    assert loop.holds == eng.layer_weights[2].compute.data_ptr()
    # another shape (one context block shorter) captured into the same pool replays too
    shorter = [SequenceSpec(s.query_len, max(0, s.context_len - 64), s.block_table) for s in reqs[2][1]]
    want = eng.prefill_context(reqs[2][0], shorter, layer=2, graphs_on=False)
    got = [eng.prefill_context(reqs[2][0], shorter, layer=layer) for layer in (0, 1, 2)]
    assert eng.graphs.captures == 2 and same_bits(got[2], want)
    assert same_bits(eng.prefill_context(*reqs[0], layer=0), eager[0])  # the first shape still replays


def test_paged_gemm_replays_every_layer_bit_for_bit():
    """``--kv-b-proj-gemm paged``: a captured loop whose GEMM reads each chunk's latents from
    the cache (no gather launched) replays, layer after layer, the bits of its eager loop."""
    from ctxprefill.ops import kv_b_proj_gluon as kg

    if kg.GLUON_ERR or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"a Hopper kernel: {kg.GLUON_ERR or 'not sm_90'}")
    c = CASES["long"]
    eng = make_engine(c, "auto", "bf16", "bf16", layers=3, gemm="paged")
    reqs = [make_request(eng, c, seed=20 + layer, layer=layer) for layer in range(3)]
    eager = [eng.prefill_context(q, seqs, layer=layer, graphs_on=False) for layer, (q, seqs) in enumerate(reqs)]
    assert all(r.stats.launches["gather"] == 0 and r.stats.launches["kv_b_proj"] == len(r.stats.chunks) > 1
               for r in eager)
    assert not same_bits(eager[0], eager[1])
    order = [0, 1, 2, 2, 0, 1]
    runs = [eng.prefill_context(*reqs[layer], layer=layer) for layer in order]
    assert (eng.graphs.captures, eng.graphs.replays) == (1, 4)
    for layer, r in zip(order, runs, strict=True):
        assert same_bits(r, eager[layer]), layer


@pytest.mark.parametrize("case", list(CASES))
def test_merges_beside_run_on_their_stream_with_the_same_bits(case, tmp_path):
    """A loop given a merge stream (as a capture is with ``LoopGraphs.merges_beside``) launches
    every merge there and every other stage where it was called, and gives the bits of the
    loop without one; so do replays captured with and without it."""
    from ctxprefill.engine.loop import start_chunk_loop
    from ctxprefill.engine.request import PrefillRequest, validate_prefill

    c = CASES[case]
    eng = make_engine(c, "auto", "bf16", "bf16")
    q, seqs = make_request(eng, c, seed=3)
    checked = validate_prefill(PrefillRequest(q, seqs), eng.config, eng.instance_id)
    x = eng.loop_inputs(checked)
    plain = start_chunk_loop(x, eng.backend, True).finish()
    side = torch.cuda.Stream()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        beside = start_chunk_loop(x, eng.backend, True, merge_stream=side).finish()
        torch.cuda.synchronize()
    assert same_bits(beside, plain) and beside.launches == plain.launches
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    kernels = [e for e in json.loads(trace.read_text())["traceEvents"]
               if e.get("cat") in ("kernel", "gpu_memcpy") and "stream" in e.get("args", {})]
    merges = {e["args"]["stream"] for e in kernels if "merge" in e["name"]}
    rest = {e["args"]["stream"] for e in kernels if "_mla_attn" in e["name"] or "gather" in e["name"]}
    assert len(merges) == len(rest) == 1 and merges != rest, (merges, rest)
    assert len(checked.chunks) > 1
    # captured both ways: the same bits
    got = []
    for on in (False, True):
        eng.release_graphs()
        eng.graphs.merges_beside = on
        runs = [eng.prefill_context(q, seqs) for _ in range(3)]
        assert GRAPH_STAGE in runs[2].stats.stage_ns
        got.append(runs[2])
    assert same_bits(got[0], got[1]) and same_bits(got[1], plain)


@pytest.mark.parametrize("prefill", ["bf16", "fp8"])
@pytest.mark.parametrize("case", list(CASES))
def test_captured_attention_takes_its_graph_variant_with_the_same_bits(case, prefill, monkeypatch, record_property):
    """With ``LoopGraphs.graph_variants`` a capture's attention launches take the Gluon
    kernel's CAPTURED_WS (q's and K's descriptors made by the launch: HOST_DESC) and eager
    loops never; without it the capture's do not. Replays in place (q's two descriptors a
    chunk among the arguments pointed at each request's q) give the eager loop's bits
    either way."""
    from ctxprefill.backends import gluon_attention as ga
    from ctxprefill.backends import triton_attention as ta

    c = CASES[case]
    eng = make_engine(c, "auto", "bf16", prefill)
    assert eng.backend.caps.graph_variants and ta.CAPTURED_WS["HOST_DESC"]
    launches = []  # per launch: q's address and shape, P_REGS, HOST_DESC
    real = ga.launch

    def spy(*args, **kw):
        launches.append((args[0].data_ptr(), tuple(args[0].shape), args[13]["P_REGS"], bool(args[13]["HOST_DESC"])))
        return real(*args, **kw)

    monkeypatch.setattr(ga, "launch", spy)
    q_args = {}
    for on in (True, False):
        eng.release_graphs()
        eng.graphs.graph_variants = on
        launches.clear()
        q, seqs = make_request(eng, c, seed=4)  # (the same blocks and values each time)
        eager = eng.prefill_context(q, seqs, graphs_on=False)
        chunks = len(eager.stats.chunks)
        runs = [eng.prefill_context(q, seqs) for _ in range(3)]  # eager, eager + capture, replay
        host_desc = [x[3] for x in launches]
        assert host_desc == [False] * chunks * 3 + [on] * chunks, (on, host_desc)
        [loop] = eng.graphs._graphs.values()
        assert loop.in_place, loop.copies_because
        # q's arguments, and what names them where the count is not the expected one
        q_args[on] = dict(counts=list(loop.patch.counts), descriptor_counts=list(loop.patch.descriptor_counts),
                          launches=launches[-chunks:], sites=[x for x in loop.patch.sites if x["buffer"] == 0])
        q2, seqs2 = make_request(eng, c, seed=5)
        eager2 = eng.prefill_context(q2, seqs2, graphs_on=False)
        assert all(same_bits(r, eager) for r in runs) and same_bits(eng.prefill_context(q2, seqs2), eager2)
    record_property("q_sites", json.dumps({str(on): a["sites"] for on, a in q_args.items()}))  # junit.xml: read
    # the attention's q arguments: its pointer, plus q's two descriptors with the variant.
    # (Other kernels' words are not counted: in ragged-fp8 captures torch's
    # direct_copy_kernel_cuda held q's address at byte 496 of its arguments, and the
    # replays' bits, checked above, were the eager ones with that word patched.)
    attn = {on: Counter(x["param"] for x in a["sites"] if x["kernel"] == "_mla_attn_ws_fwd")
            for on, a in q_args.items()}
    assert len(attn[True]) == 3 and attn[True][0] == chunks and set(attn[True].values()) == {chunks} \
        and attn[False] == {0: chunks}, q_args
    # q's descriptors (params past 0) are found as TMA maps, whatever their byte offset
    assert all(x["descriptor"] == (x["param"] != 0) for x in q_args[True]["sites"]
               if x["kernel"] == "_mla_attn_ws_fwd"), q_args


def test_one_sequence_replays_of_every_layer_take_the_quick_path():
    """A one-sequence shape that replayed is remembered for every layer (they share its
    graph): the next requests of any layer check their layer and block ids alone and replay
    with their own block offset, weight and cache, bit for bit their eager loops."""
    c = CASES["long"]
    eng = make_engine(c, "auto", "bf16", "bf16", layers=3)
    reqs = [make_request(eng, c, seed=20 + layer, layer=layer) for layer in range(3)]
    eager = [eng.prefill_context(q, seqs, layer=layer, graphs_on=False) for layer, (q, seqs) in enumerate(reqs)]
    order = [0, 1, 2, 2, 0, 1]  # eager, eager + capture, then quick replays (the shape is every layer's)
    runs = [eng.prefill_context(*reqs[layer], layer=layer) for layer in order]
    assert eng.graphs is not None and (eng.graphs.captures, eng.graphs.replays, eng.quick_replays) == (1, 4, 4)
    for layer, r in zip(order, runs, strict=True):
        assert same_bits(r, eager[layer]), layer
    # a block id past the cache: refused by the full checks, naming it; nothing replayed
    q, seqs = reqs[1]
    bad = [SequenceSpec(seqs[0].query_len, seqs[0].context_len, [*seqs[0].block_table[:-1], c["blocks"]])]
    with pytest.raises(OutOfRange, match=r"sequences\[0\]\.block_table"):
        eng.prefill_context(q, bad, layer=1)
    assert (eng.graphs.replays, eng.quick_replays) == (4, 4)


def test_observed_requests_run_eagerly_and_shapes_are_bounded():
    c = CASES["long"]
    eng = make_engine(c, "auto", "bf16", "bf16")
    assert eng.graphs is not None
    eng.graphs.max_graphs = 1
    q, seqs = make_request(eng, c, seed=1)
    for _ in range(3):
        seen: list[int] = []
        r = eng.prefill_context(q, seqs, observer=lambda i, *_: seen.append(i))
        assert GRAPH_STAGE not in r.stats.stage_ns and seen == list(range(len(r.stats.chunks)))
    assert eng.graphs.captures == 0
    shorter = [SequenceSpec(s.query_len, s.context_len - 64, s.block_table) for s in seqs]
    for request in (seqs, shorter, seqs, shorter):
        for _ in range(3):
            eng.prefill_context(q, request)
    assert len(eng.graphs) == 1 and eng.graphs.captures == 4  # each shape captured again after its eviction


def test_captures_of_new_shapes_reuse_the_pools_memory_and_release_it():
    """Shapes of a growing context (a model's prefill, chunk after chunk) each get a graph;
    the captures after the first reuse the blocks the first freed in the shared pool, so the
    memory they add is far less than the first one's: what each graph keeps (q, out, LSE,
    metadata), not its loop's workspace again. Dropping the graphs (what an out-of-memory
    request does) gives the pool back, and shapes are captured again."""
    c = dict(CASES["long"], contexts=[32768], queries=[256], W=8192, blocks=600)  # ~150 MB a chunk's work
    eng = make_engine(c, "auto", "bf16", "bf16")
    assert eng.graphs is not None
    added = []
    for extra in range(4):
        ce = dict(c, contexts=[c["contexts"][0] + 1024 * extra])
        q, seqs = make_request(eng, ce, seed=1 + extra)
        eng.prefill_context(q, seqs)  # eager: the shape's kernels warmed
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        eng.prefill_context(q, seqs)  # captured
        torch.cuda.synchronize()
        added.append(torch.cuda.memory_reserved() - before)
    assert eng.graphs.captures == 4 and len(eng.graphs) == 4
    # (a graph's own buffers take a segment or two of the allocator's: 2 or 20 MB each)
    assert added[0] > 100 << 20
    assert max(added[1:]) < added[0] / 4, f"bytes reserved by each capture: {added}"
    # out of memory, the engine drops its graphs: the pool's memory goes back to the device
    torch.cuda.empty_cache()  # (the eager loops' cached blocks first: not the pool's)
    held = torch.cuda.memory_reserved()
    assert eng.release_graphs() == 4 and len(eng.graphs) == 0
    gc.collect()
    torch.cuda.empty_cache()
    assert held - torch.cuda.memory_reserved() >= added[0] / 2, (held, torch.cuda.memory_reserved(), added)
    q, seqs = make_request(eng, c, seed=9)
    for _ in range(3):  # captured again from the shape's second request
        r = eng.prefill_context(q, seqs)
    assert eng.graphs.captures == 5 and GRAPH_STAGE in r.stats.stage_ns


def test_a_capture_out_of_memory_runs_eagerly_until_the_graphs_release_theirs(monkeypatch):
    """The chunk loop's capture raising torch's out-of-memory error (mid-capture, as the
    graph's pool would): the request is answered by its eager loop, the shape's later
    requests run eagerly without another capture, and once the graphs gave their memory
    back (``Engine.release_graphs``) the shape is captured again and replays bit for bit."""
    from ctxprefill.engine import graphs

    c = CASES["long"]
    eng = make_engine(c, "auto", "bf16", "bf16")
    q, seqs = make_request(eng, c, seed=1)
    eager = eng.prefill_context(q, seqs, graphs_on=False)
    real, captures = graphs.start_chunk_loop, []

    def short_of_memory(*a, **k):
        if k.get("timed") is False:  # the capture's call
            captures.append(torch.cuda.is_current_stream_capturing())
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.88 GiB")
        return real(*a, **k)

    monkeypatch.setattr(graphs, "start_chunk_loop", short_of_memory)
    runs = [eng.prefill_context(q, seqs) for _ in range(4)]
    assert captures == [True] and len(eng.graphs) == 0 and eng.graphs.replays == 0
    assert all(same_bits(r, eager) and GRAPH_STAGE not in r.stats.stage_ns for r in runs)
    monkeypatch.setattr(graphs, "start_chunk_loop", real)
    eng.release_graphs()
    runs = [eng.prefill_context(q, seqs) for _ in range(3)]
    assert eng.graphs.captures == 1 and eng.graphs.replays == 1 and GRAPH_STAGE in runs[-1].stats.stage_ns
    assert all(same_bits(r, eager) for r in runs)


def test_served_requests_replay_with_the_same_answers(cuda_ext):
    """``ctxprefill serve --cuda-graphs``: a request repeated through gRPC (a deadline
    on each: a stop signal over 2 chunks) answers the same bits eagerly and replayed, and
    the replays show as the ``graph`` stage in the metrics."""
    import os
    import sys

    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: service_process
    from context_layout import tables_and_slots
    from ctxprefill_client import PrefillContextClient
    from service_process import ServerProcess, sample_sum

    heads, bs, contexts, queries = 4, 16, [100, 0, 37, 64], [5, 3, 7, 1]
    tables, slots = tables_and_slots(contexts, bs)
    rng = np.random.default_rng(3)
    proc = ServerProcess({"device": f"cuda:{torch.cuda.current_device()}", "heads": heads, "block_size": bs,
                          "num_blocks": 64, "workspace_tokens": 128, "seed": 9, "cuda_graphs": True})
    try:
        proc.wait_ready(timeout=600)
        with PrefillContextClient(proc.target, retries=0, timeout=120) as c:
            c.write_cache(slots, rng.standard_normal((len(slots), 512), dtype=np.float32),
                          rng.standard_normal((len(slots), 64), dtype=np.float32))
            q = rng.standard_normal((sum(queries), heads, 192), dtype=np.float32)
            answers = [c.prefill_context(q, list(zip(queries, contexts, tables)), timeout=60) for _ in range(4)]
        for a in answers[1:]:
            assert np.array_equal(a.output, answers[0].output) and np.array_equal(a.lse, answers[0].lse)
        assert ["graph" in a.stats["stage_nanos"] for a in answers] == [False, False, True, True]
        m = proc.scrape()
        replays = sample_sum(m["ctxprefill_stage_duration_seconds_count"], stage="graph")
        assert replays == 2, replays  # the third and fourth
        # read q and wrote the output in place (the server's q: a fresh device copy, aligned)
        assert sample_sum(m["ctxprefill_graph_replays_total"], mode="in_place") == 2
        assert sample_sum(m["ctxprefill_graph_replays_total"], mode="copying") == 0
    finally:
        proc.terminate(30)
        proc.kill()
