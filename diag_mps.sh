# one-off diagnostic (not committed): stream order with and without MPS
CTXPREFILL_COMMIT=$1 GPU_RUN_STEPS="build pytest" GPU_RUN_PYTEST=tests/gpu/test_stream_order_gpu.py OUT=$OUT bash scripts/gpu_run.sh
export PYTHONPATH="/tmp/site:server:client:bench" PATH="/tmp/site/bin:$PATH" CTXPREFILL_BUILD_DIR=$PWD/.ext
python3 bench/bench_model_workload.py --device cuda --cuda-graphs --heads 16 --orders host stream --out $OUT/wl16.json 2>&1 | grep -v "^\s*16 " | tail -12
command -v nvidia-cuda-mps-control || { echo "no MPS control"; exit 0; }
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d && sleep 2 && echo "MPS started"
python3 bench/bench_model_workload.py --device cuda --cuda-graphs --heads 16 --orders host stream --out $OUT/wl16_mps.json 2>&1 | grep -v "^\s*16 " | tail -12
echo quit | nvidia-cuda-mps-control; sleep 1; cat $CUDA_MPS_LOG_DIRECTORY/control.log | tail -5
