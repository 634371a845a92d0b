"""Who may call: TLS on the gRPC port, optional mutual TLS, an optional bearer token.

- ``--tls-cert`` + ``--tls-key``: the gRPC port speaks TLS only (a plaintext client
  cannot connect).
- ``--tls-client-ca``: mutual TLS — a client must present a certificate that chains to
  this CA bundle, or the handshake fails.
- ``--auth-token-file PATH`` (or the token itself in ``CTXPREFILL_AUTH_TOKEN``, which
  keeps it off the command line): every RPC must carry ``authorization: Bearer
  <token>`` — missing is UNAUTHENTICATED, wrong is PERMISSION_DENIED, compared in
  constant time (``interceptors.check_bearer``). ``grpc.health.v1.Health`` answers
  without it (probes carry no credentials); reflection needs it.

Everything is read and checked once, before any port is bound: a certificate that does
not match its key, an unreadable file or an empty token refuses to start
(ConfigError naming the flag). The HTTP port (/metrics, /healthz, /readyz) is neither
TLS nor token protected: it exposes no RPC and no request data; keep it on a
network only the scraper reaches.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import ssl
import stat

import grpc

from ..errors import ConfigError

log = logging.getLogger("ctxprefill.lifecycle")

TOKEN_ENV = "CTXPREFILL_AUTH_TOKEN"
MIN_TOKEN_CHARS = 16


@dataclasses.dataclass(frozen=True)
class Security:
    credentials: grpc.ServerCredentials | None  # None: plaintext gRPC port
    token: str | None  # None: no bearer token required
    transport: str  # "plaintext" | "tls" | "mtls"

    @property
    def token_source(self) -> str:
        return "none" if self.token is None else "set"


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"--{flag} {path!r}: cannot read: {e.strerror or e}") from None
    if not data.strip():
        raise ConfigError(f"--{flag} {path!r}: the file is empty")
    return data


def _check_token(token: str, source: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{source}: the bearer token must have at least {MIN_TOKEN_CHARS} characters")
    if any(not (0x21 <= ord(ch) <= 0x7E) for ch in token):
        raise ConfigError(f"{source}: the bearer token must be printable ASCII without spaces "
                          f"(it travels in gRPC metadata)")
    return token


def load_token(token_file: str | None, environ=os.environ) -> str | None:
    env = environ.get(TOKEN_ENV)
    if token_file and env is not None:
        raise ConfigError(f"both --auth-token-file and {TOKEN_ENV} are set; set one")
    if token_file:
        raw = _read(token_file, "auth-token-file")
        try:
            mode = os.stat(token_file).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                log.warning("the token file is readable by other users; chmod 600 it",
                            extra={"auth_token_file": token_file})
        except OSError:  # pragma: no cover - it was just read
            pass
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            raise ConfigError("--auth-token-file: the token must be printable ASCII") from None
        return _check_token(text, "--auth-token-file")
    if env is not None:
        return _check_token(env, TOKEN_ENV)
    return None


def load_security(s) -> Security:
    """The gRPC port's credentials and the bearer token of settings ``s`` (checked)."""
    if bool(s.tls_cert) != bool(s.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together: set both or neither")
    if s.tls_client_ca and not s.tls_cert:
        raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    creds, transport = None, "plaintext"
    if s.tls_cert:
        cert, key = _read(s.tls_cert, "tls-cert"), _read(s.tls_key, "tls-key")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # parse and match them now, not at the first handshake
        try:
            ctx.load_cert_chain(s.tls_cert, s.tls_key)
        except (ssl.SSLError, ValueError) as e:
            raise ConfigError(f"--tls-cert/--tls-key: not a PEM certificate and its matching key: {e}") from None
        ca = None
        if s.tls_client_ca:
            ca = _read(s.tls_client_ca, "tls-client-ca")
            try:
                ctx.load_verify_locations(cafile=s.tls_client_ca)
            except (ssl.SSLError, ValueError) as e:
                raise ConfigError(f"--tls-client-ca: not a PEM CA bundle: {e}") from None
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
        transport = "mtls" if ca is not None else "tls"
    return Security(creds, load_token(s.auth_token_file), transport)
