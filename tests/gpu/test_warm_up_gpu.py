"""The service's warm-up compiles every kernel variant its requests take: a fresh process
built and warmed as ``ctxprefill serve`` does (``app.build_and_warm``), then serving
ragged, long, wide-grid, many-sequence and one-row requests (each eager, captured and
replayed: a shape's first request runs eagerly), compiles no Triton or Gluon kernel — a compile on a
request's path would cost that request seconds (tests/gpu/warm_up_child.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# tests/: service_process
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from service_process import env_with_sources  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device: the warm-up test runs on the GPU machine")]

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_up_child.py")
CASES = {
    "bf16-graphs": dict(prefill_dtype="bf16", cuda_graphs=True),
    "fp8-graphs": dict(prefill_dtype="fp8", cache_dtype="fp8", cuda_graphs=True),
    "bf16-paged-graphs": dict(prefill_dtype="bf16", cuda_graphs=True, kv_b_proj_gemm="paged"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_requests_after_the_warm_up_compile_nothing(case, cuda_ext):
    p = subprocess.run([sys.executable, CHILD, json.dumps(CASES[case])], capture_output=True, text=True,
                       env=env_with_sources(), timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    print(case, {k: v for k, v in got.items() if not k.startswith("compiled")})
    # the hook sees a compile: the kernel first launched after the requests
    assert len(got["compiled_by_probe"]) == 1 and "_probe_kernel" in got["compiled_by_probe"][0]
    assert got["captures"] > 0 and got["replays"] > 0
    assert got["compiled_by_requests"] == [], "\n".join(got["compiled_by_requests"])
