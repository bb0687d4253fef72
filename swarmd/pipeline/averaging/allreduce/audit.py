"""Audits of part owners: a share of the commits draws a member that recomputes one part from its signed slices.

Every member of a chunked all-reduce (``averager``) owns a part: it alone receives that part's slices
and publishes their mean, as a single leader publishes its round's. The members' checks
(``round_checks.check_answer``) bound a part mean by the norms listed with it, so an owner that does not
reduce by the rule (``owner.reduce_slices``) could publish any mean inside that box (a sign flip: under
AdamW as harmful as -20x) and every member would apply it alike (issue 29).

An audit makes that lie a conviction. The owner signs its ready report (``plan.Ready``: the digest of
the decoded mean and its used list, the members it reduced with their samples, and the members the plan
struck) before the coordinator decides; every slice it reduced came as its member's signed ``ar_part``
frame (``plan.part_message``, over the slice as decoded), which the owner keeps as it came (until
``KEEP_ROUNDS`` rounds after the round, and past that only if the commit drew that part:
``auditor.PartAuditor.release_later``, ``keep``). So the
owner's answer is a function of signed inputs, and anyone holding them recomputes it: the rule is
deterministic (peer-id order, float64), and the mean re-encoded with the owner's codec must come out as
the owner's, within ``AUDIT_TOLERANCE`` (on one build: bit for bit, measured; another build may round a
value of a lossy code to the next level). Whether a commit is audited (``AUDIT_SHARE``), which part and
who audits it are drawn from the signed commit (:func:`draw`), which exists only after every owner
signed its report: an owner cannot tell whether its part will be audited when it lies, and the auditor
is never the part's owner.

The auditor asks the owner for its evidence (``POST /v1/allreduce/slices``: :class:`PartEvidence`, the signed
ready report, the mean's frame as served and every slice's frame as it came, compressed as the members sent
them). An owner that refuses, answers what does not hold up (a slice not signed by its member, a mean whose
digest is not the one it signed), or leaves the request unanswered while it answers others, is held to account
as if it had shown a lie (``auditor``: ``unaccountable``): excluded by the auditor, and by every stage-mate
that audits it in turn, told which commit's part it would not show. A mean the recomputation does not
reproduce convicts: the auditor excludes the owner as a hostile peer (``HOSTILE_EXCLUSION_S``, growing on
repeat) and posts the same evidence to its stage-mates (``POST /v1/allreduce/audit``); each checks the
signatures and recomputes the part itself, trusting nobody, and excludes the owner too (``seconded``), so the
stage's coordinators leave it out of their plans and its progress answers name it to the trainers. The auditor
is only a messenger: it cannot forge the owner's report or a member's slice, and an honest owner's part
recomputes to its own mean.

Cost: an audited commit moves one part's slices and mean to one member (about ``|grads| x (1 + 1/n)``
bytes as the members' codec sent them), in at most ``AUDIT_ROUNDS`` pieces, one a commit the auditor
applies (the mean with the first): a peak round grows by the mean and ``ceil(n / AUDIT_ROUNDS)`` slices,
not by a whole gradient (``scripts/bench_averaging.py --audit-share``: B within 2.2 |grads| at n = 2-16
with every commit audited); and it reduces one part there (``1/n`` of the round's reduction).
``AUDIT_SHARE`` of the commits are audited, one at a time per auditor (a draw while one is under way is
skipped), so a member receives about ``AUDIT_SHARE / n`` of a gradient more per round on average. A liar
owning one of ``n`` parts is caught in a round it lies in with probability ``AUDIT_SHARE / n``
(``1/12`` in a stage of 3): the rounds it lies in before that are applied. A conviction sends the
evidence to each stage-mate once.

**Suspected parts: a mean that points against the members' own slices is audited at once.** The draw
catches a liar owning one part of ``n`` in ``AUDIT_SHARE / n`` of its rounds, and the rounds before are
applied: a sign-flipped part in the first rounds of training costs held-out loss long after its owner is
excluded (`docs/BENCHMARKS.md`: 0.98-1.01x when excluded at step 0-1, 1.06x at step 3, 1.10x at step 10). Every
member holds its own slice of every part, and an honest mean holds that slice at its weight, so the two point
the same way (cosine ~``1/sqrt(n)`` or more for slices that are otherwise unrelated; measured on ``tiny``:
median 0.76-0.97, below ``SUSPECT_BELOW`` in ~0.5% of a member's parts, against a flipped part's -0.97). A
member that sees a part's committed mean at a cosine below ``SUSPECT_BELOW`` with its own slice audits that
part itself before applying the commit (``auditor``: ``suspected``; every piece at once, one such audit at a
time, its verdict awaited ``SUSPECT_WAIT_S`` at most): evidence convicts or clears the owner, as a drawn
audit's does; a conviction (or a refusal) and the member does not apply the commit, but keeps its gradients
for the next round, without the liar. So an honest owner pays one audit's traffic for a false alarm, and the
round a short wait; and the lie is not applied where it is seen. For that, an owner keeps every part's evidence
``KEEP_ROUNDS`` rounds past its own (the members' frames as they came: about ``(KEEP_ROUNDS + 1) x |grads|`` of
memory as their codec sent them), and a refusal while the member has not moved on further is a refusal. A liar
that knows the rule can publish a mean harmful yet not against any one slice (it sees them all): the draw is
left for that one.

What is left: an owner that answers nothing at all from its audit until ``PENDING_MAX_S`` (5 minutes) has
passed (it looks gone, and is gone from the stage's rounds meanwhile: ``unanswered``); a lie inside the
tolerance (a mean within 1% of the rule's: bounded by it); an owner whose slices' members collude with it
(they sign what it wants); the rounds a liar spends before its part is drawn; heterogeneous builds that score
a slice on the other side of a strike threshold recompute another mean (an honest owner convicted that way is
the price of a threshold, as in ``hostile_contributions``; none seen on one build). The members' own slices
are not checked here: that is the owners' scoring and the openings' business.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmd.dht.identity import peer_id_of, verify
from swarmd.errors import RequestError, WireError
from swarmd.net.codecs import CODECS
from swarmd.net.wire import Frame, decode_frame, encode_frame
from swarmd.pipeline.averaging.allreduce.messages import ArPart, read_mean
from swarmd.pipeline.averaging.allreduce.owner import PartOwner, encoded_mean, reduce_slices
from swarmd.pipeline.averaging.allreduce.plan import MAX_MEMBERS, Ready, part_digest, part_signer
from swarmd.pipeline.averaging.trust.round_checks import tensor_digest

__all__ = ["AUDIT_KIND", "AUDIT_ROUNDS", "AUDIT_SHARE", "AUDIT_TOLERANCE", "KEEP_ROUNDS", "SUSPECT_BELOW",
           "SUSPECT_WAIT_S", "AuditVerdict", "PartEvidence", "SignedSlice", "against_own", "draw", "evidence_of",
           "slices_per_piece"]

AUDIT_KIND = "allreduce-audit"
#: The share of commits audited (``draw``): each audit moves one part's slices, about ``|grads|`` (as the
#: members' codec sent them) to one member, so auditing every commit would add that to one peer's round.
AUDIT_SHARE = 0.25
#: An auditor fetches the evidence in this many pieces at most, one a round it applies (the mean and the first
#: slices with the commit it audits): about ``|grads| / AUDIT_ROUNDS`` more bytes a round, not ``|grads|`` at
#: once. An owner keeps its parts for 16 rounds (``averager``).
AUDIT_ROUNDS = 8
#: An owner's mean further than this from the recomputed one (relative L2 distance, after both are
#: decoded from the owner's codec) convicts it.
AUDIT_TOLERANCE = 1e-2
#: A committed part mean whose cosine with a member's own slice of it is below this has that member audit it.
SUSPECT_BELOW = -0.5
#: How long a member that suspects a part waits for its audit's verdict before applying the commit all the same.
SUSPECT_WAIT_S = 10.0
#: An owner keeps the evidence of every part it reduced until it releases a round this many steps later (a member
#: that suspects a part audits it before it applies the commit, so before it takes part in the next round).
KEEP_ROUNDS = 1
_DRAW_DOMAIN = b"swarmd-allreduce-audit-draw/1\x00"


def draw(decision_message: bytes, signature: bytes | None, owners: Sequence[str], members: Iterable[str],
         left_out: Iterable[str] = (), share: float = 1.0) -> tuple[int, str] | None:
    """The part a committed round audits and the member that audits it, from the signed commit (its message
    and signature: fixed once every owner reported, so no owner knows beforehand): with probability
    ``share`` a part, then a member of the round other than its owner and not ``left_out`` (dropped or
    refused). None: this commit is not audited, or nobody can audit it."""
    if not owners:
        return None
    h = hashlib.sha256(_DRAW_DOMAIN + decision_message + (signature or b"")).digest()
    if int.from_bytes(h[16:24], "big") >= share * 2**64:
        return None
    part = int.from_bytes(h[:8], "big") % len(owners)
    skip = set(left_out) | {owners[part]}
    candidates = sorted(set(members) - skip)
    if not candidates:
        return None
    return part, candidates[int.from_bytes(h[8:16], "big") % len(candidates)]


def against_own(mean: torch.Tensor, own: torch.Tensor) -> float | None:
    """The cosine between a part's committed mean and a member's own slice of it, in float32 (the threshold is far
    from any rounding; None: either is zero or not finite, or they differ in size). An honest mean holds the slice
    at its weight: below ``SUSPECT_BELOW``, the member audits the part."""
    a, b = mean.detach().flatten().float(), own.detach().flatten().float()
    if a.numel() != b.numel():
        return None
    na, nb = float(a.norm()), float(b.norm())
    if not (na > 0.0 and nb > 0.0 and math.isfinite(na) and math.isfinite(nb)):
        return None
    return float(a @ b) / (na * nb)


def slices_per_piece(slices: int) -> int:
    """How many slices an owner hands an auditor at once: all of them within ``AUDIT_ROUNDS`` pieces."""
    return max(1, -(-slices // AUDIT_ROUNDS))


def evidence_of(owner: PartOwner, stage: int) -> PartEvidence | str:
    """What an owner shows an auditor of a part it reduced (:class:`PartEvidence`), or why it cannot."""
    ready, signed = owner.ready, owner.ready_signed
    if ready is None or not ready.digest or signed is None or owner.encoded is None:
        return "this part was not reduced here, or not signed"
    frames = []
    for pid in sorted(owner.parts):
        if pid not in owner.frames:
            return "a slice of this part came unsigned"
        frames.append(owner.frames[pid])
    return PartEvidence(stage, ready, signed[0], signed[1], owner.mean_codec, owner.encoded, tuple(frames))


@dataclass(frozen=True)
class SignedSlice:
    """One member's slice of the part, as the owner decoded it from the member's signed frame."""

    peer_id: str
    samples: int
    grads: torch.Tensor | None


@dataclass(frozen=True)
class AuditVerdict:
    """A recomputation's outcome: ``distance`` (relative L2 between the owner's mean and the recomputed one)
    and ``why`` the owner is convicted (None: its mean holds up)."""

    distance: float
    why: str | None


@dataclass(frozen=True)
class PartEvidence:
    """What an owner shows of one part it reduced: its signed ready report, the mean's frame as it served it
    (and the codec it encoded it with), and every slice it reduced as the signed ``ar_part`` frame its member
    sent (the bytes that came, compressed as they came). :meth:`decode` validates the outer frame (cheap);
    :meth:`check` opens and checks the rest and recomputes the part (off the event loop). An owner hands it
    to an auditor in pieces (:meth:`piece`, ``piece``: the first slice's index and the count of all slices;
    the mean comes with the first piece), a few slices a round, and the auditor puts them together
    (:meth:`assemble`)."""

    stage: int
    ready: Ready
    ready_key: bytes
    ready_sig: bytes
    codec: str
    mean_frame: bytes
    part_frames: tuple[bytes, ...]
    piece_of: tuple[int, int] | None = None  # (first slice's index, slices in all) of a piece; None: all of it

    def piece(self, start: int) -> PartEvidence | None:
        """The piece of this evidence from slice ``start``: ``slices_per_piece`` slices (the mean with the first);
        None past the last slice."""
        every = len(self.part_frames)
        if not 0 <= start < every:
            return None
        end = min(every, start + slices_per_piece(every))
        return PartEvidence(self.stage, self.ready, self.ready_key, self.ready_sig, self.codec,
                            self.mean_frame if start == 0 else b"", self.part_frames[start:end], (start, every))

    @classmethod
    def assemble(cls, pieces: Sequence[PartEvidence]) -> PartEvidence | str:
        """The whole evidence from its pieces in order, or why they are not the pieces of one."""
        first = pieces[0] if pieces else None
        if first is None or first.piece_of is None:
            return "no pieces"
        every = first.piece_of[1]
        frames: list[bytes] = []
        for p in pieces:
            if (p.piece_of != (len(frames), every) or p.stage != first.stage or p.ready != first.ready
                    or p.ready_key != first.ready_key or p.ready_sig != first.ready_sig or p.codec != first.codec):
                return "the pieces are not those of one part's evidence, in order"
            frames.extend(p.part_frames)
        if len(frames) != every or not first.mean_frame:
            return "the pieces do not hold every slice and the mean"
        return PartEvidence(first.stage, first.ready, first.ready_key, first.ready_sig, first.codec,
                            first.mean_frame, tuple(frames))

    def encode(self) -> bytes:
        blobs = [self.mean_frame, *self.part_frames]
        data = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
        meta: dict[str, Any] = {"stage": self.stage, "ready": self.ready.to_wire(), "ready_pk": self.ready_key,
                                "ready_sig": self.ready_sig, "codec": self.codec, "lengths": [len(b) for b in blobs]}
        if self.piece_of is not None:
            meta["piece"] = list(self.piece_of)
        return encode_frame(AUDIT_KIND, meta, {"frames": data})

    @classmethod
    def decode(cls, frame: Frame) -> PartEvidence:
        """``RequestError`` unless the outer frame is well formed (remote input)."""
        if frame.kind != AUDIT_KIND:
            raise RequestError(f"an audit's evidence is a {AUDIT_KIND!r} frame, not {frame.kind!r}")
        m = frame.meta
        stage, raw_ready, key, sig, codec, lengths = (m.get("stage"), m.get("ready"), m.get("ready_pk"),
                                                      m.get("ready_sig"), m.get("codec"), m.get("lengths"))
        try:
            ready = Ready.from_wire(raw_ready)
        except ValueError as exc:
            raise RequestError(f"meta.ready: {exc}") from None
        if not (type(stage) is int and stage >= 0 and type(key) is bytes and len(key) == 32
                and type(sig) is bytes and len(sig) == 64 and codec in CODECS):
            raise RequestError("an audit's evidence names its stage, the owner's key and signature and a codec")
        raw_piece = m.get("piece")
        piece: tuple[int, int] | None = None
        if raw_piece is not None:
            if not (isinstance(raw_piece, list) and len(raw_piece) == 2 and all(type(x) is int for x in raw_piece)
                    and 0 <= raw_piece[0] < raw_piece[1] <= MAX_MEMBERS):
                raise RequestError("meta.piece is [first slice's index, slices in all]")
            piece = (raw_piece[0], raw_piece[1])
        data = frame.tensors.get("frames")
        if data is None or data.dtype != torch.uint8 or data.dim() != 1:
            raise RequestError("an audit's evidence carries its frames as one flat uint8 tensor")
        # the mean's frame first (empty in a piece after the first), then one per slice
        mean_given = piece is None or piece[0] == 0
        if not (isinstance(lengths, list) and 2 <= len(lengths) <= MAX_MEMBERS + 1
                and all(type(n) is int and n > 0 for n in lengths[1:]) and sum(lengths) == data.numel()
                and type(lengths[0]) is int and (lengths[0] > 0) == mean_given):
            raise RequestError("meta.lengths split the frames: the mean's, then one per slice")
        raw = data.numpy().tobytes()
        blobs, at = [], 0
        for n in lengths:
            blobs.append(raw[at:at + n])
            at += n
        return cls(stage, ready, key, sig, str(codec), blobs[0], tuple(blobs[1:]), piece)

    def check(self) -> AuditVerdict | str:
        """Why this evidence does not hold up (a string), or the recomputation's verdict. It holds up when the
        ready report is signed by the part's owner, the mean is the one its digest names, and every slice is
        signed by its member and is one the report says was reduced, all of them. Then the part is recomputed
        by the owner's rule (:func:`owner.reduce_slices`) and re-encoded with its codec: the owner is convicted
        when its mean lies further than ``AUDIT_TOLERANCE`` from that. Pure; off the event loop."""
        ready = self.ready
        if self.piece_of is not None:
            return "a piece of the evidence, not all of it"
        if peer_id_of(self.ready_key) != ready.owner or not verify(self.ready_key, ready.message(self.stage),
                                                                   self.ready_sig):
            return "the ready report is not signed by the part's owner"
        try:
            mean_frame = decode_frame(self.mean_frame)
            size = mean_frame.tensors["grads"].numel() if "grads" in mean_frame.tensors else 0
            mean, used = read_mean(mean_frame, ready.round_id, ready.part, size)
        except (WireError, RequestError) as exc:
            return f"the mean's frame does not read ({exc})"
        if not ready.digest or part_digest(mean, used) != ready.digest:
            return "the mean is not the one the owner's signed report names"
        slices, digests = [], {}
        for blob in self.part_frames:
            try:
                frame = decode_frame(blob)
                part = ArPart.from_frame(frame, size)
            except (WireError, RequestError) as exc:
                return f"a slice's frame does not read ({exc})"
            digest = tensor_digest(part.grads)
            if part_signer(frame.meta, digest, self.stage, ready.round_id, ready.part, ready.owner) != part.peer_id:
                return f"the slice of {part.peer_id[:12]} is not signed by its member for this part"
            slices.append(SignedSlice(part.peer_id, part.samples, part.grads))
            digests[part.peer_id] = digest
        by_peer = {s.peer_id: s for s in slices}
        listed = {u[0]: u for u in used if isinstance(u, list) and len(u) == 4 and isinstance(u[0], str)}
        if (len(by_peer) != len(slices) or len(listed) != len(used) or set(by_peer) != set(listed)
                or dict(ready.samples) != {pid: s.samples for pid, s in by_peer.items()}):
            return "the slices are not the members the owner reduced"
        for s in slices:
            if listed[s.peer_id][1] != s.samples or listed[s.peer_id][2] != digests[s.peer_id]:
                return f"the slice of {s.peer_id[:12]} is not the one the owner listed"
        mean_rule, _ = reduce_slices({s.peer_id: (s.samples, s.grads) for s in slices}, ready.owner, ready.struck,
                                     size)
        _, decoded = encoded_mean(ready.round_id, ready.part, mean_rule, self.codec, used)
        theirs, ours = mean.to(torch.float64), decoded.to(torch.float64)
        scale = max(float(torch.linalg.vector_norm(theirs)), float(torch.linalg.vector_norm(ours)))
        distance = float(torch.linalg.vector_norm(theirs - ours)) / scale if scale > 0 else 0.0
        if not math.isfinite(distance) or distance > AUDIT_TOLERANCE:
            return AuditVerdict(distance, f"part {ready.part} of round {ready.round_id}: its signed mean lies "
                                          f"{distance:.3g} (relative) from the mean its members' signed slices give "
                                          f"by the rule (tolerance {AUDIT_TOLERANCE:g})")
        return AuditVerdict(distance, None)
