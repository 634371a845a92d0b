#!/usr/bin/env bash
# Compile the lock files from their inputs, with hashes (uv pip compile; uv goes into
# $CTXPREFILL_TOOLS_DIR, default .cache/tools):
#
#   requirements/runtime.in -> requirements/runtime.txt   the image (Linux x86_64, CPython 3.12)
#   requirements/test.in    -> requirements/test.txt      CI (Linux x86_64, CPython 3.11)
#
#   bash scripts/lock.sh                 # keep the versions already locked where they still fit
#   bash scripts/lock.sh --upgrade       # move every package to its newest version
#   bash scripts/lock.sh --check         # exit 1, with the difference, if a lock is not current
#
# Run it after changing a dependency in pyproject.toml or client/pyproject.toml;
# tests/test_image_build.py fails while a lock misses one. ctxprefill and ctxprefill-client
# themselves are built from this tree and are not in the locks.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
TOOLS=${CTXPREFILL_TOOLS_DIR:-$PWD/.cache/tools}
UV="$TOOLS/uv-$UV_VERSION/bin/uv"
if [ ! -x "$UV" ]; then
  python3 -m venv "$TOOLS/uv-$UV_VERSION"
  "$TOOLS/uv-$UV_VERSION/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
fi
# CI's CPU torch (torch==2.13.0+cpu) is a wheel on local disk, where pip's find-links points
TORCH_WHEELS=${CTXPREFILL_TORCH_WHEELS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}

OUT=requirements
CHECK=0
if [ "${1:-}" = --check ]; then
  CHECK=1
  shift
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
  cp requirements/runtime.txt requirements/test.txt "$OUT"/  # the locked versions stay preferred
fi
common=(--no-config --generate-hashes --python-platform x86_64-manylinux_2_28 --quiet
        --no-emit-package ctxprefill --no-emit-package ctxprefill-client
        --custom-compile-command "bash scripts/lock.sh" "$@")
"$UV" pip compile "${common[@]}" --python-version 3.12 requirements/runtime.in -o "$OUT/runtime.txt"
"$UV" pip compile "${common[@]}" --python-version 3.11 ${TORCH_WHEELS:+--find-links "$TORCH_WHEELS"} \
  --no-emit-package torch requirements/test.in -o "$OUT/test.txt"
if [ "$CHECK" = 1 ]; then
  rc=0
  for f in runtime.txt test.txt; do
    diff -u "requirements/$f" "$OUT/$f" >&2 || { echo "[lock] requirements/$f is not current: run bash scripts/lock.sh" >&2; rc=1; }
  done
  exit "$rc"
fi
echo "[lock] requirements/runtime.txt: $(grep -c '^[a-z]' requirements/runtime.txt) packages," \
     "requirements/test.txt: $(grep -c '^[a-z]' requirements/test.txt) packages" >&2
