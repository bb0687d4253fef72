"""The daemon's three listening sockets, bound before anything else starts.

A taken port used to fail a daemon seconds late, after it had founded a DHT and built its stage,
with "Address already in use" and no word of which port (issue 26). :func:`bind_listeners` binds
all three at once, first: the data plane's and the control plane's TCP sockets (listening at once,
so that no other process can bind them in between) and the DHT's UDP socket. ``swarmd [serve]``
calls it before it even imports torch (this module needs only the standard library), so a taken
port fails in a fraction of a second; the daemon then hands these very sockets on to the data
plane, the control plane and the DHT node, so there is no window between a check and the real bind
for another process to take a port. A failure is one sentence
naming the flag and the address: :class:`~swarmd.errors.PortUnavailable` (the CLI exits 1) when the
port is taken or forbidden, :class:`~swarmd.errors.ConfigError` (exit 2) when the host is no
address of this machine or cannot be resolved, or when two flags name one port.

Each socket is made as asyncio and uvicorn would make it: the first address ``getaddrinfo`` gives
for the host, ``SO_REUSEADDR`` on TCP (a restarted daemon rebinds while old connections linger in
TIME_WAIT; on Linux this never lets two sockets listen on one port), never on UDP (where it would
let two DHT nodes share a port), and ``IPV6_V6ONLY`` on the data plane's IPv6 socket as
``loop.create_server`` sets it.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from swarmd.errors import ConfigError, PortUnavailable

#: How many connections may wait to be accepted before the server takes them (asyncio's default).
BACKLOG = 100


@dataclass(frozen=True)
class Endpoint:
    """One socket the daemon listens on, with the flags that set it (for the sentences)."""

    port_flag: str  # --port, --api-port, --dht-port
    host_flag: str  # --host, --api-host, --dht-host
    host: str
    port: int
    kind: socket.SocketKind  # SOCK_STREAM or SOCK_DGRAM

    @property
    def proto(self) -> str:
        return "TCP" if self.kind == socket.SOCK_STREAM else "UDP"


@dataclass
class Listeners:
    """The bound sockets, owned by the daemon until it hands each on; ``close`` closes them all
    (idempotent, and harmless for a socket a server already closed)."""

    data: socket.socket
    api: socket.socket
    dht: socket.socket

    def close(self) -> None:
        for sock in (self.data, self.api, self.dht):
            sock.close()


def bind_listeners(data: tuple[str, int], api: tuple[str, int], dht: tuple[str, int]) -> Listeners:
    """Bind the data plane (``--host``/``--port``), the control plane (``--api-host``/``--api-port``)
    and the DHT (``--dht-host``/``--dht-port``), in that order; on any failure the ones already
    bound are closed and the error names the flag and address that failed."""
    endpoints = (
        Endpoint("--port", "--host", *data, socket.SOCK_STREAM),
        Endpoint("--api-port", "--api-host", *api, socket.SOCK_STREAM),
        Endpoint("--dht-port", "--dht-host", *dht, socket.SOCK_DGRAM),
    )
    first, second = endpoints[0], endpoints[1]
    if first.port and first.port == second.port and first.host == second.host:
        raise ConfigError(f"--port and --api-port are both {first.port} on {first.host}: the data plane and the "
                          "control plane need a port each; give them different ports (0 picks a free one)")
    bound: list[socket.socket] = []
    try:
        for endpoint in endpoints:
            bound.append(bind(endpoint, v6only=endpoint.port_flag == "--port"))
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return Listeners(*bound)


def bind(endpoint: Endpoint, *, v6only: bool = False) -> socket.socket:
    """One socket bound to ``endpoint`` (and listening, for TCP); PortUnavailable or ConfigError."""
    where = f"{endpoint.port_flag} {endpoint.port} on {endpoint.host}"
    try:
        infos = socket.getaddrinfo(endpoint.host, endpoint.port, type=endpoint.kind)
    except socket.gaierror as exc:
        raise ConfigError(f"{endpoint.host_flag} {endpoint.host} cannot be resolved ({exc.strerror}); give an "
                          "address of this machine, e.g. 127.0.0.1 or 0.0.0.0") from exc
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        if kind == socket.SOCK_STREAM:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if v6only and family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        if kind == socket.SOCK_STREAM:
            sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise _explain(exc, endpoint, where) from exc
    sock.set_inheritable(False)
    return sock


def _explain(exc: OSError, endpoint: Endpoint, where: str) -> Exception:
    """The sentence for a failed bind: what is wrong with which flag, and what to do."""
    if exc.errno == errno.EADDRINUSE:
        return PortUnavailable(
            f"{where} is already in use ({endpoint.proto}): another program, perhaps another swarmd, listens "
            f"there; stop it or give another {endpoint.port_flag} (0 picks a free port)")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PortUnavailable(
            f"{where} is not allowed ({exc.strerror}): ports below 1024 need privileges; give a {endpoint.port_flag} "
            "above 1023 (0 picks a free port)")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(
            f"{endpoint.host_flag} {endpoint.host} is not an address of this machine, so {endpoint.port_flag} cannot "
            "listen there; give one of its addresses, or 0.0.0.0 for all of them")
    return PortUnavailable(f"cannot listen with {where} ({endpoint.proto}): {exc.strerror or exc}")
