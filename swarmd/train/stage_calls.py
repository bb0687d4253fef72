"""Calls to a stage: the one machine every caller goes through (route, timeout, send, classify, ban, retry).

SWARM's trainers send each microbatch through one peer per stage, picked by stochastic wiring
(paper, section 3.2), and survive slow, leaving or broken peers by routing around them. Every call
to a stage does the same: the stage's router (``swarmd.pipeline.routing``) picks a peer and says how
long to wait for it; the request goes out; a refusal is classified by its type
(``swarmd.pipeline.failures``) into a ban with backoff and a retry elsewhere, a pause, a redo or a
give-up. :meth:`StageCalls.call` is that machine, once; a microbatch's forward and backward, a
validation forward and a spot check's second opinion all use it (petals' client cuts the same way:
``sequence_manager`` decides, ``remote_forward_backward`` sends, one retry loop around them).

What differs between callers is said, not coded twice:

* :class:`Patience`: how hard a call tries. A microbatch's call (:meth:`Patience.until_answered`)
  must be answered: it waits for a usable peer (up to ``stage_wait_timeout_s``) and retries until
  one answers. A spot check's opinion is an extra: a few tries, and it ends when there is nobody to
  ask or the peer moved on (its answer would be from another step).
* :class:`CallTally`: who pays. A microbatch's calls count in the trainer's summary (retries, bans,
  timeouts, probation calls) and each ban is logged; a check's count as its extra traffic.

How a call ends, by type: the reply (:class:`Served`); :class:`StepMoved` (``StaleStep``: the stage
stepped since this microbatch's forward, whose gradient would mix two steps: a :class:`Redo`);
:class:`StageBehind` (every usable peer refused it as ``PeerBehind``: a :class:`Redo` too); or
:class:`CallEnded` (a :class:`~swarmd.train.swarm_client.TrainerError` saying why: refused, nobody
to ask, moved on).

Peer to peer (issue #31): a microbatch's forward may name the peers of the next stages
(:meth:`StageCalls.forward` ``chain_to``, :meth:`StageCalls._hops`: picked by their own routers as
their calls would be, proven and directly dialable only), and is then one call to the first stage
that waits for the whole chain; the later stages' answers are credited to their peers from the
waits each reports, and a broken chain is not a failure of the first peer (its own outputs come
back, and the caller goes on).

Timeouts follow what the stage's peers take (``StageRouter.timeout_for``); a peer never seen
answering is on probation, and a forward to it (no side effect) is cut short once overdue by what
the stage takes *now* (issue #18: a tarpit costs about one typical call). A backward is exactly
once (``swarmd.pipeline.stage.step_protocol``): its peer adds the gradient only within its deadline, and
an attempt whose answer was lost is settled by asking that peer (``POST /v1/claim``) before the next.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

import torch

from swarmd.errors import InputsNotCached, PeerBehind, PeerError
from swarmd.net.addresses import is_relayed
from swarmd.net.client import DataPlaneClient, metered
from swarmd.net.messages import HOP_MARGIN_MS, BackwardReply, ClaimRequest, ForwardReply, Hop
from swarmd.pipeline.failures import Action, classify, timed_out
from swarmd.pipeline.routing import StageRouter
from swarmd.pipeline.stage.step_protocol import BackwardAttempts
from swarmd.train.events import CallDone, TrainerEvent
from swarmd.train.summary import TrainSummary
from swarmd.train.swarm_client import TrainerError
from swarmd.train.timing import Timing
from swarmd.train.verify import call_passes

__all__ = [
    "CallEnded",
    "CallTally",
    "Ended",
    "How",
    "Patience",
    "Redo",
    "Send",
    "Served",
    "StageCalls",
    "Stages",
    "StageBehind",
    "StepMoved",
    "unreachable_hint",
]

log = logging.getLogger(__name__)

R = TypeVar("R")
Kind = Literal["forward", "backward"]
#: Sends one request to the peer at ``addr``, waiting at most ``timeout_s``.
Send = Callable[[str, float], Awaitable[R]]


class Redo(Exception):
    """The microbatch must be redone from its first stage, under a new id."""


class StepMoved(Redo):
    """A stage refused a backward as ``StaleStep``: it stepped since this microbatch's forward, and
    the gradient would mix two steps. Redone whole, it is never lost nor counted in the wrong step."""

    def __init__(self, stage: int) -> None:
        super().__init__(f"stage {stage} stepped since the microbatch's forward")
        self.stage = stage


class StageBehind(Redo):
    """Every usable peer of a stage refused a backward as ``PeerBehind``: none of them is at the step
    the microbatch's forward ran at (the peer that ran it stepped alone, or is gone or banned, and its
    stage-mates have not followed). Retrying elsewhere would go round them for good, holding the
    microbatch's samples out of the step they were leased for; redone whole, its forward runs at the
    step the stage is at. Nothing was counted: ``PeerBehind`` is refused before any compute."""

    def __init__(self, stage: int) -> None:
        super().__init__(f"every usable peer of stage {stage} is behind the step of the microbatch's forward")
        self.stage = stage


class Ended(enum.Enum):
    """Why a call ended without an answer."""

    REFUSED = "refused"  # the request itself is wrong: resending it anywhere would fail the same way
    NOBODY = "nobody"  # no usable peer to ask (for a waiting call: for stage_wait_timeout_s), or tries spent
    MOVED_ON = "moved_on"  # the peer is leaving, behind or on another stage (a call that does not retry elsewhere)


class CallEnded(TrainerError):
    """A call to a stage ended without an answer; ``why`` says how."""

    def __init__(self, why: Ended, message: str) -> None:
        super().__init__(message)
        self.why = why


@dataclass(frozen=True)
class Patience:
    """How hard one call tries before it ends unanswered."""

    tries: int | None  # requests sent at most (None: until a peer answers)
    #: No usable peer now, or the peer moved on: wait for one / try another (True), or end the call.
    waits: bool
    busy_pause_s: float  # a peer busy averaging is asked again after this

    @classmethod
    def until_answered(cls, timing: Timing) -> Patience:
        """A microbatch's (or a validation's) call: it must be answered, so it waits and retries."""
        return cls(tries=None, waits=True, busy_pause_s=timing.busy_retry_s)


@dataclass(frozen=True)
class Served(Generic[R]):
    """A call's answer: the reply, the peer that sent it, and how many requests it took."""

    reply: R
    peer_id: str
    attempts: int
    addr: str = ""  # where the answering peer was dialled
    hops: tuple[Hop, ...] = ()  # a peer-to-peer forward's next hops, as sent (their answers: ``reply.chain``)
    #: a peer-to-peer forward's earlier attempts that failed after naming a fused hop: ``(stage, addr)`` of each
    #: backward they may have counted (the fused hop's; with the backward chain, every peer of the chain's): the
    #: caller settles each (a claim) before sending that stage's backward itself
    unsettled: tuple[tuple[int, str], ...] = ()
    #: the peer picked for the stage after the chain's end that the chain could not name (relayed, on
    #: probation): the caller's own call of that stage asks it first, so it is not passed over
    stopped_at: str | None = None


class CallTally(Protocol):
    """Who pays for a call's requests (see the module docstring)."""

    def sent(self, peer_id: str, samples: int, *, on_probation: bool) -> None: ...

    # the peer computed them (not Busy, not failed), at ``passes`` forward passes a sample (verify.call_passes)
    def answered(self, peer_id: str, samples: int, passes: int) -> None: ...

    # the bodies one request and its reply took on the wire (a refused or failed one's too, what it sent)
    def carried(self, nbytes: int) -> None: ...

    def banned(self, stage: int, peer_id: str, error: PeerError, *, timed_out: bool, ban_s: float,
               timeout_s: float) -> None: ...


@dataclass(frozen=True)
class How:
    """A spot check's call (``swarmd.train.spot_checks``): the same request as a microbatch's, sent
    the same way; only whom it may ask (``only``, ``exclude``, ``taken``: see :meth:`StageCalls.call`),
    how hard it tries and who pays differ, none of which the peer sees. ``opinion``: a second or third
    opinion asked after another peer answered: its backward is computed and answered, never accumulated
    (meta ``verify``), so an honest swarm's books stay exact; the peer asked may tell, the peer checked
    cannot (it answered already)."""

    patience: Patience | None = None  # None: a microbatch's (until answered)
    tally: CallTally | None = None  # None: a microbatch's (counted in the summary, told to the observers)
    only: str | None = None
    exclude: frozenset[str] = frozenset()
    taken: set[str] | None = None
    opinion: bool = False


class Stages(Protocol):
    """The routers a call picks peers from (``swarmd.train.swarm_view.SwarmView``)."""

    @property
    def routers(self) -> Sequence[StageRouter]: ...

    async def refresh(self, force: bool = False) -> None: ...

    def unreachable(self, stage: int) -> Sequence[str]: ...

    @property
    def suspected(self) -> frozenset[str]: ...  # peers accused once, as the stages' last progress answers said


class _WorkTally:
    """A microbatch's calls: counted in the trainer's summary, each ban said in the log."""

    def __init__(self, summary: TrainSummary) -> None:
        self.summary = summary

    def sent(self, peer_id: str, samples: int, *, on_probation: bool) -> None:
        self.summary.probation_calls += int(on_probation)

    def answered(self, peer_id: str, samples: int, passes: int) -> None:
        pass

    def carried(self, nbytes: int) -> None:
        self.summary.wire_bytes += nbytes

    def banned(self, stage: int, peer_id: str, error: PeerError, *, timed_out: bool, ban_s: float,
               timeout_s: float) -> None:
        s = self.summary
        s.retries += 1
        s.bans += 1
        s.timeouts += int(timed_out)
        log.warning("stage %d peer %s failed (%s%s); banned for %.1fs, retrying elsewhere", stage, peer_id[:12],
                    error, f", no answer within {timeout_s:.1f}s" if timed_out else "", ban_s)


async def _carried(sending: Awaitable[R], tally: CallTally) -> R:
    """``sending``'s reply, its bodies' bytes on the wire told to ``tally`` however it ends."""
    with metered() as wire:
        try:
            return await sending
        finally:
            tally.carried(wire.total)


def unreachable_hint(failures: dict[str, PeerError], unreachable: Sequence[str] = ()) -> str:
    """The end of a give-up sentence: the addresses that failed and why, or that no member of the
    swarm could dial, with the likely cause (a firewall, a NAT, a wrong ``--announce``)."""
    cause = "a firewall or NAT in the way, or a wrong --announce on that peer?"
    parts = []
    if unreachable:
        parts.append(f"{len(unreachable)} peer(s) listed at {', '.join(unreachable[:3])} could not be dialled by "
                     f"other members (reachable: no; {cause})")
    if failures:
        shown = "; ".join(f"{addr}: {exc.message or exc.error}" for addr, exc in list(failures.items())[-3:])
        hint = f" ({cause})" if all(exc.status == 0 for exc in failures.values()) else ""
        parts.append(f"its peers failed: {shown}{hint}")
    return (". " + "; ".join(parts)) if parts else ""


class StageCalls:
    """Every call this trainer makes to a stage: the machine (:meth:`call`) and the kinds of call
    (:meth:`forward`, :meth:`backward`, and the same requests again for a spot check)."""

    def __init__(
        self, stages: Stages, client: DataPlaneClient, *, model: str, codec: str, summary: TrainSummary,
        timing: Timing, request_timeout_s: float, stage_wait_timeout_s: float,
        emit: Callable[[TrainerEvent], None] | None = None,
    ) -> None:
        self.stages = stages
        self.client = client
        self.model = model  # the model spec's digest: every request names it
        self.codec = codec
        self.summary = summary
        self.timing = timing
        self.request_timeout_s = request_timeout_s
        self.stage_wait_timeout_s = stage_wait_timeout_s
        self.failures: dict[int, dict[str, PeerError]] = {}  # stage -> addr -> the last error that banned it
        self._emit = emit
        self._work = _WorkTally(summary)
        self._patient = Patience.until_answered(timing)

    # ---- the machine -----------------------------------------------------------------------------

    async def call(
        self, stage: int, kind: Kind, samples: int, send: Send[R], *, patience: Patience | None = None,
        tally: CallTally | None = None, prefer: str | None = None, only: str | None = None,
        exclude: Collection[str] = (), taken: set[str] | None = None, send_proven: Send[R] | None = None,
        own_seconds: Callable[[R, float], float] | None = None,
    ) -> Served[R]:
        """One request to some peer of ``stage``, made by ``send(addr, timeout_s)`` within the router's
        timeout for that peer; retried, banned and waited for as ``patience`` says (by default: until
        answered), paid by ``tally`` (by default: the trainer's summary).

        Whom to ask: ``prefer`` first when it is usable (a backward's: the peer that ran the forward,
        whose activation cache holds the microbatch), ``only`` that peer and nobody else (a spot check
        asking the same peer again), never one in ``exclude``. ``taken`` is shared by calls made at
        once that must each ask another peer: each call's current peer is in it from before its
        first await.

        ``send_proven``: how to send to a peer off probation, when that differs (a peer-to-peer
        forward, which waits on later stages too, is never sent to a peer whose call may be cut
        short); ``own_seconds(reply, elapsed)``: the part of ``elapsed`` that was the peer's own (a
        peer-to-peer forward's reply says how long it waited on its next hop).
        """
        router = self.stages.routers[stage]
        patience = self._patient if patience is None else patience
        tally = self._work if tally is None else tally
        exclude = frozenset(exclude)
        tried: set[str] = set()  # failed in this call (cleared when a waiting call goes round again)
        behind: set[str] = set()  # refused it as PeerBehind: not at the step this request names
        mine: str | None = None  # this call's claim in ``taken``
        waiting_since: float | None = None
        sent = 0
        while patience.tries is None or sent < patience.tries:
            avoid = exclude | tried
            if only is not None:
                choice = router.choose_only(only) if only not in avoid else None
            else:
                choice = router.choose_preferred(prefer, exclude=avoid | ((taken or set()) - {mine}))
                if choice is None and taken and patience.waits:
                    # a call that must be answered never waits for the peers its pair took: they stay in
                    # ``taken`` after the pair's answer, and with its own peer failed (banned, in ``tried``)
                    # it would wait on them for good (the end-of-run stall of issue 28). Both halves on one
                    # peer are an unchecked pair (spot_checks: the same peer), as on a stage of one peer.
                    choice = router.choose_preferred(prefer, exclude=avoid)
            if choice is None:
                if not patience.waits:
                    break
                if behind and not router.waiting_on_caps(exclude=exclude | behind):
                    raise StageBehind(stage)  # nobody left who could take it at its step
                waiting_since = await self._wait_for_peer(stage, router, tried, avoid, waiting_since)
                continue
            peer_id, addr = choice
            if taken is not None:
                if mine is not None:
                    taken.discard(mine)
                taken.add(peer_id)
            mine = peer_id
            on_probation = not router.stats(peer_id).proven
            timeout = router.timeout_for(peer_id, samples, kind, floor_s=self.timing.timeout_floor(
                kind, self.request_timeout_s))
            router.begin(peer_id)
            sent += 1
            tally.sent(peer_id, samples, on_probation=on_probation)
            started = time.monotonic()
            try:
                sending: Awaitable[R]
                if on_probation and kind == "forward":  # no side effect: may be cut short (issue #18)
                    # the watch gives it up at the stage's latency as that is *now*; the request's own timeout
                    # only backs it (equal, the two raced, and the cause read as a plain HTTP timeout)
                    sending = self._watched(router, peer_id, samples, kind,
                                            send(addr, max(timeout, self.request_timeout_s)), started)
                elif send_proven is not None and not on_probation:
                    sending = send_proven(addr, timeout)
                else:
                    sending = send(addr, timeout)
                reply = await _carried(sending, tally)
            except PeerError as exc:
                action = classify(exc)
                if action is Action.BAN:
                    late = timed_out(exc)
                    self.failures.setdefault(stage, {})[addr] = exc
                    ban = router.report_failure(peer_id, timeout=late)
                    tally.banned(stage, peer_id, exc, timed_out=late, ban_s=ban, timeout_s=timeout)
                    tried.add(peer_id)
                    continue
                router.release(peer_id)
                if action is Action.REDO:
                    raise StepMoved(stage) from exc
                if action is Action.RETRY_SOON:  # e.g. Busy averaging: this peer is fine, shortly
                    await asyncio.sleep(patience.busy_pause_s)
                    continue
                if action is Action.RETRY_ELSEWHERE:  # leaving, behind, or not this stage any more
                    if not patience.waits:
                        raise CallEnded(Ended.MOVED_ON, f"stage {stage} peer {peer_id[:12]} moved on: {exc}") from exc
                    tried.add(peer_id)
                    if isinstance(exc, PeerBehind):
                        behind.add(peer_id)
                    continue
                raise CallEnded(Ended.REFUSED, f"stage {stage} peer {peer_id[:12]} refused a request: {exc}") from exc
            except BaseException:
                router.release(peer_id)
                raise
            elapsed = time.monotonic() - started
            router.report_success(peer_id, samples, own_seconds(reply, elapsed) if own_seconds else elapsed, kind)
            tally.answered(peer_id, samples, call_passes(kind, last_stage=stage == len(self.stages.routers) - 1))
            return Served(reply, peer_id, sent, addr)
        raise CallEnded(Ended.NOBODY, f"stage {stage}: no peer to ask (after {sent} request(s))")

    async def _wait_for_peer(self, stage: int, router: StageRouter, tried: set[str], avoid: Collection[str],
                             waiting_since: float | None) -> float | None:
        """Nobody to choose for a call that waits: pause for the right reason, and say since when
        the stage has had no usable peer at all (None while it has some); give up after
        ``stage_wait_timeout_s`` of that."""
        if router.waiting_on_caps(exclude=avoid):
            await asyncio.sleep(self.timing.tick_s)  # peers on probation are busy: a call ending frees a slot
            return waiting_since
        if tried and router.usable_count:
            tried.clear()  # every usable peer was tried once in this call: go round again
            await asyncio.sleep(self.timing.round_again_s)
            return waiting_since
        now = time.monotonic()  # no usable peer at all: none listed, or all banned
        if waiting_since is None:
            waiting_since = now
            log.warning("no usable peer for stage %d right now; waiting for one (up to %.0fs)",
                        stage, self.stage_wait_timeout_s)
        elif now - waiting_since > self.stage_wait_timeout_s:
            raise CallEnded(Ended.NOBODY,
                            f"stage {stage} has had no usable peer for {self.stage_wait_timeout_s:.0f}s; giving up"
                            + unreachable_hint(self.failures.get(stage, {}), self.stages.unreachable(stage)))
        tried.clear()
        unban = router.next_unban_in()
        await asyncio.sleep(min(unban if unban is not None else self.timing.no_peer_poll_s, self.timing.no_peer_poll_s))
        await self.stages.refresh()
        return waiting_since

    async def _watched(self, router: StageRouter, peer_id: str, samples: int, kind: Kind, call: Awaitable[R],
                       started: float) -> R:
        """A forward to a peer on probation, given up once it is overdue by the timeout the stage's
        latency gives *now*: a trainer's first calls go out before any estimate exists (the ceiling
        then holds), and a peer that answers polls but holds calls must cost about one typical call
        once its stage-mates have answered, not the ceiling (issue #18)."""
        task = asyncio.ensure_future(call)
        floor = self.timing.timeout_floor(kind, self.request_timeout_s)
        try:
            while True:
                limit = router.timeout_for(peer_id, samples, kind, floor_s=floor)
                left = started + limit - time.monotonic()
                if left <= 0:
                    overdue = TimeoutError(f"no answer within {limit:.1f}s")
                    raise PeerError(0, "TimeoutError", f"no answer within {limit:.1f}s, the stage's typical latency "
                                    "(a peer on probation)") from overdue
                done, _ = await asyncio.wait({task}, timeout=min(left, self.timing.watch_s))
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # ---- the kinds of call -----------------------------------------------------------------------

    async def forward(self, stage: int, inputs: torch.Tensor, targets: torch.Tensor | None = None, *,
                      mb: int | None = None, how: How | None = None, chain_to: int | None = None,
                      fused_targets: torch.Tensor | None = None, prefer: str | None = None,
                      back: bool = False, min_step: int | None = None) -> Served[ForwardReply]:
        """A forward through ``stage`` (with ``targets`` on the last stage: its loss too); ``how``: a
        spot check's pair or arbiter (whom to ask, how hard, who pays), else a microbatch's call.

        ``chain_to`` (a microbatch's forward, with ``mb``): peer to peer (issue #31). The request names
        peers of stages ``stage+1 .. chain_to`` (:meth:`_hops`: picked as their own calls would be), so
        the outputs go from peer to peer and the answer holds the last one's outputs, with what each
        answered in ``reply.chain`` (the hops as sent: ``Served.hops``). A chain ends early where a hop
        failed (``reply.hop_error``), and the caller goes on from there as without one. With
        ``fused_targets`` (``chain_to`` the last stage), the chain's last hop is that stage's fused
        forward and backward (``reply.fused``), sent by the peer before it with attempt 0 and a deadline,
        as the caller's own would be; where that hop failed, the caller settles it (a claim) first.
        ``back`` (with ``fused_targets``): the backward chain, each stage's peer running its backward once
        the stages after it ran theirs (``reply.backs``, attempt 0 as the fused hop's); every attempt that
        failed after asking for it may have counted anywhere along its chain (``Served.unsettled``).
        ``prefer``: the peer to ask first (``Served.stopped_at`` of the chain before). ``min_step``: the
        peer, and each hop's, runs it only once it reached that step (a sync step's chain goes out before
        its stages took the step before), and the hops get ``Timing.chain_step_wait_s`` longer for it (a
        call without hops too); a peer on probation, sent none, refuses it at once if it is not there yet
        (``StageBehind`` once all did)."""
        client, codec, model, samples = self.client, self.codec, self.model, inputs.shape[0]

        def send(addr: str, timeout: float) -> Awaitable[ForwardReply]:  # (min_step: refused at once if behind)
            return client.forward(addr, stage, inputs, targets, codec=codec, model=model, mb=mb, timeout_s=timeout,
                                  min_step=min_step)

        def send_waiting(addr: str, timeout: float) -> Awaitable[ForwardReply]:  # a proven peer waits for min_step
            within = timeout + self.timing.chain_step_wait_s
            return client.forward(addr, stage, inputs, targets, codec=codec, model=model, mb=mb, timeout_s=within,
                                  budget_ms=int(within * 1000), min_step=min_step)

        def own(reply: ForwardReply, elapsed: float) -> float:  # what the peer waited for (its step, a hop) is not its
            return max(0.0, elapsed - reply.wait_ms / 1000.0)

        if chain_to is None or chain_to <= stage or mb is None or targets is not None or how is not None:
            # (a spot check's pair is sent as any call is, min_step and budget included: a peer cannot tell it)
            return await self._observed(stage, "forward", samples, send, how=how, prefer=prefer,
                                        send_proven=send_waiting if min_step is not None else None, own_seconds=own)
        sent: dict[str, tuple[tuple[Hop, ...], str | None]] = {}  # addr -> the hops of the request answered there
        # (stage, addr) of failed attempts' backwards that may have counted: their fused hops' (once one failed, no
        # attempt names another), and with the backward chain every peer of their chains'
        unsettled: list[tuple[int, str]] = []

        async def send_chained(addr: str, timeout: float) -> ForwardReply:
            fused = fused_targets is not None and not unsettled
            hops, stopped = self._hops(stage + 1, chain_to, samples, fused=fused, back=back and fused,
                                       wait_s=self.timing.chain_step_wait_s if min_step is not None else 0.0)
            sent[addr] = ((), stopped)
            if not hops:
                return await send(addr, timeout)
            outcome: ForwardReply | None = None
            fusing = fused_targets if hops[-1].deadline_ms is not None else None
            backing = back and fusing is not None
            try:
                budget = timeout + (hops[0].timeout_ms + HOP_MARGIN_MS) / 1000.0
                if backing:  # and this stage's own backward, after the chain's
                    budget += self._backward_s(stage, addr, samples)
                reply = await client.forward(addr, stage, inputs, fusing, codec=codec, model=model, mb=mb, next=hops,
                                             budget_ms=int(budget * 1000), timeout_s=budget, back=backing,
                                             min_step=min_step)
                if (reply.fused is not None) != (len(reply.chain) == len(hops) and fusing is not None):
                    raise PeerError(200, "BadReply", f"{addr} answered a chain without its fused end, or the reverse")
                named = [hop.peer_id for hop in hops[:len(reply.chain)]]
                if len(reply.chain) > len(hops) or [r.peer_id for r in reply.chain] != named:
                    raise PeerError(200, "BadReply", f"{addr} answered for hops it was not sent to")
                if reply.backs and (not backing or reply.fused is None or reply.backs[0].stage < stage
                                    or reply.backs[-1].stage != reply.fused.stage - 1
                                    or (reply.backs[0].grad_inputs is None) != (reply.backs[0].stage == 0)):
                    raise PeerError(200, "BadReply", f"{addr} answered backwards of stages it was not asked for, "
                                                     "or without the input gradient the next one needs")
                outcome = reply
            finally:
                self._settled_hops(hops, samples, outcome, back=backing)
                if outcome is None and backing:
                    unsettled.extend([(stage, addr), *((hop.stage, hop.addr) for hop in hops)])
                elif outcome is None and fusing is not None:
                    unsettled.append((hops[-1].stage, hops[-1].addr))
            sent[addr] = (hops, stopped)
            return outcome

        served = await self._observed(stage, "forward", samples, send, send_proven=send_chained, prefer=prefer,
                                      own_seconds=own)
        hops, stopped = sent.get(served.addr, ((), None))
        return dataclasses.replace(served, hops=hops, unsettled=tuple(unsettled), stopped_at=stopped)

    def _backward_s(self, stage: int, addr: str, samples: int) -> float:
        """How long a backward of ``samples`` at the peer of ``stage`` dialled at ``addr`` may take: its
        own backward call's timeout (the backward chain's part of a chained forward's budget)."""
        router = self.stages.routers[stage]
        peer_id = next((p.peer_id for p in router.snapshot() if p.addr == addr), "")
        return router.timeout_for(peer_id, samples, "backward",
                                  floor_s=self.timing.timeout_floor("backward", self.request_timeout_s))

    def _hops(self, first: int, last: int, samples: int, *, fused: bool = False, back: bool = False,
              wait_s: float = 0.0) -> tuple[tuple[Hop, ...], str | None]:
        """Peers of stages ``first .. last`` for a peer-to-peer forward, each picked as its own call
        would pick it and counted in flight there: the chain stops before a stage whose pick is on
        probation (its calls are watched from here) or relayed (its stage-mates cannot dial it), and
        that pick comes back with the hops (the caller's call of that stage asks it first: a peer the
        chain cannot name is not passed over, and one on probation gets its first calls).
        ``fused``: stage ``last``'s hop is its fused forward and backward, timed as a backward and
        given the deadline the caller's own backward would have. ``back`` (with ``fused``): the backward
        chain, each earlier hop timed as its forward and its backward. ``wait_s``: added once, to the last
        hop's time (and so to every hop's before it, each covering those after): a wait somewhere along the
        chain (``min_step``)."""
        picked: list[tuple[int, str, str, float, int | None, float]] = []
        stopped: str | None = None
        for stage in range(first, last + 1):
            router = self.stages.routers[stage]
            choice = router.choose()
            if choice is None:
                break
            peer_id, addr = choice
            if is_relayed(addr) or not router.stats(peer_id).proven:
                stopped = peer_id
                break
            router.begin(peer_id)
            kind: Kind = "backward" if fused and stage == last else "forward"
            timeout = router.timeout_for(peer_id, samples, kind,
                                         floor_s=self.timing.timeout_floor(kind, self.request_timeout_s))
            deadline = self.timing.backward_deadline_ms(timeout + wait_s) if kind == "backward" else None
            extra = self._backward_s(stage, addr, samples) if back and fused and kind == "forward" else 0.0
            picked.append((stage, addr, peer_id, timeout, deadline, extra))
        if picked:  # a wait along the chain: the last hop's time, and so every hop's before it (covering those after)
            stage, addr, peer_id, timeout, deadline, extra = picked[-1]
            picked[-1] = (stage, addr, peer_id, timeout + wait_s, deadline, extra)
        backed = back and fused and bool(picked) and picked[-1][0] == last  # the backward chain needs the fused end
        hops, rest = [], 0.0
        for stage, addr, peer_id, timeout, deadline, extra in reversed(picked):  # each hop's wait covers those after
            rest += timeout + (extra if backed else 0.0) + (HOP_MARGIN_MS / 1000.0 if rest else 0.0)  # and a margin
            hops.append(Hop(stage=stage, addr=addr, peer_id=peer_id, timeout_ms=max(1, int(rest * 1000)),
                            deadline_ms=deadline))
        return tuple(reversed(hops)), stopped

    def _settled_hops(self, hops: tuple[Hop, ...], samples: int, reply: ForwardReply | None, *,
                      back: bool = False) -> None:
        """A peer-to-peer forward ended (``reply`` None: it failed): the hops that answered are
        reported to their routers, their latency being the wait of the hop before them less their
        own wait on the next; the rest are released, neither banned (a hop that failed another peer
        may well answer this trainer: its stage's own call finds out) nor credited."""
        results = reply.chain if reply is not None else ()
        before_ms = reply.wait_ms if reply is not None else 0
        for i, hop in enumerate(hops):
            router = self.stages.routers[hop.stage]
            if i < len(results) and results[i].peer_id == hop.peer_id:
                own_s = max(0.0, (before_ms - results[i].wait_ms) / 1000.0)
                router.report_success(hop.peer_id, samples, own_s,
                                      "backward" if hop.deadline_ms is not None or back else "forward")
                before_ms = results[i].wait_ms
            else:
                router.release(hop.peer_id)
        if reply is not None:
            self.summary.p2p_hops += len(results)
            self.summary.p2p_fallbacks += int(reply.hop_error is not None)
            self.summary.p2p_backwards += len(reply.backs)

    async def backward(
        self, stage: int, inputs: torch.Tensor | None, *, grad_outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None, step: int | None = None, mb: int | None = None,
        prefer: str | None = None, kept_at: str | None = None, how: How | None = None,
        recover: Callable[[], Awaitable[torch.Tensor]] | None = None, lost_at: Collection[str] = (),
    ) -> Served[BackwardReply]:
        """A backward through ``stage`` (with ``targets`` on the last stage: the fused forward and
        backward), counted exactly once by the stage (``swarmd.pipeline.stage.step_protocol``): the peer
        adds the gradient only within its deadline (past it, this trainer gave up and retries
        elsewhere), and an attempt whose answer was lost is settled by asking its peer before the
        next attempt, which only computes if it counted.

        ``kept_at``: the address of the peer whose forward reply said it ``kept`` the microbatch's
        inputs; a request to that address omits them (issue #30: the boundary carries 2 tensors per
        microbatch, not 3). Should that peer not hold them any more (``InputsNotCached``: restarted,
        evicted), the same request goes again at once with them: one resend, nothing counted twice
        (the refusal came before any compute). Any other peer (a failover, a spot check's) gets them.

        ``inputs`` None (peer to peer: the forward's inputs went from peer to peer, and the trainer never
        saw them): sent to ``kept_at`` without them; should they be needed after all (that peer is not
        usable, or lost them), ``recover()`` computes them again (``swarmd.train.microbatches``).
        ``lost_at``: peer-to-peer chains sent this backward (the last stage's fused call, attempt 0) to
        these addresses and its answer was lost: it is settled there (a claim) before this call's first attempt.
        """
        client, codec, model, timing, s = self.client, self.codec, self.model, self.timing, self.summary
        # an opinion's backward only computes: as a retry whose first attempt another peer counted
        attempts = BackwardAttempts(mb, counted_by="(an opinion)" if how is not None and how.opinion else None)
        if lost_at and mb is not None:
            attempts.next_attempt()  # attempt 0 went out from the peer before it
            attempts.lost.update(dict.fromkeys(lost_at, attempts.sent))
        omit_at = kept_at if mb is not None else None
        held = inputs

        async def with_inputs() -> torch.Tensor:
            nonlocal held
            if held is None:
                if recover is None:
                    raise ValueError("a backward without inputs needs a way to recover them")
                held = await recover()
                s.inputs_recovered += 1
            return held

        async def send(addr: str, timeout: float) -> BackwardReply:
            nonlocal omit_at
            await self._settle_lost(stage, attempts)
            omit = addr == omit_at and not attempts.compute_only  # a verify-only retry: its entry is spent

            def request(x: torch.Tensor | None) -> Awaitable[BackwardReply]:
                return client.backward(addr, stage, x, grad_outputs, targets,
                                       codec=codec, model=model, step=step, mb=mb, attempt=attempts.next_attempt(),
                                       verify=attempts.compute_only, deadline_ms=timing.backward_deadline_ms(timeout),
                                       timeout_s=timeout)

            try:
                if not omit:
                    return await request(await with_inputs())
                s.inputs_omitted += 1
                try:
                    return await request(None)
                except InputsNotCached:  # refused before computing: resend with the inputs, once
                    omit_at = None
                    s.inputs_resent += 1
                    return await request(await with_inputs())
            except PeerError as exc:
                attempts.failed(addr, exc)
                raise

        samples = (inputs if inputs is not None else grad_outputs if grad_outputs is not None else targets)
        if samples is None:
            raise ValueError("a backward needs its inputs, its grad_outputs or its targets")
        return await self._observed(stage, "backward", samples.shape[0], send, prefer=prefer, how=how)

    async def _observed(self, stage: int, kind: Kind, samples: int, send: Send[R], *,
                       prefer: str | None = None, how: How | None = None, send_proven: Send[R] | None = None,
                       own_seconds: Callable[[R, float], float] | None = None) -> Served[R]:
        """A microbatch's call, told to the observers (``CallDone``: from the first request to the
        answer, retries and waits for a usable peer included); a check's (``how``) is not."""
        if how is not None and how.tally is not None:
            return await self.call(stage, kind, samples, send, patience=how.patience, tally=how.tally,
                                   prefer=prefer if how.only is None else None, only=how.only, exclude=how.exclude,
                                   taken=how.taken, send_proven=send_proven, own_seconds=own_seconds)
        began = time.perf_counter()
        served = await self.call(stage, kind, samples, send, prefer=prefer, patience=how.patience if how else None,
                                 exclude=how.exclude if how else (), taken=how.taken if how else None,
                                 send_proven=send_proven, own_seconds=own_seconds)
        if self._emit is not None:
            self._emit(CallDone(stage=stage, kind=kind, samples=samples, peer_id=served.peer_id,
                                attempts=served.attempts, started=began, ended=time.perf_counter()))
        return served

    async def _settle_lost(self, stage: int, attempts: BackwardAttempts) -> None:
        """Ask each peer whose attempt at this backward failed without an answer whether it counted
        the microbatch (``POST /v1/claim``): if one did, the next attempts only compute; if not, it
        has fenced the lost attempt off. A peer that cannot be asked is noted, and the retry counts."""
        mb = attempts.mb
        if mb is None:
            return
        s = self.summary
        for addr, fence in attempts.to_settle():
            s.claims += 1
            try:
                reply = await self.client.claim(addr, ClaimRequest(stage=stage, mb=mb, attempt=fence),
                                                timeout_s=self.timing.claim_timeout_s)
            except PeerError as exc:
                s.claims_unanswered += 1
                attempts.settled(addr, None)
                log.warning("stage %d: a backward's answer from %s was lost and that peer cannot say whether it "
                            "counted it (%s); retrying it as a new count (a repeat is detected at averaging)",
                            stage, addr, exc)
                continue
            s.claims_counted += int(reply.counted)
            attempts.settled(addr, reply.counted)
