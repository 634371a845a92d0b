"""asyncio client of ``ctxprefill.v1.PrefillContextService`` (``grpc.aio``).

The twin of :class:`ctxprefill_client.PrefillContextClient`: same arguments, same
methods (coroutines), same deadlines, retries and instance-id tracking.

    async with AsyncPrefillContextClient("localhost:50051") as client:
        info = await client.server_info()
        res = await client.prefill_context(q, sequences)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc
import grpc.aio
import numpy as np

from ctxprefill_api import pb, pb_grpc
from ctxprefill_api.wire import use_outgoing_requests

from ._common import (
    DEFAULT_BACKOFF_BASE_S,
    DEFAULT_BACKOFF_MAX_S,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_S,
    RETRYABLE_CODES,
    InstanceTracker,
    PrefillResult,
    ServerInfo,
    backoff_delay,
    build_prefill_request,
    build_read_request,
    build_write_request,
    call_metadata,
    channel_credentials,
    map_rpc_error,
    parse_prefill_response,
    parse_read_response,
    tls_channel_options,
)
from ._common import channel_options as _channel_options
from ._trace_context import with_trace_context
from .shared_memory import (
    SharedMemoryRef,
    SharedMemoryRegionStatus,
    register_cuda_request,
    register_system_request,
)
from .stream import AsyncPrefillStream

__all__ = ["AsyncPrefillContextClient"]

_R = TypeVar("_R")


class AsyncPrefillContextClient:
    """asyncio client; see :class:`ctxprefill_client.PrefillContextClient` for the arguments.

    Create it inside a running event loop (grpc.aio binds its channel to the loop).
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        retries: int = DEFAULT_RETRIES,
        backoff_base: float = DEFAULT_BACKOFF_BASE_S,
        backoff_max: float = DEFAULT_BACKOFF_MAX_S,
        credentials: grpc.ChannelCredentials | None = None,
        tls: bool = False,
        root_certificates: bytes | str | None = None,
        client_certificate: bytes | str | None = None,
        client_key: bytes | str | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        metadata: Iterable[tuple[str, str]] = (),
        expected_instance_id: str | None = None,
        track_instance: bool = True,
        channel_options: Iterable[tuple[str, Any]] = (),
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        self.target = target
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff_base = float(backoff_base)
        self.backoff_max = float(backoff_max)
        self._metadata = call_metadata(token, metadata)
        self._tracker = InstanceTracker(expected_instance_id, track_instance)
        self._info: ServerInfo | None = None
        self._owns_channel = channel is None
        if channel is None:
            opts = _channel_options(max_message_bytes, [*tls_channel_options(tls_server_name), *channel_options])
            creds = channel_credentials(credentials, tls, root_certificates, client_certificate, client_key)
            channel = (
                grpc.aio.secure_channel(target, creds, options=opts)
                if creds is not None
                else grpc.aio.insecure_channel(target, options=opts)
            )
        self._channel = channel
        self._stub = pb_grpc.PrefillContextServiceStub(channel)
        use_outgoing_requests(self._stub, channel)

    # ------------------------------------------------------------------ plumbing

    async def close(self) -> None:
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self) -> AsyncPrefillContextClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def instance_id(self) -> str | None:
        """The server instance this client expects (None until the first answer)."""
        return self._tracker.instance_id

    def reset_instance(self, instance_id: str | None = None) -> None:
        """Forget the remembered instance; the next answer's id becomes the expected one."""
        self._tracker.reset(instance_id)
        self._info = None

    async def _call(
        self,
        method: str,
        rpc: Callable[..., Awaitable[_R]],
        request: Any,
        timeout: float | None,
        expected: str | None,
    ) -> _R:
        deadline = self.timeout if timeout is None else float(timeout)
        attempt = 0
        while True:
            try:
                return await rpc(request, timeout=deadline, metadata=with_trace_context(self._metadata))
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                if code in RETRYABLE_CODES and attempt < self.retries:
                    await asyncio.sleep(backoff_delay(attempt, self.backoff_base, self.backoff_max))
                    attempt += 1
                    continue
                raise map_rpc_error(method, err, expected) from err

    # ------------------------------------------------------------------ RPCs

    async def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        """GetServerInfo. Raises ServerRestartedError if the instance changed."""
        resp = await self._call("GetServerInfo", self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout, None)
        info = ServerInfo.from_proto(resp)
        self._tracker.observe("GetServerInfo", info.instance_id)
        self._info = info
        return info

    async def write_cache(self, slot_mapping: Any, kv_c: Any, k_pe: Any, *, timeout: float | None = None,
                          layer: int | None = None) -> int:
        """WriteCache; see ``PrefillContextClient.write_cache``. Returns slots written."""
        expected = self._tracker.expected()
        req = build_write_request(slot_mapping, kv_c, k_pe, expected, layer)
        resp = await self._call("WriteCache", self._stub.WriteCache, req, timeout, expected)
        self._tracker.observe("WriteCache", resp.instance_id)
        return int(resp.slots_written)

    async def read_cache(self, slot_mapping: Any, *, timeout: float | None = None,
                         layer: int | None = None) -> np.ndarray:
        """ReadCache: the raw bytes of the slots, ``uint8 [T, bytes_per_slot]``."""
        expected = self._tracker.expected()
        req = build_read_request(slot_mapping, expected, layer)
        resp = await self._call("ReadCache", self._stub.ReadCache, req, timeout, expected)
        self._tracker.observe("ReadCache", resp.instance_id)
        return parse_read_response(resp, len(req.slot_mapping.data) // 8)

    async def prefill_context(
        self,
        q: Any,
        sequences: Iterable[Any],
        *,
        request_id: str | None = None,
        workspace_tokens: int | None = None,
        plan: Iterable[Any] | None = None,
        q_dtype: int | None = None,
        output_region: SharedMemoryRef | None = None,
        lse_region: SharedMemoryRef | None = None,
        float_output: bool = True,
        timeout: float | None = None,
        layer: int | None = None,
        cache_write: Any = None,
    ) -> PrefillResult:
        """PrefillContext; see ``PrefillContextClient.prefill_context``."""
        expected = self._tracker.expected()
        req = build_prefill_request(
            q,
            sequences,
            request_id=request_id,
            workspace_tokens=workspace_tokens,
            plan=plan,
            expected=expected,
            q_dtype=q_dtype,
            server_prefill_dtype=self._info.prefill_dtype if self._info else None,
            output_region=output_region,
            lse_region=lse_region,
            layer=layer,
            cache_write=cache_write,
        )
        resp = await self._call("PrefillContext", self._stub.PrefillContext, req, timeout, expected)
        self._tracker.observe("PrefillContext", resp.instance_id)
        rows = int(req.q.shape[0]) if len(req.q.shape) else 0
        return parse_prefill_response(resp, rows, output_region, lse_region, float_output)

    def prefill_stream(self, *, timeout: float | None = None) -> AsyncPrefillStream:
        """A :class:`~ctxprefill_client.stream.AsyncPrefillStream`: PrefillContext requests one after
        another (or several in flight) over one open ``PrefillContextStream`` call, which
        costs less per request than a call each. ``timeout`` bounds the whole stream
        (default: the client's). Use it as an async context manager."""
        return AsyncPrefillStream(self, timeout)

    # ------------------------------------------------------------------ shared memory

    async def register_system_shared_memory(
        self, region: Any, key: str | None = None, byte_size: int | None = None, *, offset: int = 0,
        timeout: float | None = None,
    ) -> SharedMemoryRegionStatus:
        """RegisterSystemSharedMemory: ``region`` is a :class:`SystemSharedMemoryRegion`, or
        a region name with the POSIX shm ``key`` and ``byte_size`` (``offset``: where the
        region starts in the object). Needs a server with ``--shared-memory system|all``."""
        req = register_system_request(region, key, byte_size, offset)
        resp = await self._call("RegisterSystemSharedMemory", self._stub.RegisterSystemSharedMemory, req, timeout, None)
        return SharedMemoryRegionStatus.from_proto(resp.region)

    async def register_cuda_shared_memory(
        self, region: Any, raw_handle: bytes | None = None, device_id: int | None = None,
        byte_size: int | None = None, *, offset: int = 0, timeout: float | None = None,
    ) -> SharedMemoryRegionStatus:
        """RegisterCudaSharedMemory: ``region`` is a :class:`CudaSharedMemoryRegion` (a torch
        CUDA tensor of this process), or a region name with the 64-byte ``raw_handle``, the
        server's ``device_id``, ``byte_size`` and ``offset`` in the allocation. Needs a server
        on the same host and GPU with ``--shared-memory cuda|all``."""
        req = register_cuda_request(region, raw_handle, device_id, byte_size, offset)
        resp = await self._call("RegisterCudaSharedMemory", self._stub.RegisterCudaSharedMemory, req, timeout, None)
        return SharedMemoryRegionStatus.from_proto(resp.region)

    async def unregister_shared_memory(self, name: str = "", *, timeout: float | None = None) -> list[str]:
        """UnregisterSharedMemory of region ``name`` ("": all); returns the names unregistered."""
        req = pb.UnregisterSharedMemoryRequest(name=name)
        resp = await self._call("UnregisterSharedMemory", self._stub.UnregisterSharedMemory, req, timeout, None)
        return list(resp.names)

    async def shared_memory_status(self, name: str = "", *,
                                   timeout: float | None = None) -> list[SharedMemoryRegionStatus]:
        """GetSharedMemoryStatus of region ``name`` ("": all)."""
        req = pb.GetSharedMemoryStatusRequest(name=name)
        resp = await self._call("GetSharedMemoryStatus", self._stub.GetSharedMemoryStatus, req, timeout, None)
        return [SharedMemoryRegionStatus.from_proto(r) for r in resp.regions]
