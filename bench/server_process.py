"""A ``python -m ctxprefill.cli serve`` subprocess on free local ports, for the
benchmarks that drive a real server (bench_concurrency, bench_sharded, bench_transport).

Output goes to ``<logdir>/<name>.log``; readiness is the HTTP ``/readyz`` probe (the
engine built and warmed up); ``stop`` drains with SIGTERM, then kills.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [os.path.join(ROOT, "server"), os.path.join(ROOT, "client")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("TRITON_INTERPRET", None)  # compiled kernels on a GPU (the CPU test suite sets it)
    return env


class ServerProcess:
    """One server. ``flags``: ``{"heads": 16, "shared_memory": "all", "request_ring": True,
    "shared_memory_pin": False, ...}`` -> ``--heads 16 ... --request-ring --no-shared-memory-pin``."""

    def __init__(self, name: str, flags: dict[str, object], logdir: str):
        self.name = name
        self.port, self.metrics_port = free_port(), free_port()
        self.args = [sys.executable, "-m", "ctxprefill.cli", "serve", "--host", "127.0.0.1", "--port",
                     str(self.port), "--metrics-port", str(self.metrics_port)]
        for k, v in flags.items():
            flag = "--" + k.replace("_", "-")
            no = "--no-" + k.replace("_", "-")  # every boolean flag of serve has its --no- form
            self.args += ([flag] if v else [no]) if isinstance(v, bool) else [flag, str(v)]
        self.cmd = " ".join(self.args[1:])
        self.log_path = os.path.join(logdir, f"{name}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, env=server_env(), cwd=ROOT, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def ready(self) -> bool:
        """Whether /readyz answers 200 now; raises if the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=1.0) as r:
                return r.status == 200
        except OSError:
            return False

    def counter(self, name: str, label: str) -> dict[str, float]:
        """Counter ``name``'s samples on the server's /metrics page now, by ``label``'s value."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5.0) as r:
            page = r.read().decode()
        return {s.labels[label]: s.value for fam in text_string_to_metric_families(page)
                for s in fam.samples if s.name == name}

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ready (TimeoutError with the log's tail past ``timeout``)."""
        t = time.monotonic()
        wait_all_ready([self], timeout)
        return time.monotonic() - t

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (drain), SIGKILL after ``timeout`` s; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


def wait_all_ready(servers: list[ServerProcess], timeout: float) -> None:
    t_end = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        pending = [s for s in pending if not s.ready()]
        if not pending:
            return
        if time.monotonic() > t_end:
            tails = "\n".join(f"--- {s.name}\n{s.tail()}" for s in pending)
            raise TimeoutError(f"not ready after {timeout:.0f} s: {[s.name for s in pending]}\n{tails}")
        time.sleep(0.2)
