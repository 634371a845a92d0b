"""Build the CUDA extension ahead of time: ``python -m ctxprefill.ops.build_ext [--arch 90a]``.

Builds into the same directory that ``ctxprefill.ops._cuda.load()`` looks in
(``$CTXPREFILL_BUILD_DIR/ext-<hash>``, default root ``~/.cache/ctxprefill``), so that a
container image built with it starts without compiling. Needs nvcc and the CUDA
headers, not a GPU, when ``--arch`` (or ``$CTXPREFILL_CUDA_ARCH``) is given. Prints
where the library is; exits non-zero, pointing at the build log, when the build fails.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import _cuda


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ctxprefill.ops.build_ext", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default=None,
                    help="target architectures, e.g. 90a or '90a;100a' (default: $CTXPREFILL_CUDA_ARCH, "
                         "else the current device's)")
    ap.add_argument("--verbose", action="store_true", help="show the compiler commands and output")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        archs = _cuda.arch_list(args.arch)
        mod, bdir = _cuda.build(";".join(archs), verbose=args.verbose)
    except Exception as e:  # noqa: BLE001 - report and exit non-zero
        print(f"ctxprefill: CUDA extension build FAILED: {e}", file=sys.stderr)
        if e.__cause__ is not None:
            print(str(e.__cause__)[-4000:], file=sys.stderr)
        return 1
    print(f"ctxprefill CUDA extension for sm_{','.join(archs)}: {bdir}/{_cuda.module_name(archs)}.so "
          f"(ready in {time.time() - t0:.1f} s; functions: "
          f"{', '.join(n for n in dir(mod) if not n.startswith('_'))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
