"""Weights come only through safetensors; nothing in the shipped code unpickles
(CONTRACT §8): a grep of every tracked or new source file outside ``tests/`` for the ways
Python code deserializes pickles."""

from __future__ import annotations

import os
import re
import subprocess

from service_process import ROOT

_UNSAFE = [
    (re.compile(r"^\s*(import|from)\s+(pickle|cPickle|_pickle|dill|cloudpickle|joblib|shelve|marshal)\b", re.M),
     "imports a pickle-style deserializer"),
    (re.compile(r"\b(pickle|cPickle|_pickle|dill|cloudpickle|joblib|marshal)\.loads?\("), "unpickles"),
    (re.compile(r"\btorch\.(jit\.)?load\("), "torch.load unpickles"),
    (re.compile(r"\b(np|numpy)\.load\("), "numpy.load (may unpickle)"),
    (re.compile(r"allow_pickle\s*=\s*True"), "allow_pickle=True"),
    (re.compile(r"\bUnpickler\b"), "an Unpickler"),
]


def test_nothing_in_the_shipped_code_unpickles():
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    code = [f for f in files if f.endswith((".py", ".sh", ".pyx")) and not f.startswith("tests/")
            and os.path.isfile(os.path.join(ROOT, f))]
    assert any(f.startswith("server/") for f in code) and any(f.startswith("client/") for f in code)
    found = []
    for f in code:
        with open(os.path.join(ROOT, f), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        for pattern, why in _UNSAFE:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{f}:{line}: {why}: {m.group(0).strip()}")
    assert not found, "\n".join(found)
    # weights come through safetensors only
    with open(os.path.join(ROOT, "server/ctxprefill/weights.py")) as fh:
        assert "safetensors" in fh.read()
