"""Faults on the GPU: device out-of-memory for one request, and hostile input against a
real ``--device cuda`` process (every index checked before a kernel sees it).

- A request too large for the device memory left free gets RESOURCE_EXHAUSTED ("out
  of memory"), counted as ``rejected{reason="out_of_memory"}``; with the memory still
  taken, a normal request right after returns the result it returned before, bit for
  bit; once memory is free again the large request succeeds. (In-process servicer on
  a real grpc.aio server; the memory is taken by this process, so the server sees it
  as taken.)
- ``hostile_cases``' mutations (the CPU suite's families, fewer of them) against a
  ``ctxprefill serve --device cuda`` process: all refused with the field named, the
  valid ones bit for bit, the process alive and the cache bytes unchanged. The same
  set under compute-sanitizer is ``scripts/hostile_under_sanitizer.sh``.

Skipped, with the reason, where there is no CUDA device.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the GPU fault tests run on the GPU machine")]

GiB, MiB = 1 << 30, 1 << 20


def _prefill_req(rows: int, context: int, H: int, bs: int, seed: int = 0):
    from ctxprefill_api import pb
    from ctxprefill_client import encode_tensor, float32_to_bf16_bits

    x = np.random.default_rng(seed).standard_normal((rows, H, 192)).astype(np.float32)
    return pb.PrefillContextRequest(
        q=encode_tensor(float32_to_bf16_bits(x), pb.DATA_TYPE_BF16),
        sequences=[pb.Sequence(query_len=rows, context_len=context, block_table=list(range(-(-context // bs))))])


def test_device_out_of_memory_is_resource_exhausted_and_the_server_goes_on(cuda_ext):
    from ctxprefill.app import build_engine
    from ctxprefill.service.engine_worker import EngineWorker
    from ctxprefill.service.interceptors import server_interceptors
    from ctxprefill.service.metrics import Metrics
    from ctxprefill.service.servicer import PrefillContextServicer
    from ctxprefill.settings import ServeSettings
    from ctxprefill_api import pb, pb_grpc
    from ctxprefill_client import encode_tensor
    from service_process import parse_metrics, sample_sum

    H, bs = 16, 64
    settings = ServeSettings(device="cuda", heads=H, block_size=bs, num_blocks=64, workspace_tokens=4096)
    engine = build_engine(settings)
    rng = np.random.default_rng(1)
    slots = np.arange(16 * bs, dtype=np.int64)
    engine.write_cache(torch.from_numpy(slots), torch.from_numpy(rng.standard_normal((len(slots), 512),
                                                                                    dtype=np.float32)),
                       torch.from_numpy(rng.standard_normal((len(slots), 64), dtype=np.float32)))
    small = _prefill_req(24, 700, H, bs)
    # q [rows, 16, 192] bf16 on the device plus out [rows, 16, 128]: ~10 KiB a row
    big_rows = 40_000
    big = _prefill_req(big_rows, 256, H, bs, seed=2)
    margin = 128 * MiB  # less than the big request needs (~400 MiB), far more than the small one

    async def main():
        metrics = Metrics()
        worker = EngineWorker(metrics)
        servicer = PrefillContextServicer(settings, metrics, worker, GiB, 4)
        servicer.attach_engine(engine)
        servicer.set_ready()
        server = grpc.aio.server(interceptors=server_interceptors(metrics),
                                 options=[("grpc.max_receive_message_length", GiB),
                                          ("grpc.max_send_message_length", GiB)])
        pb_grpc.add_PrefillContextServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", GiB),
                                                                      ("grpc.max_send_message_length", GiB)])
        stub = pb_grpc.PrefillContextServiceStub(ch)
        hog = []
        try:
            ref = await stub.PrefillContext(small, timeout=120)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            hog.append(torch.empty(max(0, free - margin), dtype=torch.uint8, device="cuda"))
            free_now, _ = torch.cuda.mem_get_info()
            assert free_now < 2 * margin, f"could not take the device memory ({free_now / MiB:.0f} MiB left)"

            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.PrefillContext(big, timeout=300)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
            assert "out of memory" in ei.value.details()
            # the server goes on, with the memory still taken: the same answer as before
            r = await stub.PrefillContext(small, timeout=120)
            assert r.output.data == ref.output.data and r.lse.data == ref.lse.data
            # ... and the cache is intact
            read = await stub.ReadCache(pb.ReadCacheRequest(slot_mapping=encode_tensor(slots)), timeout=60)
            assert read.slots.data == engine.read_cache(torch.from_numpy(slots)).numpy().tobytes()
            page = parse_metrics(metrics.render().decode())
            assert sample_sum(page["ctxprefill_rejected_requests_total"], reason="out_of_memory") == 1
            # memory back: the large request runs
            hog.clear()
            torch.cuda.empty_cache()
            r = await stub.PrefillContext(big, timeout=300)
            assert list(r.output.shape) == [big_rows, H, 128]
            r = await stub.PrefillContext(small, timeout=120)
            assert r.output.data == ref.output.data
        finally:
            hog.clear()
            await ch.close()
            await server.stop(0)
            worker.stop(5)

    asyncio.run(main())


@pytest.mark.parametrize("flags", [
    {"cache_dtype": "auto", "kv_b_proj_dtype": "bf16", "prefill_dtype": "bf16"},
    {"cache_dtype": "fp8", "kv_b_proj_dtype": "bf16", "prefill_dtype": "bf16"},
    {"cache_dtype": "fp8_ds_mla", "kv_b_proj_dtype": "fp8", "prefill_dtype": "fp8"},
], ids=["auto", "fp8", "fp8_ds_mla-fp8prefill"])
def test_hostile_requests_on_the_gpu(cuda_ext, flags):
    import hostile_cases as hc
    from service_process import ServerProcess

    proc = ServerProcess({"device": "cuda", "heads": 2, "block_size": 16, "num_blocks": 64,
                          "workspace_tokens": 64, "max_message_bytes": 4 << 20, **flags})
    try:
        proc.wait_ready(timeout=600)
        with grpc.insecure_channel(proc.target) as ch:
            w = hc.Workload(ch, seed=3)
            w.setup()
            d = hc.RandomDrawer(11)
            problems, sent = [], 0
            while sent < 3000:
                for o in hc.send_batch(w, hc.draw_batch(d, w, 50, 2)):
                    sent += o.case.hostile
                    assert o.code.name not in ("UNKNOWN", "INTERNAL"), (o.case.kind, o.details)
                    if o.problem:
                        problems.append(f"{o.case.kind} ({o.case.method}): {o.problem}")
            assert not problems, "\n".join(problems[:20])
            assert proc.proc.poll() is None, proc.log()
            assert np.array_equal(w.read_all(), w.snapshot), "cache bytes changed"
        assert '"level": "ERROR"' not in proc.log(), proc.log()[-4000:]
    finally:
        proc.terminate(30)
        proc.kill()
