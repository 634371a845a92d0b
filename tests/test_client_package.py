"""The client is its own distribution, ``ctxprefill-client`` (client/pyproject.toml):
``pip install ./client`` into a fresh venv gives ``ctxprefill_client`` and
``ctxprefill_api`` (typed: ``py.typed``, the generated ``.pyi``) with numpy, ml_dtypes, grpcio
and protobuf and without torch, and from that venv the example orchestrator checks a CPU
server's answers against its own float64 attention."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service_process import ROOT, ServerProcess

pytestmark = pytest.mark.slow  # a venv and a pip install: ~30-60 s

CLIENT = Path(ROOT) / "client"

PROBE = r"""
import importlib, importlib.util, json, os, pkgutil, sys
import ctxprefill_api, ctxprefill_client
mods = []
for pkg in (ctxprefill_api, ctxprefill_client):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
        mods.append(m.name)
api_dir = os.path.dirname(ctxprefill_api.__file__)
print(json.dumps({
    "files": [ctxprefill_api.__file__, ctxprefill_client.__file__],
    "modules": mods,
    "typed": [os.path.exists(os.path.join(os.path.dirname(p.__file__), "py.typed"))
              for p in (ctxprefill_api, ctxprefill_client)],
    "pyi": os.path.exists(os.path.join(api_dir, "ctxprefill", "v1", "ctxprefill_pb2.pyi")),
    "torch_loaded": "torch" in sys.modules,
    "findable": {n: importlib.util.find_spec(n) is not None for n in ("torch", "ctxprefill", "numpy", "grpc")},
}))
"""


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("client-package")
    # a copy: the build writes build/ and *.egg-info beside the sources
    src = tmp / "client"
    shutil.copytree(CLIENT, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"pip install ./client failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return venv


def _python(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "python"), *args], capture_output=True, text=True, timeout=300,
                          cwd=str(venv.parent))


def test_installed_packages_import_without_torch(client_venv: Path) -> None:
    r = _python(client_venv, "-c", PROBE)
    assert r.returncode == 0, r.stderr
    probe = json.loads(r.stdout)
    site = str(client_venv)
    assert all(f.startswith(site) for f in probe["files"]), probe["files"]  # the installed copy, not the repo's
    for name in ("ctxprefill_api.wire", "ctxprefill_api.ring", "ctxprefill_api.ctxprefill.v1.ctxprefill_pb2_grpc",
                 "ctxprefill_client.client", "ctxprefill_client.aio", "ctxprefill_client.shared_memory",
                 "ctxprefill_client.examples.orchestrator"):
        assert name in probe["modules"], name
    assert probe["typed"] == [True, True] and probe["pyi"]
    assert not probe["torch_loaded"]
    assert probe["findable"] == {"torch": False, "ctxprefill": False, "numpy": True, "grpc": True}


def test_pip_list_has_the_client_and_its_dependencies_not_torch(client_venv: Path) -> None:
    r = _python(client_venv, "-m", "pip", "list", "--format=json", "--disable-pip-version-check")
    assert r.returncode == 0, r.stderr
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(r.stdout)}
    assert installed.get("ctxprefill-client") == "0.1.0", installed
    assert {"numpy", "ml-dtypes", "grpcio", "protobuf"} <= set(installed), installed
    assert "torch" not in installed and "ctxprefill" not in installed, installed


def test_orchestrator_from_the_installed_client_against_a_cpu_server(client_venv: Path) -> None:
    weights = client_venv.parent / "weights.safetensors"
    r = _python(client_venv, "-m", "ctxprefill_client.examples.orchestrator", "--write-weights", str(weights),
                "--heads", "2")
    assert r.returncode == 0, r.stderr
    with ServerProcess({"weights": str(weights), "heads": 2, "block_size": 16, "num_blocks": 32,
                        "workspace_tokens": 128}) as srv:
        r = _python(client_venv, "-m", "ctxprefill_client.examples.orchestrator", "--target", srv.target,
                    "--weights", str(weights), "--context-lens", "200,48,0", "--query-lens", "8,4,5")
        assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{srv.log()[-3000:]}"
