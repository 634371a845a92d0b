"""Helpers of the service tests: a `ctxprefill serve` child process on free ports,
HTTP scraping with timeouts, parsing of the Prometheus text page, and a bounded wait."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the marks of a module of POSIX shared-memory tests (Linux's /dev/shm; tensors read from
#: a region's bytes, which numpy and torch see as read-only)
SHARED_MEMORY_MARKS = [
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm: POSIX shared memory is Linux-only here"),
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
]


_GIVEN: set[int] = set()  # ports free_port has handed out in this process


def free_port() -> int:
    """A local port the OS calls free and that this process has not handed out before (the
    OS may offer a port again once its probing socket is closed, before a server binds it)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def env_with_sources() -> dict[str, str]:
    env = dict(os.environ)
    paths = [os.path.join(ROOT, "server"), os.path.join(ROOT, "client")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def wait_for(cond, timeout: float = 30.0, what: str = "condition", poll: float = 0.02) -> None:
    """Poll ``cond()`` until it is true; fail the test naming ``what`` after ``timeout`` s."""
    t_end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t_end, f"{what}: not met within {timeout} s"
        time.sleep(poll)


class ServerProcess:
    """``python -m ctxprefill.cli serve`` with the given flags on free local ports. As a
    context manager: ready on entry; stopped on exit (SIGTERM, then SIGKILL)."""

    def __init__(self, flags: dict[str, object], grace_seconds: float = 10.0, port: int | None = None,
                 metrics_port: int | None = None, env: dict[str, str] | None = None):
        # ports picked here can be taken by another process before the server binds them
        # (free_port releases its socket): wait_ready then starts again on new ones
        self._auto_ports = port is None and metrics_port is None
        self.port = port if port is not None else free_port()
        self.metrics_port = metrics_port if metrics_port is not None else free_port()
        self.grace_seconds = grace_seconds
        self._flags, self._env = flags, env
        self._start()

    def _start(self) -> None:
        args = [sys.executable, "-m", "ctxprefill.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--device", "cpu", "--grace-seconds",
                str(self.grace_seconds)]
        for k, v in self._flags.items():
            flag = "--" + k.replace("_", "-")
            args += ([flag] if v else []) if isinstance(v, bool) else [flag, str(v)]  # --x / nothing
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(args, env={**env_with_sources(), **(self._env or {})}, cwd=ROOT,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def scrape(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """The server's /metrics page, parsed (``parse_metrics``)."""
        status, page = http_get(self.metrics_url + "/metrics")
        assert status == 200, page[-2000:]
        return parse_metrics(page)

    def wait_ready(self, timeout: float = 90.0) -> None:
        t_end = time.monotonic() + timeout
        restarts = 0
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                if self._auto_ports and restarts < 3 and "cannot bind" in self.log():
                    restarts += 1
                    self.port, self.metrics_port = free_port(), free_port()
                    self._log.close()  # the exited attempt's log
                    self._start()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if http_get(self.metrics_url + "/readyz", timeout=1.0)[0] == 200:
                    return
            except (OSError, http.client.HTTPException):
                # not listening yet, or another process's port (a gRPC server answers HTTP/2):
                # this server then fails to bind and starts again above
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def terminate(self, timeout: float) -> int | None:
        """SIGTERM, then wait up to ``timeout``; the exit code, or None if still running."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        self._log.close()

    def __enter__(self) -> ServerProcess:
        try:
            self.wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate(self.grace_seconds + 10)
        self.kill()


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)] of a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name].append((dict(s.labels), s.value))
    return out


def sample_sum(samples, **match) -> float:
    return sum(v for labels, v in samples if all(labels.get(k) == want for k, want in match.items()))
