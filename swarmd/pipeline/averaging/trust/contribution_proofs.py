"""Accountable averaging contributions: a contributor opens its contribution after the round (issue #29, item 3).

A contribution claims to be the sum of the gradients of the microbatches its sender served. The
robust mean bounds what a false one does (``robust_aggregation``), and a far one is convicted on its
signed norm (``accusations``); but a contribution that is the true gradient with its sign flipped has
an honest norm, and judging its direction against the others convicts honest peers (an earlier stage's
directions follow the next stage's input gradients) with evidence nobody else can check
(docs/BENCHMARKS.md, "The sign-flip liar"). This module makes the claim itself checkable.

**The opening.** While computing, a last-stage peer keeps each microbatch's parameter gradient
``g_i`` apart (``step_protocol.GradientAccumulator`` with ``keep_parts``), and whatever its
contribution holds that no microbatch of its own explains (gradients handed in by a leaving peer, the
error-feedback residual of a lossy codec) as ``extra`` parts. It sends its contribution ``c`` as
always. Only once the round is answered is the projection fixed: its seed (:func:`proof_seed`) hashes
the stage, the step, the leader, the leader's own contribution's digest (published in the answer's
``used`` list; the contributor cannot know it when it sends ``c``) and ``c``'s digest. The contributor
then signs an :class:`Opening`: ``p_i = R g_i`` for every microbatch, ``e = R (sum of extra)``, and
``s = R c`` (``c`` as the leader decoded it), where ``R`` is a CountSketch of ``K`` signed buckets
drawn from the seed (:func:`sketch`: each coordinate goes to one bucket with a random sign, so ``R x``
costs one pass over ``x`` and ``R`` is linear). It rides to the leader with the contributor's next
contribution (no new endpoint, no extra round trip).

**The checks.** By linearity an honest opening has ``sum_i p_i + e == s`` up to float32 rounding (the
accumulator's float32 sums and the sketch's float32 buckets: ~1e-6 measured, tolerance :data:`TOLERANCE`; a
lossy codec's quantisation moves ``s``, tolerance per codec: :data:`CODEC_TOLERANCE`). A peer that sent ``-c`` and
opened its true microbatches signs ``s = -(sum p_i + e)``: a gap of 1.0 on the scale below, and a
statement **anyone can check from the signed opening alone** (:func:`inconsistency`): no gradient, no
parameters, no trust in the leader. So the leader convicts and its stage-mates second
(``accuser``), as for a far contribution. The leader also checks what only it can: that
``s`` is the sketch of the ``c`` it received (:func:`sketch` of the decoded gradients at reduce time)
and that the parts sum to the signed total; failing those, the contribution is refused and the peer
excluded from this leader's rounds (not seconded: the proof needs ``c``).

**What it costs.** Memory: one float32 copy of the stage's gradients per microbatch held (``m x
|grads|``, the last stage only; ``m`` is 1-2 on the default fixtures), plus one for a residual. Compute:
a contributor sketches ``m + 2`` vectors of ``|grads|`` after each round (one ``index_add`` pass each,
plus drawing ``|grads|`` bucket indices); the leader sketches each contribution it receives once.
Traffic: ``(m + 3) * K`` float64 values and a signature per round (~0.5-1 KB against the gradients'
``4 |grads|`` bytes).

**What it does not catch on its own**: a liar that opens false parts consistent with its false ``c``
(``p_i = -R g_i``): a leader recomputes one sampled microbatch's ``g_j`` from the inputs shipped with the
contribution, on the step's parameters, and compares ``R g_j`` with the signed ``p_j``
(``recomputation``); a liar that moves its lie into ``extra`` (unbounded here). One that never opens
is not convicted, but its contributions are left out of every mean after its first
(``openings``). The first and last stage differ: only the last stage opens (an earlier
stage's gradients follow input gradients another peer answered, so a recomputation would have to use
the trainer's copy of them).

Pure: seeds, sketches, the wire form (every byte hostile: ``RequestError``) and the checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import torch

from swarmd.dht.identity import PEER_ID_BYTES, PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_of, verify
from swarmd.errors import RequestError
from swarmd.net.messages.averaging import MAX_OPENING_BYTES
from swarmd.pipeline.reports import unpack_bounded

__all__ = ["CHUNK", "CODEC_TOLERANCE", "K", "LOSSY_TOLERANCE", "MAX_OPENING_BYTES", "MAX_PARTS", "TOLERANCE",
           "Awaited", "Opening", "OpeningEvidence", "gap", "inconsistency", "opened_microbatches", "parts_digest",
           "proof_seed", "read_opening", "sign_opening", "sketch", "sketch_pieces", "tolerance"]

#: Buckets of the sketch. A flipped contribution's gap does not depend on it; more buckets only make the
#: sketch of a small lie less likely to vanish (a lie ``d`` has ``||R d|| ~ ||d||``, spread over ``K``).
K = 16
#: Coordinates drawn and summed at a time (bounds the sketch's scratch memory to ~16 MB).
CHUNK = 1 << 20
#: ``gap`` an honest opening stays under with exact gradients (``none``): float32 sums and float32 buckets
#: differ by ~1e-6 relative.
TOLERANCE = 1e-3
#: ... and with a lossy codec, whose quantisation error is in ``s`` alone. Honest gaps measured on heavy-tailed
#: random gradients (``tests/unit/test_contribution_proofs.py``): fp16 1.3e-4, 8bit 0.014, 4bit 0.044, 5level
#: 0.25; a sign flip's gap stays near 1.0 under every codec. A codec this build does not know: the loosest.
CODEC_TOLERANCE = {"none": TOLERANCE, "fp16": 2e-3, "8bit": 0.1, "4bit": 0.25, "5level": 0.6}
LOSSY_TOLERANCE = max(CODEC_TOLERANCE.values())
#: Most microbatch parts an opening carries (as ``AverageRequest``'s ``mbs``).
MAX_PARTS = 256
MAX_EVIDENCE_BYTES = 1400
_SEED_DOMAIN = b"swarmd-proof-seed/1\x00"
_OPENING_DOMAIN = b"swarmd-opening/1\x00"
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Awaited:
    """A contribution a leader sketched at its reduction, whose opening it expects with the next one."""

    step: int
    digest: str
    codec: str
    sent: tuple[float, ...]  # its sketch under the contribution's seed
    # the microbatches whose inputs came with it (None: none came), the one the leader drew and recomputed, and
    # the recomputed gradient's sketch under the same seed (None: not recomputed; ``recomputation``)
    input_mbs: frozenset[int] | None = None
    unexplained: int | None = None  # its samples no shipped microbatch holds (None: none shipped)
    sampled: int | None = None
    recomputed: tuple[float, ...] | None = None
    # what its opening must sign of the recomputation (``Opening.ins``, ``at``, ``lead``): the shipped inputs'
    # digests by microbatch, the parameters' digest and precision they ran at, this leader's own digest (the
    # seed's); and the drawn microbatch's inputs, the evidence a conviction shows the stage-mates
    input_digests: tuple[tuple[int, str], ...] = ()
    at: tuple[str, str] | None = None
    lead: str = ""
    sampled_inputs: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)


def proof_seed(stage: int, step: int, leader: str, leader_digest: str, digest: str) -> int:
    """The sketch's seed for one contribution: fixed only by the round's answer (the leader's digest)."""
    raw = hashlib.sha256(_SEED_DOMAIN + msgpack.packb([stage, step, leader, leader_digest, digest])).digest()
    return int.from_bytes(raw[:8], "big") & (2**63 - 1)


def sketch(vectors: Sequence[torch.Tensor | None], seed: int, numel: int, k: int = K) -> torch.Tensor:
    """``R x`` for each flat vector (None: zeros), float64 ``[len(vectors), k]``: a CountSketch drawn from
    ``seed`` (coordinate ``j`` goes to bucket ``b_j`` with sign ``s_j``; ``(R x)_b = sum_{b_j = b} s_j x_j``).
    The indices come from torch's CPU generator, drawn in chunks; the sums are float32 within a chunk, so two
    peers' sketches of one vector agree to float32 rounding (the checks' tolerances are far above it)."""
    gen = torch.Generator().manual_seed(seed)
    acc = torch.zeros(len(vectors), 2 * k, dtype=torch.float64)
    for lo in range(0, numel, CHUNK):
        hi = min(numel, lo + CHUNK)
        idx = torch.randint(0, 2 * k, (hi - lo,), generator=gen)
        for row, v in enumerate(vectors):
            if v is not None:
                # float32 within a chunk (float64 index_add is ~200x slower on CPU: 19 ms against 0.09 ms for
                # 66k values), float64 across chunks: relative error ~1e-5 at most, against TOLERANCE 1e-3
                part = torch.zeros(2 * k, dtype=torch.float32).index_add_(0, idx, v[lo:hi].to("cpu", torch.float32))
                acc[row] += part.to(torch.float64)
    return acc[:, 0::2] - acc[:, 1::2]


def sketch_pieces(pieces: Sequence[tuple[int, torch.Tensor]], seed: int, numel: int, k: int = K) -> torch.Tensor:
    """``R x`` of each piece of a flat vector of ``numel`` values, given as ``(offset, values)`` (disjoint), with
    the vector's coordinates elsewhere zero: float64 ``[len(pieces), k]``, the same CountSketch as :func:`sketch`
    (the indices drawn chunk by chunk from ``seed``), so the pieces of a vector sketch to rows that add up to its
    sketch, to float32 rounding. What an all-reduce member opens of each part it sent, and what a part's owner
    sketches of the slice it received (``allreduce.sent_parts``). Draws the indices up to the last piece's end."""
    for lo, values in pieces:
        if lo < 0 or lo + values.numel() > numel:
            raise ValueError("a piece lies outside the vector")
    end = max((lo + v.numel() for lo, v in pieces), default=0)
    gen = torch.Generator().manual_seed(seed)
    acc = torch.zeros(len(pieces), 2 * k, dtype=torch.float64)
    for lo in range(0, end, CHUNK):
        hi = min(numel, lo + CHUNK)
        idx = torch.randint(0, 2 * k, (hi - lo,), generator=gen)
        for row, (at, values) in enumerate(pieces):
            a, b = max(lo, at), min(hi, at + values.numel())
            if a < b:
                part = torch.zeros(2 * k, dtype=torch.float32).index_add_(
                    0, idx[a - lo : b - lo], values[a - at : b - at].to("cpu", torch.float32))
                acc[row] += part.to(torch.float64)
    return acc[:, 0::2] - acc[:, 1::2]


def tolerance(codec: str) -> float:
    return CODEC_TOLERANCE.get(codec, LOSSY_TOLERANCE)


def _norm(v: Sequence[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def gap(total: Sequence[float], extra: Sequence[float], sent: Sequence[float]) -> float:
    """``||s - (t + e)|| / (||s|| + ||t + e||)``: 0 for an honest opening, 1 for a sign flip, in [0, 1]."""
    explained = [t + e for t, e in zip(total, extra, strict=True)]
    scale = _norm(sent) + _norm(explained)
    if scale == 0:
        return 0.0
    return _norm([s - x for s, x in zip(sent, explained, strict=True)]) / scale


def _floats(value: object, k: int, what: str) -> tuple[float, ...]:
    if not (isinstance(value, list) and len(value) == k and all(type(x) is float and math.isfinite(x) for x in value)):
        raise RequestError(f"an opening's {what} must be {k} finite floats")
    return tuple(value)


def _peer(value: object, what: str) -> str:
    if not (isinstance(value, str) and len(value) == 2 * PEER_ID_BYTES and set(value) <= _HEX):
        raise RequestError(f"an opening's {what} must be a peer id")
    return value


def _digest(value: object, what: str) -> str:
    if not (isinstance(value, str) and len(value) == 64 and set(value) <= _HEX):
        raise RequestError(f"an opening's {what} must be 64 hex characters")
    return value


def _int(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= 2**53:
        raise RequestError(f"an opening's {what} must be a non-negative integer")
    return value


def parts_digest(mbs: Sequence[int], parts: Sequence[Sequence[float]], ins: Sequence[str] = (),
                 at: Sequence[str] = (), lead: str = "", sent_parts: Sequence[Sequence[float]] = (),
                 sent_bounds: Sequence[Sequence[int]] = (), sent_digests: Sequence[str] = ()) -> str:
    """What an opening's signature covers of its per-microbatch sketches (the evidence leaves them out), of
    what a recomputation needs (``ins``, ``at``, ``lead``: :class:`Opening`) and of its per-part sketches of
    what it sent (``sent_parts``); an opening without them digests as before they existed."""
    fields: list[object] = [list(mbs), [list(p) for p in parts]]
    if ins or at or lead or sent_parts:
        fields += [list(ins), list(at), lead]
    if sent_parts:
        fields += [[list(p) for p in sent_parts], [list(b) for b in sent_bounds], list(sent_digests)]
    return hashlib.sha256(msgpack.packb(fields)).hexdigest()


@dataclass(frozen=True)
class OpeningEvidence:
    """An opening without its per-microbatch parts (they are signed through ``parts_digest``): what a
    leader shows its stage-mates, small enough for a report, and enough to check :func:`inconsistency`."""

    stage: int
    step: int
    peer_id: str
    leader: str
    digest: str  # of the contribution as the leader decoded it
    codec: str
    parts_digest: str
    total: tuple[float, ...]  # sum of the parts' sketches
    extra: tuple[float, ...]  # sketch of what no own microbatch explains
    sent: tuple[float, ...]  # sketch of the contribution
    key: bytes
    signature: bytes

    def message(self) -> bytes:
        return _OPENING_DOMAIN + msgpack.packb(
            [self.stage, self.step, self.peer_id, self.leader, self.digest, self.codec, self.parts_digest,
             list(self.total), list(self.extra), list(self.sent)], use_bin_type=True)

    def _fields(self) -> dict[str, object]:
        return {"stage": self.stage, "step": self.step, "peer_id": self.peer_id, "leader": self.leader,
                "digest": self.digest, "codec": self.codec, "parts_digest": self.parts_digest,
                "total": list(self.total), "extra": list(self.extra), "sent": list(self.sent),
                "key": self.key, "sig": self.signature}

    def encode(self) -> bytes:
        return msgpack.packb(self._fields(), use_bin_type=True)

    @classmethod
    def _from_fields(cls, fields: dict[str, object]) -> OpeningEvidence:
        codec, key, sig = fields["codec"], fields["key"], fields["sig"]
        if not (isinstance(codec, str) and 0 < len(codec) <= 16):
            raise RequestError("an opening's codec must be a codec's name")
        if type(key) is not bytes or len(key) != PUBLIC_KEY_BYTES:
            raise RequestError(f"an opening's key must be a {PUBLIC_KEY_BYTES}-byte ed25519 public key")
        if type(sig) is not bytes or len(sig) != SIGNATURE_BYTES:
            raise RequestError(f"an opening's signature must be {SIGNATURE_BYTES} bytes")
        return cls(stage=_int(fields["stage"], "stage"), step=_int(fields["step"], "step"),
                   peer_id=_peer(fields["peer_id"], "peer_id"), leader=_peer(fields["leader"], "leader"),
                   digest=_digest(fields["digest"], "digest"), codec=codec,
                   parts_digest=_digest(fields["parts_digest"], "parts_digest"),
                   total=_floats(fields["total"], K, "total"), extra=_floats(fields["extra"], K, "extra"),
                   sent=_floats(fields["sent"], K, "sent"), key=key, signature=sig)

    @classmethod
    def decode(cls, raw: object) -> OpeningEvidence:
        if type(raw) is not bytes or not 0 < len(raw) <= MAX_EVIDENCE_BYTES:
            raise RequestError(f"an opening's evidence must be 1..{MAX_EVIDENCE_BYTES} bytes of msgpack")
        fields = unpack_bounded(raw, "an opening's evidence", MAX_EVIDENCE_BYTES, max_array_len=K, max_map_len=12)
        if not isinstance(fields, dict) or set(fields) != set(_EVIDENCE_KEYS):
            raise RequestError("an opening's evidence must be a map of " + ", ".join(_EVIDENCE_KEYS))
        evidence = cls._from_fields(fields)
        if evidence.encode() != raw:
            raise RequestError("an opening's evidence is not in its canonical encoding")
        return evidence

    def verify(self, stage: int, accused: str) -> None:
        """Signed by ``accused`` (its key hashing to that id), for ``stage``; ``RequestError`` when not."""
        if self.stage != stage or self.peer_id != accused:
            raise RequestError("an opening must be the accused's, of this stage")
        if peer_id_of(self.key) != accused:
            raise RequestError("an opening's key is not the accused's")
        if not verify(self.key, self.message(), self.signature):
            raise RequestError("an opening is not signed by the peer it names")


_EVIDENCE_KEYS = ("stage", "step", "peer_id", "leader", "digest", "codec", "parts_digest", "total", "extra", "sent",
                  "key", "sig")


def inconsistency(evidence: OpeningEvidence) -> str | None:
    """Why the signed opening contradicts itself (None: it does not): its contribution's sketch is not
    the sum of its parts' (module docstring; checkable by anyone, signatures checked first)."""
    g = gap(evidence.total, evidence.extra, evidence.sent)
    if g <= tolerance(evidence.codec):
        return None
    return (f"unaccountable contribution: its signed opening of step {evidence.step} shows a contribution whose "
            f"sketch is {g:.3f} away from the sum of its microbatches' (tolerance {tolerance(evidence.codec):g}"
            f"{'' if evidence.codec == 'none' else ', codec ' + evidence.codec})")


@dataclass(frozen=True)
class Opening:
    """A contributor's full opening of one round's contribution: the evidence's fields plus the
    per-microbatch sketches (``mbs[i]`` -> ``parts[i]``) the leader keeps for a recomputation check.

    When the contribution shipped its microbatches' inputs (``recomputation``), the opening also signs
    (through ``parts_digest``) what a stage-mate needs to recompute one of them itself: ``ins[i]``, the
    digest of ``mbs[i]``'s inputs (``recomputation.inputs_digest``), ``at``, the parameters' digest and the
    precision they ran at, and ``lead``, the leader's digest its seed hashes (:func:`proof_seed`). Else all
    three are empty. An all-reduce member's opening also signs ``sent_parts``: the sketch of each part of its
    contribution as that part's owner decoded it (they add up to ``sent``), which the coordinator checks part
    by part against what the owners received (``allreduce.sent_parts``), with each part's range of the
    flat vector (``sent_bounds``) and the digest of each part as decoded (``sent_digests``: they hash to
    the contribution's claim digest, the seed's): so a part's signed slice and the opening convict a
    member whose sketch of it is false, whoever shows them."""

    evidence: OpeningEvidence
    mbs: tuple[int, ...]
    parts: tuple[tuple[float, ...], ...]
    ins: tuple[str, ...] = ()
    at: tuple[str, ...] = ()
    lead: str = ""
    sent_parts: tuple[tuple[float, ...], ...] = ()
    sent_bounds: tuple[tuple[int, int], ...] = ()
    sent_digests: tuple[str, ...] = ()

    @classmethod
    def signed(cls, identity: Identity, *, stage: int, step: int, peer_id: str, leader: str, digest: str, codec: str,
               mbs: Sequence[int], parts: torch.Tensor, extra: torch.Tensor, sent: torch.Tensor,
               ins: Sequence[str] = (), at: Sequence[str] = (), lead: str = "",
               sent_parts: torch.Tensor | None = None, sent_bounds: Sequence[tuple[int, int]] = (),
               sent_digests: Sequence[str] = ()) -> Opening:
        """Sign the sketches (``parts`` ``[m, K]``, ``extra`` and ``sent`` ``[K]``, float64) with ``identity``
        (its key goes with them), and ``ins``, ``at``, ``lead``, ``sent_parts`` (``[n, K]``) when given."""
        rows = tuple(tuple(float(x) for x in row) for row in parts.tolist())
        sent_rows = tuple(tuple(float(x) for x in row) for row in sent_parts.tolist()) if sent_parts is not None else ()
        total = tuple(float(x) for x in parts.sum(0).tolist()) if rows else (0.0,) * K
        unsigned = OpeningEvidence(stage=stage, step=step, peer_id=peer_id, leader=leader, digest=digest, codec=codec,
                                   parts_digest=parts_digest(mbs, rows, ins, at, lead, sent_rows, sent_bounds,
                                                             sent_digests), total=total,
                                   extra=tuple(float(x) for x in extra.tolist()),
                                   sent=tuple(float(x) for x in sent.tolist()),
                                   key=identity.public_key_bytes, signature=b"\x00" * SIGNATURE_BYTES)
        evidence = dataclasses.replace(unsigned, signature=identity.sign(unsigned.message()))
        return cls(evidence=evidence, mbs=tuple(mbs), parts=rows, ins=tuple(ins), at=tuple(at), lead=lead,
                   sent_parts=sent_rows, sent_bounds=tuple((lo, hi) for lo, hi in sent_bounds),
                   sent_digests=tuple(sent_digests))

    def encode(self) -> bytes:
        fields: dict[str, object] = {**self.evidence._fields(), "mbs": list(self.mbs),
                                     "parts": [list(p) for p in self.parts]}
        if self.ins or self.at or self.lead or self.sent_parts:
            fields.update(ins=list(self.ins), at=list(self.at), lead=self.lead)
        if self.sent_parts:
            fields.update(sp=[list(p) for p in self.sent_parts], sb=[list(b) for b in self.sent_bounds],
                          sd=list(self.sent_digests))
        return msgpack.packb(fields, use_bin_type=True)

    def part_of(self, mb: int) -> tuple[tuple[float, ...], str] | None:
        """The signed part of microbatch ``mb`` and its signed inputs' digest (None: not listed with one)."""
        if mb not in self.mbs or len(self.ins) != len(self.mbs):
            return None
        i = self.mbs.index(mb)
        return self.parts[i], self.ins[i]

    @classmethod
    def decode(cls, raw: object) -> Opening:
        """Shapes, ranges, the parts' digest and canonical encoding (:meth:`OpeningEvidence.verify` checks the
        signature); ``RequestError`` naming what is wrong."""
        if type(raw) is not bytes or not 0 < len(raw) <= MAX_OPENING_BYTES:
            raise RequestError(f"an opening must be 1..{MAX_OPENING_BYTES} bytes of msgpack")
        fields = unpack_bounded(raw, "an opening", MAX_OPENING_BYTES, max_array_len=MAX_PARTS, max_map_len=20)
        keys = {*_EVIDENCE_KEYS, "mbs", "parts"}
        if not isinstance(fields, dict) or set(fields) not in (keys, keys | {"ins", "at", "lead"},
                                                               keys | {"ins", "at", "lead", "sp", "sb", "sd"}):
            raise RequestError("an opening must be a map of " + ", ".join((*_EVIDENCE_KEYS, "mbs", "parts"))
                               + " (and ins, at, lead; and sp, sb, sd)")
        mbs, parts = fields.pop("mbs"), fields.pop("parts")
        ins, at, lead = fields.pop("ins", []), fields.pop("at", []), fields.pop("lead", "")
        sp = fields.pop("sp", [])
        if not (isinstance(sp, list) and len(sp) <= MAX_PARTS):
            raise RequestError(f"an opening's sp must be at most {MAX_PARTS} sketches, one per part sent")
        sent_rows = tuple(_floats(p, K, "part sent") for p in sp)
        sb, sd = fields.pop("sb", []), fields.pop("sd", [])
        if not (isinstance(sb, list) and len(sb) == len(sent_rows) and all(
                isinstance(b, list) and len(b) == 2 and all(type(x) is int for x in b) and 0 <= b[0] < b[1]
                for b in sb)):
            raise RequestError("an opening's sb must give one [lo, hi) range per part sent")
        if not (isinstance(sd, list) and len(sd) == len(sent_rows)):
            raise RequestError("an opening's sd must give one digest per part sent")
        sent_bounds = tuple((b[0], b[1]) for b in sb)
        sent_digests = tuple(_digest(d, "part's digest") for d in sd)
        if not (isinstance(mbs, list) and all(type(m) is int and 0 <= m < 2**64 for m in mbs)):
            raise RequestError("an opening's mbs must be microbatch ids")
        if not isinstance(parts, list) or len(parts) != len(mbs):
            raise RequestError("an opening must carry one part per microbatch")
        if not (isinstance(ins, list) and len(ins) in (0, len(mbs))):
            raise RequestError("an opening's ins must give one inputs' digest per microbatch, or none")
        ins_t = tuple(_digest(d, "inputs' digest") for d in ins)
        if not (isinstance(at, list) and (at == [] or (len(at) == 2 and at[1] in ("fp32", "bf16", "fp16")))):
            raise RequestError("an opening's at must be [parameters' digest, precision], or empty")
        at_t = (_digest(at[0], "parameters' digest"), at[1]) if at else ()
        lead = _digest(lead, "lead") if lead != "" else ""
        rows = tuple(_floats(p, K, "part") for p in parts)
        evidence = OpeningEvidence._from_fields(fields)
        if evidence.parts_digest != parts_digest(mbs, rows, ins_t, at_t, lead, sent_rows, sent_bounds, sent_digests):
            raise RequestError("an opening's parts are not the ones its signature covers")
        opening = cls(evidence=evidence, mbs=tuple(mbs), parts=rows, ins=ins_t, at=at_t, lead=lead,
                      sent_parts=sent_rows, sent_bounds=sent_bounds, sent_digests=sent_digests)
        if opening.encode() != raw:
            raise RequestError("an opening is not in its canonical encoding")
        return opening

    def sent_parts_gap(self) -> float:
        """How far the per-part sketches of what it sent lie from its signed ``sent`` (0 for an honest opening;
        0 without them)."""
        if not self.sent_parts:
            return 0.0
        summed = [math.fsum(col) for col in zip(*self.sent_parts, strict=True)]
        return gap(summed, (0.0,) * K, self.evidence.sent)

    def parts_gap(self) -> float:
        """How far the parts' sum lies from the signed total (0 for an honest opening)."""
        if not self.parts:
            return gap(self.evidence.total, (0.0,) * K, (0.0,) * K)
        summed = [math.fsum(col) for col in zip(*self.parts, strict=True)]
        return gap(summed, (0.0,) * K, self.evidence.total)


# ---- what the leader's and the all-reduce's openings share --------------------------------------------------


def opened_microbatches(parts: Sequence[tuple[int | None, torch.Tensor]]) -> list[int]:
    """The microbatches an opening of a contribution made of ``parts`` lists, in order (``None``: what
    no microbatch explains, summed into the opening's ``extra``)."""
    return [mb for mb, _ in parts if mb is not None]


def sign_opening(identity: Identity, *, stage: int, step: int, peer_id: str, leader: str, leader_digest: str,
                 digest: str, codec: str, parts: Sequence[tuple[int | None, torch.Tensor]], decoded: torch.Tensor,
                 numel: int, ins: Sequence[str] = (), at: Sequence[str] = (), lead: str = "",
                 bounds: Sequence[tuple[int, int]] = (), sent_digests: Sequence[str] = ()) -> Opening:
    """``peer_id``'s signed opening of the contribution made of ``parts`` (its microbatches' gradients and
    what no microbatch explains), sent as ``decoded``, under the seed :func:`proof_seed` draws from the
    round's answer (``leader``, ``leader_digest``) and the contribution's ``digest``. Off the loop: it
    sketches ``len(parts) + 1`` vectors of ``numel`` values."""
    seed = proof_seed(stage, step, leader, leader_digest, digest)
    mbs = opened_microbatches(parts)
    vectors = [t for mb, t in parts if mb is not None] + [t for mb, t in parts if mb is None] + [decoded]
    rows = sketch(vectors, seed, numel)
    n = len(mbs)
    # (an all-reduce member: what it sent, sketched part by part, ``bounds`` its round's parts)
    sent_parts = sketch_pieces([(lo, decoded[lo:hi]) for lo, hi in bounds], seed, numel) if bounds else None
    return Opening.signed(identity, stage=stage, step=step, peer_id=peer_id, leader=leader, digest=digest,
                          codec=codec, mbs=mbs, parts=rows[:n], extra=rows[n:-1].sum(0), sent=rows[-1], ins=ins,
                          at=at, lead=lead, sent_parts=sent_parts, sent_bounds=bounds if bounds else (),
                          sent_digests=sent_digests if bounds else ())


def read_opening(raw: bytes, *, stage: int, peer_id: str, leader: str, step: int,
                 digest: str) -> tuple[str, str, Opening | None]:
    """The checks every opening passes before anything round-specific, for ``leader`` awaiting
    ``peer_id``'s opening of its contribution of ``step`` with ``digest``: ``(verdict, why, opening)`` with
    verdict ``bad`` (unreadable or not its signature), ``other`` (an opening of another round: the one
    awaited is still owed), ``inconsistent`` (it contradicts itself: :func:`inconsistency`) or ``ok``; the
    opening comes with ``inconsistent`` and ``ok``. Pure."""
    try:
        opening = Opening.decode(raw)
        opening.evidence.verify(stage, peer_id)
    except RequestError as exc:
        return "bad", f"bad opening: {exc}", None
    ev = opening.evidence
    if ev.leader != leader or (ev.step, ev.digest) != (step, digest):
        return "other", f"an opening of step {ev.step}, not of its contribution of step {step}", None
    why = inconsistency(ev)
    return ("inconsistent", why, opening) if why is not None else ("ok", "", opening)
