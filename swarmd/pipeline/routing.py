"""Which peer of a stage serves the next request: SWARM's stochastic wiring, as pure logic.

SWARM (Ryabinin et al., 2023, section 3.2, "stochastic wiring") lets every trainer route each
microbatch through one peer per stage, chosen by *interleaved weighted round-robin* over the
stage's peers. The weights are the trainer's own estimate of each peer's throughput, an
exponential moving average of what it measured, so faster peers get proportionally more work
and a slow or overloaded peer sheds load without any central scheduler. A peer that fails is
dropped from the rotation for a while and the request is retried on another peer of the
same stage.

:class:`StageRouter` keeps that state for one stage. It does no I/O and never sleeps: the
async trainer shell calls :meth:`StageRouter.choose`, performs the call, and reports the
outcome; when no peer is usable it sleeps :meth:`StageRouter.next_unban_in` seconds. Time and
randomness come from the injected ``clock`` and ``rng``, so tests drive it deterministically.

Design choices:

* **Smooth weighted round-robin** (the nginx variant: every peer's counter grows by its weight,
  the largest counter wins and pays back the total). It is deterministic given the weights,
  sends each peer exactly its weighted share over a round, and spreads a peer's turns through
  the round (weights 3:1 give ``AABA``, not ``AAAB``), which is the interleaving the paper asks
  for: a fast peer is never handed a burst that queues up behind itself. Because the counters
  carry over, it adapts smoothly as the EMA weights move after every measurement.
* **Bias-corrected EMA** (as in Adam): ``raw / (1 - (1 - alpha) ** n)``, so the first
  measurement counts fully instead of being dragged towards zero.
* **Newcomers are probed at once**: a peer never chosen and never measured is picked by the
  next :meth:`StageRouter.choose` before the round-robin resumes. Until its first success it
  rotates with the weight of the fastest known peer (or ``explore_weight``), so its throughput
  gets measured soon.
* **Bans, not starvation**: a failure bans the peer for ``ban_base_s * 2 ** (k - 1)`` seconds
  (``k`` consecutive failures, capped at ``ban_max_s``, +-10% jitter so trainers that saw the
  same outage do not all return at the same instant). When the ban expires the peer is tried
  again; a success resets ``k``. This is the "ban with backoff, retry elsewhere" lesson from
  hivemind and the SWARM reference code, whose retries had neither.
* **Weight floor**: every peer gets at least ``min_share`` of the largest weight, so a peer
  measured as very slow (or as 0 samples/s) still sees occasional traffic and can prove it
  recovered.
* **In-flight accounting** (optional): :meth:`StageRouter.begin` marks a call as started, the
  success or failure report ends it; with ``max_in_flight`` set, peers at the cap are skipped,
  so a burst of concurrent requests cannot all pile onto one peer.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from swarmd.pipeline.throughput import ThroughputEMA

__all__ = ["JITTER", "PeerStats", "StageRouter"]

#: Relative jitter applied to every ban length (+-10%).
JITTER = 0.1

# 2 ** 64 is already far beyond any sensible ban_max_s; capping the exponent avoids overflow.
_MAX_BACKOFF_EXPONENT = 64

# Relative to the round's total weight: counters closer than this count as tied.
_TIE_TOLERANCE = 1e-9


@dataclass
class PeerStats:
    """What one trainer knows about one peer of a stage, measured by itself."""

    peer_id: str
    addr: str
    alpha: float = field(default=0.1, repr=False)
    ema: ThroughputEMA = field(init=False, repr=False)  # samples/s, bias-corrected
    successes: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    banned_until: float | None = None  # clock() value; None when never banned
    in_flight: int = 0
    picks: int = 0  # how often choose() returned this peer
    current: float = field(default=0.0, repr=False)  # smooth weighted round-robin counter

    def __post_init__(self) -> None:
        self.ema = ThroughputEMA(self.alpha)

    @property
    def measured(self) -> bool:
        return self.ema.count > 0

    @property
    def throughput(self) -> float:
        """Bias-corrected EMA of samples/s; 0.0 before the first measurement."""
        return self.ema.value

    def banned_for(self, now: float) -> float:
        """Seconds of ban left at ``now`` (0.0 when usable)."""
        if self.banned_until is None:
            return 0.0
        return max(0.0, self.banned_until - now)

    def observe(self, samples: int, seconds: float) -> None:
        self.ema.update(samples, seconds)


class StageRouter:
    """Chooses the peer for each request to one stage and learns from the outcomes."""

    def __init__(
        self,
        stage: int,
        *,
        alpha: float = 0.1,
        ban_base_s: float = 1.0,
        ban_max_s: float = 60.0,
        explore_weight: float | None = None,
        min_share: float = 0.01,
        max_in_flight: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        if not 0.0 < ban_base_s <= ban_max_s:
            raise ValueError("need 0 < ban_base_s <= ban_max_s")
        if explore_weight is not None and not explore_weight > 0.0:
            raise ValueError("explore_weight must be positive")
        if not 0.0 <= min_share <= 1.0:
            raise ValueError("min_share must be in [0, 1]")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.stage = stage
        self.alpha = alpha
        self.ban_base_s = ban_base_s
        self.ban_max_s = ban_max_s
        self.explore_weight = explore_weight
        self.min_share = min_share
        self.max_in_flight = max_in_flight
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._peers: dict[str, PeerStats] = {}

    # ---- membership ----------------------------------------------------------------------

    def update_peers(self, peers: Mapping[str, str]) -> None:
        """Adopt the swarm's current view of this stage: ``peer_id -> data_addr``.

        Vanished peers are forgotten (a peer that comes back re-announced itself, so it starts
        afresh); known peers keep their measurements and bans even if their address changed;
        new peers are added in sorted order, so the result does not depend on the view's order.
        """
        for peer_id in [p for p in self._peers if p not in peers]:
            del self._peers[peer_id]
        for peer_id in sorted(peers):
            stats = self._peers.get(peer_id)
            if stats is None:
                self._peers[peer_id] = PeerStats(peer_id, peers[peer_id], alpha=self.alpha)
            else:
                stats.addr = peers[peer_id]

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def stats(self, peer_id: str) -> PeerStats:
        """The live record of one peer (KeyError if unknown); for tests and progress displays."""
        return self._peers[peer_id]

    # ---- choosing ------------------------------------------------------------------------

    def choose(self, exclude: Collection[str] = ()) -> tuple[str, str] | None:
        """``(peer_id, data_addr)`` for the next request, or None if no peer is usable now.

        ``exclude`` names peers this request already failed on, so a retry goes to another
        peer of the same stage. Banned peers and, with ``max_in_flight``, saturated ones are
        skipped as well.
        """
        now = self._clock()
        candidates = [
            p
            for p in self._peers.values()
            if p.banned_for(now) == 0.0
            and p.peer_id not in exclude
            and (self.max_in_flight is None or p.in_flight < self.max_in_flight)
        ]
        if not candidates:
            return None
        fresh = [p for p in candidates if p.picks == 0 and not p.measured and p.failures == 0]
        if fresh:
            chosen = fresh[0]
        else:
            weights = self._weights()
            total = 0.0
            for p in candidates:
                p.current += weights[p.peer_id]
                total += weights[p.peer_id]
            # The first of the (near-)equal leaders wins: a tolerance keeps float rounding in
            # the EMA weights from reordering ties, so equal weights cycle in a fixed order.
            best = max(p.current for p in candidates) - _TIE_TOLERANCE * total
            chosen = next(p for p in candidates if p.current >= best)
            chosen.current -= total
        chosen.picks += 1
        return chosen.peer_id, chosen.addr

    def choose_preferred(self, peer_id: str | None, exclude: Collection[str] = ()) -> tuple[str, str] | None:
        """``peer_id`` itself if it is usable now (known, not banned, not in ``exclude``, under
        the in-flight cap), else :meth:`choose`'s pick.

        For a backward: the peer that served the microbatch's forward may still hold its
        activations. The round-robin counters are left alone, so affinity does not skew the
        weighted shares of the forwards it follows.
        """
        p = self._peers.get(peer_id) if peer_id is not None else None
        if (
            p is not None
            and p.banned_for(self._clock()) == 0.0
            and p.peer_id not in exclude
            and (self.max_in_flight is None or p.in_flight < self.max_in_flight)
        ):
            p.picks += 1
            return p.peer_id, p.addr
        return self.choose(exclude)

    def _weights(self) -> dict[str, float]:
        """Round-robin weight of every known peer: measured throughput, floored.

        Unmeasured peers get ``explore_weight`` or, by default, the largest measured
        throughput, so they are tried about as often as the fastest peer until measured.
        """
        measured = [p.throughput for p in self._peers.values() if p.measured]
        explore = self.explore_weight
        if explore is None:
            explore = max(measured, default=0.0)
        base = {p.peer_id: p.throughput if p.measured else explore for p in self._peers.values()}
        top = max(base.values(), default=0.0)
        if not top > 0.0:  # nothing measured above zero yet: plain round-robin
            return dict.fromkeys(base, 1.0)
        floor = self.min_share * top
        return {peer_id: max(w, floor) for peer_id, w in base.items()}

    # ---- outcomes ------------------------------------------------------------------------

    def begin(self, peer_id: str) -> None:
        """A call to ``peer_id`` started; the success or failure report ends it."""
        stats = self._peers.get(peer_id)
        if stats is not None:
            stats.in_flight += 1

    def release(self, peer_id: str) -> None:
        """A begun call ended without an outcome (cancelled): nothing is learned about the peer."""
        stats = self._peers.get(peer_id)
        if stats is not None:
            stats.in_flight = max(0, stats.in_flight - 1)

    def report_success(self, peer_id: str, samples: int, seconds: float) -> None:
        """``samples`` went through ``peer_id`` in ``seconds``: update its throughput estimate.

        A success resets the backoff but does not lift a ban already in force: the ban came
        from a failure that may well be newer than the call that just succeeded. Reports about
        peers no longer in the view are ignored (the view can change while a call is running).
        """
        if samples < 0 or not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"need samples >= 0 and finite seconds >= 0, got {samples}, {seconds}")
        stats = self._peers.get(peer_id)
        if stats is None:
            return
        stats.in_flight = max(0, stats.in_flight - 1)
        stats.successes += 1
        stats.consecutive_failures = 0
        stats.observe(samples, seconds)

    def report_failure(self, peer_id: str) -> float:
        """Ban ``peer_id`` with exponential backoff; returns the ban length in seconds.

        The length is ``ban_base_s * 2 ** (k - 1)`` for the ``k``-th consecutive failure, with
        +-10% jitter from ``rng``, and never more than ``ban_max_s``. Unknown peers: 0.0.
        """
        stats = self._peers.get(peer_id)
        if stats is None:
            return 0.0
        stats.in_flight = max(0, stats.in_flight - 1)
        stats.failures += 1
        stats.consecutive_failures += 1
        exponent = min(stats.consecutive_failures - 1, _MAX_BACKOFF_EXPONENT)
        jitter = 1.0 + self._rng.uniform(-JITTER, JITTER)
        ban = min(self.ban_base_s * 2.0**exponent * jitter, self.ban_max_s)
        stats.banned_until = self._clock() + ban
        stats.current = 0.0  # come back from the ban with neither credit nor debt
        return ban

    # ---- introspection -------------------------------------------------------------------

    def next_unban_in(self) -> float | None:
        """Seconds until the earliest ban expires; None when no peer is banned."""
        now = self._clock()
        left = [p.banned_for(now) for p in self._peers.values()]
        return min((s for s in left if s > 0.0), default=None)

    @property
    def usable_count(self) -> int:
        """Known peers not banned right now (exclusions and in-flight caps not counted)."""
        now = self._clock()
        return sum(1 for p in self._peers.values() if p.banned_for(now) == 0.0)

    def snapshot(self) -> list[dict[str, Any]]:
        """One plain dict per peer, sorted by id, for progress displays and tests."""
        now = self._clock()
        weights = self._weights()
        return [
            {
                "id": p.peer_id,
                "addr": p.addr,
                "throughput": p.throughput,
                "measured": p.measured,
                "weight": weights[p.peer_id],
                "in_flight": p.in_flight,
                "banned_for_s": p.banned_for(now),
                "successes": p.successes,
                "failures": p.failures,
                "consecutive_failures": p.consecutive_failures,
            }
            for p in sorted(self._peers.values(), key=lambda p: p.peer_id)
        ]
