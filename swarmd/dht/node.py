"""``DHTNode``: the daemon's only handle on the DHT, and the owner of every task it runs.

It wires kademlia's routing table and crawlers (Maymounkov & Mazières, sections 2.3-2.5) to
:class:`~swarmd.dht.protocol.DHTProtocol` and :class:`~swarmd.dht.storage.RecordStorage`,
and replaces ``kademlia.network.Server``, whose ``listen`` starts fire-and-forget tasks and
whose ``stop`` is synchronous. Here every task (the maintenance loop, each ``get``/``store``,
the protocol's hand-overs and pings) belongs to the node, and :meth:`DHTNode.stop` cancels and
awaits all of them before closing the socket.

Its parts
    :mod:`~swarmd.dht.bootstrap` joins through the bootstrap addresses; :mod:`~swarmd.dht.publishing`
    stores a record on the k closest nodes (and a stage's peer record in a bucket with room);
    :mod:`~swarmd.dht.lookups` reads a key from every replica and merges what enough of them vouch
    for; :mod:`~swarmd.dht.keys` names the keys. Here: the socket, the tasks, the public calls.

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
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kademlia.crawling import NodeSpiderCrawl
from kademlia.node import Node
from kademlia.utils import digest

from swarmd.dht.bootstrap import Bootstrap, fmt_addr, key_hint
from swarmd.dht.identity import Identity
from swarmd.dht.keys import DEFAULT_STAGE_BUCKETS, KEY_PREFIX, bucket_of, stage_key, swarm_key
from swarmd.dht.lookups import find_values, merge_vouched
from swarmd.dht.protocol import DEFAULT_MAX_BULK_RPCS, MAX_BUNDLE_BYTES, DHTProtocol, TaskSet, gather_all
from swarmd.dht.publishing import StageBuckets, store_closest
from swarmd.dht.records import PeerRecord, Record, RecordCache, bundle_size, encode_bundle
from swarmd.dht.sources import DEFAULT_MAX_PER_SOURCE, Grouping
from swarmd.dht.storage import DEFAULT_MAX_KEYS, DEFAULT_MAX_SUBKEYS, RecordStorage
from swarmd.errors import DHTError
from swarmd.swarm_key import SwarmKey

__all__ = [
    "DEFAULT_STAGE_BUCKETS",
    "KEY_PREFIX",
    "DHTNode",
    "bucket_of",
    "stage_key",
    "swarm_key",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


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
        self._buckets = StageBuckets(bucket_count)
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
            raise DHTError(f"cannot bind the DHT's UDP socket to {fmt_addr((self.host, self.port))}: {exc}") from exc
        self._protocol = protocol
        transport = protocol.transport
        sockname = transport.get_extra_info("sockname")
        self._address = (sockname[0], sockname[1])
        self._family = transport.get_extra_info("socket").family
        self._state = "running"
        self._background.spawn(self._maintain(), name="dht maintenance")
        try:
            if bootstrap:
                join = Bootstrap(protocol, self.node, self._address, self._family, rpc_timeout=self.rpc_timeout,
                                 ksize=self.ksize, alpha=self.alpha, hint=self._key_hint)
                await join.join(list(bootstrap), deadline_s, backoff_s, max_backoff_s)
            else:
                log.info("founded a new DHT at %s (peer %s)", fmt_addr(self._address), self.identity.peer_id)
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
        log.info("DHT node %s stopped", fmt_addr(self._address))

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
        answers = await gather_all(*(protocol.observed_from(addr, timeout=timeout) for addr in asked))
        return [(addr, seen[0]) for addr, seen in zip(asked, answers, strict=True) if seen is not None]

    def _key_hint(self) -> str:
        return key_hint(self.swarm_key, self._auth, self._protocol)

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
            await gather_all(*crawls)

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
        return await self._buckets.store(
            swarm, peer, record, lambda dkey, bundle: self._run(self._store(dkey, bundle, prebundled=True)))

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
        bundle = raw if prebundled else encode_bundle([raw])
        return await store_closest(self._proto(), self.node, self.storage, dkey, bundle, self.ksize, self.alpha)

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
        """Every replica's bundle of each key, merged over what enough replicas vouch for
        (:func:`~swarmd.dht.lookups.merge_vouched`)."""
        protocol = self._proto()
        found = await gather_all(*(find_values(protocol, self.storage, dkey, self.ksize, self.alpha) for dkey in dkeys))
        return merge_vouched(found, self.cache, self._clock(), self._lookup_rejected)

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
            "address": fmt_addr(self._address) if self._address else None,
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
        where = fmt_addr(self._address) if self._address else "unbound"
        return f"DHTNode(peer_id={self.identity.peer_id[:12]}..., {where}, {self._state})"
