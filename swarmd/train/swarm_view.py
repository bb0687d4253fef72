"""The trainer's view of the swarm: the stage map of ``/swarm``, typed for the routers.

A trainer runs no DHT node (SWARM, section 3.2: trainers are light clients). It reads the stage map
from one daemon's ``GET /swarm`` (the DHT's peer records; ``swarmd.train.swarm_client`` does that
I/O), and the routers take it typed: each listed peer becomes a
:class:`~swarmd.pipeline.routing.PeerView` (:func:`peer_views`), and each stage's
:class:`~swarmd.pipeline.routing.StageRouter` routes to the usable ones.
"""

from __future__ import annotations

from typing import get_args

from swarmd.api import models
from swarmd.peer_state import ANNOUNCED
from swarmd.pipeline.routing import PeerView, Reachability

__all__ = ["peer_views"]

_STATES = {state.value: state for state in ANNOUNCED}
_REACHABILITY: tuple[str, ...] = get_args(Reachability)


def peer_views(body: models.SwarmView) -> dict[int, list[PeerView]]:
    """Every stage's listed peers, typed. The listing is read leniently, like the DHT records it
    shows (old and new peers coexist): a state this build does not know is a peer it cannot
    dial (left out), a reachability it does not know is ``unknown``."""
    return {
        stage.stage: [
            PeerView(p.peer_id, stage.stage, p.data_addr, _STATES[p.state],
                     p.reachable if p.reachable in _REACHABILITY else "unknown")  # type: ignore[arg-type]
            for p in stage.peers if p.state in _STATES
        ]
        for stage in body.stages
    }
