"""A member's side of one chunked all-reduce round (the state diagram is in
``swarmd.pipeline.averaging.allreduce.averager``): scatter its parts, fetch every part mean, wait for the one
decision (deciding it, on the coordinator), then apply or restore."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Any, Protocol

import torch

from swarmd.dht.identity import Identity, peer_id_of, verify
from swarmd.errors import Busy, PeerError, SwarmdError
from swarmd.net.client import DataPlaneClient
from swarmd.net.wire import WireTensor
from swarmd.pipeline.averaging.allreduce.audit import SUSPECT_BELOW, SUSPECT_WAIT_S, against_own
from swarmd.pipeline.averaging.allreduce.auditor import PartAuditor
from swarmd.pipeline.averaging.allreduce.coordinator import Coordinator, CoordRound
from swarmd.pipeline.averaging.allreduce.messages import ArAck, ArDecisionReply, ArPart, ArQuery, ArReady, read_mean
from swarmd.pipeline.averaging.allreduce.openings import ArAwaited, open_contribution, opening_codec, round_digest
from swarmd.pipeline.averaging.allreduce.owner import PartOwner, PartStrikes
from swarmd.pipeline.averaging.allreduce.plan import Decision, RoundPlan, claim_digest, part_digest, part_message
from swarmd.pipeline.averaging.allreduce.recompute import InputsKept
from swarmd.pipeline.averaging.allreduce.sent_parts import received_slice
from swarmd.pipeline.averaging.averager import RoundResult, _wire_codec
from swarmd.pipeline.averaging.patience import RoundPatience
from swarmd.pipeline.averaging.reduction import HOSTILE_EXCLUSION_S
from swarmd.pipeline.averaging.round import _encoded_once
from swarmd.pipeline.averaging.trust.accusations import (
    NORM_TOLERANCE,
    SECOND_CLAIMS,
    Claim,
    OwnNorms,
    StruckClaims,
    contribution_message,
)
from swarmd.pipeline.averaging.trust.contribution_proofs import opened_microbatches, proof_seed, sketch_pieces
from swarmd.pipeline.averaging.trust.hostile_contributions import HostileWatch, Score, combine_terms
from swarmd.pipeline.averaging.trust.recomputation import inputs_digest
from swarmd.pipeline.averaging.trust.refusals import Refusal
from swarmd.pipeline.averaging.trust.round_checks import (
    Suspicions,
    Used,
    check_answer,
    per_sample_norm,
    tensor_digest,
    whole_norms,
    whole_outliers,
)
from swarmd.pipeline.failures import refused_connection
from swarmd.pipeline.stage.executor import Contribution, StageExecutor
from swarmd.tasks import wait_event

log = logging.getLogger(__name__)

Part = tuple[torch.Tensor, list[Any]]  # a part mean (decoded float32) and its used list (wire form)


class RoundHost(Protocol):
    """What a member's round uses of the peer's averager (``AllReduceAverager`` is one): its stage,
    identity and client, the round's coordinator and part owners, and its books of rounds."""

    executor: StageExecutor
    peer_id: str
    identity: Identity | None
    client: DataPlaneClient
    coord: Coordinator
    owners: dict[tuple[str, int], PartOwner]
    control_requests: Counter[str]
    unreachable: dict[str, float]  # part owners found gone, until when its coordinator plans without them
    codecs_sent: Counter[str]
    commit_grace_s: float
    reply_slack_s: float
    rounds_ok: int
    rounds_aborted: int
    on_behind: Callable[[int], Awaitable[None]] | None
    suspicions: Suspicions
    patience: RoundPatience
    hostile: HostileWatch
    struck_claims: StruckClaims
    own_norms: OwnNorms
    contributions_refused: Counter[str]
    accusations: Counter[str]
    part_strikes: PartStrikes
    own_slices_struck: int
    auditor: PartAuditor
    inputs_kept: InputsKept

    @property
    def target(self) -> int: ...

    def convicts(self) -> bool: ...

    def _recomputes(self) -> bool: ...

    def _to_send(self, own: Contribution, plan: RoundPlan) -> Contribution: ...

    def convict_members(self, convicted: dict[str, str], step: int, *, struck: int) -> None: ...

    def await_openings(self, awaited: dict[str, ArAwaited]) -> None: ...

    def _take_opening_convictions(self) -> dict[str, str]: ...

    def _opened(self, leader: str, opened: tuple[bytes | None, float]) -> None: ...

    def count_repeats(self, step: int, groups: list[Collection[int]]) -> None: ...

    def _refuse_contributor(self, peer_id: str, why: Refusal, step: int) -> None: ...

    async def quorum_lost(self, members: Iterable[str]) -> str | None: ...

    def drop_silent(self, peer_ids: Iterable[str], step: int, addrs: dict[str, str]) -> None: ...

    def sign_decision(self, decision: Decision) -> bytes | None: ...

    def _record(self, result: RoundResult, leader: str, missing: list[str], *, status: str | None = None,
                reason: str | None = None, refused: dict[str, str] | None = None,
                started: float | None = None, clipped: tuple[str, ...] = (), struck: tuple[str, ...] = (),
                convicted: dict[str, str] | None = None) -> None: ...


class MemberRound:
    """One round, on one member (``rnd``: this peer's coordinator state when it coordinates)."""

    def __init__(self, av: RoundHost, plan: RoundPlan, rnd: CoordRound | None) -> None:
        self.av = av
        self.plan = plan
        self.rnd = rnd
        self.started = time.monotonic()
        self.fetched: dict[int, Part] = {}  # as fetched, not yet checked against a decision
        self.parts: dict[int, Part] = {}  # checked against the commit's digests: served to other members
        self.mine: dict[int, tuple[Used, torch.Tensor | None]] = {}  # this member's part j as its owner sees it
        self.lossy = False  # a part of this member's went with a lossy codec (error feedback keeps the residual)
        self.decision: Decision | None = None
        self.decision_sig: bytes | None = None
        self.decision_pk: bytes | None = None
        # its coordinator refused this member's request for the decision (no process listens there): no
        # decision can reach it from the coordinator any more, only from a member that holds one
        self.cut_off = False
        self.settled = asyncio.Event()  # set once it holds the decision or is cut off (``answer_decision``)
        self.claim_digest = ""  # this member's signed claim of its contribution (``_scatter``)
        self.codecs: list[str] = []  # the codec each part went with (its own: none)
        self.claim_norm = 0.0
        # (last stage) the digests of its microbatches' inputs it committed with part 0, in its opening's order,
        # and the parameters' digest and precision they ran at (``recompute``)
        self.ins: tuple[tuple[int, str], ...] = ()
        self.at: tuple[str, str] | None = None
        # parts whose committed mean points against this member's own slice (``audit.SUSPECT_BELOW``): audited
        self.suspected: list[tuple[int, float]] = []

    @property
    def deadline(self) -> float:
        return self.started + self.plan.timeout_s

    def _left(self, slack: float = 0.0) -> float:
        return max(0.0, self.deadline + slack - time.monotonic())

    async def run(self) -> None:
        av, plan = self.av, self.plan
        ex = av.executor
        try:
            own: Contribution | None = await ex.take_contribution()
        except Busy:  # already out: this member sends nothing, its owners report it missing, the round aborts
            own = None
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._settle_part(j)) for j in plan.parts_of(av.peer_id)]
        fetches = {j: loop.create_task(self._fetch(j)) for j in range(len(plan.owners))}
        try:
            if own is not None:
                await self._scatter(own)
            if self.rnd is not None:
                await self._decide(self.rnd, fetches)
            else:
                await self._await_decision()
            await self._finish(own, fetches)
        except BaseException:
            if own is not None and ex.averaging:
                await asyncio.shield(ex.restore_contribution(own))
            raise
        finally:
            for t in [*tasks, *fetches.values()]:
                t.cancel()
            await asyncio.gather(*tasks, *fetches.values(), return_exceptions=True)
            self._release_parts()

    def _release_parts(self) -> None:
        """This peer's parts of the round, which is over for it: what an audit needs kept past ``KEEP_ROUNDS``
        more rounds only where the commit drew one of them (the members' signed frames were held for the last 16
        rounds once: as much memory again as the gradients of each)."""
        av, plan = self.av, self.plan
        d = self.decision
        drawn = av.auditor.drawn(plan, d, self.decision_sig) if d is not None else None
        for j in plan.parts_of(av.peer_id):
            owner = av.owners.get((plan.round_id, j))
            if owner is None or owner.ready is None:
                continue
            if drawn is not None and drawn[0] == j:
                av.auditor.keep(owner)  # (past the round, and on disk: an audit of it may take several commits)
            elif d is not None:  # kept a few rounds more: a member that suspects the part audits it (``KEEP_ROUNDS``)
                av.auditor.release_later(owner)
            # (without the decision this peer cannot tell whether the commit drew its part: it keeps the frames
            # while it holds the round; an owner that cannot show a drawn part's evidence is held to account)

    # ---- scatter -------------------------------------------------------------------------

    async def _scatter(self, own: Contribution) -> None:
        av, plan = self.av, self.plan
        ex = av.executor
        sent = av._to_send(own, plan)  # what it reduces and sends to the other owners (tests make it lie)
        codecs: dict[int, str] = {}
        wires: dict[int, WireTensor] = {}  # each lossy part as encoded once: decoded here, and sent

        async def prepare(j: int) -> None:
            lo, hi = plan.bounds[j]
            owner = plan.owners[j]
            if owner == av.peer_id:  # its own part, reduced here, as a leader's own contribution is
                piece = sent.grads[lo:hi] if sent.grads is not None else None
                digest, norm = await asyncio.to_thread(
                    lambda: (tensor_digest(piece), per_sample_norm(piece, own.samples)))
                self.mine[j] = (Used(av.peer_id, own.samples, digest, norm), piece)
                return
            piece = sent.grads[lo:hi] if sent.grads is not None else None
            codec = ("none" if piece is None
                     else _wire_codec(piece, ex.training.grad_codec, av.client.links, plan.addr(owner)))
            if piece is not None:
                av.codecs_sent[codec] += 1
                self.lossy = self.lossy or codec != "none"
            codecs[j] = codec
            def encoded() -> tuple[torch.Tensor | None, str, WireTensor | None, float]:
                decoded, digest, wire = _encoded_once(piece, codec)
                return decoded, digest, wire, per_sample_norm(decoded, own.samples)

            decoded, digest, wire, norm = await asyncio.to_thread(encoded)
            if wire is not None:
                wires[j] = wire
            self.mine[j] = (Used(av.peer_id, own.samples, digest, norm), decoded)

        await asyncio.gather(*(prepare(j) for j in range(len(plan.owners))))
        self.codecs = [codecs.get(j, "none") for j in range(len(plan.owners))]
        # the signed claim of the whole contribution, for the coordinator's evidence should it convict this member
        # (``accusations``): its per-sample norm, and the parts' digests as their owners decode them
        self.claim_digest = claim_digest([self.mine[j][0].digest for j in range(len(plan.owners))])
        self.claim_norm = math.sqrt(sum(self.mine[j][0].norm ** 2 for j in range(len(plan.owners))))
        av.own_norms.note(plan.step, plan.coordinator, self.claim_norm, own.samples)  # to second accusations with
        # (last stage) its samples no microbatch of its explains: those not in the microbatches whose inputs it
        # kept (handed in; all of them when it kept none): its coordinator bounds its opening's extra by it
        unexplained = (max(0, own.samples - sum(i.inputs.shape[0] for i in own.inputs))
                       if own.parts and own.grads is not None else None)
        await self._commit_inputs(own)
        claim_sig = None
        if av.identity is not None and own.samples > 0:
            claim_sig = av.identity.sign(contribution_message(ex.stage, plan.step, own.samples, self.claim_digest,
                                                              av.peer_id, plan.coordinator, self.claim_norm))

        async def send(j: int) -> None:
            owner = plan.owners[j]
            used, decoded = self.mine[j]
            claim = (self.claim_norm, claim_sig) if j == 0 and claim_sig is not None else (None, None)
            if owner == av.peer_id:
                key = av.identity.public_key_bytes if av.identity is not None and j == 0 else None
                own_frame = None  # (its own slice as a signed part frame, as any member's: what an audit is shown)
                if av.identity is not None:
                    own_sig = av.identity.sign(part_message(ex.stage, plan.round_id, j, own.samples, used.digest,
                                                            av.peer_id, owner))
                    mine = ArPart(ex.stage, plan.round_id, j, av.peer_id, own.samples, decoded, used.digest, "none",
                                  av.identity.public_key_bytes, own_sig)
                    own_frame = await asyncio.to_thread(mine.encode)
                why = av.owners[(plan.round_id, j)].add(
                    av.peer_id, own.samples, decoded, used.digest, mbs=own.mbs if j == 0 else (),
                    claim=(key, self.claim_norm, claim_sig) if key is not None and claim_sig is not None else None,
                    unexplained=unexplained if j == 0 else None, frame=own_frame, ins=self.ins if j == 0 else ())
                if why is not None:
                    log.warning("stage %d: own part %d refused by itself (%s)", ex.stage, j, why)
                return
            lo, hi = plan.bounds[j]
            piece = sent.grads[lo:hi] if sent.grads is not None else None
            codec, digest = codecs[j], used.digest
            key = sig = None
            if av.identity is not None:
                key = av.identity.public_key_bytes
                sig = av.identity.sign(part_message(ex.stage, plan.round_id, j, own.samples, digest, av.peer_id, owner))
            req = ArPart(ex.stage, plan.round_id, j, av.peer_id, own.samples, piece, digest, codec, key, sig,
                         own.mbs if j == 0 else (), claim_norm=claim[0], claim_sig=claim[1],
                         unexplained=unexplained if j == 0 else None, wire=wires.get(j),
                         ins=self.ins if j == 0 else ())
            try:
                frame = await av.client.allreduce(plan.addr(owner), "part", req.encode,
                                                  0 if piece is None else piece.numel() * 4,
                                                  timeout_s=self._left(1.0) + 1.0)
                ack = ArAck.from_frame(frame)
                if not ack.ok:
                    log.info("stage %d: owner %s turned part %d away (%s)", ex.stage, owner[:12], j, ack.reason)
            except (PeerError, SwarmdError) as exc:  # its owner reports this member missing: the round aborts
                log.info("stage %d: part %d did not reach owner %s (%s)", ex.stage, j, owner[:12], exc)

        await asyncio.gather(*(send(j) for j in range(len(plan.owners))))

    async def _commit_inputs(self, own: Contribution) -> None:
        """(Last stage, a member of another's round) the digests of its microbatches' inputs, to commit with part 0
        before the commit fixes its opening's projection; the inputs kept for its coordinator to draw one of
        (``recompute``). None when it lacks one of them: its opening is ``uncommitted`` and its next contribution
        struck (``openings``)."""
        av, plan, ex = self.av, self.plan, self.av.executor
        if (not av._recomputes() or plan.coordinator == av.peer_id or own.grads is None or not own.parts
                or not own.inputs):
            return
        mbs = opened_microbatches(own.parts)
        kept = {i.mb: i for i in own.inputs}
        if not mbs or not set(mbs) <= set(kept):
            return
        self.at = (ex.digest, ex.precision)
        self.ins = await asyncio.to_thread(
            lambda: tuple((mb, inputs_digest(mb, kept[mb].inputs, kept[mb].targets)) for mb in mbs))
        av.inputs_kept.keep_round(plan.round_id, [kept[mb] for mb in mbs])

    async def _settle_part(self, j: int) -> None:
        av, plan = self.av, self.plan
        owner = av.owners[(plan.round_id, j)]
        # the members' parts are waited for as long as the plan's patience, then the silent ones are dropped
        ready = await owner.settle(min(self._left(), self.started + plan.wait_s - time.monotonic()))
        if av.peer_id in owner.struck and av.peer_id not in plan.struck:  # its own slice, against the part's median
            av.own_slices_struck += 1
            log.warning("stage %d step %d: part %d left this peer's own slice out (far from or against the "
                        "part's median): its gradients disagree with its stage's", av.executor.stage, plan.step, j)
        key = sig = None
        if av.identity is not None:  # (signed also by a coordinator to itself: what an audit of this part is shown)
            key, sig = av.identity.public_key_bytes, av.identity.sign(ready.message(av.executor.stage))
            owner.ready_signed = (key, sig)
        if self.rnd is not None:
            av.coord.on_ready(ready)
            return
        req = ArReady(av.executor.stage, ready, key, sig)
        av.control_requests["ready"] += 1
        try:
            await av.client.allreduce(plan.addr(plan.coordinator), "ready", req.encode, timeout_s=POLL_S)
        except PeerError as exc:
            log.info("stage %d: coordinator did not take part %d's ready report (%s)", av.executor.stage, j, exc)

    async def _fetch(self, j: int, addr: str | None = None, wait_s: float | None = None) -> Part | None:
        """Part ``j``'s mean from its owner (or from ``addr``), long-polled until it is reduced."""
        av, plan = self.av, self.plan
        lo, hi = plan.bounds[j]
        if addr is None and plan.owners[j] == av.peer_id:
            owner = av.owners[(plan.round_id, j)]
            if await owner.mean_bytes(self._left(1.0)) is None or owner.mean is None:
                return None
            self.fetched[j] = (owner.mean, owner.used)
            return self.fetched[j]
        wait = min(60.0, self._left(1.0) if wait_s is None else wait_s)
        q = ArQuery(av.executor.stage, plan.round_id, j, wait)
        try:
            frame = await av.client.allreduce(addr or plan.addr(plan.owners[j]), "mean", q.encode,
                                              timeout_s=wait + POLL_S)
            if frame.kind == ArAck.KIND:
                return None
            got = await asyncio.to_thread(read_mean, frame, plan.round_id, j, hi - lo)  # (its finite check: torch)
        except (PeerError, SwarmdError) as exc:
            log.info("stage %d: part %d's mean not fetched (%s)", av.executor.stage, j, exc)
            return None
        if addr is None:
            self.fetched[j] = got
        return got

    # ---- the decision --------------------------------------------------------------------

    async def _decide(self, rnd: CoordRound, fetches: dict[int, asyncio.Task[Part | None]]) -> None:
        """The coordinator's one decision: collect readies, verify every part by fetching it, decide."""
        av, plan = self.av, self.plan
        # owners heard of the round after this coordinator did: their deadlines are a little later
        await self._collect(rnd, self._left(min(POLL_S, self.plan.timeout_s / 2)), fetches)
        decision = av.coord.decide(rnd, av.target)
        if decision.status == "commit":
            # every member left sent its parts to this round and to no other (a member is in one round at a
            # time; the dropped ones sent none in time): a quorum of the stage as counted now means no disjoint
            # round can commit at this step as well
            why = await av.quorum_lost(set(plan.member_ids) - set(decision.dropped))
            if why is not None:
                log.warning("stage %d step %d: round %s aborted: no quorum (%s)", plan.stage, plan.step,
                            plan.round_id, why)
                decision = Decision(plan.round_id, plan.stage, plan.step, "abort", 0, (), plan.coordinator,
                                    f"no quorum: {why}")
        if decision.status == "commit":
            await asyncio.wait(list(fetches.values()), timeout=self._left(1.0) + 1.0)
            for j, digest in enumerate(decision.digests):
                got = self.fetched.get(j)
                if got is None or await asyncio.to_thread(part_digest, got[0], got[1]) != digest:
                    decision = Decision(plan.round_id, plan.stage, plan.step, "abort", 0, (), plan.coordinator,
                                        f"part {j} could not be fetched and verified by the coordinator")
                    break
                self.parts[j] = got
        late = time.monotonic() - self.deadline
        if decision.status == "commit" and late > av.commit_grace_s:
            log.warning("stage %d step %d: this coordinator is %.1fs past the round's deadline (it was frozen?); "
                        "the round is aborted", plan.stage, plan.step, late)
            decision = Decision(plan.round_id, plan.stage, plan.step, "abort", 0, (), plan.coordinator, "late")
        convicted: dict[str, str] = {}
        claimed: dict[str, ArAwaited] = {}
        if decision.status == "commit":  # the owners' scores, summed: strike, and convict on the last stage
            decision, convicted, claimed = await asyncio.to_thread(self._judge, rnd, decision)
        if decision.dropped:  # members whose parts no owner (on a commit), or some owner, had at the patience
            av.drop_silent(decision.dropped, plan.step, dict(plan.members))
        if decision.status == "commit":  # how long honest parts took, as this owner saw them (patience)
            for j in plan.parts_of(av.peer_id):
                owner = av.owners.get((plan.round_id, j))
                if owner is not None:
                    av.patience.observe({pid: t for pid, t in owner.arrived.items() if pid != av.peer_id})
                    break
        sig = av.sign_decision(decision)
        self.decision, self.decision_sig = decision, sig
        self.decision_pk = av.identity.public_key_bytes if av.identity is not None else None
        self.settled.set()
        av.coord.settle(rnd, decision, sig)
        if decision.status == "commit":
            av.convict_members(convicted, plan.step, struck=len(decision.struck))
            av.await_openings({pid: c for pid, c in claimed.items() if pid not in convicted})

    async def _collect(self, rnd: CoordRound, wait_s: float, fetches: dict[int, asyncio.Task[Part | None]]) -> None:
        """The owners' ready reports, at most ``wait_s``; cut short when an owner still missing is gone (its
        address refuses connections: no process can report that part any more, so the round aborts either
        way). Waiting out the deadline for a SIGKILLed owner held the stage ~7 s in the chaos run.

        Only an owner whose part's mean this coordinator no longer long-polls is asked whether it is gone: an
        open request to it (``fetches``) says its process lives (a SIGKILL closes the connection, which ends
        the fetch at once). Asking every missing owner every ``OWNER_CHECK_S`` cost 2n control requests a
        round at 16 peers (``scripts/bench_averaging.py``), each owner's ready being a few seconds away."""
        av, plan = self.av, self.plan
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            await av.coord.collect(rnd, min(left, OWNER_CHECK_S))
            if time.monotonic() >= deadline or len(rnd.readies) == len(plan.owners) or any(
                    r.missing or r.refused for r in rnd.readies.values()):
                return
            missing = sorted({plan.owners[j] for j in range(len(plan.owners))
                              if j not in rnd.readies and (j not in fetches or fetches[j].done())} - {av.peer_id})
            if not missing:
                continue

            async def gone(pid: str) -> bool:
                av.control_requests["progress"] += 1
                try:
                    await av.client.progress(plan.addr(pid), timeout_s=OWNER_CHECK_S)
                except PeerError as exc:
                    return refused_connection(exc)
                return False

            found = [pid for pid, g in zip(missing, await asyncio.gather(*(gone(pid) for pid in missing)),
                                           strict=True) if g]
            if found:
                log.info("stage %d step %d: part owner(s) %s of round %s are gone; aborting it now", plan.stage,
                         plan.step, ", ".join(pid[:12] for pid in found), plan.round_id)
                until = time.monotonic() + UNREACHABLE_S
                av.unreachable.update(dict.fromkeys(found, until))  # left out of the next plans meanwhile
                return

    def _judge(self, rnd: CoordRound, decision: Decision) -> tuple[Decision, dict[str, str], dict[str, ArAwaited]]:
        """The coordinator's scores of a committed round (off the loop): each member's
        ``hostile_contributions`` score summed over the owners' reports; those that strike are named in the
        decision with those the plan struck (they owed an opening: ``openings``), and on the last stage
        (``convicts``) the watch convicts repeat offenders, far ones only, with their signed claims as the
        evidence (``accusations``). The decision to sign, who it convicts, and the openings this coordinator
        then awaits (``openings``: of the members whose claims it kept)."""
        av, plan = self.av, self.plan
        left = set(plan.member_ids) - set(decision.dropped)
        scores = {pid: sc for pid, sc in combine_terms(dict(r.scores) for r in rnd.readies.values()).items()
                  if pid in left and pid != av.peer_id}
        struck = tuple(sorted({pid for pid, sc in scores.items() if sc.strike() is not None}
                              | (set(plan.struck) & left)))
        if scores:
            log.debug("stage %d step %d: contribution scores %s", plan.stage, plan.step,
                      {pid[:8]: (round(sc.far, 2), round(sc.cos, 3)) for pid, sc in scores.items()})
        convicted: dict[str, str] = {}
        claims: dict[str, tuple[bytes, Claim]] = {}
        if av.convicts():
            claims = self._claims(decision)
            for pid, sc in sorted(scores.items()):
                claim = claims.get(pid)
                if claim is not None:
                    av.struck_claims.note(pid, claim[0], claim[1], far=sc.far_strike() is not None)
            convicted = av.hostile.observe(scores)
        out = dataclasses.replace(decision, struck=struck, convicted=tuple(sorted(convicted.items())))
        owner0 = av.owners.get((plan.round_id, 0)) if plan.owners[0] == av.peer_id else None
        checks = owner0 is not None and not av.executor.training.delay_updates  # (the leader's: nothing shipped)
        snap = av.executor.progress_snapshot  # (its parameters of the round's step: the commit is not applied yet)
        recomputes = checks and av._recomputes() and snap.step == plan.step
        lead, params = round_digest(decision.digests), snap.digest
        owners = tuple((o, plan.addr(o)) for o in plan.owners)
        awaited = {pid: ArAwaited(plan.step, c.digest,
                                  frozenset(owner0.mbs.get(pid, ())) if checks and owner0 is not None else None,
                                  owner0.unexplained.get(pid) if checks and owner0 is not None else None,
                                  ins=owner0.ins.get(pid, ()) if recomputes and owner0 is not None else None,
                                  lead=lead, params=params if recomputes else "", addr=plan.addr(pid),
                                  round_id=plan.round_id, bounds=plan.bounds, owners=owners,
                                  own_part=0 if owner0 is not None else None,
                                  own_sketch=self._own_part_sketch(pid, c.digest, lead) if owner0 is not None else None,
                                  own_frame=owner0.frames.get(pid) if owner0 is not None else None)
                   for pid, (_, c) in claims.items() if pid != av.peer_id}
        return out, convicted, awaited

    def _own_part_sketch(self, pid: str, claim: str, lead: str) -> tuple[float, ...] | None:
        """(Off the loop) the coordinator's sketch of ``pid``'s slice of part 0, which it owns, as decoded here,
        under the seed of ``pid``'s opening (``sent_parts``); None when it holds no such slice."""
        av, plan = self.av, self.plan
        owner0 = av.owners.get((plan.round_id, 0))
        piece = received_slice(owner0, pid) if owner0 is not None else None
        if piece is None:
            return None
        seed = proof_seed(plan.stage, plan.step, av.peer_id, lead, claim)
        row = sketch_pieces([(plan.bounds[0][0], piece)], seed, av.executor.grad_numel)[0]
        return tuple(float(x) for x in row.tolist())

    def _claims(self, decision: Decision) -> dict[str, tuple[bytes, Claim]]:
        """The members' signed claims of their contributions (kept by part 0's owner, when it is this
        coordinator) that match the parts the owners reduced: the digest of their parts' digests and the
        norm of their parts' norms, as the parts' used lists give them."""
        av, plan = self.av, self.plan
        owner0 = av.owners.get((plan.round_id, 0)) if plan.owners[0] == av.peer_id else None
        if owner0 is None or not owner0.claims or len(self.parts) != len(plan.owners):
            return {}
        lists: list[dict[str, Used]] = []
        for j in range(len(plan.owners)):
            try:
                lists.append({u.peer_id: u for u in (Used.from_wire(w) for w in self.parts[j][1])})
            except ValueError:
                return {}
        out = {}
        for pid, (key, norm, sig) in sorted(owner0.claims.items()):
            entries = [used.get(pid) for used in lists]
            if any(e is None for e in entries) or peer_id_of(key) != pid:
                continue
            digest = claim_digest([e.digest for e in entries if e is not None])
            whole = math.sqrt(sum(e.norm ** 2 for e in entries if e is not None))
            samples = entries[0].samples if entries[0] is not None else 0
            if not math.isclose(norm, whole, rel_tol=NORM_TOLERANCE, abs_tol=1e-30) or not verify(
                    key, contribution_message(plan.stage, plan.step, samples, digest, pid, av.peer_id, norm), sig):
                av.contributions_refused["bad_norm"] += 1  # not evidence: its claim is not what it sent
                log.info("stage %d step %d: %s's signed claim does not match its parts; not kept as evidence",
                         plan.stage, plan.step, pid[:12])
                continue
            out[pid] = (key, Claim(plan.step, samples, digest, norm, sig))
        return out

    async def _await_decision(self) -> None:
        """The coordinator's decision, long-polled; while it cannot be asked (gone, overloaded), asked of
        the other members (it is signed: any copy will do). Given up once the coordinator can no longer
        commit (it commits within ``commit_grace_s`` of its deadline, earlier than this member's
        ``reply_slack_s``): a member that restored its gradients while a commit was still possible
        would stay behind holding samples the others stepped on; or, sooner, once no decision can reach
        it any more (:meth:`_nobody_holds_it`: the coordinator is gone and no live member holds one).

        A coordinator that moved to another stage says it is cut off from the round (its averager of this
        stage was stopped before it served the other): the same as gone. A migrating coordinator held its
        members for ``T + reply_slack_s`` (40 s in test_migration's heal test) before that.

        A SIGKILLed coordinator refuses connections from then on. Waiting out ``T + reply_slack_s`` for it
        stalled the stage by ~35 s in the chaos run (a leader's contributors give up on a dead leader at
        once): the wait only ever served to hear of a decision it sent before it died, and only members
        can hold one of those, so this member asks them and is done once each live one says it holds none
        and can get none (``cut_off``)."""
        av, plan = self.av, self.plan
        coordinator = plan.addr(plan.coordinator)
        while self.decision is None and self._left(av.reply_slack_s) > 0:
            av.control_requests["decision"] += 1
            try:
                decision, gone = await self._ask_decision_of(coordinator, min(60.0, self._left(av.reply_slack_s)))
                if decision is not None:
                    return
                if not gone:
                    continue
            except PeerError as exc:
                gone = refused_connection(exc)
            if gone and not self.cut_off:
                self.cut_off = True
                self.settled.set()
            if await self._nobody_holds_it():
                return
            await asyncio.sleep(min(1.0, self._left(av.reply_slack_s)))

    async def _nobody_holds_it(self) -> bool:
        """Ask the other members for the decision (in parallel); True when this member waits no longer:
        one held it (taken), or this member is cut off and so is every other live one, none holding it.

        Why that is final: a decision comes only from the coordinator, through a member's request for it;
        once its address refused a connection no new request reaches it (no process listens: SIGKILLed,
        or its listener closed for good), so the members that will ever hold it are those that got it
        through a request already open. A member answers ``cut_off`` only after its own request ended in
        a refusal (any decision that request carried was read first), or when it never heard of the
        round (it has no request open). A member whose address refuses connections is gone too (what
        it applied, if anything, went with it: as in the wait this replaces, which asked the same
        members and found nobody). A member that times out or answers without ``cut_off`` may still
        get or hold one: waited for, as before. A lying member can only end the wait early with the
        outcome the full wait had: this member restores while whoever applied stays applied."""
        av, plan = self.av, self.plan
        others = [addr for pid, addr in plan.members if pid not in (av.peer_id, plan.coordinator)]
        wait = CUT_OFF_WAIT_S if self.cut_off else 0.0  # (a mate cut off a moment later says so meanwhile)

        async def ask(addr: str) -> bool:
            """Whether the member at ``addr`` is gone or cut off without a decision."""
            av.control_requests["decision"] += 1
            try:
                _, cut_off = await self._ask_decision_of(addr, wait)
            except PeerError as exc:
                return refused_connection(exc)
            return cut_off

        final = await asyncio.gather(*(ask(addr) for addr in others))
        if self.decision is not None:
            return True
        if self.cut_off and all(final):
            log.info("stage %d step %d: coordinator %s of round %s is gone and no live member holds its decision; "
                     "restoring this peer's gradients", plan.stage, plan.step, plan.coordinator[:12], plan.round_id)
            return True
        return False

    async def answer_decision(self, wait_s: float) -> None:
        """Until this member holds the decision or is cut off, at most ``wait_s`` (a member asking whether
        any decision can still come: :meth:`_nobody_holds_it`)."""
        await wait_event(self.settled, wait_s)

    async def _ask_decision_of(self, addr: str, wait: float) -> tuple[Decision | None, bool]:
        """The decision as the peer at ``addr`` holds it (taken, when this member has none yet and it is
        signed by the coordinator), and whether that peer said it is cut off without one."""
        av, plan = self.av, self.plan
        q = ArQuery(av.executor.stage, plan.round_id, 0, wait)
        frame = await av.client.allreduce(addr, "decision", q.encode, timeout_s=wait + POLL_S)
        try:
            reply = ArDecisionReply.from_frame(frame)
        except SwarmdError as exc:
            raise PeerError(200, "BadReply", str(exc)) from exc
        d = reply.decision
        if d is None or d.round_id != plan.round_id or d.coordinator != plan.coordinator or d.step != plan.step \
                or (d.status == "commit" and len(d.digests) != len(plan.owners)):
            return None, reply.cut_off and d is None
        if av.identity is not None and not (
                reply.public_key is not None and reply.signature is not None
                and peer_id_of(reply.public_key) == plan.coordinator
                and verify(reply.public_key, d.message(), reply.signature)):
            return None, False
        if self.decision is None:
            self.decision, self.decision_sig, self.decision_pk = d, reply.signature, reply.public_key
            self.settled.set()
        return self.decision, False

    # ---- apply or restore ----------------------------------------------------------------

    async def _finish(self, own: Contribution | None, fetches: dict[int, asyncio.Task[Part | None]]) -> None:
        av, plan = self.av, self.plan
        ex = av.executor
        d = self.decision
        for pid, bad in (d.refused if d is not None else ()):
            if pid != av.peer_id:
                av._refuse_contributor(pid, Refusal.from_wire(bad), plan.step)
        if d is None or d.status != "commit":
            if own is not None:
                await ex.restore_contribution(own)
            av.rounds_aborted += 1
            reason = d.reason if d is not None else "no decision reached this member"
            av._record(RoundResult("aborted", plan.step, 0, len(plan.members), None), plan.coordinator,
                       missing=list(d.dropped) if d is not None else [], reason=reason, started=self.started)
            return
        if av.peer_id in d.dropped:  # committed without this member's parts (they came too late, or never)
            if own is not None and ex.averaging:
                await ex.restore_contribution(own)
            log.warning("stage %d step %d: round %s committed without this peer's parts (silent at its owners); "
                        "resyncing", ex.stage, plan.step, plan.round_id)
            av.rounds_aborted += 1
            av._record(RoundResult("aborted", plan.step, d.samples, len(plan.members), None), plan.coordinator,
                       missing=[av.peer_id], status="missed", reason="dropped", started=self.started)
            if av.on_behind is not None:
                await av.on_behind(plan.step + 1)
            return
        missing = await self._gather_parts(d, fetches)
        why: str | None = None if missing else await asyncio.to_thread(self._check, d)
        if why is None and not missing and self.suspected:  # a part against this peer's own slice: audited first
            why = await av.auditor.suspect(plan, d, self.decision_sig, self.suspected, SUSPECT_WAIT_S)
        if missing or why is not None or own is None:
            if own is not None and ex.averaging:
                await ex.restore_contribution(own)
            reason = why or (f"part(s) {missing[:8]} missing after the commit" if missing else "not contributing")
            log.warning("stage %d step %d: round %s committed but this peer cannot apply it (%s); resyncing",
                        ex.stage, plan.step, plan.round_id, reason)
            av.rounds_aborted += 1
            av._record(RoundResult("aborted", plan.step, d.samples, len(plan.members), None), plan.coordinator,
                       missing=[], status="missed", reason=reason, started=self.started)
            if missing and av.on_behind is not None:  # (a refused mean is not adopted through a resync either)
                await av.on_behind(plan.step + 1)
            return
        mean = await asyncio.to_thread(torch.cat, [self.parts[j][0] for j in range(len(plan.owners))])
        await ex.apply_average(mean, plan.step)
        self._second(d)
        av.auditor.after_commit(plan, d, self.decision_sig)  # (if the commit draws this peer: ``audit``)
        if self.lossy and own.grads is not None and len(self.mine) == len(plan.owners):  # error feedback:
            decoded = [self.mine[j][1] for j in range(len(plan.owners))]  # each part as its owner decoded it
            if all(d is not None for d in decoded):
                whole = await asyncio.to_thread(torch.cat, [d for d in decoded if d is not None])
                await ex.keep_residual(own.grads, whole)
        av.rounds_ok += 1
        self._count_repeats()
        convicted = dict(d.convicted)
        used: tuple[Used, ...] | None = None
        if plan.coordinator == av.peer_id:  # and those its openings convicted since its last round (as a leader's)
            convicted |= av._take_opening_convictions()
            used = self._used()  # whose samples the mean holds, in its record as in a leader's
        av._record(RoundResult("ok", plan.step, d.samples, len(plan.members) - len(d.dropped), None, used=used),
                   plan.coordinator, missing=list(d.dropped), started=self.started, struck=d.struck,
                   convicted=convicted)
        if (av.convicts() and av.identity is not None and own.grads is not None and own.parts
                and plan.coordinator != av.peer_id and len(self.mine) == len(plan.owners)):
            # open the contribution for the coordinator, now that the commit fixed the projection (``openings``)
            identity, sent = av.identity, [self.mine[j][1] for j in range(len(plan.owners))]
            if all(t is not None for t in sent):
                def opened(own: Contribution = own) -> tuple[bytes | None, float]:
                    # (its CPU timed in the thread that does it: the event loop's own time is not the opening's)
                    started = time.thread_time()
                    opening = open_contribution(
                        identity, stage=plan.stage, step=plan.step, peer_id=av.peer_id, coordinator=plan.coordinator,
                        digests=d.digests, claim=self.claim_digest, codec=opening_codec(self.codecs), own=own,
                        decoded=torch.cat([t for t in sent if t is not None]), numel=ex.grad_numel, ins=self.ins,
                        at=self.at, bounds=plan.bounds,
                        part_digests=tuple(self.mine[j][0].digest for j in range(len(plan.owners))))
                    return opening, time.thread_time() - started

                av._opened(plan.coordinator, await asyncio.to_thread(opened))

    def _used(self) -> tuple[Used, ...] | None:
        """The contributions a committed mean holds, by part 0's used list (every part lists the same members
        and samples: ``decide``); None when it cannot be read."""
        held = self.parts.get(0)
        if held is None:
            return None
        try:
            return tuple(Used.from_wire(u) for u in held[1])
        except ValueError:
            return None

    async def _gather_parts(self, d: Decision, fetches: dict[int, asyncio.Task[Part | None]]) -> list[int]:
        """Every part, checked against the commit's digests: from its owner, else from the coordinator
        or any member holding a checked copy (the part re-assigned). The parts still missing."""
        av, plan = self.av, self.plan
        await asyncio.wait(list(fetches.values()), timeout=self._left(1.0) + 1.0)
        missing = []
        for j, digest in enumerate(d.digests):
            if j in self.parts:
                continue
            got = self.fetched.get(j)
            if got is not None and await asyncio.to_thread(part_digest, got[0], got[1]) == digest:
                self.parts[j] = got
                continue
            sources = [plan.coordinator] + [pid for pid, _ in plan.members if pid not in (plan.coordinator, av.peer_id)]
            for pid in sources:
                if pid == av.peer_id or pid == plan.owners[j]:
                    continue
                alt = await self._fetch(j, plan.addr(pid), wait_s=0.0)
                if alt is not None and await asyncio.to_thread(part_digest, alt[0], alt[1]) == digest:
                    self.parts[j] = alt
                    break
            else:
                missing.append(j)
        return missing

    def _second(self, d: Decision) -> None:
        """After a commit: score this round's slices of this peer's parts into its own window, and second
        the decision's convictions that its own parts bear out (``SECOND_CLAIMS`` far strikes of the
        accused's slices against this owner's own among the last ``WINDOW`` committed rounds): the accused
        is excluded here too (``hostile: ...``), so the stage's progress answers name it from two peers and
        the trainers stop routing to it (``swarmd.train.verify.excluded_by_stage``). A member that owns no
        part, or whose parts do not bear it out, does not second: one coordinator alone cannot have a peer
        excluded by its mates (as one leader cannot: ``accusations``)."""
        av, plan = self.av, self.plan
        if not av.convicts():
            return
        worst: dict[str, Score] = {}
        for j in plan.parts_of(av.peer_id):
            owner = av.owners.get((plan.round_id, j))
            for pid, sc in (owner.scores.items() if owner is not None else ()):
                if pid not in worst or sc.far > worst[pid].far:
                    worst[pid] = sc
        av.part_strikes.observe({pid: sc for pid, sc in worst.items() if pid not in d.dropped})
        for pid, why in d.convicted:
            if pid == av.peer_id or plan.coordinator == av.peer_id or pid in av.suspicions.excluded():
                continue
            far = av.part_strikes.far(pid)
            if far < SECOND_CLAIMS:
                av.accusations["not_seconded"] += 1
                log.warning("stage %d step %d: coordinator %s convicted %s (%s); not seconded: %d of its slices of "
                            "this peer's parts were far from this peer's own lately (%d needed)", plan.stage,
                            plan.step, plan.coordinator[:12], pid[:12], why, far, SECOND_CLAIMS)
                continue
            av.accusations["seconded"] += 1
            period = av.suspicions.accuse(pid, f"hostile: {far} of its last parts here far from this peer's own "
                                          f"(seconding coordinator {plan.coordinator[:12]}: {why})",
                                          base_s=HOSTILE_EXCLUSION_S)
            log.warning("stage %d step %d: seconded coordinator %s's conviction of %s (%d far parts here); excluded "
                        "from this peer's rounds for %.0fs", plan.stage, plan.step, plan.coordinator[:12], pid[:12],
                        far, period)

    def _count_repeats(self) -> None:
        """On part 0's owner, after the commit: microbatch ids held by two members' gradients, or by
        this round and the last one it saw (the exactly-once rule's last resort, as the leader's):
        counted twice, and seen in ``duplicate_microbatches``."""
        av, plan = self.av, self.plan
        owner = av.owners.get((plan.round_id, 0)) if plan.owners[0] == av.peer_id else None
        if owner is None:
            return
        av.count_repeats(plan.step, [owner.mbs.get(pid, ()) for pid in sorted(owner.parts)])

    def _check(self, d: Decision) -> str | None:
        """Why this member refuses the committed mean (the round checks, part by part, and the outlier rule
        on the whole contributions, as the coordinator judged them: ``plan.decide``; off the loop)."""
        av, plan = self.av, self.plan
        lists: list[dict[str, tuple[float, int]]] = []
        for j, (mean, used_wire) in sorted(self.parts.items()):
            try:
                used = tuple(Used.from_wire(u) for u in used_wire)
            except ValueError as exc:
                return f"part {j}'s used list is malformed ({exc})"
            lists.append({u.peer_id: (u.norm, u.samples) for u in used if u.samples > 0})
            if plan.owners[j] == av.peer_id or j not in self.mine:
                continue
            own, decoded = self.mine[j]
            if decoded is not None and own.samples > 0:
                cos = against_own(mean, decoded)
                if cos is not None and cos < SUSPECT_BELOW:
                    self.suspected.append((j, cos))
            why = check_answer(own=own, own_grads=decoded, mean=mean, used=used, total=d.samples,
                               leader=plan.owners[j], codec=av.executor.training.grad_codec, check_outliers=False)
            if why is not None:
                av.suspicions.accuse(plan.owners[j], why)
                return f"part {j} (owner {plan.owners[j][:12]}): {why}"
        whole = whole_norms(lists) if len(lists) == len(plan.owners) else None
        if whole is None:
            return "the parts' used lists name different members or samples"
        bad = whole_outliers(whole, plan.coordinator)
        if bad:
            pid, why = next(iter(sorted(bad.items())))
            av.suspicions.accuse(plan.coordinator, f"it committed {pid[:12]}'s outlier contribution ({why})")
            return f"the commit holds {pid[:12]}'s contribution although it is an outlier ({why})"
        return None


POLL_S = 5.0  # slack for one control request's round trip on top of its long-poll
#: A member cut off from its coordinator waits this long for each other member to be cut off too (or to
#: hold the decision) when it asks them: they notice the coordinator's death at about the same moment.
CUT_OFF_WAIT_S = 2.0
#: The coordinator checks this often, while ready reports are missing, whether their owners are gone.
OWNER_CHECK_S = 1.0
#: How long a part owner found gone (connections refused) is left out of its coordinator's plans; after it, one
#: that still reports is planned again (it may be back: a restarted peer at the same address).
UNREACHABLE_S = 10.0
