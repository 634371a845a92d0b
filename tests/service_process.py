"""Helpers of the service tests: a `ctxprefill serve` child process on free ports,
HTTP scraping with timeouts, and parsing of the Prometheus text page."""

from __future__ import annotations

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class ServerProcess:
    """``python -m ctxprefill.cli serve`` with the given flags on free local ports."""

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

    def wait_ready(self, timeout: float = 90.0) -> None:
        t_end = time.monotonic() + timeout
        restarts = 0
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                if self._auto_ports and restarts < 3 and "cannot bind" in self.log():
                    restarts += 1
                    self.port, self.metrics_port = free_port(), free_port()
                    self._start()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if http_get(self.metrics_url + "/readyz", timeout=1.0)[0] == 200:
                    return
            except OSError:
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
