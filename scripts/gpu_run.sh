#!/usr/bin/env bash
# The one script to run on the GPU machine (H200), in one call, from the repository root:
#
#   bash scripts/gpu_run.sh            # results in $OUT (default ./.out)
#
# A step's JSON has the name of its file in bench/results/ (bench/make_tables.py lists them):
# copy it over that file and run python bench/make_tables.py to remake the tables.
#
# Steps (each runs even if an earlier one failed; rc per step in $OUT/summary.txt):
#   0. environment facts (GPU, driver, the host's CPUs and speed, nvcc, torch, triton)
#   1. install carried wheels from .whl/ (if present; bash scripts/fetch_gpu_wheels.sh) into /tmp/site
#   2. build the CUDA extension ahead of time (python3 -m ctxprefill.ops.build_ext)   -> build.log
#   3. GPU tests: tests/gpu, then tests/test_backend_triton.py                        -> pytest.log, junit.xml
#   4. bench/bench_kernels.py                                                         -> bench_kernels.json
#   5. compute-sanitizer memcheck on a small subset of tests/gpu/test_kernels.py      -> sanitizer.log
#   6. bench/bench_attention.py, if present                                           -> bench_attention.json
# and, when named in GPU_RUN_STEPS: bench_engine (64k headline rows), bench_engine_ragged, bench_engine_full
# (the 108-row grid), bench_concurrency, bench_concurrency_stream, bench_concurrency_ring, bench_transport,
# bench_rpc_floor, attention_sweep_ws, attention_ab, ncu_attention, bench_attention_flashinfer, probe_write, hostile_sanitizer,
# bench_sharded, profile_host, probe_host, probe_gemm, bench_ring_overlap (request rings with and without
# --request-ring-overlap), bench_request_overlap (calls with and without --request-overlap), bench_transport_pin (system regions page-locked and pageable, alternating),
# bench_inline_parse (the event loop's parse of an inline request, with and without protobuf's copies),
# bench_model_prefill (a transformers DeepSeek-V3 model prefilled in chunks through CUDA IPC, bf16 and float32),
# bench_model_workload (a 61-layer DeepSeek-V3-shaped prefill through a CUDA IPC request ring against its floors),
# bench_model_workload_graphs (the same, served with --cuda-graphs), bench_model_workload_mps (16 and 128 heads
# without and with a CUDA MPS daemon), profile_workload (py-spy over the workload),
# segv (a native backtrace of one test).
# CTXPREFILL_COMMIT labels the results: pass it from the machine that sends the call (the
# device's own git may report the commit its checkout started from, not the tree that runs;
# a label that is that commit while the tree differs from it is recorded with "+dirty").
# The device tool brings back at most 8 files from $OUT: choose steps accordingly.
# A time budget (GPU_RUN_BUDGET_S, default 560 s: one device call is capped at 600 s)
# caps every step; a step that no longer fits is recorded as skipped and counts as a
# failure. Exit code 0 only when every step passed. Files in $OUT: at most 7.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-./.out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="server:client:bench${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# built extension inside the (ignored) tree: a warm machine keeps it between calls
export CTXPREFILL_BUILD_DIR=${CTXPREFILL_BUILD_DIR:-$PWD/.ext}
BUDGET=${GPU_RUN_BUDGET_S:-560}
T0=$(date +%s)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

# GPU_RUN_STEPS selects steps (default: all but the slow or diagnostic extras)
STEPS=" ${GPU_RUN_STEPS:-build pytest bench_kernels sanitizer bench_attention} "
want() { [[ "$STEPS" == *" $1 "* ]]; }

say() { echo "[gpu_run +$(($(date +%s) - T0))s] $*"; }
note() { echo "$*" >>"$SUMMARY"; }

# The least time a step needs to leave its result (JSON written at its end): one that would
# start with less is recorded as skipped, its device time saved, not started to be cut off
# (default 15 s)
declare -A STEP_MIN=([bench_attention_flashinfer]=150 [bench_engine]=75)

# run_step NAME CAP_SECONDS RESERVE_SECONDS LOGFILE CMD...
#   LOGFILE "-": output appended to the summary; "+PATH": appended to PATH; else PATH is overwritten
run_step() {
  local name=$1 cap=$2 reserve=$3 logfile=$4
  shift 4
  local left=$((BUDGET - ($(date +%s) - T0) - reserve))
  local limit=$((cap < left ? cap : left)) least=${STEP_MIN["$name"]:-15}
  if [ "$limit" -lt "$least" ]; then
    say "SKIP $name: ${limit}s left in the ${BUDGET}s budget, it needs ${least}s"
    note "$name: SKIPPED (time budget) rc=125"
    FAILED=1
    return 0
  fi
  say "start $name (limit ${limit}s)"
  local t=$(date +%s) rc=0
  if [ "$logfile" = "-" ]; then
    timeout --kill-after=10 "$limit" "$@" >>"$SUMMARY" 2>&1 || rc=$?
  elif [ "${logfile#+}" != "$logfile" ]; then
    echo "===== $name: $*" >>"${logfile#+}"
    timeout --kill-after=10 "$limit" "$@" >>"${logfile#+}" 2>&1 || rc=$?
  else
    timeout --kill-after=10 "$limit" "$@" >"$logfile" 2>&1 || rc=$?
  fi
  local dt=$(($(date +%s) - t))
  [ "$rc" -eq 124 ] && note "$name: TIMED OUT after ${limit}s"
  note "$name: rc=$rc (${dt}s)"
  say "end $name rc=$rc (${dt}s)"
  [ "$rc" -eq 0 ] || FAILED=1
  return 0
}

# ---- 0. environment ---------------------------------------------------------------------
note "== ctxprefill gpu_run $(date -u +%Y-%m-%dT%H:%M:%SZ) commit=${CTXPREFILL_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
note "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi unavailable')"
# the host's speed (eager rows are bounded by it): run_info.python_loop_ms, as ctxprefill bench records it
note "host: $(nproc) CPUs, a 100k-step Python loop in $(python3 -c 'from ctxprefill_bench.run_info import python_loop_ms
print(f"{python_loop_ms():.2f} ms")' 2>&1 | tail -n 1)"
note "nvcc: $( (nvcc --version 2>/dev/null || "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version 2>/dev/null) | tail -n 1 || echo 'not found')"

# ---- 1. carried wheels ----------------------------------------------------------------------
if compgen -G ".whl/*.whl" >/dev/null; then
  say "installing carried wheels: $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
  rc=0
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >>"$SUMMARY" 2>&1 || rc=$?
  note "wheels: rc=$rc"
  [ "$rc" -eq 0 ] || FAILED=1
fi
# a pure-Python wheel too large for the carry travels unpacked (fetch_gpu_wheels.sh): unpack it likewise
for t in .whl/*.tar.xz; do
  [ -f "$t" ] || continue
  mkdir -p /tmp/site && tar -C /tmp/site -xJf "$t" && note "unpacked $(basename "$t")" || { note "unpack $t failed"; FAILED=1; }
done
if [ -d /tmp/site ]; then
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
  export PATH="/tmp/site/bin:$PATH"  # console scripts of the carried wheels (ninja for FlashInfer's JIT)
fi
note "python: $(python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -n 1)"
note "triton: $(python3 -c 'import triton; print(triton.__version__)' 2>&1 | tail -n 1)"

# ---- 2. build the extension once, for every later step ---------------------------------------
# (no reserve for later steps: they need the build, and would build it themselves, just
# in time, at the same cost — a reserve only made it time out under a small budget)
want build && run_step build 300 15 "$OUT/build.log" python3 -m ctxprefill.ops.build_ext
[ -f "$OUT/build.log" ] && tail -n 2 "$OUT/build.log" | sed 's/^/  build: /' >>"$SUMMARY" || true

# ---- 3. GPU tests (two runs: a hang in one cannot cost the other) -------------------------------
if want pytest; then
: >"$OUT/pytest.log"
# GPU_RUN_PYTEST narrows the first run to some test files / node ids (and skips the second,
# whose time it then keeps). GPU_RUN_PYTEST_K is pytest's -k expression, passed whole
# ("p_in_registers or exp2_poly"; GPU_RUN_PYTEST is split at spaces). Each run's reserve
# keeps time for what follows it (the Triton file, later steps)
LATER=$(for s in $STEPS; do case $s in build|pytest) ;; *) echo "$s";; esac; done)
K_ARGS=()
[ -z "${GPU_RUN_PYTEST_K:-}" ] || K_ARGS=(-k "$GPU_RUN_PYTEST_K")
# GPU_RUN_PYTEST_WORKERS=N: the Triton file's run (or GPU_RUN_PYTEST's) in N pytest-xdist
# processes sharing the GPU (xdist travels in .whl): its tests are bound by compiling their
# kernel variants on the host, ~18 s a test on a fresh machine; tests/gpu stays in one process
W_ARGS=()
if [ -n "${GPU_RUN_PYTEST_WORKERS:-}" ]; then
  if python3 -c "import xdist" 2>/dev/null; then
    W_ARGS=(-n "$GPU_RUN_PYTEST_WORKERS")
    note "pytest: $GPU_RUN_PYTEST_WORKERS xdist workers for the Triton file / GPU_RUN_PYTEST"
  else
    note "pytest: GPU_RUN_PYTEST_WORKERS set, but pytest-xdist is not installed (bash scripts/fetch_gpu_wheels.sh)"
    FAILED=1
  fi
fi
if [ -z "${GPU_RUN_PYTEST:-}" ]; then
  # tests/gpu (~210-300 s on the H200) first claims 300 s of what is left: the Triton file's
  # reserve, 200 s, shrinks under a smaller budget (to 5 s) rather than cut tests/gpu short
  FIRST_RESERVE=$((BUDGET - ($(date +%s) - T0) - 300))
  FIRST_RESERVE=$((FIRST_RESERVE > 200 ? 200 : FIRST_RESERVE < 5 ? 5 : FIRST_RESERVE))
else
  FIRST_RESERVE=$([ -n "$LATER" ] && echo 150 || echo 5)
fi
run_step pytest_gpu 400 "$FIRST_RESERVE" \
  "+$OUT/pytest.log" \
  python3 -m pytest -q -rsfE -p no:cacheprovider --durations=10 --tb=short --junitxml=/tmp/junit.xml \
  ${GPU_RUN_PYTEST:-tests/gpu} ${K_ARGS[@]+"${K_ARGS[@]}"} ${GPU_RUN_PYTEST:+${W_ARGS[@]+"${W_ARGS[@]}"}}
[ -n "${GPU_RUN_PYTEST:-}" ] || run_step pytest_triton 240 "$([ -n "$LATER" ] && echo 150 || echo 5)" "+$OUT/pytest.log" \
  python3 -m pytest -q -rs -p no:cacheprovider --durations=5 tests/test_backend_triton.py \
  $(ls tests/test_backend_cudnn.py 2>/dev/null) ${W_ARGS[@]+"${W_ARGS[@]}"}
grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|errors?) in " "$OUT/pytest.log" | tail -n 25 | sed 's/^/  pytest: /' >>"$SUMMARY" || true
# launch counts (profiler vs stats) recorded by tests/gpu/test_engine_gpu.py as junit properties
[ -f /tmp/junit.xml ] && python3 - /tmp/junit.xml >>"$SUMMARY" 2>&1 <<'PY' || true
import collections, json, sys, xml.etree.ElementTree as ET
rows, sites = [], []  # launch counts; q's GraphPatch sites in the graph-variant test's captures
for tc in ET.parse(sys.argv[1]).iter("testcase"):
    p = {q.get("name"): q.get("value") for q in tc.iter("property")}
    if "stats_launches" in p:
        bad = tc.find("failure") is not None or tc.find("error") is not None
        rows.append(f"  launches {tc.get('name')}: profiler {p.get('profiler_kernels')} kernels + "
                    f"{p.get('profiler_dtod_copies')} DtoD, stats {p['stats_launches']}{'  MISMATCH' if bad else ''}")
    for on, found in json.loads(p.get("q_sites", "{}")).items():  # grouped
        c = collections.Counter((x["kernel"][:40], x["param"], x["offset"], x["size"], x["descriptor"], x["probe"]) for x in found)
        sites.append(f"  q sites {tc.get('name')} variants={on}: " + "; ".join(f"{k} x{n}" for k, n in c.items()))
print(f"launch-count tests: {len(rows)} recorded, {sum('MISMATCH' in r for r in rows)} mismatched")
print("\n".join([r for r in rows if "MISMATCH" in r][:10] + [r for r in rows if "MISMATCH" not in r][:4] + sites))
PY
cp /tmp/junit.xml "$OUT/junit.xml" 2>/dev/null || true
fi

# ---- 3b. a native backtrace of a crashing test (GPU_RUN_SEGV_TEST=node id) -------------------
if want segv; then
  run_step segv 120 60 "$OUT/gdb.log" cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" \
    --args python3 -m pytest -q -x -p no:cacheprovider "${GPU_RUN_SEGV_TEST:-tests/gpu/test_kernels.py::test_pack_empty_and_errors}"
fi

# ---- 4. kernel benchmark ------------------------------------------------------------------------
want bench_kernels && run_step bench_kernels 150 80 - python3 bench/bench_kernels.py --out "$OUT/bench_kernels.json"

# ---- 5. memcheck on a subset ----------------------------------------------------------------------
SAN=$(command -v compute-sanitizer || true)
[ -z "$SAN" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ] && SAN="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
if ! want sanitizer; then
  :
elif [ -n "$SAN" ]; then
  # exact allocations (no caching allocator) so that an out-of-bounds access is caught
  run_step sanitizer 150 50 "$OUT/sanitizer.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    "$SAN" --tool memcheck --error-exitcode 99 --print-limit 50 \
    python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernels.py \
    -k "not 65536 and not 4097 and not 70001 and not 1000 and not long_context and not k_scale_not_power and not random_bytes and not all_bit_patterns and not fp16"
  grep -E "ERROR SUMMARY|[0-9]+ (passed|failed)" "$OUT/sanitizer.log" | tail -n 3 | sed 's/^/  sanitizer: /' >>"$SUMMARY" || true
else
  note "sanitizer: compute-sanitizer not found (not on PATH, not in \$CUDA_HOME/bin): skipped"
  echo "compute-sanitizer not found" >"$OUT/sanitizer.log"
fi

# ---- 6. attention benchmark (another engineer's) ----------------------------------------------
if want bench_attention; then
  run_step bench_attention 120 5 - python3 bench/bench_attention.py --out "$OUT/bench_attention.json"
fi

# ---- 7. the whole request: fused vs generic in one process (ctxprefill bench) ------------------
# (--clocks-s 1: a second of each path under NVML's eye per row, after its timing: SM clock,
# power, clock-event reasons — is the fused path's compute slower because it is power-capped?)
# (GPU_RUN_ENGINE_ARGS: more options, e.g. "--gemm gluon"; BENCH_ENGINE_FILE: its JSON's name, bench_engine;
# bench_engine_h200, an H200's run)
want bench_engine && run_step bench_engine 240 5 - python3 -m ctxprefill.cli bench --heads 16 128 --new 1024 \
  --context 65536 --clocks-s 1 --iters 25 ${GPU_RUN_ENGINE_ARGS:-} --out "$OUT/${BENCH_ENGINE_FILE:-bench_engine}.json"
# cost against work: request time and floor from 8k to 1M context tokens (1,024 new), and from 128 to 16k new
# tokens (64k context); make_tables.py fits the growth per context token
want bench_engine_scaling && run_step bench_engine_scaling 240 5 - python3 -m ctxprefill.cli bench --heads 16 128 \
  --new 1024 --context 8192 32768 131072 262144 524288 1048576 --cache-dtype auto --prefill-dtype bf16 fp8 \
  --iters 3 --budget-s 225 --out "$OUT/bench_engine_scaling.json"
want bench_engine_new && run_step bench_engine_new 200 5 - python3 -m ctxprefill.cli bench --heads 16 128 \
  --new 128 1024 4096 16384 --context 65536 --cache-dtype auto --prefill-dtype bf16 fp8 \
  --iters 3 --budget-s 185 --out "$OUT/bench_engine_new.json"

# where a 16-head request's host time goes (the gap column above): the host's CPUs and load, then
# profile_engine.py --timeline for each path and prefill dtype, into one file
want profile_host && run_step profile_host 200 5 "$OUT/profile_host.txt" bash -c '
  echo "== nproc $(nproc); $(uptime)"; lscpu | grep -E "Model name|MHz" || true
  ps -eo pcpu,pid,comm --sort=-pcpu | head -6
  for pd in bf16 fp8; do for path in "" --generic; do
    echo "== profile_engine --heads 16 --prefill-dtype $pd $path"
    python3 bench/profile_engine.py --heads 16 --prefill-dtype $pd $path --iters 30 --timeline --top 20 || exit 1
  done; done'

# the host's time to issue a 16-head request with the device held (no waits), and its pieces
# PROBE_HOST_HEADS: the head counts probed (default 16; "16 128" adds the 128-head request);
# PROBE_HOST_ARGS: more of its options (e.g. --no-gc, --cpu-latency-us 0: idle CPUs held awake);
# PROBE_HOST_FILE: its JSON's name (probe_host; probe_host_quiet, a second machine's run)
want probe_host && run_step probe_host 240 5 - python3 bench/probe_host_issue.py --heads ${PROBE_HOST_HEADS:-16} \
  ${PROBE_HOST_ARGS:-} --out "$OUT/${PROBE_HOST_FILE:-probe_host}.json"

# kv_b_proj's GEMM shapes: cuBLAS against a Triton persistent TMA kernel, beside the burst rate
want probe_gemm && run_step probe_gemm 200 5 - python3 bench/probe_gemm.py --out "$OUT/probe_gemm.json"

# ragged requests: 4 sequences of uneven lengths in one 64k-row chunk; where the Triton backend packs
# the chunk's attention tiles per SM (H=16, 4,096 new: 512 tiles), the fused path also without it
want bench_engine_ragged && run_step bench_engine_ragged 240 5 - python3 -m ctxprefill.cli bench --heads 16 128 \
  --new 1024 4096 --context 65536 --sequences 4 --workspace-tokens 65536 --out "$OUT/bench_engine_ragged.json"

# ---- 7b. the whole engine grid (108 rows), the concurrency sweep, the transports -------------------
want bench_engine_full && run_step bench_engine_full 240 5 - python3 -m ctxprefill.cli bench --grid full \
  --iters 20 --target-s 0.3 --budget-s 215 --out "$OUT/bench_engine_full.json"
want bench_concurrency && run_step bench_concurrency 240 5 - python3 bench/bench_concurrency.py \
  --shape 16:1024:65536 128:1024:65536 --clients 1 2 4 8 16 --transport inline cuda --seconds 5 --warmup-s 1 \
  --budget-s 225 --out "$OUT/bench_concurrency.json"
# requests on one PrefillContextStream per client, 2 in flight (does pipelining beat a call each?)
want bench_concurrency_stream && run_step bench_concurrency_stream 200 5 - python3 bench/bench_concurrency.py \
  --shape 16:1024:65536 128:1024:65536 --clients 1 2 4 --transport cuda --stream-depth 2 --seconds 5 --warmup-s 1 \
  --budget-s 190 --out "$OUT/bench_concurrency_stream.json"
# requests through a request ring per client, 2 in flight (serve --request-ring; not run on the GPU yet)
want bench_concurrency_ring && run_step bench_concurrency_ring 200 5 - python3 bench/bench_concurrency.py \
  --shape 16:1024:65536 128:1024:65536 --clients 1 2 4 --transport cuda --ring-depth 2 --seconds 5 --warmup-s 1 \
  --budget-s 190 --out "$OUT/bench_concurrency_ring.json"
# on_off_on NAME FLAG CAP ARGS...: bench/bench_concurrency.py ARGS against a server with --FLAG on, off
# (--no-FLAG), then on again (the host's speed drifts between runs; the bracketing shows by how much),
# each run capped at CAP s -> bench_NAME_{on,off,on2}.json
on_off_on() {
  local name=$1 flag=$2 cap=$3 v
  shift 3
  for v in on off on2; do
    local off=(); [ "$v" = off ] && off=(--server-flag "no-$flag")
    run_step "${name}_$v" "$cap" 5 - python3 bench/bench_concurrency.py "$@" --budget-s $((cap - 5)) "${off[@]}" \
      --out "$OUT/bench_${name}_$v.json"
  done
}
# the request ring's overlap (--request-ring-overlap), 16 heads, a ring per client
want bench_ring_overlap && on_off_on ring_overlap request-ring-overlap 60 --shape 16:1024:65536 --clients 1 2 4 \
  --transport cuda --ring-depth 2 --seconds 5 --warmup-s 1
# calls queued behind each other overlapping on the device (--request-overlap), a call per request over
# CUDA IPC, 16 and 128 heads
want bench_request_overlap && on_off_on request_overlap request-overlap 110 --shape 16:1024:65536 128:1024:65536 \
  --clients 1 2 4 --transport cuda --seconds 4 --warmup-s 1
want bench_transport && run_step bench_transport 240 5 - python3 bench/bench_transport.py --device cuda --iters 60 \
  --out "$OUT/bench_transport.json"
# system regions page-locked (default) against pageable (--no-shared-memory-pin), alternating
if want bench_transport_pin; then
  for v in pin nopin pin2 nopin2; do
    pin=(); [[ $v == nopin* ]] && pin=(--no-pin)
    run_step "transport_$v" 90 5 - python3 bench/bench_transport.py --device cuda --iters 60 \
      --modes system system-ring "${pin[@]}" --out "$OUT/bench_transport_$v.json"
  done
fi
want bench_inline_parse && run_step bench_inline_parse 60 5 - python3 bench/bench_inline_parse.py \
  --tokens 256 1024 4096 --out "$OUT/bench_inline_parse.json"
want bench_rpc_floor && run_step bench_rpc_floor 60 5 - python3 bench/bench_rpc_floor.py --out "$OUT/bench_rpc_floor.json"
# the same two with idle CPUs held awake (/dev/cpu_dma_latency = 0, bench/pm_qos.py)
want bench_transport_awake && run_step bench_transport_awake 180 5 - python3 bench/bench_transport.py --device cuda \
  --cpu-latency-us 0 --modes cuda cuda-stream system --out "$OUT/bench_transport_awake.json"
want bench_rpc_floor_awake && run_step bench_rpc_floor_awake 60 5 - python3 bench/bench_rpc_floor.py --cpu-latency-us 0 \
  --out "$OUT/bench_rpc_floor_awake.json"

# ---- 7c. FlashInfer's FA3 ragged prefill next to ours (carried wheels; compiles on first use)
# (GPU_RUN_FI_ARGS replaces the provider filter and budget, e.g. "--budget-s 175": every provider;
# the default's budget leaves the key scan, started before it passes, room within the step's 420 s;
# BENCH_ATTENTION_FILE: its JSON's name, bench_attention; bench_attention_captured with --captured)
want bench_attention_flashinfer && run_step bench_attention_flashinfer 420 5 - python3 bench/bench_attention.py \
  --flashinfer ${GPU_RUN_FI_ARGS:---providers triton flashinfer cudnn --no-flex --budget-s 340 --key-scan} \
  --out "$OUT/${BENCH_ATTENTION_FILE:-bench_attention}.json"

# ---- 7d. how fast writes stream, by every way to write (for the bf16 pack: is 3.38 TB/s torch's
# fill kernel or the memory?), and the bf16 pack in CUDA against Triton packs with plain / TMA stores
want probe_write && run_step probe_write 90 5 - python3 bench/probe_write_bandwidth.py --out "$OUT/probe_write.json"

# ---- 7e. a real model: a random transformers DeepSeek-V3 (4 layers x 16 heads, hidden 2048) prefills an 8,192-token
# prompt in 1,024-token chunks, every layer's context attention from a serve --model server through one CUDA IPC
# region, then inline; per chunk local / remote / server time, errors against the monolithic forward
# (GPU_RUN_MODEL_ARGS: more options, e.g. "--heads 128")
want bench_model_prefill && run_step bench_model_prefill 150 5 - python3 bench/bench_model_prefill.py --device cuda \
  ${GPU_RUN_MODEL_ARGS:-} --out "$OUT/bench_model_prefill.json"
# the same weights computing in float32: the error left is ctxprefill's and its bf16 cache's
want bench_model_prefill && run_step bench_model_prefill_fp32 150 5 - python3 bench/bench_model_prefill.py \
  --device cuda --dtype float32 --transports cuda ${GPU_RUN_MODEL_ARGS:-} --out "$OUT/bench_model_prefill_fp32.json"

# ---- 7f. a DeepSeek-V3-shaped workload: 61 layers at 128 and at 16 heads (one server each), 8,192 new tokens in
# 1,024-token chunks over a context growing to 128k, every layer's call through a CUDA IPC request ring, each
# waited for before the next layer's; wall time against the sum of the calls' floors, per-GPU context tokens/s
# (host order, then a stream-ordered ring on the same server: calls ordered on the device by CUDA events),
# with bf16 and then with fp8 prefill (a server each)
# (GPU_RUN_WORKLOAD_ARGS: more options, e.g. "--heads 16" or "--cache-write separate")
want bench_model_workload && run_step bench_model_workload 540 5 - python3 bench/bench_model_workload.py \
  --device cuda --orders host stream --prefill-dtype bf16 fp8 ${GPU_RUN_WORKLOAD_ARGS:-} \
  --out "$OUT/bench_model_workload.json"
# the same with the server's --cuda-graphs (a step's shape captured once, replayed for the other layers)
want bench_model_workload_graphs && run_step bench_model_workload_graphs 300 5 - python3 bench/bench_model_workload.py \
  --device cuda --cuda-graphs --orders host stream --prefill-dtype bf16 fp8 ${GPU_RUN_WORKLOAD_ARGS:-} \
  --out "$OUT/bench_model_workload_graphs.json"
# the bf16 workload at 16 and 128 heads without and with a CUDA MPS daemon over the caller and the server, in
# turn, two rounds (~310 s on an H100)
want bench_model_workload_mps && run_step bench_model_workload_mps 420 5 - python3 bench/bench_model_workload.py \
  --device cuda --orders host stream --heads 16 128 --prefill-dtype bf16 --mps-ab 2 \
  --out "$OUT/bench_model_workload_mps.json"

# where the host's time goes in that workload (16 heads, graphs): py-spy samples the bench and its
# server (raw stacks, gzipped), folded for the server's engine thread and the caller's timed loop
want profile_workload && run_step profile_workload 200 5 "$OUT/profile_workload.txt" bash -c '
  py-spy record --subprocesses --threads --nonblocking -r 400 -f raw -o /tmp/stacks.txt -- \
    python3 bench/bench_model_workload.py --device cuda --cuda-graphs --heads 16 --new 32768 --out /tmp/pw.json \
    || exit 1
  gzip -c /tmp/stacks.txt >"$OUT/profile_workload_stacks.txt.gz"
  for w in EngineWorker._run drive; do python3 bench/fold_stacks.py /tmp/stacks.txt --within $w --top 80; done'

# ---- 8a. the warp-specialized kernel's configs (GPU_RUN_SWEEP_FLASHINFER=1: FlashInfer's FA3 beside
# them, its ~90 s JIT build included)
# (GPU_RUN_WS_SWEEP=ws-short: the defaults against 64-key blocks on the 1,024-row chunks)
want attention_sweep_ws && run_step attention_sweep_ws 360 5 - python3 bench/bench_attention.py \
  --sweep "${GPU_RUN_WS_SWEEP:-ws}" ${GPU_RUN_SWEEP_FLASHINFER:+--flashinfer} --no-flex --budget-s 300 \
  --out "$OUT/attention_sweep_${GPU_RUN_WS_SWEEP:-ws}.json"

# ---- 8a'. two configs of the warp-specialized kernel in interleaved rounds (GPU_RUN_AB: names of
# bench_attention.AB, one step each, default ws-wait; GPU_RUN_AB_ROUNDS: rounds per shape, default 5;
# GPU_RUN_AB_ARGS: more arguments, split at spaces, e.g. --ws-over {"PERSIST":true})
for ab in ${GPU_RUN_AB:-ws-wait}; do
  want attention_ab && run_step "attention_ab $ab" 300 5 - python3 bench/bench_attention.py --ab "$ab" \
    --verdict-rounds "${GPU_RUN_AB_ROUNDS:-5}" --budget-s 240 ${GPU_RUN_AB_ARGS:-} --out "$OUT/attention_ab_$ab.json"
done

# ---- 8a''. one launch of each config of an --ab entry (GPU_RUN_NCU_AB) under Nsight Compute (clocks left alone):
# tensor pipe share, SM clock, shared-memory wavefronts, stall reasons -> ncu_attention.csv (the
# launches' configs, in order, in ncu_attention.log). Beside FlashInfer's FA3:
# GPU_RUN_NCU_ARGS="--flashinfer" GPU_RUN_NCU_K="" (every kernel in the range)
want ncu_attention && run_step ncu_attention 240 5 "$OUT/ncu_attention.log" ncu --clock-control none --nvtx \
  --nvtx-include profiled/ ${GPU_RUN_NCU_K--k regex:_mla_attn_ws_fwd} --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section MemoryWorkloadAnalysis_Tables --csv --page details \
  --log-file "$OUT/ncu_attention.csv" python3 bench/profile_attention.py --ab "${GPU_RUN_NCU_AB:-ws-fp8-regs}" \
  ${GPU_RUN_NCU_ARGS:-}

# ---- 8b. hostile requests against a GPU server under memcheck (reduced set) ----------------------
want hostile_sanitizer && run_step hostile_sanitizer 200 5 "$OUT/hostile_sanitizer.log" env HOSTILE_COUNT=300 \
  CONFIGS="auto" READY_TIMEOUT=150 OUT=/tmp/hostile_sanitizer PYTHON=python3 bash scripts/hostile_under_sanitizer.sh

# ---- 9. head-sharded workers, one per GPU (needs 2 GPUs) ----------------------------------------
# with one GPU both shards share it: the bit-for-bit equality still holds and is checked
SHARED=$([ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] || echo --shared-gpu)
want bench_sharded && run_step bench_sharded 200 5 - python3 bench/bench_sharded.py --num-shards 2 --concurrency "${SHARDED_CONCURRENCY:-8}" \
  $SHARED --seconds 15 --budget-s 150 --out "$OUT/bench_sharded.json"

note "== total $(($(date +%s) - T0))s; $([ "$FAILED" -eq 0 ] && echo 'ALL PASSED' || echo 'SOME STEPS FAILED')"
say "done: $(tail -n 1 "$SUMMARY")"
exit "$FAILED"
