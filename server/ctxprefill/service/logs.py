"""The service's log lines: JSON objects, one a line, each carrying the request id of the
call being handled (set by the servicer in ``request_id_var``)."""

from __future__ import annotations

import contextvars
import datetime
import json
import logging

#: the request id of the RPC being handled (set by the servicer; read by the formatter)
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("ctxprefill_request_id", default="")
#: request ids are logged; longer ones are cut in logs
MAX_LOGGED_REQUEST_ID = 128

lifecycle = logging.getLogger("ctxprefill.lifecycle")

_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


def request_id_for_logs(request_id: str) -> str:
    return request_id if len(request_id) <= MAX_LOGGED_REQUEST_ID else request_id[:MAX_LOGGED_REQUEST_ID] + "…"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id (when set), the
    record's ``extra`` fields, and ``exc`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", "") or request_id_var.get()
        if rid:
            d["request_id"] = rid
        for k, v in record.__dict__.items():
            if k not in _STD_ATTRS and k not in d and not k.startswith("_"):
                d[k] = v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d, ensure_ascii=False)


def setup_logging() -> None:
    """JSON lines on the root handlers (installs one on stderr if there is none); the
    lifecycle lines are always shown, the rest follows the root level."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING)
    for h in root.handlers:
        h.setFormatter(JsonFormatter())
    if lifecycle.getEffectiveLevel() > logging.INFO:
        lifecycle.setLevel(logging.INFO)
