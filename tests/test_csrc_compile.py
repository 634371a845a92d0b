"""The CUDA kernels compile for the H200 (sm_90a) on a machine without a GPU.

Every ``csrc/*.cu`` is compiled with nvcc (``-c``, the flags the extension build uses,
including torch.utils.cpp_extension's defaults) with all warnings as errors, and
ptxas must report no register spills in a file with kernels (a spill in a streaming
kernel costs bandwidth; graph_patch.cu is host code).
The torch binding cannot be compiled here (torch's CUDA build is on the GPU machine
only), but it is syntax-checked against this machine's torch headers where they
are present. Files are compiled in parallel: about 20 s on 2 cores.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
NVCC = shutil.which("nvcc")
ARCH = os.environ.get("CTXPREFILL_TEST_ARCH", "90a")
# what torch.utils.cpp_extension adds to every nvcc command, plus ours (ops/_cuda.py)
TORCH_DEFAULT_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
]
FLAGS = ["-O3", "-std=c++17", "-lineinfo", f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}",
         "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra", "-Xptxas", "-v"]
CU_FILES = sorted(CSRC.glob("*.cu"))

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: the CUDA compile check is skipped")


def _compile(src: Path, out_dir: Path) -> subprocess.CompletedProcess:
    cmd = [NVCC, *TORCH_DEFAULT_FLAGS, *FLAGS, "-I", str(CSRC), "-c", str(src), "-o", str(out_dir / (src.stem + ".o"))]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("csrc_build")
    with ThreadPoolExecutor(max_workers=max(2, min(len(CU_FILES), os.cpu_count() or 2))) as pool:
        results = list(pool.map(lambda s: _compile(s, out_dir), CU_FILES))
    return dict(zip([p.name for p in CU_FILES], results)), out_dir


def test_sources_exist():
    names = {p.name for p in CSRC.iterdir()}
    for want in ("common.cuh", "launchers.h", "pack.cu", "cache_ops.cu", "merge.cu", "binding.cpp"):
        assert want in names, f"csrc/{want} is missing"


def test_cuda_sources_do_not_include_torch():
    for p in [*CU_FILES, *CSRC.glob("*.cuh"), *CSRC.glob("*.h")]:
        text = p.read_text()
        assert not re.search(r"#\s*include\s*[<\"](torch|ATen|c10)/", text), f"{p.name} includes a torch header"


@needs_nvcc
@pytest.mark.parametrize("name", [p.name for p in CU_FILES])
def test_cu_compiles_for_sm90a(compiled, name):
    results, out_dir = compiled
    r = results[name]
    log = r.stdout + r.stderr
    assert r.returncode == 0, f"nvcc failed on {name}:\n{log[-6000:]}"
    assert (out_dir / name.replace(".cu", ".o")).stat().st_size > 0
    warnings = [ln for ln in log.splitlines() if "warning" in ln.lower()]
    assert not warnings, f"{name}: compiler warnings:\n" + "\n".join(warnings)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if "__global__" not in (CSRC / name).read_text():  # host code only (graph_patch.cu): no kernel to report
        assert not spills
        return
    assert spills, f"{name}: no ptxas report in the output (-Xptxas -v)"
    bad = [s for s in spills if s != ("0", "0")]
    assert not bad, f"{name}: register spills in {len(bad)} kernel(s): {bad}\n{log[-4000:]}"


def _torch_include_dirs() -> list[str] | None:
    try:
        from torch.utils import cpp_extension

        return cpp_extension.include_paths()
    except Exception:  # pragma: no cover
        return None


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH: binding syntax check skipped")
def test_binding_syntax(tmp_path):
    """g++ -fsyntax-only of csrc/binding.cpp against this machine's torch headers.

    A CPU build of torch ships c10/cuda's headers except the CMake-generated
    ``c10/cuda/impl/cuda_cmake_macros.h``: a one-line stand-in is provided for it.
    """
    inc = _torch_include_dirs()
    cuda_inc = None
    for cand in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if cand and (Path(cand) / "include" / "cuda_runtime.h").is_file():
            cuda_inc = str(Path(cand) / "include")
            break
    if not inc or not any((Path(i) / "c10" / "cuda" / "CUDAGuard.h").is_file() for i in inc):
        pytest.skip("torch's c10/cuda headers are not installed here: binding syntax check skipped")
    if cuda_inc is None:
        pytest.skip("no CUDA toolkit headers (cuda_runtime.h) here: binding syntax check skipped")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-DTORCH_EXTENSION_NAME=ctxprefill_check",
           "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{CSRC}"]
    for d in [*inc, sysconfig.get_paths()["include"], cuda_inc]:
        cmd += ["-isystem", d]
    cmd += ["-isystem", str(tmp_path), str(CSRC / "binding.cpp")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"binding.cpp does not compile:\n{r.stderr[-6000:]}"
    assert "warning" not in r.stderr, f"binding.cpp warnings:\n{r.stderr[-4000:]}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-rs"]))
