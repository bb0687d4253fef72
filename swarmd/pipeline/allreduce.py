"""Stage-wide synchronous steps by a chunked all-reduce with one atomic decision (issue #28).

SWARM (paper, section 3.2) averages a stage's gradients among its peers before they all step.
``swarmd.pipeline.averaging`` does it through one leader that receives every contribution and
answers everyone: ``(n - 1) x |grads|`` each way at the leader. Here every peer of the round owns
the reduction of one part of the flat gradient vector (reduce-scatter), and every peer fetches
every part's mean (all-gather): about ``2 x |grads| x (n - 1) / n`` sent and as much received per
peer, whatever ``n`` (hivemind's butterfly all-reduce). What the single leader gave is kept by a
commit protocol: a coordinator (chosen as the leader is: the smallest proven peer id at the step,
direct peers first) signs one decision per round, and a peer applies the mean only with that
``commit`` and every part, each matching the digest the decision names.

Roles and states of one round ``r`` at step ``s`` (timeouts: ``T = averaging_timeout_s``)::

    member (every peer of the round, the coordinator and the owners included)
      IDLE --report (long-poll, to the coordinator)--> REPORTED
      REPORTED --"wait"/"superseded"--> IDLE            (report again when its samples grew by
                                                         its share of what the stage misses)
      REPORTED --"behind"--> RESYNC                     (most stage-mates are ahead: adopt one's state)
      REPORTED --"start" + plan--> SCATTER
      SCATTER: take the gradients out of the stage (backwards answer Busy), send part j to owner j,
               start fetching every part mean (long-polls)                   --> AWAIT_DECISION
      AWAIT_DECISION --commit, every part fetched, digests match--> APPLY --> IDLE at s + 1
      AWAIT_DECISION --abort, or no decision within T + REPLY_SLACK_S--> RESTORE --> IDLE at s
                     (gradients put back: nothing lost; a silent coordinator is asked of the
                      other members first, any of which may hold its signed decision)
      AWAIT_DECISION --commit, a part missing or not matching after asking its owner, the
                     coordinator and every member--> RESTORE, then RESYNC from a mate that applied

    owner of part j
      COLLECT (until every member's part j, or T) --> REDUCE (outliers refused; float64, peer-id
      order; encoded once with grad_codec) --> READY (report digest + samples to the coordinator)
      --> SERVE (the same bytes to every member, until the round is forgotten)
      a part missing, non-finite, badly signed or an outlier: READY without a digest (-> abort)

    coordinator
      HOLD reports --(reports at s with its digest + own samples >= target, every trusted mate
      accounted for)--> START (plan to every held report) --> COLLECT readies (T)
      --> VERIFY (fetch every part itself: after a commit it can serve any of them)
      --> DECIDE: commit iff every part is ready and verified, every owner reduced the same
          members with the same samples, none refused, samples >= target, and it is at most
          COMMIT_GRACE_S past the round's deadline (a frozen coordinator aborts) --> SERVE decision

Failures (``tests/test_allreduce_faults.py`` kills each role at each phase):

- a member dies before sending its parts: its owners report it missing, the round aborts, every
  other member restores its gradients; it is not in the next plan (it no longer reports);
- an owner dies before READY: the coordinator times out and aborts; after READY but before the
  coordinator verified its part: abort; after the commit: every part is held by the coordinator
  too (it verified them), and by every member that fetched it, so members re-fetch elsewhere (the
  part is re-assigned to whoever holds it); the decision's digest makes any copy as good as the
  owner's;
- the coordinator dies before deciding: members wait at most ``T + REPLY_SLACK_S``, ask the other
  members for a decision, find none and restore; it dies after deciding: a member that did not get
  the decision gets it from another member (it is signed), or restores and later sees most mates
  at ``s + 1`` and resyncs (as a member whose leader's answer was lost does today);
- the coordinator is frozen past its deadline: it aborts instead of committing (as the leader does).

A peer thus either applies the one committed mean, bit for bit the others', or stays at ``s``
and resyncs: never two peers at ``s + 1`` with different parameters.

Checks against liars (``swarmd.pipeline.round_checks``): parts are signed by their members and
refused from unproven or excluded peers; an owner refuses outlier parts (per-sample norms of the
part) and non-finite ones (a 422 at the data plane); refused members are named in the decision and
excluded by every member; each part mean lists what it holds, and every member checks the lists
and its own part against each part mean (``check_answer``) before applying.

Status (2026-12-02): not the default (``TrainingSpec.averaging`` stays ``"leader"``). The in-process
tests pass (``tests/integration/test_allreduce.py``: bit-identical steps, the leader's mean bit for bit, each role
killed at each phase), but the 2 stages x 8 daemons run of ``tests/system/test_allreduce_scale.py`` on a
machine at load average ~20 forked stages: rounds at one step with 32, 48 and 56 samples were
committed by different peers of stage 1 while its peers joined and proved one another. Two peers
that each took itself for the coordinator (each had not yet proven the other: a proof timed out
under load) started rounds over disjoint members at one step, each group holding a full batch (the
stage had accumulated several while rounds aborted). ``_accounted`` asked only the mates this
peer had proven; it now also asks up to 8 listed but unproven ones (``_unproven_agree``: one that
is at this step naming another coordinator holds the round up for at most 10 s). With it the
scale test passed once (17:40 UTC, lower load); one pass is not evidence enough for a default, and a
plan acknowledged by a majority of the listed stage would close the window for good.

Control requests per round (``/metrics``: ``swarmd_averaging_control_requests``): one report per
member (more only when its samples grow slowly), one "ready" per owner, one decision long-poll per
member: about ``3n``, instead of every peer polling every other a few times a second.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

from swarmd.errors import NonFinite, PeerError, RequestError
from swarmd.net.wire import Frame
from swarmd.pipeline.allreduce_coordinator import Coordinator, CoordRound, share_of_missing
from swarmd.pipeline.allreduce_member import MemberRound
from swarmd.pipeline.allreduce_messages import (
    ArAck,
    ArDecisionReply,
    ArPart,
    ArQuery,
    ArReady,
    ArReport,
    ArReportReply,
    encode_mean,
)
from swarmd.pipeline.allreduce_owner import PartOwner
from swarmd.pipeline.allreduce_plan import RoundPlan, choose_coordinator, part_message, plan_round
from swarmd.pipeline.averaging import COMMIT_GRACE_S, POLL_TIMEOUT_S, REPLY_SLACK_S, StageAverager
from swarmd.pipeline.failures import timed_out
from swarmd.pipeline.refusals import Refusal, RefusalKind
from swarmd.pipeline.round_checks import tensor_digest

log = logging.getLogger(__name__)

#: A member's report is held this long at the coordinator unless the round starts.
HOLD_S = 1.0
#: A part arriving before its owner heard of the round waits this long for the plan.
PLAN_WAIT_S = 5.0
#: Probes of a stage-mate that did not report are reused this long.
PROBE_MEMORY_S = 2.0
#: At most this many listed but unproven mates are asked where they stand before a round starts, and
#: each holds the rounds of one step up at most this long (see ``_unproven_agree``).
UNPROVEN_PROBES = 8
UNPROVEN_HOLD_S = 10.0


class AllReduceAverager(StageAverager):
    """One peer's part in its stage's chunked all-reduce rounds (``TrainingSpec.averaging ==
    "allreduce"``): member, part owner and, when it has the smallest proven peer id, coordinator.
    The trust machinery (proofs, exclusions, suspicions, resync) is the single leader's."""

    def __init__(self, *args: Any, hold_s: float = HOLD_S, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold_s = hold_s
        self.commit_grace_s = COMMIT_GRACE_S
        self.reply_slack_s = REPLY_SLACK_S
        self.coord = Coordinator(self.peer_id)
        self.owners: dict[tuple[str, int], PartOwner] = {}
        self.members: dict[str, MemberRound] = {}  # the last few rounds this peer was a member of
        self.rounds_started = 0
        self._plan_arrived = asyncio.Event()
        self._in_round = False
        self._share = 1  # samples to gather before reporting again
        self._probes: dict[str, tuple[float, Any]] = {}
        self._held_up: dict[tuple[str, int], float] = {}  # (unproven mate, step) -> when it first held a round up

    # ---- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Report to (or act as) the round's coordinator and take part in rounds, until cancelled."""
        while True:
            try:
                await self._ar_tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad round must not end the stage's training
                log.exception("all-reduce round of stage %d failed", self.executor.stage)
                await asyncio.sleep(self.poll_s)

    async def _ar_tick(self) -> None:
        ex = self.executor
        if ex.averaging or self._in_round:
            await asyncio.sleep(self.poll_s)
            return
        mates = await self._trusted_mates()
        addrs = {**mates, self.peer_id: self._own_addr}
        now = time.monotonic()
        coordinator = choose_coordinator(addrs, {p for p, t in self._suspects.items() if t > now}) or self.peer_id
        self._leader_view = coordinator
        if coordinator == self.peer_id:
            await self._coordinate(mates)
        else:  # (reports still held here from when this peer coordinated run out within hold_s)
            await self._report(coordinator, mates[coordinator])

    # ---- member: reporting -------------------------------------------------------------------

    async def _report(self, coordinator: str, addr: str) -> None:
        ex = self.executor

        def send() -> asyncio.Task[ArReportReply]:
            samples = ex.grad_samples
            report = ArReport(ex.stage, self.peer_id, ex.step, samples, ex.digest, coordinator, self.hold_s)
            self.control_requests["report"] += 1
            return asyncio.get_running_loop().create_task(self._call_report(addr, report))

        pending = send()
        reported = ex.grad_samples
        try:
            while True:
                grown = asyncio.get_running_loop().create_task(
                    ex.wait_progress(self.hold_s * 2, samples=reported + self._share))
                done, _ = await asyncio.wait({pending, grown}, return_when=asyncio.FIRST_COMPLETED)
                if pending not in done and grown.result():
                    older, pending, reported = pending, send(), ex.grad_samples
                    reply = await older  # "superseded", or "start" if the round began meanwhile
                    if reply.status == "start":
                        await self._on_reply(reply)
                        await pending
                        return
                    continue
                grown.cancel()
                await asyncio.gather(grown, return_exceptions=True)
                await self._on_reply(await pending)
                return
        except PeerError as exc:
            log.info("stage %d: coordinator %s did not answer a report (%s)", ex.stage, coordinator[:12], exc)
            if not timed_out(exc):
                # unreachable or refusing: report to the next one for a while (a slow one is waited for: two
                # coordinators at once could each start a round at one step)
                self._suspects[coordinator] = time.monotonic() + 5.0
            await asyncio.sleep(self.poll_s)
        finally:
            if not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)

    async def _call_report(self, addr: str, report: ArReport) -> ArReportReply:
        # the coordinator answers within wait_s; on a loaded one the answer may come late, and a member that
        # gave up on it would miss the round's start (its parts never sent: every owner waits the timeout)
        frame = await self.client.allreduce(addr, "report", report.encode,
                                            timeout_s=report.wait_s + max(POLL_TIMEOUT_S, self.timeout_s))
        numel = self.executor.grad_numel
        return self.client._read(addr, lambda f: ArReportReply.from_frame(f, numel), frame)

    async def _on_reply(self, reply: ArReportReply) -> None:
        ex = self.executor
        if reply.status == "start" and reply.plan is not None:
            plan = reply.plan
            if plan.step == ex.step and plan.stage == ex.stage and self.peer_id in plan.member_ids:
                await self._round_as_member(plan)
            return
        if reply.status == "behind" and reply.step > ex.step and self.on_behind is not None:
            log.info("stage-mates are at step %d, this peer at %d: resyncing", reply.step, ex.step)
            await self.on_behind(reply.step)
            return
        self._share = share_of_missing(reply.missing, reply.members)
        if reply.status == "refused":
            await asyncio.sleep(self.hold_s)

    # ---- coordinator: starting -------------------------------------------------------------

    async def _coordinate(self, mates: dict[str, str]) -> None:
        ex = self.executor
        self.coord.wake.clear()
        step, digest, now = ex.step, ex.digest, time.monotonic()
        offenders = self.suspicions.offenders()
        # where the mates are: by their reports here, else by a recent probe (mates that report to another
        # coordinator, e.g. those that stepped in a round this peer missed)
        steps = {pid: p.step for pid, (at, p) in self._probes.items()
                 if p is not None and pid in mates and now - at <= PROBE_MEMORY_S}
        steps |= {pid: s for pid, s in self.coord.recent_steps(now).items() if pid in mates}
        ahead = [s for pid, s in steps.items() if s > step and pid not in offenders]
        level = 1 + sum(1 for s in steps.values() if s == step)
        if ahead and len(ahead) >= level and self.on_behind is not None:
            self.coord.release_all(step, 0, 1)
            log.info("stage-mates are at step %d, this coordinator at %d: resyncing", max(ahead), step)
            await self.on_behind(max(ahead))
            return
        waiting = {pid: r for pid, r in self.coord.waiting(step, digest).items() if pid in mates}
        total = ex.grad_samples + sum(r.samples for r in waiting.values())
        if total < self.target:
            await self._wait_wake(self.target - (total - ex.grad_samples))
            return
        if not await self._accounted(mates, waiting, step, digest) or (not waiting and await self._newly_listed()):
            await self._wait_wake(None)  # hear from the mates first
            return
        # the reports held now (those above may have been answered "wait" while the mates were asked):
        # from here to answering them with the plan nothing awaits, so each member planned with hears of it
        held_now = {pid: r for pid, r in self.coord.waiting(step, digest).items() if pid in mates}
        if ex.step != step or ex.digest != digest:
            return
        if ex.grad_samples + sum(r.samples for r in held_now.values()) < self.target:
            await self._wait_wake(None)
            return
        waiting = held_now
        members = {pid: mates[pid] for pid in waiting} | {self.peer_id: self._own_addr}
        plan = plan_round(stage=ex.stage, step=step, coordinator=self.peer_id, members=members,
                          numel=ex.grad_numel, nonce=secrets.token_hex(4), timeout_s=self.timeout_s)
        rnd = self.coord.open(plan)
        self._register(plan)
        self.coord.answer_waiting({pid: ArReportReply("start", step, 0, len(members), plan) for pid in waiting})
        self.rounds_started += 1
        await self._round_as_member(plan, rnd)

    async def _accounted(self, mates: dict[str, str], waiting: dict[str, ArReport], step: int, digest: str) -> bool:
        """Whether every trusted stage-mate that did not report here is elsewhere: at another step or
        with other parameters, or silent (one ``/v1/progress`` each, reused for PROBE_MEMORY_S). A mate
        at this step that names another coordinator means the views differ: no round yet."""
        now = time.monotonic()
        held = self.coord.held
        unknown = {}
        for pid, addr in mates.items():
            if pid in waiting:
                continue
            h = held.get(pid)
            if h is not None and now - h.at <= self.hold_s * 3:
                if h.report.step == step and h.report.params_digest == digest:
                    return False  # it is between two reports: hear from it
                continue
            unknown[pid] = addr
        stale = {pid: addr for pid, addr in unknown.items() if now - self._probes.get(pid, (-1e9, None))[0]
                 > PROBE_MEMORY_S}
        if stale:
            got = await self._poll(stale)
            for pid in stale:
                self._probes[pid] = (now, got.get(pid))
        for pid in unknown:
            p = self._probes.get(pid, (0.0, None))[1]
            if p is not None and p.step == step and p.params_digest == digest:
                return False  # alive at this step: it names another coordinator, or is about to report
        return await self._unproven_agree(step, digest, now)

    async def _unproven_agree(self, step: int, digest: str, now: float) -> bool:
        """False while a listed mate this peer has not proven (yet: its first proof may be pending, or
        have timed out under load) answers that it is at this step with these parameters and takes
        another peer for the coordinator: it may be coordinating a round of its own at this step, and
        two rounds at one step would fork the stage. Bounded: such a mate holds rounds up for at most
        UNPROVEN_HOLD_S per step (a liar answering progress but never its proofs cannot stall the stage)."""
        if len(self._held_up) > 1024:
            self._held_up = {k: t for k, t in self._held_up.items() if k[1] >= step}
        unproven = {pid: addr for pid, addr in self._mates.items()
                    if pid not in (self.prover.proven(self._mates) if self.prover is not None else self._mates)}
        if not unproven:
            return True
        stale = {pid: addr for pid, addr in list(unproven.items())[:UNPROVEN_PROBES]
                 if now - self._probes.get(pid, (-1e9, None))[0] > PROBE_MEMORY_S}
        if stale:
            got = await self._poll(stale)
            for pid in stale:
                self._probes[pid] = (now, got.get(pid))
        for pid in list(unproven)[:UNPROVEN_PROBES]:
            p = self._probes.get(pid, (0.0, None))[1]
            if p is not None and p.step == step and p.params_digest == digest and p.leader not in (None, self.peer_id):
                first = self._held_up.setdefault((pid, step), now)
                if now - first <= UNPROVEN_HOLD_S:
                    return False
        return True

    async def _wait_wake(self, need: int | None) -> None:
        """Until a report arrives, this peer's samples reach ``need`` (None: a report only), or
        ``hold_s`` (a quarter of it with ``need`` None: the mates awaited may be between reports)."""
        loop = asyncio.get_running_loop()
        waits: set[asyncio.Task[bool]] = {loop.create_task(self.coord.wake.wait())}
        if need is not None:
            waits.add(loop.create_task(self.executor.wait_progress(self.hold_s, samples=max(1, need))))
        try:
            await asyncio.wait(waits, timeout=self.hold_s if need is not None else self.hold_s / 4,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waits:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    def _register(self, plan: RoundPlan) -> None:
        """Know the round: its part owners here exist before any part can arrive."""
        for j in plan.parts_of(self.peer_id):
            self.owners[(plan.round_id, j)] = PartOwner(plan, j, self.peer_id, self.executor.training.grad_codec)
        while len(self.owners) > 16 * max(1, len(plan.parts_of(self.peer_id))):
            self.owners.pop(next(iter(self.owners)))
        self._plan_arrived.set()
        self._plan_arrived = asyncio.Event()

    async def _round_as_member(self, plan: RoundPlan, rnd: CoordRound | None = None) -> None:
        if rnd is None:
            self._register(plan)
        self._in_round = True
        try:
            member = MemberRound(self, plan, rnd)
            self.members[plan.round_id] = member
            while len(self.members) > 8:
                self.members.pop(next(iter(self.members)))
            await member.run()
        finally:
            self._in_round = False

    # ---- serving (POST /v1/allreduce/<op>) ---------------------------------------------------

    async def handle(self, op: str, frame: Frame, remote: str = "") -> bytes:
        """One request of the round's protocol; the answer frame's bytes (RequestError: a 4xx)."""
        if op == "report":
            return (await self._on_report(ArReport.from_frame(frame))).encode()
        if op == "part":
            return (await self._on_part(frame)).encode()
        if op == "ready":
            return self._on_ready(ArReady.from_frame(frame)).encode()
        if op == "decision":
            q = ArQuery.from_frame(frame)
            return (await self._on_decision(q)).encode()
        if op == "mean":
            q = ArQuery.from_frame(frame)
            data = await self._on_mean(q)
            if data is None:
                return ArAck(False, "this peer holds no such part mean").encode()
            return data
        raise RequestError(f"no all-reduce operation {op!r}")

    async def _on_report(self, report: ArReport) -> ArReportReply:
        ex = self.executor
        if report.stage != ex.stage:
            return ArReportReply("refused", ex.step, reason="another stage")
        if report.peer_id in self.excluded():
            return ArReportReply("refused", ex.step, reason="excluded by this stage")
        if self.prover is not None and report.peer_id not in self.prover.proven(self._mates):
            return ArReportReply("refused", ex.step, reason="unproven: not a proven stage-mate yet")
        step = ex.step
        now_reply: ArReportReply | None = None  # held otherwise (also while this peer is in a round, or
        if report.step < step and self._leader_view == self.peer_id:  # does not coordinate: no report spins)
            steps = self.coord.recent_steps(time.monotonic())
            here = 1 + sum(1 for pid, s in steps.items() if s == step and pid != report.peer_id)
            there = 1 + sum(1 for pid, s in steps.items() if s == report.step and pid != report.peer_id)
            if here >= there:
                now_reply = ArReportReply("behind", step)
        reply = await self.coord.on_report(report, now_reply, min(report.wait_s, 10.0))
        if reply.status == "wait" and now_reply is None:
            waiting = self.coord.waiting(step, ex.digest)
            total = ex.grad_samples + sum(r.samples for r in waiting.values())
            reply = ArReportReply("wait", step, max(0, self.target - total), 1 + len(waiting))
        return reply

    async def _on_part(self, frame: Frame) -> ArAck:
        rid, part = frame.meta.get("round_id"), frame.meta.get("part")
        owner = await self._owner(rid, part)
        if owner is None:
            return ArAck(False, "this peer owns no such part (unknown round)")
        lo, hi = owner.plan.bounds[owner.part]
        try:
            req = ArPart.from_frame(frame, hi - lo)
        except RequestError as exc:
            signer = await asyncio.to_thread(self._part_signer, frame, owner)
            if signer is not None:
                kind: RefusalKind = "nonfinite" if isinstance(exc, NonFinite) else "malformed"
                owner.refuse(signer, Refusal(kind, str(exc)[:200]))
                self._refuse_contributor(signer, Refusal(kind, str(exc)[:120]), owner.plan.step)
            raise
        digest = await asyncio.to_thread(tensor_digest, req.grads)
        if self.identity is not None and self._part_signer(frame, owner, digest) != req.peer_id:
            return ArAck(False, "bad_signature: a part must be signed by its member for this round and owner")
        if req.peer_id in self.excluded():
            owner.refuse(req.peer_id, Refusal("excluded", "by this stage"))
            return ArAck(False, "excluded: this stage excludes that peer for now")
        why = owner.add(req.peer_id, req.samples, req.grads, digest, req.codec)
        return ArAck(why is None, why or "")

    def _part_signer(self, frame: Frame, owner: PartOwner, digest: str | None = None) -> str | None:
        meta, grads = frame.meta, frame.tensors.get("grads")
        pid, pk, sig, samples = meta.get("peer_id"), meta.get("pk"), meta.get("sig"), meta.get("samples")
        if not (isinstance(pid, str) and type(pk) is bytes and type(sig) is bytes and type(samples) is int):
            return None
        from swarmd.dht.identity import peer_id_of, verify  # (keeps this module's imports about rounds)

        if peer_id_of(pk) != pid:
            return None
        d = digest if digest is not None else tensor_digest(grads)
        message = part_message(self.executor.stage, owner.plan.round_id, owner.part, samples, d, pid, self.peer_id)
        return pid if verify(pk, message, sig) else None

    async def _owner(self, rid: Any, part: Any) -> PartOwner | None:
        if not isinstance(rid, str) or not isinstance(part, int):
            raise RequestError("meta.round_id and meta.part name the round and part")
        deadline = time.monotonic() + PLAN_WAIT_S
        while (rid, part) not in self.owners:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not rid.startswith(f"{self.executor.step}-"):
                return None
            try:
                await asyncio.wait_for(self._plan_arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return None
        return self.owners[(rid, part)]

    def _on_ready(self, req: ArReady) -> ArAck:
        ready = req.ready
        rnd = self.coord.rounds.get(ready.round_id)
        if rnd is None:
            return ArAck(False, "no such round here")
        if self.identity is not None:
            from swarmd.dht.identity import peer_id_of, verify

            if req.public_key is None or req.signature is None or peer_id_of(req.public_key) != ready.owner \
                    or not verify(req.public_key, ready.message(req.stage), req.signature):
                return ArAck(False, "bad_signature: a ready report must be signed by the part's owner")
        why = self.coord.on_ready(ready)
        return ArAck(why is None, why or "")

    async def _on_decision(self, q: ArQuery) -> ArDecisionReply:
        """The round's signed decision: waited for when this peer coordinates it, else the copy this
        member received (a member whose coordinator died asks the others)."""
        if q.round_id in self.coord.rounds:
            got = await self.coord.decision(q.round_id, min(q.wait_s, self.timeout_s + self.reply_slack_s))
            if got is not None:
                key = self.identity.public_key_bytes if self.identity is not None and got[1] is not None else None
                return ArDecisionReply(got[0], key, got[1])
        member = self.members.get(q.round_id)
        if member is not None and member.decision is not None:
            return ArDecisionReply(member.decision, member.decision_pk, member.decision_sig)
        return ArDecisionReply(None)

    async def _on_mean(self, q: ArQuery) -> bytes | None:
        owner = self.owners.get((q.round_id, q.part))
        if owner is None and q.round_id not in self.members:  # this peer may not have heard of the round yet
            owner = await self._owner(q.round_id, q.part)
        if owner is not None:
            return await owner.mean_bytes(min(q.wait_s, self.timeout_s + self.reply_slack_s))
        member = self.members.get(q.round_id)
        held = member.parts.get(q.part) if member is not None else None
        if held is None:
            return None
        mean, used = held  # a copy this member verified: exact (codec none), so its digest still matches
        return await asyncio.to_thread(encode_mean, q.round_id, q.part, mean, "none", used)

    def checks_status(self) -> dict[str, Any]:
        out = super().checks_status()
        out["mode"] = "allreduce"
        return out


