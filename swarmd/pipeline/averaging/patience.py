"""How long a stage's averaging round waits for a contributor, as pure logic (issue #18).

SWARM's stage-mates average their gradients in rounds (Ryabinin et al., 2023, section 3.2;
``swarmd.pipeline.averaging.averager``): the leader waits for every expected stage-mate's contribution,
at most ``averaging_timeout_s``. A proof (``swarmd.net.proof``) shows that a peer holds its
identity and serves at its address, not that it will contribute, and identities are free: a
fake can pass the proof, answer ``/v1/progress`` with an honest stage-mate's numbers and then
never send anything. Waiting the whole timeout for it at every round would stall the stage.

So the leader learns what honest rounds take: the delay from opening a round to each
contribution that arrived, in rounds that stepped, for the stage and for each contributor. Once
it has seen ``min_samples`` of them, a round waits ``factor`` times the stage's median, within
``[floor_s, timeout]`` (the median, so a minority of slow or late peers cannot stretch everyone's
patience), or longer for an expected peer that has contributed before: ``factor`` times the
slowest of its own recent delays (SWARM's peers are heterogeneous: a slow honest link is waited
for as it always was). A contributor still missing then was *silent*: the round goes on without
it and the leader excludes it like its other offenders (``round_checks.Suspicions``: 10 s,
doubling to 10 min). Before the leader has seen enough rounds, the round timeout holds, and a
contributor missing at the deadline is silent as well. An honest peer that froze for longer
than that pays one exclusion period (it downloads its stage's state afterwards, as any peer that
fell behind); a fake that never contributed gets only the stage's patience, and pays for every
return with a longer exclusion.

A leader also waits, before it opens a round, for the contributors of the round it just led
(:class:`CatchUp`): they are one step behind while its answer is on its way and being applied (a
second or more over a 100 ms, 100 Mbit/s link). Under delayed updates the leader alone often
holds a full batch again by the time it stepped; opening then would leave them out, step alone,
and leave them behind: they resync from it and their samples are dropped, round after round
(issue 28, bench_wan at wan100: one peer of each stage in 1 round of 10). It waits at most a
grace (the stage's patience): a contributor that lost the answer resyncs meanwhile, and a peer
that never contributes is never waited for. One that made it wait in vain (still behind when the
grace ran out: a liar about its step, or a peer that froze) is not waited for again for the next
``forget_after`` rounds, so a contributor cannot cost every round a grace.

A round opens only once the stage-mates at its step name the same leader (:class:`Dissent`): one
that names another means the views of the stage differ (a peer joined or left, a leader is
suspected), and they agree again within a poll or two. A proven fake can name a leader no honest
peer would choose at every poll, and waiting for it to agree would stall the stage for as long as
it answers. So a mate is waited for to agree for the stage's patience at most; one that has named
another leader for longer is left out of this peer's rounds (its samples not counted, not waited
for) until it names the same leader again. An honest mate whose view lags pays nothing; one whose
view stays apart (it cannot see this leader) rounds with those it can see, and the steps of the two
groups are reconciled as any peer that fell behind is (it resyncs from the majority).

Pure: times are given, nothing sleeps. The averager feeds it and asks it.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Collection, Iterable, Mapping

__all__ = ["CatchUp", "Dissent", "RoundPatience"]


class RoundPatience:
    """A leader's estimate of how long its rounds' contributions take to arrive."""

    def __init__(self, *, factor: float = 4.0, floor_s: float = 3.0, window: int = 64, min_samples: int = 3,
                 per_peer: int = 8, max_peers: int = 1024) -> None:
        if not (factor >= 1.0 and floor_s > 0.0 and window >= 1 and 1 <= min_samples <= window and per_peer >= 1
                and max_peers >= 1):
            raise ValueError("need factor >= 1, floor_s > 0, window >= 1, 1 <= min_samples <= window, "
                             "per_peer >= 1, max_peers >= 1")
        self.factor, self.floor_s, self.min_samples = factor, floor_s, min_samples
        self.per_peer, self.max_peers = per_peer, max_peers
        self._delays: deque[float] = deque(maxlen=window)
        self._own: dict[str, deque[float]] = {}  # contributor -> its recent delays (insertion order: oldest first)

    def observe(self, delays_s: Mapping[str, float]) -> None:
        """Contributions of a round that stepped arrived these many seconds after it opened (by peer)."""
        for pid, delay in sorted(delays_s.items()):
            delay = max(0.0, delay)
            self._delays.append(delay)
            own = self._own.pop(pid, None) or deque(maxlen=self.per_peer)
            own.append(delay)
            self._own[pid] = own  # most recently seen last
        while len(self._own) > self.max_peers:
            del self._own[next(iter(self._own))]

    @property
    def samples(self) -> int:
        return len(self._delays)

    def wait_s(self, timeout_s: float, expected: Iterable[str] = ()) -> float:
        """How long a round expecting ``expected`` waits for its contributors (at most ``timeout_s``)."""
        if len(self._delays) < self.min_samples:
            return timeout_s
        wait = max(self.floor_s, self.factor * statistics.median(self._delays))
        for pid in expected:
            own = self._own.get(pid)
            if own:
                wait = max(wait, self.factor * max(own))
        return min(timeout_s, wait)

    @staticmethod
    def silent(expected: Iterable[str], arrived: Iterable[str], *, leader: str) -> set[str]:
        """The contributors a round that ended waited for in vain. (A round opens only once every
        expected peer's progress names this leader, so an honest one among them was coming.)"""
        return set(expected) - set(arrived) - {leader}


class CatchUp:
    """Whether a leader holds off opening a round for the contributors of its last round that are
    still applying its answer (pure: the times are passed in)."""

    def __init__(self, *, forget_after: int = 10) -> None:
        self.forget_after = forget_after
        self._last: tuple[int, frozenset[str]] = (-1, frozenset())  # the step and contributors of the last round led
        self._since: tuple[int, float] | None = None  # the step it first held off at, and when
        self._vain: dict[str, int] = {}  # contributor -> the step at which the leader waited for it in vain

    def stepped(self, step: int, contributors: Iterable[str]) -> None:
        """This peer led the round of ``step`` and applied it, with these contributors (itself aside)."""
        self._last = (step, frozenset(contributors))

    def behind(self, step: int, mate_steps: Mapping[str, int]) -> frozenset[str]:
        """The contributors of the last round led (at ``step - 1``) that are still at ``step - 1``."""
        last_step, contributors = self._last
        if last_step != step - 1:
            return frozenset()
        return frozenset(pid for pid in contributors if mate_steps.get(pid) == step - 1
                         and not 0 <= step - self._vain.get(pid, -2 * self.forget_after) <= self.forget_after)

    def holds_off(self, step: int, mate_steps: Mapping[str, int], *, now: float, grace_s: float) -> bool:
        """Whether a round at ``step`` waits: some contributor of the last round is :meth:`behind`, and
        the leader has not held off at this step for ``grace_s`` yet."""
        behind = self.behind(step, mate_steps)
        if not behind:
            return False
        if self._since is None or self._since[0] != step:
            self._since = (step, now)
        if now - self._since[1] < grace_s:
            return True
        for pid in behind:  # waited for in vain: not again for a while
            self._vain[pid] = step
        return False


class Dissent:
    """Stage-mates that name another leader than this peer's, and since when (pure: the times are
    passed in). Counts every mate it starts to disregard (``left_out``, for ``/status``)."""

    def __init__(self, *, max_peers: int = 1024) -> None:
        self.max_peers = max_peers
        self._since: dict[str, float] = {}  # mate -> when it began naming another leader (reset once it agrees)
        self._disregarded: set[str] = set()
        self.left_out = 0

    def disregarded(self, named: Mapping[str, str | None], leader: str, *, now: float, grace_s: float,
                    mates: Collection[str] | None = None) -> frozenset[str]:
        """Of the mates at this peer's step and parameters, with the leader each names (``named``),
        those that have named another than ``leader`` for ``grace_s`` or longer: not waited for.
        ``mates``: the stage-mates listed now (the others, gone, are forgotten)."""
        if mates is not None:
            for pid in [pid for pid in self._since if pid not in mates]:
                self._forget(pid)
        for pid, theirs in named.items():
            if theirs == leader:
                self._forget(pid)
            else:
                self._since.setdefault(pid, now)
        while len(self._since) > self.max_peers:  # the oldest dissent first (insertion order)
            self._forget(next(iter(self._since)))
        out = frozenset(pid for pid in named if pid in self._since and now - self._since[pid] >= grace_s)
        self.left_out += len(out - self._disregarded)
        self._disregarded |= out
        return out

    def _forget(self, pid: str) -> None:
        """``pid`` agrees, or is gone: it dissents no more."""
        self._since.pop(pid, None)
        self._disregarded.discard(pid)

    @property
    def current(self) -> frozenset[str]:
        """The mates disregarded at the last call that named another leader (for ``/status``)."""
        return frozenset(self._disregarded)
