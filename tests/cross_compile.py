"""Cross-compiling a Triton or Gluon kernel for the H200 (sm_90) on a machine without a
GPU, with the Triton wheel's own ptxas and cuobjdump: a script run in a subprocess (the
interpreter off) prints one JSON list of per-kernel facts (registers, spills, shared
memory, instruction counts) for the tests to check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cross_compile(script: str, jobs: list) -> list[dict]:
    """Run a cross-compile script on ``jobs`` (its ``sys.argv[1]``, as JSON); its last
    stdout line is a JSON list of per-kernel facts."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    pkg_root = os.path.join(ROOT, "server")  # holds ctxprefill/
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    r = subprocess.run([sys.executable, "-c", script, json.dumps(jobs)], capture_output=True, text=True,
                       env=env, timeout=300)
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr):
        pytest.skip(f"no ptxas for a cross-compile: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


#: the scripts' shared helpers: cuobjdump on a compiled kernel, its (registers, stack bytes)
RESOURCES = r'''
import os, re, subprocess, tempfile
import triton


def cuobjdump(k, flag):
    """Triton's cuobjdump (-res-usage, -sass) on a compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    try:
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)


def resources(k):
    """(registers, stack bytes) per thread of a compiled kernel."""
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", cuobjdump(k, "-res-usage"))
    return int(m[1]), int(m[2])
'''
