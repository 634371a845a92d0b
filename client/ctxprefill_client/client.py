"""Synchronous client of ``ctxprefill.v1.PrefillContextService``.

    from ctxprefill_client import PrefillContextClient

    with PrefillContextClient("localhost:50051") as client:
        info = client.server_info()
        client.write_cache(slots, kv_c, k_pe)            # float arrays [T, L], [T, R]
        res = client.prefill_context(q, [(4, 200, block_table)])
        res.output, res.lse                               # [Tq, H, V] float32, [H, Tq] natural log

Every call has a deadline (``timeout``); UNAVAILABLE is retried with exponential
backoff and full jitter (``retries`` extra attempts), nothing else is. The client
remembers the server's ``instance_id`` from the first answer and sends it as
``expected_instance_id`` on WriteCache, ReadCache and PrefillContext: a restarted
server (whose cache is gone) then surfaces as :class:`ServerRestartedError` instead
of silently wrong results.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import grpc
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
from .request_ring import RequestRing
from .shared_memory import (
    SharedMemoryRef,
    SharedMemoryRegionStatus,
    register_cuda_request,
    register_system_request,
)
from .stream import PrefillStream

__all__ = ["PrefillContextClient"]

_R = TypeVar("_R")


class PrefillContextClient:
    """Blocking client. Thread-safe for concurrent calls (one gRPC channel).

    Args:
        target: ``host:port`` (any gRPC target string).
        timeout: default deadline of each attempt, seconds; every method also takes
            ``timeout=``.
        max_message_bytes: send and receive limit set on the channel (default 512 MiB).
        retries: extra attempts after an UNAVAILABLE answer (0 disables retrying).
        backoff_base, backoff_max: the backoff before retry n is uniform in
            ``[0, min(backoff_max, backoff_base * 2**n)]`` seconds.
        credentials: ``grpc.ChannelCredentials`` for a secure channel; or ``tls=True``
            for TLS verified against the system roots, ``root_certificates`` (PEM bytes
            or a file path) to verify the server against this CA bundle instead, and
            ``client_certificate`` + ``client_key`` (PEM bytes or paths) for a server
            that requires client certificates (``--tls-client-ca``, mutual TLS). Any of
            these turns TLS on. ``tls_server_name``: the name the server certificate
            must carry when it differs from the target's host.
        token: sent as ``authorization: Bearer <token>`` metadata on every call (a
            server started with ``--auth-token-file`` / ``CTXPREFILL_AUTH_TOKEN``).
        metadata: extra ``(key, value)`` metadata sent on every call.
        expected_instance_id: start out expecting this instance (else the first answer
            sets it); ``track_instance=False`` turns the tracking off.
        channel_options: extra gRPC channel options.
        channel: use this channel instead of making one (the client does not close it).
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
        channel: grpc.Channel | None = None,
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
                grpc.secure_channel(target, creds, options=opts)
                if creds is not None
                else grpc.insecure_channel(target, options=opts)
            )
        self._channel = channel
        self._stub = pb_grpc.PrefillContextServiceStub(channel)
        use_outgoing_requests(self._stub, channel)

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> PrefillContextClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def instance_id(self) -> str | None:
        """The server instance this client expects (None until the first answer)."""
        return self._tracker.instance_id

    def reset_instance(self, instance_id: str | None = None) -> None:
        """Forget the remembered instance (e.g. after re-populating a restarted server's
        cache); the next answer's instance id becomes the expected one."""
        self._tracker.reset(instance_id)
        self._info = None

    def _call(self, method: str, rpc: Callable[..., _R], request: Any, timeout: float | None,
              expected: str | None) -> _R:
        deadline = self.timeout if timeout is None else float(timeout)
        attempt = 0
        while True:
            try:
                return rpc(request, timeout=deadline, metadata=with_trace_context(self._metadata))
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                if code in RETRYABLE_CODES and attempt < self.retries:
                    time.sleep(backoff_delay(attempt, self.backoff_base, self.backoff_max))
                    attempt += 1
                    continue
                raise map_rpc_error(method, err, expected) from err

    # ------------------------------------------------------------------ RPCs

    def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        """GetServerInfo. Raises ServerRestartedError if the instance changed."""
        resp = self._call("GetServerInfo", self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout, None)
        info = ServerInfo.from_proto(resp)
        self._tracker.observe("GetServerInfo", info.instance_id)
        self._info = info
        return info

    def write_cache(self, slot_mapping: Any, kv_c: Any, k_pe: Any, *, timeout: float | None = None,
                    layer: int | None = None) -> int:
        """WriteCache: token i's ``kv_c[i]`` (``[T, L]``) and ``k_pe[i]`` (``[T, R]``) go to slot
        ``slot_mapping[i]`` (-1 skips it). Float arrays travel as FP32 (the server rounds them
        per its cache dtype); ``uint16`` arrays or a BF16 ``RawTensor`` travel as bf16 bits.
        ``layer``: the model layer whose cache is written (needed when the server holds
        several: ``server_info().layers``). Returns the number of slots written."""
        expected = self._tracker.expected()
        req = build_write_request(slot_mapping, kv_c, k_pe, expected, layer)
        resp = self._call("WriteCache", self._stub.WriteCache, req, timeout, expected)
        self._tracker.observe("WriteCache", resp.instance_id)
        return int(resp.slots_written)

    def read_cache(self, slot_mapping: Any, *, timeout: float | None = None, layer: int | None = None) -> np.ndarray:
        """ReadCache: the raw bytes of the slots, ``uint8 [T, bytes_per_slot]`` (read-only), of
        model layer ``layer``'s cache (as in :meth:`write_cache`)."""
        expected = self._tracker.expected()
        req = build_read_request(slot_mapping, expected, layer)
        resp = self._call("ReadCache", self._stub.ReadCache, req, timeout, expected)
        self._tracker.observe("ReadCache", resp.instance_id)
        return parse_read_response(resp, len(req.slot_mapping.data) // 8)

    def prefill_context(
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
        """PrefillContext: attention of ``q`` ``[Tq, H, P+R]`` over the cached context.

        ``sequences``: :class:`Sequence` objects, ``(query_len, context_len, block_table)``
        tuples or dicts. ``q``: a float array (rounded to bf16, or to fp8 when the server's
        last known prefill dtype is fp8), ``uint16`` bf16 bits, ``uint8`` fp8 bits, or a
        ``RawTensor``; ``q_dtype`` forces the wire dtype. ``plan``: an explicit chunk plan
        (:class:`ContextChunk` objects or 4-tuples); None lets the server plan.

        Shared memory (``serve --shared-memory``; :mod:`ctxprefill_client.shared_memory`):
        ``q`` may be a :class:`SharedMemoryTensor` (from a registered region's ``write`` or
        ``input``); ``output_region`` / ``lse_region`` (a region's ``ref(...)``) make the
        server write the results there instead of sending them (see :class:`PrefillResult`).
        ``float_output=False`` skips the float32 copy of the output (``output`` is None; the
        bf16 bits are in ``output_bits``). ``layer``: the model layer whose cache and
        kv_b_proj the request uses (needed when the server holds several; the block tables
        are the same for every layer). ``cache_write``: ``(slot_mapping, kv_c, k_pe)`` as
        :meth:`write_cache` takes them, written into that layer's cache once the attention
        is computed (typically the new tokens' own latents: one call instead of two per
        layer; ``slots_written`` in the result).
        """
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
        resp = self._call("PrefillContext", self._stub.PrefillContext, req, timeout, expected)
        self._tracker.observe("PrefillContext", resp.instance_id)
        rows = int(req.q.shape[0]) if len(req.q.shape) else 0
        return parse_prefill_response(resp, rows, output_region, lse_region, float_output)

    def prefill_stream(self, *, timeout: float | None = None) -> PrefillStream:
        """A :class:`~ctxprefill_client.stream.PrefillStream`: PrefillContext requests one after
        another (or several in flight) over one open ``PrefillContextStream`` call, which
        costs less per request than a call each. ``timeout`` bounds the whole stream
        (default: the client's). Use it as a context manager."""
        return PrefillStream(self, timeout)

    def attach_request_ring(self, region: Any, *, num_slots: int = 4, slot_bytes: int = 1 << 16, offset: int = 0,
                            timeout: float | None = None, spin_s: float = 0.25,
                            stream_ordered: bool = False, device: Any = None) -> RequestRing:
        """A :class:`~ctxprefill_client.request_ring.RequestRing` in ``region`` (a registered
        :class:`SystemSharedMemoryRegion`; server ``--request-ring``): PrefillContext requests
        through shared-memory slots, taken by the server's engine thread without a gRPC
        call each. ``timeout``: the ring's whole life (default: none). ``stream_ordered``
        (torch, server ``--request-ring-stream-order``): requests ordered with the caller's
        CUDA stream by events on ``device`` (default: the current one), no host waiting for
        the device on either side. Use it as a context manager; leave the region registered
        while the ring is attached."""
        return RequestRing(self, region, num_slots=num_slots, slot_bytes=slot_bytes, offset=offset, timeout=timeout,
                           spin_s=spin_s, stream_ordered=stream_ordered, device=device)

    # ------------------------------------------------------------------ shared memory

    def register_system_shared_memory(
        self, region: Any, key: str | None = None, byte_size: int | None = None, *, offset: int = 0,
        timeout: float | None = None,
    ) -> SharedMemoryRegionStatus:
        """RegisterSystemSharedMemory: ``region`` is a :class:`SystemSharedMemoryRegion`, or
        a region name with the POSIX shm ``key`` and ``byte_size`` (``offset``: where the
        region starts in the object). Needs a server with ``--shared-memory system|all``."""
        req = register_system_request(region, key, byte_size, offset)
        resp = self._call("RegisterSystemSharedMemory", self._stub.RegisterSystemSharedMemory, req, timeout, None)
        return SharedMemoryRegionStatus.from_proto(resp.region)

    def register_cuda_shared_memory(
        self, region: Any, raw_handle: bytes | None = None, device_id: int | None = None,
        byte_size: int | None = None, *, offset: int = 0, timeout: float | None = None,
    ) -> SharedMemoryRegionStatus:
        """RegisterCudaSharedMemory: ``region`` is a :class:`CudaSharedMemoryRegion` (a torch
        CUDA tensor of this process), or a region name with the 64-byte ``raw_handle``, the
        server's ``device_id``, ``byte_size`` and ``offset`` in the allocation. Needs a server
        on the same host and GPU with ``--shared-memory cuda|all``."""
        req = register_cuda_request(region, raw_handle, device_id, byte_size, offset)
        resp = self._call("RegisterCudaSharedMemory", self._stub.RegisterCudaSharedMemory, req, timeout, None)
        return SharedMemoryRegionStatus.from_proto(resp.region)

    def unregister_shared_memory(self, name: str = "", *, timeout: float | None = None) -> list[str]:
        """UnregisterSharedMemory of region ``name`` ("": all); returns the names unregistered."""
        req = pb.UnregisterSharedMemoryRequest(name=name)
        resp = self._call("UnregisterSharedMemory", self._stub.UnregisterSharedMemory, req, timeout, None)
        return list(resp.names)

    def shared_memory_status(self, name: str = "", *, timeout: float | None = None) -> list[SharedMemoryRegionStatus]:
        """GetSharedMemoryStatus of region ``name`` ("": all)."""
        req = pb.GetSharedMemoryStatusRequest(name=name)
        resp = self._call("GetSharedMemoryStatus", self._stub.GetSharedMemoryStatus, req, timeout, None)
        return [SharedMemoryRegionStatus.from_proto(r) for r in resp.regions]

