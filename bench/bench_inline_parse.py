"""The server's per-request work on an inline PrefillContext before the engine, side by
side: protobuf's parse plus the checks (``FromString``, then ``codec.decode_prefill`` and ``validate_prefill`` reading
``q.data``: two copies of q) against ``service/inline_views.parse`` (q a view of the
received bytes). This runs on the server's event loop, one request at a time, so it bounds
how many inline requests per second the server can take in; the CPU time is the host's,
not the GPU's.

    python bench/bench_inline_parse.py [--tokens 1024 4096] [--heads 16] [--iters 30] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "server"), os.path.join(ROOT, "client"), os.path.join(ROOT, "bench")]

import numpy as np  # noqa: E402

from ctxprefill.config import CacheConfig, EngineConfig, ModelShape  # noqa: E402
from ctxprefill.engine.request import validate_prefill  # noqa: E402
from ctxprefill.service import codec, inline_views  # noqa: E402
from ctxprefill_api import pb  # noqa: E402
from ctxprefill_api.wire import serialize_request  # noqa: E402
from ctxprefill_bench import run_info  # noqa: E402
from ctxprefill_client._common import build_prefill_request  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    bs = 64
    cfg = EngineConfig(shape=ModelShape(heads=ns.heads),
                       cache=CacheConfig(block_size=bs, num_blocks=ns.context // bs + 1),
                       workspace_tokens=16384)
    rows = []
    for T in ns.tokens:
        bits = np.random.default_rng(T).integers(0, 1 << 16, size=(T, ns.heads, 192), dtype=np.uint16)
        table = list(range(ns.context // bs))
        raw = serialize_request(build_prefill_request(bits, [(T, ns.context, table)], request_id=None,
                                                      workspace_tokens=None, plan=None, expected=None,
                                                      q_dtype=pb.DATA_TYPE_BF16, server_prefill_dtype=None))
        ways = {"protobuf": lambda: pb.PrefillContextRequest.FromString(raw),
                "views": lambda: inline_views.parse(pb.PrefillContextRequest, raw)}
        times = {k: [] for k in ways}
        for _i in range(ns.iters + 2):  # alternating, the first two of each dropped (warm-up)
            for name, parse in ways.items():
                t = time.perf_counter()
                args = validate_prefill(codec.decode_prefill(parse()).request, cfg, "")
                times[name].append(time.perf_counter() - t)
                assert args.q.shape == (T, ns.heads, 192)
                del args
        med = {k: statistics.median(v[2:]) * 1e3 for k, v in times.items()}
        row = {"tokens": T, "heads": ns.heads, "q_bytes": bits.nbytes, "protobuf_ms": med["protobuf"],
               "views_ms": med["views"]}
        rows.append(row)
        print(f"q {T} x {ns.heads} x 192 bf16 ({bits.nbytes / 1e6:.1f} MB): parse + validate "
              f"{med['protobuf']:.3f} ms with protobuf's copies, {med['views']:.3f} ms with views "
              f"({med['protobuf'] / med['views']:.1f}x)", flush=True)
    if ns.out:
        meta = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                "python": platform.python_version(), "commit": run_info.commit(), "args": vars(ns),
                "date": run_info.utc_now(), "gpu": run_info.gpu_name()}
        with open(ns.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
