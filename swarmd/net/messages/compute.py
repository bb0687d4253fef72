"""The compute endpoints: ``POST /v1/forward`` and ``POST /v1/backward``, and the peer-to-peer hops a
forward or backward may carry to the next stage (issue #31)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from swarmd.errors import MalformedFrame, RequestError
from swarmd.net.messages.fields import (
    MAX_HOP_ADDR_LEN,
    MAX_HOP_ERROR_LEN,
    MAX_HOP_TIMEOUT_MS,
    MAX_HOPS,
    MAX_ORIGIN_LEN,
    MAX_PEER_ID_LEN,
    PRECISIONS,
    StageTarget,
    _attempt,
    _check_target,
    _codec,
    _is_int,
    _kind,
    _microbatch_id,
    _model,
    _optional_count,
    _reply_fields,
    _reply_float,
    _reply_int,
    _required,
    _stage,
)
from swarmd.net.token_ids import narrow, widen
from swarmd.net.wire import Frame, encode_frame

# ---- POST /v1/forward -------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardRequest:
    """Run a stage's forward on ``inputs``; on the last stage with ``targets``, the loss.

    ``mb`` names the microbatch: the peer keeps the forward's activations under it for the
    backward (``swarmd.pipeline.stage.executor``'s activation cache). ``codec`` is the codec of the
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
    counts, it counts before any sender before it gives up (exactly once, ``swarmd.pipeline.stage.step_protocol``).
    ``back`` (meta ``back: true``, only with a fused last hop): the backward chain. Once the chain's end
    answered, each peer runs its own stage's backward (attempt 0, on the inputs it kept, counted for
    ``origin`` within what is left of ``budget_ms`` less :data:`HOP_MARGIN_MS`) with the input gradient
    the stage after it answered, and answers its sender with its own input gradient instead
    (:class:`ForwardReply` ``backs``); a peer whose backward failed answers the gradient it got and why
    (``back_error``), and the trainer sends the remaining backwards itself.
    ``min_step`` (meta ``min_step``, optional): run only once this peer has reached that step (a sync
    trainer's next step, whose calls must see the parameters after it: a chain's later stages may
    still be finishing the step before when the chain goes out). The peer waits for it within half
    of ``budget_ms`` less :data:`HOP_MARGIN_MS` (the rest is for what follows; without a budget, not
    at all) and refuses with ``PeerBehind`` (409) if it is not there by then; carried on to every hop.
    The reply's ``wait_ms`` includes that wait.
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
    min_step: int | None = None

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
        if self.min_step is not None:
            meta["min_step"] = self.min_step
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
            raise RequestError(
                "a forward with next hops carries targets exactly when its last hop is the last "
                "stage's fused call (a hop with a deadline)"
            )
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
        return cls(
            stage=stage,
            inputs=widen(_required(frame.tensors, "inputs")),
            targets=targets,
            model=_model(meta.get("model")),
            codec=codec,
            mb=mb,
            next=hops,
            peer=_short_str(meta, "peer", MAX_PEER_ID_LEN),
            origin=_short_str(meta, "origin", MAX_ORIGIN_LEN),
            budget_ms=budget_ms,
            back=back,
            min_step=_optional_count(meta, "min_step", "the step this peer must have reached"),
        )


@dataclass(frozen=True)
class ForwardReply:
    """The stage's outputs (hidden states or logits) at ``step``; with targets, the scalar
    mean ``loss`` (then ``outputs`` is that loss as a 0-d tensor, exactly as computed).

    ``kept`` (meta ``kept: true``): the peer keeps the forward's inputs (and graph) under the
    request's ``mb`` for its backward, which may then omit them (:class:`BackwardRequest`). An
    older peer never says so, and an older trainer ignores it: it always resends the inputs.

    Peer to peer (a request with ``next``): ``chain`` (meta ``chain``) holds what each later stage
    that the outputs went through answered (:class:`HopResult`), in stage order, and ``outputs`` are
    then the last of them's; ``wait_ms`` how long this peer waited for its next hop's answer (and for
    ``min_step``); ``hop_error`` (meta ``hop_error``) why the next hop failed, when it did: ``chain`` then ends
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
            return cls(
                stage=stage,
                step=step,
                outputs=torch.empty(0),
                precision=_reply_precision(frame.meta),
                kept=frame.meta.get("kept") is True,
                chain=HopResult.list_from_meta(frame.meta.get("chain"), stage),
                wait_ms=_reply_int(frame.meta, "wait_ms", 0),
                fused=fused,
                backs=_backs(frame),
                back_error=None if back_error is None else back_error[:MAX_HOP_ERROR_LEN],
            )
        loss = _reply_float(frame.meta, "loss")
        name = "outputs" if loss is None else "loss"
        outputs = frame.tensors.get(name)
        if outputs is None:
            raise MalformedFrame(
                f"a forward reply {'with' if loss is not None else 'without'} a loss needs "
                f"a '{name}' tensor (it has {sorted(frame.tensors) or 'none'})"
            )
        kept = frame.meta.get("kept", False)
        if not isinstance(kept, bool):
            raise MalformedFrame(f"a forward reply's meta.kept must be true or false, got {kept!r:.30}")
        hop_error = frame.meta.get("hop_error")
        if hop_error is not None and not isinstance(hop_error, str):
            raise MalformedFrame(f"a forward reply's meta.hop_error must be a string, got {hop_error!r:.30}")
        return cls(
            stage=stage,
            step=step,
            outputs=outputs,
            loss=loss,
            precision=_reply_precision(frame.meta),
            kept=kept,
            chain=HopResult.list_from_meta(frame.meta.get("chain"), stage),
            wait_ms=_reply_int(frame.meta, "wait_ms", 0),
            hop_error=None if hop_error is None else hop_error[:MAX_HOP_ERROR_LEN],
        )


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
            if not (
                isinstance(hop, list)
                and len(hop) in (4, 5)
                and _is_int(hop[0])
                and isinstance(hop[1], str)
                and isinstance(hop[2], str)
                and all(_is_int(v) for v in hop[3:])
            ):
                raise RequestError("each hop of meta.next must be [stage, addr, peer_id, timeout_ms(, deadline_ms)]")
            hop_stage, addr, peer_id, timeout_ms = hop[:4]
            deadline_ms = hop[4] if len(hop) == 5 else None
            if deadline_ms is not None and (i != len(value) - 1 or not 0 <= deadline_ms < timeout_ms):
                raise RequestError(
                    f"hop {i} of meta.next: only the last hop (a fused forward and backward) has a "
                    "deadline, shorter than its timeout"
                )
            if hop_stage != stage + 1 + i:
                raise RequestError(f"hop {i} of meta.next must be for stage {stage + 1 + i}, not {hop_stage!r:.20}")
            if not 0 < len(addr) <= MAX_HOP_ADDR_LEN or "@" in addr or "/" in addr or ":" not in addr:
                raise RequestError(f"hop {i} of meta.next needs a direct host:port address, got {addr!r:.60}")
            if not 0 < len(peer_id) <= MAX_PEER_ID_LEN:
                raise RequestError(f"hop {i} of meta.next needs a peer id of at most {MAX_PEER_ID_LEN} characters")
            if not 0 < timeout_ms <= MAX_HOP_TIMEOUT_MS:
                raise RequestError(f"hop {i} of meta.next needs a timeout in (0, {MAX_HOP_TIMEOUT_MS}] ms")
            hops.append(
                cls(stage=hop_stage, addr=addr, peer_id=peer_id, timeout_ms=timeout_ms, deadline_ms=deadline_ms)
            )
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
            if not (
                isinstance(item, list)
                and len(item) == 6
                and _is_int(item[0])
                and _is_int(item[1])
                and item[1] >= 0
                and isinstance(item[2], str)
                and len(item[2]) <= MAX_PEER_ID_LEN
                and isinstance(item[3], bool)
                and item[4] in PRECISIONS
                and _is_int(item[5])
                and item[5] >= 0
            ):
                raise MalformedFrame(
                    "each result of a forward reply's meta.chain must be "
                    "[stage, step, peer_id, kept, precision, wait_ms]"
                )
            if item[0] != stage + 1 + i:
                raise MalformedFrame(f"result {i} of a forward reply's meta.chain must be stage {stage + 1 + i}")
            results.append(
                cls(stage=item[0], step=item[1], peer_id=item[2], kept=item[3], precision=str(item[4]), wait_ms=item[5])
            )
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
    return {
        "stage": reply.stage,
        "step": reply.step,
        "samples": reply.samples,
        "accumulated": reply.accumulated,
        "loss": reply.loss,
        "duplicate": reply.duplicate,
        "precision": reply.precision,
    }


def _backs(frame: Frame) -> tuple[BackwardReply, ...]:
    """A chained forward reply's ``meta.backs``: the backward chain's answers, in stage order, the first
    with the gradient at its stage's inputs (tensor ``back_grad_inputs``), the stages one after another."""
    backs = frame.meta.get("backs")
    if backs is None:
        return ()
    if not isinstance(backs, list) or not 0 < len(backs) <= MAX_HOPS or not all(isinstance(b, dict) for b in backs):
        raise MalformedFrame(f"a forward reply's meta.backs must list 1 to {MAX_HOPS} maps")
    grad = frame.tensors.get("back_grad_inputs")
    replies = tuple(
        BackwardReply.from_frame(Frame(BackwardReply.KIND, b, {} if i or grad is None else {"grad_inputs": grad}))
        for i, b in enumerate(backs)
    )
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
    each ``mb`` once per step (``swarmd.pipeline.stage.step_protocol``). ``deadline_ms``: how long the
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
    min_step: int | None = None  # as ForwardRequest's, waited for within half of ``deadline_ms``

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
        if self.min_step is not None:
            meta["min_step"] = self.min_step
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
            raise RequestError(
                "a backward without 'inputs' must name (meta.mb) the microbatch whose forward this peer kept"
            )
        step = _optional_count(meta, "step", "the step the forward reported")
        deadline_ms = _optional_count(meta, "deadline_ms", "how long the sender waits, in ms")
        verify = meta.get("verify", False)
        if not isinstance(verify, bool):
            raise RequestError(f"meta.verify must be true or false, got {verify!r:.40}")
        return cls(
            stage=stage,
            inputs=inputs,
            grad_outputs=frame.tensors.get("grad_outputs"),
            targets=widen(frame.tensors.get("targets")),
            model=_model(meta.get("model")),
            codec=codec,
            step=step,
            mb=mb,
            deadline_ms=deadline_ms,
            verify=verify,
            attempt=_attempt(meta),
            peer=_short_str(meta, "peer", MAX_PEER_ID_LEN),
            origin=_short_str(meta, "origin", MAX_ORIGIN_LEN),
            min_step=_optional_count(meta, "min_step", "the step this peer must have reached"),
        )


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
        meta: dict[str, Any] = {
            "stage": self.stage,
            "step": self.step,
            "samples": self.samples,
            "accumulated": self.accumulated,
        }
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
        return cls(
            stage=stage,
            step=step,
            samples=_reply_int(frame.meta, "samples"),
            accumulated=_reply_int(frame.meta, "accumulated", 0),
            grad_inputs=frame.tensors.get("grad_inputs"),
            loss=_reply_float(frame.meta, "loss"),
            duplicate=frame.meta.get("duplicate") is True,
            precision=_reply_precision(frame.meta),
        )


def _reply_precision(meta: Mapping[str, Any]) -> str:
    """The compute precision a reply names: one of ``--precision``'s (fp32 when it names none)."""
    value = meta.get("precision", "fp32")
    if value not in PRECISIONS:
        raise MalformedFrame(f"a reply's meta.precision must be one of {', '.join(PRECISIONS)}, got {value!r:.40}")
    return str(value)
