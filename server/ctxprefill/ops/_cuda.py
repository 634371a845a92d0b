"""Loads the compiled CUDA extension (``csrc/``), or says why it cannot.

``load()`` returns the extension module or None; it never raises, caches its answer
for the process, and records the reason for a None in ``why_not()``: extension
disabled by ``CTXPREFILL_DISABLE_CUDA_EXT=1``, no CUDA device, torch built without
CUDA, no nvcc, or a failed build (with the path of the build log).

Build. Just in time with ``torch.utils.cpp_extension.load`` (ninja), into a
persistent directory ``$CTXPREFILL_BUILD_DIR/ext-<hash>`` (default root
``~/.cache/ctxprefill``), where the hash covers the sources in ``csrc/``, the torch
and CUDA versions, the Python version, the target architectures and the flags. A
directory that already holds the built library is imported directly — no ninja, no
nvcc — so an image built ahead of time (``python -m ctxprefill.ops.build_ext``, which
uses this same function and directory) starts instantly. Flags: ``-O3`` and
``-gencode=arch=compute_<a>,code=sm_<a>`` for each architecture in
``$CTXPREFILL_CUDA_ARCH`` (e.g. ``90a`` or ``90a;100a``; default derived from the
device: capability 9.0 -> ``90a``). No fast math: the merge kernel must match torch's
``exp``/``log`` bit for bit.

Sources: ``$CTXPREFILL_CSRC`` or the repository's ``csrc/`` next to ``server/``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("ctxprefill.ops.cuda")

_lock = threading.Lock()
_state: dict = {"done": False, "module": None, "why": "not loaded yet"}

_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")
_STALE_LOCK_S = 15 * 60
EXTRA_CFLAGS = ["-O3"]
EXTRA_CUDA_CFLAGS = ["-O3", "-lineinfo"]  # the C++ standard: torch.utils.cpp_extension's


# ---- configuration -------------------------------------------------------------------


def csrc_dir() -> Path:
    env = os.environ.get("CTXPREFILL_CSRC")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "csrc"


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _SOURCE_SUFFIXES)


def _normalize_arch(a: str) -> str:
    a = a.strip().lower()
    for prefix in ("sm_", "compute_"):
        if a.startswith(prefix):
            a = a[len(prefix):]
    return a.replace(".", "")


def arch_list(arch: str | None = None) -> list[str]:
    """Target architectures, e.g. ``["90a"]``: from ``arch``, ``$CTXPREFILL_CUDA_ARCH``,
    or the current device (capability >= 9 gets the ``a`` variant: wgmma, setmaxnreg)."""
    spec = arch or os.environ.get("CTXPREFILL_CUDA_ARCH", "")
    if spec.strip():
        out = [_normalize_arch(a) for a in spec.replace(",", ";").replace(" ", ";").split(";") if a.strip()]
        bad = [a for a in out if not (a[:-1] if a.endswith("a") else a).isdigit()]
        if bad:
            raise ValueError(f"CUDA arch {bad} not understood (expected e.g. 90a, 9.0, sm_90a)")
        return out
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device to derive the architecture from; pass --arch (e.g. 90a) "
                           "or set CTXPREFILL_CUDA_ARCH")
    major, minor = torch.cuda.get_device_capability()
    return [f"{major}{minor}a" if major >= 9 else f"{major}{minor}"]


def gencode_flags(archs: list[str]) -> list[str]:
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def build_hash(archs: list[str], root: Path | None = None) -> str:
    root = root or csrc_dir()
    h = hashlib.sha256()
    for p in _sources(root):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    meta = [torch.__version__, str(torch.version.cuda), f"py{sys.version_info[0]}.{sys.version_info[1]}",
            ";".join(archs), " ".join(EXTRA_CFLAGS), " ".join(EXTRA_CUDA_CFLAGS)]
    h.update("\0".join(meta).encode())
    return h.hexdigest()[:16]


def build_dir(archs: list[str]) -> Path:
    root = os.environ.get("CTXPREFILL_BUILD_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ctxprefill")
    return Path(root) / f"ext-{build_hash(archs)}"


def module_name(archs: list[str]) -> str:
    return f"ctxprefill_cuda_{build_hash(archs)}"


def _progress(msg: str) -> None:
    """A visible progress line: through logging when it is configured, else stderr."""
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        logger.info(msg)
    else:
        print(f"[ctxprefill] {msg}", file=sys.stderr, flush=True)


# ---- building and importing --------------------------------------------------------------


def _import_so(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(arch: str | None = None, verbose: bool = False):
    """Build (or find) the extension; returns ``(module, build directory)``. Raises on
    failure, with the build log written to ``<build dir>/build.log``."""
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is built without CUDA: the extension cannot be built")
    archs = arch_list(arch)
    root = csrc_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"CUDA sources not found at {root} (set CTXPREFILL_CSRC)")
    name = module_name(archs)
    bdir = build_dir(archs)
    so = bdir / f"{name}.so"
    if so.is_file():
        return _import_so(name, so), bdir
    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("nvcc not found: torch.utils.cpp_extension found no CUDA_HOME "
                           "(set CUDA_HOME or put nvcc on PATH)")
    bdir.mkdir(parents=True, exist_ok=True)
    lock = bdir / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        _progress(f"removing a stale build lock {lock} (a build that died?)")
        lock.unlink(missing_ok=True)
    sources = [str(p) for p in _sources(root) if p.suffix in (".cu", ".cpp")]
    _progress(f"building CUDA extension (first use, ~60 s) for sm_{','.join(archs)} into {bdir} …")
    t0 = time.time()
    log = bdir / "build.log"
    try:
        mod = cpp_extension.load(
            name=name,
            sources=sources,
            extra_cflags=EXTRA_CFLAGS,
            extra_cuda_cflags=EXTRA_CUDA_CFLAGS + gencode_flags(archs),
            extra_include_paths=[str(root)],
            build_directory=str(bdir),
            verbose=verbose,
        )
    except Exception as e:  # noqa: BLE001 - the compiler output is in the message
        log.write_text(f"{type(e).__name__}: {e}\n")
        raise RuntimeError(f"building the CUDA extension failed after {time.time() - t0:.0f} s; log: {log}") from e
    log.write_text(f"built {name} for {archs} in {time.time() - t0:.1f} s\n")
    _progress(f"built CUDA extension in {time.time() - t0:.1f} s")
    return mod, bdir


def load() -> ModuleType | None:
    """The extension module, or None (see ``why_not()``). Cached; never raises."""
    if _state["done"]:
        return _state["module"]
    with _lock:
        if _state["done"]:
            return _state["module"]
        mod, why = None, ""
        try:
            if os.environ.get("CTXPREFILL_DISABLE_CUDA_EXT", "") not in ("", "0"):
                why = "disabled by CTXPREFILL_DISABLE_CUDA_EXT"
            elif torch.version.cuda is None:
                why = f"torch {torch.__version__} is built without CUDA"
            elif not torch.cuda.is_available():
                why = "no CUDA device (torch.cuda.is_available() is False)"
            else:
                mod, _ = build()
        except Exception as e:  # noqa: BLE001 - load() never raises
            mod, why = None, f"{e}" + (f" ({e.__cause__.__class__.__name__})" if e.__cause__ else "")
            logger.error("ctxprefill CUDA extension unavailable: %s", why)
        _state.update(done=True, module=mod, why=why if mod is None else "")
        return mod


def why_not() -> str:
    """Why ``load()`` returned None ('' when it did not, or has not been called)."""
    return _state["why"] if _state["done"] else "not loaded yet"


def use_cuda(t: torch.Tensor) -> bool:
    """Whether the op on tensor ``t`` should run the compiled kernel."""
    return t.is_cuda and load() is not None


def _reset_for_tests() -> None:
    with _lock:
        _state.update(done=False, module=None, why="not loaded yet")
