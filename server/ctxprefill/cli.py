"""ctxprefill: MLA context-attention prefill over a paged latent KV cache, served over gRPC.

Every command logs JSON lines on stderr at --log-level (before or after the subcommand)
or CTXPREFILL_LOG_LEVEL, WARNING by default.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .errors import ConfigError


def _make_weights(ns) -> int:
    from .config import ModelShape
    from .weights import random_kv_b_proj, save_weights

    t = random_kv_b_proj(ModelShape(heads=ns.heads), ns.dtype, ns.seed, ns.scale_kind)
    save_weights(ns.out, t, ns.prefix)
    keys = ", ".join(f"{ns.prefix}{k} {list(v.shape)} {v.dtype}" for k, v in t.items())
    print(f"wrote {ns.out}: {keys}")
    return 0


def _make_model(ns) -> int:
    from .checkpoint_writer import TinyModel, write_model

    m = TinyModel(layers=ns.layers, heads=ns.heads, dtype=ns.dtype, shards=ns.shards, seed=ns.seed, yarn=ns.yarn)
    index = write_model(ns.dir, m)
    print(f"wrote {ns.dir}: DeepSeek-V3 architecture, {m.layers} layers x {m.heads} heads, {m.dtype}"
          f"{', yarn' if m.yarn else ''}, {len(index['weight_map'])} tensors in {m.shards} shard(s), "
          f"{index['metadata']['total_size']} bytes")
    return 0


def _log_level(argv: list[str]) -> tuple[str, list[str]]:
    """(the level ``--log-level`` gives anywhere in ``argv``, else ``CTXPREFILL_LOG_LEVEL``,
    else WARNING; ``argv`` without it). Exits 2 naming the flag or the variable when the
    level is not one."""
    from .service.logs import DEFAULT_LEVEL, LEVEL_ENV, parse_level

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--log-level")
    ns, rest = pre.parse_known_args(argv)
    value, where = (ns.log_level, "--log-level") if ns.log_level is not None else \
        (os.environ.get(LEVEL_ENV, DEFAULT_LEVEL), LEVEL_ENV)
    try:
        return parse_level(value, where), rest
    except ValueError as e:
        print(f"ctxprefill: configuration error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    from .service.logs import DEFAULT_LEVEL, LEVEL_ENV, LEVELS, setup_logging
    from .settings import add_arguments, from_args

    argv = sys.argv[1:] if argv is None else argv
    level, rest = _log_level(argv)
    setup_logging(level)
    if rest[:1] == ["bench"]:  # its own parser: a grid of shapes, not server settings
        from ctxprefill_bench.engine_bench import main as bench_main

        return bench_main(rest[1:])
    # --log-level is read above, wherever it stands; each parser lists it for --help
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, metavar="LEVEL",
                        help=f"{', '.join(LEVELS)}, any case (default: {DEFAULT_LEVEL}: quiet but for the lifecycle "
                             f"lines) [{LEVEL_ENV}]")
    p = argparse.ArgumentParser(prog="ctxprefill", description=__doc__, parents=[common],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", parents=[common], help="start the gRPC server and the metrics/health HTTP server")
    add_arguments(serve)

    demo = sub.add_parser("demo", parents=[common],
                          help="run one request in-process (or against --target) and check it against float64")
    add_arguments(demo)
    demo.add_argument("--target", default=None, help="host:port of a running server to drive instead")
    demo.set_defaults(num_blocks=256)

    sub.add_parser("bench", parents=[common],
                   help="fused vs generic path over a grid of shapes, in-process (see bench --help)")

    mw = sub.add_parser("make-weights", parents=[common],
                        help="write random kv_b_proj weights in the checkpoint layout")
    mw.add_argument("--out", required=True, help="safetensors file to write")
    mw.add_argument("--heads", type=int, default=16)
    mw.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    mw.add_argument("--scale-kind", choices=("block", "tensor"), default="block",
                    help="fp8: 128x128 weight_scale_inv (block) or a scalar weight_scale (tensor)")
    mw.add_argument("--prefix", default="", help="key prefix, e.g. model.layers.0.self_attn.")
    mw.add_argument("--seed", type=int, default=0)

    mm = sub.add_parser("make-model", parents=[common],
                        help="write a small random DeepSeek-V3 checkpoint directory (serve --model DIR)")
    mm.add_argument("dir", help="directory to write (created; must be empty if it exists)")
    mm.add_argument("--layers", type=int, default=4)
    mm.add_argument("--heads", type=int, default=16)
    mm.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: linear weights in e4m3 with 128x128 weight_scale_inv, as DeepSeek-V3's release")
    mm.add_argument("--shards", type=int, default=2, help="safetensors files the tensors are split into")
    mm.add_argument("--seed", type=int, default=0, help="layer i's kv_b_proj is the random weight of seed + i")
    mm.add_argument("--yarn", action="store_true", help="DeepSeek-V3's rope_scaling (YaRN, factor 40)")

    ns = p.parse_args(argv)
    try:
        if ns.cmd == "make-weights":
            return _make_weights(ns)
        if ns.cmd == "make-model":
            return _make_model(ns)
        settings = from_args(ns)
        if ns.cmd == "demo":
            if ns.target:
                from ctxprefill_bench.remote_demo import run_remote_demo

                return run_remote_demo(ns.target, settings)
            from ctxprefill_bench.demo import run_demo

            return run_demo(settings)
        from .app import serve

        return serve(settings)
    except ConfigError as e:
        print(f"ctxprefill: configuration error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
