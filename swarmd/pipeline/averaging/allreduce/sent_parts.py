"""What an all-reduce member sent, checked part by part against its opening (issue #29, item 3).

The single leader checks an opening's ``sent`` sketch against its own sketch of the contribution it
received. In the chunked all-reduce no peer receives a contribution whole, so a member could open its
true microbatches and sign the sketch of its *true* contribution as ``sent`` while sending its owners
another (flipped, say): a consistent opening, and its lie in every mean (``scripts/bench_verify.py --lies
flipsigned``: never excluded before this). So:

* **Per part.** A member's opening also signs ``sent_parts``: the sketch of each part it sent, as that
  part's owner decoded it, under the opening's seed (``contribution_proofs.sketch_pieces``: the same
  CountSketch restricted to the part's range, so the rows add up to ``sent``; the coordinator refuses an
  opening whose rows do not: ``bad``).
* **The coordinator's own part.** The coordinator owns part 0: at the commit it sketches each member's slice
  of it under that member's seed (``member._own_part_sketch``), and an opening that misstates it is
  ``misstated`` (``openings.judge``): convicted here on the coordinator's own evidence (the member's signed
  slice and its signed opening), which it posts to the stage-mates (below).
* **One other part, drawn.** After an ``ok`` opening the coordinator draws, with its own secret randomness,
  one of the parts owned by neither it nor the member, and asks that part's owner for its sketch of the
  member's slice under the opening's seed (``POST /v1/allreduce/sketch``: ``K`` floats). Where they agree,
  nothing more. Where they do not, either the member or the owner lies: it asks the owner for the member's
  frame of that part (``frame``), checks it is the slice whose range and digest the member's opening signs
  (:func:`signed_slice`, as the stage-mates do) and sketches it itself. A
  frame that matches the opening clears the member (the owner's sketch was wrong: ``sent_owner_wrong``); one
  that does not convicts the member on its own signatures (``hostile: unaccountable contribution``). An owner
  that cannot answer is counted (``sent_unchecked``), never held against the member.
* **Seconded.** Either conviction rests on the member's signatures alone: its opening signs each part's
  range and digest (``Opening.sent_bounds``, ``sent_digests``, which hash to the claim digest its seed
  hashes) and the frame it sent carries that part's slice. The coordinator posts both to the stage-mates
  (``POST /v1/recheck``, ``PartRecheckRequest``); each checks them (:func:`check_shown_part`), sketches the
  slice itself and seconds when the signed sketch is not that slice's (:meth:`SentPartChecks.consider_recheck`):
  the coordinator is only the messenger, so it cannot frame an honest member, whose signed sketches hold.
  Two stage-mates excluding the member, the trainers route around it.

A member that flips every part is caught at its first opening (part 0); one that flips only parts owned by
others, at the first draw of one of them (with three members, one part is drawable: every round). What it
costs: ``(n + 1) K`` floats more in each opening (``n`` parts), one range sketch per member at the commit and
one per drawn query at an owner (the indices drawn up to the part's end: at most a whole sketch's), and one
small request per member and round at the coordinator; a member's slice travels only when an owner and a
member disagree.

``/status`` averaging ``openings``: ``sent_own_checked`` and ``misstated`` (part 0 checked, convictions on it),
``sent_checked``, ``sent_mismatch`` (a drawn part checked, convictions on it), ``sent_owner_wrong``,
``sent_unchecked``, ``sent_skipped``. A round of two members has no drawable part: part 0 and the member's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from swarmd.errors import PeerError, RequestError, SwarmdError
from swarmd.net.messages import PartRecheckRequest
from swarmd.net.wire import Frame, decode_frame
from swarmd.pipeline.averaging.allreduce.messages import ArAck, ArPart, ArPartQuery, ArSketch
from swarmd.pipeline.averaging.allreduce.plan import claim_digest
from swarmd.pipeline.averaging.trust.contribution_proofs import TOLERANCE, K, Opening, gap, proof_seed, sketch_pieces
from swarmd.pipeline.averaging.trust.round_checks import tensor_digest
from swarmd.pipeline.reports import MisbehaviourReport

if TYPE_CHECKING:
    from swarmd.net.client import DataPlaneClient
    from swarmd.pipeline.averaging.allreduce.openings import ArAwaited
    from swarmd.pipeline.averaging.allreduce.owner import PartOwner
    from swarmd.pipeline.averaging.trust.accusations import Evidence
    from swarmd.pipeline.averaging.trust.contribution_proofs import OpeningEvidence
    from swarmd.pipeline.stage.executor import StageExecutor

__all__ = ["QUERY_TIMEOUT_S", "SentPartChecks", "ShownPart", "check_shown_part", "received_slice",
           "signed_slice"]

log = logging.getLogger(__name__)

#: How long one question to an owner may take.
QUERY_TIMEOUT_S = 10.0
#: Sketches an owner computes for the coordinators' questions at once (more are answered ``busy``).
MAX_ANSWERING = 2
#: Checks one coordinator runs at once (more drawn meanwhile are skipped, counted ``sent_skipped``).
MAX_CHECKING = 4


def received_slice(owner: PartOwner, peer_id: str) -> torch.Tensor | None:
    """(Off the loop) ``peer_id``'s slice of ``owner``'s part as decoded there, from the member's signed frame it
    keeps for audits (the decoded slices are dropped once reduced); None when it keeps none."""
    raw = owner.frames.get(peer_id)
    if raw is None:
        return None
    lo, hi = owner.plan.bounds[owner.part]
    try:
        return ArPart.from_frame(decode_frame(raw), hi - lo).grads
    except (RequestError, ValueError):
        return None


@dataclass(frozen=True)
class ShownPart:
    """A conviction on a part a member sent, as a stage-mate receives it, its signatures and digests checked
    (:func:`check_shown_part`): the reporter's report, the accused's opening, the part, its range's start and its
    slice, and the seed of the opening's sketches."""

    report: MisbehaviourReport
    opening: Opening
    part: int
    lo: int
    piece: torch.Tensor
    seed: int

    @property
    def step(self) -> int:
        return self.opening.evidence.step


def signed_slice(opening: Opening, j: int, frame: Frame, numel: int) -> tuple[int, ArPart, torch.Tensor]:
    """The start of part ``j``'s range, the member's part frame of it and its slice, when ``frame`` is the slice
    whose range and digest the member's ``opening`` signs (``RequestError`` naming what is not): what the
    coordinator and the stage-mates judge a member's sketch of a part by. Off the loop (it hashes the slice)."""
    if not j < len(opening.sent_parts):
        raise RequestError(f"the opening signs no sketch of part {j} of what it sent")
    lo, hi = opening.sent_bounds[j]
    if hi > numel:
        raise RequestError(f"part {j} lies outside this stage's {numel} gradients")
    part = ArPart.from_frame(frame, hi - lo)
    piece = part.grads
    if part.peer_id != opening.evidence.peer_id or piece is None:
        raise RequestError("the frame is not a slice the accused sent")
    if tensor_digest(piece) != opening.sent_digests[j]:
        raise RequestError(f"the frame is not the slice of part {j} the accused's opening signs")
    return lo, part, piece


def check_shown_part(req: PartRecheckRequest, numel: int) -> ShownPart:
    """Everything but the sketch (off the loop: it decodes and hashes a slice); ``RequestError`` naming what does
    not hold: the report's signature and kind, the opening's signature by the accused and the report resting on
    it, a signed sketch, range and digest for the part (the digests hashing to its claim's, the seed's), and the
    frame's slice being that part of the accused's, of the digest the opening signs."""
    report = MisbehaviourReport.decode(req.body, req.signature)
    if report.kind != "averaging":
        raise RequestError("a recheck's report must be an 'averaging' one")
    opening = Opening.decode(req.opening)
    ev = opening.evidence
    ev.verify(report.stage, report.accused)
    if report.evidence != ev.encode():
        raise RequestError("a recheck's report must rest on the opening it carries (its evidence)")
    if not opening.lead:
        raise RequestError("a recheck's opening signs no seed for sketches of what it sent")
    if claim_digest(opening.sent_digests) != ev.digest:
        raise RequestError("a recheck's opening signs parts' digests that are not those its seed hashes")
    try:
        lo, _, piece = signed_slice(opening, req.part, decode_frame(req.frame), numel)
    except RequestError as exc:
        raise RequestError(f"a recheck's part: {exc}") from exc
    seed = proof_seed(ev.stage, ev.step, ev.leader, opening.lead, ev.digest)
    return ShownPart(report, opening, req.part, lo, piece, seed)


class SentHost(Protocol):
    """What the checks use of their averager (``averager.AllReduceAverager``)."""

    executor: StageExecutor
    peer_id: str
    client: DataPlaneClient
    owners: dict[tuple[str, int], PartOwner]
    hostile_convictions: Counter[str]
    openings: Counter[str]
    accusations: Counter[str]
    _opening_convictions: dict[str, str]
    _rechecked: dict[tuple[str, int], None]

    def _own(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...

    def convicts(self) -> bool: ...

    def _excluded_as_hostile(self, peer_id: str) -> bool: ...

    def exclude_hostile(self, peer_id: str, why: str) -> float: ...

    def _convict_on_opening(self, peer_id: str, why: str, step: int) -> float: ...

    def _warn(self, peer_id: str, reason: str, msg: str, *args: Any) -> None: ...

    def _post_accusation(self, accused: str, evidence: Evidence | OpeningEvidence, step: int, counter: str,
                         shown: tuple[bytes, int, torch.Tensor, torch.Tensor] | None = None,
                         part_shown: tuple[bytes, int, bytes] | None = None) -> None: ...


class SentPartChecks:
    """An owner's answers about the slices it holds, and a coordinator's drawn checks (module docstring)."""

    def __init__(self, av: SentHost) -> None:
        self.av = av
        self.timeout_s = QUERY_TIMEOUT_S
        self.answering = 0
        self.checking = 0
        self.rechecking = 0

    # ---- the owner's side --------------------------------------------------------------------

    async def answer_sketch(self, q: ArPartQuery) -> bytes:
        """``sketch``: this owner's sketch of the member's slice under the coordinator's seed."""
        if q.stage != self.av.executor.stage:
            return ArAck(False, "this peer serves another stage").encode()
        owner = self.av.owners.get((q.round_id, q.part))
        if owner is None or q.peer_id not in owner.frames:
            return ArAck(False, "this peer holds no such slice").encode()
        if self.answering >= MAX_ANSWERING:
            return ArAck(False, "busy: too many sketches asked at once").encode()
        lo, numel = owner.plan.bounds[owner.part][0], self.av.executor.grad_numel

        def sketched() -> torch.Tensor | None:
            piece = received_slice(owner, q.peer_id)
            return None if piece is None else sketch_pieces([(lo, piece)], q.seed, numel)[0]

        self.answering += 1
        try:
            row = await asyncio.to_thread(sketched)
        finally:
            self.answering -= 1
        if row is None:
            return ArAck(False, "this peer holds no such slice").encode()
        return ArSketch(tuple(float(x) for x in row.tolist())).encode()

    def answer_frame(self, q: ArPartQuery) -> bytes:
        """``frame``: the member's signed part frame as this owner received it."""
        owner = self.av.owners.get((q.round_id, q.part))
        frame = owner.frames.get(q.peer_id) if owner is not None and q.stage == self.av.executor.stage else None
        if frame is None:
            return ArAck(False, "this peer keeps no such frame").encode()
        return frame

    # ---- the coordinator's side --------------------------------------------------------------

    def consider(self, pid: str, awaited: ArAwaited, raw: bytes) -> None:
        """After ``pid``'s opening ``raw`` was judged ``ok`` (on the loop): draw one part owned by neither this
        coordinator nor the member, and check it in an owned task."""
        av = self.av
        if not av.convicts() or not awaited.bounds or len(awaited.owners) != len(awaited.bounds):
            return
        drawable = [j for j, (owner, _) in enumerate(awaited.owners) if owner not in (av.peer_id, pid)]
        if not drawable:
            return
        if self.checking >= MAX_CHECKING:
            av.openings["sent_skipped"] += 1
            return
        j = drawable[secrets.randbelow(len(drawable))]
        self.checking += 1
        av._own(self._check(pid, awaited, raw, j), "swarmd-ar-sent-part")

    async def _check(self, pid: str, awaited: ArAwaited, raw: bytes, j: int) -> None:
        try:
            await self._check_part(pid, awaited, raw, j)
        finally:
            self.checking -= 1

    async def _ask(self, addr: str, op: str, q: ArPartQuery) -> Any:
        """The owner's answer frame (None: it did not answer)."""
        try:
            return await self.av.client.allreduce(addr, op, q.encode, timeout_s=self.timeout_s)
        except (PeerError, SwarmdError) as exc:
            log.info("stage %d: the owner at %s did not answer a %s question (%s)", self.av.executor.stage, addr, op,
                     str(exc)[:200])
            return None

    async def _check_part(self, pid: str, awaited: ArAwaited, raw: bytes, j: int) -> None:
        av, ex = self.av, self.av.executor
        opening = await asyncio.to_thread(Opening.decode, raw)  # (judged ``ok`` already: it reads)
        claimed = opening.sent_parts[j]
        owner, addr = awaited.owners[j]
        seed = proof_seed(ex.stage, awaited.step, av.peer_id, awaited.lead, awaited.claim)
        q = ArPartQuery(ex.stage, awaited.round_id, j, pid, seed)
        answer = await self._ask(addr, "sketch", q)
        try:
            row = ArSketch.from_frame(answer, K).row if answer is not None and answer.kind == ArSketch.KIND else None
        except RequestError:
            row = None
        if row is None:
            av.openings["sent_unchecked"] += 1
            return
        av.openings["sent_checked"] += 1
        if gap(claimed, (0.0,) * K, row) <= TOLERANCE:
            return
        # the member or the owner lies: the member's slice, of the digest its opening signs, decides
        framed = await self._ask(addr, "frame", q)
        try:
            if framed is None or framed.kind != ArPart.KIND:
                raise RequestError("no frame")
            lo, part, piece = await asyncio.to_thread(signed_slice, opening, j, framed, ex.grad_numel)
        except RequestError as exc:
            av.openings["sent_unchecked"] += 1
            log.info("stage %d step %d: the owner %s of part %d disagrees with %s's opening and shows no signed slice "
                     "of it (%s)", ex.stage, awaited.step, owner[:12], j, pid[:12], exc)
            return
        own_row = (await asyncio.to_thread(sketch_pieces, [(lo, piece)], seed, ex.grad_numel))[0]
        got = gap(claimed, (0.0,) * K, tuple(float(x) for x in own_row.tolist()))
        if got <= TOLERANCE:  # the member's opening holds: the owner's sketch was wrong
            av.openings["sent_owner_wrong"] += 1
            av._warn(owner, "sent_owner_wrong", "stage %d step %d: the owner %s of part %d sketched %s's slice wrong "
                     "(its signed slice matches its opening)", ex.stage, awaited.step, owner[:12], j, pid[:12])
            return
        if av._excluded_as_hostile(pid):
            return
        why = (f"unaccountable contribution: its opening sketches part {j} as {got:.3f} away from the part it sent "
               f"(signed) to its owner")
        av.openings["sent_mismatch"] += 1
        av._convict_on_opening(pid, why, awaited.step)
        shown = dataclasses.replace(part, wire=None, codec="none").encode()  # (its slice as decoded: its digest)
        av._post_accusation(pid, opening.evidence, awaited.step, "sent", part_shown=(raw, j, shown))

    # ---- a stage-mate's side -----------------------------------------------------------------

    async def consider_recheck(self, req: PartRecheckRequest,
                               count: Callable[[MisbehaviourReport], object]) -> tuple[str, str]:
        """A stage-mate's conviction on a part (``POST /v1/recheck``): checked (``RequestError``: a 422), the part
        sketched here, and seconded when the accused's signed sketch misstates it (then only ``count`` its
        report in this daemon's ledger). What this peer made of it, and the accused: ``seconded``,
        ``not_seconded`` or ``ignored`` (another stage, about itself, by itself or the accused, not by the
        coordinator the accused opened to, already excluded as hostile, checked before, or busy)."""
        av, ex = self.av, self.av.executor
        shown = await asyncio.to_thread(check_shown_part, req, ex.grad_numel)
        report, ev = shown.report, shown.opening.evidence
        accused, key = report.accused, (report.accused, shown.step)
        if (report.stage != ex.stage or not av.convicts() or accused == av.peer_id
                or report.reporter_id in (av.peer_id, accused) or report.reporter_id != ev.leader
                or av._excluded_as_hostile(accused) or key in av._rechecked or self.rechecking >= MAX_ANSWERING):
            return "ignored", accused
        av._rechecked[key] = None
        while len(av._rechecked) > 256:
            av._rechecked.pop(next(iter(av._rechecked)))
        self.rechecking += 1
        try:
            row = (await asyncio.to_thread(sketch_pieces, [(shown.lo, shown.piece)], shown.seed, ex.grad_numel))[0]
        finally:
            self.rechecking -= 1
        got = gap(shown.opening.sent_parts[shown.part], (0.0,) * K, tuple(float(x) for x in row.tolist()))
        av.accusations["rechecked"] += 1
        if got <= TOLERANCE:
            av.accusations["not_seconded"] += 1
            av._warn(accused, "not_seconded", "stage %d: %s accuses %s of misstating part %d of step %d; not "
                     "seconded: its signed sketch is %.2e from the slice, it holds", ex.stage, report.reporter_id[:12],
                     accused[:12], shown.part, shown.step, got)
            return "not_seconded", accused
        if av._excluded_as_hostile(accused):  # convicted meanwhile
            return "ignored", accused
        why = (f"unaccountable contribution: its opening sketches part {shown.part} of step {shown.step} as {got:.3f} "
               f"away from the part it sent (signed), as {report.reporter_id[:12]} found")
        av.accusations["seconded"] += 1
        count(report)
        period = av.exclude_hostile(accused, why)
        log.warning("stage %d: seconded %s's conviction of %s on a part it sent (%s); excluded from this peer's "
                    "rounds for %.0fs", ex.stage, report.reporter_id[:12], accused[:12], why, period)
        return "seconded", accused

