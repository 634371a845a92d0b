"""The ctxprefill wire API, shared by the server and the client.

- ``pb`` / ``pb_grpc``: the messages and stubs generated from
  ``proto/ctxprefill/v1/ctxprefill.proto`` (``scripts/gen_proto.sh``; never edited by hand).
- :mod:`ctxprefill_api.wire`: messages whose inline tensor bytes are appended at
  serialization instead of copied into the message.
- :mod:`ctxprefill_api.ring`: the request ring's slot layout.

Torch-free: it needs numpy, grpcio and protobuf only.
"""

from .ctxprefill.v1 import ctxprefill_pb2 as pb
from .ctxprefill.v1 import ctxprefill_pb2_grpc as pb_grpc

SERVICE_NAME = "ctxprefill.v1.PrefillContextService"

__all__ = ["pb", "pb_grpc", "SERVICE_NAME"]
