"""PrefillContext's ``cache_write`` (proto; docs/DESIGN.md "Model layers"): latents
written into the request's layer's cache after its attention — one call per layer where
an orchestrator would otherwise make two. The attention never sees them (even when they
rewrite slots it reads), the cache afterwards holds exactly what WriteCache would have
written, the insert launches are counted as WriteCache's are, and a cache_write that
fails its checks refuses the whole request with the field named, writing nothing."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import numpy as np
import pytest
import torch

from ctxprefill.app import build_engine
from ctxprefill.settings import ServeSettings
from ctxprefill_api import pb
from ctxprefill_client import encode_tensor, float32_to_bf16_bits
from ctxprefill_client._common import build_prefill_request
from inprocess_service import Harness
from service_process import parse_metrics, sample_sum

S = ServeSettings(device="cpu", heads=2, block_size=16, num_blocks=8, workspace_tokens=64, backend="reference",
                  layers=2, first_layer=0)
CONTEXT = 40  # blocks 0..2: slots 0..39
TABLE = [0, 1, 2]
Q = float32_to_bf16_bits(np.random.default_rng(1).standard_normal((5, 2, 192), dtype=np.float32))


def _latents(n: int, seed: int):
    g = np.random.default_rng(seed)
    return g.standard_normal((n, 512), dtype=np.float32), g.standard_normal((n, 64), dtype=np.float32)


def _prefill(layer: int, cache_write=None) -> pb.PrefillContextRequest:
    req = build_prefill_request(Q, [(5, CONTEXT, TABLE)], request_id=None, workspace_tokens=None, plan=None,
                                expected=None, q_dtype=None, server_prefill_dtype="bf16", layer=layer,
                                cache_write=cache_write)
    return req.full_message() if hasattr(req, "full_message") else req


def _read(slots) -> pb.ReadCacheRequest:
    return pb.ReadCacheRequest(slot_mapping=encode_tensor(np.asarray(slots, np.int64)), layer=1)


def _write(slots, kv_c, k_pe, layer=1) -> pb.WriteCacheRequest:
    r = pb.WriteCacheRequest(layer=layer)
    r.slot_mapping.CopyFrom(encode_tensor(np.asarray(slots, np.int64)))
    r.kv_c.CopyFrom(encode_tensor(kv_c))
    r.k_pe.CopyFrom(encode_tensor(k_pe))
    return r


def test_cache_write_comes_after_the_attention_and_equals_write_cache():
    engine = build_engine(S)
    ctx_kv, ctx_pe = _latents(CONTEXT, 2)
    # the new tokens' latents go to slots 40..44, and two of them rewrite context slots 3 and 7
    new_slots = np.array([40, 41, 3, -1, 7, 42], np.int64)
    new_kv, new_pe = _latents(len(new_slots), 3)

    async def main():
        async with Harness(engine) as h:
            await h.stub.WriteCache(_write(np.arange(CONTEXT), ctx_kv, ctx_pe), timeout=30)
            plain = await h.stub.PrefillContext(_prefill(1), timeout=60)
            launches_before = sample_sum(parse_metrics(h.metrics.render().decode())
                                         ["ctxprefill_kernel_launches_total"], stage="insert")
            r = await h.stub.PrefillContext(_prefill(1, (new_slots, new_kv, new_pe)), timeout=60)
            assert r.slots_written == 5
            assert bytes(r.output.data) == bytes(plain.output.data)  # the write came after the attention
            assert bytes(r.lse.data) == bytes(plain.lse.data)
            assert "insert" not in r.stats.kernel_launches  # Stats count the chunk loop only
            page = parse_metrics(h.metrics.render().decode())
            assert sample_sum(page["ctxprefill_kernel_launches_total"], stage="insert") == launches_before + 1
            after = await h.stub.PrefillContext(_prefill(1), timeout=60)
            assert bytes(after.output.data) != bytes(plain.output.data)  # later requests see the new bytes
            got = await h.stub.ReadCache(_read(np.arange(48)), timeout=30)
            other = await h.stub.ReadCache(pb.ReadCacheRequest(slot_mapping=encode_tensor(np.arange(48)), layer=0),
                                           timeout=30)
            return bytes(got.slots.data), bytes(other.slots.data)

    got, layer0 = asyncio.run(main())
    ref = build_engine(S)  # the same writes through WriteCache
    ref.write_cache(torch.arange(CONTEXT), torch.from_numpy(ctx_kv), torch.from_numpy(ctx_pe), layer=1)
    ref.write_cache(torch.from_numpy(new_slots), torch.from_numpy(new_kv), torch.from_numpy(new_pe), layer=1)
    assert got == ref.read_cache(torch.arange(48), layer=1).numpy().tobytes()
    assert layer0 == bytes(48 * engine.config.cache.bytes_per_slot)  # the other layer untouched


@pytest.mark.parametrize("bad,code,field", [
    ("kv_c_shape", grpc.StatusCode.INVALID_ARGUMENT, "cache_write.kv_c"),
    ("k_pe_dtype", grpc.StatusCode.INVALID_ARGUMENT, "cache_write.k_pe"),
    ("slot", grpc.StatusCode.OUT_OF_RANGE, "cache_write.slot_mapping[1]"),
    ("layer", grpc.StatusCode.OUT_OF_RANGE, "layer"),
])
def test_a_bad_cache_write_refuses_the_request_and_writes_nothing(bad, code, field):
    engine = build_engine(S)
    n = engine.config.cache.num_slots
    slots = np.array([0, n if bad == "slot" else 1], np.int64)
    kv_c, k_pe = _latents(2, 4)
    if bad == "kv_c_shape":
        kv_c = kv_c[:, :100]
    req = _prefill(5 if bad == "layer" else 1, (slots, kv_c, k_pe))
    if bad == "k_pe_dtype":
        req.cache_write.k_pe.CopyFrom(encode_tensor(np.zeros((2, 64), np.int64)))
    before = [c.storage.clone() for c in engine.caches]

    async def main():
        async with Harness(engine) as h:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await h.stub.PrefillContext(req, timeout=30)
            assert ei.value.code() == code
            assert ei.value.details().startswith(field), ei.value.details()
            ok = await h.stub.PrefillContext(_prefill(1), timeout=60)  # the server goes on
            assert ok.slots_written == 0

    asyncio.run(main())
    assert all(torch.equal(a, c.storage) for a, c in zip(before, engine.caches))


def test_the_client_builds_cache_write():
    slots = np.array([5, -1], np.int64)
    kv_c, k_pe = _latents(2, 6)
    req = _prefill(1, (slots, kv_c, float32_to_bf16_bits(k_pe)))
    cw = req.cache_write
    assert list(cw.slot_mapping.shape) == [2] and cw.kv_c.dtype == pb.DATA_TYPE_FP32
    assert cw.k_pe.dtype == pb.DATA_TYPE_BF16 and len(cw.kv_c.data) == kv_c.nbytes
    assert not _prefill(1).HasField("cache_write")
    with pytest.raises(ValueError, match="cache_write"):
        _prefill(1, (slots, kv_c))


def test_a_one_layer_server_takes_cache_write_without_a_layer():
    engine = build_engine(dataclasses.replace(S, layers=1))
    kv_c, k_pe = _latents(3, 7)
    req = build_prefill_request(Q, [(5, 0, [])], request_id=None, workspace_tokens=None, plan=None, expected=None,
                                q_dtype=None, server_prefill_dtype="bf16", cache_write=(np.arange(3), kv_c, k_pe))
    req = req.full_message() if hasattr(req, "full_message") else req

    async def main():
        async with Harness(engine) as h:
            r = await h.stub.PrefillContext(req, timeout=60)
            assert r.slots_written == 3

    asyncio.run(main())
    assert engine.cache.slots_used == 3


def test_a_ring_request_whose_cache_write_reads_shared_memory_waits_for_the_device_before_release(monkeypatch, request):
    """A ring request's regions are released after its answer (deferred). Its results'
    copies are waited for before the answer, but a cache_write reading its latents from
    shared memory is queued after them: that release goes through ``Lease.end`` (which
    waits for the device when the regions can still be read by it), an inline one's not."""
    from ctxprefill.service.engine_worker import EngineWorker
    from ctxprefill.service.metrics import Metrics
    from ctxprefill.service.prefill import PrefillCall
    from ctxprefill.service.servicer import PrefillContextServicer
    from ctxprefill.service.shared_memory import Lease, caller_peer
    from ctxprefill_client import SystemSharedMemoryRegion

    token = caller_peer.set("ipv4:127.0.0.1:50000")  # a ring's requests use shared memory as its loopback caller
    request.addfinalizer(lambda: caller_peer.reset(token))
    s = dataclasses.replace(S, shared_memory="system")
    engine = build_engine(s)
    servicer = PrefillContextServicer(s, Metrics(), EngineWorker(Metrics()), 64 << 20, 4)
    servicer.attach_engine(engine)
    ended = []
    monkeypatch.setattr(Lease, "end", lambda lease, device: (ended.append(lease), lease.finish()))
    kv, pe = _latents(2, 5)
    with SystemSharedMemoryRegion("cw", 8192) as shm:
        servicer.shm.register_system("cw", shm.key, 0, 8192)
        for shared in (False, True):
            latents = (shm.write(kv, 0), shm.write(pe, 4096)) if shared else (kv, pe)
            call = PrefillCall.open(engine, servicer.metrics, _prefill(0, ([40, 41], *latents)), "r", servicer.shm,
                                    64 << 20, 0)
            assert bool(call.decoded.shared) == shared  # the latents view the region
            defer: list = []
            call.start(defer)()
            assert ended == [] and defer  # nothing released before the answer
            for f in defer:
                f()
            assert ended == ([call.lease] if shared else [])
            assert servicer.shm.status("cw")[0]["requests_in_flight"] == 0  # released either way
        servicer.shm.unregister("cw")
