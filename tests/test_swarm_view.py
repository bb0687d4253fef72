"""The trainer's view of the swarm (swarmd.train.swarm_view): the /swarm listing, typed for the routers."""

from __future__ import annotations

from typing import Any

from swarmd.api.models import SwarmView
from swarmd.peer_state import PeerState
from swarmd.pipeline.routing import PeerView, StageRouter
from swarmd.train.swarm_view import peer_views


def body(*stages: list[dict[str, Any]]) -> SwarmView:
    """A ``GET /swarm`` body listing ``stages`` (each a list of peers: ``peer_id``, ``state``, ...)."""

    def peer(p: dict[str, Any]) -> dict[str, Any]:
        return {"data_addr": f"{p['peer_id']}:1", "api_addr": "x:2", "throughput": 1.0, "queue": 0, "step": 0,
                "params_digest": None, "version": "0", "age_s": 0.1, "state": "serving", **p}

    return SwarmView.model_validate({
        "swarm": "s", "model": {"name": "m", "digest": "d", "spec": {}}, "training": {}, "dht": {},
        "stages": [{"stage": k, "throughput": 1.0, "peers": [peer(p) for p in peers]} for k, peers in enumerate(stages)],
    })


def test_the_listing_becomes_typed_peers_and_unknown_values_do_not_break_it() -> None:
    views = peer_views(body(
        [{"peer_id": "a"}, {"peer_id": "b", "state": "draining", "reachable": "yes"}],
        [{"peer_id": "c", "reachable": "no"}, {"peer_id": "d", "state": "hibernating"},  # a newer peer's state
         {"peer_id": "e", "reachable": "sometimes"}],
    ))
    assert views == {
        0: [PeerView("a", 0, "a:1", PeerState.SERVING, "unknown"), PeerView("b", 0, "b:1", PeerState.DRAINING, "yes")],
        1: [PeerView("c", 1, "c:1", PeerState.SERVING, "no"), PeerView("e", 1, "e:1", PeerState.SERVING, "unknown")],
    }
    assert [p.usable for p in views[0] + views[1]] == [True, False, False, True]
    router = StageRouter(1)
    router.update_peers(views[1])
    assert [p.peer_id for p in router.snapshot()] == ["e"]  # the unreachable one is listed, never routed to
