"""Who counts as a peer of the stage for the all-reduce's quorum, as pure logic (issue #28).

The chunked all-reduce (``swarmd.pipeline.averaging.allreduce.averager``) starts and commits a round only with a
quorum of the stage (``plan.quorum``): its safety argument needs every coordinator to
*count* every peer that could be a member of another round at the same step. The DHT listing
alone is a poor count both ways:

- it *shrinks* under load: records live ``3 x announce_period_s``, and a loaded peer that misses
  its refreshes drops out of every listing while it still takes part in rounds (the 2 x 8 scale
  test at load ~19 committed a round of 2 members in a stage of 8 that way);
- it *swells* with records nobody answers at: a flood of fake records (tarpits, black holes)
  counts until each expires, and a fake re-signs its record at will, so a lone honest peer never
  has a quorum.

So this view counts a peer that

1. is listed now, or was listed within ``remember_s`` and no probe since its record dropped out
   found it *gone* (its port refused the connection: no process serves there) -- an expired
   record of a live peer keeps counting for ``remember_s``, probed meanwhile;
2. has answered this peer at least once (a proof, a progress answer, a report), or was first
   listed less than ``mute_after_s`` ago and did not fail ``mute_after_failures`` challenges or
   probes in a row -- a record that never answered is counted apart
   (:meth:`StageMembership.mute`), so a tarpit flood does not inflate the count for longer than
   two failed proofs (seconds), ``mute_after_s`` at most;
3. did not say, in an answer of the last ``away_memory_s``, that it takes no part in this stage's
   rounds (``away``: starting, moving, paused; or its answer was for another stage or peer).

Safety: the quorum's claim (two disjoint rounds at one step cannot both commit unless each
coordinator excludes a member of the other's) holds verbatim with "listed" replaced by "counted"
(the proof only uses that each coordinator's denominator holds every member of both rounds). A
member ``b`` of a round is counted by every coordinator ``X`` except when (i) ``X`` never heard
from ``b`` at all since listing it, for ``mute_after_s`` or two failed challenges (``X`` could
never reach ``b``: an asymmetric partition from the start, across which no averaging mode is
safe, since neither can see the other's rounds; or ``b`` is a newcomer so loaded that it missed
its first two proofs, a window of seconds after it is first listed); (ii) ``b`` answered ``X``
``away`` less than ``away_memory_s`` ago and joined a round since (it resumed: a window of one
probe period, as the listing's cache second was before); (iii) ``b``'s record dropped out more
than ``remember_s`` ago while ``b`` still serves (a peer that missed every refresh for that long).
The price is liveness: a peer that died without its port refusing connections (its machine is
gone) counts ``remember_s`` longer than its record did, so a survivor of two waits that much
longer; a SIGKILLed process refuses at once and stops counting at the next probe.

Pure: times are passed in, nothing sleeps or dials; the averager feeds it (listings, answers,
probe results) and asks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["StageMembership"]

#: An expired record of a peer that was not found gone counts this long.
REMEMBER_S = 30.0
#: A listed record that never answered this peer counts this long after it was first listed.
MUTE_AFTER_S = 10.0
#: A listed record that never answered this peer stops counting after this many failed challenges/probes in a row.
MUTE_AFTER_FAILURES = 2
#: An answer saying "away" (no part in this stage's rounds) holds this long.
AWAY_MEMORY_S = 10.0


@dataclass
class _Seen:
    addr: str
    first_listed: float
    last_listed: float
    answered: bool = False  # it answered this peer at least once
    away_at: float | None = None  # when its latest answer said it takes no part in this stage's rounds
    gone_at: float | None = None  # when a probe found no process at its address (after its last listing)
    probed_at: float = -1e18  # when it was last probed (any outcome)
    failures: int = 0  # challenges or probes that failed in a row


class StageMembership:
    """The stage's peers as the quorum counts them (see the module docstring)."""

    def __init__(self, *, remember_s: float = REMEMBER_S, mute_after_s: float = MUTE_AFTER_S,
                 away_memory_s: float = AWAY_MEMORY_S, mute_after_failures: int = MUTE_AFTER_FAILURES,
                 max_peers: int = 4096) -> None:
        if not (remember_s >= 0 and mute_after_s >= 0 and away_memory_s >= 0 and max_peers >= 1
                and mute_after_failures >= 1):
            raise ValueError("need remember_s, mute_after_s, away_memory_s >= 0, mute_after_failures >= 1 and "
                             "max_peers >= 1")
        self.remember_s, self.mute_after_s, self.away_memory_s = remember_s, mute_after_s, away_memory_s
        self.mute_after_failures = mute_after_failures
        self.max_peers = max_peers
        self._seen: dict[str, _Seen] = {}
        self._listed: frozenset[str] = frozenset()

    def observe(self, listed: Mapping[str, str], now: float) -> None:
        """The stage's serving records as read now (peer id -> data address)."""
        self._listed = frozenset(listed)
        for pid, addr in listed.items():
            s = self._seen.get(pid)
            if s is None or s.addr != addr:  # new, or at a new address: it must answer there
                self._seen[pid] = _Seen(addr, now, now)
            else:
                s.last_listed = now
        for pid in [pid for pid, s in self._seen.items()
                    if pid not in self._listed and now - s.last_listed > self.remember_s]:
            del self._seen[pid]
        while len(self._seen) > self.max_peers:  # the oldest entry first (a flood of records)
            del self._seen[next(iter(self._seen))]

    def answered(self, peer_id: str, now: float, *, away: bool | None = None) -> None:
        """``peer_id`` answered this peer: a progress poll (``away``: whether it said it takes no part in
        this stage's rounds), or something that says nothing of that (None: a proof)."""
        s = self._seen.get(peer_id)
        if s is None:
            return
        s.answered = True
        s.failures = 0
        if away is not None:
            s.away_at = now if away else None
            s.probed_at = max(s.probed_at, now)

    def failed(self, peer_id: str, now: float, *, gone: bool) -> None:
        """A probe of ``peer_id`` got no answer; ``gone``: its address refused the connection."""
        s = self._seen.get(peer_id)
        if s is None:
            return
        s.probed_at = max(s.probed_at, now)
        s.failures += 1
        if gone:
            s.gone_at = now

    def challenged(self, peer_id: str, failures: int) -> None:
        """``peer_id``'s proof challenges at its listed address failed ``failures`` times in a row."""
        s = self._seen.get(peer_id)
        if s is not None and not s.answered:
            s.failures = max(s.failures, failures)

    def counted(self, now: float) -> set[str]:
        """The peers the quorum counts now (members of a round are added by ``quorum`` itself)."""
        return {pid for pid, s in self._seen.items() if self._counts(pid, s, now)}

    def mute(self, now: float) -> set[str]:
        """Listed records that never answered this peer, for ``mute_after_s`` or ``mute_after_failures``
        failed challenges or probes in a row: not counted."""
        return {pid for pid, s in self._seen.items() if pid in self._listed and self._mute(s, now)}

    def to_probe(self, now: float, every_s: float, limit: int) -> dict[str, str]:
        """Peers whose standing only a probe can tell, not probed within ``every_s`` (at most ``limit``,
        the longest unprobed first): records that dropped out of the listing and still count, and
        listed peers whose last answer said "away"."""
        due = [(s.probed_at, pid, s.addr) for pid, s in self._seen.items()
               if now - s.probed_at >= every_s and self._counts(pid, s, now, away_ok=True)
               and (pid not in self._listed or s.away_at is not None)]
        return {pid: addr for _, pid, addr in sorted(due)[:limit]}

    def _counts(self, pid: str, s: _Seen, now: float, *, away_ok: bool = False) -> bool:
        if pid not in self._listed:
            if now - s.last_listed > self.remember_s:
                return False
            if s.gone_at is not None and s.gone_at >= s.last_listed:
                return False
        if not away_ok and s.away_at is not None and now - s.away_at <= self.away_memory_s:
            return False
        return not self._mute(s, now)

    def _mute(self, s: _Seen, now: float) -> bool:
        return not s.answered and (now - s.first_listed >= self.mute_after_s or s.failures >= self.mute_after_failures)

    def status(self, now: float) -> dict[str, int]:
        """Counts for ``/status``: listed now, counted, remembered (counted, not listed), mute, away."""
        counted = self.counted(now)
        return {"listed": len(self._listed), "counted": len(counted), "remembered": len(counted - self._listed),
                "mute": len(self.mute(now)),
                "away": sum(1 for s in self._seen.values()
                            if s.away_at is not None and now - s.away_at <= self.away_memory_s)}

