"""Exactly once across a stage's peers (issue #13, item 2; ``swarmd.pipeline.stage.step_protocol``).

A backward that a peer counted and whose answer was then lost is retried on a stage-mate. The
trainer first asks the peer (``POST /v1/claim``): "counted" makes the retry compute-only, "not
counted" fences the lost attempt off. When the peer cannot be asked, the retry counts and the
round's leader sees the id in two contributions (``averaging.duplicate_microbatches``).

The pure rules are tested directly; the end-to-end test drops answers of a real peer (its
connection closed after the handler ran, as a reset or a dead relay would) in a real swarm.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from swarmd.errors import PeerError, RequestError, RequestTimeout
from swarmd.net.messages import AverageRequest, BackwardReply, BackwardRequest, ClaimReply, ClaimRequest
from swarmd.net.server import DataPlane, error_response
from swarmd.net.wire import CONTENT_TYPE, decode_frame, encode_frame
from swarmd.pipeline.spec import PRESETS, TrainingSpec
from swarmd.pipeline.stage.step_protocol import BackwardAttempts, StepProtocol, may_have_counted, repeated_microbatches
from swarmd.train.trainer import Trainer, TrainerConfig
from tests.support.swarms import swarm

# ---- the rules, pure ---------------------------------------------------------------------------


def test_a_claim_finds_what_was_counted_and_fences_what_was_not() -> None:
    steps = StepProtocol(0)
    steps.commit(7, 0, attempt=0)
    steps.accumulated(4, 7, 0)
    assert steps.claim(7, 1) is True and steps.claims_counted == 1
    assert steps.claim(8, 1) is False  # not counted: attempt 0 of mb 8 is fenced off
    with pytest.raises(RequestTimeout):
        steps.commit(8, 0, attempt=0)  # the lost attempt, finishing late
    assert steps.fenced_refused == 1
    steps.commit(8, 0, attempt=1)  # the retry on this same peer counts
    assert steps.claim(8, 2) is True and steps.claims == 3


def test_a_claim_fences_only_the_attempts_sent_from_the_claimants_address() -> None:
    """A member that saw a microbatch id (it travels through every stage) cannot fence that
    microbatch on a stage-mate of another stage: the fence holds for the claimant's own source."""
    steps = StepProtocol(0)
    assert steps.claim(9, 5, source="203.0.113.7") is False  # a stranger claims the trainer's mb 9
    steps.commit(9, 0, attempt=0, source="198.51.100.2")  # the trainer's own attempt still counts
    assert steps.fenced_refused == 0 and steps.claim(9, 1, source="198.51.100.2") is True
    assert steps.claim(10, 1, source="198.51.100.2") is False  # the trainer fences its own lost attempt
    with pytest.raises(RequestTimeout):
        steps.commit(10, 0, attempt=0, source="198.51.100.2")
    assert steps.fenced_refused == 1


def test_fences_and_ids_last_one_step_and_travel_with_the_contribution() -> None:
    steps = StepProtocol(0)
    for mb in (1, 2):
        steps.commit(mb, 0)
        steps.accumulated(4, mb, 0)
    taken = steps.take()
    assert taken.mbs == (1, 2) and taken.samples == 8
    assert steps.restore(0, 8) and steps.take().mbs == (1, 2)  # a failed round gives them back
    steps.begin_update(0)
    steps.finish_update()
    assert steps.claim(1, 1) is True  # the step before is still known
    assert steps.claim(3, 1) is False
    steps.adopt(5)  # a stage-mate's state replaced this one's: nothing counted here any more
    assert steps.claim(1, 1) is False and steps.take().mbs == ()


def test_a_claim_and_a_commit_racing_agree() -> None:
    """From two threads (the event loop's claim, the worker's commit), exactly one wins."""
    for trial in range(200):
        steps = StepProtocol(0)
        barrier = threading.Barrier(2)
        out: dict[str, Any] = {}

        def commit(steps: StepProtocol = steps, barrier: threading.Barrier = barrier,
                   out: dict[str, Any] = out, mb: int = trial) -> None:
            barrier.wait()
            try:
                steps.commit(mb, 0, attempt=0)
                out["committed"] = True
            except RequestTimeout:
                out["committed"] = False

        thread = threading.Thread(target=commit)
        thread.start()
        barrier.wait()
        counted = steps.claim(trial, 1)
        thread.join()
        assert counted == out["committed"], trial


@pytest.mark.parametrize(("status", "unknown"), [(0, True), (200, True), (500, True), (502, True), (503, False),
                                                 (408, False), (409, False), (422, False)])
def test_which_failures_may_have_counted(status: int, unknown: bool) -> None:
    assert may_have_counted(PeerError(status, "X", "y")) is unknown


def test_backward_attempts_settle_lost_answers() -> None:
    a = BackwardAttempts(mb=5)
    assert a.next_attempt() == 0
    a.failed("p:1", PeerError(0, "ServerDisconnectedError", "gone"))
    assert a.to_settle() == [("p:1", 1)]  # fence every attempt sent so far
    a.settled("p:1", False)
    assert a.next_attempt() == 1 and not a.compute_only
    a.failed("q:2", PeerError(503, "Busy", "averaging"))  # a refusal: nothing to settle
    assert a.to_settle() == []
    a.next_attempt()
    a.failed("q:2", PeerError(502, "RelayFailed", "went away"))
    a.settled("q:2", True)
    assert a.compute_only and a.counted_by == "q:2" and a.to_settle() == []
    b = BackwardAttempts(mb=6)
    b.next_attempt()
    b.failed("p:1", PeerError(0, "TimeoutError", ""))
    b.settled("p:1", None)
    assert b.unsettled == 1 and not b.compute_only
    unnamed = BackwardAttempts(mb=None)
    unnamed.next_attempt()
    unnamed.failed("p:1", PeerError(0, "TimeoutError", ""))
    assert unnamed.to_settle() == []


def test_repeated_microbatches() -> None:
    assert repeated_microbatches([(1, 2), (3,), (2, 4), (4,)]) == {2, 4}
    assert repeated_microbatches([(1, 2), ()]) == set()


# ---- the wire ---------------------------------------------------------------------------------


def test_claim_and_contribution_ids_round_trip_and_bad_ones_are_refused() -> None:
    req = ClaimRequest(stage=1, mb=2**64 - 1, attempt=3)
    assert ClaimRequest.from_frame(decode_frame(req.encode())) == req
    reply = ClaimReply(stage=1, step=4, counted=True)
    assert ClaimReply.from_frame(decode_frame(reply.encode())) == reply
    back = BackwardRequest(stage=0, inputs=torch.zeros(1, 2, dtype=torch.long), mb=9, attempt=2)
    assert BackwardRequest.from_frame(decode_frame(back.encode())).attempt == 2
    avg = AverageRequest(stage=0, peer_id="a" * 64, step=1, samples=0, mbs=(1, 2**64 - 1))
    assert AverageRequest.from_frame(decode_frame(avg.encode())).mbs == (1, 2**64 - 1)
    many = replace(avg, mbs=tuple(range((1 << 20) + 1)))  # more than a contribution may name: sent without
    assert AverageRequest.from_frame(decode_frame(many.encode())).mbs == ()
    for meta in ({"stage": 0}, {"stage": 0, "mb": -1}, {"stage": 0, "mb": 1, "attempt": -2},
                 {"stage": 0, "mb": 1, "attempt": "x"}, {"stage": 0, "mb": 1, "attempt": 2**21}):
        with pytest.raises(RequestError):
            ClaimRequest.from_frame(decode_frame(encode_frame("claim", meta, {}, "none")))
    meta = {"stage": 0, "peer_id": "a" * 64, "step": 1, "samples": 0}
    for ids in (torch.zeros(2), torch.zeros(2, 2, dtype=torch.long), torch.zeros((1 << 20) + 1, dtype=torch.long)):
        with pytest.raises(RequestError):
            AverageRequest.from_frame(decode_frame(encode_frame("average", meta, {"mbs": ids}, "none")))


# ---- a real swarm -------------------------------------------------------------------------------

SPEC = replace(PRESETS["tiny"], name="once")
TARGET = 16
MICRO = 4
TRAINING = TrainingSpec(target_batch_size=TARGET, lr=1e-3, warmup_steps=1, averaging_timeout_s=5.0)


def ok_rounds(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in (status["averaging"] or {}).get("recent", []) if r["status"] == "ok"]


async def test_a_counted_backward_whose_answer_is_lost_counts_once_or_is_seen_twice(monkeypatch) -> None:
    """2 stages x 2 peers. A last-stage peer counts a backward and its answer is lost (connection
    closed). First the trainer can ask it: the retry on its stage-mate only computes and the books
    balance exactly. Then the stage-mate loses an answer and its claim too: the retry counts, and
    the stage's leader reports the one microbatch both peers hold."""
    fault: dict[str, Any] = {"planes": [], "phase": 0, "dropped": [], "claims_dropped": 0, "served": []}
    backward, claim = DataPlane._backward, DataPlane._claim

    async def lossy_backward(self: DataPlane, request: web.Request) -> web.StreamResponse:
        sent = BackwardRequest.from_frame(decode_frame(await request.read()))
        if fault["phase"] == 2 and self is fault["planes"][1] and sent.mb == fault["dropped"][1] and not sent.verify:
            # the second victim turns the retry away, so it lands on its stage-mate, which never saw it
            return error_response(503, "Draining", "test: this peer is leaving; send the request elsewhere")
        resp = await backward(self, request)
        if fault["phase"] >= 2 or self is not fault["planes"][fault["phase"]] or not isinstance(resp, web.Response):
            return resp
        step = self._current().executor.step
        fault["served"].append((fault["phase"], step))
        if step < 1 or resp.status != 200:
            return resp
        answer = BackwardReply.from_frame(decode_frame(bytes(resp.body)))  # type: ignore[arg-type]
        if sent.verify or answer.duplicate:
            return resp
        fault["dropped"].append(sent.mb)
        fault["phase"] += 1
        assert request.transport is not None
        request.transport.close()  # counted, and the answer never arrives
        return resp

    async def lossy_claim(self: DataPlane, request: web.Request) -> web.StreamResponse:
        if fault["phase"] == 2 and self is fault["planes"][1] and not fault["claims_dropped"]:
            fault["claims_dropped"] += 1
            assert request.transport is not None
            request.transport.close()  # the peer cannot be asked
        return await claim(self, request)

    monkeypatch.setattr(DataPlane, "_backward", lossy_backward)
    monkeypatch.setattr(DataPlane, "_claim", lossy_claim)
    async with swarm(SPEC, TRAINING, peers_per_stage=2) as daemons:
        last = [d for d in daemons if d.stage == 1]
        fault["planes"] = [d.data_plane for d in last]
        api = f"http://{daemons[0].api_addr[0]}:{daemons[0].api_addr[1]}"
        config = TrainerConfig(api=api, steps=4, microbatch_size=MICRO, window=2, codec="none", seed=3, val_every=0,
                               val_batches=1, max_corpus_bytes=1 << 20, name="once", refresh_s=0.5, heartbeat_s=1.0,
                               request_timeout_s=20.0, stage_wait_timeout_s=60.0, verify_fraction=0.0)
        summary = await Trainer(config).run()
        await asyncio.sleep(0)  # the last answers' jobs adopted
        statuses = {d: d.status() for d in daemons}
        # the endpoint over a real socket: hostile bodies get a 4xx with a sentence, never a 500
        addr = last[1].data_plane.address
        async with aiohttp.ClientSession() as http:
            async def post(body: bytes, content_type: str = CONTENT_TYPE) -> tuple[int, bytes]:
                async with http.post(f"http://{addr[0]}:{addr[1]}/v1/claim", data=body,
                                     headers={"Content-Type": content_type}) as r:
                    return r.status, await r.read()

            refusals = [await post(b"\xc1garbage"), await post(b"{}", "application/json"),
                        await post(encode_frame("claim", {"stage": 0, "mb": 1}, {}, "none")),
                        await post(encode_frame("claim", {"stage": 1}, {}, "none")),
                        await post(encode_frame("claim", {"stage": 1, "mb": 1, "attempt": -1}, {}, "none"))]
            ok_status, ok_body = await post(ClaimRequest(stage=1, mb=fault["dropped"][0], attempt=9).encode())
    assert [status for status, _ in refusals] == [400, 415, 409, 422, 422], refusals
    assert all(b'"message"' in body for _, body in refusals)
    assert ok_status == 200 and ClaimReply.from_frame(decode_frame(ok_body)).counted is False  # counted by its mate
    assert len(fault["dropped"]) == 2 and fault["claims_dropped"] == 1, (fault["served"], fault["dropped"])
    assert summary.microbatches_issued == summary.microbatches_completed
    assert (summary.claims, summary.claims_counted, summary.claims_unanswered) == (2, 1, 1)
    asked = [statuses[d]["exactly_once"] for d in last]
    assert [(e["claims"], e["claims_counted"]) for e in asked] == [(1, 1), (0, 0)], asked
    # the first stage saw no fault: every step exactly the batch, each sample counted once
    first = [d for d in daemons if d.stage == 0]
    rounds0 = ok_rounds(statuses[first[0]])
    assert rounds0 and all(r["samples"] == TARGET for r in rounds0), rounds0
    assert sum(r["samples"] for r in rounds0) + sum(statuses[d]["grad_samples"] for d in first) == summary.samples
    # the last stage: the first lost answer counted once; the second, unaskable, twice, and seen
    rounds1 = max((ok_rounds(statuses[d]) for d in last), key=len)
    held1 = sum(statuses[d]["grad_samples"] for d in last)
    assert sum(r["samples"] for r in rounds1) + held1 == summary.samples + MICRO, (rounds1, held1, summary.samples)
    seen = sum(statuses[d]["averaging"]["duplicate_microbatches"] for d in last)
    assert seen == 1, [statuses[d]["averaging"] for d in last]
