"""Trainer registrations: who is training through this daemon, expiring without heartbeats.

Trainers are lightweight clients (SWARM, section 3.2): they run no DHT node, so they register
with any daemon's control plane, learn the swarm from it, and keep the registration alive with
heartbeats. The registry is local to the daemon and only informative (for ``GET /trainers``);
trainers talk to stage peers directly over the data plane. A heartbeat may carry a report (step,
loss, samples/s, validation loss): the registry keeps the newest values per trainer and hands the
report to ``on_report`` (the daemon's ``swarmd.training_summary.TrainingLog``).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarmd.api.models import TrainerReport

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

    def note(self, report: TrainerReport) -> None:
        """Keep the newest values of a heartbeat's report."""
        self.samples, self.samples_per_s = report.samples, report.samples_per_s
        for point in report.steps:
            self.step = point.step if self.step is None else max(self.step, point.step)
            self.loss = point.loss if point.loss is not None else self.loss
            self.val_loss = point.val_loss if point.val_loss is not None else self.val_loss


class TrainerRegistry:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic,
                 on_report: Callable[[str, TrainerReport], None] | None = None) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._on_report = on_report
        self._trainers: dict[str, Registration] = {}

    def register(self, name: str) -> Registration | None:
        """A new registration, or None when the registry is full of live trainers."""
        self._expire()
        if len(self._trainers) >= MAX_TRAINERS:
            return None
        reg = Registration(secrets.token_hex(8), name, time.time(), self._clock())
        self._trainers[reg.trainer_id] = reg
        return reg

    def heartbeat(self, trainer_id: str, report: TrainerReport | None = None) -> bool:
        self._expire()
        reg = self._trainers.get(trainer_id)
        if reg is None:
            return False
        reg.last_seen = self._clock()
        if report is not None:
            reg.note(report)
            if self._on_report is not None:
                self._on_report(trainer_id, report)
        return True

    def live(self) -> list[dict[str, object]]:
        self._expire()
        now = self._clock()
        return [
            {"trainer_id": r.trainer_id, "name": r.name, "registered_at": r.registered_at,
             "last_seen_s": round(now - r.last_seen, 3), "step": r.step, "loss": r.loss, "val_loss": r.val_loss,
             "samples": r.samples, "samples_per_s": r.samples_per_s}
            for r in sorted(self._trainers.values(), key=lambda r: r.registered_at)
        ]

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        for trainer_id in [t for t, r in self._trainers.items() if r.last_seen < cutoff]:
            del self._trainers[trainer_id]
