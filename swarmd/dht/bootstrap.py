"""Joining a DHT (Maymounkov & Mazières, section 2.3): ping the bootstrap addresses, then look
oneself up to fill the routing table.

Every bootstrap address is pinged at once, retried with exponential backoff (a peer started at
the same moment may open its port a few seconds after this one's first ping) until one answers or
the deadline passes; a failure then names every address and why it failed, with a hint about the
swarm key when a private swarm's members may be dropping this node's datagrams unanswered.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable

from kademlia.crawling import NodeSpiderCrawl
from kademlia.node import Node

from swarmd.dht.protocol import DHTProtocol, gather_all
from swarmd.errors import BootstrapError
from swarmd.swarm_key import DatagramAuth, SwarmKey

log = logging.getLogger("swarmd.dht.node")  # the node's lines, under the name they always had


def fmt_addr(addr: object) -> str:
    """``host:port``, or ``[host]:port`` for IPv6 (anything else as its repr)."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = str(addr[0])
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    return repr(addr)


def key_hint(swarm_key: SwarmKey | None, auth: DatagramAuth | None, protocol: DHTProtocol | None) -> str:
    """Why a live bootstrap peer may stay silent: the swarm key (its members drop the datagrams
    of anyone without the same key, unanswered)."""
    if auth is not None and swarm_key is not None:
        refused = sum(auth.refused.values())
        seen = f"; {refused} datagrams from others were refused" if refused else ""
        return (f" (this node uses --swarm-key {swarm_key.source or '(given)'}: the bootstrap peers must "
                f"use the same key{seen}; check --swarm-key)")
    if protocol is not None and protocol.dropped["private_swarm"]:
        return " (a peer of a private swarm wrote to this node: give the swarm's --swarm-key)"
    return " (if the swarm is private, give its --swarm-key)"


class Bootstrap:
    """One node's join through a list of bootstrap addresses (``DHTNode.start`` runs it once)."""

    def __init__(
        self,
        protocol: DHTProtocol,
        own: Node,
        address: tuple[str, int],
        family: socket.AddressFamily,
        *,
        rpc_timeout: float,
        ksize: int,
        alpha: int,
        hint: Callable[[], str],
    ) -> None:
        """``own``: this node (it looks itself up); ``address``, ``family``: its bound socket's;
        ``hint``: what to add to a failure (asked then: it counts what was refused meanwhile)."""
        self.protocol = protocol
        self.own = own
        self.address = address
        self.family = family
        self.rpc_timeout = rpc_timeout
        self.ksize = ksize
        self.alpha = alpha
        self.hint = hint

    async def join(
        self, addrs: list[tuple[str, int]], deadline_s: float, backoff_s: float, max_backoff_s: float
    ) -> None:
        """Ping ``addrs`` until one answers (``backoff_s`` doubling up to ``max_backoff_s``), then
        look this node up through those that answered; :class:`BootstrapError` after ``deadline_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        delay = backoff_s
        attempt = 0
        reported = ""  # the failures of the last round that waited a whole rpc_timeout (the last one may not)
        log.info("joining the DHT through %s (for up to %g s)", ", ".join(fmt_addr(a) for a in addrs), deadline_s)
        while True:
            attempt += 1
            timeout = min(self.rpc_timeout, max(deadline - loop.time(), 0.05))
            outcomes = await gather_all(*(self.probe(addr, timeout) for addr in addrs))
            contacts = [node for node, _ in outcomes if node is not None]
            failures = "; ".join(
                f"{fmt_addr(a)}: {why}" for a, (node, why) in zip(addrs, outcomes, strict=True) if node is None
            )
            if timeout >= self.rpc_timeout or not reported:
                reported = failures
            if contacts:
                if failures:
                    log.warning("DHT bootstrap: some addresses failed (%s); joining through the others", failures)
                await NodeSpiderCrawl(self.protocol, self.own, contacts, self.ksize, self.alpha).find()
                log.info(
                    "joined the DHT at %s through %s; %d contacts",
                    fmt_addr(self.address),
                    ", ".join(str(n) for n in contacts),
                    len(self.protocol.router.find_neighbors(self.own, 10**6)),
                )
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise BootstrapError(
                    f"no DHT bootstrap address answered within {deadline_s:g} s ({attempt} attempts): {reported}; "
                    "check that a swarmd runs there with that --dht-port, open to UDP from this machine"
                    + self.hint()
                )
            wait = min(delay, remaining)
            log.debug("DHT bootstrap attempt %d failed (%s); retrying in %.1f s", attempt, failures, wait)
            await asyncio.sleep(wait)
            delay = min(delay * 2, max_backoff_s)

    async def probe(self, addr: object, timeout: float) -> tuple[Node | None, str]:
        """Ping one bootstrap address: its node, or None and why not."""
        if not (isinstance(addr, tuple) and len(addr) == 2 and isinstance(addr[0], str)):
            return None, "not a (host, port) pair"
        host, port = addr
        if type(port) is not int or not 0 < port < 65536:
            return None, f"invalid port {port!r}"
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
            if (ip.version == 6) != (self.family == socket.AF_INET6):
                return None, f"an IPv{ip.version} address, but this node's socket is {fmt_addr(self.address)}"
            sockaddr = (str(ip), port)
        except ValueError:  # a host name: resolve it off the event loop
            try:
                loop = asyncio.get_running_loop()
                infos = await loop.getaddrinfo(host, port, family=self.family, type=socket.SOCK_DGRAM)
            except (OSError, UnicodeError) as exc:
                return None, f"cannot resolve {host!r}: {exc}"
            if not infos:
                return None, f"cannot resolve {host!r}"
            sockaddr = (str(infos[0][4][0]), int(infos[0][4][1]))
        node_id = await self.protocol.ping_address(sockaddr, timeout=timeout)
        if node_id is None:
            return None, f"no answer within {timeout:.1f} s"
        if node_id == self.own.id:
            return None, "that is this node itself"
        return Node(node_id, sockaddr[0], sockaddr[1]), ""
