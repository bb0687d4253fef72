"""Spot checks (swarmd.train.verify, issue #17): the comparison rule, arbitration, the checked share,
1,000 honest checks through real executors and real codecs without a false alarm, and liars in a
real 2-stage x 3-peer swarm caught, reported and excluded while training goes on."""

from __future__ import annotations

import asyncio
import math
import random
import socket
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from swarmd.daemon import Daemon
from swarmd.dht.identity import Identity
from swarmd.errors import PeerError
from swarmd.net.client import DataPlaneClient
from swarmd.net.messages import BackwardReply, ForwardReply, ReportRequest
from swarmd.net.wire import CONTENT_TYPE, decode_frame, encode_frame
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.reports import MisbehaviourReport
from swarmd.pipeline.routing import StageRouter
from swarmd.pipeline.spec import PRESETS
from swarmd.train.spot_checks import Finding, Ruling, SpotChecks, Unsettled
from swarmd.train.stage_calls import StageCalls
from swarmd.train.trainer import Trainer, TrainerConfig, TrainSummary
from swarmd.train.verify import (
    CROSS_BUILD_SLACK,
    UNSETTLED_LIMIT,
    Answer,
    Outlier,
    SpotChecker,
    Verdict,
    VerifyStats,
    agree,
    arbitrate,
    describe,
    tolerance,
)
from tests.support.checks import FRACTION, SPEC, TRAINING, trainer_config
from tests.support.liars import make_liar
from tests.support.routing import FixedStages, listed
from tests.support.swarms import fast_swarm

CODECS = ("none", "fp16", "bf16", "8bit")


def answer(peer: str, t: torch.Tensor | None, step: int = 0, loss: float | None = None) -> Answer:
    return Answer(peer, step, t, loss)


# ---- the comparison rule -----------------------------------------------------------------------


def test_tolerance_is_twice_the_codec_bound_plus_the_build_slack() -> None:
    assert tolerance("none") == CROSS_BUILD_SLACK
    assert tolerance("fp16") == pytest.approx(2 * 2**-11 + CROSS_BUILD_SLACK)
    assert tolerance("4bit") > tolerance("8bit") > tolerance("bf16") > tolerance("fp16") > tolerance("none")
    with pytest.raises(ValueError):
        tolerance("2bit")


def test_agree_exact_within_and_beyond_tolerance() -> None:
    x = torch.randn(4, 8, 16)
    tol = tolerance("8bit")
    assert agree(answer("a", x), answer("b", x.clone()), 0.0)  # bit-identical: always
    assert agree(answer("a", x), answer("b", x + 0.5 * tol * x.abs().max()), tol)
    assert not agree(answer("a", x), answer("b", x * 1.5), tol)  # a scaled answer
    assert not agree(answer("a", x), answer("b", -3 * x), tol)  # a wrong gradient
    assert not agree(answer("a", x), answer("b", x[:2]), tol)  # another shape
    assert not agree(answer("a", x), answer("b", x.double()), tol)  # another dtype
    assert not agree(answer("a", x), answer("b", torch.full_like(x, math.nan)), tol)
    assert not agree(answer("a", x), answer("b", None), tol)
    assert agree(answer("a", None, loss=2.0), answer("b", None, loss=2.0 + 1e-6), tol)
    assert not agree(answer("a", None, loss=2.0), answer("b", None, loss=2.5), tol)
    assert not agree(answer("a", x, loss=2.0), answer("b", x), tol)
    assert not agree(answer("a", x, loss=math.inf), answer("b", x, loss=math.inf), tol)
    ints = torch.arange(6)
    assert agree(answer("a", ints), answer("b", ints.clone()), tol)
    assert not agree(answer("a", ints), answer("b", ints + 1), 1.0)


def test_arbitration_verdicts() -> None:
    x, tol = torch.ones(3), 1e-6
    good, bad = answer("honest", x), answer("liar", 2 * x)
    assert arbitrate([good, answer("other", x)], tol).verdict is Verdict.AGREE
    assert arbitrate([good, bad], tol).verdict is Verdict.MISMATCH
    assert arbitrate([good, answer("later", x, step=1)], tol).verdict is Verdict.INCONCLUSIVE  # a step between
    caught = arbitrate([bad, good, answer("third", x)], tol)
    assert caught.verdict is Verdict.LIAR and caught.liar == "liar"
    caught = arbitrate([good, bad, answer("third", x)], tol)
    assert caught.verdict is Verdict.LIAR and caught.liar == "liar"  # a lying second opinion is caught too
    three_way = arbitrate([good, bad, answer("third", 3 * x)], tol)
    assert three_way.verdict is Verdict.INCONCLUSIVE and three_way.liar is None  # two must agree to convict
    assert arbitrate([good, bad, answer("third", x, step=2)], tol).verdict is Verdict.INCONCLUSIVE
    with pytest.raises(ValueError):
        arbitrate([good], tol)


def test_the_checked_share_is_the_fraction_and_nothing_uncheckable_is_drawn() -> None:
    checker = SpotChecker(0.02, random.Random(1))
    n = 20_000
    drawn = sum(checker.should_check(comparable=True, other_peers=2) for _ in range(n))
    assert abs(drawn - 0.02 * n) <= 4 * math.sqrt(n * 0.02 * 0.98)  # binomial, 4 sigma
    assert not any(checker.should_check(comparable=True, other_peers=0) for _ in range(100))
    assert not any(checker.should_check(comparable=False, other_peers=2) for _ in range(100))
    assert not any(SpotChecker(0.0).should_check(comparable=True, other_peers=5) for _ in range(100))
    with pytest.raises(ValueError):
        SpotChecker(1.5)


def test_verify_stats_are_strict_json_with_the_traffic_fraction() -> None:
    stats = VerifyStats(calls=200, checks=4, arbitrations=1, extra_requests=7, caught=("p",))
    out = stats.to_json()
    assert out["traffic_fraction"] == pytest.approx(7 / 200) and out["caught"] == ["p"]
    assert VerifyStats().to_json()["traffic_fraction"] == 0.0


def test_the_plain_summary_line_says_what_the_checks_cost_and_caught() -> None:
    line = describe(VerifyStats(calls=200, checks=4, mismatches=1, extra_requests=7, caught=("ab" * 20,)).to_json())
    assert line == ("spot checks: 4 of 200 calls, 7 extra requests (+3.5% traffic), 1 mismatches, "
                    "1 liar(s) caught: abababababab")
    assert "no liar caught" in (describe(VerifyStats(calls=10, checks=1, extra_requests=1).to_json()) or "")
    assert describe(VerifyStats(calls=10).to_json()) is None  # checked nothing: no line
    # with the bytes of the trainer's own calls, the traffic is said in bytes (a probe weighs less than a pair)
    stats = VerifyStats(calls=200, checks=4, extra_requests=7, extra_wire_bytes=3_000).to_json()
    assert "(+1.5% traffic)" in (describe(stats, wire_bytes=200_000) or "")


# ---- 1,000 honest checks: real executors, real codecs --------------------------------------------


def _decoded(encode: Any, codec: str, kind: type[ForwardReply] | type[BackwardReply]) -> Any:
    return kind.from_frame(decode_frame(encode(codec)))


async def test_a_thousand_honest_spot_checks_raise_no_false_alarm() -> None:
    """Two executors of the same stage (a middle one: the primary's backward hits its activation
    cache, the check recomputes) answer the same requests; every reply goes through each wire
    codec it could travel with (63 requests x 4 codecs x 4 comparisons: the requests are shared
    by the codecs, as the codecs' decoding, not the compute, is what costs here). No pair may
    disagree, whatever the codec."""
    spec = replace(PRESETS["tiny"], name="honest", n_stages=3, d_model=32, d_ff=64, seq_len=16)
    primary, second = StageExecutor(spec, 1), StageExecutor(spec, 1)
    rng = torch.Generator().manual_seed(0)
    checks = 0
    try:
        for i in range(63):
            x = torch.randn(2, spec.seq_len, spec.d_model, generator=rng) * (1 + i % 7)
            g = torch.randn(2, spec.seq_len, spec.d_model, generator=rng) * 1e-3
            a, b = await primary.forward(x, mb=i), await second.forward(x, mb=10_000 + i)
            ba = await primary.backward(x, g, step=a.step, mb=i)  # the cached graph
            bb = await second.backward(x, g, step=b.step, mb=i, verify=True)  # recomputed, not accumulated
            for codec in CODECS:
                tol = tolerance(codec)
                fa = _decoded(ForwardReply(1, a.step, a.outputs).encode, codec, ForwardReply)
                fb = _decoded(ForwardReply(1, b.step, b.outputs).encode, codec, ForwardReply)
                ra = _decoded(BackwardReply(1, ba.step, ba.samples, 0, ba.grad_inputs).encode, codec, BackwardReply)
                rb = _decoded(BackwardReply(1, bb.step, bb.samples, 0, bb.grad_inputs).encode, codec, BackwardReply)
                for p, q in ((answer("p", fa.outputs), answer("q", fb.outputs)),
                             (answer("p", ra.grad_inputs), answer("q", rb.grad_inputs)),
                             (answer("p", fa.outputs), answer("q", _requantized(fb.outputs, codec))),
                             (answer("p", ra.grad_inputs), answer("q", _requantized(rb.grad_inputs, codec)))):
                    assert arbitrate([p, q], tol).verdict is Verdict.AGREE, (i, codec)
                    checks += 1
        assert checks == 1008
        assert second.grad_samples == 0 and primary.grad_samples == 126  # checks never accumulate
    finally:
        await primary.close()
        await second.close()


def _requantized(t: torch.Tensor, codec: str) -> torch.Tensor:
    """``t`` nudged by float rounding (another build) and coded again: still within the rule."""
    nudged = t * (1 + 1e-6) + 1e-7
    return ForwardReply.from_frame(decode_frame(ForwardReply(1, 0, nudged).encode(codec))).outputs


# ---- the verdict on a pair ---------------------------------------------------------------------

def _checking_trainer(client: DataPlaneClient, steps: dict[str, int] | list[dict[str, int]] | None = None
                      ) -> tuple[SpotChecks, list[str]]:
    """A trainer's spot checks whose stage-1 router lists three peers at closed loopback ports:
    reports to them fail at once, which ``_convict`` takes as not accepted. ``steps``: what the
    stage's peers report through ``/v1/progress`` (a list: what successive fresh polls say, the last
    one for good)."""
    polls = list(steps) if isinstance(steps, list) else [steps or {}]
    routers = [StageRouter(0), StageRouter(1)]
    ports = []
    for _ in range(3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    addrs = {name * 20: f"127.0.0.1:{port}" for name, port in zip(("ab", "bc", "cd"), ports, strict=True)}
    routers[1].update_peers(listed(addrs, stage=1))
    config = TrainerConfig(api="http://unused", verify_fraction=0.02, codec="none")
    calls = StageCalls(FixedStages(routers), client, model="unused", codec=config.codec, summary=TrainSummary(),
                       timing=config.timing, request_timeout_s=config.request_timeout_s,
                       stage_wait_timeout_s=config.stage_wait_timeout_s)

    async def stage_steps(stage: int, fresh: bool) -> dict[str, int]:
        if fresh and len(polls) > 1:
            return dict(polls.pop(0))
        return dict(polls[0])

    checks = SpotChecks(calls, client, stats=VerifyStats(), codec=config.codec, fraction=config.verify_fraction,
                        window=config.window, timing=config.timing, stage_steps=stage_steps)
    return checks, list(addrs)


def _arbiter(*answers: Answer | None) -> Any:
    """An arbiter that answers from its script, in order (None: nobody answered)."""
    script = list(answers)

    async def arbiter(exclude: frozenset[str]) -> Answer | None:
        third = script.pop(0)
        assert third is None or third.peer_id not in exclude
        return third

    return arbiter


REQUEST = (torch.zeros(4, 8),)


async def test_microbatches_run_paired_for_first_checks_only_until_two_peers_of_each_stage_are_confirmed() -> None:
    """A pair confirms two peers of every stage at once; past two, a newer peer's first answers are checked by
    an opinion each (``SpotChecks._alone``), so a join no longer pairs every microbatch until it is reached."""
    async with DataPlaneClient(timeout_s=2) as client:
        t, (a, b, c) = _checking_trainer(client)
        assert t.pairing.pairs() and t.stats.first_checks == 1  # nobody confirmed on stage 1
        t.ledger.credit([answer(a, None)], "backward")
        assert t.pairing.pairs() and t.stats.first_checks == 2  # one is not enough
        t.ledger.credit([answer(b, None)], "backward")
        for _ in range(50):
            t.pairing.pairs()  # drawn at the random share only now, though c has nothing confirmed
        assert t.stats.first_checks == 2 and t.ledger.wants_first_check(c, "backward")


async def test_a_new_peers_first_answer_gets_an_opinion_and_its_answers_meanwhile_wait_for_the_verdict() -> None:
    g = torch.ones(4, 8)
    async with DataPlaneClient(timeout_s=2) as client:
        t, (a, b, c) = _checking_trainer(client)
        gate = asyncio.Event()

        async def slow_opinion(exclude: frozenset[str]) -> Answer | None:
            await gate.wait()
            return answer(a, g, 3)

        first = asyncio.create_task(t._alone(1, "backward", answer(c, g, 3), slow_opinion, REQUEST))
        await asyncio.sleep(0.01)
        # its next answer comes while the first check is out: no opinion of its own (an empty script would
        # raise), it waits and then goes on as a confirmed peer's answer
        second = asyncio.create_task(t._alone(1, "backward", answer(c, g, 3), _arbiter(), REQUEST))
        await asyncio.sleep(0.01)
        assert not second.done()
        gate.set()
        assert await first == Ruling(Finding.CONFIRMED) and await second is None
        assert t.stats.first_opinions == 1 and t.ledger.confirmed(c, "backward") == 1
        assert t.ledger.confirmed(a, "backward") == 1  # the opinion's peer is confirmed too
        # a liar's first check convicts it, and its answers that waited are redone, never used
        t, (a, b, c) = _checking_trainer(client)
        gate = asyncio.Event()

        async def slow_truth(exclude: frozenset[str]) -> Answer | None:
            await gate.wait()
            return answer(b if a in exclude else a, g, 3)

        first = asyncio.create_task(t._alone(1, "backward", answer(c, -3 * g, 3), slow_truth, REQUEST))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(t._alone(1, "backward", answer(c, -3 * g, 3), _arbiter(), REQUEST))
        await asyncio.sleep(0.01)
        gate.set()
        assert (await first).finding is Finding.OVERRULED and t.stats.caught == (c,)
        with pytest.raises(Unsettled):
            await second
        # nobody to give the opinion (busy, on probation, just listed): the answer goes on unconfirmed, never
        # redone (redone, it met the same peer again and again: the README swarm's livelock)
        t, (a, b, c) = _checking_trainer(client)
        assert await t._alone(1, "backward", answer(c, g, 3), _arbiter(None), REQUEST) is None
        assert t.stats.first_opinions == t.stats.unconfirmed == 1 and t.stats.redone == 0
        assert t.ledger.wants_first_check(c, "backward")  # its next answer is its first check again


async def test_an_outlier_confirmed_after_it_came_is_not_made_a_reference_of_its_stage() -> None:
    """A paired microbatch's confirmed answer joins the size references; an unpaired one checked for its
    size (an outlier: a loss spike's gradient) does not, confirmed or not: the next step's ordinary answers
    held to it were the false alarms after a spike (verify.AnswerSizes)."""
    g = torch.ones(4, 8)
    async with DataPlaneClient(timeout_s=2) as client:
        t, (a, b, c) = _checking_trainer(client)
        assert await t.judge(1, "backward", answer(a, 10 * g, 3), answer(b, 10 * g, 3), _arbiter(), REQUEST,
                             reference=False) == Ruling(Finding.CONFIRMED)
        assert t.ledger.confirmed(a, "backward") == 1  # confirmed all the same
        assert t.sizes.outlier(1, "backward", answer(c, g, 3)) is not Outlier.FIRM  # no reference to hold it to
        assert await t.judge(1, "backward", answer(a, 10 * g, 3), answer(b, 10 * g, 3), _arbiter(),
                             REQUEST) == Ruling(Finding.CONFIRMED)
        assert t.sizes.outlier(1, "backward", answer(c, g, 3)) is Outlier.FIRM  # a pair's answer is one


async def test_a_last_stage_answer_out_of_a_thin_references_band_is_probed_and_opined_on_only_when_uphill() -> None:
    """One stage-mate's answer of a step around it is a thin reference (``verify.Outlier.THIN``): a last-stage
    answer out of its band is probed for direction first (a forward), and another peer is asked for an opinion (a
    fused call) only when the probe finds it uphill; an outlier against a firm reference gets the opinion at once.
    Held to thin references too, the check-aware liar's first lies stopped going through (BENCHMARKS)."""
    g = torch.ones(4, 8)

    def probe(uphill: bool, asked: list[int]) -> Any:
        async def run() -> bool:
            asked.append(1)
            return uphill
        return run

    async with DataPlaneClient(timeout_s=2) as client:
        # downhill: the answer goes on unopined, and is no reference of its step (a checked outlier)
        t, (a, b, c) = _checking_trainer(client)
        t.ledger.credit([answer(p, None) for p in (a, b, c)], "backward")  # past their first checks
        t.sizes.observe(1, "backward", answer(a, g, 2))
        asked: list[int] = []
        assert await t._alone(1, "backward", answer(c, 3 * g, 3), _arbiter(), REQUEST, probe(False, asked)) is None
        assert asked == [1] and t.stats.outlier_probes == t.stats.probes == 1 and t.stats.suspicions == 0
        assert t.sizes.outlier(1, "backward", answer(b, 3 * g, 3)) is Outlier.THIN  # still only a's
        assert not t.ledger.wants_suspicion_check(c, "backward")
        # uphill: the opinion, and the liar convicted by a third
        ruling = await t._alone(1, "backward", answer(c, -3 * g, 3), _arbiter(answer(a, g, 3), answer(b, g, 3)),
                                REQUEST, probe(True, asked))
        assert ruling is not None and ruling.finding is Finding.OVERRULED and t.stats.caught == (c,)
        assert asked == [1, 1] and t.stats.outlier_probes == 2 and t.stats.suspicions == 1
        # and an uphill answer is evidence of its own, whatever its opinion settles: its peer's next answers of
        # every kind are checked always (a second opinion from the next step redoes the microbatch unblamed)
        assert t.ledger.wants_suspicion_check(c, "backward") and t.ledger.wants_suspicion_check(c, "forward")
        # a firm reference (two of the steps around it): the opinion at once, no probe
        t, (a, b, c) = _checking_trainer(client)
        t.ledger.credit([answer(p, None) for p in (a, b, c)], "backward")
        t.sizes.observe(1, "backward", answer(a, g, 2))
        t.sizes.observe(1, "backward", answer(b, g, 4))
        asked = []
        ruling = await t._alone(1, "backward", answer(c, 3 * g, 3), _arbiter(answer(a, 3 * g, 3)), REQUEST,
                                probe(True, asked))
        assert ruling == Ruling(Finding.CONFIRMED) and asked == [] and t.stats.suspicions == 1
        assert t.stats.probes == 0


async def test_a_pair_that_agrees_is_confirmed_and_a_mismatch_is_settled_by_a_third_peer() -> None:
    g = torch.ones(4, 8)
    async with DataPlaneClient(timeout_s=2) as client:
        t, (a, b, c) = _checking_trainer(client)
        assert await t.judge(1, "backward", answer(a, g, 3), answer(b, g, 3), _arbiter(), REQUEST) == Ruling(
            Finding.CONFIRMED)
        assert t.ledger.confirmed(a, "backward") == 1 and t.ledger.confirmed(b, "backward") == 1
        # the primary lied: convicted, and the majority's answer goes on
        ruling = await t.judge(1, "backward", answer(a, -3 * g, 3), answer(b, g, 3), _arbiter(answer(c, g, 3)),
                               REQUEST)
        assert ruling.finding is Finding.OVERRULED and ruling.use is not None and torch.equal(ruling.use.tensor, g)
        assert t.stats.caught == (a,) and t.stats.arbitrations == 1
        # the pair lied: convicted, the primary's answer goes on
        t, (a, b, c) = _checking_trainer(client)
        ruling = await t.judge(1, "forward", answer(a, g, 3), answer(b, 1.5 * g, 3), _arbiter(answer(c, g, 3)),
                               REQUEST)
        assert ruling == Ruling(Finding.CONFIRMED) and t.stats.caught == (b,)
        # nobody to arbitrate (or the arbiter met another step): never dropped, the microbatch is redone
        t, (a, b, c) = _checking_trainer(client)
        for third in (None, answer(c, g, 4)):
            ruling = await t.judge(1, "forward", answer(a, g, 3), answer(b, 1.5 * g, 3), _arbiter(third), REQUEST)
            assert ruling.redo and not t.stats.caught
        assert t.stats.redone == 2


async def test_a_liar_whose_mismatches_no_third_answer_settles_is_convicted_by_their_verdicts() -> None:
    """Every arbiter meets another step (or nobody), so no mismatch is settled at its own step: each
    is redone and counted against both peers, and the liar is convicted once it has disagreed with
    two peers that agreed with each other; the answer of the peer that agreed goes on."""
    g = torch.ones(4, 8)
    async with DataPlaneClient(timeout_s=2) as client:
        t, (a, b, liar) = _checking_trainer(client)
        assert (await t.judge(1, "backward", answer(liar, -3 * g, 3), answer(a, g, 3), _arbiter(None), REQUEST)).redo
        assert await t.judge(1, "backward", answer(a, g, 4), answer(b, g, 4), _arbiter(), REQUEST) == Ruling(
            Finding.CONFIRMED)
        assert not t.stats.caught
        ruling = await t.judge(1, "backward", answer(liar, -3 * g, 5), answer(b, g, 5), _arbiter(answer(a, g, 6)),
                               REQUEST)
        assert ruling.finding is Finding.OVERRULED and ruling.use is not None and torch.equal(ruling.use.tensor, g)
        assert t.stats.caught == (liar,)


async def test_a_reply_step_is_checked_not_believed() -> None:
    """A step ahead of what its own peer reports in a poll made afterwards, or far beyond every
    stage-mate's, convicts its peer at once (a liar tagging its answers +1000 told 171 lies
    unreported); a pair at steps one apart asks a third peer and holds the one alone ahead to a
    fresh poll; an honest peer that is ahead (it stepped first) or behind is never blamed."""
    g = torch.ones(4, 8)
    async with DataPlaneClient(timeout_s=2) as client:
        t, (a, b, c) = _checking_trainer(client, steps={"ab" * 20: 1005, "bc" * 20: 5, "cd" * 20: 6})
        ruling = await t.judge(1, "forward", answer(a, g, 1005), answer(b, g, 5), _arbiter(), REQUEST)
        assert ruling.redo and t.stats.caught == (a,)  # it reports 1005 itself: beyond its mates' steps
        t, (a, b, c) = _checking_trainer(client, steps={"ab" * 20: 5, "bc" * 20: 5, "cd" * 20: 6})
        ruling = await t.judge(1, "forward", answer(a, g, 1005), answer(b, g, 5), _arbiter(), REQUEST)
        assert ruling.redo and t.stats.caught == (a,)
        # one ahead of what it reports: alone ahead in its pair, then held to the poll
        t, (a, b, c) = _checking_trainer(client, steps={"ab" * 20: 5, "bc" * 20: 5, "cd" * 20: 5})
        ruling = await t.judge(1, "backward", answer(a, g, 6), answer(b, g, 5), _arbiter(answer(c, g, 5)), REQUEST)
        assert ruling.redo and t.stats.caught == (a,)
        # ... even when the stage steps right after that poll: its own peer named an earlier step after the
        # reply came, which an honest peer never does (the poll again 0.5 s later let a +1 liar through)
        t, (a, b, c) = _checking_trainer(client, steps=[{"ab" * 20: 5, "bc" * 20: 5, "cd" * 20: 5},
                                                        {"ab" * 20: 6, "bc" * 20: 6, "cd" * 20: 6}])
        ruling = await t.judge(1, "backward", answer(a, g, 6), answer(b, g, 5), _arbiter(answer(c, g, 5)), REQUEST)
        assert ruling.redo and t.stats.caught == (a,)
        # honest: it stepped first (it reports 6), or it is behind: redone, never blamed
        t, (a, b, c) = _checking_trainer(client, steps={"ab" * 20: 6, "bc" * 20: 5, "cd" * 20: 5})
        for _ in range(10):
            assert (await t.judge(1, "forward", answer(a, g, 6), answer(b, g, 5), _arbiter(answer(c, g, 5)),
                                  REQUEST)).redo
            assert (await t.judge(1, "forward", answer(b, g, 4), answer(c, g, 5), _arbiter(answer(a, g, 5)),
                                  REQUEST)).redo
        assert not t.stats.caught


async def test_a_forward_step_no_peer_of_its_stage_is_at_is_held_to_its_peer_s_poll() -> None:
    """A backward every usable peer refused as behind its forward's step (``stage_calls.StageBehind``: the
    microbatch is redone) holds that forward's step to a fresh poll: its peer naming an earlier step lied
    (convicted); one naming that step stepped alone, and one gone says nothing: neither is blamed."""
    g = torch.ones(4, 8)
    async with DataPlaneClient(timeout_s=2) as client:
        t, (a, b, c) = _checking_trainer(client, steps={"ab" * 20: 5, "bc" * 20: 5, "cd" * 20: 5})
        assert await t.held_to_step(1, a, 6, g, REQUEST) and t.stats.caught == (a,)
        t, (a, b, c) = _checking_trainer(client, steps={"ab" * 20: 6, "bc" * 20: 5, "cd" * 20: 5})
        assert not await t.held_to_step(1, a, 6, g, REQUEST) and not t.stats.caught
        t, (a, b, c) = _checking_trainer(client, steps={"bc" * 20: 5, "cd" * 20: 5})
        assert not await t.held_to_step(1, a, 6, g, REQUEST) and not t.stats.caught


async def test_two_peers_that_always_differ_stall_nothing_once_no_third_can_settle_it() -> None:
    """A stage of two whose answers differ every time (one of two lies, which two peers cannot tell
    apart; or they differ beyond the tolerance): ``UNSETTLED_LIMIT`` of them are redone, then their
    answers go on and their first checks stop (each redo forever would livelock the swarm)."""
    g = torch.ones(4, 8)
    async with DataPlaneClient(timeout_s=2) as client:
        t, (a, b, gone) = _checking_trainer(client)
        t.calls.stages.routers[1].ban(gone, 60.0)  # two usable peers: no third opinion
        rulings = [await t.judge(1, "backward", answer(a, g), answer(b, 1.01 * g), _arbiter(None), REQUEST)
                   for _ in range(UNSETTLED_LIMIT)]
        assert rulings[:-1] == [Ruling(Finding.UNSETTLED)] * (UNSETTLED_LIMIT - 1) and all(r.redo for r in rulings[:-1])
        assert rulings[-1] == Ruling(Finding.LET_THROUGH) and not rulings[-1].redo  # their answers go on
        assert t.ledger.gave_up(a, "backward") and t.ledger.gave_up(b, "backward") and not t.stats.caught


async def test_answers_of_different_precisions_are_never_compared() -> None:
    """bf16 and fp32 answers differ by more than any codec's tolerance: an honest bf16 peer among
    fp32 stage-mates must not be convicted, nor its microbatches redone."""
    g = torch.ones(4, 8)
    async with DataPlaneClient(timeout_s=2) as client:
        t, (half, b, c) = _checking_trainer(client)
        primary = Answer(half, 0, 1.01 * g, 1.0, "bf16")
        ruling = await t.judge(1, "backward", primary, answer(b, g), _arbiter(), REQUEST)
        assert ruling == Ruling(Finding.INCOMPARABLE) and not ruling.redo
        assert not t.stats.caught and t.stats.mismatches == 0 and t.ledger.gave_up(half, "backward")


# ---- liars in a real swarm ------------------------------------------------------------------------


def bounded_by_fraction(summary: TrainSummary, fraction: float) -> None:
    """Microbatches paired at random (not for a peer's first answers, nor to settle a mismatch) are
    a binomial sample of the attempts: within 4 sigma of the share."""
    v = summary.verify
    drawn = v["paired"] - v["first_checks"] - v["rechecks"]
    n = summary.microbatches_issued + summary.stale_redos + v["redone"]
    assert drawn <= n * fraction + 4 * math.sqrt(n * fraction * (1 - fraction)) + 1, v
    assert v["arbitrations"] <= v["mismatches"] <= v["checks"] + v["liars"]
    assert v["first_checks"] <= 48  # the first answers of six peers, a window (4) of microbatches at a time


async def test_liars_in_a_2x3_swarm_are_caught_reported_and_excluded_while_training_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    """One peer of stage 0 scales its activations, one of stage 1 returns wrong input gradients;
    two trainers spot-check half their calls. Both liars are caught after a few answers, every
    honest peer's ledger excludes them (two independent reports), the trainers stop routing to
    them, and the training finishes every step and every microbatch."""
    async with fast_swarm(SPEC, TRAINING, peers_per_stage=3) as daemons:
        stage0 = [d for d in daemons if d.stage == 0]
        stage1 = [d for d in daemons if d.stage == 1]
        liar0, liar1 = stage0[1], stage1[2]
        assert liar0.executor is not None and liar1.executor is not None
        make_liar(liar0.executor, "scale")
        make_liar(liar1.executor, "grad")
        api = f"http://{daemons[0].status()['api_addr']}"
        liars = {liar0.peer_id, liar1.peer_id}
        honest = [d for d in daemons if d.peer_id not in liars]
        caught: set[str] = set()
        # two trainers at a time until both liars were reported by two of them: each pair routes at random, so
        # a pair may not reach one liar at all. (The failures of 2026-12-01, 3 of 4 reports in every attempt,
        # were not chance: stage 0's founder stepped alone before it listed its mates, and the liar, stranded
        # at step 0 with an honest peer, answered only checks against another step: inconclusive.)
        for attempt in range(6):
            trainers = [Trainer(trainer_config(api, f"t{attempt}{k}", steps=3, seed=10 * attempt + k))
                        for k in range(2)]
            summaries = await asyncio.gather(*(t.run() for t in trainers))
            for summary in summaries:
                assert summary.steps >= 3 and summary.microbatches_issued == summary.microbatches_completed
                assert set(summary.verify["caught"]) <= liars, summary.verify  # no honest peer blamed
                bounded_by_fraction(summary, FRACTION)
                caught |= set(summary.verify["caught"])
            if all(set(d.status()["reports"]["excluded"]) == liars for d in honest):
                break
        assert caught == liars
        for d in honest:
            status = d.status()["reports"]
            assert set(status["excluded"]) == liars and status["exclusions"] == 2, status
        for liar_id in liars:  # a log line per catch and per exclusion, naming the peer and the evidence
            assert f"peer {liar_id[:12]} lied (its " in caplog.text
            assert f"peer {liar_id} excluded for 600s: reported by 2 independent checks" in caplog.text
        # bounded: each liar answered a handful of requests before it was caught
        served = []
        for liar in (liar0, liar1):
            assert liar.data_plane is not None
            served.append(dict(liar.data_plane.served))
            assert served[-1]["forward"] + served[-1]["backward"] <= 60, served[-1]
        await _the_report_endpoint_refuses_bad_input_and_counts_good_reports(honest[0])
        # a trainer that checks nothing itself learns the exclusions from the swarm and never routes to them
        late = Trainer(trainer_config(api, "late", steps=1, fraction=0.0, seed=7))
        summary = await late.run()
        assert summary.steps == 1 and summary.verify["checks"] == 0
        assert [dict(liar.data_plane.served) for liar in (liar0, liar1) if liar.data_plane] == served
        for router in late.routers:
            assert liars & {p.peer_id for p in router.snapshot()} <= router.excluded


async def _the_report_endpoint_refuses_bad_input_and_counts_good_reports(d: Daemon) -> None:
    """POST /v1/report on a daemon of the swarm: a sentence and a 4xx for bad input, never a 500;
    a good report counted (the ledger's rules themselves: tests/unit/test_reports.py)."""
    accused, other = "ab" * 20, "cd" * 20
    assert d.data_addr is not None
    async with DataPlaneClient(timeout_s=10) as client:
        for k in range(2):  # two reporters (loopback: two keys) exclude
            report = MisbehaviourReport.signed(Identity.generate(), accused=accused, stage=0, step=0, kind="forward",
                                               mb=1, request_digest="00" * 32,
                                               answers={accused: "11" * 32, other: "22" * 32}, at=time.time())
            result = await client.report(d.data_addr, ReportRequest(*report.encode()))
            progress = await client.progress(d.data_addr)
            if k == 0:  # one report: suspected (trainers check it more), not excluded
                assert result.accepted and not result.excluded
                assert accused in progress.suspected and accused not in progress.excluded
                assert accused in d.status()["reports"]["suspected"]
        assert result.accepted and result.excluded
        assert accused in progress.excluded and accused not in progress.suspected
        assert accused in set(d.reports.excluded()) and accused not in d.status()["reports"]["suspected"]
        with pytest.raises(PeerError) as refused:
            await client.report(d.data_addr, ReportRequest(report.encode()[0], bytes(64)))
        assert refused.value.status == 422 and "signature" in refused.value.message
        url = f"http://{d.data_addr}/v1/report"
        for body, status in [
            (b"\x00garbage", 400),
            (encode_frame("report", {"body": b"x", "sig": b"y"}, {}, "none"), 422),
            (encode_frame("report", {"body": 1}, {}, "none"), 422),
            (encode_frame("forward", {"stage": 0}, {}, "none"), 422),
            (b"x" * (20 * 2**10), 413),
        ]:
            async with client.session.post(url, data=body, headers={"Content-Type": CONTENT_TYPE}) as resp:
                assert resp.status == status, (body[:20], await resp.text())
                assert (await resp.json())["message"]


async def _train_with(lie: str | None, steps: int = 40) -> tuple[float, set[str], set[str], dict[int, list[int]]]:
    """Two checking trainers for ``steps`` steps on a fresh 2x3 swarm, with one lying peer (``lie``
    on stage 0 for the forward lies, on stage 1 for wrong input gradients); the held-out loss of
    the trained swarm, the liars caught, the liar's id, and each stage's peers' steps. The liar is excluded
    by every honest peer, after a bounded number of answers."""
    async with fast_swarm(SPEC, TRAINING, peers_per_stage=3) as daemons:
        liars: set[str] = set()
        liar: Daemon | None = None
        if lie is not None:
            liar = [d for d in daemons if d.stage == (1 if lie == "grad" else 0)][1]
            assert liar.executor is not None and liar.peer_id is not None
            make_liar(liar.executor, lie)
            liars.add(liar.peer_id)
        api = f"http://{daemons[0].status()['api_addr']}"
        summaries = await asyncio.gather(*(Trainer(trainer_config(api, f"t{k}", steps=steps, seed=k)).run()
                                           for k in range(2)))
        for summary in summaries:
            # two trainers: one of them may see one step more
            assert summary.steps >= steps and set(summary.verify["caught"]) <= liars
            bounded_by_fraction(summary, FRACTION)
        for d in daemons:
            if d is not liar:
                assert set(d.status()["reports"]["excluded"]) == liars, d.status()["reports"]
        if liar is not None and liar.data_plane is not None:
            served = liar.data_plane.served
            assert served["forward"] + served["backward"] <= 60, dict(served)
        # the held-out loss, measured by a trainer that routes around excluded peers and checks nothing,
        # on 64 windows of the held-out split
        final = await Trainer(replace(trainer_config(api, "val", steps=1, fraction=0.0, seed=99),
                                      val_batches=16)).run()
        assert final.val_loss is not None
        stage_steps: dict[int, list[int]] = {}
        for d in daemons:
            stage_steps.setdefault(d.stage, []).append(d.status()["step"])
        return final.val_loss, {p for s in summaries for p in s.verify["caught"]}, liars, stage_steps


_HONEST_LOSS: list[tuple[float, dict[int, list[int]]]] = []  # the honest run's held-out loss and stage steps, run once


# 40 steps and 64 held-out windows: at 20 steps and 8 windows honest runs alone spread 3.16-3.36, so a
# 5 % comparison of two runs failed by chance; at 40 steps five honest runs spread 2.894-2.929.
@pytest.mark.timeout(300)  # the first kind runs the honest swarm too (~20-30 s a run here)
# the suite's 10-minute budget: in the default run the gradient liar only (its unconfirmed answers once cost
# 6-9 %); the forward liars are caught in the default run by test_liars_in_a_2x3_swarm_... (scale) and
# tests/adversarial/test_liars_checks.py (sometimes, stale), their loss here with -m slow
@pytest.mark.parametrize("lie", [pytest.param("scale", marks=pytest.mark.slow),
                                 pytest.param("noise", marks=pytest.mark.slow), "grad"])
async def test_each_kind_of_liar_is_caught_and_excluded_and_the_loss_ends_within_5_percent_of_an_honest_run(
        lie: str) -> None:
    """Every trainer step done, the liar caught and excluded by every honest peer after a bounded
    number of answers (``_train_with``'s assertions), and the held-out loss within 5 % of an honest
    run's (a gradient liar's unconfirmed answers once cost 6-9 %: ``SpotChecks.check``)."""
    if not _HONEST_LOSS:
        honest, caught, _, honest_steps = await _train_with(None)
        assert not caught  # no false alarm on the honest swarm
        _HONEST_LOSS.append((honest, honest_steps))
    honest_loss, honest_steps = _HONEST_LOSS[0]
    loss, caught, liars, stage_steps = await _train_with(lie)
    assert caught == liars
    # (two CI runs of ~10 failed at 3.10-3.11 against ~2.92, not reproduced in 30 reruns: the stages' steps say
    # whether a stage stepped less than in the honest run)
    assert abs(loss - honest_loss) <= 0.05 * honest_loss, (loss, honest_loss, stage_steps, honest_steps)


async def test_the_sitecustomize_hook_makes_a_child_process_executor_lie(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/support/liars.py's SITECUSTOMIZE, as a child daemon would run it at start-up: with
    ``SWARMD_TEST_LIE=scale`` and ``SWARMD_TEST_LIE_STAGE=0`` every stage-0 executor built after it
    scales its outputs, other stages stay honest."""
    from swarmd.pipeline.stage import executor as executor_module
    from tests.support.liars import SITECUSTOMIZE

    spec = replace(PRESETS["tiny"], name="hook", d_model=32, d_ff=64, seq_len=8)
    honest = StageExecutor(spec, 0)
    monkeypatch.setenv("SWARMD_TEST_LIE", "scale")
    monkeypatch.setenv("SWARMD_TEST_LIE_STAGE", "0")
    init = executor_module.StageExecutor.__init__
    try:
        exec(compile(SITECUSTOMIZE, "sitecustomize.py", "exec"), {})
        liar, other = StageExecutor(spec, 0), StageExecutor(spec, 1)
    finally:
        executor_module.StageExecutor.__init__ = init  # type: ignore[method-assign]
    try:
        tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
        want, got = (await honest.forward(tokens)).outputs, (await liar.forward(tokens)).outputs
        assert torch.allclose(got, 1.5 * want)
        assert other._forward_sync.__func__ is StageExecutor._forward_sync  # type: ignore[attr-defined]
    finally:
        for ex in (honest, liar, other):
            await ex.close()
