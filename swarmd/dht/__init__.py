"""Kademlia membership: signed peer and swarm records, merged per peer under shared keys.

- :mod:`~swarmd.dht.identity`: the peer's ed25519 key pair and the peer id derived from it;
- :mod:`~swarmd.dht.records`: the signed, versioned records and their msgpack envelope;
- :mod:`~swarmd.dht.storage`: per-node storage that merges records per subkey, with caps;
- :mod:`~swarmd.dht.protocol`: kademlia's RPCs over UDP, hardened and with owned tasks;
- :mod:`~swarmd.dht.keys`: the keys records are stored under (a stage's spread over buckets);
- :mod:`~swarmd.dht.bootstrap`, :mod:`~swarmd.dht.publishing`, :mod:`~swarmd.dht.lookups`: joining,
  storing on the k closest nodes, reading from every replica and merging what they vouch for;
- :mod:`~swarmd.dht.node`: :class:`DHTNode`, the daemon's handle on all of it.
"""

from swarmd.dht.identity import Identity, peer_id_of, verify
from swarmd.dht.keys import DEFAULT_STAGE_BUCKETS, bucket_of, stage_key, swarm_key
from swarmd.dht.node import DHTNode
from swarmd.dht.protocol import MAX_BUNDLE_BYTES, MAX_DATAGRAM, RPC_MAX_PAYLOAD
from swarmd.dht.records import (
    MAX_RECORD_BYTES,
    MAX_TTL_S,
    PEER_STATES,
    PeerRecord,
    Record,
    RecordCache,
    SwarmRecord,
    open_record,
    sign_record,
)
from swarmd.dht.storage import MergeResult, RecordStorage

__all__ = [
    "DEFAULT_STAGE_BUCKETS",
    "MAX_BUNDLE_BYTES",
    "MAX_DATAGRAM",
    "MAX_RECORD_BYTES",
    "MAX_TTL_S",
    "PEER_STATES",
    "RPC_MAX_PAYLOAD",
    "DHTNode",
    "Identity",
    "MergeResult",
    "PeerRecord",
    "Record",
    "RecordCache",
    "RecordStorage",
    "SwarmRecord",
    "bucket_of",
    "open_record",
    "peer_id_of",
    "sign_record",
    "stage_key",
    "swarm_key",
    "verify",
]
