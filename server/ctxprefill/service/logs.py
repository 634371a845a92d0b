"""The service's log lines: JSON objects, one a line (python-json-logger), each carrying the
request id of the call being handled (set by the servicer in ``request_id_var``) and, while
tracing is on, the trace and span ids of the RPC's span (``tracing.py``).

Every command logs so (``ctxprefill.cli``): ``--log-level`` on any subcommand, or
``CTXPREFILL_LOG_LEVEL``; WARNING by default, with the lifecycle lines (listening, serving,
draining, stopped, the model's loading) always shown.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from typing import Any

from pythonjsonlogger.json import JsonFormatter as _JsonFormatter

from . import tracing

#: the request id of the RPC being handled (set by the servicer; read by the formatter)
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("ctxprefill_request_id", default="")
#: request ids are logged; longer ones are cut in logs
MAX_LOGGED_REQUEST_ID = 128
#: the levels ``--log-level`` takes (any case)
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_LEVEL = "WARNING"
LEVEL_ENV = "CTXPREFILL_LOG_LEVEL"

lifecycle = logging.getLogger("ctxprefill.lifecycle")

#: a record's attribute -> its key in the line (the first four come first)
_FIELDS = {"levelname": "level", "name": "logger", "message": "msg", "exc_info": "exc"}


def request_id_for_logs(request_id: str) -> str:
    return request_id if len(request_id) <= MAX_LOGGED_REQUEST_ID else request_id[:MAX_LOGGED_REQUEST_ID] + "…"


class JsonFormatter(_JsonFormatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, msg, request_id (when
    set), trace_id / span_id (while a traced RPC is handled), the record's ``extra`` fields
    (what JSON cannot hold as it is, as python-json-logger's encoder writes it: ``str`` at
    worst), and ``exc`` (the traceback) when there is one."""

    def __init__(self) -> None:
        super().__init__(["levelname", "name", "message"], rename_fields=_FIELDS, timestamp="ts",
                         json_ensure_ascii=False)

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        super().add_fields(log_data, record, message_dict)
        rid = getattr(record, "request_id", "") or request_id_var.get()
        if rid:
            log_data["request_id"] = rid
        ids = tracing.current_ids()
        if ids is not None:
            log_data.setdefault("trace_id", ids[0])
            log_data.setdefault("span_id", ids[1])

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        ts = log_data.pop("ts")
        return {"ts": ts.isoformat(timespec="milliseconds"), **log_data}


def parse_level(value: str, where: str = "--log-level") -> str:
    """``value`` as one of :data:`LEVELS`; ValueError naming ``where`` otherwise."""
    level = value.strip().upper()
    if level not in LEVELS:
        raise ValueError(f"{where} {value!r}: one of {', '.join(LEVELS)} (any case)")
    return level


def setup_logging(level: str | None = None) -> None:
    """JSON lines on the root handlers (installs one on stderr if there is none), at
    ``level`` when given; the lifecycle lines are always shown, the rest follows the
    root level."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
        if level is None:
            root.setLevel(DEFAULT_LEVEL)
    if level is not None:
        root.setLevel(parse_level(level))
    for h in root.handlers:
        h.setFormatter(JsonFormatter())
    if lifecycle.getEffectiveLevel() > logging.INFO:
        lifecycle.setLevel(logging.INFO)
