"""Network addresses as swarmd writes them, and which address a peer announces to the swarm.

A daemon *binds* its data plane and DHT node to ``--host`` / ``--dht-host`` and *announces* one
address in its peer record: the one trainers and stage-mates dial. They differ whenever it binds
a wildcard (``0.0.0.0``, ``::``), which names no host at all: announcing it made every trainer
dial its own machine (issue #11). The announced host is, in this order of trust:

1. ``flag``: ``--announce HOST[:PORT]``, as given (behind a port forward, a reverse proxy ...);
2. ``bound``: the bound host, when it is a specific address;
3. ``observed``: for a wildcard, the address that two or more DHT contacts agree they see this
   peer's datagrams come from (their ``whoami`` answers, as in STUN);
4. ``route``: else the local address of the route towards the first bootstrap peer (a UDP
   ``connect`` sends nothing; the kernel only picks the source address), or towards a public
   address for a founder;
5. ``loopback`` as the last resort for a founder on a machine with no route at all.

Never a wildcard, and never a loopback address into a swarm whose members are not all on
loopback (a joiner on loopback that joins a non-loopback bootstrap peer is refused with one
sentence). IPv6 hosts are written in brackets: ``[2001:db8::1]:7000``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from swarmd.errors import ConfigError

#: How the announced host was chosen (shown in ``/status``).
HOW = ("flag", "bound", "observed", "route", "loopback")

# An address from TEST-NET-3 (RFC 5737) / the IPv6 documentation prefix: a UDP connect towards it
# picks the source address of the default route; nothing is ever sent there.
_PUBLIC_PROBE: dict[int, str] = {socket.AF_INET: "203.0.113.1", socket.AF_INET6: "2001:db8::1"}


#: The header that asks a relay to pass a request on to the peer it names (``swarmd.net.relay``).
RELAY_HEADER = "X-Swarm-Relay"
#: Where a relayed peer attaches its WebSocket on its relay's data plane.
RELAY_ATTACH_PATH = "/v1/relay"


def format_relayed(peer_id: str, relay_addr: str) -> str:
    """The address a relayed peer announces: ``<peer id>@<relay host:port>``."""
    return f"{peer_id}@{relay_addr}"


def dial_target(addr: str) -> tuple[str, dict[str, str]]:
    """Where to send a request for the peer announced at ``addr``, and the headers it needs:
    ``"10.0.0.5:7000"`` → ``("http://10.0.0.5:7000", {})``; a relayed ``"<id>@10.0.0.9:7000"`` →
    ``("http://10.0.0.9:7000", {"X-Swarm-Relay": "<id>"})``."""
    peer, sep, host_port = addr.rpartition("@")
    base = host_port if host_port.startswith("http") else f"http://{host_port}"
    return (base, {RELAY_HEADER: peer}) if sep else (base, {})


def is_relayed(addr: str) -> bool:
    return "@" in addr


def format_addr(addr: tuple[str, int] | None) -> str | None:
    """``("10.0.0.1", 7000)`` → ``"10.0.0.1:7000"``; ``("2001:db8::1", 7000)`` → ``"[2001:db8::1]:7000"``."""
    if addr is None:
        return None
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_host_port(text: str, *, default_port: int | None = None) -> tuple[str, int | None]:
    """``"10.0.0.1:7000"``, ``"[::1]:7000"``, ``"::1"``, ``"example.org"`` → (host, port or default).

    ValueError with a sentence for anything else (an empty host, a bad port, brackets that do not
    close)."""
    text = text.strip()
    if not text:
        raise ValueError("an empty address")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"{text!r}: an IPv6 address in brackets needs its closing ']'")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{text!r}: expected [IPv6]:PORT")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:  # a bare IPv6 address, no port
        host, port_text = text, None
    else:
        host, _, port_text = text.partition(":")
        port_text = port_text if ":" in text else None
    if not host:
        raise ValueError(f"{text!r} has no host")
    if port_text is None:
        return host, default_port
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{text!r}: {port_text!r} is not a port number") from None
    if not 0 < port < 65536:
        raise ValueError(f"{text!r}: the port must be 1-65535")
    return host, port


def is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host in ("", "*")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def family_of(host: str) -> int:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host.strip("[]")).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET


def route_source(towards: str, family: int | None = None) -> str | None:
    """The local address the kernel would send from towards ``towards`` (no packet is sent), or
    None when there is no route (or ``towards`` is not an IP address)."""
    try:
        target = ipaddress.ip_address(towards.strip("[]"))
    except ValueError:
        return None
    fam = family or (socket.AF_INET6 if target.version == 6 else socket.AF_INET)
    try:
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((str(target), 9))
            source = s.getsockname()[0]
    except OSError:
        return None
    return None if is_wildcard(source) else str(source)


def default_route_source(family: int = socket.AF_INET) -> str | None:
    """The local address of the default route (towards a documentation address; nothing is sent)."""
    return route_source(_PUBLIC_PROBE[family], family)


@dataclass(frozen=True)
class Announced:
    """The host a peer announces, how it was chosen, and what its DHT contacts said they saw."""

    host: str
    how: str  # one of HOW
    observed: tuple[str, ...] = ()  # the IPs contacts reported (whoami), for /status

    def addr(self, port: int) -> str:
        return format_addr((self.host, port)) or ""


def choose_host(
    *,
    bound: str,
    flag: str | None = None,
    observed: Sequence[str] = (),
    route: str | None = None,
) -> Announced:
    """The host to announce (see the module docstring); pure, for tests and for the daemon.

    ``observed``: the IPs DHT contacts saw this peer's datagrams come from; ``route``: the local
    address of the route towards the bootstrap peer (or the default route), if any.
    """
    seen = tuple(observed)
    if flag:
        return Announced(flag, "flag", seen)
    if not is_wildcard(bound):
        return Announced(bound, "bound", seen)
    votes = Counter(ip for ip in seen if not is_wildcard(ip))
    if votes:
        ip, count = max(votes.items(), key=lambda item: (item[1], item[0]))
        if count >= 2:
            return Announced(ip, "observed", seen)
    if route and not is_wildcard(route):
        return Announced(route, "route", seen)
    loop = "::1" if family_of(bound) == socket.AF_INET6 else "127.0.0.1"
    return Announced(loop, "loopback", seen)


def loopback_mismatch(announced: str, join: Sequence[tuple[str, int]]) -> str | None:
    """A sentence when a loopback ``announced`` host would go into a swarm joined through a
    non-loopback address (its members could never dial it), else None."""
    if not is_loopback(announced):
        return None
    outside = [format_addr(a) for a in join if not is_loopback(a[0])]
    if not outside:
        return None
    return (f"this peer would announce the loopback address {announced} to a swarm joined through "
            f"{outside[0]}, which is not on this machine's loopback: bind --host/--dht-host to an address "
            "the others can reach (or 0.0.0.0), or give --announce HOST")


#: How long resolving the ``--join`` hosts may take: a resolver that does not answer would
#: otherwise hold start-up for the system's own timeout (often 20 s or more).
RESOLVE_TIMEOUT_S = 5.0


async def check_join_hosts(
    join: Sequence[tuple[str, int]], timeout_s: float = RESOLVE_TIMEOUT_S
) -> tuple[list[tuple[str, int]], list[str]]:
    """Resolve every ``--join`` host before anything starts: ConfigError (the CLI exits 2) with one
    sentence when none resolves, e.g. a typo; otherwise the addresses that resolved and a sentence
    for each that did not (the caller warns and joins through the others: one name down must not
    keep a peer out)."""
    loop = asyncio.get_running_loop()

    async def why_not(host: str, port: int) -> str | None:
        try:
            ipaddress.ip_address(host.strip("[]"))
            return None  # an IP literal needs no resolver
        except ValueError:
            pass
        try:
            await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM), timeout_s)
        except socket.gaierror as exc:
            return f"cannot resolve {host} ({exc.strerror})"
        except asyncio.TimeoutError:
            return f"cannot resolve {host} (no answer from the name resolver within {timeout_s:g} s)"
        except UnicodeError:  # a label longer than 63 characters, an empty label
            return f"cannot resolve {host} (not a valid host name)"
        return None

    reasons = await asyncio.gather(*(why_not(host, port) for host, port in join))
    failed = [f"--join {format_addr(addr)}: {why}" for addr, why in zip(join, reasons, strict=True) if why]
    if join and len(failed) == len(join):
        raise ConfigError("; ".join(failed) + ": check the name, or give the peer's IP address")
    return [addr for addr, why in zip(join, reasons, strict=True) if not why], failed
