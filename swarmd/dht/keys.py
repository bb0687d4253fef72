"""The DHT keys swarmd stores its records under, and the bucket a stage's peer record goes to.

A swarm's :class:`~swarmd.dht.records.SwarmRecord` lives under :func:`swarm_key`; a stage's
:class:`~swarmd.dht.records.PeerRecord` s are spread over ``bucket_count`` keys
(:func:`stage_key`), a peer's record going first to :func:`bucket_of` its id, so that one key's
bundle stays under a datagram (the sizes are in :mod:`swarmd.dht.node`'s docstring). Every peer
of a swarm must use the same ``bucket_count``.
"""

from __future__ import annotations

import hashlib

__all__ = ["DEFAULT_STAGE_BUCKETS", "KEY_PREFIX", "bucket_of", "stage_key", "swarm_key"]

DEFAULT_STAGE_BUCKETS = 4
KEY_PREFIX = "swarmd/1"


def swarm_key(swarm: str) -> str:
    """The DHT key of a swarm's :class:`~swarmd.dht.records.SwarmRecord`."""
    return f"{KEY_PREFIX}/{swarm}/swarm"


def stage_key(swarm: str, stage: int, bucket: int) -> str:
    """The DHT key of one bucket of a stage's :class:`~swarmd.dht.records.PeerRecord` s."""
    return f"{KEY_PREFIX}/{swarm}/stage/{stage}/{bucket}"


def bucket_of(peer_id: str, bucket_count: int = DEFAULT_STAGE_BUCKETS) -> int:
    """The bucket a peer's record goes to first (a hash of its id, so peers spread evenly)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big") % bucket_count
