#!/usr/bin/env bash
# Fetch, into .whl/ (git-ignored), the wheels the GPU machine lacks: it has torch,
# triton, grpcio 1.84, protobuf, prometheus-client and pytest, but not these (the runtime's
# others among them: requirements/runtime.txt), and it cannot download. FlashInfer and the modules it imports are for bench_attention.py's
# --flashinfer comparison only (its kernels compile with nvcc on first use). scripts/gpu_run.sh installs whatever is in .whl/ into /tmp/site;
# h2 (with hpack, hyperframe) is the raw HTTP/2 client of the hostile-client tests; py-spy samples
# the workload bench for gpu_run.sh's profile_workload step; pytest-xdist (with execnet) runs
# the Triton file's compile-bound tests in parallel (gpu_run.sh's GPU_RUN_PYTEST_WORKERS).
# name ".whl" in the device call's carry.
#
#   bash scripts/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# the GPU machine: CPython 3.12, x86-64, glibc >= 2.28
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 -d .whl \
  grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 \
  uvicorn==0.54.0 h11==0.16.0 \
  ml-dtypes==0.7.0 psutil==7.2.2 python-json-logger==4.2.0 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 googleapis-common-protos==1.76.0 importlib-metadata==8.7.0 zipp==3.23.0 \
  nvidia-cudnn-frontend==1.32.0 \
  apache-tvm-ffi==0.1.15.post2 einops==0.8.2 tabulate==0.10.0 nvidia-ml-py==13.615.71 \
  ninja==1.13.2 tqdm==4.70.1 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 \
  h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 \
  pytest-xdist==3.8.0 execnet==2.1.2
# py-spy's wheel is tagged manylinux1 only
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux1_x86_64 -d .whl \
  py-spy==0.4.3
# FlashInfer's newest release: its wheel (101 MB, deflate) exceeds the device call's 64 MiB carry, so it
# travels unpacked as one xz tarball (24 MB, the wheel's files and dist-info unchanged; a pure-Python
# wheel installs by unpacking), which gpu_run.sh unpacks into /tmp/site. Its other declared
# dependencies (cutlass-dsl, cuda-tile, nccl4py) are not imported by the FA3 prefill path.
FI=0.7.4
if [ ! -f ".whl/flashinfer_python-$FI.tar.xz" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download --no-deps --only-binary=:all: -d "$tmp" "flashinfer-python==$FI"
  mkdir "$tmp/x" && python3 -m zipfile -e "$tmp"/flashinfer_python-$FI-*.whl "$tmp/x"
  tar -C "$tmp/x" -cf - . | xz -9 -T0 >".whl/flashinfer_python-$FI.tar.xz.part"
  mv ".whl/flashinfer_python-$FI.tar.xz.part" ".whl/flashinfer_python-$FI.tar.xz"
  rm -rf "$tmp"
fi
rm -f .whl/flashinfer_python-*.whl  # FlashInfer travels as the tarball alone (a wheel beside it would be installed too)
ls -l .whl
