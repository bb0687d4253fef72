"""A peer's part in the audits of part owners (``audit``: the rule, the draw, the evidence, the cost).

Three roles, all on ``POST /v1/allreduce/<op>``:

- **auditor**: after it applied a commit, a member the commit draws (``audit.draw``) asks the drawn
  part's owner for its evidence (``slices``), checks it and recomputes the part off the event loop; a mean
  that does not hold up convicts the owner here and the evidence goes to every listed stage-mate (``audit``);
- **owner**: answers ``slices`` with what it kept of a part it reduced (its signed ready report, the mean's
  frame, every member's signed part frame as it came: ``owner.PartOwner``, the last rounds' parts);
- **stage-mate**: checks evidence it is shown itself (signatures, then the recomputation), one at a time,
  each (owner, round, part) once, and excludes the owner too when it holds (``seconded``).

``/status`` averaging ``audits`` (``drawn``, ``ok``, ``mismatch``, ``unanswered``, ``unprovable``, ``seconded``,
``not_seconded``, ``busy``); ``/metrics`` ``swarmd_averaging_audits_total{outcome}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from swarmd.errors import PeerError, RequestError, SwarmdError
from swarmd.net.wire import Frame
from swarmd.pipeline.averaging.allreduce.audit import AUDIT_SHARE, PartEvidence, draw, evidence_of
from swarmd.pipeline.averaging.allreduce.messages import ArAck, ArQuery

if TYPE_CHECKING:
    from swarmd.dht.identity import Identity
    from swarmd.net.client import DataPlaneClient
    from swarmd.pipeline.averaging.allreduce.owner import PartOwner
    from swarmd.pipeline.averaging.allreduce.plan import Decision, RoundPlan
    from swarmd.pipeline.averaging.trust.round_checks import Suspicions
    from swarmd.pipeline.stage.executor import StageExecutor

__all__ = ["AUDIT_TIMEOUT_S", "PartAuditor"]

log = logging.getLogger(__name__)

#: How long fetching an owner's evidence, or showing it to one stage-mate, may take.
AUDIT_TIMEOUT_S = 30.0
#: An audit whose pieces did not all come within this long is given up (``unanswered``).
PENDING_MAX_S = 300.0
#: Evidence a stage-mate checks at once (more is answered "busy": the auditor's other mates check it).
_CHECKING_MAX = 2
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
    """An audit under way: the commit it audits and the pieces of the owner's evidence fetched so far."""

    plan: RoundPlan
    decision: Decision
    part: int
    pieces: list[PartEvidence]
    started: float


class PartAuditor:
    """The audits of one averager: its draws, its answers as an owner, its checks of others' evidence."""

    def __init__(self, av: AuditHost) -> None:
        self.av = av
        self.share = AUDIT_SHARE  # the commits audited (``audit.draw``: tests audit every one)
        self.counts: Counter[str] = Counter()
        self._checked: OrderedDict[tuple[str, str, int], None] = OrderedDict()
        self._checking = 0
        self._pending: _Pending | None = None  # this peer's audit under way
        self.fetching = 0  # its fetches of a piece now (``scripts/bench_averaging.py`` counts them in their round)

    # ---- auditor -----------------------------------------------------------------------------

    def after_commit(self, plan: RoundPlan, decision: Decision, signature: bytes | None) -> None:
        """A commit this member applied: fetch the next piece of the audit under way (one a round), and start
        auditing the part the commit draws if the draw names this peer (one audit at a time: owned tasks)."""
        av = self.av
        pending = self._pending
        if pending is not None and time.monotonic() - pending.started > PENDING_MAX_S:
            self._pending = pending = None
            self.counts["unanswered"] += 1
        if pending is not None and not self.fetching:
            self._fetch_next(pending)
        if av.identity is None or signature is None:  # (nothing signed: nothing an audit could show)
            return
        drawn = self.drawn(plan, decision, signature)
        if drawn is None or drawn[1] != av.peer_id or plan.owners[drawn[0]] in av.suspicions.excluded():
            return
        if pending is not None:
            self.counts["skipped"] += 1  # (auditing another part still)
            return
        self.counts["drawn"] += 1
        self._pending = _Pending(plan, decision, drawn[0], [], time.monotonic())
        self._fetch_next(self._pending)

    def drawn(self, plan: RoundPlan, decision: Decision, signature: bytes | None) -> tuple[int, str] | None:
        """The part a commit audits and its auditor (``audit.draw`` at this peer's share), or None. An owner
        keeps the evidence of that part alone (``PartOwner.release``): every peer runs with the same share."""
        if signature is None or decision.status != "commit":
            return None
        left_out = [*decision.dropped, *(pid for pid, _ in decision.refused)]
        return draw(decision.message(), signature, plan.owners, plan.member_ids, left_out, self.share)

    def _fetch_next(self, pending: _Pending) -> None:
        self.fetching += 1
        self.av._own(self._fetch(pending), "swarmd-audit")

    async def _fetch(self, pending: _Pending) -> None:
        try:
            await self._fetch_piece(pending)
        finally:
            self.fetching -= 1

    async def _fetch_piece(self, pending: _Pending) -> None:
        """The next piece of the owner's evidence; with the last, check it all and judge the owner."""
        av, plan, part = self.av, pending.plan, pending.part
        owner, stage = plan.owners[part], av.executor.stage
        start = sum(len(p.part_frames) for p in pending.pieces)
        query = ArQuery(stage, plan.round_id, part, index=start)
        try:
            frame = await av.client.allreduce(plan.addr(owner), "slices", query.encode, timeout_s=AUDIT_TIMEOUT_S)
        except (PeerError, SwarmdError) as exc:
            self._end(pending)
            self._unanswered(owner, part, plan, str(exc))
            return
        if frame.kind == ArAck.KIND:
            try:
                reason = ArAck.from_frame(frame).reason
            except RequestError as exc:
                reason = str(exc)
            self._end(pending)
            self._unanswered(owner, part, plan, reason)
            return
        try:
            piece = await asyncio.to_thread(PartEvidence.decode, frame)
        except RequestError as exc:
            self._end(pending)
            self._unprovable(owner, part, plan, str(exc))
            return
        ready = piece.ready
        if (piece.stage != stage or ready.owner != owner or ready.round_id != plan.round_id or ready.part != part
                or ready.digest != pending.decision.digests[part] or piece.piece_of is None
                or piece.piece_of[0] != start):
            self._end(pending)
            self._unprovable(owner, part, plan, "its evidence is of another part, piece, or a mean not committed")
            return
        pending.pieces.append(piece)
        if start + len(piece.part_frames) < piece.piece_of[1]:
            return  # the next piece with the next commit
        self._end(pending)
        evidence = PartEvidence.assemble(pending.pieces)
        if isinstance(evidence, str):
            self._unprovable(owner, part, plan, evidence)
            return
        verdict = await asyncio.to_thread(evidence.check)
        if isinstance(verdict, str):
            self._unprovable(owner, part, plan, verdict)
            return
        if verdict.why is None:
            self.counts["ok"] += 1
            log.debug("stage %d step %d: audited part %d of %s: its mean holds up (%.2g)", stage, plan.step, part,
                      owner[:12], verdict.distance)
            return
        self.counts["mismatch"] += 1
        self._convict(owner, verdict.why, "convicted")
        await self._show(owner, evidence)

    def _end(self, pending: _Pending) -> None:
        if self._pending is pending:
            self._pending = None

    def _unanswered(self, owner: str, part: int, plan: RoundPlan, why: str) -> None:
        self.counts["unanswered"] += 1
        log.info("stage %d step %d: the owner %s of part %d did not show it for an audit (%s)",
                 self.av.executor.stage, plan.step, owner[:12], part, why[:200])

    def _unprovable(self, owner: str, part: int, plan: RoundPlan, why: str) -> None:
        self.counts["unprovable"] += 1
        log.warning("stage %d step %d: the owner %s of part %d showed evidence that does not hold up for an "
                    "audit (%s); nothing in it convicts it before others", self.av.executor.stage, plan.step,
                    owner[:12], part, why[:200])

    def _convict(self, owner: str, why: str, how: str) -> None:
        av = self.av
        av.hostile_convictions[owner] += 1
        period = av.exclude_hostile(owner, f"audited: {why}")
        log.warning("stage %d: %s part owner %s by an audit (%s); excluded from this peer's rounds for %.0fs",
                    av.executor.stage, how, owner[:12], why, period)

    async def _show(self, owner: str, evidence: PartEvidence) -> None:
        """Post the evidence to every listed stage-mate but the owner and this peer."""
        av = self.av
        targets = await av.mates_to_tell(owner, "the audit")
        raw = await asyncio.to_thread(evidence.encode)

        async def one(addr: str) -> bool:
            try:
                frame = await av.client.allreduce(addr, "audit", lambda: raw, len(raw), timeout_s=AUDIT_TIMEOUT_S)
                return ArAck.from_frame(frame).ok
            except (PeerError, SwarmdError):
                return False

        taken = await asyncio.gather(*(one(addr) for addr in targets))
        self.counts["shown"] += sum(taken)

    # ---- owner -------------------------------------------------------------------------------

    async def on_slices(self, q: ArQuery) -> bytes:
        """An auditor asks for a part this peer reduced: its evidence, or an ack saying why none."""
        owner = self.av.owners.get((q.round_id, q.part))
        if q.stage != self.av.executor.stage or owner is None:
            return ArAck(False, "this peer holds no such part (another stage, or a round forgotten)").encode()
        evidence = evidence_of(owner, q.stage)
        if isinstance(evidence, str):
            return ArAck(False, evidence).encode()
        piece = evidence.piece(q.index)
        if piece is None:
            return ArAck(False, f"this part holds {len(evidence.part_frames)} slices").encode()
        return await asyncio.to_thread(piece.encode)

    # ---- stage-mate --------------------------------------------------------------------------

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
        self._checked[key] = None
        while len(self._checked) > _CHECKED_KEEP:
            self._checked.popitem(last=False)
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
