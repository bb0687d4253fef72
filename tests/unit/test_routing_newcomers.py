"""Newcomers cost a trainer neither its polls nor its steps (issue #18, item 1).

The pure rules (``swarmd.pipeline.routing``: ``StageRouter(require_alive=True)`` and
:class:`NewcomerPolls`) with a fake clock, then :meth:`SwarmClient.progress` over real sockets:
an honest peer's answer comes back while a tarpit's poll is still out, and the tarpit's poll
ends in the background (told to ``on_late``) or is cancelled by ``aclose``.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from aiohttp import web

from swarmd.net.client import DataPlaneClient
from swarmd.net.messages import ProgressReply
from swarmd.pipeline.failures import timed_out
from swarmd.pipeline.routing import NewcomerPolls, StageRouter
from swarmd.train import swarm_client
from swarmd.train.swarm_client import PeerProgress, SwarmClient
from swarmd.train.timing import Timing
from tests.support.routing import listed


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def router(clock: Clock, **kwargs: object) -> StageRouter:
    return StageRouter(0, clock=clock, rng=random.Random(0), require_alive=True, **kwargs)  # type: ignore[arg-type]


# ---- require_alive ----------------------------------------------------------------------------


def test_an_unproven_peer_that_never_answered_a_poll_is_not_called_while_a_proven_one_is_usable() -> None:
    clock = Clock()
    r = router(clock)
    r.update_peers(listed({"a": "addr-a", "tarpit": "addr-t"}))
    r.report_success("a", 4, 0.1, "forward")
    picks = [r.choose() for _ in range(20)]
    assert all(p == ("a", "addr-a") for p in picks)
    assert not r.waiting_on_caps(exclude={"a"})  # the tarpit frees no slot: the trainer must not spin on it
    r.report_alive("tarpit")  # it answered a progress poll: now it may take its probation call
    r.begin("a")  # (a proven peer's call in flight does not count against probation)
    assert ("tarpit", "addr-t") in [r.choose() for _ in range(5)]


def test_a_failure_takes_aliveness_away_until_the_peer_answers_a_poll_again() -> None:
    clock = Clock()
    r = router(clock)
    r.update_peers(listed({"a": "addr-a", "b": "addr-b"}))
    r.report_success("a", 4, 0.1)
    r.report_alive("b")
    assert r.stats("b").alive
    r.report_failure("b", timeout=True)
    clock.now += 10_000.0  # the ban is long over
    assert not r.stats("b").alive
    assert {r.choose() for _ in range(10)} == {("a", "addr-a")}
    assert r.snapshot()[1].alive is False


def test_with_nobody_proven_or_alive_unproven_peers_are_still_tried() -> None:
    """A trainer's very first calls, or a stage whose proven peers are all banned: the old rule
    (one probation call each) holds, so a swarm of newcomers is usable at all."""
    clock = Clock()
    r = router(clock)
    r.update_peers(listed({"a": "addr-a", "b": "addr-b"}))
    assert r.choose() == ("a", "addr-a")
    r.begin("a")
    assert r.choose() == ("b", "addr-b")
    # a proven peer exists but is banned: newcomers are tried rather than nobody
    r.report_success("a", 4, 0.1)
    r.report_failure("a")
    assert r.choose() == ("b", "addr-b")


def test_without_require_alive_the_router_behaves_as_before() -> None:
    r = StageRouter(0, clock=Clock(), rng=random.Random(0))
    r.update_peers(listed({"a": "addr-a", "b": "addr-b"}))
    r.report_success("a", 4, 0.1)
    assert ("b", "addr-b") in {r.choose() for _ in range(4)}


# ---- NewcomerPolls ----------------------------------------------------------------------------


def test_a_poll_is_ready_once_trusted_peers_are_in_and_every_stage_answered_or_has_nobody_left() -> None:
    assert not NewcomerPolls.ready(1, [True, True], [0, 0])  # a trusted peer's poll is still out
    assert NewcomerPolls.ready(0, [True, True], [5, 3])  # newcomers pending, but every stage answered
    assert not NewcomerPolls.ready(0, [True, False], [5, 3])  # stage 1 has no answer yet and newcomers to hear
    assert NewcomerPolls.ready(0, [True, False], [5, 0])  # stage 1: nobody left to hear from
    assert NewcomerPolls.ready(0, [], [])


def test_grace_follows_how_long_the_poll_took_within_floor_and_ceiling() -> None:
    polls = NewcomerPolls(factor=2.0, floor_s=0.1, ceiling_s=1.0, clock=Clock())
    assert polls.grace_s(0.0) == 0.1
    assert polls.grace_s(0.3) == pytest.approx(0.6)
    assert polls.grace_s(5.0) == 1.0
    assert polls.grace_s(-1.0) == 0.1


def test_the_probe_budget_refills_at_its_rate_up_to_its_burst() -> None:
    clock = Clock()
    polls = NewcomerPolls(rate=10.0, burst=5, clock=clock)
    assert polls.take(3) == 3
    assert polls.take(3) == 2  # the burst is spent
    assert polls.take(1) == 0
    clock.now += 0.25  # 2.5 tokens
    assert polls.take(10) == 2
    clock.now += 100.0
    assert polls.take(100) == 5  # never more than the burst at once
    assert polls.take(0) == 0


@pytest.mark.parametrize("kwargs", [{"factor": -1.0}, {"floor_s": 2.0, "ceiling_s": 1.0}, {"rate": 0.0},
                                    {"burst": 0}])
def test_bad_newcomer_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        NewcomerPolls(**kwargs)  # type: ignore[arg-type]


# ---- SwarmClient.progress over real sockets ----------------------------------------------------


class Peers:
    """One honest ``/v1/progress`` and one tarpit (accepts, never answers) on loopback."""

    def __init__(self) -> None:
        self.tarpit_polls = 0
        self._runner: web.AppRunner | None = None
        self.honest = self.tarpit = ""

    async def __aenter__(self) -> Peers:
        app = web.Application()

        async def progress(request: web.Request) -> web.Response:
            return web.json_response(ProgressReply(stage=0, step=7, samples=3).to_json())

        async def tarpit(request: web.Request) -> web.Response:
            self.tarpit_polls += 1
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        app.router.add_get("/v1/progress", progress)
        pit = web.Application()
        pit.router.add_get("/v1/progress", tarpit)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        self._pit = web.AppRunner(pit, shutdown_timeout=0.1, handler_cancellation=True)
        addrs = []
        for runner in (self._runner, self._pit):
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
            addrs.append(f"{host}:{port}")
        self.honest, self.tarpit = addrs
        return self

    async def __aexit__(self, *exc: object) -> None:
        for runner in (self._runner, self._pit):
            if runner is not None:
                await runner.cleanup()


async def test_a_tarpit_newcomer_is_left_out_of_the_poll_and_reported_when_its_poll_ends() -> None:
    late: list[tuple[int, PeerProgress]] = []
    async with Peers() as peers, aiohttp.ClientSession() as http, DataPlaneClient(timeout_s=5.0) as data:
        client = SwarmClient("http://127.0.0.1:1", http=http, data=data,
                             timing=Timing(probation_progress_timeout_s=0.5))
        stages = [[("honest", peers.honest), ("pit", peers.tarpit)]]
        polled = await client.progress(stages, probation={"honest", "pit"},
                                       on_late=lambda k, a: late.append((k, a)))
        assert [(p.peer_id, p.step, p.samples) for p in polled[0]] == [("honest", 7, 3)]
        assert late == [] and client.newcomer_stats == {"probed": 2, "left_running": 1, "over_budget": 0}
        # while its poll is out the tarpit is not polled again; the honest peer is, as a trusted one
        again = await client.progress(stages, probation={"honest", "pit"}, on_late=lambda k, a: late.append((k, a)))
        assert [p.peer_id for p in again[0]] == ["honest"] and peers.tarpit_polls == 1
        for _ in range(200):  # its poll times out (0.5 s) in the background and on_late hears of it
            if late:
                break
            await asyncio.sleep(0.02)
        assert [(k, a.peer_id, a.step) for k, a in late] == [(0, "pit", None)]
        assert late[0][1].error is not None and timed_out(late[0][1].error)
        await client.aclose()


async def test_a_peer_that_answers_for_another_stage_has_no_step_of_the_one_it_was_polled_for() -> None:
    """It moved (a migration the listing has not caught up with): its step there is no step here, and a
    spot check holding a reply's step to its peer's poll must not read it (``SpotChecks._plausible``)."""
    async with Peers() as peers, aiohttp.ClientSession() as http, DataPlaneClient(timeout_s=5.0) as data:
        client = SwarmClient("http://127.0.0.1:1", http=http, data=data)
        polled = await client.progress([[], [("honest", peers.honest)]])  # it answers as a stage-0 peer
        assert polled == [[], [PeerProgress("honest", None)]]
        await client.aclose()


async def test_aclose_cancels_newcomers_polls_still_out() -> None:
    async with Peers() as peers, aiohttp.ClientSession() as http, DataPlaneClient(timeout_s=5.0) as data:
        client = SwarmClient("http://127.0.0.1:1", http=http, data=data)
        late: list[tuple[int, PeerProgress]] = []
        polled = await client.progress([[("pit", peers.tarpit), ("honest", peers.honest)], []],
                                       on_late=lambda k, a: late.append((k, a)))
        assert polled == [[PeerProgress("honest", 7, 3)], []]
        await client.aclose()
        assert late == [] and client.newcomer_stats["left_running"] == 1
        assert not client._late  # noqa: SLF001 - nothing left running


async def test_the_reported_rate_spans_a_window_not_the_time_since_the_last_heartbeat() -> None:
    """A final report right after a heartbeat used to say 0 samples/s; a stalled trainer's rate
    falls to 0 once it has seen no step for the window."""
    clock = [100.0]
    async with aiohttp.ClientSession() as http, DataPlaneClient(timeout_s=5.0) as data:
        client = SwarmClient("http://127.0.0.1:1", http=http, data=data, clock=lambda: clock[0])
        assert client.samples_per_s() == 0.0
        for step in range(1, 11):  # 32 samples a second for 10 s
            clock[0] += 1.0
            client.observe_step(step, 5.0, 32 * step)
        assert client._report()["samples_per_s"] == pytest.approx(32.0)
        assert client._report()["samples_per_s"] == pytest.approx(32.0)  # a second report at once: the same
        clock[0] += swarm_client.RATE_WINDOW_S + 1  # stalled for longer than the window
        assert client.samples_per_s() == 0.0
        assert len(client._seen) == 1  # the window keeps what it needs, not every step ever seen
