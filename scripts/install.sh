#!/usr/bin/env bash
# Set up ctxprefill in a virtual environment (default .venv; CTXPREFILL_VENV overrides).
#
# torch: a machine without a GPU gets the pinned CPU build (torch==2.13.0, from local
# disk on our CI machines; an open-ended "torch" would download gigabytes of CUDA
# wheels). A GPU image that already has its CUDA torch creates the venv with
# CTXPREFILL_SYSTEM_SITE=1 so that torch is inherited, not replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CTXPREFILL_VENV:-.venv}
TORCH_SPEC=${CTXPREFILL_TORCH_SPEC:-torch==2.13.0}
log() { printf '[install] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  if [ "${CTXPREFILL_SYSTEM_SITE:-0}" = 1 ]; then python3 -m venv --system-site-packages "$VENV"; else python3 -m venv "$VENV"; fi
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
  # the environment takes ~2 GB; pip's own error on a full disk names no size
  free_kb=$(df -Pk "$VENV" 2>/dev/null | awk 'NR == 2 {print $4}')
  if [ -n "$free_kb" ] && [ "$free_kb" -lt $((2500 * 1024)) ]; then
    log "WARNING: $((free_kb / 1024)) MB free where $VENV lives; torch and the rest need about 2,000 MB"
  fi
  log "installing $TORCH_SPEC"
  "$PY" -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
fi
log "installing ctxprefill-client (client/), ctxprefill and its test dependencies"
# one command: the server's pin on ctxprefill-client is met by ./client (pyproject.toml)
"$PY" -m pip install -q --disable-pip-version-check -e ./client -e ".[test]"
"$PY" -c "import ctxprefill, ctxprefill_client, torch; print('[install] ctxprefill', ctxprefill.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" >&2
