"""A member's side of one chunked all-reduce round (the state diagram is in
``swarmd.pipeline.allreduce``): scatter its parts, fetch every part mean, wait for the one
decision (deciding it, on the coordinator), then apply or restore."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch

from swarmd.dht.identity import Identity, peer_id_of, verify
from swarmd.errors import Busy, PeerError, SwarmdError
from swarmd.net.client import DataPlaneClient
from swarmd.pipeline.allreduce_coordinator import Coordinator, CoordRound
from swarmd.pipeline.allreduce_messages import ArAck, ArDecisionReply, ArPart, ArQuery, ArReady, read_mean
from swarmd.pipeline.allreduce_owner import PartOwner
from swarmd.pipeline.allreduce_plan import Decision, RoundPlan, part_digest, part_message
from swarmd.pipeline.averaging import RoundResult, _as_decoded, _wire_codec
from swarmd.pipeline.executor import Contribution, StageExecutor
from swarmd.pipeline.refusals import Refusal
from swarmd.pipeline.round_checks import Suspicions, Used, check_answer, per_sample_norm, tensor_digest

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
    codecs_sent: Counter[str]
    commit_grace_s: float
    reply_slack_s: float
    rounds_ok: int
    rounds_aborted: int
    on_behind: Callable[[int], Awaitable[None]] | None
    suspicions: Suspicions

    @property
    def target(self) -> int: ...

    def _refuse_contributor(self, peer_id: str, why: Refusal, step: int) -> None: ...

    def _record(self, result: RoundResult, leader: str, missing: list[str], *, status: str | None = None,
                reason: str | None = None, refused: dict[str, str] | None = None,
                started: float | None = None) -> None: ...


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
        self.decision: Decision | None = None
        self.decision_sig: bytes | None = None
        self.decision_pk: bytes | None = None

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

    # ---- scatter -------------------------------------------------------------------------

    async def _scatter(self, own: Contribution) -> None:
        av, plan = self.av, self.plan
        ex = av.executor

        async def send(j: int) -> None:
            lo, hi = plan.bounds[j]
            owner = plan.owners[j]
            piece = own.grads[lo:hi] if own.grads is not None else None
            if owner == av.peer_id:
                digest = await asyncio.to_thread(tensor_digest, piece)
                self.mine[j] = (Used(av.peer_id, own.samples, digest, per_sample_norm(piece, own.samples)), piece)
                why = av.owners[(plan.round_id, j)].add(av.peer_id, own.samples, piece, digest)
                if why is not None:
                    log.warning("stage %d: own part %d refused by itself (%s)", ex.stage, j, why)
                return
            codec = ("none" if piece is None
                     else _wire_codec(piece, ex.training.grad_codec, av.client.links, plan.addr(owner)))
            if piece is not None:
                av.codecs_sent[codec] += 1
            decoded, digest = await asyncio.to_thread(_as_decoded, piece, codec)
            self.mine[j] = (Used(av.peer_id, own.samples, digest, per_sample_norm(decoded, own.samples)), decoded)
            key = sig = None
            if av.identity is not None:
                key = av.identity.public_key_bytes
                sig = av.identity.sign(part_message(ex.stage, plan.round_id, j, own.samples, digest, av.peer_id, owner))
            req = ArPart(ex.stage, plan.round_id, j, av.peer_id, own.samples, piece, digest, codec, key, sig)
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

    async def _settle_part(self, j: int) -> None:
        av, plan = self.av, self.plan
        owner = av.owners[(plan.round_id, j)]
        ready = await owner.settle(self._left())
        if self.rnd is not None:
            av.coord.on_ready(ready)
            return
        key = sig = None
        if av.identity is not None:
            key, sig = av.identity.public_key_bytes, av.identity.sign(ready.message(av.executor.stage))
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
            got = read_mean(frame, plan.round_id, j, hi - lo)
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
        await av.coord.collect(rnd, self._left(min(POLL_S, self.plan.timeout_s / 2)))
        decision = av.coord.decide(rnd, av.target)
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
        sig = av.identity.sign(decision.message()) if av.identity is not None else None
        self.decision, self.decision_sig = decision, sig
        self.decision_pk = av.identity.public_key_bytes if av.identity is not None else None
        av.coord.settle(rnd, decision, sig)

    async def _await_decision(self) -> None:
        """The coordinator's decision, long-polled; while it cannot be asked (gone, overloaded), asked of
        the other members (it is signed: any copy will do). Given up only once the coordinator can no
        longer commit (it commits within ``commit_grace_s`` of its deadline, earlier than this member's
        ``reply_slack_s``): a member that restored its gradients while a commit was still possible
        would stay behind holding samples the others stepped on."""
        av, plan = self.av, self.plan
        coordinator = plan.addr(plan.coordinator)
        while self.decision is None and self._left(av.reply_slack_s) > 0:
            av.control_requests["decision"] += 1
            try:
                if await self._ask_decision(coordinator, min(60.0, self._left(av.reply_slack_s))) is not None:
                    return
                continue
            except PeerError:
                pass
            for pid, addr in plan.members:
                if pid in (av.peer_id, plan.coordinator):
                    continue
                av.control_requests["decision"] += 1
                try:
                    if await self._ask_decision(addr, 0.0) is not None:
                        return
                except PeerError:
                    continue
            await asyncio.sleep(min(1.0, self._left(av.reply_slack_s)))

    async def _ask_decision(self, addr: str, wait: float) -> Decision | None:
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
            return None
        if av.identity is not None and not (
                reply.public_key is not None and reply.signature is not None
                and peer_id_of(reply.public_key) == plan.coordinator
                and verify(reply.public_key, d.message(), reply.signature)):
            return None
        self.decision, self.decision_sig, self.decision_pk = d, reply.signature, reply.public_key
        return d

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
            av._record(RoundResult("aborted", plan.step, 0, len(plan.members), None), plan.coordinator, missing=[],
                       reason=reason, started=self.started)
            return
        missing = await self._gather_parts(d, fetches)
        why: str | None = None if missing else await asyncio.to_thread(self._check, d)
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
        mean = torch.cat([self.parts[j][0] for j in range(len(plan.owners))])
        await ex.apply_average(mean, plan.step)
        av.rounds_ok += 1
        av._record(RoundResult("ok", plan.step, d.samples, len(plan.members), None), plan.coordinator, missing=[],
                   started=self.started)

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

    def _check(self, d: Decision) -> str | None:
        """Why this member refuses the committed mean (the round checks, part by part; off the loop)."""
        av, plan = self.av, self.plan
        for j, (mean, used_wire) in sorted(self.parts.items()):
            if plan.owners[j] == av.peer_id or j not in self.mine:
                continue
            try:
                used = tuple(Used.from_wire(u) for u in used_wire)
            except ValueError as exc:
                return f"part {j}'s used list is malformed ({exc})"
            own, decoded = self.mine[j]
            why = check_answer(own=own, own_grads=decoded, mean=mean, used=used, total=d.samples,
                               leader=plan.owners[j], codec=av.executor.training.grad_codec)
            if why is not None:
                av.suspicions.accuse(plan.owners[j], why)
                return f"part {j} (owner {plan.owners[j][:12]}): {why}"
        return None


POLL_S = 5.0  # slack for one control request's round trip on top of its long-poll
