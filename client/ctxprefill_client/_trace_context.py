"""The caller's trace context on every call: when ``opentelemetry-api`` is importable and
a span is current, its W3C ``traceparent`` (and ``tracestate``, baggage: the globally
configured propagators) goes into the call's metadata, so that the server's spans join
the caller's trace. Without the package, or outside a span, the metadata is as given."""

from __future__ import annotations

try:
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace

    _AVAILABLE = True
except ImportError:  # the client works without OpenTelemetry: calls carry no trace context
    _AVAILABLE = False

Metadata = tuple[tuple[str, str], ...]


def with_trace_context(metadata: Metadata) -> Metadata:
    """``metadata`` plus the current trace context's headers (none outside a span)."""
    if not _AVAILABLE or not _trace.get_current_span().get_span_context().is_valid:
        return metadata
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    return metadata + tuple(carrier.items()) if carrier else metadata
