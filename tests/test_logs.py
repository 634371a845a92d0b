"""The log lines (``ctxprefill.service.logs``, docs/DEPLOY.md "Logs"): every line one JSON
object, whatever the message or its extra fields hold; the request id and the trace ids
of the call being handled; ``--log-level`` on every subcommand and
``CTXPREFILL_LOG_LEVEL``; a served process's whole output parsed line by line; a weights
error logged and exit 2 before anything listens; the model loader's progress lines."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ctxprefill import checkpoint
from ctxprefill.checkpoint_writer import TinyModel, write_model
from ctxprefill.cli import _log_level
from ctxprefill.config import ModelShape
from ctxprefill.service import tracing
from ctxprefill.service.logs import JsonFormatter, request_id_var, setup_logging
from ctxprefill.weights import random_kv_b_proj
from ctxprefill_client import CtxPrefillRpcError, PrefillContextClient, float32_to_bf16_bits
from service_process import ROOT, ServerProcess, env_with_sources


class _Opaque:
    def __str__(self) -> str:
        return 'opaque "thing"\nwith a newline'


def _lines(records: list[logging.LogRecord]) -> list[dict]:
    f = JsonFormatter()
    out = []
    for r in records:
        line = f.format(r)
        assert "\n" not in line, line  # one record, one line
        out.append(json.loads(line))
    return out


def _record(msg: str, *args: object, level: int = logging.INFO, exc: bool = False,
            **extra: object) -> logging.LogRecord:
    logger = logging.getLogger("ctxprefill.test")
    exc_info = None
    if exc:
        try:
            raise ValueError('bad "value"\nsecond line')
        except ValueError:
            exc_info = sys.exc_info()
    return logger.makeRecord(logger.name, level, __file__, 1, msg, args, exc_info, extra=extra)


def test_every_line_is_json_whatever_it_holds():
    records = [
        _record('a "quoted" message\nover two lines\twith a tab and a backslash \\ and ünïcode ✓'),
        _record("%s and %r", 'x"y', "z\nw"),
        _record("extras", level=logging.WARNING, path='C:\\dir "q"', n=3, ratio=0.5, flag=True, nothing=None,
                nested={"k": ['v"', 1]}, obj=_Opaque(), tensor_shape=torch.Size([2, 3])),
        _record("failed", level=logging.ERROR, exc=True),
    ]
    got = _lines(records)
    assert [g["msg"] for g in got[:2]] == [
        'a "quoted" message\nover two lines\twith a tab and a backslash \\ and ünïcode ✓', "x\"y and 'z\\nw'"]
    for g in got:
        assert list(g)[:4] == ["ts", "level", "logger", "msg"]
        assert g["ts"].endswith("+00:00") and g["logger"] == "ctxprefill.test"
    e = got[2]
    assert e["level"] == "WARNING" and e["path"] == 'C:\\dir "q"' and e["n"] == 3 and e["ratio"] == 0.5
    assert e["flag"] is True and e["nothing"] is None and e["nested"] == {"k": ['v"', 1]}
    assert e["obj"] == str(_Opaque()) and e["tensor_shape"] == [2, 3]
    assert got[3]["level"] == "ERROR" and 'ValueError: bad "value"\nsecond line' in got[3]["exc"]
    for g in got:
        assert "request_id" not in g and "trace_id" not in g


def test_request_id_and_trace_ids_of_the_call_being_handled():
    class Ctx:
        trace_id, span_id = 0x1234, 0xABC

    class Span:
        def get_span_context(self) -> Ctx:
            return Ctx()

    token = request_id_var.set('req "7"')
    rpc = tracing.rpc_var.set(tracing.RpcTrace(None, Span(), False))  # type: ignore[arg-type]
    try:
        g = _lines([_record("in a call")])[0]
    finally:
        tracing.rpc_var.reset(rpc)
        request_id_var.reset(token)
    assert g["request_id"] == 'req "7"'
    assert g["trace_id"] == f"{0x1234:032x}" and g["span_id"] == f"{0xABC:016x}"
    # a record's own request_id wins over the call's
    assert _lines([_record("own", request_id="mine")])[0]["request_id"] == "mine"


def test_setup_logging_sets_the_level_and_keeps_the_lifecycle_lines():
    root = logging.getLogger()
    saved = root.handlers[:], root.level, logging.getLogger("ctxprefill.lifecycle").level
    buf = io.StringIO()
    root.handlers[:] = [logging.StreamHandler(buf)]
    try:
        setup_logging("error")
        logging.getLogger("ctxprefill.service").warning("hidden")
        logging.getLogger("ctxprefill.lifecycle").info("shown")
        logging.getLogger("ctxprefill.lifecycle.model").info("shown too", extra={"done": 1})
        with pytest.raises(ValueError, match="--log-level 'loud'"):
            setup_logging("loud")
    finally:
        root.handlers[:], _, _ = saved
        root.setLevel(saved[1])
        logging.getLogger("ctxprefill.lifecycle").setLevel(saved[2])
    got = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [g["msg"] for g in got] == ["shown", "shown too"] and got[1]["done"] == 1


# ------------------------------------------------------------------------------ the command line


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ctxprefill.cli", *args], cwd=ROOT,
                          env={**env_with_sources(), **(env or {})}, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("where", ["before", "after", "env"])
def test_log_level_on_every_subcommand(tmp_path, monkeypatch, where):
    command = ["make-weights", "--out", str(tmp_path / "w.safetensors"), "--heads", "1"]
    args, env = command, None
    if where == "before":
        args = ["--log-level", "debug", *command]
    elif where == "after":
        args = [*command, "--log-level", "DEBUG"]
    else:
        env = {"CTXPREFILL_LOG_LEVEL": "Debug"}
    monkeypatch.delenv("CTXPREFILL_LOG_LEVEL", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    assert _log_level(args) == ("DEBUG", command)  # the level main() sets, and the command without the flag
    r = _cli(*args, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("wrote ")
    for line in r.stderr.splitlines():
        json.loads(line)


def test_a_bad_log_level_exits_2_naming_where_it_came_from():
    r = _cli("serve", "--log-level", "chatty")
    assert r.returncode == 2 and "--log-level 'chatty'" in r.stderr and "DEBUG, INFO" in r.stderr
    r = _cli("make-model", "/nonexistent", env={"CTXPREFILL_LOG_LEVEL": "chatty"})
    assert r.returncode == 2 and "CTXPREFILL_LOG_LEVEL 'chatty'" in r.stderr


def test_a_served_process_writes_only_json_lines():
    """...and its "serving" line says what runs: here --cuda-graphs asked for on the CPU,
    which runs every request eagerly and says why; a setting without effect (--k-scale on a
    bf16 cache) is a warning before anything listens."""
    proc = ServerProcess({"heads": 1, "block_size": 16, "num_blocks": 8, "workspace_tokens": 64,
                          "log_level": "DEBUG", "cuda_graphs": True, "k_scale": 2.0})
    try:
        proc.wait_ready()
        with PrefillContextClient(proc.target, retries=0, timeout=60) as c:
            q = float32_to_bf16_bits(np.ones((2, 1, 192), np.float32))
            c.prefill_context(q, [(2, 20, [3, 4])], request_id='id with "quotes"\nand a newline')
            with pytest.raises(CtxPrefillRpcError):
                c.prefill_context(q[:1], [(2, 20, [3, 4])], request_id="bad-1")
        assert proc.terminate(30) == 0
        out = proc.log()
    finally:
        proc.kill()
    lines = [json.loads(line) for line in out.splitlines()]  # every line, stdout and stderr
    msgs = [g["msg"] for g in lines]
    for m in ("weights loaded", "listening", "serving", "prefill done", "draining", "stopped"):
        assert m in msgs, (m, msgs)
    assert msgs.index("weights loaded") < msgs.index("listening") < msgs.index("serving")
    serving = next(g for g in lines if g["msg"] == "serving")
    assert serving["device"] == "cpu" and serving["cuda_graphs"] is False and serving["fused_kernels"] is False
    assert serving["kv_b_proj_gemm"] == "cublas"  # the default (--kv-b-proj-gemm)
    assert "need a CUDA device, got cpu" in serving["cuda_graphs_reason"]
    assert serving["mps_client"] is None  # a CPU server: no CUDA context to share
    ignored = next(g for g in lines if g["msg"] == "settings without effect")
    assert ignored["level"] == "WARNING" and msgs.index("settings without effect") < msgs.index("listening")
    assert ignored["settings"] == ["--k-scale (needs --cache-dtype fp8: fp8_ds_mla keeps a scale per tile)"]
    done = next(g for g in lines if g["msg"] == "prefill done")
    assert done["request_id"] == 'id with "quotes"\nand a newline' and done["chunks"] == 1
    assert any(g.get("request_id") == "bad-1" and "INVALID_ARGUMENT" in g["msg"] for g in lines)


def test_a_weights_error_exits_2_before_anything_listens(tmp_path):
    t = random_kv_b_proj(ModelShape(heads=1), "bf16", 0)
    t["kv_b_proj.weight"].view(torch.int16)[5, 6] = 0x7FC0  # NaN
    path = str(tmp_path / "w.safetensors")
    save_file(t, path)
    r = _cli("serve", "--device", "cpu", "--heads", "1", "--num-blocks", "8", "--block-size", "16",
             "--workspace-tokens", "64", "--port", "0", "--metrics-port", "0", "--weights", path,
             "--log-level", "INFO")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("ctxprefill: configuration error: ") and "NaN/Inf" in lines[-1], r.stderr
    for line in lines[:-1]:
        assert json.loads(line)["msg"] != "listening", r.stderr


@pytest.mark.parametrize("backend", ["triton", "cudnn"])
def test_a_named_backend_the_device_cannot_run_exits_2_before_anything_listens(backend):
    r = _cli("serve", "--device", "cpu", "--heads", "1", "--num-blocks", "8", "--block-size", "16",
             "--workspace-tokens", "64", "--port", "0", "--metrics-port", "0", "--backend", backend,
             "--log-level", "INFO")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith(f"ctxprefill: configuration error: --backend {backend}: attention backend "
                                f"'{backend}' is not available"), r.stderr
    assert "needs a CUDA device, got cpu" in lines[-1]
    for line in lines[:-1]:  # nothing bound, nothing loaded
        assert json.loads(line)["msg"] not in ("listening", "weights loaded"), r.stderr


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_in_use_exits_2_with_one_line_naming_the_flag(flag):
    """A port another process holds is a configuration error naming its flag (gRPC never
    shares a port: no SO_REUSEPORT), not a second listener or a traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        ports = {"--port": "0", "--metrics-port": "0", flag: port}
        r = _cli("serve", "--device", "cpu", "--heads", "1", "--num-blocks", "8", "--block-size", "16",
                 "--workspace-tokens", "64", "--host", "127.0.0.1", *[x for kv in ports.items() for x in kv])
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ctxprefill: configuration error: {flag} {port}: cannot bind"), r.stderr
    assert "Traceback" not in r.stderr


def test_the_model_loader_logs_its_progress(tmp_path, monkeypatch, caplog):
    write_model(str(tmp_path / "m"), TinyModel(layers=3, heads=2, shards=2))
    monkeypatch.setattr(checkpoint, "PROGRESS_EVERY_S", 0.0)  # a line at every step
    with caplog.at_level(logging.INFO, logger="ctxprefill.lifecycle.model"):
        checkpoint.load_model_kv_b_proj(str(tmp_path / "m"), 0, 3, 2)
    progress = [r for r in caplog.records if r.getMessage() == "loading model"]
    steps = [(r.step, r.done, r.of) for r in progress]  # type: ignore[attr-defined]
    files = [s for s in steps if s[0] == "reading shard files"]
    assert [s[1] for s in files] == list(range(1, len(files) + 1)) and files[-1][2] == len(files)
    assert [s[1:] for s in steps if s[0] == "preparing layers"] == [(1, 3), (2, 3), (3, 3)]
    assert all(r.percent <= 100 for r in progress)  # type: ignore[attr-defined]
    assert caplog.records[-1].getMessage() == "model loaded"
    monkeypatch.setattr(checkpoint, "PROGRESS_EVERY_S", 3600.0)  # a short load: no progress line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ctxprefill.lifecycle.model"):
        checkpoint.load_model_kv_b_proj(str(tmp_path / "m"), 0, 3, 2)
    assert [r.getMessage() for r in caplog.records] == ["model loaded"]
