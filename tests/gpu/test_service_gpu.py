"""The service's metrics on the GPU (CONTRACT §9): for one PrefillContext RPC, the
increase of ``ctxprefill_kernel_launches_total`` equals the kernels the CUDA profiler
records while the request runs, and ``ctxprefill_fp8_path_total`` moves by the number
of chunks under the request's dtype combination."""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: service_process

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device: the GPU service tests run on the GPU machine")]

COMBOS = [("auto", "bf16"), ("fp8", "bf16"), ("fp8", "fp8"), ("fp8_ds_mla", "bf16"), ("fp8_ds_mla", "fp8")]


@pytest.mark.parametrize("cache_dtype,prefill", COMBOS)
def test_launch_metric_equals_profiler_and_fp8_path_counts_chunks(cache_dtype, prefill):
    import grpc
    from torch.profiler import ProfilerActivity, profile

    from ctxprefill.app import build_engine
    from ctxprefill.service.engine_worker import EngineWorker
    from ctxprefill.service.interceptors import server_interceptors
    from ctxprefill.service.metrics import Metrics
    from ctxprefill.service.servicer import PrefillContextServicer
    from ctxprefill.settings import ServeSettings
    from ctxprefill_api import pb, pb_grpc
    from ctxprefill_client import encode_tensor, float32_to_bf16_bits, float32_to_fp8_e4m3_bits
    from service_process import parse_metrics, sample_sum

    s = ServeSettings(device="cuda", heads=4, block_size=16, num_blocks=64, workspace_tokens=64,
                      cache_dtype=cache_dtype, prefill_dtype=prefill, backend="gluon")  # the H200's kernel
    engine = build_engine(s)
    metrics = Metrics()
    worker = EngineWorker(metrics)
    servicer = PrefillContextServicer(s, metrics, worker, 256 << 20, 8)
    servicer.attach_engine(engine)
    servicer.set_ready()
    rng = np.random.default_rng(0)
    contexts, queries = [100, 0, 40], [5, 3, 7]
    tables = [list(range(0, 7)), [], list(range(7, 10))]

    def launches_total(m):  # every stage of a request (the insert of WriteCache is not one)
        return sum(v for labels, v in m.get("ctxprefill_kernel_launches_total", []) if labels.get("stage") != "insert")

    async def main():
        server = grpc.aio.server(interceptors=server_interceptors(metrics))
        pb_grpc.add_PrefillContextServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.PrefillContextServiceStub(ch)
            n = sum(contexts)
            slots = np.concatenate([
                (np.array(t)[np.arange(c) // 16] * 16 + np.arange(c) % 16) if c else np.zeros(0, np.int64)
                for t, c in zip(tables, contexts)]).astype(np.int64)
            assert slots.size == n
            await stub.WriteCache(pb.WriteCacheRequest(
                slot_mapping=encode_tensor(slots),
                kv_c=encode_tensor(rng.standard_normal((n, 512), dtype=np.float32)),
                k_pe=encode_tensor(rng.standard_normal((n, 64), dtype=np.float32))))
            qf = rng.standard_normal((sum(queries), 4, 192), dtype=np.float32)
            q = (encode_tensor(float32_to_fp8_e4m3_bits(qf), pb.DATA_TYPE_FP8_E4M3) if prefill == "fp8"
                 else encode_tensor(float32_to_bf16_bits(qf), pb.DATA_TYPE_BF16))
            req = pb.PrefillContextRequest(q=q, sequences=[
                pb.Sequence(query_len=qn, context_len=c, block_table=t) for qn, c, t in zip(queries, contexts, tables)])
            await stub.PrefillContext(req)  # warm-up: Triton compile, cuBLAS handles
            before = parse_metrics(metrics.render().decode())
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                resp = await stub.PrefillContext(req)
                torch.cuda.synchronize()
            after = parse_metrics(metrics.render().decode())
        await server.stop(0)
        return before, after, resp, prof

    try:
        before, after, resp, prof = asyncio.run(main())
    finally:
        worker.stop(5)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if not any(x in n.lower() for x in ("memcpy", "memset"))]  # as device_profile
    dtod = [n for n in names if "memcpy dtod" in n.lower()]
    delta = launches_total(after) - launches_total(before)
    chunks = resp.stats.num_chunks
    print(f"[service launches] {cache_dtype}/{prefill}: metric +{delta:.0f}, profiler {len(kernels)} kernels + "
          f"{len(dtod)} DtoD, chunks {chunks}")
    assert delta == len(kernels) + len(dtod), sorted(set(kernels))
    labels = dict(cache_dtype=cache_dtype, kv_b_proj_dtype="bf16", prefill_dtype=prefill)
    moved = (sample_sum(after["ctxprefill_fp8_path_total"], **labels)
             - sample_sum(before.get("ctxprefill_fp8_path_total", []), **labels))
    assert chunks == 3 and moved == chunks
