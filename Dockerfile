# syntax=docker/dockerfile:1
# ctxprefill GPU image (see docs/DEPLOY.md).
#
#   docker build -t ctxprefill:0.1.0 .                          # sm_90a (H100/H200)
#   docker build --build-arg CUDA_ARCH="90a;100a" -t ctxprefill .  # + Blackwell
#   docker run --gpus 1 -p 50051:50051 -p 9400:9400 -v "$PWD/deploy/secrets:/run/secrets:ro" \
#     ctxprefill:0.1.0 --heads 16 --auth-token-file /run/secrets/token \
#     --tls-cert /run/secrets/tls.crt --tls-key /run/secrets/tls.key
#
# Everything Python comes from requirements/runtime.txt (hashes; torch 2.11.0 and its CUDA
# 13.0 wheels included), installed by scripts/install.sh, the script CI uses:
#   deps    CUDA devel image: the venv /opt/ctxprefill/.venv with the lock (a layer that
#           changes only with the lock);
#   build   + wheels of ./client and . installed non-editable under /opt/ctxprefill/app, and
#           the CUDA extension compiled ahead of time into /opt/ctxprefill/build (nvcc);
#   runtime plain Ubuntu with the same Python: torch's CUDA wheels bring the CUDA runtime
#           libraries (the extension's libcudart is theirs), the driver comes from the host.
#           No compiler toolchain but gcc (Triton's launcher stubs), no test tools, non-root.
# Build arguments: CUDA_VERSION, UBUNTU (the devel image), RUNTIME_IMAGE, CUDA_ARCH.

ARG CUDA_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04
# the devel image's Ubuntu release: the venv's interpreter is its /usr/bin/python3.12
ARG RUNTIME_IMAGE=ubuntu:24.04

# ----------------------------------------------------------------------------- deps
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS deps

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CTXPREFILL_APP_PREFIX=/opt/ctxprefill/app

# python3-dev + g++ + ninja: torch.utils.cpp_extension builds csrc/ with them.
# DL3008 (apt versions not pinned): the base image tag pins the Ubuntu release; exact
# .deb versions vanish from the archive with each security update, breaking the build.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ninja-build \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/ctxprefill
COPY requirements/runtime.txt requirements/runtime.txt
COPY scripts/install.sh scripts/install.sh
# The pip cache mount keeps the wheels (GBs) across rebuilds; it is not in the image.
RUN --mount=type=cache,target=/root/.cache/pip CTXPREFILL_INSTALL=runtime-deps bash scripts/install.sh

# ---------------------------------------------------------------------------- build
FROM deps AS build
ARG CUDA_ARCH=90a
ENV CTXPREFILL_BUILD_DIR=/opt/ctxprefill/build \
    CTXPREFILL_CSRC=/opt/ctxprefill/csrc \
    CTXPREFILL_CUDA_ARCH=${CUDA_ARCH}

COPY pyproject.toml README.md ./
COPY client client
COPY server server
COPY bench/ctxprefill_bench bench/ctxprefill_bench
RUN CTXPREFILL_INSTALL=runtime bash scripts/install.sh

COPY csrc csrc
RUN .venv/bin/python -m ctxprefill.ops.build_ext --arch "${CUDA_ARCH}"

# -------------------------------------------------------------------------- runtime
FROM ${RUNTIME_IMAGE} AS runtime
ARG CUDA_ARCH=90a

LABEL org.opencontainers.image.title="ctxprefill" \
      org.opencontainers.image.description="Chunked-context MLA prefill attention over a paged latent cache, as a gRPC microservice" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV DEBIAN_FRONTEND=noninteractive
# python3: the venv's interpreter. gcc + libc6-dev + python3-dev: Triton compiles its
# small C launcher stubs at run time. DL3008: as in the deps stage.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home-dir /var/cache/ctxprefill --create-home \
            --shell /usr/sbin/nologin ctxprefill

# Layers, largest and least often changed first: the locked dependencies (torch and the
# CUDA wheels), then ctxprefill itself, then the prebuilt extension and its sources.
COPY --from=deps /opt/ctxprefill/.venv /opt/ctxprefill/.venv
COPY --from=build /opt/ctxprefill/app /opt/ctxprefill/app
COPY --from=build /opt/ctxprefill/build /opt/ctxprefill/build
COPY csrc /opt/ctxprefill/csrc
COPY deploy/healthcheck.py /opt/ctxprefill/deploy/healthcheck.py

# NVIDIA_*: what the NVIDIA Container Toolkit reads to mount the driver (libcuda) into a
# container of a non-CUDA base image; a driver older than CUDA 13.0 is refused at start.
# /usr/local/nvidia: where some managed clusters mount the driver instead.
# The extension is looked up by a hash of the sources (CTXPREFILL_CSRC), torch, Python and
# the target architectures: CTXPREFILL_CUDA_ARCH must be the list it was built for, and the
# build dir stays read-only. Writable state (Triton's kernel cache) goes to the user's
# home, /var/cache/ctxprefill (a volume / emptyDir in compose and Kubernetes).
ENV PATH=/opt/ctxprefill/app/bin:/opt/ctxprefill/.venv/bin:/usr/local/nvidia/bin:${PATH} \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA="cuda>=13.0" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CTXPREFILL_BUILD_DIR=/opt/ctxprefill/build \
    CTXPREFILL_CSRC=/opt/ctxprefill/csrc \
    CTXPREFILL_CUDA_ARCH=${CUDA_ARCH} \
    XDG_CACHE_HOME=/var/cache/ctxprefill \
    TRITON_HOME=/var/cache/ctxprefill \
    TRITON_CACHE_DIR=/var/cache/ctxprefill/triton

WORKDIR /opt/ctxprefill
USER 10001:10001
# Every interface of the container: the server then starts only with a credential, a bearer
# token over TLS (above) or mutual TLS (--tls-client-ca); without one it exits with status 2
# and says so (docs/DEPLOY.md, "Credentials"). The metrics port follows --host.
ENV CTXPREFILL_HOST=0.0.0.0
# gRPC, then HTTP /metrics /healthz /readyz
EXPOSE 50051 9400

# Readiness through the HTTP port's /readyz (engine built and warm, not draining): it needs
# no credentials, whatever the gRPC port requires. The start period covers weight loading
# and kernel warm-up (Triton compiles on first use).
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "/opt/ctxprefill/deploy/healthcheck.py"]

ENTRYPOINT ["ctxprefill", "serve"]
