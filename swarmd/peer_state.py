"""The states a peer goes through, from start-up to stop.

``starting`` → ``joining`` (announced; downloading the stage's state) → ``serving`` ⇄
``migrating`` (moving to another stage) → ``draining`` → ``stopped``. The five in
:data:`ANNOUNCED` appear in DHT peer records, where a state travels as its index in that tuple
(append only, so old and new peers read each other's records). ``stopped`` is a peer's last
record, published when it stops gracefully: it replaces the peer's listing at once, and every
view leaves it out (an older build cannot read the state and drops the record, which is the
same thing), so a stopped peer vanishes at once instead of lingering until its record expires.
"""

from __future__ import annotations

from enum import Enum


class PeerState(str, Enum):
    STARTING = "starting"  # joining the DHT, learning the model, building the stage
    JOINING = "joining"  # announced; downloading its stage's state from a stage-mate
    SERVING = "serving"  # answers forward/backward and takes part in its stage's rounds
    MIGRATING = "migrating"  # moving to another stage (drain, build, download)
    DRAINING = "draining"  # shutting down: finishes in-flight requests, refuses new ones
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


#: The states a DHT peer record can carry, in wire order (the index is what travels).
ANNOUNCED: tuple[PeerState, ...] = (PeerState.JOINING, PeerState.SERVING, PeerState.MIGRATING, PeerState.DRAINING,
                                     PeerState.STOPPED)
#: Records in these states are listed; a ``stopped`` record is a withdrawal and is never listed.
LISTED: tuple[PeerState, ...] = ANNOUNCED[:4]
#: A peer on its way into a stage: it will add capacity there once its download is done.
PENDING: tuple[PeerState, ...] = (PeerState.JOINING, PeerState.MIGRATING)


def usable(state: str, reachable: str) -> bool:
    """Whether trainers and stage-mates may dial a listed peer: serving, and not known to be out of reach
    (``reachable`` is ``yes``, ``no`` or ``unknown``: swarmd.net.reachability). The one rule behind
    ``PeerRecord.usable`` and the router's ``PeerView.usable``."""
    return state == PeerState.SERVING.value and reachable != "no"
