"""Trainer registrations: who is training through this daemon, expiring without heartbeats.

Trainers are lightweight clients (SWARM, section 3.2): they run no DHT node, so they register
with any daemon's control plane, learn the swarm from it, and keep the registration alive with
heartbeats. The registry is local to the daemon and only informative (for ``GET /trainers``);
trainers talk to stage peers directly over the data plane.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_TTL_S = 30.0
MAX_TRAINERS = 1024  # a registration costs a few bytes, but an unbounded dict is a DoS handle


@dataclass
class Registration:
    trainer_id: str
    name: str
    registered_at: float  # unix time
    last_seen: float  # monotonic


class TrainerRegistry:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._trainers: dict[str, Registration] = {}

    def register(self, name: str) -> Registration | None:
        """A new registration, or None when the registry is full of live trainers."""
        self._expire()
        if len(self._trainers) >= MAX_TRAINERS:
            return None
        reg = Registration(secrets.token_hex(8), name, time.time(), self._clock())
        self._trainers[reg.trainer_id] = reg
        return reg

    def heartbeat(self, trainer_id: str) -> bool:
        self._expire()
        reg = self._trainers.get(trainer_id)
        if reg is None:
            return False
        reg.last_seen = self._clock()
        return True

    def live(self) -> list[dict[str, object]]:
        self._expire()
        now = self._clock()
        return [
            {"trainer_id": r.trainer_id, "name": r.name, "registered_at": r.registered_at,
             "last_seen_s": round(now - r.last_seen, 3)}
            for r in sorted(self._trainers.values(), key=lambda r: r.registered_at)
        ]

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        for trainer_id in [t for t, r in self._trainers.items() if r.last_seen < cutoff]:
            del self._trainers[trainer_id]
