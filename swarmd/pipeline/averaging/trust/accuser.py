"""A stage-mate's part in convicting hostile contributions swarm-wide (``swarmd.pipeline.averaging.trust.accusations``).

The leader keeps the signed claims of the contributions it struck as far, and on a conviction
posts a signed ``averaging`` report carrying them to its stage-mates; a stage-mate that finds them
far from its own contributions of the same rounds excludes the accused from its rounds too and
posts a report of its own. A conviction by recomputation (``openings``) travels as ``POST /v1/recheck``
with the accused's signed opening and the drawn microbatch's inputs; a stage-mate recomputes that
microbatch on its own parameters of the signed digest (``recomputation``, "Seconded") and seconds
when the signed part misstates it, one recheck at a time and once per accused and step (a
recomputation runs ahead of the stage's microbatches on its worker), and only as shown by the leader the
accused opened to. The stage's progress answers
then name the accused from two peers, which is what the trainers follow
(``swarmd.train.verify.excluded_by_stage``), and the stage's ledgers hold two independent reporters
(``swarmd.pipeline.reports``).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from swarmd.errors import RequestError, SwarmdError
from swarmd.net.messages import AverageRequest, PartRecheckRequest, RecheckRequest, ReportRequest
from swarmd.pipeline.averaging.round import AveragerCore, _OpenRound, log
from swarmd.pipeline.averaging.trust.accusations import (
    Claim,
    Evidence,
    RecomputedEvidence,
    answers_of,
    describe,
    second,
)
from swarmd.pipeline.averaging.trust.contribution_proofs import OpeningEvidence, inconsistency, sketch
from swarmd.pipeline.averaging.trust.recomputation import (
    RECOMPUTE_PRECISIONS,
    RECOMPUTE_TOLERANCE,
    misstated_microbatch,
    recheck,
)
from swarmd.pipeline.reports import MisbehaviourReport

if TYPE_CHECKING:
    from swarmd.pipeline.averaging.reduction import Reduction

__all__ = ["RECHECK_ATTEMPTS", "RECHECK_RETRY_S", "RECHECK_TIMEOUT_S", "REPORT_TIMEOUT_S", "RoundAccuser", "Shown"]

#: How long posting one accusation to one stage-mate may take.
REPORT_TIMEOUT_S = 5.0
#: ... and one conviction by recomputation (it carries a microbatch's inputs), asked this many times at most
#: this far apart while the stage-mate cannot take it up (its parameters of that step are kept two steps).
RECHECK_TIMEOUT_S = 30.0
RECHECK_ATTEMPTS = 4
RECHECK_RETRY_S = 0.25
#: The (accused, step) pairs of rechecks this peer remembers having checked (each is checked once).
_RECHECKED_KEEP = 256
#: Rechecks waiting for their recomputation, one at a time (more are ignored: at most one a contributor a round
#: comes from an honest leader).
_RECHECK_QUEUE = 8

#: What a conviction by recomputation shows the stage-mates: the accused's signed opening (as it sent it),
#: the drawn microbatch's id and its inputs (activations, targets).
Shown = tuple[bytes, int, torch.Tensor, torch.Tensor]


class RoundAccuser(AveragerCore):
    """Keeps the evidence of far contributions, accuses, and seconds stage-mates' accusations."""

    def convicts(self) -> bool:
        """Whether this stage's leaders convict (and its peers accuse and second) at all: on the last
        stage only. An earlier stage's parameter gradients are computed from the input gradients the
        next stage answered, so a liar there that scales them (caught only by the trainers' spot
        checks, in time) makes an honest peer's contributions far too: a check-aware liar returning
        input gradients times -20 got an honest stage-0 peer convicted and seconded
        (docs/BENCHMARKS.md). The last stage's gradients come from its own loss on the trainer's
        targets and spot-checked activations. Elsewhere far and opposed contributions are still
        struck, left out of the mean, every round (``reduction``)."""
        ex = self.executor
        return ex.stage == ex.spec.n_stages - 1

    def _note_claim(self, rnd: _OpenRound, peer_id: str, request: AverageRequest | None) -> None:
        """Keep a signed contribution's claim for this round (the evidence, should it be struck)."""
        if request is None or request.public_key is None or request.signature is None or not request.digest:
            return
        rnd.claims[peer_id] = (request.public_key, Claim(rnd.step, request.samples, request.digest, request.norm,
                                                         request.signature))

    def _note_scores(self, rnd: _OpenRound, red: Reduction) -> None:
        """After a reduction (off the loop): keep the claims of far contributions, and this peer's own norm."""
        for pid, score in sorted(red.scores.items()) if self.convicts() else ():
            signed = rnd.claims.get(pid)
            if signed is not None:
                self.struck_claims.note(pid, signed[0], signed[1], far=score.far_strike() is not None)
        for used in red.used:
            if used.peer_id == self.peer_id:
                self.own_norms.note(rnd.step, self.peer_id, used.norm, used.samples)

    def _accuse(self, accused: str, step: int) -> None:
        """The leader convicted ``accused`` at ``step``: post the evidence to the stage-mates."""
        evidence = self.struck_claims.take(accused, self.peer_id)
        if evidence is None:
            log.warning("stage %d step %d: no signed claims of %s to show its stage-mates; the conviction stays "
                        "this peer's own", self.executor.stage, step, accused[:12])
            return
        self._post_accusation(accused, evidence, step, "sent")

    def consider_accusation(self, report: MisbehaviourReport, evidence: Evidence | OpeningEvidence) -> str:
        """A stage-mate's ``averaging`` report (its evidence's signatures verified): second it when the
        accused's signed claims are far from this peer's own contributions (``accusations.second``), or
        when its signed opening contradicts itself (``contribution_proofs.inconsistency``).
        What this peer made of it: ``seconded``, ``not_seconded``, or ``ignored``."""
        accused = report.accused
        if (report.stage != self.executor.stage or not self.convicts() or accused == self.peer_id
                or report.reporter_id == self.peer_id or self._excluded_as_hostile(accused)):
            return "ignored"
        if isinstance(evidence, OpeningEvidence):
            return self._consider_opening(report, evidence)
        why = second(evidence, self.own_norms)
        if why is None:
            self.accusations["not_seconded"] += 1
            self._warn(accused, "not_seconded", "stage %d: %s accuses %s of hostile contributions (claims: step, "
                       "samples, norm[, this peer's round leader, samples, norm, score] %s); not "
                       "seconded: they are not far from this peer's own contributions of those rounds",
                       self.executor.stage, report.reporter_id[:12], accused[:12],
                       describe(evidence.claims, self.own_norms))
            return "not_seconded"
        self.accusations["seconded"] += 1
        period = self.exclude_hostile(accused, why.removeprefix("hostile: "))  # (``second`` names it hostile)
        log.warning("stage %d: seconded %s's accusation of %s (%s); excluded from this peer's rounds for %.0fs",
                    self.executor.stage, report.reporter_id[:12], accused[:12], why, period)
        self._post_accusation(accused, evidence, max(c.step for c in evidence.claims), "seconded_sent")
        return "seconded"

    def _consider_opening(self, report: MisbehaviourReport, evidence: OpeningEvidence) -> str:
        """Second an accusation resting on the accused's signed opening when the opening contradicts
        itself: no trust in the accuser, nor any gradient, is needed to tell."""
        accused = report.accused
        why = inconsistency(evidence)
        if why is None:
            self.accusations["not_seconded"] += 1
            self._warn(accused, "not_seconded", "stage %d: %s accuses %s on an opening of step %d that is consistent; "
                       "not seconded", self.executor.stage, report.reporter_id[:12], accused[:12], evidence.step)
            return "not_seconded"
        self.accusations["seconded"] += 1
        period = self.exclude_hostile(accused, why)
        log.warning("stage %d: seconded %s's accusation of %s (%s); excluded from this peer's rounds for %.0fs",
                    self.executor.stage, report.reporter_id[:12], accused[:12], why, period)
        self._post_accusation(accused, evidence, evidence.step, "seconded_sent")
        return "seconded"

    def _excluded_as_hostile(self, peer_id: str) -> bool:
        """Whether this peer excludes ``peer_id`` for hostile contributions now: an accusation of it is moot.
        Excluded for another reason (silent in a round, a bad opening: a few seconds) it is still checked, or
        the liar would be back once that shorter exclusion ends (seen under load: one of three runs)."""
        entry = self.suspicions.status().get(peer_id)
        return entry is not None and str(entry["reason"]).startswith("hostile")

    def consider_recheck(self, evidence: RecomputedEvidence, count: Callable[[], object] = lambda: None) -> str:
        """A stage-mate's conviction by recomputation (its signatures and digests checked:
        ``RecomputedEvidence.check``): recompute the microbatch in an owned task and second it when the
        accused's signed part misstates it, and then only ``count`` its report (in this daemon's ledger: a
        conviction by recomputation that does not hold counts for nothing). What this peer made of it now:
        ``checking``, ``queued`` or
        ``ignored`` (not this stage's last, about itself, by itself or the accused, not by the leader the
        accused opened to, already excluded as hostile, checked before, or too many waiting)."""
        report = evidence.report
        accused, key = report.accused, (report.accused, evidence.step)
        if (report.stage != self.executor.stage or not self.convicts() or accused == self.peer_id
                or report.reporter_id in (self.peer_id, accused) or self._excluded_as_hostile(accused)
                or report.reporter_id != evidence.opening.evidence.leader  # see below
                or key in self._rechecked or len(self._recheck_queue) >= _RECHECK_QUEUE):
            # Only the leader the accused opened to can have drawn and recomputed its microbatch, and only it can
            # sign as itself: so nobody else (the accused above all, showing one of its true microbatches first)
            # can use up the one check of that accused and step. A stage-mate's seconding copy is counted by the
            # ledger all the same; the leader posted the original to every stage-mate.
            return "ignored"
        self._rechecked[key] = None
        while len(self._rechecked) > _RECHECKED_KEEP:
            self._rechecked.pop(next(iter(self._rechecked)))
        self._recheck_queue.append((evidence, count))
        if len(self._recheck_queue) > 1:  # the task checking the one before takes it next
            return "queued"

        async def check() -> None:
            while self._recheck_queue:
                try:
                    await self._recheck(*self._recheck_queue[0])
                finally:
                    self._recheck_queue.popleft()

        self._own(check(), "swarmd-recheck")
        return "checking"

    async def _recheck(self, evidence: RecomputedEvidence, count: Callable[[], object]) -> None:
        """Recompute the evidence's microbatch on this peer's parameters of the signed digest (the worker
        thread), sketch it under the signed seed (a thread) and second, or not (counted against the accuser);
        ``count``: count its report in this daemon's ledger (only when it holds)."""
        ex, report = self.executor, evidence.report
        accused, step = report.accused, evidence.step
        gap = None
        if evidence.precision not in RECOMPUTE_PRECISIONS:
            why_not = f"its precision {evidence.precision} is not recomputed"
        else:
            try:
                flat = await ex.recompute_past(evidence.inputs, evidence.targets, evidence.precision, step,
                                               evidence.params)
            except RequestError as exc:
                flat, why_not = None, f"its inputs do not fit this stage ({exc})"
            else:
                why_not = f"this peer holds no parameters of step {step} with the signed digest"
            if flat is not None:
                row = await asyncio.to_thread(sketch, [flat], evidence.seed(), ex.grad_numel)
                gap = recheck(evidence.part, tuple(float(v) for v in row[0].tolist()))
                why_not = f"its signed part is {gap:.2e} from the gradient recomputed here: it holds"
        self.accusations["rechecked" if gap is not None else "unchecked"] += 1  # recomputed here, or could not be
        if gap is None or gap <= RECOMPUTE_TOLERANCE:
            self.accusations["not_seconded"] += 1
            self._warn(accused, "not_seconded", "stage %d: %s accuses %s of misstating microbatch %#x of step %d; "
                       "not seconded: %s", ex.stage, report.reporter_id[:12], accused[:12], evidence.mb, step,
                       why_not)
            return
        if self._excluded_as_hostile(accused):  # convicted meanwhile
            return
        why = f"{misstated_microbatch(evidence.mb, step, gap)}, as {report.reporter_id[:12]} found"
        self.accusations["seconded"] += 1
        count()
        period = self.exclude_hostile(accused, why)
        log.warning("stage %d: seconded %s's conviction of %s by recomputation (%s); excluded from this peer's "
                    "rounds for %.0fs", ex.stage, report.reporter_id[:12], accused[:12], why, period)
        shown = (evidence.opening.encode(), evidence.mb, evidence.inputs, evidence.targets)
        self._post_accusation(accused, evidence.opening.evidence, step, "seconded_sent", shown=shown)

    def _post_accusation(self, accused: str, evidence: Evidence | OpeningEvidence, step: int, counter: str,
                         shown: Shown | None = None, part_shown: tuple[bytes, int, bytes] | None = None) -> None:
        """Sign an ``averaging`` report against ``accused`` and post it to every listed stage-mate but
        it and this peer (an owned task; a stage-mate that does not answer is skipped); with ``shown``
        (a conviction by recomputation), as a recheck carrying the opening and the microbatch's inputs."""
        if self.identity is None:
            return
        raw = evidence.encode()
        report = MisbehaviourReport.signed(self.identity, accused=accused, stage=self.executor.stage, step=step,
                                           kind="averaging", mb=secrets.randbits(64),
                                           request_digest=hashlib.sha256(raw).hexdigest(),
                                           answers=answers_of(evidence, accused, self.peer_id), at=time.time(),
                                           evidence=raw)
        body, signature = report.encode()
        request = ReportRequest(body, signature)
        rechecked: RecheckRequest | PartRecheckRequest | None = None
        if shown is not None:
            rechecked = RecheckRequest(body, signature, *shown)
        elif part_shown is not None:  # (an all-reduce member's part: allreduce.sent_parts)
            rechecked = PartRecheckRequest(body, signature, *part_shown)

        async def one(addr: str) -> bool:
            if rechecked is not None:
                return await ask_to_recheck(addr)
            try:
                return (await self.client.report(addr, request, timeout_s=REPORT_TIMEOUT_S)).accepted
            except SwarmdError:  # it did not answer, or refused
                return False

        async def ask_to_recheck(addr: str) -> bool:
            """Taken up (the mate recomputes it, and counts it if it holds)? A mate that could not take it up
            now (not serving rounds this moment, busy, unreachable) is asked again, while it may still hold
            that step's parameters (``PAST_PARAMS``)."""
            assert rechecked is not None  # only called with one
            why = ""
            for attempt in range(RECHECK_ATTEMPTS):
                if attempt:
                    await asyncio.sleep(RECHECK_RETRY_S)
                try:
                    reply = await self.client.recheck(addr, rechecked, timeout_s=RECHECK_TIMEOUT_S)
                except RequestError as exc:  # refused as malformed (a 4xx): asking again changes nothing
                    why = str(exc)
                    break
                except SwarmdError as exc:  # did not answer, or busy: again
                    why = str(exc)
                    continue
                if reply.reason in ("checking", "queued", "ignored"):  # ignored: it excludes the liar already, ...
                    return reply.reason != "ignored"
                if reply.reason in ("seconded", "not_seconded"):  # a part, checked as it came (sent_parts)
                    return reply.reason == "seconded"
                why = reply.reason
            self.accusations["recheck_not_taken"] += 1
            self._warn(accused, "recheck_not_taken", "stage %d: %s did not take up the conviction of %s by "
                       "recomputation (%s)", self.executor.stage, addr, accused[:12], why[:200])
            return False

        async def post() -> None:

            targets = await self.mates_to_tell(accused, "the conviction")
            accepted = await asyncio.gather(*(one(addr) for addr in targets))
            self.accusations[counter] += 1
            self.accusations["accepted_by_mates"] += sum(accepted)

        self._own(post(), "swarmd-accuse")
