#!/usr/bin/env bash
# Set up ctxprefill in a virtual environment (default .venv; CTXPREFILL_VENV overrides).
#
# CTXPREFILL_INSTALL chooses what goes in; the dependencies come from a lock file with
# hashes (requirements/, made by scripts/lock.sh; CTXPREFILL_LOCK overrides it):
#   dev (default; developers and CI): requirements/test.txt (the dependencies, the test
#       tools and the deploy linters), the CPU torch, then ./client and . editable with
#       the test extra.
#   runtime (the image): requirements/runtime.txt (torch and its CUDA 13.0 wheels
#       included), then wheels of ./client and . built here and installed non-editable.
#       No test tools, no editable install. With CTXPREFILL_APP_PREFIX=DIR the two
#       packages and the `ctxprefill` command go under DIR (a .pth file in the venv points
#       there), so that the image keeps them in a layer apart from the dependencies.
#   runtime-deps: the lock of runtime alone (the image's dependency layer).
#
# torch, where the lock has none: the pinned CPU build (torch==2.13.0, from local disk on
# our CI machines; an open-ended "torch" would download gigabytes of CUDA wheels). A GPU
# machine that already has its CUDA torch creates the venv with CTXPREFILL_SYSTEM_SITE=1
# so that torch is inherited, not replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CTXPREFILL_VENV:-.venv}
MODE=${CTXPREFILL_INSTALL:-dev}
TORCH_SPEC=${CTXPREFILL_TORCH_SPEC:-torch==2.13.0}
APP=${CTXPREFILL_APP_PREFIX:-}
log() { printf '[install] %s\n' "$*" >&2; }
case "$MODE" in
  dev) LOCK=${CTXPREFILL_LOCK:-requirements/test.txt} ;;
  runtime | runtime-deps) LOCK=${CTXPREFILL_LOCK:-requirements/runtime.txt} ;;
  *) log "CTXPREFILL_INSTALL=$MODE: expected dev, runtime or runtime-deps"; exit 2 ;;
esac
PIP=(-m pip install -q --disable-pip-version-check)

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  if [ "${CTXPREFILL_SYSTEM_SITE:-0}" = 1 ]; then python3 -m venv --system-site-packages "$VENV"; else python3 -m venv "$VENV"; fi
fi
PY="$VENV/bin/python"

log "installing $LOCK (hash-checked)"
# runtime: --no-deps, the lock is the whole environment (pip check below proves it closed)
"$PY" "${PIP[@]}" --require-hashes $([ "$MODE" = dev ] || echo --no-deps) -r "$LOCK"
if [ -n "$APP" ]; then
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  # where `pip install --prefix` puts packages (pip asks sysconfig the same question)
  "$PY" -c 'import sys, sysconfig as s; print(s.get_path("purelib", s.get_preferred_scheme("prefix"),
            {"base": sys.argv[1], "platbase": sys.argv[1]}))' "$APP" >"$site/ctxprefill-app.pth"
fi
[ "$MODE" = runtime-deps ] && exit 0

if ! "$PY" -c "import torch" 2>/dev/null; then
  # the environment takes ~2 GB; pip's own error on a full disk names no size
  free_kb=$(df -Pk "$VENV" 2>/dev/null | awk 'NR == 2 {print $4}')
  if [ -n "$free_kb" ] && [ "$free_kb" -lt $((2500 * 1024)) ]; then
    log "WARNING: $((free_kb / 1024)) MB free where $VENV lives; torch and the rest need about 2,000 MB"
  fi
  log "installing $TORCH_SPEC"
  "$PY" "${PIP[@]}" "$TORCH_SPEC"
fi

if [ "$MODE" = dev ]; then
  log "installing ctxprefill-client (client/) and ctxprefill, editable, with the test extra"
  # one command: the server's pin on ctxprefill-client is met by ./client (pyproject.toml);
  # the build backend is the lock's setuptools (no build environment fetched on every run)
  "$PY" "${PIP[@]}" --no-build-isolation -e ./client -e ".[test]"
else
  log "building the wheels of ctxprefill-client (client/) and ctxprefill"
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  # the build backend is the lock's setuptools: no index, no unpinned build dependency
  "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation --no-index -w "$wheels" ./client .
  "$PY" "${PIP[@]}" --no-deps --no-index ${APP:+--prefix "$APP"} "$wheels"/*.whl
  "$PY" -m pip check >&2
fi
"$PY" -c "import ctxprefill, ctxprefill_client, torch; print('[install] ctxprefill', ctxprefill.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" >&2
