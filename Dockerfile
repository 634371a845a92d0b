# syntax=docker/dockerfile:1
# ctxprefill GPU image (see docs/DEPLOY.md).
#
#   docker build -t ctxprefill:0.1.0 .                          # sm_90a (H100/H200)
#   docker build --build-arg CUDA_ARCH="90a;100a" -t ctxprefill .  # + Blackwell
#   docker run --gpus 1 -p 50051:50051 -p 9400:9400 ctxprefill:0.1.0 --heads 16
#
# Stage 1 installs with scripts/install.sh (the script CI uses) into
# /opt/ctxprefill/.venv and compiles the CUDA extension ahead of time into
# /opt/ctxprefill/build, so that the server starts without nvcc. Stage 2 is the
# matching CUDA runtime image with that directory copied in, run as a non-root user.
# Arguments (build-args): CUDA_VERSION, UBUNTU, CUDA_ARCH, TORCH_SPEC, TORCH_INDEX.

ARG CUDA_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04

# ---------------------------------------------------------------------------- build
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ARG CUDA_ARCH=90a
# torch for CUDA 13.0 (the +cu130 build lives on PyTorch's index, not on PyPI)
ARG TORCH_SPEC=torch==2.11.0+cu130
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CTXPREFILL_BUILD_DIR=/opt/ctxprefill/build \
    CTXPREFILL_CUDA_ARCH=${CUDA_ARCH}

# python3-dev + g++ + ninja: torch.utils.cpp_extension builds csrc/ with them.
# DL3008 (apt versions not pinned): the base image tag pins the Ubuntu release; exact
# .deb versions vanish from the archive with each security update, breaking the build.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ninja-build \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/ctxprefill
COPY pyproject.toml README.md ./
COPY scripts/install.sh scripts/install.sh
COPY client client
COPY server server

# The pip cache mount keeps the torch wheel (GBs) across rebuilds; it is not in the image.
RUN --mount=type=cache,target=/root/.cache/pip \
    CTXPREFILL_TORCH_SPEC="${TORCH_SPEC}" PIP_EXTRA_INDEX_URL="${TORCH_INDEX}" bash scripts/install.sh

COPY csrc csrc
RUN .venv/bin/python -m ctxprefill.ops.build_ext --arch "${CUDA_ARCH}"

COPY deploy/healthcheck.py deploy/healthcheck.py
# bytecode now: the runtime root filesystem is read-only
RUN .venv/bin/python -m compileall -q server client deploy

# -------------------------------------------------------------------------- runtime
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime
ARG CUDA_ARCH=90a

LABEL org.opencontainers.image.title="ctxprefill" \
      org.opencontainers.image.description="Chunked-context MLA prefill attention over a paged latent cache, as a gRPC microservice" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV DEBIAN_FRONTEND=noninteractive
# python3: the venv's interpreter (same Ubuntu release as the build stage, so the same
# Python). gcc + python3-dev: Triton compiles its small C launcher stubs at run time.
# DL3008: as in the build stage.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home-dir /var/cache/ctxprefill --create-home \
            --shell /usr/sbin/nologin ctxprefill

COPY --from=build /opt/ctxprefill /opt/ctxprefill

# The extension is looked up by a hash of the sources, torch, Python and the target
# architectures: CTXPREFILL_CUDA_ARCH must be the list it was built for, and the build
# dir stays read-only. Writable state (Triton's kernel cache) goes to the user's home,
# /var/cache/ctxprefill (a volume / emptyDir in compose and Kubernetes).
ENV PATH=/opt/ctxprefill/.venv/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CTXPREFILL_BUILD_DIR=/opt/ctxprefill/build \
    CTXPREFILL_CUDA_ARCH=${CUDA_ARCH} \
    XDG_CACHE_HOME=/var/cache/ctxprefill \
    TRITON_HOME=/var/cache/ctxprefill \
    TRITON_CACHE_DIR=/var/cache/ctxprefill/triton

WORKDIR /opt/ctxprefill
USER 10001:10001
# gRPC, then HTTP /metrics /healthz /readyz
EXPOSE 50051 9400

# Readiness through grpc.health.v1 (engine built and warm, not draining). The start
# period covers weight loading and kernel warm-up (Triton compiles on first use).
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "/opt/ctxprefill/deploy/healthcheck.py"]

ENTRYPOINT ["ctxprefill", "serve"]
