"""Is every stage covered? The health of each stage as the swarm's records show it (pure).

A SWARM pipeline trains only while every stage has a peer (paper, section 3: a microbatch must
pass every stage), and a stage with one peer is one crash away from stopping it (its state then
survives only in checkpoints). So every daemon sums up each stage from the DHT records it reads
-- the peers' own reports -- and says, in its log, ``/status``, ``/metrics``, the dashboard and
``swarmd status``, which stages are in trouble and what to do about it:

- ``ok``: two or more peers serve it;
- ``thin``: one peer serves it: no redundancy; start another peer (``--stage auto`` goes where
  it is needed);
- ``starting``: no peer serves it yet, but one is on its way (joining or migrating into it);
- ``empty``: no peer at all, but its state exists (a checkpoint a live peer offers, or nothing
  has trained yet): the rebalancer moves a peer there at its next decision, or start one;
- ``lost``: no peer, the swarm has trained, and no live peer offers a checkpoint of it: the
  stage cannot train until a peer that served it comes back with its ``--state-dir``.

Each stage's step is the newest step a serving peer reports, with the age of that report, so a
view never passes off an old number as current.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarmd.dht.records import PeerRecord

__all__ = ["HEALTHS", "StageHealth", "stage_health", "trouble"]

HEALTHS = ("ok", "thin", "starting", "empty", "lost")

_HINTS = {
    "ok": "",
    "thin": "one peer serves stage {stage}: if it fails the stage stops until another peer takes over; start "
            "another peer (swarmd --join ...; --stage auto goes where a peer is needed)",
    "starting": "no peer serves stage {stage} yet; {pending} peer(s) on the way (downloading its state)",
    "empty": "no peer serves stage {stage}, so the pipeline cannot train: the rebalancer moves a peer there when "
             "another stage has two, or start a peer (swarmd --join ...)",
    "lost": "no peer serves stage {stage} and no live peer holds a checkpoint of it, but the swarm has trained: "
            "restart a peer that served stage {stage} with its --state-dir (training waits until then)",
}


@dataclass(frozen=True)
class StageHealth:
    """One stage as the swarm's records show it."""

    stage: int
    health: str  # one of HEALTHS
    serving: int
    pending: int  # joining or migrating into it
    step: int | None  # the newest step a serving peer reports
    step_age_s: float | None  # how old that report is
    checkpoint: int | None  # the newest checkpoint of it a live peer offers
    hint: str  # what to do, "" when ok

    def to_dict(self) -> dict[str, object]:
        return {"stage": self.stage, "health": self.health, "serving": self.serving, "pending": self.pending,
                "step": self.step, "step_age_s": self.step_age_s, "checkpoint": self.checkpoint, "hint": self.hint}


def stage_health(n_stages: int, records: Iterable[PeerRecord], *, now: float,
                 held_here: dict[int, int] | None = None) -> list[StageHealth]:
    """Every stage's health from the listed peer records (this peer's own among them); ``held_here``:
    the checkpoints this peer holds (stage -> step), which count as offered."""
    listed = [r for r in records if r.listed]
    trained = any(r.step > 0 or any(s > 0 for _, s in r.held) for r in listed) or any(
        s > 0 for s in (held_here or {}).values())
    out = []
    for stage in range(n_stages):
        here = [r for r in listed if r.stage == stage and r.state != "draining"]
        serving = [r for r in here if r.usable]
        pending = sum(r.state in ("joining", "migrating") for r in here)
        offered = [s for r in listed if (s := r.held_step(stage)) is not None]
        if held_here and stage in held_here:
            offered.append(held_here[stage])
        newest = max(serving, key=lambda r: (r.step, r.timestamp), default=None)
        if len(serving) >= 2:
            health = "ok"
        elif serving:
            health = "thin"
        elif pending:
            health = "starting"
        elif offered or not trained:
            health = "empty"
        else:
            health = "lost"
        out.append(StageHealth(
            stage=stage, health=health, serving=len(serving), pending=pending,
            step=newest.step if newest is not None else None,
            step_age_s=round(max(0.0, now - newest.timestamp), 3) if newest is not None else None,
            checkpoint=max(offered) if offered else None,
            hint=_HINTS[health].format(stage=stage, pending=pending),
        ))
    return out


def trouble(healths: Iterable[StageHealth]) -> list[StageHealth]:
    """The stages worth a warning (all but ``ok``)."""
    return [h for h in healths if h.health != "ok"]
