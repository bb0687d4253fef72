"""Trainer registrations: who is training through this daemon, expiring without heartbeats.

Trainers are lightweight clients (SWARM, section 3.2): they run no DHT node, so they register
with any daemon's control plane, learn the swarm from it, and keep the registration alive with
heartbeats. The registry is local to the daemon and only informative (for ``GET /trainers``);
trainers talk to stage peers directly over the data plane. A heartbeat may carry a report (step,
loss, samples/s, validation loss, and the trainer's retries, bans and spot checks so far): the
registry keeps the newest values per trainer, sums what the retries, bans and spot-check counts
grew by into counters that outlive registrations (``/metrics``), and hands the report to
``on_report`` (the daemon's ``swarmd.training_summary.TrainingLog``). Spot checks (issue #17,
``swarmd.train.verify``) are the trainers' cost of verifying peers' work; a heartbeat without
them (an older trainer) changes none of their counts.

Each registration gets a *rank*, the smallest no live trainer of the swarm holds (claimed in
the DHT, ``swarmd.api.trainer_ranks``): the trainer draws its training windows from that shard
of the data (``swarmd.train.data.shard``), so trainers of one swarm draw different data. A
``--sync`` trainer makes the swarm compute exactly what single-process training on its batches
computes; another trainer's samples would join its steps, so a sync trainer is refused while
any other trainer is registered, and any trainer while a sync one is
(:meth:`TrainerRegistry.conflict`). That check is per daemon: trainers that register with
different daemons are not checked against each other.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarmd.api.models import TrainerReport

#: The spot-check counts a heartbeat may carry (``swarmd.train.verify.VerifyStats`` fields,
#: cumulative since the trainer started).
SPOT_CHECK_FIELDS = ("checks", "mismatches", "arbitrations", "liars", "reports_sent")

DEFAULT_TTL_S = 30.0
MAX_TRAINERS = 1024  # a registration costs a few bytes, but an unbounded dict is a DoS handle


@dataclass
class Registration:
    trainer_id: str
    name: str
    registered_at: float  # unix time
    last_seen: float  # monotonic
    step: int | None = None  # what its heartbeats reported last (None: nothing yet)
    loss: float | None = None
    val_loss: float | None = None
    samples: int | None = None
    samples_per_s: float | None = None
    rank: int = 0
    rank_claimed_at: float = 0.0  # unix time its rank was claimed (swarmd.api.trainer_ranks: earlier claims win)
    sync: bool = False
    steps_seen: int = 0
    finished: bool = False  # it said it finished (DELETE /trainers/{id}): listed until it expires
    retries: int = 0  # its retries and bans since it started, as reported (cumulative on its side)
    bans: int = 0
    spot_checks: dict[str, int] = field(default_factory=dict)  # SPOT_CHECK_FIELDS, as reported (cumulative)

    def note(self, report: TrainerReport) -> tuple[int, int, dict[str, int]]:
        """Keep the newest values of a heartbeat's report; the retries, bans and spot-check counts it adds
        (a repeated or older report adds nothing: counts never go down)."""
        self.samples, self.samples_per_s = report.samples, report.samples_per_s
        added = max(0, report.retries - self.retries), max(0, report.bans - self.bans)
        self.retries, self.bans = max(self.retries, report.retries), max(self.bans, report.bans)
        spot: dict[str, int] = {}
        if report.spot_checks is not None:
            for key in SPOT_CHECK_FIELDS:
                now, before = getattr(report.spot_checks, key), self.spot_checks.get(key, 0)
                spot[key] = max(0, now - before)
                self.spot_checks[key] = max(before, now)
        for point in report.steps:
            if self.step is None or point.step > self.step:
                self.steps_seen += 1
            self.step = point.step if self.step is None else max(self.step, point.step)
            self.loss = point.loss if point.loss is not None else self.loss
            self.val_loss = point.val_loss if point.val_loss is not None else self.val_loss
        return added[0], added[1], spot


class TrainerRegistry:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic,
                 on_report: Callable[[str, TrainerReport], None] | None = None) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._on_report = on_report
        self._trainers: dict[str, Registration] = {}
        # what every trainer reported, summed over all that ever registered here: counters that
        # outlive a registration's expiry (``swarmd_trainer_retries_total``, ``..._bans_total``)
        self.retries_total = 0
        self.bans_total = 0
        self.spot_checks_total: dict[str, int] = dict.fromkeys(SPOT_CHECK_FIELDS, 0)

    def conflict(self, *, sync: bool) -> str | None:
        """Why a new (``sync``) trainer cannot train through this daemon now, or None."""
        self._expire()
        training = [r for r in self._trainers.values() if not r.finished]
        if sync and training:
            return (f"a --sync trainer needs the swarm to itself (its steps must hold its own batch only), but "
                    f"{len(training)} other trainer(s) train through this daemon; stop them, or train without "
                    "--sync: asynchronous trainers share the swarm's steps through sample reservations")
        if any(r.sync for r in training):
            return ("a --sync trainer is training through this daemon and needs the swarm to itself (its steps must "
                    "hold its own batch only); wait until it finishes")
        return None

    def register(self, name: str, *, sync: bool = False) -> Registration | None:
        """A new registration, or None when the registry is full of live trainers (check
        :meth:`conflict` first)."""
        self._expire()
        if len(self._trainers) >= MAX_TRAINERS:
            return None
        taken = {r.rank for r in self._trainers.values() if not r.finished}
        rank = next(i for i in range(len(taken) + 1) if i not in taken)
        now = time.time()
        reg = Registration(secrets.token_hex(8), name, now, self._clock(), rank=rank, rank_claimed_at=now, sync=sync)
        self._trainers[reg.trainer_id] = reg
        return reg

    def ranks(self, *, exclude: str | None = None) -> dict[int, float]:
        """The ranks the live, unfinished trainers hold (rank -> claimed_at), but ``exclude``'s."""
        self._expire()
        return {r.rank: r.rank_claimed_at for r in self._trainers.values()
                if not r.finished and r.trainer_id != exclude}

    def set_rank(self, trainer_id: str, rank: int, claimed_at: float) -> None:
        """A rank chosen across the swarm (``swarmd.api.trainer_ranks``)."""
        reg = self._trainers.get(trainer_id)
        if reg is not None:
            reg.rank, reg.rank_claimed_at = rank, claimed_at

    def finish(self, trainer_id: str) -> bool:
        """A trainer that finished: still listed (``finished``) until it expires, but it holds no
        rank and no ``--sync`` claim any more; False when it was not registered (or had expired)."""
        self._expire()
        reg = self._trainers.get(trainer_id)
        if reg is None:
            return False
        reg.finished = True
        return True

    def heartbeat(self, trainer_id: str, report: TrainerReport | None = None) -> bool:
        self._expire()
        reg = self._trainers.get(trainer_id)
        if reg is None:
            return False
        reg.last_seen = self._clock()
        if report is not None:
            retries, bans, spot = reg.note(report)
            self.retries_total += retries
            self.bans_total += bans
            for key, added in spot.items():
                self.spot_checks_total[key] += added
            if self._on_report is not None:
                self._on_report(trainer_id, report)
        return True

    def live(self) -> list[dict[str, object]]:
        self._expire()
        now = self._clock()
        return [
            {"trainer_id": r.trainer_id, "name": r.name, "registered_at": r.registered_at,
             "last_seen_s": round(now - r.last_seen, 3), "step": r.step, "loss": r.loss, "val_loss": r.val_loss,
             "samples": r.samples, "samples_per_s": r.samples_per_s, "rank": r.rank, "sync": r.sync,
             "steps_seen": r.steps_seen, "finished": r.finished, "retries": r.retries, "bans": r.bans,
             "spot_checks": dict(r.spot_checks) or None}
            for r in sorted(self._trainers.values(), key=lambda r: r.registered_at)
        ]

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        for trainer_id in [t for t, r in self._trainers.items() if r.last_seen < cutoff]:
            del self._trainers[trainer_id]
