"""The averaging endpoints: ``POST /v1/average`` (a contribution and the round's answer),
``POST /v1/recheck`` (a conviction by recomputation, for a stage-mate to check) and
``GET /v1/progress`` (where a stage-mate stands, long-polled)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch

from swarmd.errors import MalformedFrame, NonFinite, RequestError
from swarmd.finite import all_finite
from swarmd.net.messages.fields import (
    MAX_CONTRIBUTION_MBS,
    MAX_EXCLUDED,
    MAX_PEER_ID_LEN,
    MAX_PROGRESS_WAIT_S,
    StageTarget,
    _check_target,
    _codec,
    _count,
    _is_int,
    _json_field,
    _kind,
    _reply_fields,
    _reply_int,
    _stage,
)
from swarmd.net.wire import Frame, WireTensor, encode_frame

# ---- POST /v1/average -------------------------------------------------------------------------

#: The most bytes a contribution's opening (``AverageRequest.opening``) may take.
MAX_OPENING_BYTES = 64 * 2**10
#: The most microbatches whose inputs a contribution may carry (``AverageRequest.inputs``).
MAX_CONTRIBUTION_INPUTS = 1024
#: Precisions a contribution's inputs may name (``AverageRequest.inputs_precision``).
_PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class AverageRequest:
    """A stage-mate's contribution to the round of ``step``: its gradient sum over ``samples``
    samples (flat float32; None with no samples: it still receives the update).

    ``codec`` is the one the gradients travel with (the swarm's ``grad_codec``); the answer
    comes with the round's codec, whatever this one is.

    ``public_key`` / ``signature`` / ``digest`` (meta ``pk``, ``sig``, ``digest``): the
    contributor's ed25519 key, its signature over the contribution (stage, step, samples,
    gradients' digest, its peer id, the leader's, ``norm``), and the digest of the gradients as the leader
    will decode them (``swarmd.pipeline.averaging.trust.round_checks.tensor_digest``). Optional on the wire; a
    leader refuses an unsigned contribution (``swarmd.pipeline.averaging.averager``). ``norm`` (meta
    ``norm``): the gradients' per-sample norm as decoded, signed so that a leader can show the
    stage-mates how large a convicted peer's contributions were (``swarmd.pipeline.averaging.trust.accusations``).

    ``mbs`` (tensor ``mbs``, int64 holding the unsigned 64-bit ids' bits): the microbatch ids whose
    gradients the sum holds, so the leader can count an id that two contributions hold
    (``swarmd.pipeline.stage.step_protocol``, exactly once). Not signed: it feeds a counter, never the mean.

    ``opening`` (meta ``opening``, at most ``MAX_OPENING_BYTES``): the contributor's signed opening of
    its *previous* contribution to this leader (``swarmd.pipeline.averaging.trust.contribution_proofs``; msgpack,
    decoded and checked by the leader, not here).

    ``inputs`` (tensors ``in_x``: the float32 activations' bits as int32, so that no codec touches them;
    ``in_y``: int64 targets; ``in_idx``: int64 ``[m, 4]`` of microbatch id bits, batch, seq, width):
    ``(mb, activations [batch, seq, width], targets [batch, seq])`` for each microbatch the contribution
    holds, what a last-stage backward ran on, with the digest of the parameters they ran at
    (``inputs_params``) and the sender's precision (``inputs_precision``), both in meta ``in_at``: for the
    leader to recompute one (``swarmd.pipeline.averaging.trust.recomputation``). Shapes and finiteness
    checked here; what fits the stage, by the leader.
    """

    stage: int
    peer_id: str
    step: int
    samples: int
    grads: torch.Tensor | None = None
    codec: str = "none"
    public_key: bytes | None = None
    signature: bytes | None = None
    digest: str | None = None
    mbs: tuple[int, ...] = ()
    norm: float = 0.0  # the gradients' per-sample norm, as signed (meta ``norm``)
    opening: bytes | None = None  # the signed opening of the previous contribution (meta ``opening``)
    inputs: tuple[tuple[int, torch.Tensor, torch.Tensor], ...] = ()  # its microbatches' (mb, activations, targets)
    inputs_params: str | None = None  # the digest of the parameters they ran at
    inputs_precision: str | None = None  # the sender's precision
    wire: WireTensor | None = None  # ``grads`` encoded with ``codec`` already: sent as they are, not encoded again

    KIND = "average"

    def encode(self) -> bytes:
        meta: dict[str, Any] = {
            "stage": self.stage,
            "step": self.step,
            "samples": self.samples,
            "peer_id": self.peer_id,
        }
        if self.public_key is not None and self.signature is not None:
            meta.update(pk=self.public_key, sig=self.signature, digest=self.digest or "", norm=float(self.norm))
        if self.opening is not None:
            meta["opening"] = self.opening
        if self.grads is not None and self.codec != "none":
            meta["codec"] = self.codec  # under grad_codec "auto" the leader answers in the most compressed sent
        tensors: dict[str, torch.Tensor | WireTensor] = {}
        if self.grads is not None:
            tensors["grads"] = self.wire if self.wire is not None else self.grads
        if self.mbs and len(self.mbs) <= MAX_CONTRIBUTION_MBS:
            tensors["mbs"] = torch.tensor([m - 2**64 if m >= 2**63 else m for m in self.mbs], dtype=torch.int64)
        if self.inputs and len(self.inputs) <= MAX_CONTRIBUTION_INPUTS:
            meta["in_at"] = [self.inputs_params or "", self.inputs_precision or "fp32"]
            tensors.update(encode_inputs(self.inputs))
        return encode_frame(self.KIND, meta, tensors, self.codec if self.grads is not None else "none")

    @classmethod
    def from_frame(cls, frame: Frame, target: StageTarget | None = None) -> AverageRequest:
        _kind(frame, cls.KIND)
        meta = frame.meta
        stage = _stage(meta)
        _check_target(stage, meta.get("model"), target)
        codec = _codec(meta)
        peer_id = meta.get("peer_id")
        if not isinstance(peer_id, str) or not 0 < len(peer_id) <= MAX_PEER_ID_LEN:
            raise RequestError("meta.peer_id (the contributor's peer id) is required")
        step = _count(meta, "step", "the round's step")
        samples = _count(meta, "samples", "the samples the gradients sum over")
        grads = frame.tensors.get("grads")
        numel = target.grad_numel if target is not None else None
        if grads is not None:
            if grads.dtype != torch.float32 or grads.dim() != 1 or (numel is not None and grads.numel() != numel):
                raise RequestError(f"'grads' must be float32 of shape [{numel if numel is not None else 'N'}]")
            if not all_finite(grads):
                raise NonFinite("'grads' contain NaN or Inf; refused")
            if not samples:  # the mean divides by samples: gradients of no sample would be weightless
                raise RequestError("a contribution with 'grads' must count its samples (meta.samples > 0)")
        elif samples:
            raise RequestError("a contribution with samples must carry its 'grads'")
        pk, sig, digest = meta.get("pk"), meta.get("sig"), meta.get("digest")
        if pk is not None or sig is not None:
            if type(pk) is not bytes or len(pk) != 32 or type(sig) is not bytes or len(sig) != 64:
                raise RequestError("meta.pk and meta.sig must be a 32-byte ed25519 key and a 64-byte signature")
            if not isinstance(digest, str) or len(digest) not in (0, 64):
                raise RequestError("meta.digest must be the gradients' 64-hex-character digest (or empty)")
            norm = meta.get("norm", 0.0)
            if type(norm) is not float or not math.isfinite(norm) or norm < 0:
                raise RequestError("meta.norm must be the gradients' per-sample norm (a finite float >= 0)")
        else:
            digest, norm = None, 0.0
        ids = frame.tensors.get("mbs")
        if ids is not None and (ids.dtype != torch.int64 or ids.dim() != 1 or ids.numel() > MAX_CONTRIBUTION_MBS):
            raise RequestError(f"'mbs' must be int64 of shape [n], n <= {MAX_CONTRIBUTION_MBS} (microbatch ids)")
        mbs = () if ids is None else tuple(m % 2**64 for m in ids.tolist())
        opening = meta.get("opening")
        if opening is not None and (type(opening) is not bytes or not 0 < len(opening) <= MAX_OPENING_BYTES):
            raise RequestError(f"meta.opening must be 1..{MAX_OPENING_BYTES} bytes (a signed opening)")
        inputs, at = decode_inputs(frame), meta.get("in_at")
        inputs_params = inputs_precision = None
        if inputs:
            if not (isinstance(at, list) and len(at) == 2 and isinstance(at[0], str) and len(at[0]) == 64
                    and at[1] in _PRECISIONS):
                raise RequestError("meta.in_at must be [the parameters' 64-hex-character digest, precision] "
                                   "with 'in_x'")
            inputs_params, inputs_precision = at
        return cls(
            stage=stage,
            peer_id=peer_id,
            step=step,
            samples=samples,
            grads=grads,
            codec=codec,
            public_key=pk,
            signature=sig,
            digest=digest,
            mbs=mbs,
            norm=norm,
            opening=opening,
            inputs=inputs,
            inputs_params=inputs_params,
            inputs_precision=inputs_precision,
        )


def encode_inputs(inputs: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]) -> dict[str, torch.Tensor]:
    """``in_x`` (float32 bits as int32), ``in_y``, ``in_idx``: see :class:`AverageRequest`."""
    xs = [x.detach().to("cpu", torch.float32).contiguous().reshape(-1) for _, x, _ in inputs]
    ys = [y.detach().to("cpu", torch.int64).contiguous().reshape(-1) for _, _, y in inputs]
    idx = [[mb - 2**64 if mb >= 2**63 else mb, *x.shape] for mb, x, _ in inputs]
    return {"in_x": torch.cat(xs).view(torch.int32), "in_y": torch.cat(ys),
            "in_idx": torch.tensor(idx, dtype=torch.int64).reshape(len(inputs), 4)}


def decode_inputs(frame: Frame) -> tuple[tuple[int, torch.Tensor, torch.Tensor], ...]:
    x, y, idx = (frame.tensors.get(n) for n in ("in_x", "in_y", "in_idx"))
    if x is None and y is None and idx is None:
        return ()
    if x is None or y is None or idx is None:
        raise RequestError("a contribution's inputs need all of 'in_x', 'in_y' and 'in_idx'")
    if (idx.dtype != torch.int64 or idx.dim() != 2 or idx.shape[1] != 4
            or not 0 < idx.shape[0] <= MAX_CONTRIBUTION_INPUTS):
        raise RequestError(f"'in_idx' must be int64 of shape [m, 4], 0 < m <= {MAX_CONTRIBUTION_INPUTS}")
    if x.dtype != torch.int32 or x.dim() != 1 or y.dtype != torch.int64 or y.dim() != 1:
        raise RequestError("'in_x' must be int32 (float32 bits) and 'in_y' int64, both flat")
    rows = idx.tolist()
    if any(b < 1 or t < 1 or w < 1 for _, b, t, w in rows):
        raise RequestError("'in_idx' must give positive batch, seq and width sizes")
    if sum(b * t * w for _, b, t, w in rows) != x.numel() or sum(b * t for _, b, t, _ in rows) != y.numel():
        raise RequestError("'in_x' and 'in_y' must hold exactly the sizes 'in_idx' gives")
    floats = x.view(torch.float32)
    if not all_finite(floats):
        raise NonFinite("'in_x' (activations) contain NaN or Inf; refused")
    if len({mb for mb, *_ in rows}) != len(rows):
        raise RequestError("'in_idx' names a microbatch twice")
    out, xo, yo = [], 0, 0
    for mb, b, t, w in rows:
        out.append((mb % 2**64, floats[xo : xo + b * t * w].view(b, t, w), y[yo : yo + b * t].view(b, t)))
        xo, yo = xo + b * t * w, yo + b * t
    return tuple(out)


# ---- POST /v1/recheck -------------------------------------------------------------------------

#: The most bytes of activations a recheck's microbatch may carry (float32; the frame's limits apply too).
MAX_RECHECK_INPUT_BYTES = 256 * 2**20


@dataclass(frozen=True)
class RecheckRequest:
    """A conviction by recomputation, shown to a stage-mate to check itself
    (``swarmd.pipeline.averaging.trust.recomputation``, "Seconded"): the reporter's signed
    ``averaging`` report (meta ``body``, ``sig``: ``swarmd.pipeline.reports.MisbehaviourReport``, its
    evidence the opening's signed summary), the accused's signed opening (meta ``opening``, at most
    ``MAX_OPENING_BYTES``) and the inputs of its microbatch ``mb`` as the accused shipped them (tensors
    ``in_x``, ``in_y``, ``in_idx`` as in :class:`AverageRequest`, one microbatch). Types and shapes
    checked here; signatures, digests and the recomputation by the receiver. Answered with a
    ``ReportReply``."""

    body: bytes
    signature: bytes
    opening: bytes
    mb: int
    inputs: torch.Tensor
    targets: torch.Tensor

    KIND = "recheck"

    @property
    def nbytes(self) -> int:
        return self.inputs.numel() * 4

    def encode(self) -> bytes:
        meta = {"body": self.body, "sig": self.signature, "opening": self.opening}
        return encode_frame(self.KIND, meta, encode_inputs(((self.mb, self.inputs, self.targets),)), "none")

    @classmethod
    def from_frame(cls, frame: Frame) -> RecheckRequest:
        _kind(frame, cls.KIND)
        body, sig, opening = (frame.meta.get(k) for k in ("body", "sig", "opening"))
        if type(body) is not bytes or type(sig) is not bytes:
            raise RequestError("a recheck needs meta.body and meta.sig (a signed report) as bytes")
        if type(opening) is not bytes or not 0 < len(opening) <= MAX_OPENING_BYTES:
            raise RequestError(f"a recheck needs meta.opening: 1..{MAX_OPENING_BYTES} bytes (a signed opening)")
        if set(frame.tensors) != {"in_x", "in_y", "in_idx"}:
            raise RequestError("a recheck carries exactly one microbatch's inputs: 'in_x', 'in_y' and 'in_idx'")
        inputs = decode_inputs(frame)
        if len(inputs) != 1:
            raise RequestError("a recheck carries exactly one microbatch's inputs")
        mb, x, y = inputs[0]
        if x.numel() * 4 > MAX_RECHECK_INPUT_BYTES:
            raise RequestError(f"a recheck's activations are at most {MAX_RECHECK_INPUT_BYTES} bytes")
        return cls(body=body, signature=sig, opening=opening, mb=mb, inputs=x, targets=y)


@dataclass(frozen=True)
class PartRecheckRequest:
    """A conviction on a part an all-reduce member sent, shown to a stage-mate to check itself
    (``swarmd.pipeline.averaging.allreduce.sent_parts``), on the same endpoint as :class:`RecheckRequest`: the
    reporter's signed ``averaging`` report (meta ``body``, ``sig``), the accused's signed opening (meta
    ``opening``), the part (meta ``part``) and the accused's ``ar_part`` frame of it as its owner received it
    (tensor ``frame``, its bytes as uint8: its slice, whose digest the opening signs). Types checked here; the rest
    by the receiver. Answered with a ``ReportReply``."""

    body: bytes
    signature: bytes
    opening: bytes
    part: int
    frame: bytes

    KIND = "recheck_part"

    @property
    def nbytes(self) -> int:
        return len(self.frame)

    def encode(self) -> bytes:
        meta = {"body": self.body, "sig": self.signature, "opening": self.opening, "part": self.part}
        return encode_frame(self.KIND, meta, {"frame": torch.frombuffer(bytearray(self.frame), dtype=torch.uint8)},
                            "none")

    @classmethod
    def from_frame(cls, frame: Frame) -> PartRecheckRequest:
        _kind(frame, cls.KIND)
        body, sig, opening, part = (frame.meta.get(k) for k in ("body", "sig", "opening", "part"))
        if type(body) is not bytes or type(sig) is not bytes:
            raise RequestError("a recheck needs meta.body and meta.sig (a signed report) as bytes")
        if type(opening) is not bytes or not 0 < len(opening) <= MAX_OPENING_BYTES:
            raise RequestError(f"a recheck needs meta.opening: 1..{MAX_OPENING_BYTES} bytes (a signed opening)")
        if type(part) is not int or not 0 <= part < 2**16:
            raise RequestError("a part recheck needs meta.part: a part's index")
        shown = frame.tensors.get("frame")
        if set(frame.tensors) != {"frame"} or shown is None or shown.dtype != torch.uint8 or shown.dim() != 1:
            raise RequestError("a part recheck carries exactly one tensor, 'frame': the accused's part frame's bytes "
                               "as uint8")
        if not shown.numel():
            raise RequestError("a part recheck's 'frame' is empty")
        return cls(body=body, signature=sig, opening=opening, part=part, frame=shown.numpy().tobytes())


@dataclass(frozen=True)
class AverageReply:
    """The round's outcome: ``ok`` with the mean gradient every peer applies (``grads``), or
    ``aborted`` (the contributor keeps its gradients; ``grads`` None).

    ``used`` (meta ``used``): the contributions the mean holds, ``[peer_id, samples, digest,
    per-sample norm]`` each, so every contributor can check its own is among them
    (``swarmd.pipeline.averaging.trust.round_checks``); ``reason`` (meta ``reason``): why an ``aborted`` answer
    turned this contribution away (``refused: ...``, ``unproven``, ...), when it did.
    """

    stage: int
    status: Literal["ok", "aborted"]
    step: int
    samples: int  # the round's total
    contributors: int
    grads: torch.Tensor | None = None
    used: tuple[tuple[str, int, str, float], ...] | None = None
    reason: str | None = None

    KIND = "average_result"

    def encode(self, codec: str = "none") -> bytes:
        meta: dict[str, Any] = {
            "stage": self.stage,
            "status": self.status,
            "step": self.step,
            "samples": self.samples,
            "contributors": self.contributors,
        }
        if self.used is not None:
            meta["used"] = [list(u) for u in self.used]
        if self.reason is not None:
            meta["reason"] = self.reason
        tensors = {} if self.grads is None else {"grads": self.grads}
        return encode_frame(self.KIND, meta, tensors, codec)

    @classmethod
    def from_frame(cls, frame: Frame, grad_numel: int | None = None) -> AverageReply:
        """``grad_numel``: the size an ``ok`` answer's mean must have (None: not checked)."""
        stage, step = _reply_fields(frame, cls.KIND)
        ok = frame.meta.get("status") == "ok"
        grads = frame.tensors.get("grads") if ok else None
        if ok and (
            grads is None
            or grads.dtype != torch.float32
            or grads.dim() != 1
            or (grad_numel is not None and grads.numel() != grad_numel)
        ):
            raise MalformedFrame(f"an 'ok' average answer needs float32 'grads' of shape [{grad_numel or 'N'}]")
        used_meta, reason = frame.meta.get("used"), frame.meta.get("reason")
        used: tuple[tuple[str, int, str, float], ...] | None = None
        if used_meta is not None:
            if not isinstance(used_meta, list) or not all(
                isinstance(u, list)
                and len(u) == 4
                and isinstance(u[0], str)
                and _is_int(u[1])
                and isinstance(u[2], str)
                and isinstance(u[3], (int, float))
                and not isinstance(u[3], bool)
                for u in used_meta
            ):
                raise MalformedFrame("an average answer's meta.used lists [peer_id, samples, digest, norm] entries")
            used = tuple((u[0], int(u[1]), u[2], float(u[3])) for u in used_meta)
        if reason is not None and not isinstance(reason, str):
            raise MalformedFrame("an average answer's meta.reason must be a string")
        return cls(
            stage=stage,
            status="ok" if ok else "aborted",
            step=step,
            samples=_reply_int(frame.meta, "samples", 0),
            contributors=_reply_int(frame.meta, "contributors", 0),
            grads=grads,
            used=used,
            reason=reason[:500] if reason is not None else None,
        )


# ---- GET /v1/progress -----------------------------------------------------------------------


@dataclass(frozen=True)
class ProgressRequest:
    """``?wait_step=N&wait_s=T``: a long-poll, answered once the stage reaches step ``N`` or after
    ``T`` seconds (at most :data:`MAX_PROGRESS_WAIT_S`); without ``wait_step``, at once."""

    wait_step: int | None = None
    wait_s: float = 1.0

    def to_query(self) -> dict[str, str]:
        if self.wait_step is None:
            return {}
        return {"wait_step": str(self.wait_step), "wait_s": repr(float(self.wait_s))}

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> ProgressRequest:
        wait_step = query.get("wait_step")
        if wait_step is None:
            return cls()
        try:
            step, wait_s = int(wait_step), float(query.get("wait_s", "1"))
        except ValueError:
            raise RequestError("wait_step must be an integer and wait_s a number") from None
        if not 0.0 <= wait_s <= MAX_PROGRESS_WAIT_S:  # NaN fails this too
            raise RequestError(f"wait_s must lie in [0, {MAX_PROGRESS_WAIT_S}]")
        return cls(wait_step=step, wait_s=wait_s)


@dataclass(frozen=True)
class ProgressReply:
    """``GET /v1/progress``: where a peer's stage stands, for its stage-mates' rounds and for
    trainers. One shape whether or not the peer takes part in rounds right now.

    ``samples`` are those held for ``step`` (accumulating, or out for averaging while
    ``averaging``). ``away``: the peer takes no part in its stage's rounds (starting, or moving
    to another stage); then the round fields are None and stage-mates ignore it. ``leader``:
    whom the peer takes for the leader of the round of ``step``; ``round``: the step of the
    round open here (this peer leads it) to contributions; ``round_expected`` /
    ``round_contributors``: whom that open round waits for, and the samples of those already in.
    ``dropped_samples``: samples discarded by adopting a stage-mate's state (a resync).
    """

    stage: int
    step: int
    samples: int
    averaging: bool = False
    away: bool = False
    peer_id: str | None = None
    leader: str | None = None
    round: int | None = None
    round_expected: tuple[str, ...] | None = None
    round_contributors: Mapping[str, int] | None = field(default=None, hash=False)
    dropped_samples: int = 0
    target_batch_size: int | None = None
    params_digest: str | None = None  # of the parameters at ``step``: stage-mates average only with equal ones
    excluded: tuple[str, ...] = ()  # peers this peer's report ledger excludes (swarmd.pipeline.reports)
    suspected: tuple[str, ...] = ()  # peers it holds one report against: trainers check them more

    def to_json(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "stage": self.stage,
            "step": self.step,
            "samples": self.samples,
            "averaging": self.averaging,
            "away": self.away,
            "leader": self.leader,
            "round": self.round,
            "round_expected": list(self.round_expected) if self.round_expected is not None else None,
            "round_contributors": dict(self.round_contributors) if self.round_contributors is not None else None,
            "dropped_samples": self.dropped_samples,
            "target_batch_size": self.target_batch_size,
            "params_digest": self.params_digest,
            "excluded": list(self.excluded),
            "suspected": list(self.suspected),
        }

    @classmethod
    def from_json(cls, body: Any) -> ProgressReply:
        """Validate a peer's answer. ``stage``, ``step`` and ``samples`` are required; the rest
        default (an older peer may not send them) and unknown keys are ignored."""
        where = "a progress reply"
        if not isinstance(body, dict):
            raise MalformedFrame(f"{where} must be a JSON object")

        def optional(key: str, kind: type) -> Any:
            value = body.get(key)
            if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
                raise MalformedFrame(f"{where}: '{key}' has the wrong type ({value!r:.40})")
            return value

        expected = optional("round_expected", list)
        contributors = optional("round_contributors", dict)
        excluded = optional("excluded", list) or []
        suspected = optional("suspected", list) or []
        for key, ids in (("excluded", excluded), ("suspected", suspected)):
            if len(ids) > MAX_EXCLUDED or not all(isinstance(p, str) and len(p) <= MAX_PEER_ID_LEN for p in ids):
                raise MalformedFrame(f"{where}: '{key}' must list at most {MAX_EXCLUDED} peer ids")
        if expected is not None and not all(isinstance(p, str) for p in expected):
            raise MalformedFrame(f"{where}: 'round_expected' must list peer ids")
        if contributors is not None and not all(_is_int(n) for n in contributors.values()):
            raise MalformedFrame(f"{where}: 'round_contributors' must map peer ids to sample counts")
        samples = _json_field(body, "samples", int, where)
        step = _json_field(body, "step", int, where)
        if samples < 0 or step < 0:
            raise MalformedFrame(f"{where}: 'step' and 'samples' must not be negative")
        return cls(
            stage=_json_field(body, "stage", int, where),
            step=step,
            samples=samples,
            averaging=bool(optional("averaging", bool)),
            away=bool(optional("away", bool)),
            peer_id=optional("peer_id", str),
            leader=optional("leader", str),
            round=optional("round", int),
            round_expected=tuple(expected) if expected is not None else None,
            round_contributors=MappingProxyType(dict(contributors)) if contributors is not None else None,
            dropped_samples=optional("dropped_samples", int) or 0,
            target_batch_size=optional("target_batch_size", int),
            params_digest=optional("params_digest", str),
            excluded=tuple(excluded),
            suspected=tuple(suspected),
        )
