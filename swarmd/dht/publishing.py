"""Storing (Maymounkov & Mazières, section 2.3): a record on the k closest nodes of its key, and a
stage's peer record in a bucket that has room.

A store finds the k closest nodes to the key (``NodeSpiderCrawl``) and sends each a one-record
bundle; it also keeps the record itself when it is among the k closest (kademlia's
``Server.set_digest`` rule): about 40 RPCs in a 100-node DHT (a node lookup, then k ``store``
RPCs). A stage's peer records are spread over ``bucket_count`` keys (:mod:`swarmd.dht.keys`);
when most replicas of a bucket refuse a record (the bucket is full there, or its source group is
over quota), :class:`StageBuckets` moves on to the next bucket (readers read all of them anyway),
so the whole capacity is usable despite hash imbalance.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from kademlia.crawling import NodeSpiderCrawl
from kademlia.node import Node
from kademlia.utils import digest

from swarmd.dht.keys import bucket_of, stage_key
from swarmd.dht.protocol import DHTProtocol, gather_all
from swarmd.dht.records import PeerRecord, encode_bundle
from swarmd.dht.storage import RecordStorage

log = logging.getLogger("swarmd.dht.node")  # the node's lines, under the name they always had


async def store_closest(
    protocol: DHTProtocol, own: Node, storage: RecordStorage, dkey: bytes, bundle: bytes, ksize: int, alpha: int
) -> tuple[int, int]:
    """Merge-store ``bundle`` under ``dkey`` on the k closest nodes, and in ``storage`` when this
    node (``own``) is one of them: ``(nodes that accepted it, nodes that refused it)``."""
    target = Node(dkey)
    nearest = protocol.router.find_neighbors(target)
    closest: list[Node] = []
    if nearest:
        found = await NodeSpiderCrawl(protocol, target, nearest, ksize, alpha).find()
        closest = [n for n in found if n.id != own.id]
    accepted = refused = 0
    if len(closest) < ksize or own.distance_to(target) < max(n.distance_to(target) for n in closest):
        if storage.merge(dkey, bundle).ok:
            accepted += 1
        else:
            refused += 1
    for answered, ok in await gather_all(*(protocol.call_store(n, dkey, bundle) for n in closest)):
        if answered and ok:
            accepted += 1
        elif answered:
            refused += 1
    return accepted, refused


class StageBuckets:
    """Which bucket of its stage a peer's record goes to: the one that last held it, else
    :func:`~swarmd.dht.keys.bucket_of` its id, moving on while most replicas refuse it."""

    def __init__(self, bucket_count: int) -> None:
        self.bucket_count = bucket_count
        self._held: dict[tuple[str, int], int] = {}  # (swarm, stage) -> the bucket that last held the record

    async def store(self, swarm: str, peer: PeerRecord, record: bytes,
                    store: Callable[[bytes, bytes], Awaitable[tuple[int, int]]]) -> int:
        """Store ``record`` (``peer``, opened) with ``store(dkey, bundle)`` in its stage's bucket,
        or the next ones while it is full; the number of nodes that accepted it."""
        first = self._held.get((swarm, peer.stage), bucket_of(peer.peer_id, self.bucket_count))
        bundle = encode_bundle([record])
        best = 0
        for i in range(self.bucket_count):
            bucket = (first + i) % self.bucket_count
            accepted, refused = await store(digest(stage_key(swarm, peer.stage, bucket)), bundle)
            if accepted >= refused:  # most replicas hold it (or nobody answered: no bucket would do better)
                self._held[(swarm, peer.stage)] = bucket
                return accepted
            # Most replicas refused a valid record: the bucket is full there. A few that accepted
            # it (replica sets found by different writers differ a little) are harmless: readers
            # merge every bucket, newest record per peer.
            best = max(best, accepted)
            log.info("stage %d bucket %d of swarm %r is full; trying the next bucket", peer.stage, bucket, swarm)
        log.warning("every bucket of stage %d of swarm %r is full; record held by %d nodes", peer.stage, swarm, best)
        return best
