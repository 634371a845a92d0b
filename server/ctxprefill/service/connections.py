"""Closing one client's TCP connection from outside gRPC.

grpcio's aio server has no per-call cancel: a call whose answer waits on the client's
flow-control window ends only when the client reads, cancels or leaves, its deadline
passes, or its connection closes. The send timeout (``--send-timeout-s``,
``interceptors/memory.py``) therefore shuts down the socket of the connection the call
came on, found among this process's file descriptors by its two addresses (Linux
``/proc/self/fd``); gRPC sees the connection fail and ends every call on it.
Unix-domain connections carry no peer address and are not found: their callers are on
this host, admitted by the socket file's permissions, and keepalive still bounds them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import urllib.parse

_FD_DIR = "/proc/self/fd"


def parse_peer(peer: str) -> tuple[str, int] | None:
    """gRPC's peer string (``ipv4:10.0.0.1:5000``, ``ipv6:[::1]:5000``, URI-escaped or
    not) as ``(address, port)``; None for any other transport (``unix:``)."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        return _canonical(host.strip("[]")), int(port)
    except ValueError:
        return None


def _canonical(host: str) -> str:
    address = ipaddress.ip_address(host.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)  # a dual-stack socket's view of an IPv4 peer
    return str(address)


@dataclasses.dataclass
class ConnectionCloser:
    """Shuts down the gRPC connection a peer string names. ``ports``: the local ports
    gRPC listens on (filled once bound; a peer's address and port alone may also name
    its connection to another of this process's ports)."""

    ports: set[int] = dataclasses.field(default_factory=set)

    def close(self, peer: str) -> bool:
        """Shut the connection down (both directions); False where none is found."""
        address = parse_peer(peer)
        if address is None:
            return False
        try:
            names = os.listdir(_FD_DIR)
        except OSError:
            return False  # not Linux: keepalive and deadlines are the bound
        for name in names:
            try:
                if not os.readlink(f"{_FD_DIR}/{name}").startswith("socket:"):
                    continue
                sock = socket.socket(fileno=os.dup(int(name)))  # a second descriptor: closing it leaves gRPC's
            except (OSError, ValueError):
                continue
            with sock:
                try:
                    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                        continue
                    remote, local = sock.getpeername(), sock.getsockname()
                    if (_canonical(remote[0]), remote[1]) != address or (self.ports and local[1] not in self.ports):
                        continue
                    sock.shutdown(socket.SHUT_RDWR)  # the connection itself, for every descriptor of it
                    return True
                except (OSError, ValueError):
                    continue
        return False
