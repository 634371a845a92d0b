"""Several model layers in one server (``--layers``, ``--first-layer``; docs/DESIGN.md
"Model layers"): each layer has its own cache and kv_b_proj, requests name their layer,
and a layer of a multi-layer engine computes exactly what a one-layer engine holding
only that layer computes. A request for a layer not held, or none on a server of
several, is refused naming ``layer`` and changes nothing."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import numpy as np
import pytest
import torch

from context_layout import tables_and_slots
from ctxprefill.app import build_engine
from ctxprefill.cache import PagedLatentCache
from ctxprefill.config import EngineConfig, ModelShape
from ctxprefill.engine.engine import Engine, SequenceSpec
from ctxprefill.errors import ConfigError, InvalidArgument, OutOfRange
from ctxprefill.settings import ServeSettings
from ctxprefill.weights import random_kv_b_proj, save_weights
from ctxprefill_api import pb
from ctxprefill_client import encode_tensor, float32_to_bf16_bits
from engine_helpers import bits
from inprocess_service import Harness
from service_process import parse_metrics, sample_sum

BASE = ServeSettings(device="cpu", heads=2, block_size=16, num_blocks=16, workspace_tokens=64, backend="reference")
SHAPE = ModelShape(heads=2)  # BASE's
CONTEXTS, QUERIES = [40, 0, 23], [3, 2, 4]


TABLES, _slots = tables_and_slots(CONTEXTS, 16)
SLOTS = torch.from_numpy(_slots)
SEQS = [SequenceSpec(q, c, t) for q, c, t in zip(QUERIES, CONTEXTS, TABLES)]


def latents(seed: int):
    g = torch.Generator().manual_seed(seed)
    n = SLOTS.numel()
    return torch.randn((n, 512), generator=g), torch.randn((n, 64), generator=g)


def query(seed: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((sum(QUERIES), 2, 192), generator=g).to(torch.bfloat16)


@pytest.fixture(scope="module")
def two_layers():
    """Layers 3 and 4, each with its own latents written at the same slots."""
    e = build_engine(dataclasses.replace(BASE, layers=2, first_layer=3))
    for layer in (3, 4):
        e.write_cache(SLOTS, *latents(layer), layer=layer)
    return e


@pytest.mark.parametrize("layer", [3, 4])
def test_a_layer_computes_what_a_one_layer_engine_of_it_computes(two_layers, layer):
    one = build_engine(dataclasses.replace(BASE, first_layer=layer))  # random weights: seed + layer in both
    one.write_cache(SLOTS, *latents(layer))
    assert torch.equal(bits(one.weights.compute), bits(two_layers.layer_weights[layer - 3].compute))
    for fused in (True, False):
        a = two_layers.prefill_context(query(), SEQS, fused=fused, layer=layer)
        b = one.prefill_context(query(), SEQS, fused=fused, layer=layer)
        c = one.prefill_context(query(), SEQS, fused=fused)  # a one-layer engine: layer may be left out
        assert torch.equal(bits(a.out), bits(b.out)) and torch.equal(bits(a.lse), bits(b.lse))
        assert torch.equal(bits(b.out), bits(c.out)) and torch.equal(bits(b.lse), bits(c.lse))


def test_layers_hold_their_own_weights_and_caches(two_layers):
    w3, w4 = (w.compute for w in two_layers.layer_weights)
    assert not torch.equal(w3, w4)
    r3 = two_layers.read_cache(SLOTS, layer=3)
    r4 = two_layers.read_cache(SLOTS, layer=4)
    assert not torch.equal(r3, r4)
    a = two_layers.prefill_context(query(), SEQS, layer=3)
    b = two_layers.prefill_context(query(), SEQS, layer=4)
    assert not torch.equal(a.out, b.out)
    assert two_layers.cache_slots_used == 2 * SLOTS.numel()


def test_a_write_to_one_layer_leaves_the_others_alone():
    e = build_engine(dataclasses.replace(BASE, layers=3))
    kv_c, k_pe = latents(1)
    assert e.write_cache(SLOTS, kv_c, k_pe, layer=1) == SLOTS.numel()
    assert int(e.read_cache(SLOTS, layer=1).count_nonzero()) > 0
    for other in (0, 2):
        assert int(e.read_cache(SLOTS, layer=other).count_nonzero()) == 0
    assert [c.slots_used for c in e.caches] == [0, SLOTS.numel(), 0]
    # the layers' caches are consecutive pieces of one allocation (a CUDA graph reads any
    # layer's through block ids offset by the layer: engine/graphs.py)
    n = e.config.cache.num_slots
    assert e.cache_storage.shape[0] == 3 * n
    assert all(c.storage.data_ptr() == e.cache_storage[i * n].data_ptr() for i, c in enumerate(e.caches))
    assert torch.equal(e.cache_storage[n:2 * n], e.caches[1].storage)
    with pytest.raises(ValueError, match="contiguous uint8"):
        PagedLatentCache(e.config.cache, torch.device("cpu"), storage=e.cache_storage[:n - 1])


def test_a_layer_not_held_or_not_named_is_refused_and_changes_nothing(two_layers):
    before = [c.storage.clone() for c in two_layers.caches]
    kv_c, k_pe = latents(5)
    for layer, err in ((None, InvalidArgument), (2, OutOfRange), (5, OutOfRange), (-1, OutOfRange)):
        with pytest.raises(err) as ei:
            two_layers.write_cache(SLOTS, kv_c, k_pe, layer=layer)
        assert ei.value.field == "layer"
        with pytest.raises(err):
            two_layers.read_cache(SLOTS, layer=layer)
        with pytest.raises(err):
            two_layers.prefill_context(query(), SEQS, layer=layer)
    assert "[3, 5)" in str(ei.value)
    assert all(torch.equal(a, c.storage) for a, c in zip(before, two_layers.caches))
    one = build_engine(BASE)
    with pytest.raises(OutOfRange):
        one.prefill_context(query(), SEQS, layer=1)


def test_layer_settings_are_checked_up_front(tmp_path):
    cases = (({"layers": 0}, "--layers"), ({"layers": 2000}, "--layers"), ({"first_layer": -1}, "--first-layer"))
    for kw, flag in cases:
        with pytest.raises(ConfigError, match=flag):
            build_engine(dataclasses.replace(BASE, **kw))
    with pytest.raises(ConfigError, match="--layers"):
        EngineConfig(num_layers=0)
    path = str(tmp_path / "w.safetensors")
    save_weights(path, random_kv_b_proj(SHAPE, "bf16", 1))
    with pytest.raises(ConfigError, match=r"\{layer\}"):
        build_engine(dataclasses.replace(BASE, layers=2, weights=path))


def test_weights_of_each_layer_come_from_the_file_by_prefix(tmp_path):
    path = str(tmp_path / "model.safetensors")
    tensors, want = {}, {}
    for layer in (0, 1, 2):
        t = random_kv_b_proj(SHAPE, "bf16", 100 + layer)
        want[layer] = t["kv_b_proj.weight"]
        tensors.update({f"model.layers.{layer}.self_attn.{k}": v for k, v in t.items()})
    from safetensors.torch import save_file

    save_file(tensors, path)
    e = build_engine(dataclasses.replace(BASE, layers=2, first_layer=1, weights=path,
                                         weights_prefix="model.layers.{layer}.self_attn."))
    for pos, layer in enumerate((1, 2)):
        assert torch.equal(bits(e.layer_weights[pos].weight), bits(want[layer]))
    one = build_engine(dataclasses.replace(BASE, weights=path, weights_prefix="model.layers.2.self_attn."))
    assert torch.equal(bits(one.weights.weight), bits(want[2]))
    with pytest.raises(ConfigError, match="model.layers.3.self_attn."):  # a layer the file lacks
        build_engine(dataclasses.replace(BASE, layers=2, first_layer=2, weights=path,
                                         weights_prefix="model.layers.{layer}.self_attn."))


def test_engine_weights_must_match_the_layer_count():
    e = build_engine(BASE)
    cfg = dataclasses.replace(e.config, num_layers=2)
    with pytest.raises(ValueError, match="2 layers"):
        Engine(cfg, e.weights, "cpu", backend=e.backend)
    Engine(cfg, [e.weights, e.weights], "cpu", backend=e.backend)


# ------------------------------------------------------------------------- over gRPC


def _write_req(layer: int | None, seed: int) -> pb.WriteCacheRequest:
    kv_c, k_pe = latents(seed)
    r = pb.WriteCacheRequest()
    r.slot_mapping.CopyFrom(encode_tensor(SLOTS.numpy()))
    r.kv_c.CopyFrom(encode_tensor(kv_c.numpy()))
    r.k_pe.CopyFrom(encode_tensor(k_pe.numpy()))
    if layer is not None:
        r.layer = layer
    return r


def _prefill_req(layer: int | None) -> pb.PrefillContextRequest:
    q = float32_to_bf16_bits(query().float().numpy())
    r = pb.PrefillContextRequest(sequences=[pb.Sequence(query_len=s.query_len, context_len=s.context_len,
                                                        block_table=list(s.block_table)) for s in SEQS])
    r.q.CopyFrom(encode_tensor(q, pb.DATA_TYPE_BF16))
    if layer is not None:
        r.layer = layer
    return r


def test_the_service_serves_each_layer_and_refuses_others():
    engine = build_engine(dataclasses.replace(BASE, layers=2, first_layer=3))

    async def main():
        async with Harness(engine) as h:
            info = await h.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
            assert (info.num_layers, info.first_layer) == (2, 3)
            for layer in (3, 4):
                r = await h.stub.WriteCache(_write_req(layer, layer), timeout=30)
                assert r.slots_written == SLOTS.numel()
            outs = {}
            for layer in (3, 4):
                r = await h.stub.PrefillContext(_prefill_req(layer), timeout=60)
                outs[layer] = bytes(r.output.data)
                want = engine.prefill_context(query(), SEQS, layer=layer)
                assert outs[layer] == want.out.contiguous().view(torch.uint16).numpy().tobytes()
            assert outs[3] != outs[4]
            for req, code in ((_prefill_req(None), grpc.StatusCode.INVALID_ARGUMENT),
                              (_prefill_req(5), grpc.StatusCode.OUT_OF_RANGE),
                              (_write_req(2, 0), grpc.StatusCode.OUT_OF_RANGE),
                              (pb.ReadCacheRequest(slot_mapping=encode_tensor(np.array([0], np.int64)), layer=9),
                               grpc.StatusCode.OUT_OF_RANGE)):
                method = {pb.PrefillContextRequest: h.stub.PrefillContext, pb.WriteCacheRequest: h.stub.WriteCache,
                          pb.ReadCacheRequest: h.stub.ReadCache}[type(req)]
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await method(req, timeout=30)
                assert ei.value.code() == code and ei.value.details().startswith("layer")
            r = await h.stub.ReadCache(pb.ReadCacheRequest(slot_mapping=encode_tensor(SLOTS.numpy()), layer=4),
                                       timeout=30)
            assert bytes(r.slots.data) == engine.read_cache(SLOTS, layer=4).numpy().tobytes()
            page = parse_metrics(h.metrics.render().decode())
            assert sample_sum(page["ctxprefill_cache_slots_total"]) == 2 * engine.config.cache.num_slots
            assert sample_sum(page["ctxprefill_cache_slots_used"]) == 2 * SLOTS.numel()

    asyncio.run(main())


def test_the_client_names_layers():
    from ctxprefill_client._common import ServerInfo, build_prefill_request, build_read_request, build_write_request

    assert build_read_request([0], None, layer=4).layer == 4
    assert not build_read_request([0], None).HasField("layer")
    assert build_write_request([0], np.zeros((1, 512), np.float32), np.zeros((1, 64), np.float32), None, 3).layer == 3
    req = build_prefill_request(np.zeros((1, 2, 192), np.float32), [(1, 0, [])], request_id=None, workspace_tokens=None,
                                plan=None, expected=None, q_dtype=None, server_prefill_dtype="bf16", layer=7)
    assert req.layer == 7
    old = ServerInfo.from_proto(pb.GetServerInfoResponse(num_heads=2))  # a server predating layers
    assert (old.num_layers, old.first_layer, list(old.layers)) == (1, 0, [0])
    new = ServerInfo.from_proto(pb.GetServerInfoResponse(num_heads=2, num_layers=2, first_layer=3))
    assert list(new.layers) == [3, 4]


# ------------------------------------------------------------- a server process, end to end


def test_a_server_of_two_layers_end_to_end():
    """``serve --layers 2 --first-layer 5`` as a process: each layer through a call each,
    a stream and a request ring equals an in-process one-layer engine of that layer; the
    client reads the layers from GetServerInfo."""
    import os

    from ctxprefill_client import PrefillContextClient, SystemSharedMemoryRegion
    from service_process import ServerProcess

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm: the ring part needs POSIX shared memory")
    flags = {"heads": 2, "block_size": 16, "num_blocks": 16, "workspace_tokens": 64, "seed": 4, "backend": "reference",
             "layers": 2, "first_layer": 5, "shared_memory": "system", "request_ring": True}
    q = float32_to_bf16_bits(query().float().numpy())
    seqs = [(s.query_len, s.context_len, list(s.block_table)) for s in SEQS]
    proc = ServerProcess(flags)
    region = SystemSharedMemoryRegion("layers-ring", 2 * (1 << 16))
    try:
        proc.wait_ready()
        with PrefillContextClient(proc.target, retries=0, timeout=60) as c:
            info = c.server_info()
            assert list(info.layers) == [5, 6]
            for layer in info.layers:
                assert c.write_cache(SLOTS.numpy(), *(t.numpy() for t in latents(layer)), layer=layer) == SLOTS.numel()
            c.register_system_shared_memory(region)
            with c.prefill_stream() as stream, c.attach_request_ring(region, num_slots=2, slot_bytes=1 << 16) as ring:
                for layer in info.layers:
                    one = build_engine(ServeSettings(device="cpu", heads=2, block_size=16, num_blocks=16,
                                                     workspace_tokens=64, seed=4, backend="reference",
                                                     first_layer=layer))
                    one.write_cache(SLOTS, *latents(layer))
                    want = one.prefill_context(query(), SEQS)
                    want_bits = want.out.contiguous().view(torch.uint16).numpy()
                    got = [c.prefill_context(q, seqs, layer=layer), stream.prefill_context(q, seqs, layer=layer),
                           ring.prefill_context(q, seqs, layer=layer)]
                    for r in got:
                        assert np.array_equal(r.output_bits, want_bits)
                        assert np.array_equal(r.lse.view(np.uint32), want.lse.numpy().view(np.uint32))
                    assert np.array_equal(c.read_cache(SLOTS.numpy(), layer=layer), one.read_cache(SLOTS).numpy())
                    # the new tokens' latents with the request (cache_write), through the ring and a call
                    new = np.array([200 + layer, 210 + layer], np.int64)
                    kv_c, k_pe = (t[:2].numpy() for t in latents(50 + layer))
                    r = ring.prefill_context(q, seqs, layer=layer, cache_write=(new, kv_c, k_pe))
                    assert r.slots_written == 2 and np.array_equal(r.output_bits, want_bits)
                    r = c.prefill_context(q, seqs, layer=layer, cache_write=(new[:1], kv_c[:1], k_pe[:1]))
                    assert r.slots_written == 1
                    one.write_cache(torch.from_numpy(new), torch.from_numpy(kv_c), torch.from_numpy(k_pe))
                    assert np.array_equal(c.read_cache(new, layer=layer), one.read_cache(torch.from_numpy(new)).numpy())
            with pytest.raises(Exception, match="layer"):
                c.prefill_context(q, seqs)  # two layers: the request must name one
    finally:
        proc.terminate(15)
        proc.kill()
        region.close()
        region.unlink()


def test_head_shards_of_two_layers_equal_the_whole_engine():
    """Two head shards, each holding layers 1 and 2, through ShardedPrefillClient: each
    layer equals an in-process unsharded engine of the same layers, bit for bit."""
    from ctxprefill_client import ShardedPrefillClient
    from service_process import ServerProcess

    common = {"heads": 4, "block_size": 16, "num_blocks": 16, "workspace_tokens": 64, "seed": 2,
              "backend": "reference", "layers": 2, "first_layer": 1, "num_shards": 2}
    whole = build_engine(ServeSettings(device="cpu", heads=4, block_size=16, num_blocks=16, workspace_tokens=64,
                                       seed=2, backend="reference", layers=2, first_layer=1))
    g = torch.Generator().manual_seed(3)
    q = torch.randn((sum(QUERIES), 4, 192), generator=g).to(torch.bfloat16)
    q_bits = q.view(torch.uint16).numpy()
    seqs = [(s.query_len, s.context_len, list(s.block_table)) for s in SEQS]
    procs = [ServerProcess({**common, "shard_index": i}) for i in (0, 1)]
    try:
        for p in procs:
            p.wait_ready()
        with ShardedPrefillClient([p.target for p in procs], timeout=60.0, retries=0) as sc:
            assert all(list(i.layers) == [1, 2] for i in sc.server_info())
            for layer in (1, 2):
                kv_c, k_pe = latents(10 + layer)
                assert sc.write_cache(SLOTS.numpy(), kv_c.numpy(), k_pe.numpy(), layer=layer) == SLOTS.numel()
                whole.write_cache(SLOTS, kv_c, k_pe, layer=layer)
            for layer in (1, 2):
                want = whole.prefill_context(q, SEQS, layer=layer)
                got = sc.prefill_context(q_bits, seqs, layer=layer)
                assert np.array_equal(got.output_bits, want.out.contiguous().view(torch.uint16).numpy())
                assert np.array_equal(got.lse.view(np.uint32), want.lse.numpy().view(np.uint32))
                assert np.array_equal(sc.read_cache(SLOTS.numpy(), layer=layer, verify=True),
                                      whole.read_cache(SLOTS, layer=layer).numpy())
    finally:
        for p in procs:
            p.terminate(15)
            p.kill()


def test_the_example_orchestrator_on_one_layer_of_two(tmp_path, capsys):
    """The client example (``--layer``, ``{layer}`` in ``--weights-prefix``) against a
    ``serve --layers 2`` process whose weights file holds the two layers."""
    from safetensors.torch import save_file

    from ctxprefill_client.examples import orchestrator
    from service_process import ServerProcess

    path = str(tmp_path / "model.safetensors")
    shape = SHAPE
    save_file({f"model.layers.{layer}.self_attn.kv_b_proj.weight": random_kv_b_proj(shape, "bf16", 30 + layer)
               ["kv_b_proj.weight"] for layer in (5, 6)}, path)
    proc = ServerProcess({"heads": 2, "block_size": 16, "num_blocks": 64, "workspace_tokens": 128,
                          "backend": "reference", "layers": 2, "first_layer": 5, "weights": path,
                          "weights_prefix": "model.layers.{layer}.self_attn."})
    try:
        proc.wait_ready()
        for layer in (5, 6):
            assert orchestrator.main(["--target", proc.target, "--weights", path, "--layer", str(layer),
                                      "--weights-prefix", "model.layers.{layer}.self_attn."]) == 0
        # the other layer's weights for this layer's attention: the check fails
        assert orchestrator.main(["--target", proc.target, "--weights", path, "--layer", "6",
                                  "--weights-prefix", "model.layers.5.self_attn."]) == 1
        # ctxprefill demo --target reads the first layer's weight from the file by the same prefix;
        # without {layer} it cannot know which, and says so instead of checking against a wrong one
        from ctxprefill_bench.remote_demo import run_remote_demo

        assert run_remote_demo(proc.target, ServeSettings(weights=path,
                                                          weights_prefix="model.layers.{layer}.self_attn.")) == 0
        assert "error vs float64 within 0.01: True" in capsys.readouterr().out
        one_layer = ServeSettings(weights=path, weights_prefix="model.layers.5.self_attn.")
        assert run_remote_demo(proc.target, one_layer) == 0
        assert "float64 check skipped" in capsys.readouterr().out
    finally:
        proc.terminate(15)
        proc.kill()


def test_caches_that_cannot_fit_refuse_to_start(monkeypatch):
    from ctxprefill import app

    with pytest.raises(ConfigError, match="--num-blocks, --layers") as ei:
        build_engine(dataclasses.replace(BASE, num_blocks=2**31 // 16 - 1, layers=2))
    assert "2 layer(s)" in str(ei.value)
    # what the device says is free decides, not a fixed limit
    cfg = build_engine(BASE).config
    need = sum(app.memory_bytes(cfg))
    monkeypatch.setattr(app, "available_bytes", lambda device: need - 1)
    with pytest.raises(ConfigError, match="GiB free"):
        build_engine(BASE)
    monkeypatch.setattr(app, "available_bytes", lambda device: need)
    build_engine(BASE)
    monkeypatch.setattr(app, "available_bytes", lambda device: None)  # unknown: the allocation decides
    build_engine(BASE)


def test_the_remote_demo_uses_the_first_layer_of_several(capsys):
    from ctxprefill_bench.remote_demo import run_remote_demo
    from service_process import ServerProcess

    proc = ServerProcess({"heads": 2, "block_size": 16, "num_blocks": 64, "workspace_tokens": 128,
                          "backend": "reference", "seed": 3, "layers": 3, "first_layer": 2})
    try:
        proc.wait_ready()
        assert run_remote_demo(proc.target, ServeSettings(seed=3)) == 0
        out = capsys.readouterr().out
        assert "layer=2 of [2, 3, 4]" in out and "error vs float64 within 0.01: True" in out
    finally:
        proc.terminate(15)
        proc.kill()


def test_the_graph_path_before_its_capture_is_the_eager_loop(two_layers):
    """A request on the CUDA-graph path whose shape has no graph yet (engine/graphs.py:
    its shape and metadata made from the checked request, the replay's lookup missed)
    runs the eager loop over that metadata: the same bits as the plain path, the shape
    counted once, nothing replayed. (Capture and replay: tests/gpu/test_graphs_gpu.py.)"""
    from ctxprefill.engine.graphs import LoopGraphs

    graphs = two_layers.graphs = LoopGraphs()
    try:
        for layer in (3, 4):
            plain = two_layers.prefill_context(query(), SEQS, layer=layer, graphs_on=False)
            via = two_layers.prefill_context(query(), SEQS, layer=layer, graphs_on=True)
            assert torch.equal(bits(via.out), bits(plain.out)) and torch.equal(bits(via.lse), bits(plain.lse))
            assert via.stats.launches == plain.stats.launches
        assert list(graphs._seen.values()) == [1, 1] and (graphs.replays, graphs.captures) == (0, 0)
    finally:
        two_layers.graphs = None
