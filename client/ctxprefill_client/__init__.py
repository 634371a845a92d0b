"""ctxprefill_client: the caller's side of the ctxprefill gRPC API (numpy, grpcio and
protobuf only; no torch).

- :class:`PrefillContextClient` / :class:`AsyncPrefillContextClient`: the RPCs, with
  deadlines, retries on UNAVAILABLE and server-restart detection.
- :class:`PrefillStream` / :class:`AsyncPrefillStream` (``client.prefill_stream()``):
  PrefillContext requests over one open call, for callers that send many.
- :class:`RequestRing` (``client.attach_request_ring()``; server ``--request-ring``):
  PrefillContext through shared-memory slots polled by the server's engine thread, no
  gRPC call per request (the same-host fast path, docs/TRANSPORT.md).
- :func:`merge_partials`: merge two (output, LSE) attention partials.
- :class:`ShardedPrefillClient` / :class:`AsyncShardedPrefillClient`: one model whose
  heads are split over several workers (``serve --num-shards``; docs/SHARDING.md).
- :mod:`ctxprefill_client.tensors`: numpy <-> ``Tensor`` messages and exact bf16/fp8 casts;
  :func:`slot_mapping`: the cache slots of a sequence's context positions from its block table.
- :mod:`ctxprefill_client.shared_memory`: same-host transport (``serve --shared-memory``):
  :class:`SystemSharedMemoryRegion` (POSIX shared memory, numpy views) and
  :class:`CudaSharedMemoryRegion` (a torch CUDA tensor by its IPC handle; torch imported
  lazily), registered with ``register_system_shared_memory`` /
  ``register_cuda_shared_memory`` (docs/TRANSPORT.md).
- The messages and stubs themselves are the ``ctxprefill_api`` package (``pb``, ``pb_grpc``),
  which ships beside this one and which the server imports too.
"""

from ._common import (
    ContextChunk,
    CtxPrefillError,
    CtxPrefillRpcError,
    PrefillResult,
    ResponseDecodeError,
    Sequence,
    ServerInfo,
    ServerRestartedError,
)
from .aio import AsyncPrefillContextClient
from .client import PrefillContextClient
from .merge import merge_partials
from .request_ring import PreparedRequest, RequestRing
from .sharded import AsyncShardedPrefillClient, ShardedPrefillClient
from .shared_memory import (
    CudaSharedMemoryRegion,
    SharedMemoryRef,
    SharedMemoryRegionStatus,
    SharedMemoryTensor,
    SystemSharedMemoryRegion,
    cuda_ipc_handle,
)
from .stream import AsyncPrefillStream, PrefillStream
from .tensors import (
    BF16,
    FP8_E4M3,
    FP16,
    FP32,
    INT32,
    INT64,
    UINT8,
    RawTensor,
    bf16_bits_to_float32,
    decode_tensor,
    encode_tensor,
    float32_to_bf16_bits,
    float32_to_fp8_e4m3_bits,
    fp8_e4m3_bits_to_float32,
    slot_mapping,
    tensor_to_numpy,
)

__version__ = "0.1.0"

__all__ = [
    "BF16",
    "FP16",
    "FP32",
    "FP8_E4M3",
    "INT32",
    "INT64",
    "UINT8",
    "AsyncPrefillContextClient",
    "AsyncPrefillStream",
    "AsyncShardedPrefillClient",
    "ContextChunk",
    "CtxPrefillError",
    "CudaSharedMemoryRegion",
    "CtxPrefillRpcError",
    "PrefillContextClient",
    "PrefillResult",
    "PrefillStream",
    "PreparedRequest",
    "RequestRing",
    "RawTensor",
    "ResponseDecodeError",
    "Sequence",
    "ServerInfo",
    "ServerRestartedError",
    "ShardedPrefillClient",
    "SharedMemoryRef",
    "SharedMemoryRegionStatus",
    "SharedMemoryTensor",
    "SystemSharedMemoryRegion",
    "__version__",
    "bf16_bits_to_float32",
    "cuda_ipc_handle",
    "decode_tensor",
    "encode_tensor",
    "float32_to_bf16_bits",
    "float32_to_fp8_e4m3_bits",
    "fp8_e4m3_bits_to_float32",
    "merge_partials",
    "slot_mapping",
    "tensor_to_numpy",
]
