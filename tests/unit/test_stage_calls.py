"""The one call machine (swarmd.train.stage_calls): route, timeout, send, classify, ban, retry, driven
with scripted answers in place of the network (the swarm tests run it for real)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from swarmd.errors import PeerError, remote_error
from swarmd.net.client import DataPlaneClient
from swarmd.net.messages import HOP_MARGIN_MS, BackwardReply, ClaimReply, ClaimRequest
from swarmd.pipeline.routing import StageRouter
from swarmd.train.pairing import CheckTally
from swarmd.train.stage_calls import CallEnded, Ended, Patience, StageBehind, StageCalls, StepMoved
from swarmd.train.summary import TrainSummary
from swarmd.train.timing import Timing
from swarmd.train.verify import VerifyStats
from tests.support.routing import FixedStages, listed

PEERS = {"a": "A", "b": "B", "c": "C"}
OPINION = Patience(tries=4, waits=False, busy_pause_s=0.001)


def timed_out(addr: str) -> PeerError:
    try:
        raise PeerError(0, "TimeoutError", f"{addr} did not answer") from TimeoutError()
    except PeerError as exc:
        return exc


class Script:
    """A ``send`` that answers each address from its script, in order: a reply, or an error to raise."""

    def __init__(self, **answers: list[Any]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def __call__(self, addr: str, timeout: float) -> str:
        self.asked.append(addr)
        answer = self.answers[addr].pop(0)
        if isinstance(answer, BaseException):
            raise answer
        if callable(answer):
            return await answer()
        return answer


async def machine(peers: dict[str, str] | None = None, *, timing: Timing | None = None,
                  wait_s: float = 120.0, **stages: Any) -> tuple[StageCalls, TrainSummary]:
    router = StageRouter(0, rng=random.Random(0), timeout_ceiling_s=60.0)
    router.update_peers(listed(PEERS if peers is None else peers))
    summary = TrainSummary()
    client = DataPlaneClient(timeout_s=1)  # never used: every call here sends through a Script
    await client.close()
    calls = StageCalls(FixedStages([router], **stages), client, model="m", codec="none", summary=summary,
                       timing=timing or Timing(), request_timeout_s=60.0, stage_wait_timeout_s=wait_s)
    return calls, summary


def router_of(calls: StageCalls) -> StageRouter:
    return calls.stages.routers[0]


async def test_a_broken_peer_is_banned_and_the_call_answered_elsewhere() -> None:
    calls, summary = await machine({"a": "A", "b": "B"})
    send = Script(A=[timed_out("A")], B=["from b"])
    served = await calls.call(0, "backward", 4, send)
    assert (served.reply, served.peer_id, served.attempts) == ("from b", "b", 2) and send.asked == ["A", "B"]
    assert (summary.retries, summary.bans, summary.timeouts, summary.probation_calls) == (1, 1, 1, 2)
    router = router_of(calls)
    assert router.snapshot()[0].banned and router.stats("a").timeouts == 1
    assert router.stats("b").proven and router.stats("a").in_flight == router.stats("b").in_flight == 0
    assert calls.failures[0]["A"].status == 0  # kept for the give-up sentence


async def test_a_busy_peer_is_asked_again_and_a_stale_backward_is_a_redo() -> None:
    calls, summary = await machine({"a": "A"})
    busy = remote_error(503, "Busy", "averaging")
    send = Script(A=[busy, busy, "ok"])
    assert (await calls.call(0, "backward", 4, send)).attempts == 3
    assert summary.bans == 0 and not router_of(calls).stats("a").failures
    with pytest.raises(StepMoved):
        await calls.call(0, "backward", 4, Script(A=[remote_error(409, "StaleStep", "stepped")]))
    assert router_of(calls).stats("a").in_flight == 0 and summary.bans == 0  # released, not blamed


async def test_a_backward_every_usable_peer_is_behind_on_is_a_redo_not_a_retry_for_good() -> None:
    """The livelock of issue 29's notes: a forward answered at step s by a peer that is then gone, banned
    or alone at s, while its stage-mates stay at s - 1. Each of them refuses the backward as PeerBehind;
    going round them again would never end, holding the microbatch's leased samples out of the step."""
    behind = remote_error(409, "PeerBehind", "stage 0 on this peer is at step 0, behind step 1")
    calls, _ = await machine()
    send = Script(A=[timed_out("A")], B=[behind], C=[behind])
    with pytest.raises(StageBehind):
        await calls.call(0, "backward", 4, send, prefer="a")
    assert send.asked == ["A", "B", "C"]  # once each: no second round
    router = router_of(calls)
    assert not router.stats("b").failures and not router.stats("c").failures  # behind is no fault of theirs
    assert all(router.stats(p).in_flight == 0 for p in PEERS)
    # one peer behind while another can still take it: answered there, no redo
    calls, _ = await machine()
    send = Script(A=[behind], B=["ok"])
    assert (await calls.call(0, "backward", 4, send, prefer="a")).peer_id == "b"


async def test_a_checks_busy_retries_count_as_traffic_and_only_the_answer_as_compute() -> None:
    """A Busy refusal computed nothing: the checks' cost (issue 29: <= 10% extra compute) counts the
    samples a peer answered, their traffic every request sent."""
    calls, _ = await machine({"a": "A"})
    busy = remote_error(503, "Busy", "averaging")
    stats = VerifyStats()
    await calls.call(0, "forward", 4, Script(A=[busy, busy, "ok"]), tally=CheckTally(stats, 100, "opinion"))
    assert (stats.extra_requests, stats.extra_bytes, stats.extra_samples) == (3, 300, 4)
    assert stats.extra_by_reason == {"opinion": 4}
    assert stats.extra_passes == 4  # a forward: one pass a sample
    await calls.call(0, "backward", 4, Script(A=["ok"]), tally=CheckTally(stats, 100, "probe"))
    assert len(calls.stages.routers) == 1  # so its backward is the last stage's fused call: three passes a sample
    assert stats.extra_passes == 4 + 12 and stats.extra_passes_by_reason == {"opinion": 4, "probe": 12}


async def test_a_refusal_no_retry_can_fix_ends_the_call_in_one_sentence() -> None:
    calls, _ = await machine({"a": "A", "b": "B"})
    with pytest.raises(CallEnded, match="stage 0 peer a refused a request: Unauthorized") as ended:
        await calls.call(0, "forward", 4, Script(A=[remote_error(401, "Unauthorized", "no key")]))
    assert ended.value.why is Ended.REFUSED


async def test_a_peer_that_moved_on_is_passed_over_by_work_and_ends_an_opinion() -> None:
    draining = remote_error(503, "Draining", "leaving")
    calls, summary = await machine({"a": "A", "b": "B"})
    assert (await calls.call(0, "forward", 4, Script(A=[draining], B=["ok"]))).peer_id == "b"
    assert summary.bans == 0
    calls, _ = await machine({"a": "A", "b": "B"})
    with pytest.raises(CallEnded) as ended:
        await calls.call(0, "forward", 4, Script(A=[draining]), patience=OPINION)
    assert ended.value.why is Ended.MOVED_ON


async def test_an_opinion_asks_only_whom_it_may_and_gives_up_after_its_tries() -> None:
    calls, _ = await machine()
    with pytest.raises(CallEnded) as ended:  # nobody left to ask
        await calls.call(0, "forward", 4, Script(), patience=OPINION, exclude={"a", "b", "c"})
    assert ended.value.why is Ended.NOBODY
    busy = remote_error(503, "Busy", "averaging")
    send = Script(B=[busy] * 4)
    with pytest.raises(CallEnded) as ended:
        await calls.call(0, "forward", 4, send, patience=OPINION, only="b")
    assert ended.value.why is Ended.NOBODY and send.asked == ["B"] * 4
    # calls made at once each ask another peer
    taken: set[str] = set()
    gate = asyncio.Event()

    def held(reply: str) -> Callable[[], Any]:
        async def answer() -> str:
            await gate.wait()
            return reply
        return answer

    send = Script(A=[held("a")], B=[held("b")], C=[held("c")])
    both = asyncio.gather(*(calls.call(0, "forward", 4, send, patience=OPINION, exclude={"a"}, taken=taken)
                            for _ in range(2)))
    await asyncio.sleep(0.05)
    gate.set()
    assert sorted(s.peer_id for s in await both) == ["b", "c"] and taken == {"b", "c"}


async def test_a_stage_without_a_usable_peer_is_waited_for_then_given_up_naming_why() -> None:
    timing = Timing(no_peer_poll_s=0.02)
    calls, _ = await machine({"a": "A"}, timing=timing, wait_s=0.3, unreachable=["10.0.0.9:1"])
    router_of(calls).ban("a", 60.0)
    with pytest.raises(CallEnded, match=r"stage 0 has had no usable peer for 0s; giving up\. 1 peer\(s\) listed at "
                                        r"10\.0\.0\.9:1 could not be dialled") as ended:
        await calls.call(0, "forward", 4, Script())
    assert ended.value.why is Ended.NOBODY and calls.stages.refreshes >= 2  # it looked for new peers meanwhile


async def test_a_forward_to_a_peer_on_probation_is_cut_short_by_what_the_stage_takes_now() -> None:
    """Issue #18: a peer that holds calls costs about one typical call of its stage, not the ceiling."""
    timing = Timing(timeout_floor_s=0.1)
    calls, summary = await machine({"a": "A", "t": "T"}, timing=timing)
    router = router_of(calls)
    router.report_success("a", 4, 0.004, "forward")  # the stage's forwards take a millisecond a sample
    router.report_alive("t")

    async def forever() -> str:
        await asyncio.sleep(60)
        return "never"

    send = Script(T=[forever])
    began = asyncio.get_running_loop().time()
    with pytest.raises(CallEnded):
        await calls.call(0, "forward", 4, send, patience=Patience(tries=1, waits=False, busy_pause_s=0.01), only="t")
    assert asyncio.get_running_loop().time() - began < 2.0 and summary.timeouts == 1
    assert "typical latency" in calls.failures[0]["T"].message and not router.stats("t").proven


class BackwardScript:
    """A data-plane client whose backwards answer from a script per address, noting whether each
    request carried the stage inputs (issue #30: only to the peer that kept them, they need not)."""

    def __init__(self, **answers: list[Any]) -> None:
        self.answers = answers
        self.sent: list[tuple[str, bool, int]] = []  # (addr, inputs sent, attempt)
        self.claims: list[str] = []

    async def backward(self, addr: str, stage: int, inputs: Any, *args: Any, attempt: int = 0, **kwargs: Any) -> Any:
        self.sent.append((addr, inputs is not None, attempt))
        answer = self.answers[addr].pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def claim(self, addr: str, request: ClaimRequest, *, timeout_s: float | None = None) -> ClaimReply:
        self.claims.append(addr)
        return ClaimReply(stage=request.stage, step=0, counted=False)


async def test_a_backward_omits_the_inputs_only_where_they_were_kept_and_resends_them_once_on_a_miss() -> None:
    reply = BackwardReply(stage=0, step=0, samples=2, accumulated=2)
    inputs = torch.zeros(2, 4, dtype=torch.long)
    calls, summary = await machine()
    missed = remote_error(409, "InputsNotCached", "this peer holds no forward of that microbatch")
    # the forward's peer lost them (restarted, evicted): refused before counting, resent at once with them
    calls.client = client = BackwardScript(A=[missed, reply])  # type: ignore[assignment]
    served = await calls.backward(0, inputs, step=0, mb=7, prefer="a", kept_at="A")
    assert served.reply is reply and served.peer_id == "a" and served.addr == "A"
    assert client.sent == [("A", False, 0), ("A", True, 1)] and not client.claims
    assert (summary.inputs_omitted, summary.inputs_resent, summary.retries) == (1, 1, 0)
    # the forward's peer died: the backward goes elsewhere, with the inputs (that peer never ran the forward)
    calls.client = client = BackwardScript(A=[timed_out("A")], B=[reply], C=[reply])  # type: ignore[assignment]
    served = await calls.backward(0, inputs, step=0, mb=8, prefer="a", kept_at="A")
    assert served.peer_id != "a" and client.sent == [("A", False, 0), (served.addr, True, 1)]
    assert client.claims == ["A"]  # its answer was lost: asked whether it counted (exactly once)
    # a forward that was not kept (a full cache, an older peer): the inputs go along from the start
    calls.client = client = BackwardScript(B=[reply], C=[reply])  # type: ignore[assignment]
    served = await calls.backward(0, inputs, step=0, mb=9, prefer="b", kept_at=None)
    assert client.sent == [(served.addr, True, 0)] and summary.inputs_omitted == 2


async def test_a_call_that_must_be_answered_does_not_wait_for_the_peer_its_pair_took() -> None:
    """Issue 28's end-of-run stall: a paired microbatch's primary half chose ``a``, its pair ``b``; the
    pair was answered (``b`` stays in ``taken``), then ``a`` failed and was banned. The primary must
    go to ``b`` (an unchecked pair), not wait for ever for a peer other than ``b``."""
    calls, summary = await machine({"a": "A", "b": "B"})
    taken: set[str] = set()
    pair_answered = asyncio.Event()

    async def fails_after_the_pair() -> str:
        await pair_answered.wait()
        raise timed_out("A")

    primary_send = Script(A=[fails_after_the_pair], B=["primary from b"])
    pair_send = Script(B=["pair from b"])
    primary = asyncio.ensure_future(calls.call(0, "backward", 4, primary_send, taken=taken))
    await asyncio.sleep(0)  # the primary chose first, as Pairing.paired lets it
    pair = await calls.call(0, "backward", 4, pair_send, patience=OPINION, taken=taken)
    assert (pair.peer_id, primary_send.asked, taken) == ("b", ["A"], {"a", "b"})
    pair_answered.set()
    served = await asyncio.wait_for(primary, timeout=30)  # without the fix: a 10 ms wait loop for good
    assert (served.reply, served.peer_id) == ("primary from b", "b") and primary_send.asked == ["A", "B"]
    assert router_of(calls).snapshot()[0].banned and summary.bans == 1


async def test_an_opinion_still_never_takes_the_peer_its_primary_took() -> None:
    """The other way round stays as it was: the pair's half (an opinion, which does not wait) ends
    rather than ask the primary's peer."""
    calls, _ = await machine({"a": "A", "b": "B"})
    taken = {"a"}
    send = Script(B=[timed_out("B")])
    with pytest.raises(CallEnded) as ended:
        await calls.call(0, "backward", 4, send, patience=OPINION, taken=taken)
    assert ended.value.why is Ended.NOBODY and send.asked == ["B"]


# ---- peer to peer: the hops a forward names (issue #31) ---------------------------------------------


async def hop_machine(*stages: dict[str, str], proven: set[str]) -> StageCalls:
    routers = []
    for k, peers in enumerate(stages):
        router = StageRouter(k, rng=random.Random(k), timeout_ceiling_s=60.0)
        router.update_peers(listed(peers, stage=k))
        for peer_id in peers:
            if peer_id in proven:
                router.begin(peer_id)
                router.report_success(peer_id, 4, 0.5, "forward")  # 0.125 s a sample
        routers.append(router)
    client = DataPlaneClient(timeout_s=1)
    await client.close()
    return StageCalls(FixedStages(routers), client, model="m", codec="none", summary=TrainSummary(),
                      timing=Timing(), request_timeout_s=60.0, stage_wait_timeout_s=1.0)


async def test_a_forwards_hops_wait_for_the_rest_of_the_chain_and_count_in_flight() -> None:
    calls = await hop_machine({"a": "A:1"}, {"b": "B:1"}, {"c": "C:1"}, {"d": "D:1"}, proven={"a", "b", "c", "d"})
    hops, stopped = calls._hops(1, 3, 4)
    assert stopped is None
    assert [(h.stage, h.addr, h.peer_id) for h in hops] == [(1, "B:1", "b"), (2, "C:1", "c"), (3, "D:1", "d")]
    each = [calls.stages.routers[k].timeout_for(p, 4, "forward", floor_s=calls.timing.timeout_floor("forward", 60.0))
            for k, p in ((1, "b"), (2, "c"), (3, "d"))]
    # each hop's wait covers the hops after it, and each of those one's margin to answer
    assert [h.timeout_ms for h in hops] == [int(sum(each[i:]) * 1000) + (2 - i) * HOP_MARGIN_MS for i in range(3)]
    assert all(h.deadline_ms is None for h in hops)
    assert [calls.stages.routers[k].stats(p).in_flight for k, p in ((1, "b"), (2, "c"), (3, "d"))] == [1, 1, 1]
    fused, _ = calls._hops(1, 3, 4, fused=True)  # the last hop: the last stage's fused call, with its deadline
    assert [h.deadline_ms is None for h in fused] == [True, True, False]
    assert fused[-1].deadline_ms == calls.timing.backward_deadline_ms(fused[-1].timeout_ms / 1000)


@pytest.mark.parametrize(("stage2", "proven", "expected", "stopped"), [
    ({"c": "c@R:1"}, {"b", "c"}, ["b"], "c"),  # a relayed peer: its stage-mates cannot dial it, the trainer calls it
    ({"c": "C:1"}, {"b"}, ["b"], "c"),  # a peer on probation: its calls are watched from the trainer
    ({"c": "C:1"}, {"c"}, [], "b"),  # the chain stops at the first such stage, whatever follows
    ({}, {"b"}, ["b"], None),  # nobody usable at stage 2
])
async def test_a_chain_stops_before_a_peer_it_should_not_dial(stage2: dict[str, str], proven: set[str],
                                                              expected: list[str], stopped: str | None) -> None:
    calls = await hop_machine({"a": "A:1"}, {"b": "B:1"}, stage2, {"d": "D:1"}, proven=proven | {"a", "d"})
    hops, stopped_at = calls._hops(1, 3, 4)
    # the pick it stopped before comes back: the trainer's own call of that stage asks it first
    assert [h.peer_id for h in hops] == expected and stopped_at == stopped
