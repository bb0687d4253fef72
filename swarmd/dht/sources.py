"""Who placed a record: source groups, per-source quotas and fair shares of a DHT key (issue 18).

A signed record proves who *speaks* in it, not that anyone stands behind it: an ed25519
identity costs nothing, so one process can mint a thousand and publish a valid ``serving``
record for each (a Sybil flood). What such a process cannot mint as cheaply is *addresses*:
its ``store`` datagrams all come from the few it holds. Storing nodes therefore account for
every record by the **source group** of the node that delivered it (the sender of the
``store`` RPC, as kademlia hands it to ``rpc_store``), and:

- bound how many records one group may place under one key (``max_per_source``, default 8;
  with the 4 bucket keys of a stage, 32 per stage per group);
- share a full key fairly: a newcomer from a group that holds fewer records than another
  group may evict one record of the group holding the most (its youngest: the identity this
  node met last), but only if that group still holds at least as many as the newcomer's
  after the swap (max-min fairness, so nothing oscillates); a newcomer from a group at or
  above every other group's count evicts nothing and is refused, as before.

Records that are already held keep refreshing whatever their group's count: a quota limits
placing new records, it never drops an incumbent (kademlia's preference for long-lived
contacts, section 2.2, applied to stored values).

Groupings (:data:`GROUPINGS`, a parameter of :class:`~swarmd.dht.node.DHTNode`):

``prefix``
    IPv4 ``/24``, IPv6 ``/64``: the unit one subscriber or one cloud machine usually holds, so
    a flood from many addresses of one allocation counts once.
``address``
    the exact IP: hosts of one LAN (a lab, a cluster) each count on their own.
``endpoint``
    IP and UDP port: on one machine, ports are all that tell daemons apart (loopback tests,
    several daemons per host).
``auto`` (default)
    ``endpoint`` for loopback senders, ``prefix`` for globally routable ones, ``address`` for
    the rest (RFC 1918, link-local, fc00::/7, 100.64/10: a LAN whose hosts the operator put
    there, or a carrier's NAT).

The local node's own stores (``source=None`` in :meth:`~swarmd.dht.storage.RecordStorage.merge`)
form the group :data:`LOCAL`, exempt from the quota.

What this does not stop: an attacker holding many /24s (or /64s: IPv6 allocations are
generous) gets a quota per group; readers merge every replica, so an attacker that sends
different records to different replicas is listed up to k times its quota per key (trainers
and stage-mates then pay for them: ``swarmd.pipeline.routing``'s probation, and proofs).
"""

from __future__ import annotations

import ipaddress
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "DEFAULT_MAX_PER_SOURCE",
    "GROUPINGS",
    "LOCAL",
    "Grouping",
    "Held",
    "RateLimiter",
    "choose_victims",
    "source_group",
]

Grouping = Literal["auto", "prefix", "address", "endpoint"]
GROUPINGS: tuple[Grouping, ...] = ("auto", "prefix", "address", "endpoint")
DEFAULT_MAX_PER_SOURCE = 8
LOCAL = "local"


def _unmapped(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def source_group(sender: tuple[Any, ...] | None, grouping: Grouping = "auto") -> str:
    """The group a datagram's sender counts in (module docstring): ``"203.0.113.0/24"``,
    ``"10.0.0.7"``, ``"127.0.0.1:40123"``, ... ``None`` is the local node (:data:`LOCAL`)."""
    if grouping not in GROUPINGS:
        raise ValueError(f"source grouping must be one of {', '.join(GROUPINGS)}, got {grouping!r}")
    if sender is None:
        return LOCAL
    host = str(sender[0]) if len(sender) > 0 else ""
    port = sender[1] if len(sender) > 1 else 0
    addr = _unmapped(host)
    if addr is None:  # not an IP (a test transport...): the string is all there is
        return f"{host}:{port}" if grouping == "endpoint" else host
    mode = grouping
    if mode == "auto":
        if addr.is_loopback:
            mode = "endpoint"
        elif addr.is_global:
            mode = "prefix"
        else:  # private, link-local, unique-local, shared (CGNAT), documentation ranges
            mode = "address"
    if mode == "endpoint":
        return f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"
    if mode == "address":
        return str(addr)
    bits = 24 if addr.version == 4 else 64
    return str(ipaddress.ip_network(f"{addr}/{bits}", strict=False))


@dataclass(frozen=True, slots=True)
class Held:
    """One record held under a key, as the fairness rule sees it."""

    subkey: str
    group: str
    born: int  # arrival order on this node: larger is younger


def choose_victims(
    held: Iterable[Held], newcomer: str, fits: Callable[[list[str]], bool]
) -> list[str] | None:
    """Which records a newcomer from group ``newcomer`` may evict from a full key, or None.

    ``fits(evicted)`` says whether the newcomer fits once the subkeys ``evicted`` are gone.
    Victims are taken one at a time from the group holding the most records (ties: the group
    name, so every replica decides alike), youngest first, and only while that group holds more
    than ``newcomer``'s count + 1 (after the swap it still holds at least as many). None: no
    eviction makes room fairly (the newcomer is refused; nobody is evicted).
    """
    by_group: dict[str, list[Held]] = {}
    for h in held:
        by_group.setdefault(h.group, []).append(h)
    counts = Counter({g: len(hs) for g, hs in by_group.items()})
    for hs in by_group.values():
        hs.sort(key=lambda h: (h.born, h.subkey))  # oldest first; pop() takes the youngest
    mine = counts[newcomer] + 1  # the newcomer's group once it is in
    evicted: list[str] = []
    while not fits(evicted):
        candidates = [g for g in counts if g != newcomer and counts[g] - 1 >= mine]
        if not candidates:
            return None
        group = max(candidates, key=lambda g: (counts[g], g))
        evicted.append(by_group[group].pop().subkey)
        counts[group] -= 1
    return evicted


class RateLimiter:
    """At most one event per ``key`` every ``period_s`` seconds (log lines about one source);
    remembers at most ``max_keys`` keys (the oldest are forgotten first)."""

    def __init__(self, period_s: float = 60.0, *, max_keys: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self.max_keys = max_keys
        self.clock = clock
        self._last: dict[str, float] = {}
        self.suppressed: Counter[str] = Counter()

    def allow(self, key: str) -> bool:
        """True if an event for ``key`` may be reported now (then it is not again for a period)."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.period_s:
            self.suppressed[key] += 1
            return False
        self._last.pop(key, None)
        self._last[key] = now
        while len(self._last) > self.max_keys:
            self._last.pop(next(iter(self._last)))
        return True

    def take_suppressed(self, key: str) -> int:
        """How many events for ``key`` were suppressed since it was last reported (and reset)."""
        return self.suppressed.pop(key, 0)
