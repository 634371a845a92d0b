"""Head-sharded workers (docs/SHARDING.md): ``serve --num-shards N --shard-index I`` and
``ctxprefill_client.ShardedPrefillClient``.

- weights: a shard's kv_b_proj (bf16, fp8 with 128×128 block scales, fp8 with a tensor
  scale) is exactly its heads' rows of the full prepared weights — ``compute`` (dtype
  included), ``weight``, and the dequantization of its scale;
- in-process: N engines on the shards' weights, outputs and LSE concatenated along
  heads, equal one engine of all the heads bit for bit (several H, N and dtypes);
- end to end (CPU server processes): two shards of a 4-head model driven by the
  sharded client equal an unsharded 4-head worker of the same seed bit for bit, for
  cache dtypes auto and fp8_ds_mla, kv_b_proj bf16 and fp8, fp8 prefill once, with
  the sync and the asyncio client; GetServerInfo reports the shard; the layout is
  validated; a shard whose instance is not the expected one, or that restarted, is
  detected, and recovers after its cache is written again;
- bad configurations (heads not divisible, shard index out of range) are ConfigErrors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math

import numpy as np
import pytest
import torch

from ctxprefill.app import build_engine
from ctxprefill.backends.reference import ReferenceBackend
from ctxprefill.config import CacheConfig, EngineConfig, ModelShape
from ctxprefill.engine.engine import Engine, SequenceSpec
from ctxprefill.errors import ConfigError
from ctxprefill.ops.fp8 import FP8
from ctxprefill.settings import ServeSettings, shard_spec
from ctxprefill.weights import BLOCK, dequantize, prepare, random_kv_b_proj, shard_kv_b_proj
from ctxprefill_client import (
    AsyncShardedPrefillClient,
    CtxPrefillError,
    PrefillContextClient,
    ServerRestartedError,
    ShardedPrefillClient,
    float32_to_bf16_bits,
    float32_to_fp8_e4m3_bits,
)
from ctxprefill_client.sharded import ShardedReadMismatchError, ShardLayoutError
from service_process import ServerProcess

HEAD_ROWS = 256  # P + V


def _weights(H, dtype, scale_kind="block", seed=3):
    t = random_kv_b_proj(ModelShape(heads=H), dtype, seed, scale_kind)
    scale = t.get("kv_b_proj.weight_scale_inv", t.get("kv_b_proj.weight_scale"))
    return prepare(dtype, t["kv_b_proj.weight"], scale)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("dtype,scale_kind", [("bf16", None), ("fp8", "block"), ("fp8", "tensor")])
@pytest.mark.parametrize("H,n", [(4, 2), (16, 4), (128, 2)])
def test_shard_weights_are_the_rows_of_the_full_ones(dtype, scale_kind, H, n):
    full = _weights(H, dtype, scale_kind or "block")
    per = H // n
    for i in range(n):
        w = shard_kv_b_proj(full, H, i, n)
        r0, r1 = i * per * HEAD_ROWS, (i + 1) * per * HEAD_ROWS
        assert w.dtype == full.dtype
        assert _same_bits(w.compute, full.compute[r0:r1])
        assert _same_bits(w.weight, full.weight[r0:r1])
        if dtype == "fp8":
            assert _same_bits(dequantize(w.weight, w.scale), dequantize(full.weight, full.scale)[r0:r1])
            if scale_kind == "block":
                assert tuple(w.scale.shape) == (math.ceil((r1 - r0) / BLOCK), math.ceil(512 / BLOCK))
            else:
                assert w.scale.dim() == 0
        # through build_engine: the served weights of shard i of the same seed
        kw = dict(device="cpu", heads=H, num_blocks=4, block_size=16, workspace_tokens=16, seed=3,
                  kv_b_proj_dtype=dtype, backend="reference")
        if (dtype == "fp8" and scale_kind == "tensor") or H > 16:
            continue  # random serve weights are block-scaled; the tensor form and H = 128 are covered above
        s = ServeSettings(**kw, num_shards=n, shard_index=i)
        e = build_engine(s)
        assert e.config.shape.heads == per and shard_spec(s).head_start == i * per and shard_spec(s).total_heads == H
        assert _same_bits(e.weights.compute, full.compute[r0:r1])


def test_shard_keeps_the_compute_dtype_of_the_whole_weight():
    """W_deq exact in bf16 on one shard's rows but not on the whole: the shard keeps the
    full weight's fp32 compute form (a per-shard decision would change its GEMM)."""
    H, N, L = 4, 4 * HEAD_ROWS, 512
    w = (torch.randn((N, L), generator=torch.Generator().manual_seed(0)) / 8).to(FP8)
    scale = torch.full((N // BLOCK, L // BLOCK), 0.5)
    scale[N // BLOCK // 2 :] = 0.3  # shard 1 of 2: arbitrary scales
    full = prepare("fp8", w, scale)
    assert full.compute.dtype == torch.float32
    assert prepare("fp8", w[: N // 2], scale[: N // BLOCK // 2]).compute.dtype == torch.bfloat16  # alone: bf16
    s0 = shard_kv_b_proj(full, H, 0, 2)
    assert s0.compute.dtype == torch.float32 and _same_bits(s0.compute, full.compute[: N // 2])


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("kw,msg", [
    (dict(heads=3, num_shards=2), "not divisible by --num-shards 2"),
    (dict(heads=4, num_shards=2, shard_index=2), "--shard-index must be in [0, 2)"),
    (dict(heads=4, num_shards=2, shard_index=-1), "--shard-index must be in [0, 2)"),
    (dict(heads=4, num_shards=0), "--num-shards must be an integer >= 1"),
])
def test_bad_shard_config_is_a_config_error(kw, msg):
    s = ServeSettings(device="cpu", num_blocks=4, block_size=16, workspace_tokens=16, **kw)
    with pytest.raises(ConfigError) as e:
        shard_spec(s)
    assert msg in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_engine(s)
    assert msg in str(e.value)
    with pytest.raises(ConfigError):
        shard_kv_b_proj(_weights(4, "bf16"), kw["heads"], kw.get("shard_index", 0), kw["num_shards"])


def test_bad_shard_config_stops_the_server():
    proc = ServerProcess({"heads": 6, "num_shards": 4, "block_size": 16, "num_blocks": 4, "workspace_tokens": 16})
    try:
        assert proc.proc.wait(timeout=60) == 2
        assert "--heads 6 (the model's total heads when sharded) is not divisible by --num-shards 4" in proc.log()
    finally:
        proc.kill()


# ----------------------------------------------------------------------------- in-process


CONTEXTS = [200, 48, 32, 0]  # the seed's case: continuation chunks, an empty sequence, W = 128
QUERIES = [8, 4, 6, 5]


def _engine(weights, heads, cache_dtype, prefill_dtype):
    cfg = EngineConfig(shape=ModelShape(heads=heads), cache=CacheConfig(cache_dtype, 16, 64, 1.0),
                       kv_b_proj_dtype=weights.dtype, prefill_dtype=prefill_dtype, workspace_tokens=128)
    return Engine(cfg, weights, "cpu", backend=ReferenceBackend())


@pytest.mark.parametrize("H,n", [(4, 2), (16, 4)])
@pytest.mark.parametrize("cache_dtype,dtype,prefill_dtype,scale_kind", [
    ("auto", "bf16", "bf16", "block"),
    ("fp8_ds_mla", "fp8", "bf16", "block"),
    ("fp8", "fp8", "fp8", "tensor"),
])
def test_in_process_shards_equal_the_whole(H, n, cache_dtype, dtype, prefill_dtype, scale_kind):
    full = _weights(H, dtype, scale_kind)
    per = H // n
    whole = _engine(full, H, cache_dtype, prefill_dtype)
    shards = [_engine(shard_kv_b_proj(full, H, i, n), per, cache_dtype, prefill_dtype) for i in range(n)]
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(64, generator=g).tolist()
    tables, at = [], 0
    for c in CONTEXTS:
        k = math.ceil(c / 16)
        tables.append(perm[at : at + k])
        at += k
    slots = torch.cat([torch.tensor(bt, dtype=torch.int64)[torch.arange(c) // 16] * 16 + torch.arange(c) % 16
                       for c, bt in zip(CONTEXTS, tables) if c])
    kv_c, k_pe = torch.randn((len(slots), 512), generator=g) * 2, torch.randn((len(slots), 64), generator=g)
    for e in [whole, *shards]:
        e.write_cache(slots, kv_c, k_pe)
    q = torch.randn((sum(QUERIES), H, 192), generator=g)
    q = q.to(FP8) if prefill_dtype == "fp8" else q.to(torch.bfloat16)
    seqs = [SequenceSpec(a, b, t) for a, b, t in zip(QUERIES, CONTEXTS, tables)]
    r = whole.prefill_context(q, seqs)
    parts = [e.prefill_context(q[:, i * per : (i + 1) * per], seqs) for i, e in enumerate(shards)]
    assert len(r.stats.chunks) > 1
    assert _same_bits(torch.cat([p.out for p in parts], 1), r.out)
    assert _same_bits(torch.cat([p.lse for p in parts], 0), r.lse)


# ----------------------------------------------------------------------------- end to end


COMMON = {"heads": 4, "block_size": 16, "num_blocks": 64, "workspace_tokens": 128, "seed": 5, "backend": "reference"}
CONFIGS = {  # both cache dtypes, both weight dtypes, fp8 prefill once (the rest of the grid: in-process above)
    "auto-bf16": {"cache_dtype": "auto", "kv_b_proj_dtype": "bf16", "prefill_dtype": "bf16"},
    "ds_mla-fp8w": {"cache_dtype": "fp8_ds_mla", "kv_b_proj_dtype": "fp8", "prefill_dtype": "bf16"},
    "auto-fp8w-fp8prefill": {"cache_dtype": "auto", "kv_b_proj_dtype": "fp8", "prefill_dtype": "fp8"},
}


class Deployment:
    """Two shards and one unsharded worker of the same model, the same context in all."""

    def __init__(self, name: str, procs: list[ServerProcess]):
        self.name, self.flags = name, {**COMMON, **CONFIGS[name]}
        self.shard_procs, self.whole_proc = procs[:2], procs[2]
        # targets deliberately in reverse head order: the client orders them itself
        self.sharded = ShardedPrefillClient([p.target for p in reversed(self.shard_procs)], timeout=60.0, retries=0)
        self.whole = PrefillContextClient(self.whole_proc.target, timeout=60.0, retries=0)
        self.infos = self.sharded.server_info()
        self.whole_info = self.whole.server_info()
        g = np.random.default_rng(7)
        perm = g.permutation(64)
        self.tables, at = [], 0
        for c in CONTEXTS:
            k = math.ceil(c / 16)
            self.tables.append(perm[at : at + k].tolist())
            at += k
        self.slots = np.concatenate([np.asarray(t, dtype=np.int64)[np.arange(c) // 16] * 16 + np.arange(c) % 16
                                     for c, t in zip(CONTEXTS, self.tables) if c])
        self.kv_c = (g.standard_normal((len(self.slots), 512)) * 2).astype(np.float32)
        self.k_pe = g.standard_normal((len(self.slots), 64)).astype(np.float32)
        self.kv_c[0, :3] = [1000.0, -1000.0, 3e-9]  # saturates in fp8
        assert self.sharded.write_cache(self.slots, self.kv_c, self.k_pe) == len(self.slots)
        assert self.whole.write_cache(self.slots, self.kv_c, self.k_pe) == len(self.slots)
        self.q = g.standard_normal((sum(QUERIES), 4, 192)).astype(np.float32)

    def seqs(self):
        return [(a, b, t) for a, b, t in zip(QUERIES, CONTEXTS, self.tables)]

    def close(self):
        self.sharded.close()
        self.whole.close()


@pytest.fixture(scope="module")
def deployments():
    """Every config's three servers, started at once (a few seconds in all)."""
    procs = {name: [ServerProcess({**COMMON, **CONFIGS[name], "num_shards": 2, "shard_index": i}) for i in range(2)]
                   + [ServerProcess({**COMMON, **CONFIGS[name]})] for name in CONFIGS}
    deps = {}
    try:
        for ps in procs.values():
            for p in ps:
                p.wait_ready()
        with concurrent.futures.ThreadPoolExecutor(len(CONFIGS)) as pool:
            futs = {name: pool.submit(Deployment, name, ps) for name, ps in procs.items()}
            deps = {name: f.result() for name, f in futs.items()}
        yield deps
    finally:
        for d in deps.values():
            d.close()
        for ps in procs.values():  # nothing to drain: SIGKILL
            for p in ps:
                p.kill()


@pytest.fixture(params=list(CONFIGS))
def dep(request, deployments):
    return deployments[request.param]


def _assert_bit_equal(res, want):
    assert res.output_bits is not None and want.output_bits is not None
    assert res.output_bits.shape == want.output_bits.shape
    np.testing.assert_array_equal(res.output_bits, want.output_bits)
    np.testing.assert_array_equal(res.lse.view(np.uint32), want.lse.view(np.uint32))


def test_server_info_reports_the_shard(dep):
    for i, info in enumerate(dep.infos):  # head order
        assert (info.shard_index, info.num_shards, info.total_heads, info.num_heads) == (i, 2, 4, 2)
        assert (info.head_start, info.head_end) == (2 * i, 2 * i + 2)
        assert info.weights_source == f"random(seed=5) [heads {2 * i}:{2 * i + 2} of 4]"
        assert info.kv_b_proj_dtype == dep.flags["kv_b_proj_dtype"]
    w = dep.whole_info
    assert (w.shard_index, w.num_shards, w.total_heads, w.num_heads) == (0, 1, 4, 4)
    assert w.weights_source == "random(seed=5)"
    assert dep.sharded.shard_targets == [p.target for p in dep.shard_procs]
    assert dep.sharded.head_ranges == [(0, 2), (2, 4)] and dep.sharded.total_heads == 4


def test_cache_is_the_same_on_every_shard(dep):
    raw = dep.sharded.read_cache(dep.slots, verify=True)
    np.testing.assert_array_equal(raw, dep.whole.read_cache(dep.slots))


@pytest.mark.parametrize("mode", ["W=128", "W=64", "explicit plan", "float q"])
def test_sharded_equals_unsharded_bit_for_bit(dep, mode):
    fp8 = dep.flags["prefill_dtype"] == "fp8"
    bits = float32_to_fp8_e4m3_bits(dep.q) if fp8 else float32_to_bf16_bits(dep.q)
    kw = {}
    if mode == "W=64":
        kw = {"workspace_tokens": 64}
    elif mode == "explicit plan":
        kw = {"plan": [(0, 1, (0,), (96,)), (0, 1, (96,), (104,)), (1, 3, (0, 0, 0), (48, 32, 0))]}
    q = dep.q if mode == "float q" else bits  # floats: rounded by the client, once, per the prefill dtype
    res = dep.sharded.prefill_context(q, dep.seqs(), request_id="sh-1", **kw)
    want = dep.whole.prefill_context(bits, dep.seqs(), **kw)
    _assert_bit_equal(res, want)
    assert res.output.shape == (sum(QUERIES), 4, 128) and res.lse.shape == (4, sum(QUERIES))
    assert res.request_id == "sh-1" and res.stats["num_chunks"] > 1
    st, ws = res.stats, want.stats
    assert st["chunks"] == ws["chunks"] and st["path"] == ws["path"] and st["fp8_path"] == ws["fp8_path"]
    assert len(st["shards"]) == 2 and [s["heads"] for s in st["shards"]] == [(0, 2), (2, 4)]
    for k, v in st["kernel_launches"].items():
        assert v == sum(s["kernel_launches"].get(k, 0) for s in st["shards"])
    assert st["total_nanos"] == max(s["total_nanos"] for s in st["shards"])
    assert res.instance_ids == [i.instance_id for i in dep.infos]


def test_async_sharded_client(deployments):
    dep = deployments["auto-fp8w-fp8prefill"]
    bits = float32_to_fp8_e4m3_bits(dep.q)
    want = dep.whole.prefill_context(bits, dep.seqs())

    async def go():
        async with AsyncShardedPrefillClient([p.target for p in dep.shard_procs], timeout=60.0, retries=0) as sc:
            infos = await sc.server_info()
            assert [i.shard_index for i in infos] == [0, 1]
            raw = await sc.read_cache(dep.slots, verify=True)
            res = await sc.prefill_context(bits, dep.seqs())
            return raw, res

    raw, res = asyncio.run(go())
    np.testing.assert_array_equal(raw, dep.whole.read_cache(dep.slots))
    _assert_bit_equal(res, want)


class _Disagreeing:
    """A shard's client stand-in whose cache answers are its own: ``written`` slots, ``fill`` bytes."""

    def __init__(self, written: int, fill: int):
        self.written, self.fill = written, fill

    def write_cache(self, *a, **kw):
        return self.written

    def read_cache(self, *a, **kw):
        return np.full((2, 4), self.fill, np.uint8)

    def close(self):
        pass


class _AsyncDisagreeing(_Disagreeing):
    async def write_cache(self, *a, **kw):
        return self.written

    async def read_cache(self, *a, **kw):
        return np.full((2, 4), self.fill, np.uint8)

    async def close(self):
        pass


def test_shards_that_disagree_are_named_by_both_clients():
    """Shards that wrote different slot counts, or hold different bytes, fail the call; the
    error names the shards (in head order: targets given in the other order), the sync and
    the asyncio client alike; shards that agree pass."""
    targets = ["127.0.0.1:1", "127.0.0.1:2"]  # never dialled: the clients are stand-ins
    layout = ([None, None], [1, 0])  # head order: target 1, then target 0
    written = r"shards wrote different numbers of slots: \{'127.0.0.1:2': 5, '127.0.0.1:1': 7\}"
    mismatch = "shard 127.0.0.1:1 holds other bytes than shard 127.0.0.1:2"

    with ShardedPrefillClient(targets, retries=0) as sc:
        for c in sc.clients:
            c.close()
        sc.clients, sc._layout = [_Disagreeing(7, 1), _Disagreeing(5, 2)], layout
        with pytest.raises(CtxPrefillError, match=written):
            sc.write_cache(None, None, None)
        with pytest.raises(ShardedReadMismatchError, match=mismatch):
            sc.read_cache(None, verify=True)
        assert sc.read_cache(None, shard=1)[0, 0] == 1  # unverified: the one shard read
        sc.clients = [_Disagreeing(5, 3), _Disagreeing(5, 3)]
        assert sc.write_cache(None, None, None) == 5 and sc.read_cache(None, verify=True)[0, 0] == 3

    async def go():
        sc = AsyncShardedPrefillClient(targets, retries=0)
        await sc.close()
        sc.clients, sc._layout = [_AsyncDisagreeing(7, 1), _AsyncDisagreeing(5, 2)], layout
        with pytest.raises(CtxPrefillError, match=written):
            await sc.write_cache(None, None, None)
        with pytest.raises(ShardedReadMismatchError, match=mismatch):
            await sc.read_cache(None, verify=True)
        assert (await sc.read_cache(None, shard=1))[0, 0] == 1
        sc.clients = [_AsyncDisagreeing(5, 3), _AsyncDisagreeing(5, 3)]
        assert await sc.write_cache(None, None, None) == 5
        assert (await sc.read_cache(None, verify=True))[0, 0] == 3

    asyncio.run(go())


def test_layout_is_validated(deployments):
    dep = deployments["auto-bf16"]
    s0, s1 = (p.target for p in dep.shard_procs)
    other = deployments["ds_mla-fp8w"].shard_procs[1].target
    cases = [
        ([s0, s0], "serves [0, 2), overlapping heads below 2 already served"),
        ([s0], "split 2 ways, 1 targets given"),
        ([s0, s1, dep.whole_proc.target], "num_heads=4"),
        ([s0, other], "cache_dtype='fp8_ds_mla'"),
    ]
    for targets, msg in cases:
        with ShardedPrefillClient(targets, timeout=30.0, retries=0) as sc:
            with pytest.raises(ShardLayoutError) as e:
                sc.server_info()
            assert msg in str(e.value), str(e.value)
    with ShardedPrefillClient([s0, s1], timeout=30.0, retries=0) as sc:
        with pytest.raises(ValueError, match=r"q: shape \[23, 2, 192\] is not \[Tq, 4, P\+R\]"):
            sc.prefill_context(np.zeros((23, 2, 192), np.float32), dep.seqs())
    # a single unsharded worker is a layout of one
    with ShardedPrefillClient([dep.whole_proc.target], timeout=30.0, retries=0) as sc:
        res = sc.prefill_context(dep.q, dep.seqs())
    _assert_bit_equal(res, dep.whole.prefill_context(dep.q, dep.seqs()))


def test_a_shard_of_another_instance_is_detected(deployments):
    """Per-shard instance tracking: a shard that is not the instance the client expects
    (as after a restart, whose cache is gone) fails with ServerRestartedError naming it."""
    dep = deployments["auto-bf16"]
    s0, s1 = dep.shard_procs
    ids = [dep.infos[0].instance_id, "0" * 32]
    with ShardedPrefillClient([s0.target, s1.target], expected_instance_ids=ids, timeout=30.0, retries=0) as sc:
        with pytest.raises(ServerRestartedError) as e:
            sc.server_info()
        assert e.value.shard_target == s1.target and e.value.shard_index == 1
        sc.reset_instance(1)
        sc.server_info()
        assert sc.instance_ids == [i.instance_id for i in dep.infos]
    with ShardedPrefillClient([s0.target, s1.target], timeout=30.0, retries=0) as sc:
        sc.server_info()
        sc.clients[0].reset_instance("f" * 32)  # as if shard 0 had been another instance before
        with pytest.raises(ServerRestartedError) as e:
            sc.prefill_context(dep.q, dep.seqs())
        assert e.value.shard_target == s0.target and e.value.shard_index == 0


def test_a_restarted_shard_is_detected_and_recovers(monkeypatch):
    """Shard 1 restarts on the same port (its cache is gone): the next request fails with
    ServerRestartedError naming shard 1; after re-writing the cache and reset_instance()
    the result is the same as before, bit for bit."""
    import service_process

    flags = {**COMMON, **CONFIGS["auto-bf16"], "num_shards": 2}
    procs = [ServerProcess({**flags, "shard_index": i}) for i in range(2)]
    try:
        for p in procs:
            p.wait_ready()
        g = np.random.default_rng(3)
        slots = np.arange(100, dtype=np.int64)
        kv_c, k_pe = g.standard_normal((100, 512), np.float32), g.standard_normal((100, 64), np.float32)
        q = float32_to_bf16_bits(g.standard_normal((6, 4, 192), np.float32))
        seqs = [(6, 100, list(range(7)))]
        with ShardedPrefillClient([p.target for p in procs], timeout=60.0, retries=0) as sc:
            sc.write_cache(slots, kv_c, k_pe)
            before = sc.prefill_context(q, seqs)
            old = procs[1]
            old.kill()
            ports = iter([old.port, old.metrics_port])
            monkeypatch.setattr(service_process, "free_port", lambda: next(ports))
            procs[1] = ServerProcess({**flags, "shard_index": 1})
            monkeypatch.undo()
            procs[1].wait_ready()
            with pytest.raises(ServerRestartedError) as e:
                sc.prefill_context(q, seqs)
            assert e.value.shard_index == 1 and e.value.shard_target == procs[1].target
            sc.reset_instance(1)
            sc.write_cache(slots, kv_c, k_pe)
            after = sc.prefill_context(q, seqs)
            assert after.instance_ids[0] == before.instance_ids[0] and after.instance_ids[1] != before.instance_ids[1]
            _assert_bit_equal(after, before)
    finally:
        for p in procs:
            p.kill()
