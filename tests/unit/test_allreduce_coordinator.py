"""The all-reduce coordinator's held reports (``swarmd.pipeline.averaging.allreduce.coordinator``): a member is
planned with only while its report is held, so that it hears of the round it is counted in."""

from __future__ import annotations

import asyncio

from swarmd.pipeline.averaging.allreduce.coordinator import Coordinator
from swarmd.pipeline.averaging.allreduce.messages import ArReport, ArReportReply


def report(peer: str, step: int = 3, samples: int = 8) -> ArReport:
    return ArReport(stage=0, peer_id=peer, step=step, samples=samples, params_digest="d", coordinator="c", wait_s=0.05)


async def test_a_report_answered_wait_is_no_longer_held_and_a_later_plan_skips_it() -> None:
    coord = Coordinator("c")
    answered = await coord.on_report(report("m1"), None, hold_s=0.05)
    assert answered.status == "wait"
    # the member has its "wait" and will report again: a round planned now must not count it (it was
    # counted, and its "start" went to nobody: the member never sent its parts and the round timed out)
    assert coord.waiting(3, "d") == {}
    coord.answer_waiting({"m1": ArReportReply("start", 3, 0, 2, None)})
    assert coord.held["m1"].answer.result().status == "wait"


async def test_a_held_report_hears_the_start_and_a_cancelled_one_is_not_held() -> None:
    coord = Coordinator("c")
    held = asyncio.create_task(coord.on_report(report("m1"), None, hold_s=30))
    gone = asyncio.create_task(coord.on_report(report("m2"), None, hold_s=30))
    await asyncio.sleep(0.01)
    assert set(coord.waiting(3, "d")) == {"m1", "m2"}
    gone.cancel()  # its request went away (the member gave up, or its connection broke)
    await asyncio.gather(gone, return_exceptions=True)
    assert set(coord.waiting(3, "d")) == {"m1"}
    coord.answer_waiting({"m1": ArReportReply("start", 3, 0, 2, None)})
    assert (await held).status == "start"


async def test_a_newer_report_supersedes_the_held_one() -> None:
    coord = Coordinator("c")
    first = asyncio.create_task(coord.on_report(report("m1", samples=4), None, hold_s=30))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(coord.on_report(report("m1", samples=8), None, hold_s=30))
    assert (await first).status == "superseded"
    assert coord.waiting(3, "d")["m1"].samples == 8
    coord.release_all(3, 0, 1)
    assert (await second).status == "wait"
