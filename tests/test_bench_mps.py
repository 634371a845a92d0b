"""bench/ctxprefill_bench/mps.py against a stand-in control binary: the daemon gets private
pipe and log directories, named to its clients and not in this process's environment, and it
is told to quit through them; bench_model_workload refuses --mps where MPS is missing, runs
--mps as a client child of a process outside the daemon, and its --mps-ab runs itself
without and with --mps in turn into one JSON."""

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
        # the owner is no client: its quit would wait for the owner itself to exit
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
        assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == "/somewhere/else"
        assert os.path.exists(os.path.join(pipe, "control")) and os.path.isdir(logdir)
        assert os.path.commonpath([pipe, logdir]).rsplit(os.sep, 1)[-1].startswith("ctxprefill-mps-")
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


def test_a_daemon_that_does_not_quit_is_reported_not_waited_for(fake_control, tmp_path, capsys):
    # quit waits while a client runs (here: forever); the owner gives up after its timeout, saying so
    (tmp_path / "bin" / mps.CONTROL).write_text(FAKE.replace('echo "cmd', 'sleep 30; echo "cmd'))
    with mps.mps_daemon(quit_timeout_s=0.3):
        pass
    assert "did not quit within 0.3 s" in capsys.readouterr().err


def _workload_module():
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_model_workload",
                                                  os.path.join(root, "bench", "bench_model_workload.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_workload_refuses_mps_where_it_is_missing(monkeypatch, tmp_path, capsys):
    mod = _workload_module()
    monkeypatch.setenv("PATH", str(tmp_path))  # no control binary
    with pytest.raises(SystemExit) as e:
        mod.main(["--device", "cpu", "--mps", "--out", str(tmp_path / "w.json")])
    assert e.value.code == 2 and "--mps" in capsys.readouterr().err
    assert not (tmp_path / "w.json").exists()


def test_workload_mps_runs_its_caller_as_a_child_inside_the_daemon(fake_control, monkeypatch, tmp_path):
    """--mps: this process starts the daemon and stays out of it; the run is a child with the
    same arguments and --mps-client, the daemon named in the child's environment only, and
    the daemon is told to quit once the child has exited."""
    import subprocess
    import sys

    mod = _workload_module()
    real_run, children = subprocess.run, []

    def run(cmd, *args, env=None, **kw):
        if cmd[0] != sys.executable:  # the control binary
            return real_run(cmd, *args, env=env, **kw)
        children.append(cmd)
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        assert os.path.exists(os.path.join(pipe, "control")) and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
        assert fake_control.read_text().count("cmd quit") == 0  # the daemon runs while the child does
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(subprocess, "run", run)
    argv = ["--device", "cpu", "--mps", "--layers", "2", "--out", str(tmp_path / "w.json")]
    assert mod.main(argv) == 3  # the child's exit code
    assert len(children) == 1 and children[0][2:] == [*argv, "--mps-client"]
    assert fake_control.read_text().splitlines()[-1].startswith("cmd quit")


def test_mps_ab_runs_without_and_with_mps_in_turn_into_one_json(fake_control, monkeypatch, tmp_path):
    """--mps-ab 2: four child runs, off/on/off/on, each the same arguments less --mps-ab and
    --out (--mps added to the second of each round), their runs labelled in one JSON that
    the results table shows with an MPS column."""
    import json
    import subprocess

    import make_tables

    mod = _workload_module()
    calls = []

    def fake_run(cmd, check=False):
        calls.append(cmd)
        out = cmd[cmd.index("--out") + 1]
        on = "--mps" in cmd
        run = {"heads": 2, "order": "host", "layers": 2, "chunks": 2, "calls": 4, "wall_s": 2.0 if on else 3.0,
               "server_compute_s": 1.0, "floor_s": 1.0, "ratio": 2.0 if on else 3.0, "ratio_held": 1.5,
               "context_tokens_per_s": 1e6, "floor_context_tokens_per_s": 2e6, "checks": [], "calls_s": 2.0,
               "server_total_s": 1.5, "server_phase_s": {"validate": 0.1, "compute": 1.0},
               "stage_s": {"attention": 0.5}, "rows": [], "server": {"prefill_dtype": "bf16", "cache_dtype": "auto"}}
        with open(out, "w") as f:
            json.dump({"meta": {"kind": "model_workload", "date": "2026-12-05T00:00:00+00:00", "commit": "abc1234",
                                "gpu": "NVIDIA H200", "torch": "2", "shared_memory": "cuda",
                                "args": {"new": 32, "chunk": 16, "max_context": 96, "cache_write": "with-prefill",
                                         "sustained_gemm_s": 2.0, "mps": on}}, "runs": [run]}, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(mod.subprocess, "run", fake_run)
    out = tmp_path / "ab.json"
    assert mod.main(["--device", "cpu", "--layers", "2", "--mps-ab", "2", f"--out={out}", "--heads", "2"]) == 0
    assert [("--mps" in c) for c in calls] == [False, True, False, True]
    for c in calls:
        assert c[2:c.index("--out")] in (["--device", "cpu", "--layers", "2", "--heads", "2"],
                                         ["--device", "cpu", "--layers", "2", "--heads", "2", "--mps"])
        assert "--mps-ab" not in c and str(out) not in " ".join(c)
    d = json.loads(out.read_text())
    assert [(r["mps"], r["round"], r["wall_s"]) for r in d["runs"]] == [(False, 1, 3.0), (True, 1, 2.0),
                                                                         (False, 2, 3.0), (True, 2, 2.0)]
    assert d["meta"]["args"]["mps_ab"] == 2 and d["meta"]["args"]["mps"] is None
    table = make_tables.model_workload_table(d)
    assert "| 2 | bf16 | host | off (1) | 2 | 2 | 4 | 3.000 |" in table
    assert "| 2 | bf16 | host | on (2) | 500.000 |" in table  # per call: the caller's 2 s over 4 calls
    assert "`--mps-ab 2`" in table


def test_mps_ab_wants_out_and_no_mps(fake_control, tmp_path, capsys):
    mod = _workload_module()
    for argv in (["--mps-ab", "1"], ["--mps-ab", "1", "--mps", "--out", str(tmp_path / "x.json")]):
        with pytest.raises(SystemExit) as e:
            mod.main(["--device", "cpu", *argv])
        assert e.value.code == 2 and "--mps-ab" in capsys.readouterr().err
