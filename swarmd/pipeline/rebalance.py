"""Which stage a peer should serve: pure functions over a snapshot of the swarm.

SWARM (paper, section 3.3 and Algorithm 2) keeps the pipeline balanced by sending peers where
throughput is lowest: a pipeline runs at the speed of its slowest stage. This module starts with
the newcomer's rule; the periodic rebalancing policies build on the same snapshot type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageLoad:
    """One stage as the DHT shows it: how many peers serve it and their summed throughput."""

    stage: int
    peers: int
    throughput: float  # samples/s, summed over the stage's peers


def choose_stage(loads: Sequence[StageLoad]) -> int:
    """The stage a newcomer should join: the lowest total throughput.

    Ties go to the stage with the fewest peers (a fresh peer reports 0 samples/s, so an empty
    stage beats one whose only peer has not measured itself yet), then the lowest index.
    """
    if not loads:
        raise ValueError("choose_stage needs at least one stage")
    return min(loads, key=lambda s: (s.throughput, s.peers, s.stage)).stage
