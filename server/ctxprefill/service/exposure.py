"""Who can reach the server, decided before anything is bound (docs/RELIABILITY.md, "Threat model").

Secure by default: with no credentials both ports bind loopback only (``--host`` and
``--metrics-host`` default to 127.0.0.1). Listening on any other address needs a
credential on the gRPC port — mutual TLS (``--tls-client-ca``) or a bearer token over
TLS (``--auth-token-file`` with ``--tls-cert``/``--tls-key``) — or an explicit
``--allow-insecure``. A token over plaintext on a non-loopback address is refused too
(anyone on the path reads it). Without a credential the gRPC port lets whoever reaches
it read and overwrite every cache slot; the HTTP port (metrics, health) has no
credentials of its own and is read-only.

:func:`check_exposure` refuses (ConfigError, exit 2) what needs ``--allow-insecure``;
:func:`describe_exposure` is the one-line ``exposure`` field of the "listening" log line.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from typing import Protocol

from ..errors import ConfigError
from ..settings import ServeSettings


class _Credentials(Protocol):  # service.security.Security
    @property
    def token(self) -> str | None: ...
    @property
    def transport(self) -> str: ...


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) binds loopback only: 127.0.0.0/8, ::1,
    ``localhost``, or a name all of whose addresses are loopback. ``0.0.0.0``, ``::``
    and ``""`` are every interface."""
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return is_loopback_address(h)
    except ValueError:
        pass
    if not h:
        return False
    try:
        infos = socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(is_loopback_address(str(i[4][0])) for i in infos)


def is_loopback_address(text: str) -> bool:
    """Whether an IP address (a zone after ``%`` ignored; IPv4-mapped IPv6 as its IPv4) is
    loopback; ValueError for text that is no address."""
    addr = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def metrics_host(s: ServeSettings) -> str:
    """The HTTP port's address: ``--metrics-host``, else ``--host``."""
    return s.metrics_host or s.host


@dataclasses.dataclass(frozen=True)
class Exposure:
    grpc_loopback: bool
    http_loopback: bool
    credential: str  # what a gRPC caller must present, in words
    credentialed: bool  # mutual TLS, or a token over TLS
    insecure: bool  # beyond loopback without a credential: allowed by --allow-insecure only


def credential_words(security: _Credentials) -> str:
    token = security.token is not None
    return {("mtls", True): "mTLS + token", ("mtls", False): "mTLS", ("tls", True): "token over TLS",
            ("tls", False): "TLS, no client credentials", ("plaintext", True): "token over plaintext",
            }.get((security.transport, token), "plaintext, no credentials")


def check_exposure(s: ServeSettings, security: _Credentials) -> Exposure:
    """The exposure of settings ``s`` with credentials ``security``; ConfigError (one line,
    naming the flags) for a non-loopback bind that needs ``--allow-insecure`` and lacks it."""
    grpc_local, http_local = is_loopback(s.host), is_loopback(metrics_host(s))
    credentialed = security.transport == "mtls" or (security.transport == "tls" and security.token is not None)
    insecure = not credentialed and not (grpc_local and http_local)
    if insecure and not s.allow_insecure:
        if not grpc_local:
            where = f"--host {s.host or '(all interfaces)'}"
            if security.token is not None and security.transport == "plaintext":
                why = "sends the bearer token in plaintext (anyone on the path reads it and then every cache slot)"
                fix = "add --tls-cert and --tls-key (or mutual TLS with --tls-client-ca)"
            else:
                why = ("listens beyond loopback with no credentials (anyone who reaches the port reads and overwrites "
                       "every cache slot)")
                fix = ("set a bearer token over TLS (--auth-token-file with --tls-cert and --tls-key) or mutual TLS "
                       "(--tls-client-ca)")
        else:
            where = f"--metrics-host {metrics_host(s) or '(all interfaces)'}"
            why = "exposes the HTTP port beyond loopback while the gRPC port has no credentials"
            fix = "bind it to loopback, or give the gRPC port a bearer token over TLS or mutual TLS"
        raise ConfigError(f"{where} {why}: {fix}, or accept the exposure with --allow-insecure")
    return Exposure(grpc_local, http_local, credential_words(security), credentialed, insecure)


def describe_exposure(e: Exposure, grpc_address: str, http_address: str) -> str:
    """One line: ``loopback only: …``, ``<address> <credential>; HTTP …``, or ``INSECURE (…): …``."""
    http = f"HTTP {http_address} metrics and health, no credentials"
    if e.grpc_loopback and e.http_loopback:
        return f"loopback only: gRPC {grpc_address} {e.credential}; {http}"
    line = f"{grpc_address} {e.credential}; {http}"
    return f"INSECURE (--allow-insecure): {line}" if e.insecure else line
