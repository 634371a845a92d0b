"""What the transport adds to a request's checks (CONTRACT §7, §8; docs/TRANSPORT.md):
the answer must fit a gRPC message and the server's answer limits, and results asked
into shared memory must have room there. Everything about the request itself is the
engine's to check (``engine/request.py``), once.

- ``InvalidArgument`` naming the field: a response over the message size limit (``q``,
  ``slot_mapping``), ``output_region`` / ``lse_region`` set with shared memory off, a
  placement too small or overlapping the other;
- RESOURCE_EXHAUSTED naming the field and the flag, before anything is allocated: a
  response over ``--max-answer-bytes``, or more than ``--max-inflight-bytes`` has free
  (``interceptors.answer_room``);
- ``NotFound`` / ``OutOfRange`` naming ``<field>.region`` / ``<field>``: a placement
  in no registered region, or outside it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import EngineConfig
from ..engine.request import PrefillRequest, ReadRequest
from ..errors import InvalidArgument
from .interceptors import answer_room
from .shared_memory import Lease, off_message

#: room left in a response for everything that is not tensor data (stats, ids, framing)
RESPONSE_OVERHEAD_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a result goes in shared memory: ``view`` is its bytes (uint8) in ``region``."""

    region: str
    kind: str
    offset: int
    view: torch.Tensor


def check_response_size(field: str, nbytes: int, max_message_bytes: int) -> None:
    if nbytes + RESPONSE_OVERHEAD_BYTES > max_message_bytes:
        raise InvalidArgument(
            field,
            f"the response would carry {nbytes} bytes of tensor data, over the server's message size limit "
            f"({max_message_bytes} bytes); split the request",
        )
    answer_room(field, nbytes)


def check_read(request: ReadRequest, config: EngineConfig, max_message_bytes: int) -> None:
    check_response_size("slot_mapping", request.slot_mapping.numel() * config.cache.bytes_per_slot, max_message_bytes)


def prefill_placements(msg: Any, request: PrefillRequest, config: EngineConfig, shm: Lease | None,
                       max_message_bytes: int) -> tuple[Placement | None, Placement | None]:
    """The request's ``output_region`` / ``lse_region`` (``msg``'s), checked and held by
    ``shm``, or None each (inline); what goes inline must fit a message."""
    H, V = config.shape.heads, config.shape.v_head_dim
    Tq = request.q.shape[0] if request.q.dim() else 0
    out_bytes, lse_bytes = Tq * H * V * 2, H * Tq * 4
    got: list[Placement | None] = []
    for field, nbytes, itemsize in (("output_region", out_bytes, 2), ("lse_region", lse_bytes, 4)):
        if not msg.HasField(field):
            got.append(None)
            continue
        if shm is None:
            raise InvalidArgument(field, off_message() + "; leave it unset to get the result inline")
        ref = getattr(msg, field)
        region, view = shm.resolve(ref, field, nbytes, itemsize, exact=False)
        got.append(Placement(region.name, region.kind, int(ref.offset), view))
    out_to, lse_to = got
    if out_to is not None and lse_to is not None and out_to.region == lse_to.region and out_bytes and lse_bytes:
        a, b = out_to.offset, lse_to.offset
        if a < b + lse_bytes and b < a + out_bytes:
            raise InvalidArgument("lse_region", f"bytes [{b}, {b + lse_bytes}) of region {lse_to.region!r} overlap the "
                                                f"output's [{a}, {a + out_bytes})")
    check_response_size("q", (0 if out_to else out_bytes) + (0 if lse_to else lse_bytes), max_message_bytes)
    return out_to, lse_to

