"""Secure by default (docs/RELIABILITY.md, "Threat model", attack 6): with no credentials
both ports bind loopback only; any other address needs a bearer token over TLS or mutual
TLS, or an explicit ``--allow-insecure``; a token over plaintext beyond loopback is refused
too. Refusals exit with status 2 and one line naming the flags; a serving server states
its exposure in its "listening" log line.

Servers here bind 127.0.0.1 or 0.0.0.0; every byte the tests send goes to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ctxprefill.errors import ConfigError
from ctxprefill.service.exposure import check_exposure, describe_exposure, is_loopback
from ctxprefill.service.security import Security
from ctxprefill.settings import ServeSettings
from service_process import ROOT, ServerProcess, env_with_sources

FLAGS = {"heads": 1, "block_size": 16, "num_blocks": 8, "workspace_tokens": 64}
TOKEN = "tok-" + "5be0c7a1d2e3f4a5b6c7d8e9f0a1b2c3"

PLAIN = Security(None, None, "plaintext")
PLAIN_TOKEN = Security(None, TOKEN, "plaintext")
TLS = Security(None, None, "tls")
TLS_TOKEN = Security(None, TOKEN, "tls")
MTLS = Security(None, None, "mtls")


def test_defaults_are_loopback():
    s = ServeSettings()
    assert s.host == "127.0.0.1" and s.metrics_host == "" and s.allow_insecure is False
    e = check_exposure(s, PLAIN)
    assert e.grpc_loopback and e.http_loopback and not e.insecure
    assert describe_exposure(e, "127.0.0.1:50051", "127.0.0.1:9400").startswith("loopback only")


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False),
    ("192.168.0.1", False), ("fe80::1%lo", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


# (host, metrics_host, credentials, allow_insecure) -> refused with this in the message, or the exposure line
REFUSED = [
    ("0.0.0.0", "", PLAIN, "--host 0.0.0.0 listens beyond loopback with no credentials"),
    ("0.0.0.0", "", TLS, "--host 0.0.0.0 listens beyond loopback with no credentials"),
    ("::", "", PLAIN, "--host :: listens beyond loopback with no credentials"),
    ("0.0.0.0", "", PLAIN_TOKEN, "--host 0.0.0.0 sends the bearer token in plaintext"),
    ("127.0.0.1", "0.0.0.0", PLAIN, "--metrics-host 0.0.0.0 exposes the HTTP port beyond loopback"),
    ("127.0.0.1", "0.0.0.0", PLAIN_TOKEN, "--metrics-host 0.0.0.0 exposes the HTTP port beyond loopback"),
]
SERVING = [
    ("127.0.0.1", "", PLAIN, False, "loopback only: gRPC 127.0.0.1:50051 plaintext, no credentials; HTTP "
                                    "127.0.0.1:9400"),
    ("127.0.0.1", "", PLAIN_TOKEN, False, "loopback only: gRPC 127.0.0.1:50051 token over plaintext;"),
    ("0.0.0.0", "", TLS_TOKEN, False, "0.0.0.0:50051 token over TLS; HTTP 0.0.0.0:9400"),
    ("0.0.0.0", "127.0.0.1", MTLS, False, "0.0.0.0:50051 mTLS; HTTP 127.0.0.1:9400"),
    ("0.0.0.0", "", PLAIN, True, "INSECURE (--allow-insecure): 0.0.0.0:50051 plaintext, no credentials"),
    ("0.0.0.0", "", PLAIN_TOKEN, True, "INSECURE (--allow-insecure): 0.0.0.0:50051 token over plaintext"),
    ("127.0.0.1", "0.0.0.0", PLAIN, True, "INSECURE (--allow-insecure): 127.0.0.1:50051 plaintext"),
]


@pytest.mark.parametrize("host,metrics_host,sec,message", REFUSED)
def test_refused_without_allow_insecure(host, metrics_host, sec, message):
    s = ServeSettings(host=host, metrics_host=metrics_host)
    with pytest.raises(ConfigError) as e:
        check_exposure(s, sec)
    text = str(e.value)
    assert message in text and "--allow-insecure" in text and "\n" not in text, text


@pytest.mark.parametrize("host,metrics_host,sec,allow,line", SERVING)
def test_exposure_line(host, metrics_host, sec, allow, line):
    s = ServeSettings(host=host, metrics_host=metrics_host, allow_insecure=allow)
    e = check_exposure(s, sec)
    http_host = metrics_host or host
    text = describe_exposure(e, f"{host}:50051", f"{http_host}:9400")
    assert text.startswith(line), text
    assert e.insecure is text.startswith("INSECURE")


# ------------------------------------------------------------------------------ through `ctxprefill serve`


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ctxprefill.cli", "serve", "--device", "cpu", "--port", "0",
                           "--metrics-port", "0", *args], env={**env_with_sources(), **(env or {})}, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_serve_refuses_exposure_with_exit_2_and_one_line():
    r = _serve("--host", "0.0.0.0")
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("ctxprefill: configuration error: --host 0.0.0.0 listens beyond loopback with no "
                           "credentials") and line.endswith("--allow-insecure"), line
    r = _serve("--host", "0.0.0.0", env={"CTXPREFILL_AUTH_TOKEN": TOKEN})
    assert r.returncode == 2 and "sends the bearer token in plaintext" in r.stderr, r.stderr
    assert TOKEN not in r.stderr
    r = _serve("--metrics-host", "0.0.0.0")
    assert r.returncode == 2 and "--metrics-host 0.0.0.0" in r.stderr, r.stderr


def _listening(proc: ServerProcess) -> dict:
    for line in proc.log().splitlines():
        with_json = line[line.find("{"):]
        try:
            d = json.loads(with_json)
        except ValueError:
            continue
        if d.get("msg") == "listening":
            return d
    raise AssertionError(f"no 'listening' line:\n{proc.log()}")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    pytest.importorskip("cryptography", reason="the test certificates need 'cryptography' (pip install -e '.[test]')")
    from certs import issue, make_ca

    d = tmp_path_factory.mktemp("exposure-pki")
    ca = make_ca()
    cert, key = issue(ca, "ctxprefill", server=True).write(str(d), "server")
    ca_path = d / "ca.crt"
    ca_path.write_bytes(ca.cert_pem)
    token = d / "token"
    token.write_text(TOKEN + "\n")
    os.chmod(token, 0o600)
    return {"cert": cert, "key": key, "ca": str(ca_path), "token": str(token)}


def test_serving_states_its_exposure(pki):
    """Four servers at once: the default (loopback), 0.0.0.0 with a token over TLS,
    0.0.0.0 with mutual TLS, 0.0.0.0 plaintext with --allow-insecure (a warning)."""
    cases = {
        "loopback": ({}, "loopback only: gRPC 127.0.0.1:{port} plaintext, no credentials; HTTP 127.0.0.1:{mport}",
                     "INFO"),
        "token+tls": ({"host": "0.0.0.0", "auth_token_file": pki["token"], "tls_cert": pki["cert"],
                       "tls_key": pki["key"]}, "0.0.0.0:{port} token over TLS; HTTP 0.0.0.0:{mport}", "INFO"),
        "mtls": ({"host": "0.0.0.0", "tls_cert": pki["cert"], "tls_key": pki["key"], "tls_client_ca": pki["ca"]},
                 "0.0.0.0:{port} mTLS; HTTP 0.0.0.0:{mport}", "INFO"),
        "insecure": ({"host": "0.0.0.0", "allow_insecure": True},
                     "INSECURE (--allow-insecure): 0.0.0.0:{port} plaintext, no credentials", "WARNING"),
    }
    procs: dict[str, ServerProcess] = {}
    try:
        for name, (flags, _, _) in cases.items():
            procs[name] = ServerProcess({**FLAGS, **flags}, grace_seconds=2)
        for name, (_, want, level) in cases.items():
            p = procs[name]
            p.wait_ready(timeout=120)  # /readyz on 127.0.0.1
            d = _listening(p)
            assert d["exposure"].startswith(want.format(port=p.port, mport=p.metrics_port)), (name, d)
            assert d["level"] == level, (name, d)
    finally:
        for p in procs.values():
            p.terminate(10)
            p.kill()
