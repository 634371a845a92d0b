"""A small in-process ctxprefill gRPC server on the CPU (a real Engine of one head, the
servicer, the interceptors, an aio channel to it) for the service-layer tests."""

from __future__ import annotations

import grpc
import numpy as np

from ctxprefill.app import build_engine
from ctxprefill.service.engine_worker import EngineWorker
from ctxprefill.service.interceptors import server_interceptors
from ctxprefill.service.metrics import Metrics
from ctxprefill.service.servicer import PrefillContextServicer
from ctxprefill.settings import ServeSettings
from ctxprefill_api import pb, pb_grpc
from ctxprefill_client import encode_tensor, float32_to_bf16_bits
from service_process import parse_metrics, sample_sum

SETTINGS = ServeSettings(device="cpu", heads=1, block_size=16, num_blocks=8, workspace_tokens=64)
SERVICE = "ctxprefill.v1.PrefillContextService"


def small_engine():
    """The engine the harness serves (tests share one per module: it takes a while)."""
    return build_engine(SETTINGS)


class Harness:
    def __init__(self, engine, queue_size=4, ready=True, tracing=None):
        self.tracing = tracing  # service.tracing.Tracing: the RPC spans on
        self.metrics = Metrics()
        self.worker = EngineWorker(self.metrics)
        self.servicer = PrefillContextServicer(SETTINGS, self.metrics, self.worker, 64 << 20, queue_size)
        if ready:
            self.servicer.attach_engine(engine)
            self.servicer.set_ready()

    async def __aenter__(self):
        self.server = grpc.aio.server(interceptors=server_interceptors(self.metrics, tracing=self.tracing))
        pb_grpc.add_PrefillContextServiceServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.target = f"127.0.0.1:{port}"
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = pb_grpc.PrefillContextServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.server.stop(0)
        self.worker.stop(5)

    def handled(self, method, code) -> float:
        m = parse_metrics(self.metrics.render().decode())
        return sample_sum(m["grpc_server_handled_total"], grpc_method=method, grpc_code=code)


def read_req(slot=0):
    return pb.ReadCacheRequest(slot_mapping=encode_tensor(np.array([slot], np.int64)))


def prefill_req(rows=2, context=20):
    q = float32_to_bf16_bits(np.ones((rows, 1, 192), np.float32))
    return pb.PrefillContextRequest(q=encode_tensor(q, pb.DATA_TYPE_BF16),
                                    sequences=[pb.Sequence(query_len=rows, context_len=context, block_table=[3, 4])])
