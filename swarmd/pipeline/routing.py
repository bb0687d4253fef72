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
It is typed at both ends: it takes the swarm's view of its stage as one :class:`PeerView` per
listed peer (a DHT peer record as ``GET /swarm`` shows it; only :attr:`PeerView.usable` peers are
routed to), and :meth:`StageRouter.snapshot` answers one :class:`RoutedPeer` per known peer, so the
trainer's decisions read fields, never string keys.

Design choices:

* **Smooth weighted round-robin** (the nginx variant: every peer's counter grows by its weight,
  the largest counter wins and pays back the total). It is deterministic given the weights,
  sends each peer exactly its weighted share over a round, and spreads a peer's turns through
  the round (weights 3:1 give ``AABA``, not ``AAAB``), which is the interleaving the paper asks
  for: a fast peer is never handed a burst that queues up behind itself. Because the counters
  carry over, it adapts smoothly as the EMA weights move after every measurement.
* **Bias-corrected EMA** (as in Adam): ``raw / (1 - (1 - alpha) ** n)``, so the first
  measurement counts fully instead of being dragged towards zero.
* **Newcomers are on probation** (issue #18: a peer record costs nothing, so a listed peer
  may be a tarpit that accepts connections and never answers). A peer that has never answered
  correctly may hold at most ``probation_slots`` calls in flight *together with every other
  unproven peer*, and one each, while a proven peer is usable: it is never the only thing
  between the trainer and progress. Within that budget a newcomer is picked by the next
  :meth:`StageRouter.choose` before the round-robin resumes, and rotates with the weight of the
  fastest known peer (or ``explore_weight``) until measured. When no peer is proven yet (a
  trainer's first calls), unproven peers get one call each, so the first answers prove them.
* **Timeouts from what the stage takes**: every success also feeds a per-peer, per-kind
  (forward, backward) EMA of *seconds per sample*. A call's timeout
  (:meth:`StageRouter.timeout_for`) is ``timeout_factor`` times the larger of the stage's
  typical latency (the median over proven peers, so one slow or lying peer cannot stretch
  everyone's timeouts) and the peer's own, times the call's samples, clamped to
  ``[timeout_floor_s, timeout_ceiling_s]`` (the ceiling is the configured request timeout). A
  tarpit therefore costs about one typical request, not the ceiling (hivemind #676: fixed
  timeouts cannot fit both fast and slow peers). Before the stage has any estimate, an
  unproven peer gets at most ``probation_timeout_s``.
* **Bans that grow to minutes**: a failure bans the peer for ``base * 2 ** (k - 1)`` seconds
  (``k`` consecutive failures, capped at ``ban_max_s``, default 10 minutes, +-10% jitter so
  trainers that saw the same outage do not all return at the same instant); ``base`` is
  ``ban_base_s`` (1 s) for a peer that has answered before, and ``probation_ban_s`` (30 s) for
  one that never has, so an honest peer's hiccup costs it a second and a fake peer is tried
  about once per half minute, then per minute, ... then per ten minutes. When the ban expires
  the peer is tried again; a success resets ``k``. A peer that vanishes from the view while
  banned is remembered until its ban ends (a record that flaps does not reset its backoff).
  This is the "ban with backoff, retry elsewhere" lesson from hivemind and the SWARM reference
  code, whose retries had neither.
* **Long bans and exclusions**: :meth:`StageRouter.ban` bans a peer for a given time whatever
  its record (a spot check caught it lying: ``swarmd.train.verify``), and
  :meth:`StageRouter.set_excluded` names the peers the swarm excluded after two independent
  reports (``swarmd.pipeline.reports``): neither is ever chosen.
* **Weight floor**: every peer gets at least ``min_share`` of the largest weight, so a peer
  measured as very slow (or as 0 samples/s) still sees occasional traffic and can prove it
  recovered.
* **Alive before called** (``require_alive``, the trainer's setting): while some proven (or
  alive) peer of the stage is usable, an unproven peer is called only once it has answered a
  progress poll (:meth:`StageRouter.report_alive`) since its last failure. A tarpit never
  answers one, so it never holds a microbatch, and so never the step that microbatch belongs to.
* **Polls do not wait for newcomers** (:class:`NewcomerPolls`): a progress poll waits for the
  peers that answered before; a never-seen peer gets a short grace after them, then its poll
  goes on in the background, and at most ``rate`` never-seen peers per second are probed.
* **In-flight accounting** (optional): :meth:`StageRouter.begin` marks a call as started, the
  success or failure report ends it; with ``max_in_flight`` set, peers at the cap are skipped,
  so a burst of concurrent requests cannot all pile onto one peer.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from swarmd.peer_state import PeerState, usable
from swarmd.pipeline.throughput import ThroughputEMA

__all__ = [
    "JITTER",
    "LatencyEMA",
    "NewcomerPolls",
    "PeerStats",
    "PeerView",
    "Reachability",
    "RoutedPeer",
    "StageRouter",
]

#: Relative jitter applied to every ban length (+-10%).
JITTER = 0.1

# 2 ** 64 is already far beyond any sensible ban_max_s; capping the exponent avoids overflow.
_MAX_BACKOFF_EXPONENT = 64

# Relative to the round's total weight: counters closer than this count as tied.
_TIE_TOLERANCE = 1e-9


#: Whether the swarm's members could dial a peer's data address (``swarmd.net.reachability``).
Reachability = Literal["unknown", "yes", "no"]


@dataclass(frozen=True)
class PeerView:
    """One peer as the swarm's view lists it: its DHT record (``swarmd.dht.records.PeerRecord``) as a
    daemon's ``GET /swarm`` shows it, reduced to what a router needs before it ever calls the peer."""

    peer_id: str
    stage: int
    addr: str  # where its data plane listens (the record's ``data_addr``)
    state: PeerState = PeerState.SERVING
    reachable: Reachability = "unknown"
    announced: float = 0.0  # samples/s of a forward and a backward, as the peer announces its own compute

    @property
    def usable(self) -> bool:
        """Serving, and not known to be out of reach: what a trainer may dial (``PeerRecord.usable``)."""
        return usable(self.state.value, self.reachable)


@dataclass(frozen=True)
class RoutedPeer:
    """One peer as a router stands with it at one moment (:meth:`StageRouter.snapshot`)."""

    peer_id: str
    addr: str
    throughput: float  # samples/s, as this trainer measured it
    measured: bool
    proven: bool  # it has answered a call correctly: off probation
    alive: bool  # it answered a progress poll since its last failure
    weight: float  # its round-robin weight
    in_flight: int
    banned_for_s: float  # 0.0 when not banned
    excluded: bool  # excluded by the swarm, its stage or as a fork: never chosen
    successes: int
    failures: int
    timeouts: int
    consecutive_failures: int

    @property
    def banned(self) -> bool:
        return self.banned_for_s > 0.0

    @property
    def routable(self) -> bool:
        """Neither banned nor excluded: the router may choose it (in-flight caps aside)."""
        return not self.banned and not self.excluded


class LatencyEMA:
    """Bias-corrected exponential moving average of seconds per sample (one peer, one kind)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self._raw = 0.0
        self.count = 0

    def update(self, seconds_per_sample: float) -> None:
        self._raw = (1.0 - self.alpha) * self._raw + self.alpha * seconds_per_sample
        self.count += 1

    @property
    def value(self) -> float:
        return self._raw / (1.0 - (1.0 - self.alpha) ** self.count) if self.count else 0.0


@dataclass
class PeerStats:
    """What one trainer knows about one peer of a stage, measured by itself."""

    peer_id: str
    addr: str
    alpha: float = field(default=0.1, repr=False)
    ema: ThroughputEMA = field(init=False, repr=False)  # samples/s, bias-corrected
    latency: dict[str, LatencyEMA] = field(init=False, repr=False)  # kind -> seconds per sample
    successes: int = 0
    failures: int = 0
    timeouts: int = 0  # failures that were this router's timeout (a tarpit's signature)
    consecutive_failures: int = 0
    banned_until: float | None = None  # clock() value; None when never banned
    convicted: bool = False  # the ban in force is a sentence (``ban``), not a failure's backoff
    in_flight: int = 0
    picks: int = 0  # how often choose() returned this peer
    alive: bool = False  # answered a progress poll since its last failure (see ``require_alive``)
    current: float = field(default=0.0, repr=False)  # smooth weighted round-robin counter

    def __post_init__(self) -> None:
        self.ema = ThroughputEMA(self.alpha)
        self.latency = {}

    @property
    def measured(self) -> bool:
        return self.ema.count > 0

    @property
    def proven(self) -> bool:
        """It has answered correctly at least once: off probation."""
        return self.successes > 0

    @property
    def throughput(self) -> float:
        """Bias-corrected EMA of samples/s; 0.0 before the first measurement."""
        return self.ema.value

    def banned_for(self, now: float) -> float:
        """Seconds of ban left at ``now`` (0.0 when usable)."""
        if self.banned_until is None:
            return 0.0
        return max(0.0, self.banned_until - now)

    def observe(self, samples: int, seconds: float, kind: str = "call") -> None:
        self.ema.update(samples, seconds)
        if samples > 0:
            self.latency.setdefault(kind, LatencyEMA(self.alpha)).update(seconds / samples)


class NewcomerPolls:
    """How a trainer's progress poll treats peers that never answered it (issue #18).

    A listed peer may be a tarpit: polled together with the others, it would hold every poll
    (and the trainer's loop behind it) for the poll's whole timeout. So a poll waits in full
    only for the peers that answered before; it is *ready* once those all finished and every
    stage has an answer from someone (or nothing left to wait for), and newcomers then get
    :meth:`grace_s` more: ``factor`` times what the poll took to get ready, at least
    ``floor_s``, at most ``ceiling_s``. An honest newcomer answers within that on any sane
    network (it answers as fast as its stage-mates); one that does not is left to finish in the
    background and is simply not in this poll's answers. A token bucket (:meth:`take`: ``rate``
    per second, ``burst`` at once) caps how many never-seen peers are probed, so 500 fresh
    records cost 500 connections only over ``500 / rate`` seconds. Pure: the clock is injected.
    """

    def __init__(self, *, factor: float = 1.0, floor_s: float = 0.05, ceiling_s: float = 0.25, rate: float = 20.0,
                 burst: int = 64, clock: Callable[[], float] = time.monotonic) -> None:
        if not (factor >= 0.0 and 0.0 <= floor_s <= ceiling_s and rate > 0.0 and burst >= 1):
            raise ValueError("need factor >= 0, 0 <= floor_s <= ceiling_s, rate > 0, burst >= 1")
        self.factor, self.floor_s, self.ceiling_s = factor, floor_s, ceiling_s
        self.rate, self.burst = rate, burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()

    @staticmethod
    def ready(trusted_pending: int, answered: Sequence[bool], newcomers_pending: Sequence[int]) -> bool:
        """Whether a poll has what it must wait for: no poll of a peer that answered before is
        pending, and every stage (``answered[k]``: some peer of stage k answered this poll) has
        an answer or no newcomer left to hear from."""
        return trusted_pending == 0 and all(a or n == 0 for a, n in zip(answered, newcomers_pending, strict=True))

    def grace_s(self, ready_after_s: float) -> float:
        """How much longer newcomers are waited for, once the poll was ready ``ready_after_s``
        seconds after it began."""
        return min(self.ceiling_s, max(self.floor_s, self.factor * max(0.0, ready_after_s)))

    def take(self, wanted: int) -> int:
        """How many of ``wanted`` never-seen peers may be probed now (and spend that many tokens)."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now
        granted = max(0, min(wanted, int(self._tokens)))
        self._tokens -= granted
        return granted


class StageRouter:
    """Chooses the peer for each request to one stage and learns from the outcomes."""

    def __init__(
        self,
        stage: int,
        *,
        alpha: float = 0.1,
        ban_base_s: float = 1.0,
        ban_max_s: float = 600.0,
        probation_ban_s: float = 30.0,
        probation_slots: int = 1,
        probation_timeout_s: float = 15.0,
        timeout_factor: float = 5.0,
        timeout_floor_s: float = 1.0,
        timeout_ceiling_s: float = 60.0,
        explore_weight: float | None = None,
        min_share: float = 0.01,
        max_in_flight: int | None = None,
        require_alive: bool = False,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        if not (0.0 < ban_base_s <= ban_max_s and 0.0 < probation_ban_s <= ban_max_s):
            raise ValueError("need 0 < ban_base_s <= ban_max_s and 0 < probation_ban_s <= ban_max_s")
        if probation_slots < 1:
            raise ValueError("probation_slots must be at least 1")
        if not (timeout_factor >= 1.0 and 0.0 < timeout_floor_s <= timeout_ceiling_s
                and 0.0 < probation_timeout_s):
            raise ValueError("need timeout_factor >= 1, 0 < timeout_floor_s <= timeout_ceiling_s, "
                             "probation_timeout_s > 0")
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
        self.probation_ban_s = probation_ban_s
        self.probation_slots = probation_slots
        self.probation_timeout_s = probation_timeout_s
        self.timeout_factor = timeout_factor
        self.timeout_floor_s = timeout_floor_s
        self.timeout_ceiling_s = timeout_ceiling_s
        self.explore_weight = explore_weight
        self.min_share = min_share
        self.max_in_flight = max_in_flight
        self.require_alive = require_alive
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._peers: dict[str, PeerStats] = {}
        self._gone: dict[str, PeerStats] = {}  # vanished while banned: restored if they come back
        self._excluded: frozenset[str] = frozenset()

    # ---- membership ----------------------------------------------------------------------

    def update_peers(self, view: Iterable[PeerView]) -> None:
        """Adopt the swarm's current view of this stage: its :attr:`PeerView.usable` peers are routed to.

        Vanished peers are forgotten, except that one banned right now is remembered until its
        ban ends (a fake record that comes and goes keeps its backoff); known peers keep their
        measurements and bans even if their address changed, except that a proven peer banned only
        for failed calls and now announcing another address (relayed through a new relay, restarted
        elsewhere) gets a new try at once: its failures were the old address's (a sentence from
        :meth:`ban` stays, and so does a never-proven peer's backoff: a fake that re-signs its record
        at a new port must not buy a probation call with each); new peers are added in sorted
        order, so the result does not depend on the view's order. A view of another stage is a
        caller's bug: ValueError.
        """
        peers: dict[str, str] = {}
        for p in view:
            if p.stage != self.stage:
                raise ValueError(f"stage {self.stage}'s router was given peer {p.peer_id[:12]} of stage {p.stage}")
            if p.usable:
                peers[p.peer_id] = p.addr
        now = self._clock()
        for peer_id in [p for p in self._gone if self._gone[p].banned_for(now) == 0.0]:
            del self._gone[peer_id]
        for peer_id in [p for p in self._peers if p not in peers]:
            stats = self._peers.pop(peer_id)
            if stats.banned_for(now) > 0.0:
                stats.in_flight = 0
                self._gone[peer_id] = stats
        for peer_id in sorted(peers):
            known = self._peers.get(peer_id) or self._gone.pop(peer_id, None)
            stats = known if known is not None else PeerStats(peer_id, peers[peer_id], alpha=self.alpha)
            if (stats.addr != peers[peer_id] and stats.proven and not stats.convicted
                    and stats.banned_for(now) > 0.0):
                stats.banned_until = now  # moved: the backoff was for the old address
            stats.addr = peers[peer_id]
            self._peers[peer_id] = stats

    def set_excluded(self, peer_ids: Collection[str]) -> None:
        """Peers the swarm excluded (two independent reports of wrong answers): never chosen."""
        self._excluded = frozenset(peer_ids)

    @property
    def excluded(self) -> frozenset[str]:
        return self._excluded

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def stats(self, peer_id: str) -> PeerStats:
        """The live record of one peer (KeyError if unknown); for tests and progress displays."""
        return self._peers[peer_id]

    # ---- choosing ------------------------------------------------------------------------

    def _probation_open(self) -> tuple[bool, bool]:
        """Whether an unproven peer may take one more call now, and whether it must have shown
        itself alive first (see the module docstring: ``require_alive``)."""
        now = self._clock()
        usable = [p for p in self._peers.values() if p.banned_for(now) == 0.0 and p.peer_id not in self._excluded]
        need_alive = self.require_alive and any(p.proven or p.alive for p in usable)
        if not any(p.proven for p in usable):
            return True, need_alive
        return sum(p.in_flight for p in self._peers.values() if not p.proven) < self.probation_slots, need_alive

    def _eligible(self, p: PeerStats, now: float, exclude: Collection[str], probation: tuple[bool, bool]) -> bool:
        probation_open, need_alive = probation
        return (
            p.banned_for(now) == 0.0
            and p.peer_id not in exclude
            and p.peer_id not in self._excluded
            and (self.max_in_flight is None or p.in_flight < self.max_in_flight)
            and (p.proven or (probation_open and p.in_flight == 0 and (p.alive or not need_alive)))
        )

    def choose(self, exclude: Collection[str] = ()) -> tuple[str, str] | None:
        """``(peer_id, data_addr)`` for the next request, or None if no peer is usable now.

        ``exclude`` names peers this request already failed on, so a retry goes to another
        peer of the same stage. Banned and excluded peers, peers on probation beyond its
        budget and, with ``max_in_flight``, saturated ones are skipped as well.
        """
        now = self._clock()
        probation = self._probation_open()
        candidates = [p for p in self._peers.values() if self._eligible(p, now, exclude, probation)]
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
        """``peer_id`` itself if it is usable now (known, not banned or excluded, not in
        ``exclude``, under the in-flight and probation caps), else :meth:`choose`'s pick.

        For a backward: the peer that served the microbatch's forward may still hold its
        activations. The round-robin counters are left alone, so affinity does not skew the
        weighted shares of the forwards it follows.
        """
        p = self._peers.get(peer_id) if peer_id is not None else None
        if p is not None and self._eligible(p, self._clock(), exclude, self._probation_open()):
            p.picks += 1
            return p.peer_id, p.addr
        return self.choose(exclude)

    def choose_only(self, peer_id: str) -> tuple[str, str] | None:
        """``peer_id`` itself if it is usable now, else None (nobody else instead, and the
        round-robin counters left alone): a spot check asking the same peer again."""
        p = self._peers.get(peer_id)
        if p is None or not self._eligible(p, self._clock(), (), self._probation_open()):
            return None
        return p.peer_id, p.addr

    def waiting_on_caps(self, exclude: Collection[str] = ()) -> bool:
        """Whether :meth:`choose` found nobody only because of in-flight or probation caps: some
        peer outside ``exclude`` is neither banned nor excluded, so a call ending frees one (an
        unproven peer that is not alive while ``require_alive`` holds frees nothing: not counted)."""
        now = self._clock()
        _, need_alive = self._probation_open()
        return any(
            p.banned_for(now) == 0.0 and p.peer_id not in exclude and p.peer_id not in self._excluded
            and (p.proven or p.alive or not need_alive)
            for p in self._peers.values()
        )

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

    # ---- timeouts ------------------------------------------------------------------------

    def typical_latency(self, kind: str = "call") -> float | None:
        """The stage's typical seconds per sample for ``kind``: the median over proven peers'
        EMAs (None before any proven peer answered one)."""
        values = [p.latency[kind].value for p in self._peers.values() if p.proven and kind in p.latency]
        return statistics.median(values) if values else None

    def timeout_for(self, peer_id: str, samples: int, kind: str = "call", *, floor_s: float | None = None) -> float:
        """Seconds to wait for a call of ``samples`` samples to ``peer_id`` (see the module
        docstring): ``timeout_factor`` x max(stage's typical, peer's own) x samples, clamped to
        ``[floor, timeout_ceiling_s]`` (``floor_s``, e.g. a larger one for calls with side
        effects, else ``timeout_floor_s``); with no estimate yet, the ceiling (at most
        ``probation_timeout_s`` for a peer on probation)."""
        typical = self.typical_latency(kind)
        p = self._peers.get(peer_id)
        own = p.latency[kind].value if p is not None and kind in p.latency else None
        if typical is None and own is None:
            if p is not None and p.proven:
                return self.timeout_ceiling_s
            return min(self.timeout_ceiling_s, self.probation_timeout_s)
        per_sample = max(typical or 0.0, own or 0.0)
        wait = self.timeout_factor * per_sample * max(1, samples)
        return min(self.timeout_ceiling_s, max(self.timeout_floor_s if floor_s is None else floor_s, wait))

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

    def report_success(self, peer_id: str, samples: int, seconds: float, kind: str = "call") -> None:
        """``samples`` went through ``peer_id`` in ``seconds``: update its throughput estimate
        and its latency for ``kind`` (a call's kind: ``forward``, ``backward``).

        A success resets the backoff and ends probation but does not lift a ban already in
        force: the ban came from a failure that may well be newer than the call that just
        succeeded. Reports about peers no longer in the view are ignored (the view can change
        while a call is running).
        """
        if samples < 0 or not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"need samples >= 0 and finite seconds >= 0, got {samples}, {seconds}")
        stats = self._peers.get(peer_id)
        if stats is None:
            return
        stats.in_flight = max(0, stats.in_flight - 1)
        stats.successes += 1
        stats.consecutive_failures = 0
        stats.observe(samples, seconds, kind)

    def report_alive(self, peer_id: str) -> None:
        """``peer_id`` answered a progress poll: an unproven peer may now be called (``require_alive``)."""
        stats = self._peers.get(peer_id)
        if stats is not None:
            stats.alive = True

    def report_failure(self, peer_id: str, *, timeout: bool = False) -> float:
        """Ban ``peer_id`` with exponential backoff; returns the ban length in seconds.

        The length is ``base * 2 ** (k - 1)`` for the ``k``-th consecutive failure, where
        ``base`` is ``ban_base_s`` for a proven peer and ``probation_ban_s`` for one that never
        answered, with +-10% jitter from ``rng``, and never more than ``ban_max_s``. A failure
        reported while the peer is banned is a call sent before that ban, failed by the same
        outage: counted, but neither ``k`` nor the ban grows (a trainer with ten calls in flight
        to a peer whose relay died would otherwise ban it for 2 ** 10 times the base at once, and
        wait out minutes after the peer came back). ``timeout``: the failure was this router's
        timeout (counted). Unknown peers: 0.0.
        """
        stats = self._peers.get(peer_id)
        if stats is None:
            return 0.0
        stats.in_flight = max(0, stats.in_flight - 1)
        stats.failures += 1
        stats.timeouts += int(timeout)
        stats.alive = False
        now = self._clock()
        if stats.banned_for(now) > 0.0:
            return stats.banned_for(now)
        stats.consecutive_failures += 1
        exponent = min(stats.consecutive_failures - 1, _MAX_BACKOFF_EXPONENT)
        jitter = 1.0 + self._rng.uniform(-JITTER, JITTER)
        base = self.ban_base_s if stats.proven else self.probation_ban_s
        ban = min(base * 2.0**exponent * jitter, self.ban_max_s)
        self._ban_until(stats, now + ban)
        stats.convicted = False
        return ban

    def ban(self, peer_id: str, seconds: float) -> None:
        """Ban ``peer_id`` for ``seconds`` (a caught liar), or longer if a ban in force ends later;
        the peer also loses its proof (it comes back on probation)."""
        if not (math.isfinite(seconds) and seconds > 0.0):
            raise ValueError(f"a ban lasts a finite positive time, got {seconds}")
        stats = self._peers.get(peer_id)
        if stats is None:
            return
        stats.successes = 0
        self._ban_until(stats, max(self._clock() + seconds, stats.banned_until or 0.0))
        stats.convicted = True

    @staticmethod
    def _ban_until(stats: PeerStats, until: float) -> None:
        stats.banned_until = until
        stats.current = 0.0  # come back from the ban with neither credit nor debt

    # ---- introspection -------------------------------------------------------------------

    def next_unban_in(self) -> float | None:
        """Seconds until the earliest ban expires; None when no peer is banned."""
        now = self._clock()
        left = [p.banned_for(now) for p in self._peers.values()]
        return min((s for s in left if s > 0.0), default=None)

    @property
    def usable_count(self) -> int:
        """Known peers neither banned right now nor excluded (exclusions of one call and
        in-flight caps not counted)."""
        now = self._clock()
        return sum(1 for p in self._peers.values() if p.banned_for(now) == 0.0 and p.peer_id not in self._excluded)

    def snapshot(self) -> list[RoutedPeer]:
        """Every known peer as this router stands with it now, sorted by id."""
        now = self._clock()
        weights = self._weights()
        return [
            RoutedPeer(
                peer_id=p.peer_id,
                addr=p.addr,
                throughput=p.throughput,
                measured=p.measured,
                proven=p.proven,
                alive=p.alive,
                weight=weights[p.peer_id],
                in_flight=p.in_flight,
                banned_for_s=p.banned_for(now),
                excluded=p.peer_id in self._excluded,
                successes=p.successes,
                failures=p.failures,
                timeouts=p.timeouts,
                consecutive_failures=p.consecutive_failures,
            )
            for p in sorted(self._peers.values(), key=lambda p: p.peer_id)
        ]
