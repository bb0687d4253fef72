"""The trainer's step coordination: ``POST /v1/reserve`` (leases on a step's microbatches),
``POST /v1/claim`` (a microbatch counted exactly once) and ``POST /v1/report`` (a spot check's verdict)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from swarmd.errors import MalformedFrame, RequestError
from swarmd.net.messages.fields import (
    MAX_PEER_ID_LEN,
    StageTarget,
    _attempt,
    _check_target,
    _count,
    _is_int,
    _kind,
    _microbatch_id,
    _optional_count,
    _reply_fields,
    _reply_int,
    _stage,
)
from swarmd.net.wire import Frame, encode_frame

# ---- POST /v1/reserve -------------------------------------------------------------------------

#: Lease ids a reservation may report done or renew at once, and leases it may ask for.
MAX_RESERVE_IDS = 1024


def _lease_ids(meta: Mapping[str, Any], key: str) -> tuple[int, ...]:
    ids = meta.get(key, [])
    if not isinstance(ids, list) or len(ids) > MAX_RESERVE_IDS or not all(_is_int(i) and i >= 0 for i in ids):
        raise RequestError(f"meta.{key} must be a list of at most {MAX_RESERVE_IDS} lease ids")
    return tuple(int(i) for i in ids)


@dataclass(frozen=True)
class ReserveRequest:
    """Ask the stage's lease book (``swarmd.pipeline.reservations``) for up to ``count`` leases
    of at most ``size`` samples for its current step; report ``done`` leases (their backward on
    this stage was accepted) and ``renew`` the open ones for ``lease_s``. ``held``: the samples
    the trainer saw the stage hold at ``step`` (None: unknown), which the book reconciles with.
    ``count`` 0 only reports."""

    stage: int
    trainer: str
    step: int
    size: int
    count: int
    lease_s: float
    done: tuple[int, ...] = ()
    renew: tuple[int, ...] = ()
    held: int | None = None

    KIND = "reserve"

    def encode(self) -> bytes:
        meta: dict[str, Any] = {
            "stage": self.stage,
            "trainer": self.trainer,
            "step": self.step,
            "size": self.size,
            "count": self.count,
            "lease_s": float(self.lease_s),
            "done": list(self.done),
            "renew": list(self.renew),
        }
        if self.held is not None:
            meta["held"] = self.held
        return encode_frame(self.KIND, meta, {}, "none")

    @classmethod
    def from_frame(cls, frame: Frame, target: StageTarget | None = None) -> ReserveRequest:
        _kind(frame, cls.KIND)
        meta = frame.meta
        stage = _stage(meta)
        _check_target(stage, meta.get("model"), target)
        trainer = meta.get("trainer")
        if not isinstance(trainer, str) or not 0 < len(trainer) <= MAX_PEER_ID_LEN:
            raise RequestError("meta.trainer (the trainer's id, at most 64 characters) is required")
        lease_s = meta.get("lease_s")
        if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not 0 < lease_s <= 3600:
            raise RequestError(f"meta.lease_s must be a number of seconds in (0, 3600], got {lease_s!r:.40}")
        count = _count(meta, "count", "leases wanted")
        if count > MAX_RESERVE_IDS:
            raise RequestError(f"meta.count must be at most {MAX_RESERVE_IDS}")
        return cls(
            stage=stage,
            trainer=trainer,
            step=_count(meta, "step", "the step the trainer saw"),
            size=_count(meta, "size", "samples per lease"),
            count=count,
            lease_s=float(lease_s),
            done=_lease_ids(meta, "done"),
            renew=_lease_ids(meta, "renew"),
            held=_optional_count(meta, "held", "samples the stage held"),
        )


@dataclass(frozen=True)
class ReserveReply:
    """The leases granted (``(lease_id, samples)``, possibly none) for ``step``, and how many of
    the step's ``target`` samples are spoken for after them (``reserved``: leased, held without a
    lease, or kept for another trainer's fair share, ``swarmd.pipeline.fair_share``)."""

    stage: int
    step: int
    leases: tuple[tuple[int, int], ...]
    reserved: int
    target: int

    KIND = "reserve_result"

    def encode(self, codec: str = "none") -> bytes:
        meta = {
            "stage": self.stage,
            "step": self.step,
            "leases": [list(lease) for lease in self.leases],
            "reserved": self.reserved,
            "target": self.target,
        }
        return encode_frame(self.KIND, meta, {}, "none")

    @classmethod
    def from_frame(cls, frame: Frame) -> ReserveReply:
        stage, step = _reply_fields(frame, cls.KIND)
        leases = frame.meta.get("leases")
        if not isinstance(leases, list) or not all(
            isinstance(lease, list) and len(lease) == 2 and all(_is_int(v) and v >= 0 for v in lease)
            for lease in leases
        ):
            raise MalformedFrame("a reserve reply's meta.leases must list [lease_id, samples] pairs")
        return cls(
            stage=stage,
            step=step,
            leases=tuple((int(i), int(n)) for i, n in leases),
            reserved=_reply_int(frame.meta, "reserved"),
            target=_reply_int(frame.meta, "target"),
        )


# ---- POST /v1/claim ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimRequest:
    """A trainer whose backward of microbatch ``mb`` on this stage failed without an answer asks,
    before retrying it elsewhere, whether this peer counted it; a peer that did not fences the
    attempts numbered below ``attempt`` off (``swarmd.pipeline.stage.step_protocol``, exactly once)."""

    stage: int
    mb: int
    attempt: int

    KIND = "claim"

    def encode(self) -> bytes:
        return encode_frame(self.KIND, {"stage": self.stage, "mb": self.mb, "attempt": self.attempt}, {}, "none")

    @classmethod
    def from_frame(cls, frame: Frame, target: StageTarget | None = None) -> ClaimRequest:
        _kind(frame, cls.KIND)
        meta = frame.meta
        stage = _stage(meta)
        _check_target(stage, meta.get("model"), target)
        mb = _microbatch_id(meta)
        if mb is None:
            raise RequestError("meta.mb (the microbatch id the claim is about) is required")
        return cls(stage=stage, mb=mb, attempt=_attempt(meta))


@dataclass(frozen=True)
class ClaimReply:
    """Whether the peer had counted the microbatch (at ``step`` or the step before); if not, the
    claimed attempts never will be."""

    stage: int
    step: int
    counted: bool

    KIND = "claim_result"

    def encode(self, codec: str = "none") -> bytes:
        return encode_frame(self.KIND, {"stage": self.stage, "step": self.step, "counted": self.counted}, {}, "none")

    @classmethod
    def from_frame(cls, frame: Frame) -> ClaimReply:
        stage, step = _reply_fields(frame, cls.KIND)
        counted = frame.meta.get("counted")
        if not isinstance(counted, bool):
            raise MalformedFrame(f"a claim reply's meta.counted must be true or false, got {counted!r:.30}")
        return cls(stage=stage, step=step, counted=counted)


# ---- POST /v1/report --------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportRequest:
    """A signed misbehaviour report (``swarmd.pipeline.reports``): meta ``body`` (the report's
    canonical msgpack) and ``sig`` (its reporter's ed25519 signature), no tensors. This layer
    checks the types only; ``MisbehaviourReport.decode`` validates the content and signature."""

    body: bytes
    signature: bytes

    KIND = "report"

    def encode(self) -> bytes:
        return encode_frame(self.KIND, {"body": self.body, "sig": self.signature}, {}, "none")

    @classmethod
    def from_frame(cls, frame: Frame) -> ReportRequest:
        _kind(frame, cls.KIND)
        body, sig = frame.meta.get("body"), frame.meta.get("sig")
        if type(body) is not bytes or type(sig) is not bytes:
            raise RequestError("a report needs meta.body and meta.sig as bytes")
        if frame.tensors:
            raise RequestError("a report carries no tensors")
        return cls(body=body, signature=sig)


@dataclass(frozen=True)
class ReportReply:
    """What the peer's ledger made of a report: ``accepted`` (counted), ``reason`` (``counted``,
    ``excluded``, ``duplicate``, ``same_source``, ``stale``, ...), and whether the accused is
    excluded there now."""

    accepted: bool
    reason: str
    excluded: bool

    KIND = "report_result"

    def encode(self, codec: str = "none") -> bytes:
        meta = {"accepted": self.accepted, "reason": self.reason, "excluded": self.excluded}
        return encode_frame(self.KIND, meta, {}, "none")

    @classmethod
    def from_frame(cls, frame: Frame) -> ReportReply:
        _kind(frame, cls.KIND)
        accepted, reason, excluded = (frame.meta.get(k) for k in ("accepted", "reason", "excluded"))
        if not isinstance(accepted, bool) or not isinstance(reason, str) or not isinstance(excluded, bool):
            raise MalformedFrame("a report reply needs meta.accepted, meta.excluded (booleans) and meta.reason")
        return cls(accepted=accepted, reason=reason[:100], excluded=excluded)
