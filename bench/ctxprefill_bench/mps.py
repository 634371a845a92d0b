"""A CUDA MPS control daemon of a benchmark's own, for processes that share one GPU.

Without MPS the GPU time-slices between processes' contexts; under one MPS daemon their
work runs in one shared context. The daemon gets its own pipe and log directories (a
temporary directory), so it serves only the processes given its environment, and it is
stopped through its own pipe (``quit``): nothing else on the machine is touched.

  with mps_daemon() as env:   # env: the variables a client process needs
      subprocess.run(cmd, env={**os.environ, **env})

The process that starts the daemon stays out of it: ``quit`` waits for every client to
exit, so a process quitting its own daemon would wait on itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

CONTROL = "nvidia-cuda-mps-control"


def available() -> bool:
    """Whether the MPS control binary is on the PATH."""
    return shutil.which(CONTROL) is not None


@contextlib.contextmanager
def mps_daemon(start_timeout_s: float = 10.0, quit_timeout_s: float = 30.0) -> Iterator[dict[str, str]]:
    """Start a private MPS daemon and yield the pipe and log directories its clients need in
    their environment; on exit ask it to quit. This process's environment is left as it is."""
    if not available():
        raise RuntimeError(f"{CONTROL} is not on the PATH: CUDA MPS is not installed here")
    with tempfile.TemporaryDirectory(prefix="ctxprefill-mps-", ignore_cleanup_errors=True) as root:
        env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"),
               "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
        for d in env.values():
            os.makedirs(d)
        full = {**os.environ, **env}
        subprocess.run([CONTROL, "-d"], env=full, check=True, timeout=start_timeout_s)  # forks the daemon
        try:
            control = os.path.join(env["CUDA_MPS_PIPE_DIRECTORY"], "control")
            deadline = time.monotonic() + start_timeout_s
            while not os.path.exists(control):  # the daemon's control pipe: it is listening
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the MPS daemon made no control pipe in {start_timeout_s} s")
                time.sleep(0.05)
            yield env
        finally:
            try:
                subprocess.run([CONTROL], input=b"quit\n", env=full, timeout=quit_timeout_s, check=False)
            except subprocess.TimeoutExpired:
                print(f"mps: the daemon in {root} did not quit within {quit_timeout_s} s: a client of it "
                      "is still running", file=sys.stderr)
