"""no_connections(): a guard that makes every outgoing socket connection (and DNS lookup) fail, and records
the attempts, so a test can prove a code path stays off the network.

    with no_connections() as attempts:
        run_something()
    assert attempts == []

allow_loopback=True lets 127.0.0.1 / ::1 / localhost through (a test's local server) and blocks the rest.
Process-wide while active (all threads); not for tests that run in parallel threads of their own.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


class NetworkBlocked(ConnectionRefusedError):
    """An OSError, so HTTP clients report it as the connection error they would get offline."""


def _host(address) -> str:
    if isinstance(address, tuple) and address:
        return str(address[0])
    return str(address)  # AF_UNIX path


@contextmanager
def no_connections(allow_loopback: bool = False) -> Iterator[list[str]]:
    attempts: list[str] = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def allowed(host: str, family=None) -> bool:
        if family == getattr(socket, "AF_UNIX", None):
            return True  # local IPC (e.g. a keyring's D-Bus socket) is not network
        return allow_loopback and host in _LOOPBACK

    def connect(self, address):
        if not allowed(_host(address), self.family):
            attempts.append(_host(address))
            raise NetworkBlocked(f"network blocked by no_connections(): connect to {address!r}")
        return real_connect(self, address)

    def connect_ex(self, address):
        if not allowed(_host(address), self.family):
            attempts.append(_host(address))
            raise NetworkBlocked(f"network blocked by no_connections(): connect to {address!r}")
        return real_connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else str(host)
        if not allowed(name):
            attempts.append(name)
            raise socket.gaierror(socket.EAI_NONAME, f"DNS blocked by no_connections(): {name}")
        return real_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
    socket.getaddrinfo = getaddrinfo
    try:
        yield attempts
    finally:
        socket.socket.connect, socket.socket.connect_ex = real_connect, real_connect_ex
        socket.getaddrinfo = real_getaddrinfo
