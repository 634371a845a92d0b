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


class Unimplemented(CtxPrefillError):
    """A feature this server was not started with (e.g. --shared-memory off)."""


class ConfigError(ValueError):
    """A server configuration that must refuse to start."""
