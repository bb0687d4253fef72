"""The loss where the swarm is: trainers' reports, kept per daemon and merged across the swarm.

Trainers report with each heartbeat (``POST /trainers/{id}/heartbeat``, body
:class:`~swarmd.api.models.TrainerReport`): the steps they finished since the last one, each with
its loss, and their samples/s and validation loss. The daemon they registered with keeps those
points in a bounded history (:class:`TrainingLog`, the curve of *its* trainers), and every
announce period publishes one small signed :class:`~swarmd.dht.records.TrainingRecord` (step,
newest loss, validation loss, samples/s, trainer count) under the swarm's training key. Every
daemon reads all of them in the same period and appends one merged point to a second bounded
history, the *swarm's* curve, so any daemon's dashboard shows the loss of the whole swarm, not
only of the trainers registered with it.

A record is ~190 bytes signed, and only daemons with live trainers publish one, so the key's
bundle (one UDP datagram, ~8 KB) holds the records of ~40 such daemons.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

from swarmd.dht.keys import KEY_PREFIX
from swarmd.dht.records import Record, TrainingRecord

__all__ = ["LOCAL_POINTS", "SWARM_POINTS", "SwarmPoint", "TrainingLog", "TrainingPoint", "training_key"]

log = logging.getLogger(__name__)

LOCAL_POINTS = 4096  # this daemon's trainers' steps kept (a few hundred KB at most)
SWARM_POINTS = 2048  # merged swarm points kept: at one per 10 s announce period, almost 6 hours


def training_key(swarm: str) -> str:
    """The DHT key under which every daemon of ``swarm`` publishes its :class:`TrainingRecord`."""
    return f"{KEY_PREFIX}/{swarm}/training"


@dataclass(frozen=True)
class TrainingPoint:
    """One step a trainer registered here reported: ``t`` is this daemon's unix time on receipt."""

    t: float
    trainer_id: str
    step: int
    loss: float | None
    val_loss: float | None
    samples_per_s: float


@dataclass(frozen=True)
class SwarmPoint:
    """The swarm at one announce period, merged from every daemon's :class:`TrainingRecord`."""

    t: float
    step: int
    loss: float | None  # mean of the publishers' newest losses
    val_loss: float | None
    samples_per_s: float  # summed over every publisher's trainers
    trainers: int
    publishers: int


@dataclass
class _Latest:
    """What one trainer reported last (for the record this daemon publishes)."""

    at: float  # monotonic
    step: int
    samples: int
    loss: float | None
    val_loss: float | None
    samples_per_s: float


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def _mean(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


class TrainingLog:
    """A daemon's bounded training histories: its own trainers' points and the swarm's merged ones."""

    def __init__(self, *, live_s: float = 30.0, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.live_s = live_s  # a trainer silent this long no longer counts in the published record
        self.local: deque[TrainingPoint] = deque(maxlen=LOCAL_POINTS)
        self.swarm: deque[SwarmPoint] = deque(maxlen=SWARM_POINTS)
        self.publishers: dict[str, TrainingRecord] = {}  # the last records read, by daemon peer id
        self._latest: dict[str, _Latest] = {}
        self._clock = clock
        self._monotonic = monotonic

    # ---- what trainers report --------------------------------------------------------------

    def report(self, trainer_id: str, *, steps: Iterable[tuple[int, float | None, float | None]], samples: int,
               samples_per_s: float) -> None:
        """A heartbeat's report: ``steps`` (step, loss, validation loss) finished since the last one,
        ``samples`` computed in all, ``samples_per_s`` now. Non-finite losses count as none."""
        now = self._clock()
        rate = samples_per_s if math.isfinite(samples_per_s) and samples_per_s >= 0 else 0.0
        latest = self._latest.get(trainer_id)
        step, loss, val = (latest.step, latest.loss, latest.val_loss) if latest is not None else (0, None, None)
        for point_step, point_loss, point_val in steps:
            point_loss, point_val = _finite(point_loss), _finite(point_val)
            self.local.append(TrainingPoint(now, trainer_id, point_step, point_loss, point_val, rate))
            step = max(step, point_step)
            loss = point_loss if point_loss is not None else loss
            val = point_val if point_val is not None else val
        self._latest[trainer_id] = _Latest(self._monotonic(), step, samples, loss, val, rate)

    def live_trainers(self) -> dict[str, _Latest]:
        cutoff = self._monotonic() - self.live_s
        for trainer_id in [t for t, r in self._latest.items() if r.at < cutoff]:
            del self._latest[trainer_id]
        return dict(self._latest)

    # ---- what this daemon publishes --------------------------------------------------------

    def record(self, peer_id: str, ttl_s: float) -> TrainingRecord | None:
        """This daemon's record for the DHT, or None while no trainer here is live."""
        live = self.live_trainers()
        if not live:
            return None
        newest = max(live.values(), key=lambda r: r.step)
        now = self._clock()
        return TrainingRecord(
            peer_id=peer_id,
            step=newest.step,
            samples=sum(r.samples for r in live.values()),
            loss=_mean(r.loss for r in live.values()),
            val_loss=_mean(r.val_loss for r in live.values()),
            samples_per_s=sum(r.samples_per_s for r in live.values()),
            trainers=len(live),
            timestamp=now,
            expiry=now + ttl_s,
        )

    # ---- what the swarm shows --------------------------------------------------------------

    def merge(self, records: Mapping[str, Record]) -> SwarmPoint | None:
        """One swarm point from every daemon's newest record (None when nobody published one);
        not appended again while no trainer's progress changed (daemons republish the same record
        every announce period), so an idle swarm does not fill the history and a curve never shows
        one loss twice as if it were two steps."""
        found = {pid: r for pid, r in records.items() if isinstance(r, TrainingRecord)}
        if not found:
            self.publishers = {}
            return None
        unchanged = {pid: (r.step, r.samples) for pid, r in found.items()} == {
            pid: (r.step, r.samples) for pid, r in self.publishers.items()}
        self.publishers = found
        if unchanged and self.swarm:
            return None
        point = SwarmPoint(
            t=self._clock(),
            step=max(r.step for r in found.values()),
            loss=_mean(r.loss for r in found.values()),
            val_loss=_mean(r.val_loss for r in found.values()),
            samples_per_s=sum(r.samples_per_s for r in found.values()),
            trainers=sum(r.trainers for r in found.values()),
            publishers=len(found),
        )
        self.swarm.append(point)
        return point

    def view(self, *, limit: int = 1024) -> dict[str, object]:
        """``GET /training``: the newest ``limit`` points of each history and the publishers now."""
        now = self._clock()
        return {
            "local": [asdict(p) for p in list(self.local)[-limit:]],
            "swarm": [asdict(p) for p in list(self.swarm)[-limit:]],
            "publishers": [
                {"peer_id": r.peer_id, "step": r.step, "samples": r.samples, "loss": r.loss, "val_loss": r.val_loss,
                 "samples_per_s": r.samples_per_s, "trainers": r.trainers,
                 "age_s": round(max(0.0, now - r.timestamp), 3)}
                for r in sorted(self.publishers.values(), key=lambda r: r.peer_id)
            ],
        }
