"""Where a stage's state comes from when a peer starts serving it: never fresh once the swarm trained.

SWARM peers that join a stage download its state from a peer serving it (paper, section 3.2).
In a volunteer swarm that is not always possible: a whole swarm stops and restarts, a stage
loses every peer, a peer moves (by hand or by the rebalancer) to a stage nobody serves. The
state then still exists on disk: in this peer's own ``--state-dir`` (checkpoints of every stage
it ever served) or in another live peer's, which offers it to the swarm (its record lists the
newest checkpoint of each stage it holds; ``GET /v1/checkpoint/{stage}`` streams it). A peer
that serves a stage -- at start-up, by ``--stage``, by ``POST /migrate`` or by the rebalancer --
takes the newest of all of these (:func:`plan`), and serves fresh parameters only while nothing
in the swarm has trained. A stage whose state is nowhere (trained swarm, no live peer, no
checkpoint offered) is *lost*: the peer says so loudly and waits for a peer that holds it rather
than start the stage again from step 0 under a pipeline that is at step 350.

Order among sources of the same step: a live stage-mate first (its state is the stage's current
one, and the stage stays bit-identical), then this peer's own checkpoint (no transfer), then an
offered one. A newer source always wins over an older one, so a peer restarted with an old
checkpoint of a stage does not drag it back, and a live peer that resumed from an older
checkpoint than someone else's is overtaken (the averaging rounds then bring it along).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Offer", "Plan", "Source", "plan"]


class Source(enum.Enum):
    """Where one candidate state of a stage lies."""

    LIVE = "live"  # a serving stage-mate: downloaded with GET /v1/state
    OWN = "own"  # this peer's own checkpoint under --state-dir
    OFFERED = "offered"  # another peer's checkpoint: downloaded with GET /v1/checkpoint/{stage}
    FRESH = "fresh"  # nothing in the swarm has trained: the deterministic initial parameters
    LOST = "lost"  # the swarm trained, and nothing anywhere holds this stage's state


_RANK = {Source.LIVE: 0, Source.OWN: 1, Source.OFFERED: 2}


@dataclass(frozen=True)
class Offer:
    """One candidate: a source and the step its state is at (``peer_id`` for live and offered ones)."""

    source: Source
    step: int
    peer_id: str | None = None


@dataclass(frozen=True)
class Plan:
    """The candidates to try, best first; ``fallback`` is what to do when every one fails (or there
    is none): ``FRESH`` while the swarm has not trained, else ``LOST``."""

    candidates: tuple[Offer, ...]
    fallback: Source

    @property
    def best(self) -> Offer | None:
        return self.candidates[0] if self.candidates else None

    @property
    def available(self) -> bool:
        """Whether the stage's state can be had (or the stage may start fresh)."""
        return bool(self.candidates) or self.fallback is Source.FRESH


def plan(*, live: Iterable[tuple[str, int]] = (), own: int | None = None,
         offered: Iterable[tuple[str, int]] = (), swarm_trained: bool, min_step: int = 0) -> Plan:
    """Every source of a stage's state at ``min_step`` or later, newest first (ties: live, own,
    offered; then peer id), and the fallback. ``live``: serving stage-mates ``(peer_id, step)``;
    ``own``: the step of this peer's newest valid checkpoint of the stage; ``offered``: other peers'
    checkpoints ``(peer_id, step)``; ``swarm_trained``: whether anything in the swarm has stepped."""
    found: list[Offer] = [Offer(Source.LIVE, step, pid) for pid, step in live]
    if own is not None:
        found.append(Offer(Source.OWN, own))
    found += [Offer(Source.OFFERED, step, pid) for pid, step in offered]
    found = [o for o in found if o.step >= min_step]
    found.sort(key=lambda o: (-o.step, _RANK[o.source], o.peer_id or ""))
    return Plan(tuple(found), Source.LOST if swarm_trained else Source.FRESH)


def trained(steps: Sequence[int]) -> bool:
    """Whether any of these steps (records' steps, checkpoints held) shows that the swarm trained."""
    return any(s > 0 for s in steps)
