"""Who may call: TLS, mutual TLS, the bearer token; what the metrics port exposes; and
(``test_no_unpickling.py``: that nothing in the shipped code unpickles).

Two real servers (certificates made here with ``cryptography``):
- ``tls``: ``--tls-cert/--tls-key`` and ``--auth-token-file``;
- ``mtls``: the same plus ``--tls-client-ca``, with the token from ``CTXPREFILL_AUTH_TOKEN``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

pytest.importorskip("cryptography", reason="the test certificates need the 'cryptography' package "
                                           "(pip install -e '.[test]')")
from certs import issue, make_ca  # noqa: E402
from ctxprefill.errors import ConfigError  # noqa: E402
from ctxprefill.service.interceptors import check_bearer  # noqa: E402
from ctxprefill.service.security import load_security, load_token  # noqa: E402
from ctxprefill.settings import ServeSettings  # noqa: E402
from ctxprefill_api import (
    pb,  # noqa: E402
    pb_grpc,  # noqa: E402
)
from ctxprefill_client import AsyncPrefillContextClient, CtxPrefillRpcError, PrefillContextClient  # noqa: E402
from service_process import ROOT, ServerProcess, http_get, sample_sum  # noqa: E402

SERVICE = "ctxprefill.v1.PrefillContextService"
FLAGS = {"heads": 1, "block_size": 16, "num_blocks": 8, "workspace_tokens": 64}
TOKEN = "tok-" + "3f9c1a7e5b2d4c6e8a0b1c2d3e4f5a6b"
MTLS_TOKEN = "env-" + "0123456789abcdef0123456789abcdef"


class PKI:
    def __init__(self, d: str):
        self.ca = make_ca()
        self.other_ca = make_ca("another CA")
        self.ca_path = os.path.join(d, "ca.crt")
        with open(self.ca_path, "wb") as f:
            f.write(self.ca.cert_pem)
        self.server_cert, self.server_key = issue(self.ca, "ctxprefill", server=True).write(d, "server")
        self.client = issue(self.ca, "orchestrator", server=False)
        self.foreign_client = issue(self.other_ca, "intruder", server=False)
        self.token_file = os.path.join(d, "token")
        with open(self.token_file, "w") as f:
            f.write(TOKEN + "\n")
        os.chmod(self.token_file, 0o600)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return PKI(str(tmp_path_factory.mktemp("pki")))


@pytest.fixture(scope="module")
def servers(pki):
    tls = ServerProcess({**FLAGS, "tls_cert": pki.server_cert, "tls_key": pki.server_key,
                         "auth_token_file": pki.token_file})
    mtls = ServerProcess({**FLAGS, "tls_cert": pki.server_cert, "tls_key": pki.server_key,
                          "tls_client_ca": pki.ca_path}, env={"CTXPREFILL_AUTH_TOKEN": MTLS_TOKEN})
    try:
        tls.wait_ready()
        mtls.wait_ready()
        yield {"tls": tls, "mtls": mtls}
    finally:
        for p in (tls, mtls):
            p.terminate(15)
            p.kill()


def _tls_channel(pki, target, client=None, root=None):
    creds = grpc.ssl_channel_credentials(root_certificates=root if root is not None else pki.ca.cert_pem,
                                         private_key=client.key_pem if client else None,
                                         certificate_chain=client.cert_pem if client else None)
    return grpc.secure_channel(target, creds)


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    except CtxPrefillRpcError as e:
        return e.code
    return grpc.StatusCode.OK


def _small_prefill(client):
    return client.prefill_context(np.ones((2, 1, 192), np.float32), [(2, 0, [])])


# ----------------------------------------------------------------------------- TLS


def test_tls_client_works(pki, servers):
    p = servers["tls"]
    with PrefillContextClient(p.target, root_certificates=pki.ca.cert_pem, token=TOKEN, retries=0) as c:
        assert c.server_info().num_heads == 1
        res = _small_prefill(c)
        assert res.output.shape == (2, 1, 128) and np.all(res.lse == -np.inf)
    # by file path, and checking the certificate against the name "localhost"
    with PrefillContextClient(f"localhost:{p.port}", root_certificates=pki.ca_path, tls_server_name="localhost",
                              token=TOKEN, retries=0) as c:
        assert c.server_info().instance_id

    async def aio():
        async with AsyncPrefillContextClient(p.target, root_certificates=pki.ca.cert_pem, token=TOKEN,
                                             retries=0) as c:
            return (await c.server_info()).num_heads

    assert asyncio.run(aio()) == 1


def test_plaintext_and_unverified_clients_cannot_connect(pki, servers):
    p = servers["tls"]
    with PrefillContextClient(p.target, token=TOKEN, retries=0, timeout=5) as c:  # plaintext
        assert _code(c.server_info) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(p.target) as ch:  # plaintext health check: no TLS, no answer either
        assert _code(lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)) == \
            grpc.StatusCode.UNAVAILABLE
    # TLS, but verifying the server against another CA
    with PrefillContextClient(p.target, root_certificates=pki.other_ca.cert_pem, token=TOKEN, retries=0,
                              timeout=5) as c:
        assert _code(c.server_info) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_from_the_ca(pki, servers):
    p = servers["mtls"]
    with PrefillContextClient(p.target, root_certificates=pki.ca.cert_pem, client_certificate=pki.client.cert_pem,
                              client_key=pki.client.key_pem, token=MTLS_TOKEN, retries=0) as c:
        assert c.server_info().num_heads == 1
        assert _small_prefill(c).output.shape == (2, 1, 128)
    with PrefillContextClient(p.target, root_certificates=pki.ca.cert_pem, token=MTLS_TOKEN, retries=0,
                              timeout=5) as c:  # no client certificate
        assert _code(c.server_info) == grpc.StatusCode.UNAVAILABLE
    with PrefillContextClient(p.target, root_certificates=pki.ca.cert_pem,
                              client_certificate=pki.foreign_client.cert_pem,
                              client_key=pki.foreign_client.key_pem, token=MTLS_TOKEN, retries=0,
                              timeout=5) as c:  # a certificate from another CA
        assert _code(c.server_info) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(p.target) as ch:
        stub = pb_grpc.PrefillContextServiceStub(ch)
        assert _code(lambda: stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
    # the token still counts on top of the certificate
    with _tls_channel(pki, p.target, client=pki.client) as ch:
        stub = pb_grpc.PrefillContextServiceStub(ch)
        assert _code(lambda: stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5, metadata=(
            ("authorization", f"Bearer {TOKEN}"),))) == grpc.StatusCode.PERMISSION_DENIED  # the other server's


# ----------------------------------------------------------------------------- the bearer token


def test_bearer_token(pki, servers):
    p = servers["tls"]
    with _tls_channel(pki, p.target) as ch:
        stub = pb_grpc.PrefillContextServiceStub(ch)

        def info(md=()):
            return _code(lambda: stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5, metadata=md))

        assert info() == grpc.StatusCode.UNAUTHENTICATED
        assert info((("authorization", "Basic " + TOKEN),)) == grpc.StatusCode.UNAUTHENTICATED
        assert info((("authorization", "Bearer"),)) == grpc.StatusCode.UNAUTHENTICATED
        assert info((("authorization", "Bearer " + TOKEN[:-1] + "x"),)) == grpc.StatusCode.PERMISSION_DENIED
        assert info((("authorization", "Bearer " + TOKEN + "x"),)) == grpc.StatusCode.PERMISSION_DENIED
        assert info((("authorization", "Bearer " + TOKEN),)) == grpc.StatusCode.OK
        assert info((("authorization", "bearer " + TOKEN),)) == grpc.StatusCode.OK  # the scheme is case-insensitive
        # every RPC needs it; a refused call's payload is not even parsed
        raw = ch.unary_unary(f"/{SERVICE}/PrefillContext")
        assert _code(lambda: raw(b"\xff\xff garbage", timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        for method in ("WriteCache", "ReadCache", "PrefillContext"):
            call = ch.unary_unary(f"/{SERVICE}/{method}")
            assert _code(lambda: call(b"", timeout=5)) == grpc.StatusCode.UNAUTHENTICATED, method  # noqa: B023
        # health answers without the token
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE):
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        # reflection needs it
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = [reflection_pb2.ServerReflectionRequest(list_services="")]
        assert _code(lambda: list(refl.ServerReflectionInfo(iter(req), timeout=5))) == \
            grpc.StatusCode.UNAUTHENTICATED
        names = {s.name for s in list(refl.ServerReflectionInfo(
            iter(req), timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),)))[0].list_services_response.service}
        assert SERVICE in names
    # the client's token= sends it
    with PrefillContextClient(p.target, root_certificates=pki.ca.cert_pem, token="wrong-" + TOKEN,
                              retries=0) as c:
        with pytest.raises(CtxPrefillRpcError) as ei:
            c.server_info()
        assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
    def counted() -> bool:  # a call's status reaches the client a moment before its metrics are recorded
        m = p.scrape()
        handled = m["grpc_server_handled_total"]
        return (sample_sum(handled, grpc_method="GetServerInfo", grpc_code="UNAUTHENTICATED") >= 3
                and sample_sum(handled, grpc_method="GetServerInfo", grpc_code="PERMISSION_DENIED") >= 3
                and sample_sum(m["ctxprefill_rejected_requests_total"], reason="unauthenticated") >= 7
                and sample_sum(m["ctxprefill_rejected_requests_total"], reason="permission_denied") >= 3)

    t_end = time.monotonic() + 10
    while not counted():
        assert time.monotonic() < t_end, "refusals not counted in the metrics"
        time.sleep(0.05)


def test_check_bearer_unit():
    tok = TOKEN.encode()
    assert check_bearer((("authorization", f"Bearer {TOKEN}"),), tok) is None
    assert check_bearer((("authorization", f"  Bearer   {TOKEN} "),), tok) is None
    assert check_bearer((), tok).code == grpc.StatusCode.UNAUTHENTICATED
    assert check_bearer((("x-other", "y"),), tok).code == grpc.StatusCode.UNAUTHENTICATED
    assert check_bearer((("authorization", "Bearer é"),), tok).code == grpc.StatusCode.PERMISSION_DENIED
    # two authorization headers: refused, whichever comes first
    two = (("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer x"))
    assert check_bearer(two, tok).code == grpc.StatusCode.PERMISSION_DENIED


# ----------------------------------------------------------------------------- configuration


def test_security_settings_are_checked_before_start(pki, tmp_path):
    def sec(**kw):
        return load_security(ServeSettings(**kw))

    assert sec().transport == "plaintext" and sec().token is None
    assert sec(tls_cert=pki.server_cert, tls_key=pki.server_key).transport == "tls"
    assert sec(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca_path).transport == "mtls"
    with pytest.raises(ConfigError, match="go together"):
        sec(tls_cert=pki.server_cert)
    with pytest.raises(ConfigError, match="needs --tls-cert"):
        sec(tls_client_ca=pki.ca_path)
    other_key = tmp_path / "other.key"
    other_key.write_bytes(pki.client.key_pem)
    with pytest.raises(ConfigError, match="matching key"):
        sec(tls_cert=pki.server_cert, tls_key=str(other_key))
    with pytest.raises(ConfigError, match="cannot read"):
        sec(tls_cert=str(tmp_path / "nope.crt"), tls_key=pki.server_key)
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="tls-client-ca"):
        sec(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=str(not_pem))
    # tokens
    assert load_token(pki.token_file, environ={}) == TOKEN
    assert load_token(None, environ={"CTXPREFILL_AUTH_TOKEN": MTLS_TOKEN}) == MTLS_TOKEN
    with pytest.raises(ConfigError, match="both"):
        load_token(pki.token_file, environ={"CTXPREFILL_AUTH_TOKEN": MTLS_TOKEN})
    with pytest.raises(ConfigError, match="at least 16"):
        load_token(None, environ={"CTXPREFILL_AUTH_TOKEN": "short"})
    with pytest.raises(ConfigError, match="printable ASCII"):
        load_token(None, environ={"CTXPREFILL_AUTH_TOKEN": "a token with spaces in it"})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        load_token(str(empty), environ={})


def test_serve_refuses_bad_security_settings(pki):
    """Through the command line: exit code 2 and the flag named, before binding anything."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "server"), os.path.join(ROOT, "client")])}
    r = subprocess.run([sys.executable, "-m", "ctxprefill.cli", "serve", "--device", "cpu", "--port", "0",
                        "--metrics-port", "0", "--tls-cert", pki.server_cert], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tls-cert and --tls-key" in r.stderr, r.stderr


# ----------------------------------------------------------------------------- the metrics port


def test_metrics_port_serves_only_its_three_paths(pki, servers):
    p = servers["tls"]
    url = p.metrics_url
    for path in ("/metrics", "/healthz", "/readyz"):
        assert http_get(url + path)[0] == 200, path
    for path in ("/", "/metrics/", "/metrics/x", "/debug/pprof", "/docs", "/openapi.json", "/v1/models",
                 f"/{SERVICE}/GetServerInfo", "/grpc.health.v1.Health/Check", "/../../etc/passwd", "/%2e%2e/x"):
        assert http_get(url + path)[0] == 404, path
    for method in ("POST", "PUT", "DELETE"):  # an RPC over HTTP/1.1 is refused too
        for path in (f"/{SERVICE}/GetServerInfo", "/metrics"):
            req = urllib.request.Request(url + path, data=b"\x00\x00\x00\x00\x00", method=method,
                                         headers={"content-type": "application/grpc"})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    status = r.status
            except urllib.error.HTTPError as e:
                status = e.code
            assert status in (404, 405), (method, path, status)
    # a gRPC client gets no service there: no RPC is reachable on the metrics port
    with grpc.insecure_channel(f"127.0.0.1:{p.metrics_port}") as ch:
        stub = pb_grpc.PrefillContextServiceStub(ch)
        code = _code(lambda: stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5))
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), code
        health = health_pb2_grpc.HealthStub(ch)
        assert _code(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5)) != grpc.StatusCode.OK
    # the page carries no request data: no request ids, no tokens
    page = http_get(url + "/metrics")[1]
    assert TOKEN not in page and "request_id" not in page
