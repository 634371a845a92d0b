"""bench/ctxprefill_bench/mps.py against a stand-in control binary: the daemon gets private
pipe and log directories, this process's environment names them only while it runs, and it
is told to quit through them; bench_model_workload refuses --mps where MPS is missing."""

import os
import stat

import pytest

from ctxprefill_bench import mps

FAKE = """#!/bin/sh
# a stand-in for nvidia-cuda-mps-control: -d "starts" (makes the control pipe), stdin is logged
if [ "$1" = "-d" ]; then
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; echo "start $CUDA_MPS_LOG_DIRECTORY" >>"$LOG"; exit 0
fi
echo "cmd $(cat) $CUDA_MPS_PIPE_DIRECTORY" >>"$LOG"
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    binary = tmp_path / "bin" / mps.CONTROL
    binary.parent.mkdir()
    binary.write_text(FAKE)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LOG", str(log))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", "/somewhere/else")
    return log


def test_private_daemon_started_named_and_quit(fake_control):
    assert mps.available()
    with mps.mps_daemon() as env:
        pipe, logdir = env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"]
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == pipe and os.environ["CUDA_MPS_LOG_DIRECTORY"] == logdir
        assert os.path.exists(os.path.join(pipe, "control")) and os.path.isdir(logdir)
        assert os.path.commonpath([pipe, logdir]).rsplit(os.sep, 1)[-1].startswith("ctxprefill-mps-")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ  # restored: unset before
    assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == "/somewhere/else"  # restored: set before
    assert not os.path.exists(pipe)  # its directory removed
    assert fake_control.read_text().splitlines() == [f"start {logdir}", f"cmd quit {pipe}"]


def test_daemon_without_a_control_pipe_is_an_error(fake_control, tmp_path):
    # -d succeeds but no pipe appears: an error, and the daemon is still told to quit
    (tmp_path / "bin" / mps.CONTROL).write_text('#!/bin/sh\n[ "$1" = "-d" ] && exit 0\necho "cmd $(cat)" >>"$LOG"\n')
    with pytest.raises(RuntimeError, match="no control pipe"):
        with mps.mps_daemon(start_timeout_s=0.2):
            pass
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert fake_control.read_text().splitlines() == ["cmd quit"]


def test_workload_refuses_mps_where_it_is_missing(monkeypatch, tmp_path, capsys):
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_model_workload",
                                                  os.path.join(root, "bench", "bench_model_workload.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("PATH", str(tmp_path))  # no control binary
    with pytest.raises(SystemExit) as e:
        mod.main(["--device", "cpu", "--mps", "--out", str(tmp_path / "w.json")])
    assert e.value.code == 2 and "--mps" in capsys.readouterr().err
    assert not (tmp_path / "w.json").exists()
