"""The data plane's typed contract (swarmd.net.messages) and errors rebuilt from their names."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd import errors
from swarmd.errors import (
    Busy,
    Draining,
    MalformedFrame,
    PeerBehind,
    PeerError,
    RequestError,
    StaleStep,
    StepMismatch,
    SwarmdError,
    Unavailable,
    WrongStage,
    remote_error,
)
from swarmd.net.messages import (
    MAX_PROGRESS_WAIT_S,
    AverageReply,
    AverageRequest,
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    Hop,
    HopResult,
    InfoLimits,
    InfoReply,
    ModelInfo,
    ProgressReply,
    ProgressRequest,
    RecheckRequest,
    StageTarget,
)
from swarmd.net.wire import Frame, WireLimits, decode_frame, encode_frame

TARGET = StageTarget(stage=1, model="d" * 64, grad_numel=10)


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))


def hidden(*shape: int) -> torch.Tensor:
    return torch.randn(*(shape or (2, 8, 4)), generator=torch.Generator().manual_seed(1))


def wire(body: bytes) -> Frame:
    return decode_frame(body)


# ---- round trips --------------------------------------------------------------------------------


def test_forward_request_and_reply_round_trip() -> None:
    req = ForwardRequest(stage=1, inputs=hidden(), targets=tokens(), model="d" * 64, codec="none", mb=2**64 - 1)
    back = ForwardRequest.from_frame(wire(req.encode()), TARGET)
    assert (back.stage, back.model, back.codec, back.mb) == (1, "d" * 64, "none", 2**64 - 1)
    assert torch.equal(back.inputs, req.inputs) and back.targets is not None and torch.equal(back.targets, req.targets)

    outputs = ForwardReply(stage=0, step=3, outputs=hidden())
    got = ForwardReply.from_frame(wire(outputs.encode("none")))
    assert got.loss is None and got.step == 3 and torch.equal(got.outputs, outputs.outputs)
    loss = torch.tensor(2.5)
    with_loss = ForwardReply.from_frame(wire(ForwardReply(stage=1, step=0, outputs=loss, loss=2.5).encode()))
    assert with_loss.loss == 2.5 and torch.equal(with_loss.outputs, loss)
    # the wire is unchanged: what older peers and tools read
    frame = wire(ForwardReply(stage=1, step=0, outputs=loss, loss=2.5).encode())
    assert frame.kind == "forward_result" and frame.meta == {"stage": 1, "step": 0, "loss": 2.5}
    assert set(frame.tensors) == {"loss"}


def test_backward_request_and_reply_round_trip() -> None:
    req = BackwardRequest(stage=1, inputs=hidden(), grad_outputs=hidden(), step=4, mb=7, codec="fp16")
    back = BackwardRequest.from_frame(wire(req.encode()), TARGET)
    assert (back.step, back.mb, back.codec, back.targets) == (4, 7, "fp16", None)
    assert back.grad_outputs is not None and back.grad_outputs.shape == (2, 8, 4)

    reply = BackwardReply(stage=1, step=4, samples=2, accumulated=6, grad_inputs=hidden(), loss=1.25)
    got = BackwardReply.from_frame(wire(reply.encode()))
    assert (got.step, got.samples, got.accumulated, got.loss) == (4, 2, 6, 1.25)
    assert got.grad_inputs is not None and torch.equal(got.grad_inputs, reply.grad_inputs)
    first = BackwardReply.from_frame(wire(BackwardReply(stage=0, step=0, samples=2, accumulated=2).encode()))
    assert first.grad_inputs is None and first.loss is None


def test_a_reply_says_which_precision_computed_it_and_fp32_replies_are_unchanged() -> None:
    bf16 = BackwardReply.from_frame(wire(BackwardReply(stage=0, step=0, samples=2, accumulated=2,
                                                       precision="bf16").encode()))
    assert bf16.precision == "bf16"
    assert ForwardReply.from_frame(wire(ForwardReply(0, 1, hidden(), precision="fp16").encode())).precision == "fp16"
    frame = wire(ForwardReply(stage=0, step=1, outputs=hidden()).encode())
    assert "precision" not in frame.meta and ForwardReply.from_frame(frame).precision == "fp32"


def test_average_request_and_reply_round_trip() -> None:
    grads = torch.arange(10, dtype=torch.float32)
    req = AverageRequest(stage=1, peer_id="p" * 64, step=5, samples=3, grads=grads, codec="none")
    back = AverageRequest.from_frame(wire(req.encode()), TARGET)
    assert (back.peer_id, back.step, back.samples) == ("p" * 64, 5, 3)
    assert back.grads is not None and torch.equal(back.grads, grads)
    empty = AverageRequest.from_frame(wire(AverageRequest(stage=1, peer_id="q", step=5, samples=0).encode()), TARGET)
    assert empty.grads is None and empty.samples == 0

    ok = AverageReply(stage=1, status="ok", step=5, samples=32, contributors=3, grads=grads)
    got = AverageReply.from_frame(wire(ok.encode("none")), grad_numel=10)
    assert (got.status, got.samples, got.contributors) == ("ok", 32, 3) and got.grads is not None
    aborted = AverageReply.from_frame(wire(AverageReply(stage=1, status="aborted", step=5, samples=0,
                                                         contributors=0).encode()))
    assert aborted.status == "aborted" and aborted.grads is None


def test_info_reply_json_round_trip() -> None:
    info = InfoReply(wire_version=1, stage=0, n_stages=2, model=ModelInfo("tiny", "d" * 64, {"name": "tiny"}),
                     step=3, codecs=("8bit", "none"), limits=InfoLimits.of(WireLimits(), 4096))
    body = json.loads(json.dumps(info.to_json()))
    assert InfoReply.from_json(body) == info
    assert body["model"]["digest"] == "d" * 64 and body["limits"]["max_batch_tokens"] == 4096
    with pytest.raises(MalformedFrame):
        InfoReply.from_json({**body, "limits": {"max_frame_bytes": "big"}})


def test_progress_has_one_shape_whether_away_or_averaging() -> None:
    away = ProgressReply(stage=0, step=1, samples=4, away=True, target_batch_size=16)
    averaging = ProgressReply(stage=0, step=1, samples=4, averaging=True, peer_id="a", leader="a", round=1,
                              round_expected=("a", "b"), round_contributors={"a": 4}, dropped_samples=2,
                              target_batch_size=16)
    assert set(away.to_json()) == set(averaging.to_json())
    for reply in (away, averaging):
        assert ProgressReply.from_json(json.loads(json.dumps(reply.to_json()))) == reply
    # an older peer's reply (no away, no round fields) still reads; unknown keys are ignored
    old = ProgressReply.from_json({"stage": 0, "step": 2, "samples": 1, "future": [1, 2]})
    assert old == ProgressReply(stage=0, step=2, samples=1)


@pytest.mark.parametrize("body", [
    None, [], "x", {"stage": 0, "step": 1}, {"stage": "0", "step": 1, "samples": 0},
    {"stage": 0, "step": -1, "samples": 0}, {"stage": 0, "step": 1, "samples": True},
    {"stage": 0, "step": 1, "samples": 0, "away": "yes"},
    {"stage": 0, "step": 1, "samples": 0, "round_expected": [1]},
    {"stage": 0, "step": 1, "samples": 0, "round_contributors": {"a": "many"}},
])
def test_a_bad_progress_reply_is_a_typed_error(body: Any) -> None:
    with pytest.raises(MalformedFrame):
        ProgressReply.from_json(body)


def test_progress_request_query() -> None:
    assert ProgressRequest.from_query({}) == ProgressRequest()
    req = ProgressRequest(wait_step=7, wait_s=0.5)
    assert ProgressRequest.from_query(req.to_query()) == req
    assert ProgressRequest().to_query() == {}
    for query in ({"wait_step": "x"}, {"wait_step": "1", "wait_s": "-1"}, {"wait_step": "1", "wait_s": "nan"},
                  {"wait_step": "1", "wait_s": str(MAX_PROGRESS_WAIT_S + 1)}):
        with pytest.raises(RequestError):
            ProgressRequest.from_query(query)


# ---- requests: remote input, typed errors, checked in a fixed order -------------------------------


def forward_frame(meta: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> Frame:
    return wire(encode_frame("forward", meta, {"inputs": hidden()} if tensors is None else tensors))


@pytest.mark.parametrize(("meta", "tensors", "error", "words"), [
    ({}, None, RequestError, "meta.stage"),
    ({"stage": True}, None, RequestError, "meta.stage"),
    ({"stage": 0}, None, WrongStage, "stage 1"),
    ({"stage": 1, "model": "0" * 64}, None, WrongStage, "model"),
    ({"stage": 1, "model": 5}, None, WrongStage, "model"),
    ({"stage": 0, "codec": []}, None, WrongStage, "stage"),  # the target first, then the codec
    ({"stage": 1, "codec": []}, None, RequestError, "codec"),
    ({"stage": 1, "codec": "zip"}, None, RequestError, "codec"),
    ({"stage": 1}, {"x": hidden()}, RequestError, "'inputs'"),
    ({"stage": 1, "mb": -1}, None, RequestError, "meta.mb"),
    ({"stage": 1, "mb": 1.5}, None, RequestError, "meta.mb"),
])
def test_a_bad_forward_request_gets_its_typed_error(
    meta: dict[str, Any], tensors: Any, error: type, words: str
) -> None:
    with pytest.raises(error, match=words):
        ForwardRequest.from_frame(forward_frame(meta, tensors), TARGET)


def test_a_request_of_another_kind_is_refused() -> None:
    with pytest.raises(RequestError, match="'forward' frame"):
        ForwardRequest.from_frame(wire(encode_frame("backward", {"stage": 1}, {"inputs": hidden()})), TARGET)


@pytest.mark.parametrize("step", [-1, "3", 1.0, True])
def test_a_backward_step_must_be_a_non_negative_integer(step: Any) -> None:
    frame = wire(encode_frame("backward", {"stage": 1, "step": step}, {"inputs": hidden()}))
    with pytest.raises(RequestError, match="meta.step"):
        BackwardRequest.from_frame(frame, TARGET)


def test_a_backward_may_omit_the_inputs_of_a_forward_the_peer_kept() -> None:
    # the sender omits the inputs and names the microbatch: no 'inputs' tensor on the wire
    req = BackwardRequest(stage=1, inputs=None, grad_outputs=hidden(), step=4, mb=7)
    frame = wire(req.encode())
    assert set(frame.tensors) == {"grad_outputs"}
    back = BackwardRequest.from_frame(frame, TARGET)
    assert back.inputs is None and back.mb == 7 and back.grad_outputs is not None
    # ... which the forward's reply said it may: kept travels only when true (older readers ignore it)
    kept = wire(ForwardReply(stage=1, step=4, outputs=hidden(), kept=True).encode())
    assert kept.meta["kept"] is True and ForwardReply.from_frame(kept).kept
    assert not ForwardReply.from_frame(wire(ForwardReply(stage=1, step=4, outputs=hidden()).encode())).kept
    with pytest.raises(MalformedFrame, match="meta.kept"):
        ForwardReply.from_frame(wire(encode_frame("forward_result", {"stage": 1, "step": 0, "kept": 1},
                                                  {"outputs": hidden()})))
    # a sender cannot build one without the id, and a peer refuses one (422) before anything else
    with pytest.raises(ValueError, match="microbatch"):
        BackwardRequest(stage=1, inputs=None, grad_outputs=hidden()).encode()
    for meta in ({"stage": 1}, {"stage": 1, "mb": None}):
        with pytest.raises(RequestError, match="meta.mb"):
            BackwardRequest.from_frame(wire(encode_frame("backward", meta, {"grad_outputs": hidden()})), TARGET)
    for bad in (-1, -(2**63), "7", 1.5, True):
        with pytest.raises(RequestError, match="meta.mb"):
            BackwardRequest.from_frame(wire(encode_frame("backward", {"stage": 1, "mb": bad},
                                                         {"grad_outputs": hidden()})), TARGET)


def average_frame(meta: dict[str, Any], grads: torch.Tensor | None = None) -> Frame:
    base = {"stage": 1, "peer_id": "p", "step": 0, "samples": 1}
    return wire(encode_frame("average", {**base, **meta}, {} if grads is None else {"grads": grads}))


NAN = torch.zeros(10)
NAN[3] = math.nan


@pytest.mark.parametrize(("meta", "grads", "words"), [
    ({"peer_id": ""}, torch.zeros(10), "peer_id"),
    ({"peer_id": "p" * 65}, torch.zeros(10), "peer_id"),
    ({"peer_id": 3}, torch.zeros(10), "peer_id"),
    ({"step": -1}, torch.zeros(10), "meta.step"),
    ({"samples": "2"}, torch.zeros(10), "meta.samples"),
    ({}, torch.zeros(11), "shape \\[10\\]"),
    ({}, torch.zeros(10, dtype=torch.float16), "float32"),
    ({}, torch.zeros(2, 5), "float32"),
    ({}, NAN, "NaN"),
    ({"samples": 0}, torch.zeros(10), "count its samples"),
    ({}, None, "carry its 'grads'"),
])
def test_a_bad_contribution_gets_a_422(meta: dict[str, Any], grads: torch.Tensor | None, words: str) -> None:
    with pytest.raises(RequestError, match=words):
        AverageRequest.from_frame(average_frame(meta, grads), TARGET)


@given(meta=st.dictionaries(st.sampled_from(["stage", "model", "codec", "mb", "step", "peer_id", "samples", "x"]),
                            st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
                            | st.text(max_size=70) | st.lists(st.integers(-5, 5), max_size=2), max_size=8),
       kind=st.sampled_from(["forward", "backward", "average"]))
@settings(max_examples=300, deadline=None)
def test_decoding_any_meta_raises_only_typed_errors(meta: dict[str, Any], kind: str) -> None:
    frame = wire(encode_frame(kind, meta, {"inputs": hidden(), "grads": torch.zeros(10)}))
    decoder = {"forward": ForwardRequest, "backward": BackwardRequest, "average": AverageRequest}[kind]
    for target in (TARGET, None):
        try:
            decoder.from_frame(frame, target)  # type: ignore[attr-defined]
        except SwarmdError as exc:
            assert exc.http_status in (409, 422), exc


# ---- replies: a peer's garbage is MalformedFrame (the client makes it a PeerError) -----------------


@pytest.mark.parametrize(("frame", "decode"), [
    (Frame("forward_result", {"stage": 0}, {"outputs": hidden()}), ForwardReply.from_frame),
    (Frame("forward_result", {"stage": 0, "step": -2}, {"outputs": hidden()}), ForwardReply.from_frame),
    (Frame("backward_result", {"stage": 0, "step": 0, "samples": 1}, {}), ForwardReply.from_frame),
    (Frame("forward_result", {"stage": 0, "step": 0}, {"loss": hidden()}), ForwardReply.from_frame),
    (Frame("forward_result", {"stage": 0, "step": 0, "loss": "low"}, {"loss": hidden()}), ForwardReply.from_frame),
    (Frame("backward_result", {"stage": 0, "step": 0}, {}), BackwardReply.from_frame),
    (Frame("backward_result", {"stage": 0, "step": 0, "samples": 1, "precision": "int4"}, {}), BackwardReply.from_frame),
    (Frame("forward_result", {"stage": 0, "step": 0, "precision": 16}, {"outputs": hidden()}), ForwardReply.from_frame),
    (Frame("average_result", {"stage": 0, "step": 0, "status": "ok"}, {}), AverageReply.from_frame),
    (Frame("average_result", {"stage": 0, "step": 0, "status": "ok", "samples": -1}, {"grads": torch.zeros(3)}),
     AverageReply.from_frame),
])
def test_a_bad_reply_is_malformed(frame: Frame, decode: Any) -> None:
    with pytest.raises(MalformedFrame):
        decode(frame)


def test_an_ok_average_answer_of_the_wrong_size_is_malformed() -> None:
    frame = wire(AverageReply(stage=0, status="ok", step=0, samples=4, contributors=2,
                              grads=torch.zeros(9)).encode())
    assert AverageReply.from_frame(frame).grads is not None  # size unchecked without grad_numel
    with pytest.raises(MalformedFrame):
        AverageReply.from_frame(frame, grad_numel=10)


# ---- errors rebuilt from their names ---------------------------------------------------------------


def test_every_data_plane_error_is_rebuilt_as_its_class_and_a_peer_error() -> None:
    names = ["Busy", "Starting", "Draining", "Migrating", "StaleStep", "PeerBehind", "WrongStage", "RequestError",
             "MalformedFrame", "LimitExceeded", "UnsupportedMediaType", "RequestTimeout", "Unauthorized",
             "UnknownCodec", "UnsupportedDtype", "UnsupportedVersion"]
    for name in names:
        cls = getattr(errors, name)
        exc = remote_error(cls.http_status, name, "why")
        assert isinstance(exc, cls) and isinstance(exc, PeerError), name
        assert (exc.status, exc.error, exc.message, exc.http_status) == (cls.http_status, name, "why", cls.http_status)
        assert type(remote_error(cls.http_status, name, "again")) is type(exc)  # one class per name


def test_refusals_are_caught_by_their_class() -> None:
    with pytest.raises(StaleStep):
        raise remote_error(409, "StaleStep", "the stage stepped")
    with pytest.raises(StepMismatch):
        raise remote_error(409, "PeerBehind", "behind")
    with pytest.raises(Unavailable):
        raise remote_error(503, "Draining", "bye")
    with pytest.raises(PeerError):
        raise remote_error(503, "Busy", "averaging")
    assert not isinstance(remote_error(409, "StaleStep", ""), (PeerBehind, Busy, Draining))


@pytest.mark.parametrize("name", ["HTTPNotFound", "InternalError", "PeerError", "StateTransferError", "", "x" * 64,
                                  "__class__", "TrainerError"])
def test_other_names_give_a_plain_peer_error(name: str) -> None:
    exc = remote_error(500, name, "m")
    assert type(exc) is PeerError and exc.error == name


# ---- peer to peer: a forward's next hops and the chain's answers (issue #31) ---------------------


def test_a_forward_with_next_hops_and_its_chained_reply_round_trip() -> None:
    hops = (Hop(stage=2, addr="10.0.0.2:7000", peer_id="b" * 64, timeout_ms=3000),
            Hop(stage=3, addr="[::1]:7001", peer_id="c" * 64, timeout_ms=1500))
    req = ForwardRequest(stage=1, inputs=hidden(), mb=9, next=hops, peer="a" * 64, origin="10.0.0.9", budget_ms=4000)
    back = ForwardRequest.from_frame(wire(req.encode()), TARGET)
    assert (back.next, back.peer, back.origin, back.mb, back.budget_ms) == (hops, "a" * 64, "10.0.0.9", 9, 4000)
    # a chain ending in the last stage's fused call carries that stage's targets, and its last hop a deadline
    fused = (hops[0], Hop(stage=3, addr="[::1]:7001", peer_id="c" * 64, timeout_ms=1500, deadline_ms=1200))
    req = ForwardRequest(stage=1, inputs=hidden(), targets=tokens(), mb=9, next=fused, budget_ms=4000)
    back = ForwardRequest.from_frame(wire(req.encode()), TARGET)
    assert back.next == fused and back.targets is not None and torch.equal(back.targets, tokens())
    # without them the frame is the one older peers know
    assert set(wire(ForwardRequest(stage=1, inputs=hidden(), mb=9).encode()).meta) == {"stage", "codec", "mb"}

    chain = (HopResult(stage=2, step=4, peer_id="b" * 64, kept=True, wait_ms=12),
             HopResult(stage=3, step=4, peer_id="c" * 64, precision="bf16"))
    reply = ForwardReply(stage=1, step=4, outputs=hidden(), kept=True, chain=chain, wait_ms=30, hop_error="x: gone")
    got = ForwardReply.from_frame(wire(reply.encode()))
    assert (got.chain, got.wait_ms, got.hop_error, got.kept) == (chain, 30, "x: gone", True)
    assert ForwardReply.from_frame(wire(ForwardReply(stage=1, step=0, outputs=hidden()).encode())).chain == ()
    # the fused end's answer: the last stage's backward reply, carried back; no outputs
    last = BackwardReply(stage=3, step=4, samples=2, accumulated=6, grad_inputs=hidden(), loss=1.5, duplicate=True)
    ended = ForwardReply.from_frame(wire(ForwardReply(stage=1, step=4, outputs=torch.empty(0), chain=chain,
                                                      fused=last).encode()))
    assert ended.fused is not None and ended.outputs.numel() == 0 and ended.chain == chain
    assert (ended.fused.step, ended.fused.samples, ended.fused.loss, ended.fused.duplicate) == (4, 2, 1.5, True)
    assert ended.fused.grad_inputs is not None and torch.equal(ended.fused.grad_inputs, last.grad_inputs)
    # a backward's peer and origin (a fused hop's) round trip, and are absent otherwise
    hop_back = BackwardRequest(stage=1, inputs=hidden(), targets=tokens(), mb=3, peer="p", origin="10.0.0.9")
    assert BackwardRequest.from_frame(wire(hop_back.encode()), TARGET).origin == "10.0.0.9"
    # the step a sync trainer's chain is for (every hop runs only once its peer took it), on either kind of call
    assert ForwardRequest.from_frame(wire(dataclasses.replace(req, min_step=7).encode()), TARGET).min_step == 7
    assert BackwardRequest.from_frame(wire(dataclasses.replace(hop_back, min_step=7).encode()), TARGET).min_step == 7
    assert "min_step" not in wire(req.encode()).meta and "min_step" not in wire(hop_back.encode()).meta


def hop(stage: int = 2, addr: Any = "10.0.0.2:7000", peer: Any = "b" * 64, timeout_ms: Any = 1000) -> list[Any]:
    return [stage, addr, peer, timeout_ms]


@pytest.mark.parametrize(("meta", "tensors", "words"), [
    ({"next": "10.0.0.2:7000"}, None, "at most"),
    ({"next": [hop()] * 65}, None, "at most"),
    ({"next": [hop()[:3]]}, None, r"\[stage, addr"),
    ({"next": [hop(stage=3)]}, None, "stage 2"),  # hops go stage by stage from the receiver's
    ({"next": [hop(), hop(stage=2)]}, None, "stage 3"),
    ({"next": [hop(addr="peer@10.0.0.9:7000")]}, None, "direct host:port"),  # a relayed peer: never dialled
    ({"next": [hop(addr="http://x/evil")]}, None, "direct host:port"),
    ({"next": [hop(addr="")]}, None, "direct host:port"),
    ({"next": [hop(peer="")]}, None, "peer id"),
    ({"next": [hop(peer="p" * 65)]}, None, "peer id"),
    ({"next": [hop(timeout_ms=0)]}, None, "timeout"),
    ({"next": [hop(timeout_ms=True)]}, None, r"\[stage, addr"),
    ({"next": [hop()], "mb": None}, None, "meta.mb"),
    ({"next": [hop() + [500], hop(stage=3)]}, None, "only the last hop"),
    ({"next": [hop() + [1000]]}, {"inputs": hidden(), "targets": tokens()}, "shorter than its timeout"),
    ({"next": [hop() + [500]]}, None, "targets exactly when"),  # a fused end needs the targets
    ({"next": [hop() + [-1]]}, {"inputs": hidden(), "targets": tokens()}, "deadline"),
    ({"next": [hop()]}, {"inputs": hidden(), "targets": tokens()}, "targets"),
    ({"next": [hop()], "budget_ms": None}, None, "budget_ms"),  # a sender that does not say how long it waits
    ({"next": [hop()], "budget_ms": -1}, None, "budget_ms"),
    ({"peer": 5}, None, "meta.peer"),
    ({"origin": "o" * 65}, None, "meta.origin"),
    ({"next": [hop()], "back": True}, None, "meta.back"),  # a backward chain needs the fused end
    ({"back": True}, None, "meta.back"),
    ({"next": [hop() + [500]], "back": "yes"}, {"inputs": hidden(), "targets": tokens()}, "meta.back"),
    ({"min_step": -1}, None, "min_step"),
    ({"min_step": "7"}, None, "min_step"),
    ({"min_step": True}, None, "min_step"),
])
def test_a_bad_next_hop_gets_a_422(meta: dict[str, Any], tensors: Any, words: str) -> None:
    meta = {"stage": 1, "mb": 3, "budget_ms": 1000, **meta}
    for key in ("mb", "budget_ms"):
        if meta[key] is None:
            del meta[key]
    with pytest.raises(RequestError, match=words):
        ForwardRequest.from_frame(forward_frame(meta, tensors), TARGET)


@pytest.mark.parametrize("chain", [
    "all", [[1, 0, "b", False, "fp32", 0]], [[2, 0, "b", False, "fp32", 0], [2, 0, "c", False, "fp32", 0]],
    [[2, -1, "b", False, "fp32", 0]], [[2, 0, "b", 1, "fp32", 0]], [[2, 0, "b", False, "int4", 0]],
    [[2, 0, "b", False, "fp32", -5]], [[2, 0, "b" * 65, False, "fp32", 0]], [[2, 0, "b", False, "fp32"]],
    [[2, 0, "b", False, "fp32", 0]] * 65,
])
def test_a_bad_chain_in_a_forward_reply_is_malformed(chain: Any) -> None:
    with pytest.raises(MalformedFrame):
        ForwardReply.from_frame(Frame("forward_result", {"stage": 1, "step": 0, "chain": chain}, {"outputs": hidden()}))
    with pytest.raises(MalformedFrame):
        ForwardReply.from_frame(Frame("forward_result", {"stage": 1, "step": 0, "hop_error": 3}, {"outputs": hidden()}))
    for fused in ([1], {"stage": 2}, {"stage": 2, "step": 0, "samples": -1}):
        with pytest.raises(MalformedFrame):
            ForwardReply.from_frame(Frame("forward_result", {"stage": 1, "step": 0, "fused": fused}, {}))


def test_a_backward_chain_request_and_its_reply_round_trip() -> None:
    fused = (Hop(stage=2, addr="10.0.0.2:7000", peer_id="b" * 64, timeout_ms=3000),
             Hop(stage=3, addr="[::1]:7001", peer_id="c" * 64, timeout_ms=1500, deadline_ms=1200))
    req = ForwardRequest(stage=1, inputs=hidden(), targets=tokens(), mb=9, next=fused, budget_ms=4000, back=True)
    assert ForwardRequest.from_frame(wire(req.encode()), TARGET).back
    assert "back" not in wire(dataclasses.replace(req, back=False).encode()).meta
    # stages 1 and 2 ran their backwards: only stage 1's input gradient travels, the fused end's is dropped
    chain = (HopResult(stage=2, step=4, peer_id="b" * 64), HopResult(stage=3, step=4, peer_id="c" * 64))
    last = BackwardReply(stage=3, step=4, samples=2, accumulated=6, grad_inputs=hidden(), loss=1.5)
    backs = (BackwardReply(stage=1, step=4, samples=2, accumulated=6, grad_inputs=hidden()),
             BackwardReply(stage=2, step=4, samples=2, accumulated=8, duplicate=True, precision="bf16"))
    reply = ForwardReply(stage=1, step=4, outputs=torch.empty(0), chain=chain, fused=last, backs=backs)
    frame = wire(reply.encode())
    assert set(frame.tensors) == {"back_grad_inputs"}
    got = ForwardReply.from_frame(frame)
    assert got.fused is not None and got.fused.grad_inputs is None and got.fused.loss == 1.5
    assert [(b.stage, b.accumulated, b.duplicate, b.precision) for b in got.backs] == [
        (1, 6, False, "fp32"), (2, 8, True, "bf16")]
    assert got.backs[0].grad_inputs is not None and torch.equal(got.backs[0].grad_inputs, hidden())
    assert got.backs[1].grad_inputs is None and got.back_error is None
    stopped = ForwardReply.from_frame(wire(dataclasses.replace(reply, backs=(), back_error="stage 1: late").encode()))
    assert stopped.back_error == "stage 1: late" and stopped.fused is not None and stopped.fused.grad_inputs is not None


@pytest.mark.parametrize("backs", [
    "all", [], [1], [{"stage": 1}], [{"stage": 1, "step": 0, "samples": 1}, {"stage": 3, "step": 0, "samples": 1}],
    [{"stage": 1, "step": 0, "samples": 1}] * 65,
])
def test_a_bad_backward_chain_in_a_forward_reply_is_malformed(backs: Any) -> None:
    fused = {"stage": 3, "step": 0, "samples": 1}
    with pytest.raises(MalformedFrame):
        ForwardReply.from_frame(Frame("forward_result", {"stage": 1, "step": 0, "fused": fused, "backs": backs}, {}))
    with pytest.raises(MalformedFrame):
        ForwardReply.from_frame(Frame("forward_result", {"stage": 1, "step": 0, "fused": fused, "back_error": 1}, {}))


@given(meta=st.dictionaries(st.sampled_from(["stage", "mb", "next", "peer", "origin", "back", "min_step"]),
                            st.none() | st.booleans() | st.integers(-5, 2**64 - 1) | st.text(max_size=70)
                            | st.lists(st.lists(st.integers(0, 5) | st.text(max_size=8), max_size=5), max_size=3),
                            max_size=5))
@settings(max_examples=200, deadline=None)
def test_decoding_any_hop_meta_raises_only_typed_errors(meta: dict[str, Any]) -> None:
    frame = wire(encode_frame("forward", meta, {"inputs": hidden()}))
    try:
        ForwardRequest.from_frame(frame, TARGET)
    except SwarmdError as exc:
        assert exc.http_status in (409, 422), exc
    try:
        ForwardReply.from_frame(wire(encode_frame("forward_result", {"stage": 1, "step": 0, "chain": meta.get("next")},
                                                  {"outputs": hidden()})))
    except MalformedFrame:
        pass


def _inputs_frame(tensors: dict[str, torch.Tensor], at: Any = ("a" * 64, "fp32")) -> Frame:
    meta = {"stage": 1, "peer_id": "p", "step": 0, "samples": 1, "in_at": list(at) if at is not None else None}
    return wire(encode_frame("average", {k: v for k, v in meta.items() if v is not None},
                             {"grads": torch.zeros(10), **tensors}, "8bit"))


def test_a_contributions_inputs_round_trip_bit_for_bit_whatever_the_codec() -> None:
    """Activations travel as their float32 bits (int32): the 8bit codec of the gradients leaves them exact."""
    x1, x2 = hidden(2, 8, 4) * 1e-7, hidden(1, 3, 4)
    y1, y2 = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (1, 3))
    req = AverageRequest(stage=1, peer_id="p", step=0, samples=3, grads=torch.arange(10, dtype=torch.float32),
                         codec="8bit", mbs=(2**64 - 1, 7), inputs=((2**64 - 1, x1, y1), (7, x2, y2)),
                         inputs_params="a" * 64, inputs_precision="bf16")
    back = AverageRequest.from_frame(wire(req.encode()), TARGET)
    assert (back.inputs_params, back.inputs_precision) == ("a" * 64, "bf16")
    assert [mb for mb, _, _ in back.inputs] == [2**64 - 1, 7]
    for (_, x, y), (_, bx, by) in zip(req.inputs, back.inputs, strict=True):
        assert bx.dtype == torch.float32 and torch.equal(bx, x) and torch.equal(by, y)
    plain = AverageRequest.from_frame(wire(AverageRequest(stage=1, peer_id="p", step=0, samples=0).encode()), TARGET)
    assert plain.inputs == () and plain.inputs_params is None


GOOD_IN = {"in_x": torch.zeros(2 * 3 * 4, dtype=torch.int32), "in_y": torch.zeros(6, dtype=torch.int64),
           "in_idx": torch.tensor([[5, 2, 3, 4]])}


@pytest.mark.parametrize(("tensors", "at", "words"), [
    ({"in_x": GOOD_IN["in_x"]}, ("a" * 64, "fp32"), "all of"),
    ({**GOOD_IN, "in_idx": torch.tensor([[5, 2, 3]])}, ("a" * 64, "fp32"), "shape \\[m, 4\\]"),
    ({**GOOD_IN, "in_idx": torch.zeros(0, 4, dtype=torch.int64)}, ("a" * 64, "fp32"), "shape \\[m, 4\\]"),
    ({**GOOD_IN, "in_x": torch.zeros(24)}, ("a" * 64, "fp32"), "int32"),
    ({**GOOD_IN, "in_idx": torch.tensor([[5, 0, 3, 4]])}, ("a" * 64, "fp32"), "positive"),
    ({**GOOD_IN, "in_idx": torch.tensor([[5, 2, 3, 5]])}, ("a" * 64, "fp32"), "exactly the sizes"),
    ({**GOOD_IN, "in_idx": torch.tensor([[5, 2, 3, 4], [5, 1, 1, 1]]),
      "in_x": torch.zeros(25, dtype=torch.int32), "in_y": torch.zeros(7, dtype=torch.int64)},
     ("a" * 64, "fp32"), "twice"),
    ({**GOOD_IN, "in_x": torch.full((24,), 0x7FC00000, dtype=torch.int32)}, ("a" * 64, "fp32"), "NaN"),
    (GOOD_IN, None, "in_at"),
    (GOOD_IN, ("a" * 63, "fp32"), "in_at"),
    (GOOD_IN, ("a" * 64, "fp8"), "in_at"),
])
def test_bad_contribution_inputs_get_a_422(tensors: dict[str, torch.Tensor], at: Any, words: str) -> None:
    with pytest.raises(RequestError, match=words):
        AverageRequest.from_frame(_inputs_frame(tensors, at), TARGET)


def test_a_recheck_carries_a_report_an_opening_and_one_microbatchs_inputs_bit_for_bit() -> None:
    x, y = hidden(), tokens()
    x.view(-1)[0] = -0.0  # bits, not values: -0.0 stays -0.0
    req = RecheckRequest(body=b"b" * 10, signature=b"s" * 64, opening=b"o" * 20, mb=2**64 - 3, inputs=x, targets=y)
    back = RecheckRequest.from_frame(wire(req.encode()))
    assert (back.body, back.signature, back.opening, back.mb) == (req.body, req.signature, req.opening, req.mb)
    assert torch.equal(back.inputs.view(torch.int32), x.view(torch.int32)) and torch.equal(back.targets, y)


def test_a_malformed_recheck_is_refused_with_a_reason() -> None:
    good = wire(RecheckRequest(body=b"b", signature=b"s", opening=b"o", mb=1, inputs=hidden(), targets=tokens())
                .encode())
    meta, tensors = dict(good.meta), dict(good.tensors)
    two = AverageRequest(stage=1, peer_id="p", step=0, samples=0, inputs=((1, hidden(), tokens()),
                                                                          (2, hidden(), tokens())))
    cases = [({**meta, "body": "text"}, tensors), ({**meta, "sig": None}, tensors), ({**meta, "opening": b""}, tensors),
             (meta, {k: v for k, v in tensors.items() if k != "in_y"}), (meta, {**tensors, "grads": torch.zeros(3)}),
             (meta, dict(wire(two.encode()).tensors)),  # two microbatches
             (meta, {**tensors, "in_x": torch.full_like(tensors["in_x"], 0x7FC00000)})]  # NaN bits
    for m, t in cases:
        with pytest.raises(RequestError):
            RecheckRequest.from_frame(wire(encode_frame("recheck", m, t)))
    with pytest.raises(RequestError):
        RecheckRequest.from_frame(wire(encode_frame("report", meta, tensors)))
