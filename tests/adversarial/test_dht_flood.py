"""The DHT under a record flood (issue 18): source quotas and fair shares of a full key.

Pure rules first (source grouping, victim choice), then the storage with signed records, then a
real loopback DHT that one attacker node floods with 1,000 validly signed serving records (fresh
identities, half per stage): the real peers stay listed and readable on every node, the fakes
held per key stay within the attacker's quota, and the refusals are counted by source.
"""

from __future__ import annotations

import logging
import time

import pytest

from swarmd.dht import DHTNode, Identity, PeerRecord, sign_record, stage_key
from swarmd.dht.node import bucket_of
from swarmd.dht.protocol import MAX_BUNDLE_BYTES
from swarmd.dht.records import bundle_size, encode_bundle
from swarmd.dht.sources import LOCAL, Held, RateLimiter, choose_victims, source_group
from swarmd.dht.storage import RecordStorage
from tests.support.dht import dht_network

KEY = b"k" * 20


def record(identity: Identity, *, stage: int = 0, addr: str = "203.0.113.45:31337", ts: float | None = None) -> bytes:
    now = time.time() if ts is None else ts
    return sign_record(identity, PeerRecord(
        peer_id=identity.peer_id, stage=stage, state="serving", data_addr=addr,
        api_addr="[2001:db8:85a3::8a2e:370:7334]:31338", throughput=10.0, queue=0, step=3,
        params_digest="ab" * 32, version="0.1.0", timestamp=now, expiry=now + 60.0, reachable="yes"))


def bundles(raws: list[bytes]) -> list[bytes]:
    """Pack records into as few store-sized bundles as fit (what a flooder sends)."""
    out: list[list[bytes]] = [[]]
    for raw in raws:
        if out[-1] and bundle_size([*out[-1], raw]) > MAX_BUNDLE_BYTES:
            out.append([])
        out[-1].append(raw)
    return [encode_bundle(b) for b in out]


# --- pure rules --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("sender", "grouping", "group"), [
    (("93.184.216.34", 4000), "auto", "93.184.216.0/24"),
    (("203.0.113.99", 4001), "prefix", "203.0.113.0/24"),
    (("::ffff:93.184.216.7", 1), "auto", "93.184.216.0/24"),  # dual-stack socket, IPv4 peer
    (("203.0.113.7", 1), "auto", "203.0.113.7"),  # a documentation range is not global
    (("2001:db8:1:2:3:4:5:6", 9), "prefix", "2001:db8:1:2::/64"),
    (("2a00:1450:4001:80b::200e", 9), "auto", "2a00:1450:4001:80b::/64"),
    (("10.213.7.3", 31337), "auto", "10.213.7.3"),  # a LAN: each host on its own
    (("100.64.1.2", 31337), "auto", "100.64.1.2"),  # a carrier's NAT
    (("fd00::5", 31337), "auto", "fd00::5"),
    (("127.0.0.1", 4000), "auto", "127.0.0.1:4000"),  # one machine: the port tells daemons apart
    (("::1", 4000), "auto", "[::1]:4000"),
    (("127.0.0.1", 4000), "address", "127.0.0.1"),
    (("203.0.113.45", 4000), "endpoint", "203.0.113.45:4000"),
    (None, "auto", LOCAL),
])
def test_source_groups(sender, grouping, group):
    assert source_group(sender, grouping) == group


def test_an_unknown_grouping_is_refused():
    with pytest.raises(ValueError, match="grouping"):
        source_group(("127.0.0.1", 1), "subnet")  # type: ignore[arg-type]


def test_victims_come_from_the_largest_group_youngest_first_and_only_while_fair():
    held = [Held(f"a{i}", "A", born=i) for i in range(5)] + [Held("b0", "B", 10), Held("b1", "B", 11)]

    def room(n: int):
        return lambda evicted: len(evicted) >= n

    assert choose_victims(held, "C", room(1)) == ["a4"]  # the youngest of the largest group
    assert choose_victims(held, "C", room(3)) == ["a4", "a3", "a2"]  # A: 2 left, C: 1
    assert choose_victims(held, "C", room(4)) == ["a4", "a3", "a2", "b1"]  # then A and B tie at 2: B's name wins
    assert choose_victims(held, "C", room(6)) is None  # no fair way to make that much room
    assert choose_victims(held, "A", room(1)) is None  # the largest group never evicts
    assert choose_victims(held, "B", room(1)) == ["a4"]  # B (2 -> 3) may take from A (5 -> 4)
    assert choose_victims([Held("x", "X", 0)], "Y", room(1)) is None  # one each: nobody is over-represented
    assert choose_victims(held, "C", room(0)) == []


def test_the_rate_limiter_lets_one_event_per_key_and_period_through():
    now = [0.0]
    limiter = RateLimiter(60.0, clock=lambda: now[0], max_keys=2)
    assert limiter.allow("a") and not limiter.allow("a") and limiter.allow("b")
    assert limiter.take_suppressed("a") == 1 and limiter.take_suppressed("a") == 0
    now[0] = 61.0
    assert limiter.allow("a")
    assert limiter.allow("c")  # a third key: the oldest ("b") is forgotten, memory stays bounded
    assert not limiter.allow("a") and not limiter.allow("c")


# --- the storage ---------------------------------------------------------------------------------------


def test_one_source_places_at_most_its_quota_under_a_key_and_its_incumbents_keep_refreshing():
    storage = RecordStorage(max_per_source=8)
    attackers = [Identity.generate() for _ in range(20)]
    result = storage.merge(KEY, encode_bundle([record(i, addr="1:1") for i in attackers]), source="198.51.100.0/24")
    assert (result.accepted, result.rejected) == (8, 12) and not result.ok
    assert storage.rejected["source_quota"] == 12
    held = set(storage.records(KEY))
    later = time.time() + 1
    refresh = storage.merge(KEY, encode_bundle([record(i, addr="1:1", ts=later) for i in attackers[:8]]),
                            source="198.51.100.0/24")
    assert refresh.ok and refresh.accepted == 8 and set(storage.records(KEY)) == held
    other = Identity.generate()
    assert storage.merge(KEY, encode_bundle([record(other)]), source="192.0.2.0/24").ok
    mine = Identity.generate()
    for _ in range(2):  # this node's own records: no quota
        assert storage.merge(KEY, encode_bundle([record(mine)]), source=None).ok
    stats = storage.flood_stats()
    assert stats["refused_over_quota"] == 12 and stats["top_refused_sources"][0] == {
        "source": "198.51.100.0/24", "refused": 12}
    assert storage.sources(KEY)[other.peer_id] == "192.0.2.0/24" and storage.sources(KEY)[mine.peer_id] == LOCAL


def test_a_thousand_fakes_neither_crowd_out_nor_evict_the_real_peers(caplog):
    """1,000 validly signed records from 4 sources against 10 real peers from their own addresses,
    in both orders: the flood first (the key is full of fakes when the real peers announce) and
    the real peers first (the flood arrives at a key that holds them)."""
    real = [Identity.generate() for _ in range(10)]
    fakes = [record(Identity.generate(), addr="127.0.0.1:9") for _ in range(1000)]
    flood_sources = [f"198.51.{k}.0/24" for k in range(4)]  # 4 x 8 = 32 > the 26 records a key holds

    def flood(storage: RecordStorage) -> None:
        for n, bundle in enumerate(bundles(fakes)):
            storage.merge(KEY, bundle, source=flood_sources[n % len(flood_sources)])

    def announce(storage: RecordStorage) -> None:
        for k, identity in enumerate(real):
            assert storage.merge(KEY, encode_bundle([record(identity)]), source=f"192.0.{k}.0/24").ok

    real_ids = {i.peer_id for i in real}
    with caplog.at_level(logging.WARNING, logger="swarmd.dht.storage"):
        first_flood = RecordStorage()
        flood(first_flood)
        assert first_flood.rejected["full"] > 0 and len(first_flood.records(KEY)) >= 26  # full of fakes
        announce(first_flood)  # each real newcomer takes the place of a fake of the largest group
        flood(first_flood)  # and the refreshed flood takes none of them back
    held = first_flood.records(KEY)
    assert real_ids <= set(held) and len(held) >= 26
    groups = first_flood.sources(KEY)
    fakes_per_source = [sum(g == s for g in groups.values()) for s in flood_sources]
    assert max(fakes_per_source) - min(fakes_per_source) <= 1  # the rest shared fairly
    assert sum(first_flood.evicted.values()) >= 10 and set(first_flood.evicted) <= set(flood_sources)
    assert first_flood.rejected["source_quota"] + first_flood.rejected["full"] >= 2000 - 2 * 28  # held: <= 28 a round
    assert all(held[pid].data_addr == "203.0.113.45:31337" for pid in real_ids)  # readable, intact
    # the refusals were said, one line per source per minute, not one per record
    lines = [r for r in caplog.records if "refused records from" in r.getMessage()]
    assert 1 <= len(lines) <= len(flood_sources)

    real_first = RecordStorage()
    announce(real_first)
    flood(real_first)
    held = real_first.records(KEY)
    assert real_ids <= set(held) and set(real_first.evicted) <= set(flood_sources)  # fakes only made room among fakes
    assert len(held) - len(real_ids) <= 4 * 8


# --- a real DHT ---------------------------------------------------------------------------------------


async def test_a_dht_flooded_with_a_thousand_records_keeps_listing_its_real_peers():
    """7 DHT nodes, 4 of them real peers (2 per stage) announcing from their own ports; one
    attacker node floods 1,000 serving records (500 per stage) in bundles to every bucket key."""
    swarm = "flooded"
    async with dht_network(8, rpc_timeout=5.0) as nodes:
        attacker, peers, readers = nodes[-1], nodes[:4], nodes[4:7]
        real = {n.peer_id: k % 2 for k, n in enumerate(peers)}

        async def announce(subset: list[DHTNode]) -> None:
            for n in subset:
                assert await n.store_peer(swarm, record(n.identity, stage=real[n.peer_id])) >= 7  # all others

        async def flood() -> None:
            by_key: dict[str, list[bytes]] = {}
            for k in range(1000):
                identity = Identity.generate()
                key = stage_key(swarm, k % 2, bucket_of(identity.peer_id))
                by_key.setdefault(key, []).append(record(identity, stage=k % 2, addr="127.0.0.1:9"))
            for key, raws in by_key.items():
                chunk: list[bytes] = []
                for raw in raws:
                    if chunk and bundle_size([*chunk, raw]) > MAX_BUNDLE_BYTES:
                        await attacker.store_many(key, chunk)
                        chunk = []
                    chunk.append(raw)
                await attacker.store_many(key, chunk)

        await announce(peers[:2])  # one real peer per stage before the flood
        await flood()
        await announce(peers[2:])  # one more per stage after it: newcomers still get in
        await announce(peers)  # and everybody's refresh is accepted
        for reader in readers:
            for stage in (0, 1):
                listed = await reader.get_stage_peers(swarm, stage)
                mine = {pid for pid, s in real.items() if s == stage}
                assert mine <= set(listed), (reader, stage)
                assert all(listed[pid].data_addr == "203.0.113.45:31337" for pid in mine)
                assert len(set(listed) - mine) <= 4 * 2 * 8  # about twice the quota per bucket key (_get_merged)
        # the attacker, a replica itself, answers lookups with every fake it minted: records that no
        # replica of another source holds are its own, and are not listed
        assert sum(r.stats()["rejected"].get("one_replica", 0) for r in readers) > 0
        attacker_group = source_group(attacker.address)
        honest = nodes[:7]
        refused = sum(n.stats()["sources"]["refused_over_quota"] for n in honest)
        assert refused >= (len(honest) - 1) * (1000 - 2 * 4 * 8)  # (nearly) every node refused the rest
        tops = [n.stats()["sources"]["top_refused_sources"][0]["source"] for n in honest]
        assert tops.count(attacker_group) >= len(honest) - 1


# --- views: peers the daemon holds evidence against ----------------------------------------------------


async def test_views_leave_out_the_peers_with_evidence_against_them_and_say_why(caplog):
    from swarmd.dht.membership import Membership

    evidence: dict[str, str] = {}
    async with dht_network(4, rpc_timeout=5.0) as nodes:
        me, real, *fakes = nodes
        for n, stage in ((me, 0), (real, 1), (fakes[0], 0), (fakes[1], 1)):
            assert await n.store_peer("s", record(n.identity, stage=stage)) >= 2
        evidence.update({fakes[0].peer_id: "never_answered", fakes[1].peer_id: "failed_proof",
                         me.peer_id: "excluded"})  # evidence against oneself is ignored
        membership = Membership(me, me.identity, "s", ttl_s=30.0, evidence=lambda: evidence)
        with caplog.at_level(logging.WARNING, logger="swarmd.dht.membership"):
            for _ in range(3):
                stages = await membership.stage_peers(2)
        assert [set(s) for s in stages] == [{me.peer_id}, {real.peer_id}]
        untrusted = membership.untrusted()
        assert untrusted["dropped"] == {"failed_proof": 1, "never_answered": 1}
        assert untrusted["dropped_peers_total"] == {"failed_proof": 1, "never_answered": 1}  # distinct peers
        assert {p["peer_id"] for p in untrusted["peers"]} == {f.peer_id for f in fakes}
        assert {p["data_addr"] for p in untrusted["peers"]} == {"203.0.113.45:31337"}
        lines = [r.getMessage() for r in caplog.records if "left 2 peer(s) out" in r.getMessage()]
        assert len(lines) == 1 and "1 failed_proof, 1 never_answered" in lines[0]  # once, not per read
        evidence.clear()  # the evidence lapsed (a peer proved itself): listed again
        assert [set(s) for s in await membership.stage_peers(2)] == [{me.peer_id, fakes[0].peer_id},
                                                                     {real.peer_id, fakes[1].peer_id}]
        assert membership.untrusted()["dropped"] == {}


def test_the_source_quota_and_grouping_flags_reach_the_dht_node() -> None:
    """``--dht-source-quota`` / ``--dht-source-grouping`` (and their ``--config`` keys) set the storing
    node's per-source quota; the CLI spells out the groupings so that ``--help`` imports no DHT code."""
    from swarmd.cli import serve
    from swarmd.dht.sources import GROUPINGS

    assert serve.DHT_GROUPINGS == GROUPINGS
    args = serve.build_parser().parse_args(["--dht-source-quota", "3", "--dht-source-grouping", "address"])
    dht = serve.config_from_args(args).dht
    assert (dht.max_per_source, dht.source_grouping) == (3, "address")
    node = DHTNode(Identity.generate(), max_per_source=dht.max_per_source, source_grouping="address")
    assert node.storage.max_per_source == 3 and node.flood_stats()["grouping"] == "address"
