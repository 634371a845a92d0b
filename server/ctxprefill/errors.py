"""Errors that carry the request field they are about.

The engine and the cache raise these; the service layer maps each class to one gRPC
status code (see service/interceptors.py). Nothing below the service imports grpc.
"""

from __future__ import annotations


class CtxPrefillError(Exception):
    """Base class: ``field`` names the input at fault ("" when none)."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class InvalidArgument(CtxPrefillError):
    """Malformed input: shape, dtype, lengths or sums that disagree."""


class OutOfRange(CtxPrefillError):
    """An index (slot, block id) outside what the cache holds."""


class FailedPrecondition(CtxPrefillError):
    """The request is well formed but the server is not in the state it assumes."""


class NotFound(CtxPrefillError):
    """A named entity (a shared-memory region, a shared-memory object) does not exist."""


class AlreadyExists(CtxPrefillError):
    """A name to register is already in use."""


class ResourceExhausted(CtxPrefillError):
    """A configured limit (e.g. shared-memory regions or bytes) would be exceeded."""


class Stopped(CtxPrefillError):
    """A request's work stopped between two chunks (``reason``: deadline, cancelled):
    ``chunks_done`` of ``chunks_planned`` were queued on the device; nothing was written."""

    reason = ""

    def __init__(self, message: str, chunks_done: int, chunks_planned: int):
        super().__init__("", message)
        self.chunks_done, self.chunks_planned = chunks_done, chunks_planned


class DeadlineExceeded(Stopped):
    """The request's deadline passed while it ran."""

    reason = "deadline"


class Cancelled(Stopped):
    """The caller went away (cancelled its call, let go of its ring) while the request ran."""

    reason = "cancelled"


class Unimplemented(CtxPrefillError):
    """A feature this server was not started with (e.g. --shared-memory off)."""


class PermissionDenied(CtxPrefillError):
    """The caller may not do this from where it is (e.g. shared memory from another host)."""


class ConfigError(ValueError):
    """A server configuration that must refuse to start."""
