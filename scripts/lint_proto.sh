#!/usr/bin/env bash
# Lint the API with buf (STANDARD + COMMENTS rules, see proto/buf.yaml).
#
# buf comes from the npm registry (@bufbuild/buf, pinned below) and is installed
# once into a cache folder; set BUF=/path/to/buf to use another binary, or
# CTXPREFILL_TOOLS_DIR to move the cache. Exits non-zero on any lint finding.
set -euo pipefail

BUF_VERSION="${BUF_VERSION:-1.75.0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${CTXPREFILL_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ctxprefill-tools}"

if [[ -z "${BUF:-}" ]]; then
  prefix="$TOOLS/buf-$BUF_VERSION"
  BUF="$prefix/node_modules/.bin/buf"
  if [[ ! -x "$BUF" ]]; then
    command -v npm >/dev/null || { echo "lint_proto: npm not found (needed to install buf)" >&2; exit 2; }
    echo "lint_proto: installing @bufbuild/buf@$BUF_VERSION into $prefix" >&2
    mkdir -p "$prefix"
    # The package's postinstall only checks the platform binary; the binary itself
    # comes from the optional dependency @bufbuild/buf-<os>-<arch>.
    npm install --no-save --no-audit --no-fund --loglevel=error --prefix "$prefix" \
      "@bufbuild/buf@$BUF_VERSION" >&2
  fi
fi

echo "lint_proto: $("$BUF" --version 2>&1) lint proto/" >&2
cd "$ROOT/proto"
"$BUF" lint
"$BUF" build -o /dev/null
echo "lint_proto: ok" >&2
