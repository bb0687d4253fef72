"""Spot checks: a trainer asks other peers of a stage for the same answer, and acts on the verdict.

The SWARM paper assumes honest workers (section 6 names malicious nodes as a limitation). The
peers of a stage hold bit-identical parameters, so the same request to two of them at one step
must give the same answer (``swarmd.train.verify`` holds the rules: the tolerance, arbitration,
the ledger of what checks concluded). This module is the I/O around those rules (issue #17):

* which calls are checked: a random ``verify_fraction`` of forward and backward calls, in the
  background; and always a peer's first answers of each kind, which the microbatch waits for (a
  liar from the start must not get its first answers used);
* a check asks a second peer (a forward under a fresh microbatch id, so it looks like any other; a
  backward flagged ``verify``, computed but never accumulated), and on a mismatch a third; a first
  check asks two at once, so all three answers likely come from one step and a liar is convicted
  at once (a third asked only after a mismatch often met the next step);
* a first check that cannot confirm the answer (nobody else answered, or the stage stepped in
  between) asks the *same* peer again with its stage-mates at once (up to :data:`RECHECKS` times):
  an unconfirmed answer must not go through, since a gradient liar's few such answers inflate
  Adam's second moments for hundreds of steps (docs/SECURITY.md, "Wrong answers from members", has the runs);
* the peer that disagrees with the other two is banned for ``LIAR_BAN_S`` and a signed report
  (``swarmd.pipeline.reports``) goes to every listed peer.

Each check ends in a typed :class:`Ruling`: go on with the answer, go on with another one, or
redo the microbatch (:class:`Unsettled`). Every opinion is a call through the trainer's one call
machine (``swarmd.train.stage_calls``), with an opinion's patience and counted as the checks' cost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from swarmd.dht.identity import Identity
from swarmd.errors import PeerError
from swarmd.net.client import DataPlaneClient
from swarmd.net.messages import BackwardReply, ForwardReply, ReportRequest
from swarmd.pipeline.reports import MisbehaviourReport, digest_tensor_bytes
from swarmd.train.stage_calls import CallEnded, Ended, Patience, Redo, Send, Served, StageCalls, StepMoved
from swarmd.train.timing import Timing
from swarmd.train.verify import (
    LIAR_BAN_S,
    Answer,
    CheckLedger,
    SpotChecker,
    Verdict,
    VerifyStats,
    agree,
    arbitrate,
    tolerance,
)

__all__ = ["OPINION_ATTEMPTS", "RECHECKS", "Finding", "Ruling", "SpotChecks", "Unsettled"]

log = logging.getLogger(__name__)

Kind = Literal["forward", "backward"]
Resend = Send[ForwardReply | BackwardReply]

#: Tries for a spot check's second (or third) opinion: a busy peer is asked again, a broken one banned.
OPINION_ATTEMPTS = 4
#: A first check that met no opinion at its step asks the same peer again this often.
RECHECKS = 2


class Unsettled(Redo):
    """A peer's first answer disagreed with another peer's and no third one settled who lied: the
    answer is not used, the microbatch is redone."""


class Finding(enum.Enum):
    """What a check found about the answer it checked."""

    CONFIRMED = "confirmed"  # another peer at its step agreed (or a witness did, against a convicted liar)
    OVERRULED = "overruled"  # the answer's peer lied: convicted, and the majority's answer goes on
    UNSETTLED = "unsettled"  # a mismatch no third peer settled: redo the microbatch
    UNCONFIRMED = "unconfirmed"  # no opinion at its step: neither confirmed nor refuted
    INCOMPARABLE = "incomparable"  # the only opinions at its step were computed in another precision
    LET_THROUGH = "let_through"  # its stage's only two peers keep disagreeing: going on with their answers


@dataclass(frozen=True)
class Ruling:
    """A check's verdict on one answer: what it found, and the answer to go on with instead of the
    checked one (``use``: the majority's when it lied; its own fresh answer after a recheck)."""

    finding: Finding
    use: Answer | None = None

    @property
    def redo(self) -> bool:
        return self.finding is Finding.UNSETTLED


_CONFIRMED = Ruling(Finding.CONFIRMED)
_UNSETTLED = Ruling(Finding.UNSETTLED)
_UNCONFIRMED = Ruling(Finding.UNCONFIRMED)


def _evidence(request: tuple[torch.Tensor, ...], answers: Sequence[Answer]) -> tuple[str, dict[str, str]]:
    """The digests a report carries: of the request's tensors, and of each peer's answer."""

    def raw(t: torch.Tensor) -> bytes:
        return t.detach().contiguous().cpu().numpy().tobytes()

    request_digest = digest_tensor_bytes(*(raw(t) for t in request))
    digests = {
        a.peer_id: digest_tensor_bytes(raw(a.tensor) if a.tensor is not None else b"", repr(a.loss).encode())
        for a in answers
    }
    return request_digest, digests


class _CheckTally:
    """An opinion's requests: the checks' extra traffic."""

    def __init__(self, stats: VerifyStats, nbytes: int) -> None:
        self.stats, self.nbytes = stats, nbytes

    def sent(self, peer_id: str, samples: int, *, on_probation: bool) -> None:
        self.stats.extra_requests += 1
        self.stats.extra_samples += samples
        self.stats.extra_bytes += self.nbytes

    def banned(self, stage: int, peer_id: str, error: PeerError, *, timed_out: bool, ban_s: float,
               timeout_s: float) -> None:
        pass  # the ban itself is the router's; an opinion's failures are counted when it ends


class SpotChecks:
    """One trainer's spot checks: drawn, run (owned background tasks), judged and acted on."""

    def __init__(
        self, calls: StageCalls, client: DataPlaneClient, *, stats: VerifyStats, codec: str, fraction: float,
        window: int, timing: Timing, rng: random.Random | None = None,
    ) -> None:
        self.calls = calls
        self.client = client
        self.stats = stats
        self.ledger = CheckLedger()
        self.fraction = fraction
        self.window = window  # background checks running at most (first checks are never skipped)
        self.timing = timing
        self._tolerance = tolerance(codec)
        self._checker = SpotChecker(fraction, rng if rng is not None else random.Random(secrets.randbits(64)))
        self._opinion_patience = Patience(tries=OPINION_ATTEMPTS, waits=False, busy_pause_s=timing.opinion_busy_retry_s)
        self._tasks: set[asyncio.Task[Ruling]] = set()  # checks running (owned)
        self._identity: Identity | None = None  # ephemeral: signs this trainer's reports

    # ---- what the microbatch calls ---------------------------------------------------------------

    async def forward(self, stage: int, inputs: torch.Tensor, served: Served[ForwardReply]) -> ForwardReply:
        """Perhaps check a forward's answer: the reply to go on with (the majority's outputs when a
        check it waited for convicted its peer)."""
        reply = served.reply
        primary = Answer(served.peer_id, reply.step, reply.outputs, reply.loss, reply.precision)
        use = await self._maybe_check(stage, "forward", primary, self.calls.forward_again(stage, inputs),
                                      (inputs,), secrets.randbits(64))
        if use is None or use.tensor is None:
            return reply
        return dataclasses.replace(reply, outputs=use.tensor, loss=use.loss)

    async def backward(
        self, stage: int, inputs: torch.Tensor, grad_outputs: torch.Tensor | None, targets: torch.Tensor | None,
        step: int | None, mb: int, served: Served[BackwardReply],
    ) -> BackwardReply:
        """Perhaps check a backward's answer, as :meth:`forward` (the liar's own accumulation is the
        averaging's to leave out, once the swarm excluded it)."""
        reply = served.reply
        if reply.grad_inputs is None and reply.loss is None:
            self.stats.calls += 1
            return reply  # the first stage's backward answers nothing to compare
        primary = Answer(served.peer_id, reply.step, reply.grad_inputs, reply.loss, reply.precision)
        tensors = tuple(t for t in (inputs, grad_outputs, targets) if t is not None)
        use = await self._maybe_check(stage, "backward", primary,
                                      self.calls.backward_again(stage, inputs, grad_outputs, targets, step, mb),
                                      tensors, mb)
        if use is None:
            return reply
        return dataclasses.replace(reply, grad_inputs=use.tensor, loss=use.loss)

    async def _maybe_check(self, stage: int, kind: Kind, primary: Answer, resend: Resend,
                           request: tuple[torch.Tensor, ...], mb: int) -> Answer | None:
        """Draw whether to check this call and start the check. A random check runs in the
        background; a peer's first check is waited for: then the answer to go on with instead of
        the primary's, if any; an unsettled mismatch raises :class:`Unsettled`."""
        self.stats.calls += 1
        router = self.calls.stages.routers[stage]
        first = self.fraction > 0 and self.ledger.wants_first_check(primary.peer_id, kind) and router.usable_count > 1
        if not first and not self._checker.should_check(comparable=True, other_peers=router.usable_count - 1):
            return None
        if not first and len(self._tasks) >= self.window:
            self.stats.skipped += 1
            return None
        self.stats.first_checks += int(first)
        task = asyncio.create_task(self.check(stage, kind, primary, resend, request, mb, waited=first),
                                   name=f"swarmd-spot-check-{stage}-{kind}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        if not first:
            return None
        # shielded: a cancelled microbatch leaves its check running (owned by _tasks)
        ruling = await asyncio.shield(task)
        if ruling.redo:
            raise Unsettled()
        return ruling.use

    def _done(self, task: asyncio.Task[Ruling]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a spot check failed unexpectedly: %r", task.exception())

    async def finish(self) -> None:
        """Wait for the checks still running (each bounded by its peers' timeouts)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def cancel(self) -> None:
        """Cancel the checks still running, and wait until they ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- one check -------------------------------------------------------------------------------

    async def check(self, stage: int, kind: Kind, primary: Answer, resend: Resend, request: tuple[torch.Tensor, ...],
                    mb: int, *, waited: bool = False) -> Ruling:
        """One spot check of ``primary``: a second opinion, and on a mismatch a third
        (``verify.arbitrate``). A check the call ``waited`` for (a peer's first answers) that
        cannot confirm the answer rechecks it (:meth:`_recheck`); a backward's recheck is flagged
        ``verify`` (never accumulated), so what goes on then is its fresh answer, and the peer's
        next backward is checked first again; a forward's recheck looks like any forward, and the
        original answer goes on. Only when the rechecks cannot confirm either is the answer let
        through, unless its peer is disputed (in a mismatch no conviction cleared): then it is
        unsettled and the microbatch redone. Honest swarms never redo, so their counts stay exact."""
        stats = self.stats
        stats.checks += 1
        samples, nbytes = int(request[0].shape[0]), sum(t.numel() * t.element_size() for t in request)
        both = waited and self.calls.stages.routers[stage].usable_count > 2
        taken: set[str] = set()
        opinions = await asyncio.gather(*(self._opinion(stage, kind, resend, samples, nbytes, {primary.peer_id}, taken)
                                          for _ in range(2 if both else 1)))
        ruling = await self._compare(stage, kind, primary, list(opinions), resend, request, mb)
        for _ in range(RECHECKS if waited else 0):
            if ruling.finding is not Finding.UNCONFIRMED:
                break
            stats.rechecks += 1
            again = await self._recheck(stage, kind, primary.peer_id, resend, samples, nbytes)
            if again is None:
                break
            fresh, mates = again
            ruling = await self._compare(stage, kind, fresh, mates, resend, request, mb,
                                         uncredited=primary.peer_id if kind == "backward" else None)
            if kind == "backward" and ruling.use is None and ruling.finding in (Finding.CONFIRMED, Finding.LET_THROUGH):
                ruling = Ruling(ruling.finding, fresh)  # its fresh gradients go on, not the unconfirmed ones
        if ruling.finding is Finding.INCOMPARABLE:
            stats.unconfirmed += int(waited)
            self._incomparable(stage, kind, primary)
        elif ruling.finding is Finding.UNCONFIRMED:
            stats.unconfirmed += int(waited)
            if waited and self.ledger.disputed(primary.peer_id):
                return _UNSETTLED
        return ruling

    async def _recheck(self, stage: int, kind: Kind, peer_id: str, resend: Resend, samples: int,
                       nbytes: int) -> tuple[Answer, list[Answer | None]] | None:
        """``peer_id``'s answer to the checked request again, and its stage-mates' (two when the
        stage has them), all asked at once; None when ``peer_id`` cannot be asked or did not answer."""
        router = self.calls.stages.routers[stage]
        if router.choose_only(peer_id) is None:
            return None  # banned or busy meanwhile: its mates are not asked in vain
        taken: set[str] = set()
        others = 2 if router.usable_count > 2 else 1
        answers = await asyncio.gather(
            self._opinion(stage, kind, resend, samples, nbytes, set(), only=peer_id),
            *(self._opinion(stage, kind, resend, samples, nbytes, {peer_id}, taken) for _ in range(others)))
        if answers[0] is None:
            return None
        return answers[0], list(answers[1:])

    async def _compare(self, stage: int, kind: Kind, primary: Answer, opinions: list[Answer | None],
                       resend: Resend, request: tuple[torch.Tensor, ...], mb: int,
                       uncredited: str | None = None) -> Ruling:
        """The ruling on ``primary`` given the ``opinions`` asked for it. ``uncredited``: a peer whose
        agreement is not counted as a confirmation (``CheckLedger.credit``)."""
        stats = self.stats
        same = [a for a in opinions if a is not None and a.step == primary.step and a.precision == primary.precision]
        if not same and any(a is not None and a.step == primary.step for a in opinions):
            return Ruling(Finding.INCOMPARABLE)
        if len(same) >= 2:
            return await self._settle_three(stage, kind, primary, same[0], same[1], request, mb, uncredited)
        second = same[0] if same else next((a for a in opinions if a is not None), None)
        if second is None:
            return _UNCONFIRMED
        outcome = arbitrate([primary, second], self._tolerance)
        if outcome.verdict is Verdict.AGREE:
            stats.agreements += 1
            self.ledger.credit((primary, second), kind, uncredited)
            return _CONFIRMED
        if outcome.verdict is Verdict.INCONCLUSIVE:
            stats.inconclusive += 1
            return _UNCONFIRMED
        self.ledger.dispute((primary.peer_id, second.peer_id))
        stats.mismatches += 1
        stats.arbitrations += 1
        log.warning("spot check: stage %d peers %s and %s answered a %s differently at step %d; asking a third",
                    stage, primary.peer_id[:12], second.peer_id[:12], kind, primary.step)
        samples, nbytes = int(request[0].shape[0]), sum(t.numel() * t.element_size() for t in request)
        third = await self._opinion(stage, kind, resend, samples, nbytes, {primary.peer_id, second.peer_id})
        if third is None:
            return self._unsettled_pair(stage, kind, primary.peer_id, second.peer_id)
        return await self._convicted(stage, kind, [primary, second, third], request, mb)

    def _unsettled_pair(self, stage: int, kind: Kind, a: str, b: str) -> Ruling:
        """A mismatch between ``a`` and ``b`` that no third peer settled: unsettled (redo), unless
        they are the only usable peers of their stage and have disagreed so ``UNSETTLED_LIMIT``
        times: no redo can ever settle it (one of two lies, which two peers cannot tell apart; or
        they differ beyond the tolerance for another reason), and redoing each microbatch for ever
        would stall training. Their answers then go on, and their first checks stop, said once."""
        ledger = self.ledger
        known = ledger.gave_up(a, kind) and ledger.gave_up(b, kind)
        if not ledger.unsettled(a, b, kind, pair_only=self.calls.stages.routers[stage].usable_count <= 2):
            return _UNSETTLED
        if not known:
            log.warning("spot check: stage %d peers %s and %s answered %s %d times differently and the stage has "
                        "no third peer to settle it (one of them lies, or they differ beyond the tolerance); "
                        "going on with their answers unconfirmed", stage, a[:12], b[:12], kind,
                        ledger.unsettled_limit)
        return Ruling(Finding.LET_THROUGH)

    async def _settle_three(self, stage: int, kind: Kind, primary: Answer, second: Answer, third: Answer,
                            request: tuple[torch.Tensor, ...], mb: int, uncredited: str | None = None) -> Ruling:
        """The ruling of a check that asked two peers at once, all three at the primary's step: all
        agree (each confirmed but ``uncredited``), or the odd one out is convicted, or unsettled."""
        stats = self.stats
        answers = [primary, second, third]
        with_second, with_third = agree(primary, second, self._tolerance), agree(primary, third, self._tolerance)
        if with_second and with_third:
            stats.agreements += 1
            self.ledger.credit(answers, kind, uncredited)
            return _CONFIRMED
        self.ledger.dispute(a.peer_id for a in answers)
        stats.mismatches += 1
        stats.arbitrations += 1
        log.warning("spot check: stage %d peers %s, %s and %s answered a %s differently at step %d", stage,
                    primary.peer_id[:12], second.peer_id[:12], third.peer_id[:12], kind, primary.step)
        if with_second or with_third:
            # the primary has a witness: the odd one out was a second opinion (convicted when the
            # other two agree, which they do here)
            witness, odd = (second, third) if with_second else (third, second)
            return await self._convicted(stage, kind, [primary, odd, witness], request, mb)
        return await self._convicted(stage, kind, answers, request, mb)

    async def _convicted(self, stage: int, kind: Kind, answers: list[Answer], request: tuple[torch.Tensor, ...],
                         mb: int) -> Ruling:
        """Arbitrate ``answers`` (primary, second, arbiter) and convict the liar: the primary's answer
        is overruled by the second's when the primary lied, else confirmed; unsettled when no two agree."""
        outcome = arbitrate(answers, self._tolerance)
        if outcome.verdict is not Verdict.LIAR or outcome.liar is None:
            self.stats.inconclusive += 1
            return _UNSETTLED
        self.ledger.clear(a.peer_id for a in answers if a.peer_id != outcome.liar)  # they agreed on the truth
        await self._convict(stage, kind, outcome.liar, answers, request, mb)
        primary, second = answers[0], answers[1]
        return Ruling(Finding.OVERRULED, second) if outcome.liar == primary.peer_id else _CONFIRMED

    def _incomparable(self, stage: int, kind: Kind, primary: Answer) -> None:
        """The stage-mates that answered computed in another ``--precision`` than ``primary`` (bf16
        against fp32 differ by more than any codec's tolerance): its answer goes on unconfirmed and
        its first checks stop (random ones go on, and compare it with a peer of its precision when
        one answers), said once per peer."""
        if self.ledger.give_up(primary.peer_id, kind):
            log.warning("spot check: stage %d peer %s computes in %s and the stage-mates asked about its %s in "
                        "another precision; its answers are not compared with theirs", stage,
                        primary.peer_id[:12], primary.precision, kind)

    async def _opinion(self, stage: int, kind: Kind, resend: Resend, samples: int, nbytes: int, exclude: set[str],
                       taken: set[str] | None = None, *, only: str | None = None) -> Answer | None:
        """Another peer's answer to a checked call (``only``: that peer's, a recheck); None (counted)
        when there was nobody to ask or none answered (``failed``), or the peer moved on or its stage
        stepped meanwhile (``inconclusive``: its answer would be from another step). ``taken``:
        shared by opinions asked at once, so that each asks another peer."""
        try:
            served = await self.calls.call(stage, kind, samples, resend, patience=self._opinion_patience,
                                           tally=_CheckTally(self.stats, nbytes), only=only, exclude=exclude,
                                           taken=taken)
        except StepMoved:
            self.stats.inconclusive += 1
            return None
        except CallEnded as ended:
            if ended.why is Ended.MOVED_ON:
                self.stats.inconclusive += 1
            else:
                self.stats.failed += 1
            return None
        reply = served.reply
        tensor = reply.outputs if isinstance(reply, ForwardReply) else reply.grad_inputs
        return Answer(served.peer_id, reply.step, tensor, reply.loss, reply.precision)

    async def _convict(self, stage: int, kind: Kind, liar: str, answers: list[Answer],
                       request: tuple[torch.Tensor, ...], mb: int) -> None:
        """Ban ``liar`` for ``LIAR_BAN_S``, say so, and report it to every listed peer."""
        stats, routers = self.stats, self.calls.stages.routers
        routers[stage].ban(liar, LIAR_BAN_S)
        if liar in stats.caught:  # another check that was in flight caught it too: reported already
            return
        stats.liars += 1
        stats.caught = (*stats.caught, liar)
        request_digest, answer_digests = await asyncio.to_thread(_evidence, request, answers)
        step = answers[0].step
        log.warning("spot check: stage %d peer %s lied (its %s at step %d disagrees with %s); banned for %.0fs "
                    "and reported (request %s, answers %s)", stage, liar[:12], kind, step,
                    " and ".join(a.peer_id[:12] for a in answers if a.peer_id != liar), LIAR_BAN_S,
                    request_digest[:16], ", ".join(f"{p[:12]}={d[:12]}" for p, d in sorted(answer_digests.items())))
        if self._identity is None:
            self._identity = Identity.generate()
        report = MisbehaviourReport.signed(self._identity, accused=liar, stage=stage, step=step, kind=kind, mb=mb,
                                           request_digest=request_digest, answers=answer_digests, at=time.time())
        body, signature = report.encode()
        peers = {p.peer_id: p.addr for router in routers for p in router.snapshot() if p.peer_id != liar and p.routable}
        client, timeout = self.client, self.timing.report_timeout_s

        async def send(addr: str) -> bool:
            try:
                return (await client.report(addr, ReportRequest(body, signature), timeout_s=timeout)).accepted
            except PeerError:
                return False

        accepted = await asyncio.gather(*(send(addr) for addr in peers.values()))
        stats.reports_sent += sum(accepted)
