"""Container health check: ask the server's ``grpc.health.v1`` service; exit 0 if SERVING.

    python deploy/healthcheck.py [SERVICE]

SERVICE defaults to ``ctxprefill.v1.PrefillContextService`` (readiness: the engine is
built and warm, the server is not draining); pass ``""`` for the overall status
(liveness: the process serves gRPC). The target is ``$CTXPREFILL_HEALTH_TARGET``, else
``127.0.0.1:$CTXPREFILL_PORT`` (default port 50051), so that it follows the same
environment variable as ``ctxprefill serve``. Exit codes: 0 SERVING, 1 anything else
(NOT_SERVING, unknown service, no answer within ``$CTXPREFILL_HEALTH_TIMEOUT`` s, default 3).
Used by the image's HEALTHCHECK; Kubernetes uses its native gRPC probes instead.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "ctxprefill.v1.PrefillContextService"


def check(target: str, service: str, timeout: float) -> tuple[bool, str]:
    try:
        with grpc.insecure_channel(target) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=timeout)
    except grpc.RpcError as e:
        return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str]) -> int:
    service = argv[1] if len(argv) > 1 else SERVICE
    target = os.environ.get("CTXPREFILL_HEALTH_TARGET") or f"127.0.0.1:{os.environ.get('CTXPREFILL_PORT', '50051')}"
    timeout = float(os.environ.get("CTXPREFILL_HEALTH_TIMEOUT", "3"))
    ok, what = check(target, service, timeout)
    print(f"{target} {service or '(overall)'}: {what}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
