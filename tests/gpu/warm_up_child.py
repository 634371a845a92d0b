"""Run by test_warm_up_gpu.py in a fresh process (no kernel compiled yet in it): build and
warm an engine as ``ctxprefill serve`` does, then serve requests of many shapes and
print, as JSON, every Triton/Gluon kernel compiled after the warm-up.

    python tests/gpu/warm_up_child.py '{"prefill_dtype": "bf16", "cuda_graphs": true, ...}'

A compile on a request's path costs that request seconds; a warm-up that covers every
variant leaves ``compiled_by_requests`` empty. ``compiled_by_probe`` checks the hook itself:
a kernel first launched after the requests must show up there."""

from __future__ import annotations

import json
import math
import sys

import torch
import triton
import triton.language as tl

from ctxprefill.app import build_and_warm
from ctxprefill.engine.engine import SequenceSpec
from ctxprefill.settings import ServeSettings
from ctxprefill_client import slot_mapping

#: (context lengths, query lengths) per request: ragged with continuation chunks and empty
#: sequences; one long sequence in several chunks; query rows whose tiles pass two
#: programs per SM (the grid-size variants); many short sequences; a single row
REQUESTS = [
    ([3000, 0, 1500, 64, 700, 1, 0, 2100], [17, 5, 9, 3, 12, 1, 4, 30]),
    ([16384], [256]),
    ([5000], [3000]),
    ([2000, 3000], [2500, 1200]),
    ([100] * 40, [8] * 40),
    ([1], [1]),
]


@triton.jit
def _probe_kernel(x_ptr):
    tl.store(x_ptr, 1.0)


def main() -> None:
    settings = ServeSettings(**dict(dict(device="cuda", heads=16, num_blocks=1024, workspace_tokens=4096),
                                    **json.loads(sys.argv[1])))
    engine, warm_s = build_and_warm(settings)
    compiled: list[str] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        # the variant's constexprs and specializations (divisibility, equal to 1): what differs
        compiled.append(f"{fn.name}: constants {compile.get('constants')!s:.1500} "
                        f"attrs {compile.get('configs')!s:.800}")
        return None  # compile as usual

    triton.knobs.runtime.jit_cache_hook = hook
    bs = engine.config.cache.block_size
    g = torch.Generator().manual_seed(0)
    runs = 3 if settings.cuda_graphs else 1  # eager, eager + capture, replay
    for contexts, queries in REQUESTS:
        perm = torch.randperm(engine.config.cache.num_blocks, generator=g).tolist()
        seqs, at = [], 0
        for n, qn in zip(contexts, queries):
            blocks = perm[at : at + math.ceil(n / bs)]
            at += len(blocks)
            if n:
                engine.write_cache(torch.from_numpy(slot_mapping(blocks, 0, n, bs)),
                                   torch.randn((n, 512), generator=g), torch.randn((n, 64), generator=g))
            seqs.append(SequenceSpec(qn, n, blocks))
        q = torch.randn((sum(queries), settings.heads, 192), generator=g)
        q = q.to(torch.float8_e4m3fn) if settings.prefill_dtype == "fp8" else q.to(torch.bfloat16)
        for _ in range(runs):
            engine.prefill_context(q.to(engine.device), seqs)
    by_requests = list(compiled)
    if engine.device.type == "cuda":
        _probe_kernel[(1,)](torch.zeros(1, device=engine.device))
    graphs = engine.graphs
    print(json.dumps({"compiled_by_requests": by_requests, "compiled_by_probe": compiled[len(by_requests):],
                      "warm_s": warm_s, "backend": engine.backend.name,
                      "captures": graphs.captures if graphs is not None else 0,
                      "replays": graphs.replays if graphs is not None else 0}))


if __name__ == "__main__":
    main()
