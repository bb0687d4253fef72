"""Benchmark the DHT membership layer: a loopback DHT of many nodes in one process.

Measures, on 127.0.0.1 with every node in this one event loop (so the numbers include the CPU
time of every node a lookup touches, on one core):

- lookup latency: ``get`` of a populated key from a random node (p50/p95, ms);
- stage read latency: ``get_stage_peers`` of a stage of 60 peers spread over 4 bucket keys;
- store latency: ``store`` of one record (lookup of the k closest + k store RPCs);
- time to visibility: from the start of ``store`` on one random node to the first ``get`` on
  another random node that returns the record (p50/p95, ms);
- the sizes everything else derives from: signed record bytes, max datagram, max bundle,
  records per key.

    .venv/bin/python scripts/bench_dht.py --json [--nodes 100] [--gets 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import random
import sys
import time
from importlib.metadata import version

from swarmd.dht import (
    DEFAULT_STAGE_BUCKETS,
    MAX_BUNDLE_BYTES,
    MAX_DATAGRAM,
    DHTNode,
    Identity,
    PeerRecord,
    RecordStorage,
    sign_record,
)
from swarmd.dht.records import encode_bundle
from swarmd.finite import strict_json_dumps


def realistic_record(identity: Identity, *, stage: int = 0, ttl: float = 300.0) -> bytes:
    now = time.time()
    return sign_record(
        identity,
        PeerRecord(
            peer_id=identity.peer_id,
            stage=stage,
            state="serving",
            data_addr="203.0.113.45:31337",
            api_addr="[2001:db8:85a3::8a2e:370:7334]:31338",
            throughput=123.456,
            queue=7,
            step=123456,
            params_digest="ab" * 32,
            version="0.1.0",
            timestamp=now,
            expiry=now + ttl,
        ),
    )


def records_per_key() -> int:
    """How many realistic PeerRecords one key's bundle holds (measured against the storage caps)."""
    storage = RecordStorage()
    held = 0
    for _ in range(100):
        identity = Identity.generate()
        if storage.merge(b"k" * 20, encode_bundle([realistic_record(identity)])).ok:
            held += 1
    return held


def summary(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)

    def pct(p: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(p * len(ordered)))], 2)

    return {"p50": pct(0.50), "p95": pct(0.95), "max": round(1000 * ordered[-1], 2), "n": len(ordered)}


async def bench(n_nodes: int, n_gets: int, n_visibility: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    nodes: list[DHTNode] = []
    try:
        start = time.perf_counter()
        for i in range(n_nodes):
            node = DHTNode(Identity.generate(), rpc_timeout=1.0)
            nodes.append(node)
            await node.start([] if i == 0 else [rng.choice(nodes[:i]).address])
        startup_s = time.perf_counter() - start

        # 20 keys with 10 writers each, and one stage of 60 peers over the default buckets
        keys = [f"bench/key/{k}" for k in range(20)]
        store_s = []
        sent_before = sum(sum(n.stats()["rpcs_sent"].values()) for n in nodes)
        for key in keys:
            for writer in rng.sample(nodes, 10):
                t0 = time.perf_counter()
                await writer.store(key, realistic_record(writer.identity))
                store_s.append(time.perf_counter() - t0)
        rpcs_per_store = (sum(sum(n.stats()["rpcs_sent"].values()) for n in nodes) - sent_before) / len(store_s)
        stage_peers = rng.sample(nodes, 60)
        await asyncio.gather(*(p.store_peer("bench", realistic_record(p.identity, stage=1)) for p in stage_peers))

        sent_before = sum(sum(n.stats()["rpcs_sent"].values()) for n in nodes)
        lookup_s, misses = [], 0
        for _ in range(n_gets):
            reader, key = rng.choice(nodes), rng.choice(keys)
            t0 = time.perf_counter()
            found = await reader.get(key)
            lookup_s.append(time.perf_counter() - t0)
            misses += len(found) != 10
        rpcs_per_lookup = (sum(sum(n.stats()["rpcs_sent"].values()) for n in nodes) - sent_before) / n_gets

        stage_s, stage_misses = [], 0
        for _ in range(max(n_gets // 5, 1)):
            reader = rng.choice(nodes)
            t0 = time.perf_counter()
            found = await reader.get_stage_peers("bench", 1)
            stage_s.append(time.perf_counter() - t0)
            stage_misses += len(found) != 60

        visible_s = []
        for i in range(n_visibility):
            writer, reader = rng.sample(nodes, 2)
            key = f"bench/visibility/{i}"
            t0 = time.perf_counter()
            storing = asyncio.create_task(writer.store(key, realistic_record(writer.identity)))
            while writer.peer_id not in await reader.get(key):
                await asyncio.sleep(0)
            visible_s.append(time.perf_counter() - t0)
            await storing

        rejected = sum(sum(n.stats()["rejected"].values()) for n in nodes)
        dropped = sum(n.stats()["dropped_datagrams_total"] for n in nodes)
        table = sorted(n.stats()["routing_table_size"] for n in nodes)
    finally:
        for node in nodes:
            await node.stop()
    record = realistic_record(Identity.generate())
    return {
        "nodes": n_nodes,
        "ksize": 20,
        "alpha": 3,
        "startup_s": round(startup_s, 3),
        "routing_table_size_median": table[len(table) // 2],
        "lookup_ms": summary(lookup_s),
        "lookup_incomplete": misses,
        "rpcs_per_lookup": round(rpcs_per_lookup, 1),
        "stage_read_ms": summary(stage_s),
        "stage_read_incomplete": stage_misses,
        "stage_peers": 60,
        "stage_buckets": DEFAULT_STAGE_BUCKETS,
        "store_ms": summary(store_s),
        "rpcs_per_store": round(rpcs_per_store, 1),
        "time_to_visibility_ms": summary(visible_s),
        "record_bytes": len(record),
        "max_datagram_bytes": MAX_DATAGRAM,
        "max_bundle_bytes": MAX_BUNDLE_BYTES,
        "records_per_key": records_per_key(),
        "rejected_records": rejected,
        "dropped_datagrams": dropped,
        "python": platform.python_version(),
        "kademlia": version("kademlia"),
        "rpcudp": version("rpcudp"),
        "cpus": os.cpu_count(),
        "seed": seed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--gets", type=int, default=300, help="lookups to time")
    parser.add_argument("--visibility", type=int, default=50, help="publish-then-read trials")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the only output)")
    args = parser.parse_args(argv)
    if args.nodes < 61:
        parser.error("--nodes must be at least 61 (the stage benchmark uses 60 writers)")
    logging.basicConfig(level=logging.ERROR)
    result = asyncio.run(bench(args.nodes, args.gets, args.visibility, args.seed))
    if args.json:
        print(strict_json_dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
