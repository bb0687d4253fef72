"""Routing fixtures: listed peers, routed peer snapshots, a fixed stage map for the trainer's calls."""

from __future__ import annotations

from dataclasses import replace

from swarmd.pipeline.routing import PeerView, RoutedPeer, StageRouter


def listed(peers: dict[str, str], stage: int = 0) -> list[PeerView]:
    """The swarm's view of a stage that lists ``peers`` (``peer_id -> data_addr``), all serving."""
    return [PeerView(peer_id, stage, addr) for peer_id, addr in peers.items()]


PEER = RoutedPeer(peer_id="", addr="", throughput=0.0, measured=False, proven=False, alive=False, weight=1.0,
                  in_flight=0, banned_for_s=0.0, excluded=False, successes=0, failures=0, timeouts=0,
                  consecutive_failures=0)


def peer(peer_id: str, **fields: object) -> RoutedPeer:
    return replace(PEER, peer_id=peer_id, addr=f"{peer_id}:1", **fields)  # type: ignore[arg-type]


class FixedStages:
    """Routers without a swarm behind them (``stage_calls.Stages``): refreshing changes nothing."""

    def __init__(self, routers: list[StageRouter], unreachable: list[str] | None = None) -> None:
        self.routers = routers
        self.refreshes = 0
        self._unreachable = unreachable or []
        self.suspected: frozenset[str] = frozenset()  # peers a daemon's progress answer named as accused once

    async def refresh(self, force: bool = False) -> None:
        self.refreshes += 1

    def unreachable(self, stage: int) -> list[str]:
        return self._unreachable

