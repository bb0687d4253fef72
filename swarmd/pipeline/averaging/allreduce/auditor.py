"""A peer's part in the audits of part owners (``audit``: the rule, the draw, the evidence, the cost).

Three roles, all on ``POST /v1/allreduce/<op>``:

- **auditor**: after it applied a commit, a member the commit draws (``audit.draw``) asks the drawn
  part's owner for its evidence (``slices``), checks it and recomputes the part off the event loop; a mean
  that does not hold up convicts the owner here and the evidence goes to every listed stage-mate (``audit``);
- **owner**: answers ``slices`` with what it kept of a part it reduced (its signed ready report, the mean's
  frame, every member's signed part frame as it came: ``owner.PartOwner``, the last rounds' parts);
- **stage-mate**: checks evidence it is shown itself (signatures, then the recomputation), one at a time,
  each (owner, round, part) once, and excludes the owner too when it holds (``seconded``).

An owner that will not show its evidence is held to account as one that showed a lie (``unaccountable``):
it refused outright, or answered what does not hold up, or let ``AUDIT_ATTEMPTS`` requests go unanswered
while it answered a cheap request of the same round each time (so it is alive and serving). The auditor
excludes it as hostile and tells its stage-mates (``refused``: the round and the part, nothing to take on
trust); each mate that applied that commit (or applies it later) checks that the commit drew that part,
and audits the owner itself by the same rules (``noticed``): evidence it is shown convicts or clears the
owner, a refusal excludes it here too. An honest owner never refuses: it keeps the evidence of every
drawn part (``keep``; in ``kept``, and on disk under the state directory when the daemon has
one, so a restart forgets none; the daemon's, so a move to another stage forgets none either). One that
answers nothing is asked again when it is back in a commit of this stage (a liar cannot wait its audit out
by playing dead), and one gone for ``PENDING_MAX_S`` is only counted (``unanswered``).

``/status`` averaging ``audits`` (``drawn``, ``noticed``, ``suspected``, ``ok``, ``mismatch``, ``unaccountable``,
``unanswered``, ``unprovable``, ``seconded``, ``not_seconded``, ``busy``, ``shown``, ``skipped``); ``/metrics``
``swarmd_averaging_audits_total{outcome}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from swarmd.errors import PeerError, RequestError, SwarmdError
from swarmd.net.wire import Frame
from swarmd.pipeline.averaging.allreduce.audit import AUDIT_SHARE, KEEP_ROUNDS, PartEvidence, draw, evidence_of
from swarmd.pipeline.averaging.allreduce.evidence_store import KeptEvidence
from swarmd.pipeline.averaging.allreduce.messages import ArAck, ArQuery

if TYPE_CHECKING:
    from swarmd.dht.identity import Identity
    from swarmd.net.client import DataPlaneClient
    from swarmd.pipeline.averaging.allreduce.owner import PartOwner
    from swarmd.pipeline.averaging.allreduce.plan import Decision, RoundPlan
    from swarmd.pipeline.averaging.trust.round_checks import Suspicions
    from swarmd.pipeline.stage.executor import StageExecutor

__all__ = ["AUDIT_ATTEMPTS", "AUDIT_TIMEOUT_S", "PartAuditor"]

log = logging.getLogger(__name__)

#: How long fetching an owner's evidence, or showing it to one stage-mate, may take.
AUDIT_TIMEOUT_S = 30.0
#: Requests for a piece an owner that answers otherwise may leave unanswered (one after each commit) before it is
#: held to account as one that refused (``unaccountable``). One that answers nothing is asked again once it takes
#: part in a commit again (a restart: it kept the evidence), until ``PENDING_MAX_S``.
AUDIT_ATTEMPTS = 3
#: An audit whose pieces did not all come within this long is given up (``unanswered``).
PENDING_MAX_S = 300.0
#: Evidence a stage-mate checks at once (more is answered "busy": the auditor's other mates check it).
_CHECKING_MAX = 2
#: The last commits that drew a part this peer remembers, to check a notice of a refused audit against.
_DRAWS_KEEP = 64
#: The (owner, round, part) triples whose evidence this peer checked (each is checked once).
_CHECKED_KEEP = 256


class AuditHost(Protocol):
    """What the auditor uses of its averager (``averager.AllReduceAverager``)."""

    executor: StageExecutor
    peer_id: str
    identity: Identity | None
    client: DataPlaneClient
    owners: dict[tuple[str, int], PartOwner]
    suspicions: Suspicions
    hostile_convictions: Counter[str]

    async def mates_to_tell(self, accused: str, what: str) -> list[str]: ...

    def _own(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...

    def _excluded_as_hostile(self, peer_id: str) -> bool: ...

    def exclude_hostile(self, peer_id: str, why: str) -> float: ...


@dataclass
class _Pending:
    """An audit under way: the commit it audits, the pieces of the owner's evidence fetched so far, and the
    requests the owner left unanswered (``noticed``: started by a stage-mate's notice, ``suspected``: by this
    peer's check of the mean, not by this peer's draw; both fetch every piece at once)."""

    plan: RoundPlan
    decision: Decision
    part: int
    pieces: list[PartEvidence]
    started: float
    noticed: bool = False
    suspected: bool = False  # started by this peer's own check of the committed mean (``suspect``)
    # how it ended, for a member holding its commit until then (``suspect``): "" the mean holds up, else why not
    verdict: str | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    failures: int = 0  # requests for a piece unanswered while the owner answered a cheap one (``_alive``)
    unreachable: int = 0  # requests for a piece unanswered when the owner answered nothing (gone)
    fetching: bool = False

    @property
    def owner(self) -> str:
        return self.plan.owners[self.part]


def _taking_part(plan: RoundPlan, decision: Decision) -> set[str]:
    """The members whose parts a commit holds."""
    return set(plan.member_ids) - set(decision.dropped)


class PartAuditor:
    """The audits of one averager: its draws, its answers as an owner, its checks of others' evidence."""

    def __init__(self, av: AuditHost) -> None:
        self.av = av
        self.share = AUDIT_SHARE  # the commits audited (``audit.draw``: tests audit every one)
        self.timeout_s = AUDIT_TIMEOUT_S  # one request for a piece (tests of an owner that hangs shorten it)
        self.counts: Counter[str] = Counter()
        self._checked: OrderedDict[tuple[str, str, int], None] = OrderedDict()
        self._checking = 0
        # this peer's audits under way: the one its own draw started, and those stage-mates' notices started
        self._pending: dict[tuple[str, int], _Pending] = {}
        self.fetching = 0  # its fetches of a piece now (``scripts/bench_averaging.py`` counts them in their round)
        # the evidence of drawn parts this peer reduced, past their round (``evidence_store``: set by the averager)
        self.kept: KeptEvidence = KeptEvidence()
        # the last commits this peer applied that drew a part (whoever audits it): round id -> (plan, commit, part)
        self._draws: OrderedDict[str, tuple[RoundPlan, Decision, int]] = OrderedDict()
        self._early: OrderedDict[str, ArQuery] = OrderedDict()  # notices of rounds this peer has not applied yet
        # parts this peer reduced that no commit drew, their evidence kept ``KEEP_ROUNDS`` rounds more (``suspect``)
        self._recent: list[PartOwner] = []

    # ---- auditor -----------------------------------------------------------------------------

    def after_commit(self, plan: RoundPlan, decision: Decision, signature: bytes | None) -> None:
        """A commit this member applied: fetch the next piece of each audit under way (one a round), and start
        auditing the part the commit draws if the draw names this peer (one audit of its own at a time: owned
        tasks). An owner that answered nothing is asked again once it is back in a commit; one away past
        ``PENDING_MAX_S`` is given up (``unanswered``)."""
        av = self.av
        now = time.monotonic()
        for key, pending in list(self._pending.items()):
            if now - pending.started > PENDING_MAX_S:
                del self._pending[key]
                self.counts["unanswered"] += 1
                log.info("stage %d: the owner %s of part %d of round %s did not show it for an audit within %.0fs "
                         "(gone: it answered nothing %d times); given up", av.executor.stage, pending.owner[:12],
                         pending.part, pending.plan.round_id, PENDING_MAX_S, pending.unreachable)
            elif not pending.fetching and (not pending.unreachable or pending.owner in _taking_part(plan, decision)):
                self._fetch_next(pending)  # (an owner that answered nothing: asked again once it is back in a commit)
        if av.identity is None or signature is None:  # (nothing signed: nothing an audit could show)
            return
        drawn = self.drawn(plan, decision, signature)
        if drawn is not None:  # (what a stage-mate's notice of a refused audit is checked against: ``on_refused``)
            self._draws[plan.round_id] = (plan, decision, drawn[0])
            while len(self._draws) > _DRAWS_KEEP:
                self._draws.popitem(last=False)
            early = self._early.pop(plan.round_id, None)
            if early is not None:  # (a notice that came before this peer applied the commit)
                self._take_notice(early)
        if drawn is None or drawn[1] != av.peer_id or plan.owners[drawn[0]] in av.suspicions.excluded():
            return
        if any(not (p.noticed or p.suspected or p.unreachable) for p in self._pending.values()):
            self.counts["skipped"] += 1  # (auditing another part still; one whose owner is away does not hold it up)
            return
        self.counts["drawn"] += 1
        self._start(_Pending(plan, decision, drawn[0], [], time.monotonic()))

    async def suspect(self, plan: RoundPlan, decision: Decision, signature: bytes | None,
                      suspected: list[tuple[int, float]], wait_s: float) -> str | None:
        """A commit this member is about to apply holds part means that point against this member's own slices
        of them (``audit.SUSPECT_BELOW``, with the cosine): audit such a part now, every piece at once, whatever
        the draw (one such audit at a time; each (owner, round, part) once; the owner kept its evidence:
        ``release_later``), and wait up to ``wait_s`` for the verdict. Why this member must not apply the commit
        (its owner convicted or unaccountable, or excluded as hostile already), or None: it holds up, or no
        verdict came in time (applied then, as any commit: the audit goes on and excludes a liar later)."""
        av = self.av
        if av.identity is None or signature is None or decision.status != "commit":
            return None
        for part, _ in suspected:
            owner = plan.owners[part]
            if owner != av.peer_id and av._excluded_as_hostile(owner):
                return f"part {part}'s owner {owner[:12]} is excluded here as hostile"
        started: list[_Pending] = []
        for part, cos in suspected:
            owner = plan.owners[part]
            key = (owner, plan.round_id, part)
            if owner == av.peer_id or key in self._checked or (plan.round_id, part) in self._pending:
                continue
            if any(p.suspected for p in self._pending.values()):
                self.counts["skipped"] += 1
                continue
            self._remember(key)
            self.counts["suspected"] += 1
            log.warning("stage %d step %d: part %d's mean points against this peer's own slice (cosine %.2f): "
                        "auditing its owner %s before applying it", av.executor.stage, plan.step, part, cos,
                        owner[:12])
            pending = _Pending(plan, decision, part, [], time.monotonic(), suspected=True)
            self._start(pending)
            started.append(pending)
        for pending in started:
            try:
                await asyncio.wait_for(pending.ended.wait(), wait_s)
            except asyncio.TimeoutError:
                log.info("stage %d step %d: no verdict on part %d within %.0fs: applied; its audit goes on",
                         av.executor.stage, plan.step, pending.part, wait_s)
                continue
            if pending.verdict:
                return f"part {pending.part}'s owner {pending.owner[:12]}: {pending.verdict}"
        return None

    def drawn(self, plan: RoundPlan, decision: Decision, signature: bytes | None) -> tuple[int, str] | None:
        """The part a commit audits and its auditor (``audit.draw`` at this peer's share), or None. An owner
        keeps that part's evidence past ``KEEP_ROUNDS`` rounds (``keep``, ``release_later``): every peer runs with
        the same share."""
        if signature is None or decision.status != "commit":
            return None
        left_out = [*decision.dropped, *(pid for pid, _ in decision.refused)]
        return draw(decision.message(), signature, plan.owners, plan.member_ids, left_out, self.share)

    def _start(self, pending: _Pending) -> None:
        key = (pending.plan.round_id, pending.part)
        if key not in self._pending:
            self._pending[key] = pending
            self._fetch_next(pending)

    def _fetch_next(self, pending: _Pending) -> None:
        self.fetching += 1
        pending.fetching = True
        self.av._own(self._fetch(pending), "swarmd-audit")

    async def _fetch(self, pending: _Pending) -> None:
        try:
            # a piece a commit; an audit a notice or a suspicion started takes them all at once (rare), so its
            # verdict does not wait for commits that may wait for it (trainers route to the owner until then)
            while await self._fetch_piece(pending) and (pending.noticed or pending.suspected):
                pass
        finally:
            self.fetching -= 1
            pending.fetching = False

    async def _fetch_piece(self, pending: _Pending) -> bool:
        """The next piece of the owner's evidence; with the last, check it all and judge the owner. True when a
        piece came and more are to come."""
        av, plan, part = self.av, pending.plan, pending.part
        owner, stage = pending.owner, av.executor.stage
        start = sum(len(p.part_frames) for p in pending.pieces)
        query = ArQuery(stage, plan.round_id, part, index=start)
        while True:
            try:
                frame = await av.client.allreduce(plan.addr(owner), "slices", query.encode, timeout_s=self.timeout_s)
                break
            except (PeerError, SwarmdError) as exc:
                if not await self._alive(pending):  # (gone, or cut off from this peer: not held to account for it)
                    pending.unreachable += 1
                    return False  # (asked again once it takes part in a commit again, within ``PENDING_MAX_S``)
                pending.failures += 1
                log.info("stage %d step %d: the owner %s of part %d did not answer its audit though it answers "
                         "otherwise (%d of %d: %s)", stage, plan.step, owner[:12], part, pending.failures,
                         AUDIT_ATTEMPTS, str(exc)[:200])
                if pending.failures >= AUDIT_ATTEMPTS:
                    await self._unaccountable(pending, f"{AUDIT_ATTEMPTS} requests for it unanswered while it "
                                                       f"answered others ({str(exc)[:120]})")
                    return False
                # asked again a moment later, not after the next commit: a stage whose rounds wait for this verdict
                # (its trainers route to the owner until a second mate excludes it) would wait for ever
                await asyncio.sleep(self.timeout_s / 4)
        if frame.kind == ArAck.KIND:
            try:
                reason = ArAck.from_frame(frame).reason
            except RequestError as exc:
                reason = str(exc)
            if pending.suspected and av.executor.step > plan.step + KEEP_ROUNDS:
                # this peer moved on past the rounds an owner keeps an undrawn part for: it may be gone honestly
                self._end(pending)
                self._conclude(pending, "")
                self.counts["unanswered"] += 1
                return False
            await self._unaccountable(pending, f"it refused ({reason[:200]})")
            return False
        try:
            piece = await asyncio.to_thread(PartEvidence.decode, frame)
        except RequestError as exc:
            await self._unaccountable(pending, f"its answer does not read ({exc})", unprovable=True)
            return False
        ready = piece.ready
        if (piece.stage != stage or ready.owner != owner or ready.round_id != plan.round_id or ready.part != part
                or ready.digest != pending.decision.digests[part] or piece.piece_of is None
                or piece.piece_of[0] != start):
            await self._unaccountable(pending, "its evidence is of another part, piece, or a mean not committed",
                                      unprovable=True)
            return False
        pending.pieces.append(piece)
        pending.failures = pending.unreachable = 0
        if start + len(piece.part_frames) < piece.piece_of[1]:
            return True  # the next piece with the next commit
        self._end(pending)
        evidence = PartEvidence.assemble(pending.pieces)
        if isinstance(evidence, str):
            await self._unaccountable(pending, evidence, unprovable=True)
            return False
        verdict = await asyncio.to_thread(evidence.check)
        if isinstance(verdict, str):
            await self._unaccountable(pending, verdict, unprovable=True)
            return False
        if verdict.why is None:
            self._conclude(pending, "")
            self.counts["ok"] += 1
            log.debug("stage %d step %d: audited part %d of %s: its mean holds up (%.2g)", stage, plan.step, part,
                      owner[:12], verdict.distance)
            return False
        self.counts["mismatch"] += 1
        self._conclude(pending, f"convicted by an audit ({verdict.why[:200]})")
        self._convict(owner, verdict.why, "convicted")
        await self._show(owner, evidence)
        return False

    async def _alive(self, pending: _Pending) -> bool:
        """Whether the owner answers at all: a cheap request of the same round (its decision, not waited for)
        within the audit's timeout. One that answers it but not its audit is hiding its evidence."""
        q = ArQuery(self.av.executor.stage, pending.plan.round_id, wait_s=0.0)
        try:
            await self.av.client.allreduce(pending.plan.addr(pending.owner), "decision", q.encode,
                                           timeout_s=self.timeout_s)
        except (PeerError, SwarmdError):
            return False
        return True

    @staticmethod
    def _conclude(pending: _Pending, verdict: str) -> None:
        """The audit's outcome, for a member holding its commit until then (``suspect``)."""
        pending.verdict = verdict
        pending.ended.set()

    def _end(self, pending: _Pending) -> None:
        key = (pending.plan.round_id, pending.part)
        if self._pending.get(key) is pending:
            del self._pending[key]

    async def _unaccountable(self, pending: _Pending, why: str, *, unprovable: bool = False) -> None:
        """The owner would not show its evidence (refused, let ``AUDIT_ATTEMPTS`` requests go unanswered while it
        answered others, or showed what does not hold up): held to account as if it had shown a lie.
        Excluded here; a peer that audited it by its own draw tells the stage-mates, who audit it themselves."""
        self._end(pending)  # (a no-op where it ended already)
        self._conclude(pending, f"unaccountable ({why[:200]})")
        plan, owner = pending.plan, pending.owner
        if unprovable:
            self.counts["unprovable"] += 1
        self.counts["unaccountable"] += 1
        if pending.noticed:
            self.counts["seconded"] += 1
        log.warning("stage %d step %d: the owner %s of part %d would not show it for an audit (%s)",
                    self.av.executor.stage, plan.step, owner[:12], pending.part, why[:200])
        self._convict(owner, f"unaccountable: part {pending.part} of round {plan.round_id}: {why[:200]}",
                      "seconded the exclusion of" if pending.noticed else "excluded")
        if not pending.noticed and not pending.suspected:  # (mates that suspect the part audit it themselves)
            await self._notify(pending)

    async def _notify(self, pending: _Pending) -> None:
        """Tell every listed stage-mate (but the owner) which commit's part its owner would not show: each audits
        it itself (``on_refused``)."""
        raw = ArQuery(self.av.executor.stage, pending.plan.round_id, pending.part).encode()
        await self._tell(pending.owner, "the refused audit", "refused", raw)

    async def _tell(self, owner: str, what: str, op: str, raw: bytes) -> None:
        """Post ``raw`` (``POST /v1/allreduce/<op>``) to every listed stage-mate but ``owner`` and this peer; those
        that took it are counted (``shown``)."""
        av = self.av
        targets = await av.mates_to_tell(owner, what)

        async def one(addr: str) -> bool:
            try:
                frame = await av.client.allreduce(addr, op, lambda: raw, len(raw), timeout_s=self.timeout_s)
                return ArAck.from_frame(frame).ok
            except (PeerError, SwarmdError):
                return False

        taken = await asyncio.gather(*(one(addr) for addr in targets))
        self.counts["shown"] += sum(taken)

    def _convict(self, owner: str, why: str, how: str) -> None:
        av = self.av
        av.hostile_convictions[owner] += 1
        period = av.exclude_hostile(owner, f"audited: {why}")
        log.warning("stage %d: %s part owner %s by an audit (%s); excluded from this peer's rounds for %.0fs",
                    av.executor.stage, how, owner[:12], why, period)

    async def _show(self, owner: str, evidence: PartEvidence) -> None:
        """Post the evidence to every listed stage-mate but the owner and this peer."""
        await self._tell(owner, "the audit", "audit", await asyncio.to_thread(evidence.encode))

    # ---- owner -------------------------------------------------------------------------------

    async def on_slices(self, q: ArQuery) -> bytes:
        """An auditor asks for a part this peer reduced: its evidence, or an ack saying why none."""
        # (kept by the daemon across stages: an owner that moved to another stage still shows what it reduced)
        kept = await self.kept.get(q.round_id, q.part)
        evidence: PartEvidence | str | None = kept if kept is not None and kept.stage == q.stage else None
        owner = self.av.owners.get((q.round_id, q.part))
        if evidence is None and owner is not None and q.stage == self.av.executor.stage:
            evidence = evidence_of(owner, q.stage)
        if evidence is None:
            return ArAck(False, "this peer holds no such part (a round forgotten, or never reduced here)").encode()
        if isinstance(evidence, str):
            return ArAck(False, evidence).encode()
        piece = evidence.piece(q.index)
        if piece is None:
            return ArAck(False, f"this part holds {len(evidence.part_frames)} slices").encode()
        return await asyncio.to_thread(piece.encode)

    def release_later(self, owner: PartOwner) -> None:
        """A part this peer reduced that its commit did not draw: its members' frames are dropped once this peer
        releases a round ``KEEP_ROUNDS`` steps later (until then a member that suspects it can audit it)."""
        self._recent.append(owner)
        newest = owner.plan.step
        keep = []
        for o in self._recent:
            if o.plan.step < newest - KEEP_ROUNDS:
                o.release()
            else:
                keep.append(o)
        self._recent = keep

    def keep(self, owner: PartOwner) -> None:
        """A part this peer reduced that a commit drew for an audit: its evidence kept past the round (``kept``)."""
        evidence = evidence_of(owner, self.av.executor.stage)
        if not isinstance(evidence, str):
            self.av._own(self.kept.put(owner.plan.round_id, owner.part, evidence), "swarmd-audit-keep")

    # ---- stage-mate --------------------------------------------------------------------------

    def on_refused(self, q: ArQuery) -> ArAck:
        """A stage-mate says the owner of part ``q.part`` of round ``q.round_id`` would not show it for an audit.
        Nothing in the notice is taken on trust: if this peer applied that commit and the commit drew that part
        (its last ``_DRAWS_KEEP`` such commits), it audits the owner itself (``noticed``), once per (owner, round,
        part)."""
        av = self.av
        if q.stage != av.executor.stage:
            return ArAck(False, "another stage")
        if q.round_id not in self._draws:
            # the auditor may have applied the commit (and been refused) before this peer did: kept until it does
            self._early[q.round_id] = q
            while len(self._early) > _DRAWS_KEEP:
                self._early.popitem(last=False)
            return ArAck(True, "noted: checked once this peer applies that commit")
        return self._take_notice(q)

    def _take_notice(self, q: ArQuery) -> ArAck:
        av = self.av
        plan, decision, part = self._draws[q.round_id]
        if part != q.part:
            return ArAck(False, "that commit did not draw that part for an audit")
        owner = plan.owners[q.part]
        if owner == av.peer_id:
            return ArAck(False, "this peer owns that part")
        key = (owner, q.round_id, q.part)
        if key in self._checked or (q.round_id, q.part) in self._pending:
            return ArAck(True, "audited already")
        if av._excluded_as_hostile(owner):
            return ArAck(True, "ignored: excluded already")
        if sum(p.noticed for p in self._pending.values()) >= _CHECKING_MAX:
            self.counts["busy"] += 1
            return ArAck(False, "busy: auditing other owners")
        self._remember(key)
        self.counts["noticed"] += 1
        self._start(_Pending(plan, decision, q.part, [], time.monotonic(), noticed=True))
        return ArAck(True, "auditing")

    def _remember(self, key: tuple[str, str, int]) -> None:
        self._checked[key] = None
        while len(self._checked) > _CHECKED_KEEP:
            self._checked.popitem(last=False)

    async def on_audit(self, frame: Frame) -> ArAck:
        """Evidence an auditor shows: checked in an owned task (RequestError: malformed, a 422)."""
        evidence = await asyncio.to_thread(PartEvidence.decode, frame)
        av, ready = self.av, evidence.ready
        if evidence.stage != av.executor.stage:
            return ArAck(False, "another stage")
        key = (ready.owner, ready.round_id, ready.part)
        if key in self._checked:
            return ArAck(True, "checked already")
        if ready.owner == av.peer_id:
            return ArAck(False, "this peer owns that part")
        if av._excluded_as_hostile(ready.owner):
            return ArAck(True, "ignored: excluded already")
        if self._checking >= _CHECKING_MAX:
            self.counts["busy"] += 1
            return ArAck(False, "busy: checking other evidence")
        self._remember(key)
        self._checking += 1
        av._own(self._second(evidence), "swarmd-audit-check")
        return ArAck(True, "checking")

    async def _second(self, evidence: PartEvidence) -> None:
        try:
            verdict = await asyncio.to_thread(evidence.check)
        finally:
            self._checking -= 1
        owner = evidence.ready.owner
        if isinstance(verdict, str) or verdict.why is None:
            self.counts["not_seconded"] += 1
            log.warning("stage %d: an audit of part owner %s shown here does not hold up (%s)",
                        self.av.executor.stage, owner[:12], verdict if isinstance(verdict, str)
                        else "its mean is the rule's")
            return
        self.counts["seconded"] += 1
        self._convict(owner, verdict.why, "seconded the conviction of")

    def status(self) -> dict[str, int]:
        return dict(self.counts)
