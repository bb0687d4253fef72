"""Wire messages of the chunked all-reduce round (``swarmd.pipeline.averaging.allreduce.averager``), all on
``POST /v1/allreduce/<op>`` as msgpack frames (``swarmd.net.wire``); validated here, so bad
input is a 422 (``RequestError``) before it reaches the round.

- ``report`` (:class:`ArReport` -> :class:`ArReportReply`): a member's progress to the round's
  coordinator; a long-poll answered when the round starts (with its :class:`RoundPlan`), when
  ``wait_s`` passes, or when a newer report of the same peer supersedes it.
- ``part`` (:class:`ArPart` -> :class:`ArAck`): part ``j`` of a member's gradients, to owner ``j``
  (part 0 also lists the microbatch ids the gradients hold: its owner looks for repeats).
- ``ready`` (:class:`ArReady` -> :class:`ArAck`): an owner's "part ready" (``plan.Ready``).
- ``decision`` (:class:`ArQuery` -> :class:`ArDecisionReply`): the round's signed decision,
  long-polled at the coordinator (or asked of any member that holds it).
- ``mean`` (:class:`ArQuery` -> the stored ``ar_mean`` frame): part ``j``'s encoded mean, served
  as the very bytes its owner encoded (so every member decodes the same floats).
- ``inputs`` (:class:`ArInputsQuery` -> :class:`ArInputs` or :class:`ArAck`): (last stage) the inputs of one
  microbatch of a member's contribution to a round, drawn by the round's coordinator after the member's
  opening came, to recompute it (``allreduce.recompute``).
- ``sketch`` (:class:`ArPartQuery` with a seed -> :class:`ArSketch` or :class:`ArAck`) and ``frame``
  (:class:`ArPartQuery` -> the member's signed ``ar_part`` frame as the owner received it, or :class:`ArAck`):
  the coordinator asks an owner for its sketch of a member's slice, and on a disagreement with the member's
  opening for the slice itself (``allreduce.sent_parts``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from swarmd.errors import NonFinite, RequestError
from swarmd.finite import all_finite
from swarmd.net.messages.averaging import MAX_OPENING_BYTES, decode_inputs, encode_inputs
from swarmd.net.messages.fields import MAX_CONTRIBUTION_MBS
from swarmd.net.wire import Frame, WireTensor, encode_frame
from swarmd.pipeline.averaging.allreduce.plan import Decision, Ready, RoundPlan

MAX_WAIT_S = 60.0
REPORT_STATUSES = ("wait", "start", "behind", "superseded", "refused")


def _nat(meta: Mapping[str, Any], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError(f"meta.{key} must be a non-negative integer")
    return value


def _str(meta: Mapping[str, Any], key: str, *, max_len: int = 128, empty: bool = False) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or len(value) > max_len or (not value and not empty):
        raise RequestError(f"meta.{key} must be a string of at most {max_len} characters")
    return value


def _wait(meta: Mapping[str, Any]) -> float:
    value = meta.get("wait_s", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_WAIT_S:
        raise RequestError(f"meta.wait_s must be a number of seconds in [0, {MAX_WAIT_S:g}]")
    return float(value)


def _signature(meta: Mapping[str, Any]) -> tuple[bytes | None, bytes | None]:
    pk, sig = meta.get("pk"), meta.get("sig")
    if pk is None and sig is None:
        return None, None
    if type(pk) is not bytes or len(pk) != 32 or type(sig) is not bytes or len(sig) != 64:
        raise RequestError("meta.pk and meta.sig must be a 32-byte ed25519 key and a 64-byte signature")
    return pk, sig


def _kind(frame: Frame, kind: str) -> None:
    if frame.kind != kind:
        raise RequestError(f"expected a {kind!r} frame, got {frame.kind!r}")


def _signed(meta: dict[str, Any], pk: bytes | None, sig: bytes | None) -> dict[str, Any]:
    if pk is not None and sig is not None:
        meta.update(pk=pk, sig=sig)
    return meta


@dataclass(frozen=True)
class ArReport:
    stage: int
    peer_id: str
    step: int
    samples: int
    params_digest: str
    coordinator: str  # whom the sender takes for the coordinator
    wait_s: float = 1.0
    # (last stage) the signed opening of the sender's contribution to this coordinator's last round it applied
    # (``contribution_proofs.Opening``; judged by the coordinator: ``member.judge_opening``)
    opening: bytes | None = None

    KIND = "ar_report"

    def encode(self, codec: str = "none") -> bytes:
        meta = {"stage": self.stage, "peer_id": self.peer_id, "step": self.step, "samples": self.samples,
                "params_digest": self.params_digest, "coordinator": self.coordinator, "wait_s": self.wait_s}
        if self.opening is not None:
            meta["opening"] = self.opening
        return encode_frame(self.KIND, meta, {})

    @classmethod
    def from_frame(cls, frame: Frame) -> ArReport:
        _kind(frame, cls.KIND)
        m = frame.meta
        opening = m.get("opening")
        if opening is not None and (type(opening) is not bytes or not 0 < len(opening) <= MAX_OPENING_BYTES):
            raise RequestError(f"meta.opening must be 1..{MAX_OPENING_BYTES} bytes (a signed opening)")
        return cls(_nat(m, "stage"), _str(m, "peer_id"), _nat(m, "step"), _nat(m, "samples"),
                   _str(m, "params_digest", empty=True), _str(m, "coordinator"), _wait(m), opening)


@dataclass(frozen=True)
class ArReportReply:
    status: str  # one of REPORT_STATUSES
    step: int  # the coordinator's step
    missing: int = 0  # samples the coordinator still waits for at its step
    members: int = 1  # peers it counts at its step (itself included)
    plan: RoundPlan | None = None  # on "start"
    reason: str = ""

    KIND = "ar_report_reply"

    def encode(self, codec: str = "none") -> bytes:
        meta: dict[str, Any] = {"status": self.status, "step": self.step, "missing": self.missing,
                                "members": self.members, "reason": self.reason}
        if self.plan is not None:
            meta["plan"] = self.plan.to_wire()
        return encode_frame(self.KIND, meta, {})

    @classmethod
    def from_frame(cls, frame: Frame, numel: int | None = None) -> ArReportReply:
        _kind(frame, cls.KIND)
        m = frame.meta
        status = m.get("status")
        if status not in REPORT_STATUSES:
            raise RequestError(f"meta.status must be one of {', '.join(REPORT_STATUSES)}")
        plan = None
        if m.get("plan") is not None:
            try:
                plan = RoundPlan.from_wire(m["plan"], numel=numel)
            except ValueError as exc:
                raise RequestError(f"meta.plan: {exc}") from exc
        if status == "start" and plan is None:
            raise RequestError("a 'start' answer carries the round's plan")
        return cls(str(status), _nat(m, "step"), _nat(m, "missing"), max(1, _nat(m, "members")), plan,
                   _str(m, "reason", max_len=512, empty=True))


@dataclass(frozen=True)
class ArPart:
    stage: int
    round_id: str
    part: int
    peer_id: str
    samples: int
    grads: torch.Tensor | None  # float32 slice; None with no samples
    digest: str = ""  # tensor_digest of the slice as the owner decodes it
    codec: str = "none"
    public_key: bytes | None = None
    signature: bytes | None = None
    mbs: tuple[int, ...] = ()  # the microbatch ids the member's gradients hold (sent with part 0)
    # (part 0) the member's signed claim of its whole contribution: per-sample norm and signature of
    # ``accusations.contribution_message`` over ``plan.claim_digest``, for the coordinator (its round's "leader")
    claim_norm: float | None = None
    claim_sig: bytes | None = None
    # (part 0, last stage) how many of its samples no microbatch of its explains (handed in by a leaving peer;
    # all of them when it keeps no inputs): under 0 of them its opening's extra term is bounded (``openings``)
    unexplained: int | None = None
    # ``grads`` encoded with ``codec`` already (``round._encoded_once``): sent as they are, not encoded again
    wire: WireTensor | None = None
    # (part 0, last stage) the digest of each microbatch's inputs (``recomputation.inputs_digest``), committed
    # before the commit fixes the opening's projection: the coordinator may draw one to recompute (``recompute``)
    ins: tuple[tuple[int, str], ...] = ()

    KIND = "ar_part"

    def encode(self, codec: str | None = None) -> bytes:
        meta = _signed({"stage": self.stage, "round_id": self.round_id, "part": self.part, "peer_id": self.peer_id,
                        "samples": self.samples, "digest": self.digest}, self.public_key, self.signature)
        if self.claim_norm is not None and self.claim_sig is not None:
            meta.update(claim_norm=float(self.claim_norm), claim_sig=self.claim_sig)
        if self.unexplained is not None:
            meta["unexplained"] = self.unexplained
        if self.ins and len(self.ins) <= MAX_CONTRIBUTION_MBS:
            meta["ins"] = [[mb, digest] for mb, digest in self.ins]
        tensors: dict[str, torch.Tensor | WireTensor] = {}
        if self.grads is not None:
            tensors["grads"] = self.wire if self.wire is not None else self.grads
        if self.mbs and len(self.mbs) <= MAX_CONTRIBUTION_MBS:
            tensors["mbs"] = torch.tensor([m - 2**64 if m >= 2**63 else m for m in self.mbs], dtype=torch.int64)
        return encode_frame(self.KIND, meta, tensors, self.codec if self.grads is not None else "none")

    @classmethod
    def from_frame(cls, frame: Frame, size: int | None = None) -> ArPart:
        _kind(frame, cls.KIND)
        m = frame.meta
        samples = _nat(m, "samples")
        grads = frame.tensors.get("grads")
        if grads is not None:
            if grads.dtype != torch.float32 or grads.dim() != 1 or (size is not None and grads.numel() != size):
                raise RequestError(f"'grads' must be float32 of shape [{size if size is not None else 'N'}]")
            if not all_finite(grads):
                raise NonFinite("'grads' contain NaN or Inf; refused")
            if not samples:
                raise RequestError("a part with 'grads' must count its samples (meta.samples > 0)")
        elif samples:
            raise RequestError("a part with samples must carry its 'grads'")
        digest = _str(m, "digest", max_len=64, empty=True)
        pk, sig = _signature(m)
        ids = frame.tensors.get("mbs")
        if ids is not None and (ids.dtype != torch.int64 or ids.dim() != 1 or ids.numel() > MAX_CONTRIBUTION_MBS):
            raise RequestError(f"'mbs' must be int64 of shape [n], n <= {MAX_CONTRIBUTION_MBS} (microbatch ids)")
        mbs = () if ids is None else tuple(i % 2**64 for i in ids.tolist())
        claim_norm, claim_sig = m.get("claim_norm"), m.get("claim_sig")
        if claim_norm is not None or claim_sig is not None:
            if not (type(claim_norm) is float and math.isfinite(claim_norm) and claim_norm >= 0
                    and type(claim_sig) is bytes and len(claim_sig) == 64):
                raise RequestError("meta.claim_norm and meta.claim_sig must be a per-sample norm and a 64-byte "
                                   "signature")
        unexplained = _nat(m, "unexplained") if m.get("unexplained") is not None else None
        if unexplained is not None and unexplained > samples:
            raise RequestError("meta.unexplained counts some of the part's samples (at most meta.samples)")
        return cls(_nat(m, "stage"), _str(m, "round_id"), _nat(m, "part"), _str(m, "peer_id"), samples, grads,
                   digest, str(m.get("codec", "none")), pk, sig, mbs, claim_norm, claim_sig, unexplained,
                   ins=_ins(m.get("ins")))


def _ins(raw: Any) -> tuple[tuple[int, str], ...]:
    """``meta.ins`` of a part: ``[[mb, digest], ...]``, each microbatch once, digests of 64 hex digits."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_CONTRIBUTION_MBS:
        raise RequestError(f"meta.ins must be a list of at most {MAX_CONTRIBUTION_MBS} [microbatch, digest] pairs")
    out = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and 0 <= item[0] < 2**64
                and isinstance(item[1], str) and len(item[1]) == 64
                and all(c in "0123456789abcdef" for c in item[1])):
            raise RequestError("meta.ins must hold [microbatch id, sha256 hex digest] pairs")
        out.append((item[0], item[1]))
    if len({mb for mb, _ in out}) != len(out):
        raise RequestError("meta.ins names a microbatch twice")
    return tuple(out)


@dataclass(frozen=True)
class ArAck:
    ok: bool
    reason: str = ""

    KIND = "ar_ack"

    def encode(self, codec: str = "none") -> bytes:
        return encode_frame(self.KIND, {"ok": self.ok, "reason": self.reason}, {})

    @classmethod
    def from_frame(cls, frame: Frame) -> ArAck:
        _kind(frame, cls.KIND)
        ok = frame.meta.get("ok")
        if not isinstance(ok, bool):
            raise RequestError("meta.ok must be true or false")
        return cls(ok, _str(frame.meta, "reason", max_len=512, empty=True))


@dataclass(frozen=True)
class ArReady:
    stage: int
    ready: Ready
    public_key: bytes | None = None
    signature: bytes | None = None

    KIND = "ar_ready"

    def encode(self, codec: str = "none") -> bytes:
        meta = _signed({"stage": self.stage, "ready": self.ready.to_wire()}, self.public_key, self.signature)
        return encode_frame(self.KIND, meta, {})

    @classmethod
    def from_frame(cls, frame: Frame) -> ArReady:
        _kind(frame, cls.KIND)
        try:
            ready = Ready.from_wire(frame.meta.get("ready"))
        except ValueError as exc:
            raise RequestError(f"meta.ready: {exc}") from exc
        pk, sig = _signature(frame.meta)
        return cls(_nat(frame.meta, "stage"), ready, pk, sig)


@dataclass(frozen=True)
class ArQuery:
    """Ask for a round's decision (``part`` unused) or part ``part``'s encoded mean, waiting up to
    ``wait_s`` for it to exist; or (``slices``) the ``index``-th piece of an owner's evidence of the part."""

    stage: int
    round_id: str
    part: int = 0
    wait_s: float = 0.0
    index: int = 0

    KIND = "ar_query"

    def encode(self, codec: str = "none") -> bytes:
        meta = {"stage": self.stage, "round_id": self.round_id, "part": self.part, "wait_s": self.wait_s}
        if self.index:
            meta["index"] = self.index
        return encode_frame(self.KIND, meta, {})

    @classmethod
    def from_frame(cls, frame: Frame) -> ArQuery:
        _kind(frame, cls.KIND)
        m = frame.meta
        index = _nat(m, "index") if m.get("index") is not None else 0
        return cls(_nat(m, "stage"), _str(m, "round_id"), _nat(m, "part"), _wait(m), index)


@dataclass(frozen=True)
class ArInputsQuery:
    """The coordinator of ``round_id`` asks a member for the inputs of its microbatch ``mb`` (``recompute``)."""

    stage: int
    round_id: str
    mb: int

    KIND = "ar_inputs_query"

    def encode(self, codec: str = "none") -> bytes:
        return encode_frame(self.KIND, {"stage": self.stage, "round_id": self.round_id, "mb": self.mb}, {})

    @classmethod
    def from_frame(cls, frame: Frame) -> ArInputsQuery:
        _kind(frame, cls.KIND)
        mb = frame.meta.get("mb")
        if type(mb) is not int or not 0 <= mb < 2**64:
            raise RequestError("meta.mb must be a microbatch id (an integer in [0, 2**64))")
        return cls(_nat(frame.meta, "stage"), _str(frame.meta, "round_id"), mb)


@dataclass(frozen=True)
class ArInputs:
    """A member's answer: microbatch ``mb``'s activations (float32, ``[batch, seq, width]``) and targets (int64,
    ``[batch, seq]``) of its contribution to ``round_id``, as its backward ran on them (float32 bits as int32 on
    the wire: no codec touches them, so their digest is the one the member committed)."""

    round_id: str
    mb: int
    inputs: torch.Tensor
    targets: torch.Tensor

    KIND = "ar_inputs"

    def encode(self, codec: str = "none") -> bytes:
        return encode_frame(self.KIND, {"round_id": self.round_id},
                            encode_inputs(((self.mb, self.inputs, self.targets),)), "none")

    @classmethod
    def from_frame(cls, frame: Frame) -> ArInputs:
        _kind(frame, cls.KIND)
        got = decode_inputs(frame)
        if len(got) != 1:
            raise RequestError("an answer carries exactly one microbatch's inputs: 'in_x', 'in_y' and 'in_idx'")
        mb, x, y = got[0]
        return cls(_str(frame.meta, "round_id"), mb, x, y)


@dataclass(frozen=True)
class ArPartQuery:
    """The coordinator asks the owner of ``part`` of ``round_id`` about ``peer_id``'s slice of it: its sketch under
    ``seed`` (``sketch``), or the member's signed frame (``frame``, ``seed`` unused)."""

    stage: int
    round_id: str
    part: int
    peer_id: str
    seed: int = 0

    KIND = "ar_part_query"

    def encode(self, codec: str = "none") -> bytes:
        return encode_frame(self.KIND, {"stage": self.stage, "round_id": self.round_id, "part": self.part,
                                        "peer_id": self.peer_id, "seed": self.seed}, {})

    @classmethod
    def from_frame(cls, frame: Frame) -> ArPartQuery:
        _kind(frame, cls.KIND)
        m = frame.meta
        seed = m.get("seed", 0)
        if type(seed) is not int or not 0 <= seed < 2**63:
            raise RequestError("meta.seed must be an integer in [0, 2**63)")
        return cls(_nat(m, "stage"), _str(m, "round_id"), _nat(m, "part"), _str(m, "peer_id"), seed)


@dataclass(frozen=True)
class ArSketch:
    """An owner's sketch of a member's slice (``contribution_proofs.sketch_pieces``): ``K`` finite floats."""

    row: tuple[float, ...]

    KIND = "ar_sketch"

    def encode(self, codec: str = "none") -> bytes:
        return encode_frame(self.KIND, {"row": list(self.row)}, {})

    @classmethod
    def from_frame(cls, frame: Frame, k: int) -> ArSketch:
        _kind(frame, cls.KIND)
        row = frame.meta.get("row")
        if not (isinstance(row, list) and len(row) == k
                and all(type(x) is float and math.isfinite(x) for x in row)):
            raise RequestError(f"meta.row must be {k} finite floats")
        return cls(tuple(row))


@dataclass(frozen=True)
class ArDecisionReply:
    decision: Decision | None  # None: not decided (yet, or not known here)
    public_key: bytes | None = None
    signature: bytes | None = None
    # (a member's answer, with no decision) it holds none and can get none from the coordinator: its own
    # request for it was refused (no process listens there), or it never heard of the round
    cut_off: bool = False

    KIND = "ar_decision"

    def encode(self, codec: str = "none") -> bytes:
        meta = _signed({"decision": self.decision.to_wire() if self.decision is not None else None},
                       self.public_key, self.signature)
        if self.cut_off and self.decision is None:
            meta["cut_off"] = True
        return encode_frame(self.KIND, meta, {})

    @classmethod
    def from_frame(cls, frame: Frame) -> ArDecisionReply:
        _kind(frame, cls.KIND)
        raw = frame.meta.get("decision")
        try:
            decision = Decision.from_wire(raw) if raw is not None else None
        except ValueError as exc:
            raise RequestError(f"meta.decision: {exc}") from exc
        pk, sig = _signature(frame.meta)
        return cls(decision, pk, sig, cut_off=decision is None and frame.meta.get("cut_off") is True)


MEAN_KIND = "ar_mean"


def encode_mean(round_id: str, part: int, mean: torch.Tensor, codec: str, used: list[list[Any]]) -> bytes:
    """Part ``part``'s mean as its owner serves it (encoded once: every member decodes these bytes),
    with the contributions it holds (``[peer_id, samples, digest, norm]`` each, for the round checks)."""
    return encode_frame(MEAN_KIND, {"round_id": round_id, "part": part, "used": used}, {"grads": mean}, codec)


def read_mean(frame: Frame, round_id: str, part: int, size: int) -> tuple[torch.Tensor, list[Any]]:
    """The decoded part mean of a ``mean`` answer and its used list, unchecked (``RequestError`` when
    it is not the one asked for)."""
    _kind(frame, MEAN_KIND)
    grads = frame.tensors.get("grads")
    used = frame.meta.get("used")
    if frame.meta.get("round_id") != round_id or frame.meta.get("part") != part:
        raise RequestError("the mean answered is another round's or part's")
    if grads is None or grads.dtype != torch.float32 or grads.dim() != 1 or grads.numel() != size:
        raise RequestError(f"a part mean is float32 of shape [{size}]")
    if not isinstance(used, list):
        raise RequestError("a part mean lists the contributions it holds (meta.used)")
    if not all_finite(grads):
        raise RequestError("the part mean is not finite")
    return grads, used
