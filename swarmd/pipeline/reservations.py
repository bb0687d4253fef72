"""Sample reservations: how many trainers share one step's batch without overfilling it.

A stage steps once its peers hold ``target_batch_size`` samples (``swarmd.pipeline.averaging.averager``).
With one trainer, pacing to that target from what the stages hold and what *it* has in flight is
enough; with several, each one's in-flight work is invisible to the others, they overfill the
step together, and every microbatch that straddles the step boundary is refused as stale and
redone (issue 13 measured 74% redone with three trainers). So the trainers coordinate through
the stage instead: one peer of the first stage keeps a *lease book* for the stage's current
step, and a trainer starts a microbatch only under a lease from it. This module is that book,
pure logic with an injected clock; ``swarmd.net.server`` serves it as ``POST /v1/reserve`` and
the trainer (``swarmd.train.trainer``) paces through it.

The reservation rule, for the stage at step ``s``::

    base + sum(samples of every lease of step s) <= target_batch_size

``base`` is what the stage holds at ``s`` that no lease of this book accounts for (samples a
``--sync`` trainer or an older trainer sent without a lease, or leases of a book that died with
its peer), learnt from the held samples the trainers report; a lease is *open* until its trainer
reports it done (its microbatch's backward on this stage was accepted) and *done* after. A grant
is cut to what fits, so the step's samples add up to exactly the target. The book only ever
looks at one step: when the stage steps, every lease of the old step is void and the new step
starts empty.

Who gets what fits: each trainer's *fair share* (``swarmd.pipeline.fair_share``), not first come,
first served. The book remembers what every trainer last asked for and was not granted; a trainer
that asked within ``active_s`` keeps its claim on the next step too (it is waiting for that step),
and a grant to another trainer leaves room for it: the samples are shared out microbatch by
microbatch to whoever holds the fewest of the step. First come, the trainer whose request arrived
first after a step opened took as many leases as its window held, whole steps when the window was
as large as the step, and a trainer that happened to ask later got none for many steps in a row.
A claim lapses ``active_s`` after its trainer's last request (a trainer that died or left stalls
the step at most that long), and a request for no leases withdraws it.

Failure cases, and what the rule does about them:

- **A trainer dies holding leases.** Open leases expire ``lease_s`` after their last renewal
  (trainers renew theirs with every request), and their samples go back to the step: the swarm
  stalls at most ``lease_s`` for them. Done leases never expire: their samples are in the
  stage's accumulators.
- **A peer dies holding accumulated samples.** The stage's round comes up short and is aborted
  (nothing is stepped), while the book counts those samples as done: the trainers report held
  samples below what the book counts. A deficit that lasts ``grace_s`` is written off (counted
  in ``written_off``), and the book grants exactly the missing samples again.
- **The book's peer dies.** Trainers turn to the next peer of the stage (the smallest live peer
  id), whose book starts from the held samples reported to it: the open leases of the dead book
  are unknown there, so that one step may be overfilled by them (their microbatches redone as
  stale, counted; nothing is lost or counted twice).
- **Work without a lease** (a ``--sync`` trainer's top-ups, an older trainer) shows up in the held
  samples and becomes ``base``; leases already granted may then overfill the step by it.
- **A trainer asks and stops asking** (it died, or left without a last report): the share kept for
  it lapses ``active_s`` after its last request, and the others are granted it then.
- **Two trainers' views of the stage differ** (a peer joined and is the smallest id for one of
  them only): two books serve one step for a moment, with the overfill of the case above.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from swarmd.pipeline.fair_share import Claim, fair_shares

__all__ = ["MAX_ASKERS", "MAX_LEASE_S", "MAX_LEASES", "MIN_LEASE_S", "Grant", "Lease", "LeaseBook"]

#: Bounds on the lease a trainer may ask for, in seconds.
MIN_LEASE_S = 0.5
MAX_LEASE_S = 300.0
#: Leases one book holds at most (a step of 4096 microbatches; more is refused, not stored).
MAX_LEASES = 4096
#: Trainers whose claims one book remembers at most (past it, the one that asked longest ago is forgotten).
MAX_ASKERS = 256


@dataclass
class Lease:
    """Samples of one microbatch of ``trainer``, reserved for the book's step."""

    lease_id: int
    trainer: str
    samples: int
    expires: float  # on the book's clock; only an open lease expires
    done: bool = False


@dataclass
class Asker:
    """What a trainer last asked the book for (its claim on the step, see :mod:`swarmd.pipeline.fair_share`)."""

    size: int
    wants: int  # samples asked for and not granted
    asked: float  # when, on the book's clock
    granted: int = 0  # samples granted it so far (a newcomer starts level with the least granted claimant)


@dataclass(frozen=True)
class Grant:
    """A reservation's answer: the leases granted now (``(lease_id, samples)``, possibly none),
    for ``step``, and how full the step is after them."""

    step: int
    leases: tuple[tuple[int, int], ...]
    reserved: int  # base + every lease of the step, after this grant
    target: int
    promised: int = 0  # free samples kept for other trainers' fair shares (they asked, and will be granted them)

    @property
    def full(self) -> bool:
        """Whether the step is spoken for: leased, held, or kept for another trainer's share."""
        return self.reserved + self.promised >= self.target


@dataclass
class BookCounters:
    """What the book did, for ``/status`` (cumulative over steps)."""

    granted: int = 0  # leases granted
    granted_samples: int = 0
    completed: int = 0  # leases reported done while their step was still open here
    expired: int = 0  # open leases whose trainer stopped renewing them
    expired_samples: int = 0
    written_off: int = 0  # done samples the stage lost (a peer died holding them)
    outside: int = 0  # samples held at a step without a lease of this book
    fair_cuts: int = 0  # requests granted fewer leases than fit, to keep other trainers' fair shares

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class LeaseBook:
    """The lease book of one stage peer (see the module docstring); owned by the event loop."""

    target: int
    clock: Callable[[], float] = time.monotonic
    grace_s: float = 2.0
    active_s: float = 2.0  # a trainer's claim on the step lasts this long after its last request
    step: int = 0
    base: int = 0
    leases: dict[int, Lease] = field(default_factory=dict)
    askers: dict[str, Asker] = field(default_factory=dict)
    counters: BookCounters = field(default_factory=BookCounters)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _deficit_since: float | None = None

    @property
    def reserved(self) -> int:
        """Samples the step counts: ``base`` plus every lease, open or done."""
        return self.base + sum(lease.samples for lease in self.leases.values())

    def open_samples(self) -> int:
        return sum(lease.samples for lease in self.leases.values() if not lease.done)

    def status(self) -> dict[str, int]:
        """The book now and its counters, for ``/status``."""
        return {"step": self.step, "reserved": self.reserved, "open": self.open_samples(), "target": self.target,
                **self.counters.to_dict()}

    def reserve(
        self,
        trainer: str,
        *,
        step: int,
        size: int,
        count: int,
        lease_s: float,
        done: Iterable[int] = (),
        renew: Iterable[int] = (),
        held: int | None = None,
    ) -> Grant:
        """Grant ``trainer`` up to ``count`` leases of at most ``size`` samples each for ``step``
        (the stage's step now), after marking its ``done`` leases, renewing its ``renew`` leases
        for ``lease_s``, expiring leases nobody renewed, and reconciling with ``held``: the
        samples the stage holds at ``step``, as the trainer last saw them (None: unknown). The
        grant is at most the trainer's fair share of what is free (see the module docstring)."""
        now = self.clock()
        lease_s = min(max(lease_s, MIN_LEASE_S), MAX_LEASE_S)
        self._roll(step)
        for lease_id in done:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.trainer == trainer and not lease.done:
                lease.done = True
                self.counters.completed += 1
        for lease_id in renew:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.trainer == trainer and not lease.done:
                lease.expires = now + lease_s
        self._expire(now)
        if held is not None:
            self._reconcile(held, now)
        asker = self._asked(trainer, size=size, count=count, now=now)
        room = self.target - self.reserved
        shares = fair_shares(self._claims(now), room, max_grants=MAX_LEASES - len(self.leases))
        share = shares.get(trainer, 0)
        granted: list[tuple[int, int]] = []
        while len(granted) < count and share > 0 and size > 0 and len(self.leases) < MAX_LEASES:
            samples = min(size, share)
            lease = Lease(next(self._ids), trainer, samples, now + lease_s)
            self.leases[lease.lease_id] = lease
            granted.append((lease.lease_id, samples))
            share -= samples
            self.counters.granted += 1
            self.counters.granted_samples += samples
        asker.wants = (count - len(granted)) * size if size > 0 else 0
        asker.granted += sum(n for _, n in granted)
        if len(granted) < count and sum(n for _, n in granted) < min(room, count * size):
            self.counters.fair_cuts += 1
        promised = sum(n for t, n in shares.items() if t != trainer)
        return Grant(step=self.step, leases=tuple(granted), reserved=self.reserved, target=self.target,
                     promised=promised)

    def _asked(self, trainer: str, *, size: int, count: int, now: float) -> Asker:
        """Note ``trainer``'s request (its claim, until it is granted), forgetting claims older than
        ``active_s``, and past :data:`MAX_ASKERS` (a flood of names) the one that asked longest ago."""
        for name in [t for t, a in self.askers.items() if now - a.asked > self.active_s and t != trainer]:
            del self.askers[name]
        asker = self.askers.get(trainer)
        if asker is None:
            while len(self.askers) >= MAX_ASKERS:
                del self.askers[min(self.askers, key=lambda t: self.askers[t].asked)]
            level = min((a.granted for a in self.askers.values()), default=0)  # no head start, no catching up
            asker = self.askers[trainer] = Asker(size=size, wants=0, asked=now, granted=level)
        asker.size, asker.wants, asker.asked = size, count * size if size > 0 else 0, now
        return asker

    def _claims(self, now: float) -> list[Claim]:
        """Every live claim on the step: what each trainer holds of it and still asks for."""
        has: dict[str, int] = {}
        for lease in self.leases.values():
            has[lease.trainer] = has.get(lease.trainer, 0) + lease.samples
        return [Claim(trainer=t, has=has.get(t, 0), wants=a.wants, size=a.size, credit=a.granted)
                for t, a in self.askers.items() if a.wants > 0 and now - a.asked <= self.active_s]

    def _roll(self, step: int) -> None:
        """The stage is at ``step``: a book of another step starts over (its leases are void)."""
        if step != self.step:
            self.step = step
            self.base = 0
            self.leases.clear()
            self._deficit_since = None

    def _expire(self, now: float) -> None:
        for lease_id in [i for i, lease in self.leases.items() if not lease.done and lease.expires <= now]:
            lease = self.leases.pop(lease_id)
            self.counters.expired += 1
            self.counters.expired_samples += lease.samples

    def _reconcile(self, held: int, now: float) -> None:
        """Learn samples held without a lease (they join ``base``), and write off done samples
        the stage no longer holds once the shortfall has lasted ``grace_s`` (the trainers'
        reports lag the stage by a poll, so a short one is only that)."""
        surplus = held - self.reserved  # more than every lease could account for
        if surplus > 0:
            self.base += surplus
            self.counters.outside += surplus
        done = sum(lease.samples for lease in self.leases.values() if lease.done)
        deficit = self.base + done - held
        if deficit <= 0:
            self._deficit_since = None
        elif self._deficit_since is None:
            self._deficit_since = now
        elif now - self._deficit_since >= self.grace_s:
            self.base -= deficit
            self.counters.written_off += deficit
            self._deficit_since = None
