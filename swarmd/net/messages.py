"""The data plane's contract: one request and one reply type per endpoint, as pure code.

``swarmd.net.wire`` says how a frame is laid out (meta + tensors, versioned, hostile-proof);
this module says what each endpoint's frames *mean*. Every request and reply is a frozen
dataclass with an ``encode`` to the wire and a ``from_frame`` / ``from_json`` that validates
remote input and raises only typed errors (``RequestError`` 422, ``WrongStage`` 409, never an
``assert``). ``swarmd.net.server`` decodes requests and encodes replies with them,
``swarmd.net.client`` the other way round, so neither side handles string-keyed dicts.

Endpoints (frames are ``application/x-msgpack``; info and progress answer JSON):

================  ==========================  ==========================================
endpoint          request                     reply
================  ==========================  ==========================================
POST /v1/forward  :class:`ForwardRequest`     :class:`ForwardReply`
POST /v1/backward :class:`BackwardRequest`    :class:`BackwardReply`
POST /v1/average  :class:`AverageRequest`     :class:`AverageReply`
POST /v1/reserve  :class:`ReserveRequest`     :class:`ReserveReply`
POST /v1/claim    :class:`ClaimRequest`       :class:`ClaimReply`
POST /v1/report   :class:`ReportRequest`      :class:`ReportReply`
GET  /v1/info     (none)                      :class:`InfoReply`
GET  /v1/progress :class:`ProgressRequest`    :class:`ProgressReply` (one shape, always)
================  ==========================  ==========================================

The frames are those of wire version 1, unchanged: compute requests carry ``meta.stage``
(required), ``meta.model`` (the spec digest, optional), ``meta.codec`` (the codec of the
reply's float tensors, default ``none``), and ``meta.mb``/``meta.step`` where they apply; every
reply carries ``meta.stage`` and ``meta.step``. Decoders ignore meta keys and tensors they do
not know, so a newer peer may add some. (``GET /v1/state`` has its own stream format:
``swarmd.net.state_transfer``.)

A request is checked in this order, so a request that is wrong in several ways always gets
the same answer: its meta types (``stage`` an integer), then whether it is meant for the
receiving peer (:class:`StageTarget`: stage 409, model 409), then ``codec``, then the
endpoint's own fields and tensors (422). The shapes and values of the tensors a stage
computes with are the executor's to check: only it knows the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, TypeGuard

import torch

from swarmd.errors import MalformedFrame, NonFinite, RequestError, WrongStage
from swarmd.finite import all_finite
from swarmd.net.codecs import CODECS
from swarmd.net.token_ids import narrow, widen
from swarmd.net.wire import Frame, WireLimits, encode_frame

__all__ = [
    "HOP_MARGIN_MS",
    "PRECISIONS",
    "MAX_PROGRESS_WAIT_S",
    "MAX_PEER_ID_LEN",
    "AverageReply",
    "AverageRequest",
    "BackwardReply",
    "BackwardRequest",
    "ClaimReply",
    "ClaimRequest",
    "ForwardReply",
    "ForwardRequest",
    "Hop",
    "HopResult",
    "InfoLimits",
    "InfoReply",
    "ModelInfo",
    "ProgressReply",
    "ProgressRequest",
    "ReportReply",
    "ReportRequest",
    "ReserveReply",
    "ReserveRequest",
    "StageTarget",
]

#: The precisions a stage computes in (``--precision``, ``swarmd.pipeline.precision``), as a reply names
#: the one that computed it: spot checks compare answers of like precision only.
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")

#: The longest a ``/v1/progress`` long-poll (``?wait_step=``) is held open, in seconds.
MAX_PROGRESS_WAIT_S = 10.0
#: A peer id is 64 hex characters; a contribution naming a longer one is refused.
MAX_PEER_ID_LEN = 64
#: The most peer ids a progress reply's ``excluded`` may list.
MAX_EXCLUDED = 1024
#: The most microbatch ids a contribution may name (``AverageRequest.mbs``, an int64 tensor: 8 MiB
#: at most). A peer holding more sends none: the ids feed a counter (exactly once), never the mean.
MAX_CONTRIBUTION_MBS = 1 << 20
#: The highest attempt number a backward or claim may carry (a trainer retries a few times).
MAX_ATTEMPT = 1 << 20
#: Peer to peer (issue #31): the most next hops a forward may carry, the longest hop address, the
#: longest wait for a hop, the longest ``origin`` (an IP address) and a reply's ``hop_error``.
MAX_HOPS = 64
MAX_HOP_ADDR_LEN = 300
MAX_HOP_TIMEOUT_MS = 3_600_000
MAX_ORIGIN_LEN = 64
MAX_HOP_ERROR_LEN = 200
#: What a peer keeps of its own budget to answer its sender after its next hop gave up (peer to peer).
HOP_MARGIN_MS = 250


@dataclass(frozen=True)
class StageTarget:
    """What the receiving peer serves: a request for another stage or model is refused (409)."""

    stage: int
    model: str  # the ModelSpec digest
    grad_numel: int | None = None  # the stage's gradient size, for /v1/average


# ---- validation helpers (remote input: typed errors, never assert) ---------------------------


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(meta: Mapping[str, Any], key: str, what: str) -> int:
    value = meta.get(key)
    if not _is_int(value) or value < 0:
        raise RequestError(f"meta.{key} must be a non-negative integer ({what}), got {value!r:.60}")
    return int(value)


def _optional_count(meta: Mapping[str, Any], key: str, what: str) -> int | None:
    return None if meta.get(key) is None else _count(meta, key, what)


def _stage(meta: Mapping[str, Any]) -> int:
    stage = meta.get("stage")
    if not _is_int(stage):
        raise RequestError("meta.stage (an integer) is required")
    return int(stage)


def _check_target(stage: int, model: Any, target: StageTarget | None) -> None:
    if target is None:
        return
    if stage != target.stage:
        raise WrongStage(f"this peer serves stage {target.stage}, not stage {stage}")
    if model is not None and model != target.model:
        raise WrongStage(f"this peer serves model {target.model[:12]}, not {str(model)[:12]}")


def _codec(meta: Mapping[str, Any]) -> str:
    codec = meta.get("codec", "none")
    if not isinstance(codec, str) or codec not in CODECS:  # a list or map is unhashable: no 500
        raise RequestError(f"meta.codec must be one of {sorted(CODECS)}, got {codec!r:.60}")
    return codec


def _model(model: Any) -> str | None:
    if model is not None and not isinstance(model, str):
        raise RequestError(f"meta.model must be a model digest (a string), got {model!r:.60}")
    return model


def _microbatch_id(meta: Mapping[str, Any]) -> int | None:
    """``meta.mb``: the trainer's id of the microbatch (keys the peer's activation cache)."""
    mb = meta.get("mb")
    if mb is not None and (not _is_int(mb) or not 0 <= mb < 2**64):
        raise RequestError(f"meta.mb must be an integer in [0, 2**64) (a microbatch id), got {mb!r:.60}")
    return mb


def _attempt(meta: Mapping[str, Any]) -> int:
    """``meta.attempt``: the trainer's number of this attempt at the microbatch (default 0)."""
    attempt = meta.get("attempt", 0)
    if not _is_int(attempt) or not 0 <= attempt <= MAX_ATTEMPT:
        raise RequestError(f"meta.attempt must be an integer in [0, {MAX_ATTEMPT}], got {attempt!r:.40}")
    return int(attempt)


def _required(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise RequestError(f"the frame has no '{name}' tensor (it has {sorted(tensors) or 'none'})") from None


def _kind(frame: Frame, kind: str) -> None:
    if frame.kind != kind:
        raise RequestError(f"this endpoint takes a '{kind}' frame, got '{frame.kind}'")


def _reply_fields(frame: Frame, kind: str) -> tuple[int, int]:
    """``(stage, step)`` of a reply frame; MalformedFrame when the peer sent something else."""
    if frame.kind != kind:
        raise MalformedFrame(f"expected a '{kind}' reply, got a '{frame.kind}' frame")
    stage, step = frame.meta.get("stage"), frame.meta.get("step")
    if not _is_int(stage) or not _is_int(step) or step < 0:
        raise MalformedFrame(f"a '{kind}' reply needs integer meta.stage and meta.step, "
                             f"got {stage!r:.30}, {step!r:.30}")
    return int(stage), int(step)


def _reply_float(meta: Mapping[str, Any], key: str) -> float | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedFrame(f"a reply's meta.{key} must be a number, got {value!r:.30}")
    return float(value)


def _reply_int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if not _is_int(value) or value < 0:
        raise MalformedFrame(f"a reply's meta.{key} must be a non-negative integer, got {value!r:.30}")
    return int(value)


# ---- POST /v1/forward -------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardRequest:
    """Run a stage's forward on ``inputs``; on the last stage with ``targets``, the loss.

    ``mb`` names the microbatch: the peer keeps the forward's activations under it for the
    backward (``swarmd.pipeline.executor``'s activation cache). ``codec`` is the codec of the
    request's own float tensors and of the reply's.

    Peer to peer (issue #31, meta ``next``, ``peer``, ``origin``; all optional): ``next`` lists the
    peers of the following stages the trainer chose (:class:`Hop`), so the receiving peer sends its
    outputs straight to ``next[0]`` (with ``next[1:]``) and answers with the chain's end
    (:class:`ForwardReply` ``chain``). ``peer``: the peer id the request is meant for (a hop names
    it: an address now held by another peer refuses it, 409). ``origin``: the trainer's address as
    the first peer saw it, which a kept forward is tied to instead of the sending peer's. With
    ``next``, ``targets`` are the last stage's, carried to the chain's last hop when that is the
    last stage's fused call (``Hop.deadline_ms``); no stage before it computes a loss.
    ``budget_ms`` (required with ``next``): how long the sender waits for this request's answer, from
    when it sent it; the receiver gives its next hop no more than what is left of it, less
    :data:`HOP_MARGIN_MS` (and a fused hop's deadline as much less), so that whatever a later stage
    counts, it counts before any sender before it gives up (exactly once, ``swarmd.pipeline.step_protocol``).
    ``back`` (meta ``back: true``, only with a fused last hop): the backward chain. Once the chain's end
    answered, each peer runs its own stage's backward (attempt 0, on the inputs it kept, counted for
    ``origin`` within what is left of ``budget_ms`` less :data:`HOP_MARGIN_MS`) with the input gradient
    the stage after it answered, and answers its sender with its own input gradient instead
    (:class:`ForwardReply` ``backs``); a peer whose backward failed answers the gradient it got and why
    (``back_error``), and the trainer sends the remaining backwards itself.
    """

    stage: int
    inputs: torch.Tensor
    targets: torch.Tensor | None = None
    model: str | None = None
    codec: str = "none"
    mb: int | None = None
    next: tuple[Hop, ...] = ()
    peer: str | None = None
    origin: str | None = None
    budget_ms: int | None = None
    back: bool = False

    KIND = "forward"

    def encode(self) -> bytes:
        meta: dict[str, Any] = {"stage": self.stage, "codec": self.codec}
        if self.model is not None:
            meta["model"] = self.model
        if self.mb is not None:
            meta["mb"] = self.mb
        if self.next:
            meta["next"] = [hop.to_meta() for hop in self.next]
        if self.peer is not None:
            meta["peer"] = self.peer
        if self.origin is not None:
            meta["origin"] = self.origin
        if self.budget_ms is not None:
            meta["budget_ms"] = self.budget_ms
        if self.back:
            meta["back"] = True
        tensors = {"inputs": narrow(self.inputs)}  # token ids travel narrow (swarmd.net.token_ids)
        if self.targets is not None:
            tensors["targets"] = narrow(self.targets)
        return encode_frame(self.KIND, meta, tensors, self.codec)

    @classmethod
    def from_frame(cls, frame: Frame, target: StageTarget | None = None) -> ForwardRequest:
        _kind(frame, cls.KIND)
        meta = frame.meta
        stage = _stage(meta)
        _check_target(stage, meta.get("model"), target)
        codec = _codec(meta)
        targets = widen(frame.tensors.get("targets"))
        hops = Hop.list_from_meta(meta.get("next"), stage)
        fused = bool(hops) and hops[-1].deadline_ms is not None
        if hops and (targets is not None) != fused:
            raise RequestError("a forward with next hops carries targets exactly when its last hop is the last "
                               "stage's fused call (a hop with a deadline)")
        mb = _microbatch_id(meta)
        if hops and mb is None:
            raise RequestError("a forward with a next hop must name its microbatch (meta.mb)")
        budget_ms = _optional_count(meta, "budget_ms", "how long the sender waits, in ms")
        if hops and budget_ms is None:
            raise RequestError("a forward with next hops must say how long its sender waits (meta.budget_ms)")
        back = meta.get("back", False)
        if not isinstance(back, bool):
            raise RequestError(f"meta.back must be true or false, got {back!r:.40}")
        if back and not fused:
            raise RequestError("a backward chain (meta.back) needs next hops ending in the last stage's fused call")
        return cls(stage=stage, inputs=widen(_required(frame.tensors, "inputs")), targets=targets,
                   model=_model(meta.get("model")), codec=codec, mb=mb, next=hops,
                   peer=_short_str(meta, "peer", MAX_PEER_ID_LEN), origin=_short_str(meta, "origin", MAX_ORIGIN_LEN),
                   budget_ms=budget_ms, back=back)


@dataclass(frozen=True)
class ForwardReply:
    """The stage's outputs (hidden states or logits) at ``step``; with targets, the scalar
    mean ``loss`` (then ``outputs`` is that loss as a 0-d tensor, exactly as computed).

    ``kept`` (meta ``kept: true``): the peer keeps the forward's inputs (and graph) under the
    request's ``mb`` for its backward, which may then omit them (:class:`BackwardRequest`). An
    older peer never says so, and an older trainer ignores it: it always resends the inputs.

    Peer to peer (a request with ``next``): ``chain`` (meta ``chain``) holds what each later stage
    that the outputs went through answered (:class:`HopResult`), in stage order, and ``outputs`` are
    then the last of them's; ``wait_ms`` how long this peer waited for its next hop's answer;
    ``hop_error`` (meta ``hop_error``) why the next hop failed, when it did: ``chain`` then ends
    there and the sender goes on from the next stage itself. ``fused`` (meta ``fused``, tensor
    ``fused_grad_inputs``): the last stage's answer when the chain ended in its fused forward and
    backward; ``outputs`` are then empty (nobody needs the last stage's inputs any more).

    The backward chain (a request with ``back``): ``backs`` (meta ``backs``, tensor ``back_grad_inputs``)
    holds the backward answers of the stages ``j .. S-2`` whose peers ran theirs, in stage order, only the
    first carrying its input gradient (none when ``j`` is stage 0: token ids have none); ``fused`` then
    carries none. ``back_error``: why the backward chain stopped short of this stage, when it did.
    """

    stage: int
    step: int
    outputs: torch.Tensor
    loss: float | None = None
    precision: str = "fp32"  # what computed it (``--precision``): spot checks compare like with like
    kept: bool = False
    chain: tuple[HopResult, ...] = ()
    wait_ms: int = 0
    hop_error: str | None = None
    fused: BackwardReply | None = None
    backs: tuple[BackwardReply, ...] = ()
    back_error: str | None = None

    KIND = "forward_result"

    def encode(self, codec: str = "none") -> bytes:
        meta: dict[str, Any] = {"stage": self.stage, "step": self.step}
        if self.precision != "fp32":
            meta["precision"] = self.precision
        if self.kept:
            meta["kept"] = True
        if self.chain:
            meta["chain"] = [hop.to_meta() for hop in self.chain]
        if self.wait_ms:
            meta["wait_ms"] = self.wait_ms
        if self.hop_error is not None:
            meta["hop_error"] = self.hop_error[:MAX_HOP_ERROR_LEN]
        if self.back_error is not None:
            meta["back_error"] = self.back_error[:MAX_HOP_ERROR_LEN]
        if self.fused is not None:
            f = self.fused
            meta["fused"] = _back_meta(f)
            tensors = {} if f.grad_inputs is None or self.backs else {"fused_grad_inputs": f.grad_inputs}
            if self.backs:
                meta["backs"] = [_back_meta(b) for b in self.backs]
                if self.backs[0].grad_inputs is not None:
                    tensors["back_grad_inputs"] = self.backs[0].grad_inputs
            return encode_frame(self.KIND, meta, tensors, codec)
        if self.loss is not None:
            meta["loss"] = self.loss
            return encode_frame(self.KIND, meta, {"loss": self.outputs}, codec)
        return encode_frame(self.KIND, meta, {"outputs": self.outputs}, codec)

    @classmethod
    def from_frame(cls, frame: Frame) -> ForwardReply:
        stage, step = _reply_fields(frame, cls.KIND)
        fused = _fused_reply(frame)
        back_error = frame.meta.get("back_error")
        if back_error is not None and not isinstance(back_error, str):
            raise MalformedFrame(f"a forward reply's meta.back_error must be a string, got {back_error!r:.30}")
        if fused is not None:
            return cls(stage=stage, step=step, outputs=torch.empty(0), precision=_reply_precision(frame.meta),
                       kept=frame.meta.get("kept") is True,
                       chain=HopResult.list_from_meta(frame.meta.get("chain"), stage),
                       wait_ms=_reply_int(frame.meta, "wait_ms", 0), fused=fused, backs=_backs(frame),
                       back_error=None if back_error is None else back_error[:MAX_HOP_ERROR_LEN])
        loss = _reply_float(frame.meta, "loss")
        name = "outputs" if loss is None else "loss"
        outputs = frame.tensors.get(name)
        if outputs is None:
            raise MalformedFrame(f"a forward reply {'with' if loss is not None else 'without'} a loss needs "
                                 f"a '{name}' tensor (it has {sorted(frame.tensors) or 'none'})")
        kept = frame.meta.get("kept", False)
        if not isinstance(kept, bool):
            raise MalformedFrame(f"a forward reply's meta.kept must be true or false, got {kept!r:.30}")
        hop_error = frame.meta.get("hop_error")
        if hop_error is not None and not isinstance(hop_error, str):
            raise MalformedFrame(f"a forward reply's meta.hop_error must be a string, got {hop_error!r:.30}")
        return cls(stage=stage, step=step, outputs=outputs, loss=loss, precision=_reply_precision(frame.meta),
                   kept=kept, chain=HopResult.list_from_meta(frame.meta.get("chain"), stage),
                   wait_ms=_reply_int(frame.meta, "wait_ms", 0),
                   hop_error=None if hop_error is None else hop_error[:MAX_HOP_ERROR_LEN])


# ---- peer to peer: a forward's next hops and what they answered (issue #31) --------------------


@dataclass(frozen=True)
class Hop:
    """A peer of a later stage that a forward's outputs go to directly (the trainer's routing choice):
    its dialable ``addr`` (``host:port``; never a relayed one, which its stage-mates cannot dial), its
    ``peer_id``, and how long the sender waits for its answer, the rest of the chain included.

    ``deadline_ms`` (the last hop only): the hop is the last stage's fused forward and backward
    (a :class:`BackwardRequest` with the chain's ``targets``), whose gradient its peer adds only within
    this long of receiving it (exactly once, as a trainer's own backward: ``deadline_ms`` there)."""

    stage: int
    addr: str
    peer_id: str
    timeout_ms: int
    deadline_ms: int | None = None

    def to_meta(self) -> list[Any]:
        head = [self.stage, self.addr, self.peer_id, self.timeout_ms]
        return head if self.deadline_ms is None else [*head, self.deadline_ms]

    @classmethod
    def list_from_meta(cls, value: Any, stage: int) -> tuple[Hop, ...]:
        """``meta.next`` of a forward to ``stage``: hops of stages ``stage+1, stage+2, ...`` in order
        (RequestError, 422, for anything else)."""
        if value is None:
            return ()
        if not isinstance(value, list) or len(value) > MAX_HOPS:
            raise RequestError(f"meta.next must list at most {MAX_HOPS} hops")
        hops = []
        for i, hop in enumerate(value):
            if not (isinstance(hop, list) and len(hop) in (4, 5) and _is_int(hop[0]) and isinstance(hop[1], str)
                    and isinstance(hop[2], str) and all(_is_int(v) for v in hop[3:])):
                raise RequestError("each hop of meta.next must be [stage, addr, peer_id, timeout_ms(, deadline_ms)]")
            hop_stage, addr, peer_id, timeout_ms = hop[:4]
            deadline_ms = hop[4] if len(hop) == 5 else None
            if deadline_ms is not None and (i != len(value) - 1 or not 0 <= deadline_ms < timeout_ms):
                raise RequestError(f"hop {i} of meta.next: only the last hop (a fused forward and backward) has a "
                                   "deadline, shorter than its timeout")
            if hop_stage != stage + 1 + i:
                raise RequestError(f"hop {i} of meta.next must be for stage {stage + 1 + i}, not {hop_stage!r:.20}")
            if not 0 < len(addr) <= MAX_HOP_ADDR_LEN or "@" in addr or "/" in addr or ":" not in addr:
                raise RequestError(f"hop {i} of meta.next needs a direct host:port address, got {addr!r:.60}")
            if not 0 < len(peer_id) <= MAX_PEER_ID_LEN:
                raise RequestError(f"hop {i} of meta.next needs a peer id of at most {MAX_PEER_ID_LEN} characters")
            if not 0 < timeout_ms <= MAX_HOP_TIMEOUT_MS:
                raise RequestError(f"hop {i} of meta.next needs a timeout in (0, {MAX_HOP_TIMEOUT_MS}] ms")
            hops.append(cls(stage=hop_stage, addr=addr, peer_id=peer_id, timeout_ms=timeout_ms,
                            deadline_ms=deadline_ms))
        return tuple(hops)


@dataclass(frozen=True)
class HopResult:
    """What the peer of one later stage answered a peer-to-peer forward: what the trainer would have
    read in its own :class:`ForwardReply` (``step``, ``kept``, ``precision``), the answering
    ``peer_id`` (the one the hop named) and ``wait_ms``, how long it waited on its own next hop."""

    stage: int
    step: int
    peer_id: str
    kept: bool = False
    precision: str = "fp32"
    wait_ms: int = 0

    def to_meta(self) -> list[Any]:
        return [self.stage, self.step, self.peer_id, self.kept, self.precision, self.wait_ms]

    @classmethod
    def list_from_meta(cls, value: Any, stage: int) -> tuple[HopResult, ...]:
        """``meta.chain`` of a forward reply from ``stage``: results of stages ``stage+1, ...`` in
        order (MalformedFrame, the answering peer's fault, for anything else)."""
        if value is None:
            return ()
        if not isinstance(value, list) or len(value) > MAX_HOPS:
            raise MalformedFrame(f"a forward reply's meta.chain must list at most {MAX_HOPS} results")
        results = []
        for i, item in enumerate(value):
            if not (isinstance(item, list) and len(item) == 6 and _is_int(item[0]) and _is_int(item[1])
                    and item[1] >= 0 and isinstance(item[2], str) and len(item[2]) <= MAX_PEER_ID_LEN
                    and isinstance(item[3], bool) and item[4] in PRECISIONS and _is_int(item[5]) and item[5] >= 0):
                raise MalformedFrame("each result of a forward reply's meta.chain must be "
                                     "[stage, step, peer_id, kept, precision, wait_ms]")
            if item[0] != stage + 1 + i:
                raise MalformedFrame(f"result {i} of a forward reply's meta.chain must be stage {stage + 1 + i}")
            results.append(cls(stage=item[0], step=item[1], peer_id=item[2], kept=item[3], precision=str(item[4]),
                               wait_ms=item[5]))
        return tuple(results)


def _fused_reply(frame: Frame) -> BackwardReply | None:
    """A chained forward reply's ``meta.fused``: the last stage's fused answer, as its own reply."""
    fused = frame.meta.get("fused")
    if fused is None:
        return None
    if not isinstance(fused, dict):
        raise MalformedFrame("a forward reply's meta.fused must be a map")
    tensors = {} if "fused_grad_inputs" not in frame.tensors else {"grad_inputs": frame.tensors["fused_grad_inputs"]}
    return BackwardReply.from_frame(Frame(BackwardReply.KIND, fused, tensors))


def _back_meta(reply: BackwardReply) -> dict[str, Any]:
    """A backward answer carried in a chained forward reply (``meta.fused``, ``meta.backs``), its tensor aside."""
    return {"stage": reply.stage, "step": reply.step, "samples": reply.samples, "accumulated": reply.accumulated,
            "loss": reply.loss, "duplicate": reply.duplicate, "precision": reply.precision}


def _backs(frame: Frame) -> tuple[BackwardReply, ...]:
    """A chained forward reply's ``meta.backs``: the backward chain's answers, in stage order, the first
    with the gradient at its stage's inputs (tensor ``back_grad_inputs``), the stages one after another."""
    backs = frame.meta.get("backs")
    if backs is None:
        return ()
    if not isinstance(backs, list) or not 0 < len(backs) <= MAX_HOPS or not all(isinstance(b, dict) for b in backs):
        raise MalformedFrame(f"a forward reply's meta.backs must list 1 to {MAX_HOPS} maps")
    grad = frame.tensors.get("back_grad_inputs")
    replies = tuple(BackwardReply.from_frame(Frame(BackwardReply.KIND, b, {} if i or grad is None else
                                                   {"grad_inputs": grad})) for i, b in enumerate(backs))
    if any(b.stage != replies[0].stage + i for i, b in enumerate(replies)):
        raise MalformedFrame("a forward reply's meta.backs must be of stages one after another")
    return replies


def _short_str(meta: Mapping[str, Any], key: str, longest: int) -> str | None:
    value = meta.get(key)
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= longest):
        raise RequestError(f"meta.{key} must be a string of 1 to {longest} characters, got {value!r:.40}")
    return value


# ---- POST /v1/backward ------------------------------------------------------------------------


@dataclass(frozen=True)
class BackwardRequest:
    """Backpropagate ``grad_outputs`` (the last stage: the loss of ``targets``) through the stage
    at ``inputs``, and accumulate the parameter gradients.

    ``inputs`` None (no ``inputs`` tensor in the frame): the stage inputs are those of the forward
    this peer ran under ``mb`` and said it kept (:class:`ForwardReply` ``kept``), so they do not
    travel twice (SWARM's stateless backward resends them: 3 tensors per boundary instead of 2).
    Such a request must name ``mb``; a peer that does not hold that forward any more (restarted,
    evicted it, never ran it) refuses it with ``InputsNotCached`` (409) before computing anything,
    and the sender resends it with the inputs.

    ``step``: the step this stage's forward reported for the microbatch (None: no check, as for
    the last stage's fused forward + backward); a backward computed at another step is refused
    (``StaleStep`` / ``PeerBehind``). ``mb``: the id the forward was sent with; a stage counts
    each ``mb`` once per step (``swarmd.pipeline.step_protocol``). ``deadline_ms``: how long the
    sender waits for the answer, from when the peer got the request; the peer applies the
    gradient only within it (past it, the sender has retried elsewhere: exactly-once).
    ``verify``: computed and answered, never accumulated nor marked as counted (meta ``verify:
    true``): a retry whose first attempt another peer said it counted, or a spot check's second
    or third opinion, asked after another peer answered. A paired microbatch's halves never send
    it (issue #29: a check is an ordinary paired microbatch, ``swarmd.train.spot_checks``), so it
    tells the peer checked nothing: that peer answered before any opinion was asked. ``attempt``:
    the sender's number of this attempt at ``mb`` on this stage (from 0; a :class:`ClaimRequest`
    fences earlier ones off).
    """

    stage: int
    inputs: torch.Tensor | None  # None: the inputs of the forward this peer kept under ``mb``
    grad_outputs: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    model: str | None = None
    codec: str = "none"
    step: int | None = None
    mb: int | None = None
    deadline_ms: int | None = None
    verify: bool = False
    attempt: int = 0
    peer: str | None = None  # peer to peer (issue #31): as ForwardRequest's, for a fused last hop
    origin: str | None = None

    KIND = "backward"

    def encode(self) -> bytes:
        meta: dict[str, Any] = {"stage": self.stage, "codec": self.codec}
        if self.model is not None:
            meta["model"] = self.model
        if self.step is not None:
            meta["step"] = self.step
        if self.mb is not None:
            meta["mb"] = self.mb
        if self.deadline_ms is not None:
            meta["deadline_ms"] = self.deadline_ms
        if self.verify:
            meta["verify"] = True
        if self.attempt:
            meta["attempt"] = self.attempt
        if self.peer is not None:
            meta["peer"] = self.peer
        if self.origin is not None:
            meta["origin"] = self.origin
        if self.inputs is None and self.mb is None:
            raise ValueError("a backward without inputs must name the microbatch whose forward the peer kept")
        tensors = {} if self.inputs is None else {"inputs": narrow(self.inputs)}
        if self.grad_outputs is not None:
            tensors["grad_outputs"] = self.grad_outputs
        if self.targets is not None:
            tensors["targets"] = narrow(self.targets)
        return encode_frame(self.KIND, meta, tensors, self.codec)

    @classmethod
    def from_frame(cls, frame: Frame, target: StageTarget | None = None) -> BackwardRequest:
        _kind(frame, cls.KIND)
        meta = frame.meta
        stage = _stage(meta)
        _check_target(stage, meta.get("model"), target)
        codec = _codec(meta)
        inputs = widen(frame.tensors.get("inputs"))
        mb = _microbatch_id(meta)
        if inputs is None and mb is None:
            raise RequestError("a backward without 'inputs' must name (meta.mb) the microbatch whose forward "
                               "this peer kept")
        step = _optional_count(meta, "step", "the step the forward reported")
        deadline_ms = _optional_count(meta, "deadline_ms", "how long the sender waits, in ms")
        verify = meta.get("verify", False)
        if not isinstance(verify, bool):
            raise RequestError(f"meta.verify must be true or false, got {verify!r:.40}")
        return cls(stage=stage, inputs=inputs, grad_outputs=frame.tensors.get("grad_outputs"),
                   targets=widen(frame.tensors.get("targets")), model=_model(meta.get("model")), codec=codec, step=step,
                   mb=mb, deadline_ms=deadline_ms, verify=verify, attempt=_attempt(meta),
                   peer=_short_str(meta, "peer", MAX_PEER_ID_LEN), origin=_short_str(meta, "origin", MAX_ORIGIN_LEN))


@dataclass(frozen=True)
class BackwardReply:
    """The gradient with respect to the stage's inputs (None on stage 0: token ids have none),
    the ``samples`` this backward added, the stage's ``accumulated`` total for ``step``, and on
    the last stage the microbatch's mean ``loss``. ``duplicate``: this stage had counted the
    microbatch at this step already (a retry whose first answer was lost): the gradients are
    answered again, not accumulated again."""

    stage: int
    step: int
    samples: int
    accumulated: int
    grad_inputs: torch.Tensor | None = None
    loss: float | None = None
    duplicate: bool = False
    precision: str = "fp32"  # what computed it (``--precision``): spot checks compare like with like

    KIND = "backward_result"

    def encode(self, codec: str = "none") -> bytes:
        meta: dict[str, Any] = {"stage": self.stage, "step": self.step, "samples": self.samples,
                                "accumulated": self.accumulated}
        if self.precision != "fp32":
            meta["precision"] = self.precision
        if self.loss is not None:
            meta["loss"] = self.loss
        if self.duplicate:
            meta["duplicate"] = True
        tensors = {} if self.grad_inputs is None else {"grad_inputs": self.grad_inputs}
        return encode_frame(self.KIND, meta, tensors, codec)

    @classmethod
    def from_frame(cls, frame: Frame) -> BackwardReply:
        stage, step = _reply_fields(frame, cls.KIND)
        return cls(stage=stage, step=step, samples=_reply_int(frame.meta, "samples"),
                   accumulated=_reply_int(frame.meta, "accumulated", 0), grad_inputs=frame.tensors.get("grad_inputs"),
                   loss=_reply_float(frame.meta, "loss"), duplicate=frame.meta.get("duplicate") is True,
                   precision=_reply_precision(frame.meta))


def _reply_precision(meta: Mapping[str, Any]) -> str:
    """The compute precision a reply names: one of ``--precision``'s (fp32 when it names none)."""
    value = meta.get("precision", "fp32")
    if value not in PRECISIONS:
        raise MalformedFrame(f"a reply's meta.precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {value!r:.40}")
    return str(value)


# ---- POST /v1/average -------------------------------------------------------------------------


@dataclass(frozen=True)
class AverageRequest:
    """A stage-mate's contribution to the round of ``step``: its gradient sum over ``samples``
    samples (flat float32; None with no samples: it still receives the update).

    ``codec`` is the one the gradients travel with (the swarm's ``grad_codec``); the answer
    comes with the round's codec, whatever this one is.

    ``public_key`` / ``signature`` / ``digest`` (meta ``pk``, ``sig``, ``digest``): the
    contributor's ed25519 key, its signature over the contribution (stage, step, samples,
    gradients' digest, its peer id, the leader's, ``norm``), and the digest of the gradients as the leader
    will decode them (``swarmd.pipeline.round_checks.tensor_digest``). Optional on the wire; a
    leader refuses an unsigned contribution (``swarmd.pipeline.averaging``). ``norm`` (meta
    ``norm``): the gradients' per-sample norm as decoded, signed so that a leader can show the
    stage-mates how large a convicted peer's contributions were (``swarmd.pipeline.accusations``).

    ``mbs`` (tensor ``mbs``, int64 holding the unsigned 64-bit ids' bits): the microbatch ids whose
    gradients the sum holds, so the leader can count an id that two contributions hold
    (``swarmd.pipeline.step_protocol``, exactly once). Not signed: it feeds a counter, never the mean.
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

    KIND = "average"

    def encode(self) -> bytes:
        meta: dict[str, Any] = {"stage": self.stage, "step": self.step, "samples": self.samples,
                                "peer_id": self.peer_id}
        if self.public_key is not None and self.signature is not None:
            meta.update(pk=self.public_key, sig=self.signature, digest=self.digest or "", norm=float(self.norm))
        if self.grads is not None and self.codec != "none":
            meta["codec"] = self.codec  # under grad_codec "auto" the leader answers in the most compressed sent
        tensors = {} if self.grads is None else {"grads": self.grads}
        if self.mbs and len(self.mbs) <= MAX_CONTRIBUTION_MBS:
            tensors["mbs"] = torch.tensor([m - 2**64 if m >= 2**63 else m for m in self.mbs], dtype=torch.int64)
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
        return cls(stage=stage, peer_id=peer_id, step=step, samples=samples, grads=grads, codec=codec,
                   public_key=pk, signature=sig, digest=digest, mbs=mbs, norm=norm)


@dataclass(frozen=True)
class AverageReply:
    """The round's outcome: ``ok`` with the mean gradient every peer applies (``grads``), or
    ``aborted`` (the contributor keeps its gradients; ``grads`` None).

    ``used`` (meta ``used``): the contributions the mean holds, ``[peer_id, samples, digest,
    per-sample norm]`` each, so every contributor can check its own is among them
    (``swarmd.pipeline.round_checks``); ``reason`` (meta ``reason``): why an ``aborted`` answer
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
        meta: dict[str, Any] = {"stage": self.stage, "status": self.status, "step": self.step,
                                "samples": self.samples, "contributors": self.contributors}
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
        if ok and (grads is None or grads.dtype != torch.float32 or grads.dim() != 1
                   or (grad_numel is not None and grads.numel() != grad_numel)):
            raise MalformedFrame(f"an 'ok' average answer needs float32 'grads' of shape [{grad_numel or 'N'}]")
        used_meta, reason = frame.meta.get("used"), frame.meta.get("reason")
        used: tuple[tuple[str, int, str, float], ...] | None = None
        if used_meta is not None:
            if not isinstance(used_meta, list) or not all(
                isinstance(u, list) and len(u) == 4 and isinstance(u[0], str) and _is_int(u[1])
                and isinstance(u[2], str) and isinstance(u[3], (int, float)) and not isinstance(u[3], bool)
                for u in used_meta
            ):
                raise MalformedFrame("an average answer's meta.used lists [peer_id, samples, digest, norm] entries")
            used = tuple((u[0], int(u[1]), u[2], float(u[3])) for u in used_meta)
        if reason is not None and not isinstance(reason, str):
            raise MalformedFrame("an average answer's meta.reason must be a string")
        return cls(stage=stage, status="ok" if ok else "aborted", step=step,
                   samples=_reply_int(frame.meta, "samples", 0), contributors=_reply_int(frame.meta, "contributors", 0),
                   grads=grads, used=used, reason=reason[:500] if reason is not None else None)


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
        meta: dict[str, Any] = {"stage": self.stage, "trainer": self.trainer, "step": self.step, "size": self.size,
                                "count": self.count, "lease_s": float(self.lease_s), "done": list(self.done),
                                "renew": list(self.renew)}
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
        return cls(stage=stage, trainer=trainer, step=_count(meta, "step", "the step the trainer saw"),
                   size=_count(meta, "size", "samples per lease"), count=count, lease_s=float(lease_s),
                   done=_lease_ids(meta, "done"), renew=_lease_ids(meta, "renew"),
                   held=_optional_count(meta, "held", "samples the stage held"))


@dataclass(frozen=True)
class ReserveReply:
    """The leases granted (``(lease_id, samples)``, possibly none) for ``step``, and how many of
    the step's ``target`` samples are reserved after them."""

    stage: int
    step: int
    leases: tuple[tuple[int, int], ...]
    reserved: int
    target: int

    KIND = "reserve_result"

    def encode(self, codec: str = "none") -> bytes:
        meta = {"stage": self.stage, "step": self.step, "leases": [list(lease) for lease in self.leases],
                "reserved": self.reserved, "target": self.target}
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
        return cls(stage=stage, step=step, leases=tuple((int(i), int(n)) for i, n in leases),
                   reserved=_reply_int(frame.meta, "reserved"), target=_reply_int(frame.meta, "target"))


# ---- POST /v1/claim ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimRequest:
    """A trainer whose backward of microbatch ``mb`` on this stage failed without an answer asks,
    before retrying it elsewhere, whether this peer counted it; a peer that did not fences the
    attempts numbered below ``attempt`` off (``swarmd.pipeline.step_protocol``, exactly once)."""

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


# ---- GET /v1/info ---------------------------------------------------------------------------


def _json_field(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = body.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedFrame(f"{where}: '{key}' is missing or of the wrong type ({value!r:.40})")
    return value


@dataclass(frozen=True)
class ModelInfo:
    name: str
    digest: str
    spec: Mapping[str, Any]  # ModelSpec.to_dict()


@dataclass(frozen=True)
class InfoLimits:
    """What the peer's decoder accepts (its ``WireLimits``) and the most tokens per batch."""

    max_frame_bytes: int
    max_tensors: int
    max_rank: int
    max_elements: int
    max_batch_tokens: int

    @classmethod
    def of(cls, limits: WireLimits, max_batch_tokens: int) -> InfoLimits:
        return cls(limits.max_frame_bytes, limits.max_tensors, limits.max_rank, limits.max_elements, max_batch_tokens)


@dataclass(frozen=True)
class InfoReply:
    """``GET /v1/info``: what the peer serves and accepts."""

    wire_version: int
    stage: int
    n_stages: int
    model: ModelInfo
    step: int
    codecs: tuple[str, ...]
    limits: InfoLimits

    def to_json(self) -> dict[str, Any]:
        return {
            "wire_version": self.wire_version,
            "stage": self.stage,
            "n_stages": self.n_stages,
            "model": {"name": self.model.name, "digest": self.model.digest, "spec": dict(self.model.spec)},
            "step": self.step,
            "codecs": list(self.codecs),
            "limits": {
                "max_frame_bytes": self.limits.max_frame_bytes,
                "max_tensors": self.limits.max_tensors,
                "max_rank": self.limits.max_rank,
                "max_elements": self.limits.max_elements,
                "max_batch_tokens": self.limits.max_batch_tokens,
            },
        }

    @classmethod
    def from_json(cls, body: Any) -> InfoReply:
        where = "an info reply"
        if not isinstance(body, dict):
            raise MalformedFrame(f"{where} must be a JSON object")
        model = _json_field(body, "model", dict, where)
        limits = _json_field(body, "limits", dict, where)
        codecs = _json_field(body, "codecs", list, where)
        return cls(
            wire_version=_json_field(body, "wire_version", int, where),
            stage=_json_field(body, "stage", int, where),
            n_stages=_json_field(body, "n_stages", int, where),
            model=ModelInfo(name=_json_field(model, "name", str, where),
                            digest=_json_field(model, "digest", str, where),
                            spec=MappingProxyType(dict(_json_field(model, "spec", dict, where)))),
            step=_json_field(body, "step", int, where),
            codecs=tuple(str(c) for c in codecs),
            limits=InfoLimits(*(_json_field(limits, k, int, where) for k in (
                "max_frame_bytes", "max_tensors", "max_rank", "max_elements", "max_batch_tokens"))),
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
        if len(excluded) > MAX_EXCLUDED or not all(isinstance(p, str) and len(p) <= MAX_PEER_ID_LEN for p in excluded):
            raise MalformedFrame(f"{where}: 'excluded' must list at most {MAX_EXCLUDED} peer ids")
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
        )
