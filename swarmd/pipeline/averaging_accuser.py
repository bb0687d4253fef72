"""A stage-mate's part in convicting hostile contributions swarm-wide (``swarmd.pipeline.accusations``).

The leader keeps the signed claims of the contributions it struck as far, and on a conviction
posts a signed ``averaging`` report carrying them to its stage-mates; a stage-mate that finds them
far from its own contributions of the same rounds excludes the accused from its rounds too and
posts a report of its own. The stage's progress answers then name the accused from two peers,
which is what the trainers follow (``swarmd.train.verify.excluded_by_stage``), and the stage's
ledgers hold two independent reporters (``swarmd.pipeline.reports``).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from typing import TYPE_CHECKING

from swarmd.errors import PeerError
from swarmd.net.messages import AverageRequest, ReportRequest
from swarmd.pipeline.accusations import Claim, Evidence, answers_of, describe, second
from swarmd.pipeline.averaging_round import AveragerCore, _OpenRound, log
from swarmd.pipeline.reports import MisbehaviourReport
from swarmd.pipeline.round_reduction import HOSTILE_EXCLUSION_S

if TYPE_CHECKING:
    from swarmd.pipeline.round_reduction import Reduction

__all__ = ["REPORT_TIMEOUT_S", "RoundAccuser"]

#: How long posting one accusation to one stage-mate may take.
REPORT_TIMEOUT_S = 5.0


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
        struck, left out of the mean, every round (``round_reduction``)."""
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

    def consider_accusation(self, report: MisbehaviourReport, evidence: Evidence) -> str:
        """A stage-mate's ``averaging`` report (its evidence's signatures verified): second it when the
        accused's signed claims are far from this peer's own contributions (``accusations.second``).
        What this peer made of it: ``seconded``, ``not_seconded``, or ``ignored``."""
        accused = report.accused
        if (report.stage != self.executor.stage or not self.convicts() or accused == self.peer_id
                or report.reporter_id == self.peer_id or accused in self.suspicions.excluded()):
            return "ignored"
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
        period = self.suspicions.accuse(accused, why, base_s=HOSTILE_EXCLUSION_S)
        if self.prover is not None:
            self.prover.table.forget(accused)
        log.warning("stage %d: seconded %s's accusation of %s (%s); excluded from this peer's rounds for %.0fs",
                    self.executor.stage, report.reporter_id[:12], accused[:12], why, period)
        self._post_accusation(accused, evidence, max(c.step for c in evidence.claims), "seconded_sent")
        return "seconded"

    def _post_accusation(self, accused: str, evidence: Evidence, step: int, counter: str) -> None:
        """Sign an ``averaging`` report against ``accused`` and post it to every listed stage-mate but
        it and this peer (an owned task; a stage-mate that does not answer is skipped)."""
        if self.identity is None:
            return
        raw = evidence.encode()
        report = MisbehaviourReport.signed(self.identity, accused=accused, stage=self.executor.stage, step=step,
                                           kind="averaging", mb=secrets.randbits(64),
                                           request_digest=hashlib.sha256(raw).hexdigest(),
                                           answers=answers_of(evidence, accused, self.peer_id), at=time.time(),
                                           evidence=raw)
        request = ReportRequest(*report.encode())

        async def one(addr: str) -> bool:
            try:
                return (await self.client.report(addr, request, timeout_s=REPORT_TIMEOUT_S)).accepted
            except PeerError:
                return False

        async def post() -> None:

            try:
                mates = await self.stage_peers()
            except Exception as exc:  # the DHT lookup failed: nobody to tell this time
                log.warning("stage %d: could not list the stage-mates to accuse %s before (%s)",
                            self.executor.stage, accused[:12], exc)
                return
            targets = [addr for pid, addr in sorted(mates.items()) if pid not in (accused, self.peer_id)]
            accepted = await asyncio.gather(*(one(addr) for addr in targets))
            self.accusations[counter] += 1
            self.accusations["accepted_by_mates"] += sum(accepted)

        task = asyncio.get_running_loop().create_task(post(), name="swarmd-accuse")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
