"""``DHTNode``: the daemon's only handle on the DHT, and the owner of every task it runs.

It wires kademlia's routing table and crawlers (Maymounkov & Mazières, sections 2.3-2.5) to
:class:`~swarmd.dht.protocol.DHTProtocol` and :class:`~swarmd.dht.storage.RecordStorage`,
and replaces ``kademlia.network.Server``, whose ``listen`` starts fire-and-forget tasks and
whose ``stop`` is synchronous. Here every task (the maintenance loop, each ``get``/``store``,
the protocol's hand-overs and pings) belongs to the node, and :meth:`DHTNode.stop` cancels and
awaits all of them before closing the socket.

Lookups
    ``store`` finds the k closest nodes to the key (``NodeSpiderCrawl``, section 2.3) and sends
    each a one-record bundle; it also keeps the record itself when it is among the k closest
    (kademlia's ``Server.set_digest`` rule). ``get`` does not stop at the first value as
    kademlia's ``ValueSpiderCrawl`` does (which then picks the most common value): it crawls
    until the k closest nodes have all been asked and merges everything they hold (per subkey,
    newest wins), with this node's own copy, keeping only the records that replicas of half the
    source groups that answered hold, and of two or more (a lone replica's extras are its own,
    e.g. a flooder's). A ``get``
    therefore costs a full lookup whatever the replicas hold: 22 ``find_value`` RPCs on average
    in a 100-node DHT (k = 20), and a ``store`` about 40 (a node lookup, then k ``store``
    RPCs); ``get_stage_peers`` is one ``get`` per bucket, run in parallel. ``scripts/bench_dht.py`` measures these.

Sizes and limits (measured; ``tests/integration/test_dht_node.py`` and ``test_dht_records.py`` pin them)
    - a realistic signed PeerRecord (IPv4 + IPv6 address, 64-hex params digest, checkpoint step): 305 bytes;
    - the largest datagram rpcudp sends: 8213 bytes (21 of header + 8192 of msgpack), which
      leaves 8137 bytes for one key's bundle (``MAX_BUNDLE_BYTES``); a private swarm
      (``swarm_key``) wraps it in 25 more bytes, 8238 in all;
    - so one key holds 26 such PeerRecords (308 bytes each inside a bundle);
    - a stage's peers are spread over ``bucket_count`` keys (default 4:
      :func:`stage_key` ``(swarm, stage, bucket)``, ``bucket = bucket_of(peer_id)``), read in
      parallel by :meth:`DHTNode.get_stage_peers`: up to 4 x 26 = 104 peers per stage. When a
      bucket's replicas refuse a record because the bucket is full, :meth:`DHTNode.store_peer`
      moves on to the next bucket (readers read all of them anyway), so the whole capacity is
      usable despite hash imbalance. Every peer of a swarm must use the same ``bucket_count``.
    - one source group (an address, its /24 or /64, or an address and port on loopback:
      ``source_grouping``) places at most ``max_per_source`` (8) new records under one key, 32 per
      stage, and a full key is shared fairly among groups (:mod:`swarmd.dht.sources`); a store
      refused over quota counts as refused, so ``store_peer`` moves on to the next bucket.

Republishing is the caller's job: the daemon re-signs its record with a fresh ``timestamp`` every
announce period, with ``expiry`` = now + 3 periods, so a dead peer disappears within 3 periods.
Kademlia's hourly republication of stored keys is not run (records expire long before); the
maintenance loop drops expired records and refreshes routing-table buckets nobody looked up in
an hour (section 2.3).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kademlia.crawling import NodeSpiderCrawl, RPCFindResponse, SpiderCrawl
from kademlia.node import Node
from kademlia.utils import digest

from swarmd.dht.identity import Identity
from swarmd.dht.protocol import DEFAULT_MAX_BULK_RPCS, MAX_BUNDLE_BYTES, DHTProtocol, TaskSet
from swarmd.dht.records import PeerRecord, Record, RecordCache, bundle_size, decode_bundle, encode_bundle
from swarmd.dht.sources import DEFAULT_MAX_PER_SOURCE, LOCAL, Grouping, source_group
from swarmd.dht.storage import DEFAULT_MAX_KEYS, DEFAULT_MAX_SUBKEYS, RecordStorage
from swarmd.errors import BootstrapError, DHTError, MalformedRecord, RecordError, RecordExpired
from swarmd.swarm_key import SwarmKey

__all__ = [
    "DEFAULT_STAGE_BUCKETS",
    "DHTNode",
    "bucket_of",
    "stage_key",
    "swarm_key",
]

log = logging.getLogger(__name__)

DEFAULT_STAGE_BUCKETS = 4
KEY_PREFIX = "swarmd/1"
T = TypeVar("T")


def swarm_key(swarm: str) -> str:
    """The DHT key of a swarm's :class:`~swarmd.dht.records.SwarmRecord`."""
    return f"{KEY_PREFIX}/{swarm}/swarm"


def stage_key(swarm: str, stage: int, bucket: int) -> str:
    """The DHT key of one bucket of a stage's :class:`~swarmd.dht.records.PeerRecord` s."""
    return f"{KEY_PREFIX}/{swarm}/stage/{stage}/{bucket}"


def bucket_of(peer_id: str, bucket_count: int = DEFAULT_STAGE_BUCKETS) -> int:
    """The bucket a peer's record goes to first (a hash of its id, so peers spread evenly)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big") % bucket_count


async def _gather(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather`` that waits for every awaitable before raising the first error."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


class MergingValueSpiderCrawl(SpiderCrawl):
    """A value lookup (section 2.3) that collects the value of every replica among the k closest.

    ``kademlia.crawling.ValueSpiderCrawl`` returns as soon as one round finds a value and keeps
    the most common one; merged records need them all, so this crawl goes on until every one of
    the k nearest nodes it knows has been asked, and returns every value (bundle) it received.
    """

    def __init__(self, protocol: DHTProtocol, node: Node, peers: list[Node], ksize: int, alpha: int) -> None:
        super().__init__(protocol, node, peers, ksize, alpha)
        self.values: list[tuple[str, bytes]] = []  # (the answering replica's source group, its bundle)

    async def find(self) -> list[tuple[str, bytes]]:
        return await self._find(self.protocol.call_find_value)

    async def _nodes_found(self, responses: dict[bytes, tuple[bool, Any]]) -> list[tuple[str, bytes]]:
        gone = []
        for peer_id, answer in responses.items():
            response = RPCFindResponse(answer)
            if not response.happened():
                gone.append(peer_id)
            elif response.has_value():
                replica = self.nearest.get_node(peer_id)
                where = (replica.ip, replica.port) if replica is not None else ("?", 0)
                self.values.append((source_group(where, self.protocol.source_grouping), response.get_value()))
            else:
                self.nearest.push(response.get_node_list())
        self.nearest.remove(gone)
        if self.nearest.have_contacted_all():
            return self.values
        return await self.find()


def _fmt(addr: object) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = str(addr[0])
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    return repr(addr)


class DHTNode:
    """One Kademlia node on a UDP socket, storing and reading merged signed records.

    Use it as ``async with DHTNode(identity) as node:`` (founds a new DHT), or call
    ``await node.start(bootstrap)`` first and then ``async with node:`` (or ``await
    node.stop()``) to join an existing one. ``start`` stops the node again if it fails.
    """

    def __init__(
        self,
        identity: Identity,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ksize: int = 20,
        alpha: int = 3,
        rpc_timeout: float = 2.0,
        bucket_count: int = DEFAULT_STAGE_BUCKETS,
        max_subkeys: int = DEFAULT_MAX_SUBKEYS,
        max_bundle_bytes: int = MAX_BUNDLE_BYTES,
        max_keys: int = DEFAULT_MAX_KEYS,
        maintenance_interval_s: float = 60.0,
        max_bulk_rpcs: int = DEFAULT_MAX_BULK_RPCS,
        clock: Callable[[], float] = time.time,
        swarm_key: SwarmKey | None = None,
        max_per_source: int = DEFAULT_MAX_PER_SOURCE,
        source_grouping: Grouping = "auto",
    ) -> None:
        """``swarm_key``: a private swarm's pre-shared key; every datagram is then authenticated
        (:mod:`swarmd.swarm_key`) and nodes without it (or with another) are not talked to.

        ``max_per_source`` and ``source_grouping``: how many new records one source group (IPv4
        /24, IPv6 /64, an address or an address and port; ``auto`` picks by address kind) may
        place under one key of this node's storage, and a full key shared fairly among groups
        (:mod:`swarmd.dht.sources`, issue 18: a flood of minted identities cannot crowd out peers)."""
        if ksize < 1 or alpha < 1 or bucket_count < 1 or max_bulk_rpcs < 1:
            raise ValueError("ksize, alpha, bucket_count and max_bulk_rpcs must be >= 1")
        if rpc_timeout <= 0 or maintenance_interval_s <= 0:
            raise ValueError("rpc_timeout and maintenance_interval_s must be > 0")
        self.identity = identity
        self.host = host
        self.port = port
        self.ksize = ksize
        self.alpha = alpha
        self.rpc_timeout = rpc_timeout
        self.bucket_count = bucket_count
        self.maintenance_interval_s = maintenance_interval_s
        self.max_bulk_rpcs = max_bulk_rpcs
        self.node = Node(identity.node_id)
        self.cache = RecordCache()
        self.storage = RecordStorage(
            max_subkeys=max_subkeys, max_bundle_bytes=max_bundle_bytes, max_keys=max_keys, cache=self.cache,
            clock=clock, max_per_source=max_per_source,
        )
        self.source_grouping: Grouping = source_grouping
        self._clock = clock
        self.swarm_key = swarm_key
        self._auth = swarm_key.dht() if swarm_key is not None else None
        self._protocol: DHTProtocol | None = None
        self._address: tuple[str, int] | None = None
        self._family = socket.AF_INET
        self._ops = TaskSet("dht operations")  # get/store: their errors go to their callers
        self._background = TaskSet("dht node")
        self._lookup_rejected: Counter[str] = Counter()
        self._stage_bucket: dict[tuple[str, int], int] = {}
        self._state = "new"  # new -> running -> stopping -> stopped
        self._stopped = asyncio.Event()

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(
        self,
        bootstrap: Sequence[tuple[str, int]] = (),
        *,
        deadline_s: float = 30.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
        sock: socket.socket | None = None,
    ) -> None:
        """Bind the UDP socket (or take ``sock``, bound beforehand: ``swarmd.net.ports``), then
        found a DHT (no ``bootstrap``) or join one.

        Joining pings every bootstrap address at once, retrying with exponential backoff
        (``backoff_s`` doubling up to ``max_backoff_s``: a peer started at the same moment may
        open its port a few seconds after this one's first ping) and logging one DEBUG line per
        failed round that names each address and why it failed; it raises :class:`BootstrapError`
        once ``deadline_s`` has passed with no answer (after at most one more ``rpc_timeout``),
        one sentence that names every address. One answering address is enough: the node then
        looks itself up (section 2.3) to fill its routing table.
        """
        if self._state != "new":
            raise DHTError(f"a DHTNode starts once (this one is {self._state})")
        self._state = "starting"
        loop = asyncio.get_running_loop()
        protocol = DHTProtocol(
            self.node,
            self.storage,
            self.ksize,
            rpc_timeout=self.rpc_timeout,
            max_bulk_rpcs=self.max_bulk_rpcs,
            auth=self._auth,
            source_grouping=self.source_grouping,
        )
        try:
            if sock is not None:
                await loop.create_datagram_endpoint(lambda: protocol, sock=sock)
            else:
                await loop.create_datagram_endpoint(lambda: protocol, local_addr=(self.host, self.port))
        except OSError as exc:
            self._state = "stopped"
            self._stopped.set()
            raise DHTError(f"cannot bind the DHT's UDP socket to {_fmt((self.host, self.port))}: {exc}") from exc
        self._protocol = protocol
        transport = protocol.transport
        sockname = transport.get_extra_info("sockname")
        self._address = (sockname[0], sockname[1])
        self._family = transport.get_extra_info("socket").family
        self._state = "running"
        self._background.spawn(self._maintain(), name="dht maintenance")
        try:
            if bootstrap:
                await self._bootstrap(list(bootstrap), deadline_s, backoff_s, max_backoff_s)
            else:
                log.info("founded a new DHT at %s (peer %s)", _fmt(self._address), self.identity.peer_id)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Cancel and await every task of the node, then close its socket. Idempotent."""
        if self._state in ("new", "stopped"):
            self._state = "stopped"
            self._stopped.set()
            return
        if self._state == "stopping":
            await self._stopped.wait()
            return
        self._state = "stopping"
        try:
            await self._ops.aclose()
            await self._background.aclose()
            if self._protocol is not None:
                await self._protocol.aclose()
        finally:
            self._state = "stopped"
            self._stopped.set()
        log.info("DHT node %s stopped", _fmt(self._address))

    async def __aenter__(self) -> DHTNode:
        if self._state == "new":
            await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def address(self) -> tuple[str, int]:
        """The bound UDP address (with port 0, the port the OS picked)."""
        if self._address is None:
            raise DHTError("the DHT node has not been started")
        return self._address

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def neighbors(self, k: int | None = None) -> list[tuple[str, int]]:
        """Addresses of up to ``k`` (default ksize) contacts closest to this node, e.g. to
        bootstrap from after a restart."""
        if self._protocol is None:
            return []
        return [(n.ip, n.port) for n in self._protocol.router.find_neighbors(self.node, k)]

    async def observe_self(self, *, contacts: int = 4, timeout: float | None = None,
                           extra: Sequence[tuple[str, int]] = ()) -> list[tuple[tuple[str, int], str]]:
        """Ask up to ``contacts`` contacts (``extra`` first, e.g. the bootstrap addresses, then
        the routing table's) which IP this node's datagrams come from: ``[(contact, ip), ...]``
        for those that answered (``whoami``, see ``swarmd.dht.protocol``)."""
        protocol = self._proto()
        asked: list[tuple[str, int]] = []
        for addr in [*extra, *self.neighbors()]:
            if addr not in asked:
                asked.append(addr)
        asked = asked[:contacts]
        answers = await _gather(*(protocol.observed_from(addr, timeout=timeout) for addr in asked))
        return [(addr, seen[0]) for addr, seen in zip(asked, answers, strict=True) if seen is not None]

    # --- bootstrap -------------------------------------------------------------------------------

    async def _bootstrap(
        self, addrs: list[tuple[str, int]], deadline_s: float, backoff_s: float, max_backoff_s: float
    ) -> None:
        protocol = self._proto()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        delay = backoff_s
        attempt = 0
        reported = ""  # the failures of the last round that waited a whole rpc_timeout (the last one may not)
        log.info("joining the DHT through %s (for up to %g s)", ", ".join(_fmt(a) for a in addrs), deadline_s)
        while True:
            attempt += 1
            timeout = min(self.rpc_timeout, max(deadline - loop.time(), 0.05))
            outcomes = await _gather(*(self._probe(addr, timeout) for addr in addrs))
            contacts = [node for node, _ in outcomes if node is not None]
            failures = "; ".join(
                f"{_fmt(a)}: {why}" for a, (node, why) in zip(addrs, outcomes, strict=True) if node is None
            )
            if timeout >= self.rpc_timeout or not reported:
                reported = failures
            if contacts:
                if failures:
                    log.warning("DHT bootstrap: some addresses failed (%s); joining through the others", failures)
                await NodeSpiderCrawl(protocol, self.node, contacts, self.ksize, self.alpha).find()
                log.info(
                    "joined the DHT at %s through %s; %d contacts",
                    _fmt(self._address),
                    ", ".join(str(n) for n in contacts),
                    len(self.neighbors(10**6)),
                )
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise BootstrapError(
                    f"no DHT bootstrap address answered within {deadline_s:g} s ({attempt} attempts): {reported}; "
                    "check that a swarmd runs there with that --dht-port, open to UDP from this machine"
                    + self._key_hint()
                )
            wait = min(delay, remaining)
            log.debug("DHT bootstrap attempt %d failed (%s); retrying in %.1f s", attempt, failures, wait)
            await asyncio.sleep(wait)
            delay = min(delay * 2, max_backoff_s)

    def _key_hint(self) -> str:
        """Why a live bootstrap peer may stay silent: the swarm key (its members drop the datagrams
        of anyone without the same key, unanswered)."""
        if self._auth is not None and self.swarm_key is not None:
            refused = sum(self._auth.refused.values())
            seen = f"; {refused} datagrams from others were refused" if refused else ""
            return (f" (this node uses --swarm-key {self.swarm_key.source or '(given)'}: the bootstrap peers must "
                    f"use the same key{seen}; check --swarm-key)")
        if self._protocol is not None and self._protocol.dropped["private_swarm"]:
            return " (a peer of a private swarm wrote to this node: give the swarm's --swarm-key)"
        return " (if the swarm is private, give its --swarm-key)"

    async def _probe(self, addr: object, timeout: float) -> tuple[Node | None, str]:
        """Ping one bootstrap address: its node, or None and why not."""
        if not (isinstance(addr, tuple) and len(addr) == 2 and isinstance(addr[0], str)):
            return None, "not a (host, port) pair"
        host, port = addr
        if type(port) is not int or not 0 < port < 65536:
            return None, f"invalid port {port!r}"
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
            if (ip.version == 6) != (self._family == socket.AF_INET6):
                return None, f"an IPv{ip.version} address, but this node's socket is {_fmt(self._address)}"
            sockaddr = (str(ip), port)
        except ValueError:  # a host name: resolve it off the event loop
            try:
                loop = asyncio.get_running_loop()
                infos = await loop.getaddrinfo(host, port, family=self._family, type=socket.SOCK_DGRAM)
            except (OSError, UnicodeError) as exc:
                return None, f"cannot resolve {host!r}: {exc}"
            if not infos:
                return None, f"cannot resolve {host!r}"
            sockaddr = (str(infos[0][4][0]), int(infos[0][4][1]))
        node_id = await self._proto().ping_address(sockaddr, timeout=timeout)
        if node_id is None:
            return None, f"no answer within {timeout:.1f} s"
        if node_id == self.node.id:
            return None, "that is this node itself"
        return Node(node_id, sockaddr[0], sockaddr[1]), ""

    # --- maintenance -------------------------------------------------------------------------

    async def _maintain(self) -> None:
        protocol = self._proto()
        while True:
            await asyncio.sleep(self.maintenance_interval_s)
            self.storage.cull()
            crawls = []
            for node_id in protocol.get_refresh_ids():  # buckets not looked up in an hour
                target = Node(node_id)
                nearest = protocol.router.find_neighbors(target, self.alpha)
                crawls.append(NodeSpiderCrawl(protocol, target, nearest, self.ksize, self.alpha).find())
            await _gather(*crawls)

    # --- store and get ---------------------------------------------------------------------------

    async def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run an operation as a task the node owns, so that ``stop`` can end it."""
        if self._state != "running":
            coro.close()
            raise DHTError(f"the DHT node is not running ({self._state})")
        task = self._ops.spawn(coro)
        if task is None:  # the TaskSet closes only in stop(), which changes the state first
            raise DHTError("the DHT node is stopping")
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            caller_cancelled = current is not None and getattr(current, "cancelling", lambda: 0)() > 0
            if task.cancelled() and not self.running and not caller_cancelled:
                raise DHTError("the DHT node stopped during the operation") from None
            raise

    def _proto(self) -> DHTProtocol:
        if self._protocol is None:
            raise DHTError("the DHT node has not been started")
        return self._protocol

    def _open_own(self, record: bytes) -> Record:
        return self.cache.open(record, now=self._clock())

    async def store(self, key: str, record: bytes) -> int:
        """Merge-store one signed record under ``key`` on the k closest nodes (and here, if this
        node is one of them). Returns how many nodes accepted it, this one included.

        ``record`` is checked first: an invalid or expired one raises the
        :class:`~swarmd.errors.RecordError` every other node would refuse it with.
        """
        self._open_own(record)
        accepted, _refused = await self._run(self._store(digest(key), record))
        return accepted

    async def store_peer(self, swarm: str, record: bytes) -> int:
        """Store a signed :class:`PeerRecord` in its stage's bucket, moving on to the next bucket
        while most replicas refuse it (the bucket is full); the number of nodes that accepted."""
        peer = self._open_own(record)
        if not isinstance(peer, PeerRecord):
            raise ValueError(f"store_peer takes a PeerRecord, got a {type(peer).__name__}")
        first = self._stage_bucket.get((swarm, peer.stage), bucket_of(peer.peer_id, self.bucket_count))
        best = 0
        for i in range(self.bucket_count):
            bucket = (first + i) % self.bucket_count
            accepted, refused = await self._run(self._store(digest(stage_key(swarm, peer.stage, bucket)), record))
            if accepted >= refused:  # most replicas hold it (or nobody answered: no bucket would do better)
                self._stage_bucket[(swarm, peer.stage)] = bucket
                return accepted
            # Most replicas refused a valid record: the bucket is full there. A few that accepted
            # it (replica sets found by different writers differ a little) are harmless: readers
            # merge every bucket, newest record per peer.
            best = max(best, accepted)
            log.info("stage %d bucket %d of swarm %r is full; trying the next bucket", peer.stage, bucket, swarm)
        log.warning("every bucket of stage %d of swarm %r is full; record held by %d nodes", peer.stage, swarm, best)
        return best

    async def store_many(self, key: str, records: Sequence[bytes]) -> tuple[int, int]:
        """Merge-store a bundle of signed records (at most :data:`MAX_BUNDLE_BYTES` encoded) under
        ``key`` on its k closest nodes, as a hand-over does: ``(nodes that held all of them, nodes
        that refused some)``. What a mirror, a test or the flood harness (``scripts/flood.py``)
        needs; a daemon stores its own record with :meth:`store` / :meth:`store_peer`."""
        for raw in records:
            self._open_own(raw)
        if bundle_size(records) > MAX_BUNDLE_BYTES:
            raise ValueError(f"a bundle of {bundle_size(records)} bytes exceeds {MAX_BUNDLE_BYTES}")
        return await self._run(self._store(digest(key), encode_bundle(records), prebundled=True))

    async def _store(self, dkey: bytes, raw: bytes, *, prebundled: bool = False) -> tuple[int, int]:
        protocol = self._proto()
        target = Node(dkey)
        bundle = raw if prebundled else encode_bundle([raw])
        nearest = protocol.router.find_neighbors(target)
        closest: list[Node] = []
        if nearest:
            found = await NodeSpiderCrawl(protocol, target, nearest, self.ksize, self.alpha).find()
            closest = [n for n in found if n.id != self.node.id]
        accepted = refused = 0
        if len(closest) < self.ksize or self.node.distance_to(target) < max(n.distance_to(target) for n in closest):
            if self.storage.merge(dkey, bundle).ok:
                accepted += 1
            else:
                refused += 1
        for answered, ok in await _gather(*(protocol.call_store(n, dkey, bundle) for n in closest)):
            if answered and ok:
                accepted += 1
            elif answered:
                refused += 1
        return accepted, refused

    async def get(self, key: str) -> dict[str, Record]:
        """The merged view of ``key``: every live, valid record held by this node or any of the
        k closest nodes, one per subkey (the newest). Invalid records are dropped and counted."""
        return await self._run(self._get_merged([digest(key)]))

    async def get_stage_peers(self, swarm: str, stage: int, *, withdrawn: bool = False) -> dict[str, PeerRecord]:
        """The live PeerRecords of one stage: every bucket read in parallel, merged, by peer id.

        A peer's ``stopped`` record (its withdrawal on a graceful stop) replaces its listing and is
        left out, unless ``withdrawn``: a reader merging several stages needs it to hide the
        peer's older record of another stage (``swarmd.dht.membership.latest_per_peer``)."""
        keys = [digest(stage_key(swarm, stage, b)) for b in range(self.bucket_count)]
        records = await self._run(self._get_merged(keys))
        return {s: r for s, r in records.items()
                if isinstance(r, PeerRecord) and r.stage == stage and (withdrawn or r.listed)}

    async def _get_merged(self, dkeys: list[bytes]) -> dict[str, Record]:
        """Every replica's bundle of each key, merged per subkey (newest wins) over the records that
        replicas of at least half the source groups that answered with a value hold, and of at least
        two when two or more answered. A replica can answer a lookup with whatever it likes, so a
        record only it (or its /24) vouches for is a flooder's own, and is dropped (counted as
        ``one_replica``); and since each honest replica holds at most its quota of one source's
        records per key, a flooder that is a replica itself is listed at most about twice that
        quota per key, whatever it sends to whom. Honest stores reach every replica of the k
        closest (and ``store_peer`` keeps a record where most accept it), so real records pass."""
        found = await _gather(*(self._lookup(dkey) for dkey in dkeys))
        now = self._clock()
        merged: dict[str, tuple[Record, bytes]] = {}
        for bundles in found:
            versions: dict[str, tuple[Record, bytes]] = {}
            vouchers: dict[str, set[str]] = {}
            groups = {group for group, _ in bundles}
            for group, bundle in bundles:
                try:
                    raws = decode_bundle(bundle)
                except MalformedRecord:
                    self._lookup_rejected[MalformedRecord.reason] += 1
                    continue
                for raw in raws:
                    try:
                        record = self.cache.open(raw, now=now)
                    except RecordExpired:
                        continue  # normal: it expired between the replica's check and ours
                    except RecordError as exc:
                        self._lookup_rejected[exc.reason] += 1
                        continue
                    vouchers.setdefault(record.subkey, set()).add(group)
                    held = versions.get(record.subkey)
                    if held is None or (held[0].timestamp, held[1]) < (record.timestamp, raw):
                        versions[record.subkey] = (record, raw)
            needed = max(min(2, len(groups)), (len(groups) + 1) // 2)
            for subkey, (record, raw) in versions.items():
                if len(vouchers[subkey]) < needed:
                    self._lookup_rejected["one_replica"] += 1
                    continue
                held = merged.get(subkey)
                if held is None or (held[0].timestamp, held[1]) < (record.timestamp, raw):
                    merged[subkey] = (record, raw)
        return {subkey: record for subkey, (record, _) in merged.items()}

    async def _lookup(self, dkey: bytes) -> list[tuple[str, bytes]]:
        protocol = self._proto()
        values: list[tuple[str, bytes]] = []
        local = self.storage.get(dkey)
        if local is not None:
            values.append((LOCAL, local))
        target = Node(dkey)
        nearest = protocol.router.find_neighbors(target)
        if nearest:
            values.extend(await MergingValueSpiderCrawl(protocol, target, nearest, self.ksize, self.alpha).find())
        return values

    # --- introspection ---------------------------------------------------------------------------

    def auth_refused(self) -> dict[str, int] | None:
        """Datagrams refused for lacking the swarm key, by reason (None: not a private swarm)."""
        return self._auth.counts() if self._auth is not None else None

    def flood_stats(self) -> dict[str, Any]:
        """What the source quota, fair sharing and vouched lookups refused (issue 18; cheap: no cull)."""
        return {"grouping": self.source_grouping, **self.storage.flood_stats(),
                "one_replica": self._lookup_rejected["one_replica"]}

    def stats(self) -> dict[str, Any]:
        """Counters for /status and tests: table size, stored keys, rejections, drops, tasks."""
        protocol = self._protocol
        dropped = dict(sorted(protocol.dropped.items())) if protocol is not None else {}
        return {
            "peer_id": self.identity.peer_id,
            "address": _fmt(self._address) if self._address else None,
            "state": self._state,
            "routing_table_size": sum(len(b) for b in protocol.router.buckets) if protocol is not None else 0,
            "stored_keys": len(self.storage),
            "stored_records": self.storage.record_count(),
            "rejected": dict(sorted((self.storage.rejected + self._lookup_rejected).items())),
            "dropped_datagrams": dropped,
            "dropped_datagrams_total": sum(dropped.values()),
            "auth_refused": self.auth_refused(),
            "outstanding_rpcs": protocol.outstanding if protocol is not None else 0,
            "rpcs_sent": dict(sorted(protocol.sent.items())) if protocol is not None else {},
            "rpcs_timed_out": dict(sorted(protocol.timed_out.items())) if protocol is not None else {},
            "sources": self.flood_stats(),
            "tasks": len(self._ops) + len(self._background) + (len(protocol.tasks) if protocol is not None else 0),
        }

    def __repr__(self) -> str:
        where = _fmt(self._address) if self._address else "unbound"
        return f"DHTNode(peer_id={self.identity.peer_id[:12]}..., {where}, {self._state})"
