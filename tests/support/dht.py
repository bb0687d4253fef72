"""DHT fixtures: signed peer records and networks of real DHT nodes on loopback UDP."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from swarmd.dht import (
    DHTNode,
    Identity,
    PeerRecord,
    sign_record,
)


def peer_record(
    identity: Identity, *, stage: int = 0, ttl: float = 30.0, step: int = 0, compact: bool = False
) -> bytes:
    """A signed PeerRecord; ``compact`` ones (short addresses, no digest) fit 30 to a key."""
    now = time.time()
    record = PeerRecord(
        peer_id=identity.peer_id,
        stage=stage,
        state="serving",
        data_addr="10.0.0.1:1" if compact else "203.0.113.45:31337",
        api_addr="" if compact else "[2001:db8:85a3::8a2e:370:7334]:31338",
        throughput=10.0,
        queue=0,
        step=step,
        params_digest=None if compact else "ab" * 32,
        version="0.1.0",
        timestamp=now,
        expiry=now + ttl,
    )
    return sign_record(identity, record)


@contextlib.asynccontextmanager
async def dht_network(n: int, *, star: bool = False, **options: Any) -> AsyncIterator[list[DHTNode]]:
    """``n`` nodes, each bootstrapped from the first (star) or from the previous one (chain);
    all stopped in ``finally``, after which not one of their tasks may be left."""
    options.setdefault("rpc_timeout", RPC_TIMEOUT)
    nodes: list[DHTNode] = []
    try:
        for i in range(n):
            node = DHTNode(Identity.generate(), **options)
            nodes.append(node)
            await node.start([] if i == 0 else [(nodes[0] if star else nodes[i - 1]).address])
        yield nodes
    finally:
        for node in nodes:
            await node.stop()
    assert asyncio.all_tasks() == {asyncio.current_task()}


RPC_TIMEOUT = 0.5
