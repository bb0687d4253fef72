"""Spot checks: a trainer runs some microbatches twice, through other peers, and acts on the verdict.

The SWARM paper assumes honest workers (section 6 names malicious nodes as a limitation). The
peers of a stage hold bit-identical parameters, so the same request to two of them at one step
must give the same answer (``swarmd.train.verify`` holds the rules: the tolerance, arbitration,
the ledger of what checks concluded). This module is the I/O around those rules (issues #17, #29).

A check is a *paired microbatch* (issue #29, item 1): the trainer draws, before a microbatch's
first call, whether it runs paired (a random ``verify_fraction`` of microbatches, and always while
a stage has fewer than two peers with a confirmed answer); a paired microbatch's every call is sent twice at
once, each under its own fresh microbatch id, the pair's to another peer of the stage where it has
one: forwards, the last stage's fused forward and backward, and each stage's backward (sent to the
peer that ran the pair's forward, with the same deadline as any backward). Both halves are ordinary
microbatches: the same fields, sizes and deadlines as any request, no flag, both accumulated (the
sample weighs twice in its step, both counted in the trainer's books); a check peer always ran its
own forward before its backward. Each stage gets the primary's (or, after a conviction, the
majority's) inputs, so both halves see byte-identical requests and each stage is judged alone.
docs/SECURITY.md ("What a peer sees of a check") says what a peer can observe and why it cannot tell.

The verdict on each pair of answers, waited for before the microbatch goes on:

* the same step and the same answer: confirmed (both peers credited);
* the same step, different answers: a third peer arbitrates (asked as a microbatch of its own: a
  forward, then its backward, flagged ``verify``: an opinion is never accumulated); the odd one
  out is convicted, and the majority's answer goes on; with no third peer the microbatch is redone
  (``Unsettled``), and a stage's only two peers that keep disagreeing are let through
  (``verify.UNSETTLED_LIMIT``);
* a reply's step is its peer's claim, so it is checked, not believed (``verify.step_lie``): a step
  beyond its stage-mates' in the last poll asks them again, and a step ahead of what its own peer
  reports afterwards, or still beyond its stage-mates', convicts it; a pair whose
  halves name different steps asks a third peer, checks the odd one out that way, and redoes the
  microbatch;
* a check is never dropped for want of an opinion of the same step: the microbatch is redone,
  while a peer is disputed (in a mismatch no conviction or agreement cleared) every microbatch
  runs paired, so it is asked again until decided, and the mismatch counts against both peers
  (``CheckLedger.against``): one that disagreed so with two peers that agree with each other is
  convicted, whatever it answers when asked again.

A newer peer's first answer of a kind, once its stage has two peers confirmed, runs alone and gets
another peer's opinion at once, judged as a pair's; its answers that come meanwhile wait for that
verdict (:meth:`SpotChecks._alone`): a join costs one opinion, not a paired microbatch for every
call until the routing reaches the newcomer, and no answer of it is used unchecked.

An answer that ran alone but whose size is far from its stage-mates' recent answers
(``verify.AnswerSizes``), or a last-stage one whose input gradient a drawn probe finds is no
descent direction (``verify.descent_probe``: the loss, asked of another peer at the inputs moved
against it, did not fall), gets a second opinion at once, judged as a pair's: a liar that knows the
checks lies where it is not paired, and its peer cannot see a check asked after it answered. A last-stage
answer far only from a thin reference (one stage-mate's answer of a step around it:
``verify.Outlier.THIN``) is probed first, and gets the opinion only when the probe finds it uphill.

Validation forwards are paired the same way (a pair of validation forwards is two validation
forwards), one batch a pass at least. The first stage's backward answers no tensor: its step is
compared (the only part of it a trainer uses).

Each check ends in a typed :class:`Ruling`; the peer convicted is banned for ``LIAR_BAN_S`` and a
signed report (``swarmd.pipeline.reports``) goes to every listed peer.

Its parts: ``swarmd.train.pairing`` draws which microbatches run paired and sends a pair's calls;
this module judges the answers; ``swarmd.train.convictions`` bans and reports a convicted peer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import random
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from swarmd.net.client import DataPlaneClient
from swarmd.net.messages import BackwardReply, ForwardReply
from swarmd.train.convictions import Convictions, Kind
from swarmd.train.pairing import CheckTally, Pairing, check_nbytes
from swarmd.train.stage_calls import CallEnded, How, Patience, Redo, Served, StageCalls
from swarmd.train.timing import Timing
from swarmd.train.verify import (
    Answer,
    AnswerSizes,
    CheckLedger,
    Outlier,
    Verdict,
    VerifyStats,
    arbitrate,
    call_passes,
    descent_probe,
    step_beyond,
    step_lie,
    tolerance,
)

__all__ = ["OPINION_ATTEMPTS", "Finding", "Ruling", "SpotChecks", "Unsettled"]

log = logging.getLogger(__name__)

R = TypeVar("R")
#: Asks a third peer (not one of the given ids) for its answer to the checked request; None when nobody answered.
Arbiter = Callable[[frozenset[str]], Awaitable[Answer | None]]
#: The stage's peers' steps by peer id as last polled (``/v1/progress``), polled afresh when ``fresh``.
StageSteps = Callable[[int, bool], Awaitable[Mapping[str, int]]]

#: Tries for a pair's or an arbiter's call: a busy peer is asked again, a broken one banned.
OPINION_ATTEMPTS = 4


class Unsettled(Redo):
    """A pair's answers disagreed (or came from different steps) and no third one settled who lied:
    neither answer is used, the microbatch is redone (asked again, under fresh ids)."""


class Finding(enum.Enum):
    """What a check found about the answer it checked."""

    CONFIRMED = "confirmed"  # the pair agreed at one step (or a witness did, against a convicted liar)
    OVERRULED = "overruled"  # the primary's peer lied: convicted, and the majority's answer goes on
    UNSETTLED = "unsettled"  # a mismatch no third peer settled: redo the microbatch
    UNCHECKED = "unchecked"  # no pair at this stage (one usable peer): nothing to compare
    INCOMPARABLE = "incomparable"  # the pair computed in different precisions
    LET_THROUGH = "let_through"  # its stage's only two peers keep disagreeing: going on with their answers


@dataclass(frozen=True)
class Ruling:
    """A check's verdict on one answer: what it found, and the answer to go on with instead of the
    primary's (``use``: the majority's when the primary lied)."""

    finding: Finding
    use: Answer | None = None

    @property
    def redo(self) -> bool:
        return self.finding is Finding.UNSETTLED


_CONFIRMED = Ruling(Finding.CONFIRMED)
_UNSETTLED = Ruling(Finding.UNSETTLED)
_UNCHECKED = Ruling(Finding.UNCHECKED)


def forward_answer(served: Served[ForwardReply]) -> Answer:
    r = served.reply
    return Answer(served.peer_id, r.step, r.outputs, r.loss, r.precision)


def backward_answer(served: Served[BackwardReply]) -> Answer:
    r = served.reply
    return Answer(served.peer_id, r.step, r.grad_inputs, r.loss, r.precision)


class SpotChecks:
    """One trainer's spot checks: which microbatches run paired, the pairs' calls, the verdicts."""

    def __init__(
        self, calls: StageCalls, client: DataPlaneClient, *, stats: VerifyStats, codec: str, fraction: float,
        window: int, timing: Timing, rng: random.Random | None = None, stage_steps: StageSteps | None = None,
    ) -> None:
        self.calls = calls
        self.client = client
        self.stats = stats
        self.ledger = CheckLedger()
        self.sizes = AnswerSizes()
        self.fraction = fraction
        self.timing = timing
        self._tolerance = tolerance(codec)
        self._patience = Patience(tries=OPINION_ATTEMPTS, waits=False, busy_pause_s=timing.opinion_busy_retry_s)
        self.pairing = Pairing(calls, stats=stats, ledger=self.ledger, fraction=fraction, timing=timing,
                               rng=rng if rng is not None else random.Random(secrets.randbits(64)),
                               patience=self._patience)
        self.convictions = Convictions(calls, client, stats=stats, timing=timing)
        self._stage_steps = stage_steps
        #: the first checks out now, by (peer, kind): that peer's other answers of the kind wait for the verdict
        self._first_checks: dict[tuple[str, str], asyncio.Future[None]] = {}

    # ---- which microbatches run paired (swarmd.train.pairing) ------------------------------------

    def pairs(self, force: bool = False) -> bool:
        """Whether the next microbatch runs paired (:meth:`Pairing.pairs`)."""
        return self.pairing.pairs(force)

    async def paired(self, stage: int, call: Callable[[How | None], Awaitable[Served[R]]],
                     nbytes: int) -> tuple[Served[R], Served[R]]:
        """A call's two halves, sent at once (:meth:`Pairing.paired`)."""
        return await self.pairing.paired(stage, call, nbytes)

    def validation_pair(self, batches: int) -> int | None:
        """Which validation batch of a pass runs paired whatever the draw (:meth:`Pairing.validation_pair`)."""
        return self.pairing.validation_pair(batches)

    def pair_tally(self, nbytes: int) -> How:
        """How a pair's backward is sent (:meth:`Pairing.pair_tally`)."""
        return self.pairing.pair_tally(nbytes)

    # ---- the verdicts ----------------------------------------------------------------------------

    async def forward(self, stage: int, inputs: torch.Tensor, targets: torch.Tensor | None,
                      served: Served[ForwardReply], pair: Served[ForwardReply] | None, *,
                      validation: bool = False) -> ForwardReply:
        """The forward reply to go on with: the primary's, or the majority's when it lied. Raises
        :class:`Unsettled` when the pair could not be judged. ``validation``: a validation forward's
        (its second opinions carry no microbatch id either, as no validation forward does)."""
        self.stats.calls += 1
        self.stats.work_passes += inputs.shape[0] * call_passes("forward", last_stage=targets is not None)
        reply = served.reply
        calls = self.calls

        async def arbiter(exclude: frozenset[str]) -> Answer | None:
            how = How(patience=self._patience, tally=CheckTally(self.stats, check_nbytes(inputs, targets), "opinion"),
                      exclude=exclude)
            mb = None if validation else secrets.randbits(64)
            try:
                return forward_answer(await calls.forward(stage, inputs, targets, mb=mb, how=how))
            except (CallEnded, Redo):  # no answer, or one a redo would not use
                return None

        request = tuple(t for t in (inputs, targets) if t is not None)
        if pair is not None:
            ruling = await self.judge(stage, "forward", forward_answer(served), forward_answer(pair), arbiter, request)
        else:
            alone = await self._alone(stage, "forward", forward_answer(served), arbiter, request)
            if alone is None:
                return reply
            ruling = alone
        if ruling.redo:
            raise Unsettled()
        if ruling.use is None or ruling.use.tensor is None:
            return reply
        return dataclasses.replace(reply, outputs=ruling.use.tensor, loss=ruling.use.loss, step=ruling.use.step)

    async def backward(
        self, stage: int, inputs: torch.Tensor, grad_outputs: torch.Tensor | None, targets: torch.Tensor | None,
        served: Served[BackwardReply], pair: Served[BackwardReply] | None,
    ) -> BackwardReply:
        """The backward reply to go on with, as :meth:`forward`. An arbiter runs its own forward
        first (the last stage's: one fused call), as any microbatch does."""
        self.stats.calls += 1
        # a backward with targets is the last stage's fused call (as StageCalls counts the checks' own)
        self.stats.work_passes += inputs.shape[0] * call_passes("backward", last_stage=targets is not None)
        reply = served.reply
        request = tuple(t for t in (inputs, grad_outputs, targets) if t is not None)
        calls, nbytes = self.calls, check_nbytes(*request)

        async def arbiter(exclude: frozenset[str]) -> Answer | None:
            mb = secrets.randbits(64)
            how = How(patience=self._patience, tally=CheckTally(self.stats, nbytes, "opinion"), exclude=exclude,
                      opinion=True)
            try:
                step = only = kept_at = None
                if targets is None:
                    fwd = await calls.forward(stage, inputs, mb=mb, how=how)
                    step, only = fwd.reply.step, fwd.peer_id
                    kept_at = fwd.addr if fwd.reply.kept else None  # sized as any backward: kept inputs stay out
                how = dataclasses.replace(how, only=only)
                return backward_answer(await calls.backward(stage, inputs, grad_outputs=grad_outputs,
                                                            targets=targets, step=step, mb=mb, how=how,
                                                            kept_at=kept_at))
            except (CallEnded, Redo):  # no answer, or one a redo would not use
                return None

        async def probe() -> bool:
            """Whether the answer's input gradient is no descent direction: the loss at the inputs moved
            against it, asked of another peer at the same step, is not below the answer's loss."""
            moved = None
            if targets is not None and reply.grad_inputs is not None and reply.loss is not None:
                moved = await asyncio.to_thread(descent_probe, inputs, reply.grad_inputs, reply.loss)
            if moved is None or reply.loss is None:
                return False
            how = How(patience=self._patience, tally=CheckTally(self.stats, nbytes, "probe"),
                      exclude=frozenset((served.peer_id,)))
            try:
                probed = await calls.forward(stage, moved, targets, how=how)  # a validation forward's shape
            except (CallEnded, Redo):  # no answer, or one a redo would not use
                self.stats.probes_missed += 1
                return False
            if probed.reply.step != reply.step:  # its stage stepped in between: the losses are not comparable
                self.stats.probes_missed += 1
                return False
            return probed.reply.loss is None or probed.reply.loss >= reply.loss

        if pair is not None:
            ruling = await self.judge(stage, "backward", backward_answer(served), backward_answer(pair), arbiter,
                                      request)
        else:
            alone = await self._alone(stage, "backward", backward_answer(served), arbiter, request,
                                      probe if targets is not None else None)
            if alone is None:
                return reply
            ruling = alone
        if ruling.redo:
            raise Unsettled()
        if ruling.use is None:
            return reply
        use = ruling.use
        return dataclasses.replace(reply, grad_inputs=use.tensor, loss=use.loss, step=use.step)

    async def judge(self, stage: int, kind: Kind, primary: Answer, second: Answer, arbiter: Arbiter,
                    request: tuple[torch.Tensor, ...], *, reference: bool = True) -> Ruling:
        """The ruling on a pair of answers (see the module docstring); ``reference``: a confirmed answer's
        size joins its stage's references (``verify.AnswerSizes``), as a paired microbatch's does and an
        outlier checked after it came does not."""
        stats = self.stats
        if primary.peer_id == second.peer_id:
            return _UNSETTLED if await self._plausible(stage, kind, primary, request) else _UNCHECKED
        stats.checks += 1
        for answer in (primary, second):
            if await self._plausible(stage, kind, answer, request):
                stats.redone += 1
                return _UNSETTLED  # its peer lied about its step and is convicted: the microbatch goes again
        if primary.precision != second.precision:
            for a in (primary, second):
                if self.ledger.give_up(a.peer_id, kind):
                    log.warning("spot check: stage %d peer %s computes in %s, its mate in another precision; their "
                                "answers are not compared", stage, a.peer_id[:12], a.precision)
            return Ruling(Finding.INCOMPARABLE)
        if primary.step != second.step:
            return await self._split_steps(stage, kind, primary, second, arbiter, request)
        outcome = arbitrate([primary, second], self._tolerance)
        if outcome.verdict is Verdict.AGREE:
            stats.agreements += 1
            self.ledger.credit((primary, second), kind)
            self.ledger.agreed(primary.peer_id, second.peer_id, kind)
            self.ledger.clear((primary.peer_id, second.peer_id))
            if reference:
                self.sizes.observe(stage, kind, primary)  # (the second is the same microbatch: no second data point)
            return _CONFIRMED
        self.ledger.dispute((primary.peer_id, second.peer_id))
        stats.mismatches += 1
        stats.arbitrations += 1
        log.warning("spot check: stage %d peers %s and %s answered a %s differently at step %d; asking a third",
                    stage, primary.peer_id[:12], second.peer_id[:12], kind, primary.step)
        third = await arbiter(frozenset((primary.peer_id, second.peer_id)))
        if third is None or third.step != primary.step:
            stats.inconclusive += 1
            odd = self.ledger.against(primary.peer_id, second.peer_id, kind)  # counted, whatever comes next
            if odd is not None:
                return await self._odd_one_out(stage, kind, odd, primary, second, request)
            return self._unsettled_pair(stage, kind, primary.peer_id, second.peer_id)
        return await self._convicted(stage, kind, [primary, second, third], request)

    async def _alone(self, stage: int, kind: Kind, answer: Answer, arbiter: Arbiter, request: tuple[torch.Tensor, ...],
                     probe: Callable[[], Awaitable[bool]] | None = None) -> Ruling | None:
        """The ruling on an answer that ran alone (None: nothing to judge, it goes on). A new peer's first
        answer of a kind, where microbatches no longer run paired for it (``Pairing``), is its first check
        (:meth:`_unpaired`); its answers that come while that check is out wait for its verdict, then go on
        as a confirmed peer's would, or are redone when it lied: one opinion a new peer, and none of its
        answers used unchecked."""
        key = (answer.peer_id, kind)
        while (pending := self._first_checks.get(key)) is not None and self._wants_first(stage, kind, answer):
            await asyncio.shield(pending)
        if answer.peer_id in self.stats.caught:
            self.stats.redone += 1
            raise Unsettled()  # its first check convicted it meanwhile
        first = self._wants_first(stage, kind, answer)
        done: asyncio.Future[None] | None = None
        if first:
            done = self._first_checks[key] = asyncio.get_running_loop().create_future()
        try:
            second, reference = await self._unpaired(stage, kind, answer, arbiter, request, probe, first=first)
            if second is None:
                return None
            return await self.judge(stage, kind, answer, second, arbiter, request, reference=reference)
        finally:
            if done is not None:
                del self._first_checks[key]
                done.set_result(None)

    def _wants_first(self, stage: int, kind: Kind, answer: Answer) -> bool:
        """Whether ``answer`` is its peer's first check of ``kind``: checks are on, it has a tensor (the
        first stage's backward has none: its step is held to the polls), its peer has none confirmed, and
        another peer of the stage is routable (could give an opinion)."""
        return (self.fraction > 0.0 and answer.tensor is not None
                and self.ledger.wants_first_check(answer.peer_id, kind)
                and any(p.routable and p.peer_id != answer.peer_id
                        for p in self.calls.stages.routers[stage].snapshot()))

    async def _unpaired(self, stage: int, kind: Kind, answer: Answer, arbiter: Arbiter,
                        request: tuple[torch.Tensor, ...],
                        probe: Callable[[], Awaitable[bool]] | None = None, *,
                        first: bool = False) -> tuple[Answer | None, bool]:
        """An answer that ran alone: its step held to its stage's (a lie: :class:`Unsettled`), and a second
        opinion asked now, to be judged as a pair's, when it is its peer's ``first`` check, when its size is
        suspicious (``verify.AnswerSizes``), or when its gradient is no descent direction (``probe``: for a
        drawn share of the last stage's answers, and for those whose size is out of a thin reference's band).
        Returns the opinion (None: nothing to judge, the answer goes on) and whether the answer's size may
        become a reference (not an outlier's). A suspicious
        answer no other peer could give an opinion on is not used (:class:`Unsettled`), unless its stage has
        no other usable peer; a first check without one goes on unconfirmed."""
        if await self._plausible(stage, kind, answer, request):
            self.stats.redone += 1
            raise Unsettled()  # its peer lied about the step: convicted, and the microbatch goes again
        outlier = self.sizes.outlier(stage, kind, answer) if self.fraction > 0.0 else Outlier.NO  # checks off: none
        # an outlier against a thin reference (one stage-mate's answer of a step around it) is a weak sign: the
        # last stage's is probed for direction (a forward) before anyone is asked for an opinion (a fused call)
        suspicious = outlier is Outlier.FIRM or (outlier is Outlier.THIN and probe is None)
        thin = outlier is Outlier.THIN and probe is not None
        if not (first or suspicious) and probe is not None and (thin or self.pairing.probes()):
            self.stats.probes += 1
            self.stats.outlier_probes += thin
            suspicious = await probe()
            if thin and not suspicious:
                return None, False  # it goes on; a checked outlier is no reference (AnswerSizes)
            if suspicious:
                # no descent direction: evidence against this answer whatever its second opinion says (one from
                # the next step settles nothing, and a liar that keeps its gradients' size is redone unblamed,
                # lie after lie): its peer's next answers are checked always until a few are confirmed
                self.ledger.watch((answer.peer_id,))
        if not (first or suspicious):
            self.sizes.observe(stage, kind, answer)
            return None, True
        if first:
            self.stats.first_opinions += 1
        else:
            self.stats.suspicions += 1
        second = await arbiter(frozenset((answer.peer_id,)))
        if second is None:
            self.stats.unconfirmed += 1
            if not suspicious:
                # a first check nobody could answer (the other peers busy, on probation, just listed): the answer
                # goes on unconfirmed, as a pair's would with both halves on one peer. Redone instead, it met the
                # same peer again and again: a livelock of the README's swarm, where a second stage-0 peer joined
                # while the first one's answers were out and no call could reach it yet
                self.sizes.observe(stage, kind, answer)
                return None, True
            if self.calls.stages.routers[stage].usable_count > 1:  # a suspicious answer nobody confirmed: not used
                self.stats.redone += 1
                raise Unsettled()
        return second, not suspicious

    async def _odd_one_out(self, stage: int, kind: Kind, liar: str, primary: Answer, second: Answer,
                           request: tuple[torch.Tensor, ...]) -> Ruling:
        """Convict ``liar``, the odd one out of unsettled mismatches (``CheckLedger.against``): the
        other answer of this pair goes on."""
        log.warning("spot check: stage %d peer %s disagreed with two stage-mates that agree with each other, "
                    "in mismatches no third answer settled", stage, liar[:12])
        self.ledger.clear(a.peer_id for a in (primary, second) if a.peer_id != liar)
        await self.convictions.convict(stage, kind, liar, [primary, second], request)
        return Ruling(Finding.OVERRULED, second) if liar == primary.peer_id else _CONFIRMED

    async def _split_steps(self, stage: int, kind: Kind, primary: Answer, second: Answer, arbiter: Arbiter,
                           request: tuple[torch.Tensor, ...]) -> Ruling:
        """A pair whose answers name different steps: a third peer says which step the stage is at,
        and the one alone ahead of it is held to a fresh poll (:meth:`_plausible`: convicted when its
        own peer then reports an earlier step). The microbatch is redone either way: a stage that
        stepped between two answers sent at once is rare, and nobody is blamed for being behind."""
        stats = self.stats
        stats.inconclusive += 1
        stats.redone += 1
        third = await arbiter(frozenset((primary.peer_id, second.peer_id)))
        if third is None:
            return _UNSETTLED
        ahead = [a for a in (primary, second) if a.step > third.step]
        if len(ahead) == 1:
            await self._plausible(stage, kind, ahead[0], request, suspect=True)
        return _UNSETTLED

    async def held_to_step(self, stage: int, peer_id: str, step: int, outputs: torch.Tensor | None,
                           request: tuple[torch.Tensor, ...]) -> bool:
        """A forward ``peer_id`` answered at ``step``, whose backward every usable peer of the stage then
        refused as behind that step (``stage_calls.StageBehind``): its step held to a fresh poll, as a pair's
        alone ahead is (:meth:`_plausible`); True when its peer was convicted. An honest peer that stepped
        alone, or is gone, is not blamed: its poll names that step, or nothing."""
        return await self._plausible(stage, "forward", Answer(peer_id, step, outputs), request, suspect=True)

    async def _plausible(self, stage: int, kind: Kind, answer: Answer, request: tuple[torch.Tensor, ...],
                         suspect: bool = False) -> bool:
        """Hold a reply's step to its stage's (``verify.step_lie``): True, and its peer convicted, when
        a poll made after it shows a lie. The poll is made only when the step is beyond its stage-mates'
        in the last one (``verify.step_beyond``), or the reply is ``suspect`` (alone ahead in a pair)."""
        if self._stage_steps is None:
            return False
        if not suspect:
            known = await self._stage_steps(stage, False)
            if not step_beyond(answer.step, [s for p, s in known.items() if p != answer.peer_id]):
                return False
        for again in range(2):
            if again:
                await asyncio.sleep(self.timing.step_recheck_s)
            steps = await self._stage_steps(stage, True)
            own = steps.get(answer.peer_id)
            mates = {p: s for p, s in steps.items() if p != answer.peer_id}
            if own is not None and answer.step > own:
                # its own peer, asked after the reply came, names an earlier step: a lie at once. A peer's
                # progress is adopted before any reply computed at that step leaves it (the executor's
                # ``_run``), so an honest peer's never does; waiting to ask again let a liar one step ahead
                # through whenever its stage stepped meanwhile (every time, on a loaded machine)
                break
            if not step_lie(answer.step, own, list(mates.values())):
                return False
            # beyond its mates' steps only: asked again a moment later (a mate's answer may lag its step)
        log.warning("spot check: stage %d peer %s answered a %s at step %d, ahead of %s", stage, answer.peer_id[:12],
                    kind, answer.step, f"the step it reports now ({own})" if own is not None and answer.step > own
                    else "its stage-mates' steps")
        self.stats.mismatches += 1
        evidence = [Answer(p, s, None) for p, s in sorted(mates.items(), key=lambda item: -item[1])][:2]
        await self.convictions.convict(stage, kind, answer.peer_id, [answer, *evidence], request)
        return True

    def _unsettled_pair(self, stage: int, kind: Kind, a: str, b: str) -> Ruling:
        """A mismatch between ``a`` and ``b`` that no third peer settled: unsettled (redo), unless
        they are the only usable peers of their stage and have disagreed so ``UNSETTLED_LIMIT``
        times: no redo can ever settle it, and redoing each microbatch for ever would stall training."""
        ledger = self.ledger
        known = ledger.gave_up(a, kind) and ledger.gave_up(b, kind)
        if not ledger.unsettled(a, b, kind, pair_only=self.calls.stages.routers[stage].usable_count <= 2):
            self.stats.redone += 1
            return _UNSETTLED
        if not known:
            log.warning("spot check: stage %d peers %s and %s answered %s %d times differently and the stage has "
                        "no third peer to settle it (one of them lies, or they differ beyond the tolerance); "
                        "going on with their answers unconfirmed", stage, a[:12], b[:12], kind,
                        ledger.unsettled_limit)
        self.stats.unconfirmed += 1
        return Ruling(Finding.LET_THROUGH)

    async def _convicted(self, stage: int, kind: Kind, answers: list[Answer],
                         request: tuple[torch.Tensor, ...]) -> Ruling:
        """Arbitrate ``answers`` (primary, second, arbiter) and convict the liar: the primary's answer
        is overruled by the second's when the primary lied, else confirmed; unsettled when no two agree."""
        outcome = arbitrate(answers, self._tolerance)
        if outcome.verdict is not Verdict.LIAR or outcome.liar is None:
            self.stats.inconclusive += 1
            self.stats.redone += 1
            return _UNSETTLED
        honest = [a for a in answers if a.peer_id != outcome.liar]
        self.ledger.clear(a.peer_id for a in honest)  # they agreed on the truth
        self.ledger.agreed(honest[0].peer_id, honest[1].peer_id, kind)
        self.sizes.observe(stage, kind, honest[0])
        await self.convictions.convict(stage, kind, outcome.liar, answers, request)
        primary, second = answers[0], answers[1]
        return Ruling(Finding.OVERRULED, second) if outcome.liar == primary.peer_id else _CONFIRMED

    async def finish(self) -> None:
        """Checks are waited for by their microbatch: nothing runs in the background."""

    async def cancel(self) -> None:
        """Checks are waited for by their microbatch: nothing runs in the background."""
