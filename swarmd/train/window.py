"""How many microbatches a trainer keeps in flight: Little's law over the costs it measured (issue #31, item 3).

A pipeline idles unless enough microbatches are in flight to cover one microbatch's trip. With one
microbatch taking ``cycle`` seconds from the trainer through every stage and back (each stage's round
trips and its own compute, :class:`StageCost`), and the slowest stage finishing one every ``bottleneck``
seconds (its compute per microbatch over its peers, which share its work), Little's law says the
pipeline runs at the bottleneck's rate only with at least ``cycle / bottleneck`` microbatches in flight
(:func:`in_flight_for`). Round trips add to the cycle but not to the bottleneck, so a longer link or a
deeper pipeline asks for more in flight; more than that only queues at the bottleneck (and holds
activations in the stages' caches for longer). SWARM (Ryabinin et al. 2023, section 3.2) leaves the
number to the trainer; GPipe's answer is "every microbatch of the step", whatever the link.

Little's law is the fluid bound: a stage's worker runs its calls one at a time in arrival order, so a
microbatch's backward waits behind forwards of later ones (and a stage before the last serves both),
and exactly that many in flight still idles the bottleneck now and then. Replayed in the sync step's
model (``swarmd.pipeline.schedule.sync_step``, 2-6 stages, round trips of 0-200 ms, stages as fast as
each other or twice as slow, 64 microbatches), the bound rounded up ran up to 1.27x (mean 1.09x) the
step of an unlimited window, and :data:`HEADROOM` times it at most 1.03x (mean 1.004x):
the window is ``ceil(HEADROOM * need)``.

The costs (:class:`CallCosts`):

- a microbatch's trip through a stage: the trainer's fastest recent call of each kind (``forward``,
  ``backward``; the last stage's fused call is a ``backward``), in seconds per sample. The fastest, not
  the mean: a call that waited in a peer's queue behind others says how full the window is, not what
  the stage costs, and a mean would shrink the window by exactly the queueing a too-large window
  causes (a loop that settles below the need);
- a peer's compute: what the stage's peers announce in their DHT records (``throughput``, samples/s
  of a forward and a backward, timed on their worker thread: no queue, no transfer), as ``/swarm``
  lists it; the rest of the trip is latency (round trips, transfers, coding), which more microbatches
  in flight hide. A peer that announces nothing yet (or a lie) is bounded: its compute is never more
  than the trip, and the window stays within ``[2, MOST]``;
- without an announcement, a peer's round trip: the fastest recent answer to a progress poll
  (``GET /v1/progress``, a few bytes each way, answered at once when the peer is at the step asked
  for), the minimum filter of TCP's and BBR's RTT estimates; a call's time less its round trip is
  then the stage's compute. That counts the activations' transfer as compute, which errs towards a
  smaller window, by a lot on a long link (TCP's slow start): measured alone, it asked for 2 in flight
  where ``tiny`` at 100 ms needs about 50 (docs/BENCHMARKS.md, the bench_gpipe section).

:class:`WindowSizer` turns each new estimate into the window in force, smoothed: an exponential
average of the estimates, grown as soon as it asks for more (an idle stage costs throughput at once),
shrunk only once it is clearly below (a window that flaps costs nothing but is hard to read), clamped
to ``[2, the step's microbatches]`` (a sync step's; an asynchronous trainer's lease book caps it by the step's
samples already) and to :data:`MOST`. Until every stage has been measured the window
is its start (:data:`START`, the fixed default it replaces). Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HEADROOM", "LEAST", "MOST", "START", "CallCosts", "StageCost", "WindowSizer", "in_flight_for"]

#: The window before anything is measured (the fixed window it replaces).
START = 8
#: Never more in flight than this, whatever the measurements say: each holds activations in the stages, whose
#: caches keep 64 microbatches a peer by default (``StageExecutor``; no stage announces its limit yet).
MOST = 64
#: Never fewer (one in flight leaves every stage but one idle).
LEAST = 2
#: The window over Little's law's bound (see the module docstring: measured on the sync step's model).
HEADROOM = 1.5
#: Recent measurements a minimum is taken over (per stage and kind, per peer).
KEEP = 32


@dataclass(frozen=True)
class StageCost:
    """One stage's costs for one microbatch: ``compute_s``, a peer's own seconds (its forward and
    backward, or the last stage's fused call); ``latency_s``, the rest of the microbatch's trip through
    the stage (round trips, transfers, coding); ``peers``, how many peers share the stage's work."""

    compute_s: float
    latency_s: float
    peers: int = 1


def in_flight_for(stages: Sequence[StageCost]) -> float | None:
    """Little's law: microbatches in flight that keep the slowest stage busy, ``sum(latency + compute)
    / max(compute / peers)`` (unrounded); None without stages or with no compute measured."""
    if not stages:
        return None
    bottleneck = max(s.compute_s / max(1, s.peers) for s in stages)
    if not bottleneck > 0.0:
        return None
    return sum(s.latency_s + s.compute_s for s in stages) / bottleneck


class _Recent:
    """The smallest of the last ``keep`` values."""

    def __init__(self, keep: int) -> None:
        self._values: deque[float] = deque(maxlen=keep)

    def add(self, value: float) -> None:
        self._values.append(value)

    @property
    def least(self) -> float | None:
        return min(self._values) if self._values else None


class CallCosts:
    """A trainer's measurements, reduced to what :func:`in_flight_for` needs (see the module docstring)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._calls: dict[tuple[int, str], _Recent] = {}  # (stage, kind) -> seconds per sample
        self._rtt: dict[tuple[int, str], _Recent] = {}  # (stage, peer) -> seconds

    def call(self, stage: int, kind: str, samples: int, seconds: float) -> None:
        """A call of ``kind`` with ``samples`` samples took ``seconds`` (from the trainer's request to its answer)."""
        if samples > 0 and math.isfinite(seconds) and seconds >= 0.0:
            self._calls.setdefault((stage, kind), _Recent(self.keep)).add(seconds / samples)

    def poll(self, stage: int, peer_id: str, seconds: float) -> None:
        """A progress poll of ``peer_id`` (of ``stage``) was answered in ``seconds``."""
        if math.isfinite(seconds) and seconds >= 0.0:
            self._rtt.setdefault((stage, peer_id), _Recent(self.keep)).add(seconds)

    def rtt(self, stage: int) -> float:
        """The stage's round trip: the median over its peers of each one's fastest poll (0 unmeasured)."""
        fastest = [r.least for (k, _), r in self._rtt.items() if k == stage and r.least is not None]
        return statistics.median(fastest) if fastest else 0.0

    def stages(self, n_stages: int, microbatch: int, peers: Sequence[int],
               announced: Sequence[Sequence[float]] = ()) -> list[StageCost] | None:
        """Each stage's :class:`StageCost` for a microbatch of ``microbatch`` samples (``peers``: usable
        peers per stage; ``announced``: per stage, the throughputs its peers announce, samples/s); None
        until every stage's calls were measured."""
        out = []
        for stage in range(n_stages):
            kinds = ("backward",) if stage == n_stages - 1 else ("forward", "backward")
            per_sample = [self._calls[(stage, k)].least if (stage, k) in self._calls else None for k in kinds]
            if any(v is None for v in per_sample):
                return None
            trip = sum(v * microbatch for v in per_sample if v is not None)
            rates = [r for r in (announced[stage] if stage < len(announced) else ()) if math.isfinite(r) and r > 0]
            if rates:
                compute = min(trip, microbatch / statistics.median(rates))
            else:
                rtt = self.rtt(stage)
                compute = sum(max(0.0, v * microbatch - rtt) for v in per_sample if v is not None)
            out.append(StageCost(compute_s=compute, latency_s=trip - compute,
                                 peers=peers[stage] if stage < len(peers) else 1))
        return out


class WindowSizer:
    """The window in force (see the module docstring): ``start`` until measured, then ``headroom`` times the
    smoothed :func:`in_flight_for`, rounded up, grown at once, shrunk once that is ``shrink_below`` under
    it. ``alpha``: the newest estimate's weight in the average."""

    def __init__(self, *, start: int = START, alpha: float = 0.3, shrink_below: float = 1.5, most: int = MOST,
                 headroom: float = HEADROOM) -> None:
        if start < 1 or not 0.0 < alpha <= 1.0 or shrink_below < 0.0 or most < LEAST or headroom < 1.0:
            raise ValueError("need start >= 1, 0 < alpha <= 1, shrink_below >= 0, most >= 2 and headroom >= 1")
        self.alpha, self.shrink_below, self.most, self.headroom = alpha, shrink_below, most, headroom
        self.current = start
        self.estimate: float | None = None  # the smoothed in-flight need (None: nothing measured yet)

    def update(self, stages: Sequence[StageCost] | None, microbatches: int) -> int:
        """The window for a step of ``microbatches`` microbatches, after a new estimate from ``stages``
        (None: nothing new measured)."""
        need = in_flight_for(stages) if stages is not None else None
        if need is not None:
            self.estimate = need if self.estimate is None else (1 - self.alpha) * self.estimate + self.alpha * need
        if self.estimate is not None:
            target = self.headroom * self.estimate
            wanted = min(self.most, max(LEAST, math.ceil(target - 1e-9)))
            if wanted > self.current or target < self.current - self.shrink_below:
                self.current = wanted
        return self.window(microbatches)

    def window(self, microbatches: int) -> int:
        """The window in force for a step of ``microbatches`` (more in flight than that is not possible)."""
        return max(1, min(self.current, self.most, microbatches))
