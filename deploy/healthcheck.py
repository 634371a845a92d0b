"""Container health check: ask the server's HTTP port; exit 0 if the answer is 200.

    python deploy/healthcheck.py [ready|live]

``ready`` (the default) asks ``/readyz`` (the engine is built and warm, the server is not
draining); ``live`` asks ``/healthz`` (the process serves). The HTTP port carries no
credentials, so the check works whatever the gRPC port requires (a token, TLS, mutual
TLS). The URL is ``$CTXPREFILL_HEALTH_URL``, else ``http://127.0.0.1:$CTXPREFILL_METRICS_PORT``
(default port 9400), so that it follows the same environment variable as ``ctxprefill
serve``. Exit codes: 0 for 200, 1 for anything else (503, no answer within
``$CTXPREFILL_HEALTH_TIMEOUT`` s, default 3). Used by the image's HEALTHCHECK;
Kubernetes uses its native HTTP probes on the same paths.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

PATHS = {"ready": "/readyz", "live": "/healthz"}


def check(url: str, timeout: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200, f"{r.status} {r.read(200).decode(errors='replace').strip()}"
    except urllib.error.HTTPError as e:
        return False, f"{e.code} {e.read(200).decode(errors='replace').strip()}"
    except (OSError, ValueError) as e:
        return False, f"no answer: {e}"


def main(argv: list[str]) -> int:
    which = argv[1] if len(argv) > 1 else "ready"
    if which not in PATHS:
        print(f"usage: healthcheck.py [{'|'.join(PATHS)}]", file=sys.stderr)
        return 2
    port = os.environ.get("CTXPREFILL_METRICS_PORT", "9400")
    base = os.environ.get("CTXPREFILL_HEALTH_URL") or f"http://127.0.0.1:{port}"
    timeout = float(os.environ.get("CTXPREFILL_HEALTH_TIMEOUT", "3"))
    url = base.rstrip("/") + PATHS[which]
    ok, what = check(url, timeout)
    print(f"{url}: {what}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
