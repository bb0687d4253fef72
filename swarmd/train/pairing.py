"""Which microbatches a trainer runs paired, and how a pair's calls are sent (issue #29, item 1).

A spot check is a *paired microbatch* (``swarmd.train.spot_checks`` has the whole story): drawn
before the microbatch's first call, with probability ``verify_fraction``, and always while a stage
with a second usable peer has fewer than two whose first answers of each kind were confirmed (past
that, a newer peer's first answers get an opinion each: ``SpotChecks._alone``), while a peer was
accused by a report and has not had a few answers confirmed since, or a mismatch is not settled. Each call
of a paired microbatch is sent twice at once, the pair's half to another peer of the stage where it
has one; the pair's requests are counted as the checks' traffic.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import torch

from swarmd.errors import PeerError
from swarmd.train.stage_calls import CallEnded, How, Patience, Served, StageCalls
from swarmd.train.timing import Timing
from swarmd.train.verify import PROBE_FRACTION, CheckLedger, SpotChecker, VerifyStats

__all__ = ["CheckTally", "Pairing", "check_nbytes"]

R = TypeVar("R")


class CheckTally:
    """A check's requests (the pair's half, an arbiter's): the checks' extra traffic."""

    def __init__(self, stats: VerifyStats, nbytes: int, reason: str = "pair") -> None:
        """``reason``: what the request is for, as ``VerifyStats.extra_by_reason`` counts its samples
        (``pair``: a paired microbatch's half; ``opinion``: a second or third opinion; ``probe``)."""
        self.stats, self.nbytes, self.reason = stats, nbytes, reason

    def sent(self, peer_id: str, samples: int, *, on_probation: bool) -> None:
        self.stats.extra_requests += 1  # traffic: every request sent, a Busy one asked again included
        self.stats.extra_bytes += self.nbytes

    def answered(self, peer_id: str, samples: int, passes: int) -> None:
        stats = self.stats  # compute: only what a peer computed (a Busy refusal computes nothing)
        stats.extra_samples += samples
        stats.extra_by_reason[self.reason] = stats.extra_by_reason.get(self.reason, 0) + samples
        stats.extra_passes += samples * passes
        stats.extra_passes_by_reason[self.reason] = stats.extra_passes_by_reason.get(self.reason, 0) + samples * passes

    def carried(self, nbytes: int) -> None:
        stats = self.stats
        stats.extra_wire_bytes += nbytes
        stats.extra_wire_by_reason[self.reason] = stats.extra_wire_by_reason.get(self.reason, 0) + nbytes

    def banned(self, stage: int, peer_id: str, error: PeerError, *, timed_out: bool, ban_s: float,
               timeout_s: float) -> None:
        pass  # the ban itself is the router's


def check_nbytes(*tensors: torch.Tensor | None) -> int:
    """The bytes a check's request carries (its tensors), counted as the checks' traffic."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Pairing:
    """Draws which microbatches run paired and sends a pair's two halves."""

    def __init__(self, calls: StageCalls, *, stats: VerifyStats, ledger: CheckLedger, fraction: float,
                 timing: Timing, rng: random.Random, patience: Patience) -> None:
        """``patience``: how a pair's half is sent (a busy peer asked again, a broken one banned)."""
        self.calls = calls
        self.stats = stats
        self.ledger = ledger
        self.fraction = fraction
        self.timing = timing
        self._checker = SpotChecker(fraction, rng)
        self._patience = patience

    def pairs(self, force: bool = False) -> bool:
        """Whether the next microbatch (or validation batch) runs paired: drawn with probability
        ``fraction``, and always while a stage with a second usable peer has fewer than two confirmed
        (:meth:`_too_few_confirmed`), while a peer has a few fewer confirmed than wanted since a report accused it
        (``CheckLedger.watch``), or when ``force``d (where checks are on and a stage has a second
        peer). Drawn before its first call: a peer's own answers change nothing."""
        paired = (force and self._can_pair()) or self._pairs()
        self.stats.paired += int(paired)
        return paired

    def _pairs(self) -> bool:
        if not self._can_pair():
            return False
        routers = self.calls.stages.routers
        last = len(routers) - 1  # its microbatches' calls are fused forward and backward: "backward"
        # per stage with a second usable peer: its routable peers, and the kinds of answer they give
        stages = [([p.peer_id for p in r.snapshot() if p.routable], ("backward",) if stage == last
                   else ("forward", "backward")) for stage, r in enumerate(routers) if r.usable_count > 1]
        if any(self.ledger.disputed(peer_id) for peers, _ in stages for peer_id in peers):
            self.stats.rechecks += 1  # a mismatch not settled yet: asked again until it is
            return True
        if self._too_few_confirmed(stages):
            self.stats.first_checks += 1
            return True
        self.ledger.watch(self.calls.stages.suspected)  # accused once somewhere: checked until confirmed a few times
        if any(self.ledger.wants_suspicion_check(peer_id, kind) for peers, kinds in stages for peer_id in peers
               for kind in kinds):
            self.stats.suspicion_checks += 1
            return True
        return self._checker.should_check(comparable=True, other_peers=1)

    def _too_few_confirmed(self, stages: Sequence[tuple[list[str], tuple[str, ...]]]) -> bool:
        """Whether a stage with a second usable peer (``stages``: its routable peers and their kinds of
        answer) has fewer than two whose first answers of each kind were confirmed: every microbatch runs
        paired then (a pair confirms two peers of every stage at once, both halves accumulated). Past that,
        a newer peer's first answers are checked one by one by an opinion (``SpotChecks._alone``), so a peer
        joining a large stage no longer pairs every microbatch until the routing happens to reach it (about
        as many as the stage has peers, for every join)."""
        return any(sum(1 for peer_id in peers if all(self.ledger.introduced(peer_id, kind) for kind in kinds)) < 2
                   for peers, kinds in stages)

    def validation_pair(self, batches: int) -> int | None:
        """Which of a validation pass's ``batches`` runs paired whatever the draw (the others are drawn
        as :meth:`pairs`): None where checks are off or no stage has a second peer. A validation forward
        is recognisable as one (no microbatch id; on the last stage a forward with targets), so a liar
        may lie on validation alone, where nothing accumulates and the fraction rarely looks: with one
        paired batch a pass, a peer that lies on every validation forward is compared in most passes
        (2 of 3 in a stage of three), for one batch's forwards more a pass."""
        return self._checker.choice(batches) if batches and self._can_pair() else None

    def probes(self) -> bool:
        """Whether an unpaired last-stage answer's gradient is probed for direction (``PROBE_FRACTION``
        of them, where checks are on): drawn after it came, which its peer cannot see."""
        return self.fraction > 0.0 and self._checker.draw(PROBE_FRACTION)

    def _can_pair(self) -> bool:
        return self.fraction > 0.0 and any(r.usable_count > 1 for r in self.calls.stages.routers)

    async def paired(self, stage: int, call: Callable[[How | None], Awaitable[Served[R]]],
                     nbytes: int) -> tuple[Served[R], Served[R]]:
        """A call's two halves, sent at once: the primary's as any microbatch's call, the pair's to
        another peer (one free now; else, while the primary's is out, any peer: a stage of one peer
        serves both halves, unchecked), paid as the checks' traffic."""
        taken: set[str] | None = set() if self.calls.stages.routers[stage].usable_count > 1 else None
        first = asyncio.ensure_future(call(How(taken=taken)))
        try:
            await asyncio.sleep(0)  # the primary's peer is in ``taken`` before the pair chooses
            tally = CheckTally(self.stats, nbytes)
            try:
                second = await call(How(patience=self._patience, tally=tally, taken=taken))
            except CallEnded:
                second = await call(How(patience=Patience.until_answered(self.timing), tally=tally))
            return await first, second
        finally:
            if not first.done():
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)

    def pair_tally(self, nbytes: int) -> How:
        """How a pair's backward is sent: as any microbatch's (to the peer that ran its forward), paid
        as the checks' traffic."""
        return How(patience=Patience.until_answered(self.timing), tally=CheckTally(self.stats, nbytes))
