"""Lookups (Maymounkov & Mazières, section 2.3): every replica's bundle of a key, merged over what
enough replicas vouch for.

``DHTNode.get`` does not stop at the first value as kademlia's ``ValueSpiderCrawl`` does (which
then picks the most common value): it crawls until the k closest nodes have all been asked
(:class:`MergingValueSpiderCrawl`) and merges everything they hold (per subkey, newest wins),
with this node's own copy, keeping only the records that replicas of half the source groups that
answered hold, and of two or more (a lone replica's extras are its own, e.g. a flooder's:
:func:`merge_vouched`). A ``get`` therefore costs a full lookup whatever the replicas hold: 22
``find_value`` RPCs on average in a 100-node DHT (k = 20); ``get_stage_peers`` is one ``get`` per
bucket, run in parallel. ``scripts/bench_dht.py`` measures these.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kademlia.crawling import RPCFindResponse, SpiderCrawl
from kademlia.node import Node

from swarmd.dht.protocol import DHTProtocol
from swarmd.dht.records import Record, RecordCache, decode_bundle
from swarmd.dht.sources import LOCAL, source_group
from swarmd.dht.storage import RecordStorage
from swarmd.errors import MalformedRecord, RecordError, RecordExpired

Bundles = list[tuple[str, bytes]]  # (the answering replica's source group, its bundle), for one key


class MergingValueSpiderCrawl(SpiderCrawl):
    """A value lookup (section 2.3) that collects the value of every replica among the k closest.

    ``kademlia.crawling.ValueSpiderCrawl`` returns as soon as one round finds a value and keeps
    the most common one; merged records need them all, so this crawl goes on until every one of
    the k nearest nodes it knows has been asked, and returns every value (bundle) it received.
    """

    def __init__(self, protocol: DHTProtocol, node: Node, peers: list[Node], ksize: int, alpha: int) -> None:
        super().__init__(protocol, node, peers, ksize, alpha)
        self.values: Bundles = []

    async def find(self) -> Bundles:
        return await self._find(self.protocol.call_find_value)

    async def _nodes_found(self, responses: dict[bytes, tuple[bool, Any]]) -> Bundles:
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


async def find_values(protocol: DHTProtocol, storage: RecordStorage, dkey: bytes, ksize: int, alpha: int) -> Bundles:
    """Every bundle held under ``dkey``: this node's own (source group ``local``), then each replica's."""
    values: Bundles = []
    local = storage.get(dkey)
    if local is not None:
        values.append((LOCAL, local))
    target = Node(dkey)
    nearest = protocol.router.find_neighbors(target)
    if nearest:
        values.extend(await MergingValueSpiderCrawl(protocol, target, nearest, ksize, alpha).find())
    return values


def merge_vouched(
    found: Sequence[Bundles], cache: RecordCache, now: float, rejected: Counter[str]
) -> dict[str, Record]:
    """Every replica's bundle of each key, merged per subkey (newest wins) over the records that
    replicas of at least half the source groups that answered with a value hold, and of at least
    two when two or more answered. A replica can answer a lookup with whatever it likes, so a
    record only it (or its /24) vouches for is a flooder's own, and is dropped (counted in
    ``rejected`` as ``one_replica``, with the records refused as invalid); and since each honest
    replica holds at most its quota of one source's records per key, a flooder that is a replica
    itself is listed at most about twice that quota per key, whatever it sends to whom. Honest
    stores reach every replica of the k closest (and ``store_peer`` keeps a record where most
    accept it), so real records pass."""
    merged: dict[str, tuple[Record, bytes]] = {}
    for bundles in found:
        versions: dict[str, tuple[Record, bytes]] = {}
        vouchers: dict[str, set[str]] = {}
        groups = {group for group, _ in bundles}
        for group, bundle in bundles:
            try:
                raws = decode_bundle(bundle)
            except MalformedRecord:
                rejected[MalformedRecord.reason] += 1
                continue
            for raw in raws:
                try:
                    record = cache.open(raw, now=now)
                except RecordExpired:
                    continue  # normal: it expired between the replica's check and ours
                except RecordError as exc:
                    rejected[exc.reason] += 1
                    continue
                vouchers.setdefault(record.subkey, set()).add(group)
                held = versions.get(record.subkey)
                if held is None or (held[0].timestamp, held[1]) < (record.timestamp, raw):
                    versions[record.subkey] = (record, raw)
        needed = max(min(2, len(groups)), (len(groups) + 1) // 2)
        for subkey, (record, raw) in versions.items():
            if len(vouchers[subkey]) < needed:
                rejected["one_replica"] += 1
                continue
            held = merged.get(subkey)
            if held is None or (held[0].timestamp, held[1]) < (record.timestamp, raw):
                merged[subkey] = (record, raw)
    return {subkey: record for subkey, (record, _) in merged.items()}
