#!/usr/bin/env bash
# Hostile requests against a GPU server running under compute-sanitizer memcheck.
#
# For each configuration below: start `ctxprefill serve --device cuda` under
# `compute-sanitizer --tool memcheck` (PyTorch's caching allocator off, so that every
# tensor is its own allocation and memcheck sees its exact bounds), send a reduced
# hostile set (tests/hostile_cases.py: every mutation family, HOSTILE_COUNT requests,
# valid ones mixed in and checked bit for bit, the cache checksummed before and after),
# SIGTERM the server, and require: every answer as expected, the server alive until
# the end and exiting 0, and "ERROR SUMMARY: 0 errors" from memcheck.
#
#   bash scripts/hostile_under_sanitizer.sh                 # on the GPU machine
#   HOSTILE_COUNT=500 CONFIGS="auto" bash scripts/hostile_under_sanitizer.sh
#   SANITIZER= DEVICE=cpu bash scripts/hostile_under_sanitizer.sh   # dry run of the plumbing, no GPU
#
# Environment: PYTHON (default .venv/bin/python, else python3), HOSTILE_COUNT (2000),
# CONFIGS (space-separated names of the table below; default all), BACKEND (auto),
# SANITIZER (compute-sanitizer; empty: none), DEVICE (cuda), READY_TIMEOUT (1200 s),
# OUT (where logs go; default a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
COUNT=${HOSTILE_COUNT:-2000}
BACKEND=${BACKEND:-auto}
DEVICE=${DEVICE:-cuda}
SANITIZER=${SANITIZER-compute-sanitizer}
READY_TIMEOUT=${READY_TIMEOUT:-1200}
OUT=${OUT:-$(mktemp -d -t ctxprefill-sanitizer.XXXXXX)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/server:$PWD/client${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1

declare -A FLAGS=(
  [auto]="--cache-dtype auto --kv-b-proj-dtype bf16 --prefill-dtype bf16"
  [fp8]="--cache-dtype fp8 --kv-b-proj-dtype bf16 --prefill-dtype bf16"
  [fp8_ds_mla]="--cache-dtype fp8_ds_mla --kv-b-proj-dtype fp8 --prefill-dtype fp8"
)
CONFIGS=${CONFIGS:-"auto fp8 fp8_ds_mla"}
log() { printf '[sanitizer] %s\n' "$*" >&2; }

if [ -n "$SANITIZER" ] && ! command -v "$SANITIZER" >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer; do
    if [ -x "$d/compute-sanitizer" ]; then SANITIZER="$d/compute-sanitizer"; break; fi
  done
  command -v "$SANITIZER" >/dev/null 2>&1 || { log "compute-sanitizer not found (set SANITIZER=path)"; exit 2; }
fi

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ready() { "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$1" >/dev/null 2>&1; }

SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for c in $(ps -o pid= --ppid "$SERVER_PID" 2>/dev/null); do kill -TERM "$c" 2>/dev/null || true; done
  fi
}
trap cleanup EXIT

failed=0
for name in $CONFIGS; do
  port=$(free_port); mport=$(free_port)
  srv_log="$OUT/server-$name.log"; san_log="$OUT/memcheck-$name.log"; client_log="$OUT/hostile-$name.log"
  cmd=("$PYTHON" -m ctxprefill.cli serve --device "$DEVICE" --host 127.0.0.1 --port "$port" --metrics-port "$mport"
       --heads 2 --block-size 16 --num-blocks 64 --workspace-tokens 64 --max-message-bytes 4194304
       --backend "$BACKEND" --grace-seconds 120 ${FLAGS[$name]})
  if [ -n "$SANITIZER" ]; then
    cmd=("$SANITIZER" --tool memcheck --leak-check no --report-api-errors no --log-file "$san_log" "${cmd[@]}")
  fi
  log "$name: starting: ${cmd[*]}"
  "${cmd[@]}" >"$srv_log" 2>&1 &
  SERVER_PID=$!
  t0=$(date +%s)
  until ready "http://127.0.0.1:$mport/readyz"; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then log "$name: the server exited during start-up"; tail -50 "$srv_log" >&2; exit 1; fi
    if [ $(( $(date +%s) - t0 )) -gt "$READY_TIMEOUT" ]; then log "$name: not ready after $READY_TIMEOUT s"; exit 1; fi
    sleep 2
  done
  log "$name: ready after $(( $(date +%s) - t0 )) s; sending $COUNT hostile requests"
  rc=0
  "$PYTHON" tests/hostile_cases.py --target "127.0.0.1:$port" --count "$COUNT" --batch 25 --seed 5 \
    >"$client_log" 2>&1 || rc=$?
  cat "$client_log" >&2
  alive=yes; kill -0 "$SERVER_PID" 2>/dev/null || alive=no
  # SIGTERM the python server (the sanitizer's child, or the server itself without one)
  target_pid=$SERVER_PID
  if [ -n "$SANITIZER" ]; then
    child=$(ps -o pid= --ppid "$SERVER_PID" | head -1 | tr -d ' ')
    [ -n "$child" ] && target_pid=$child
  fi
  kill -TERM "$target_pid" 2>/dev/null || true
  src=0; wait "$SERVER_PID" || src=$?
  SERVER_PID=""
  summary="(no sanitizer)"
  if [ -n "$SANITIZER" ]; then summary=$(grep -h "ERROR SUMMARY" "$san_log" | tail -1 || true); fi
  log "$name: hostile client exit $rc; server alive at the end: $alive; server exit $src; memcheck: $summary"
  if [ "$src" != 0 ] && [ -n "$SANITIZER" ] && grep -q "couldn't find exit code" "$san_log"; then
    # seen on the H200 (2026-11-29): after the SIGTERM to its target, compute-sanitizer
    # 13.0 says "couldn't find exit code" and exits 1 itself; the drain is tested on
    # the CPU (tests/test_reliability.py), here the point is memcheck over the requests
    log "$name: the sanitizer lost the server's exit code after SIGTERM (its own exit 1): not counted"
    src=0
  fi
  if [ "$rc" != 0 ] || [ "$alive" != yes ] || [ "$src" != 0 ]; then failed=1; fi
  if [ -n "$SANITIZER" ] && ! grep -q "ERROR SUMMARY: 0 errors" "$san_log"; then
    failed=1; log "$name: memcheck reported errors:"; grep -m 40 -E "=========" "$san_log" >&2 || true
  fi
done
log "logs in $OUT"
if [ "$failed" != 0 ]; then log "FAILED"; exit 1; fi
log "PASSED: $CONFIGS"
