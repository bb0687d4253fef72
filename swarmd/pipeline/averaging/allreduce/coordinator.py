"""The coordinator's side of a chunked all-reduce round (``swarmd.pipeline.averaging.allreduce.averager``).

O(n) control: members report their progress here (``report``, a long-poll held until the round
starts, ``hold_s`` passes, or a newer report of the same member supersedes it) instead of every
peer polling every other. The coordinator starts a round when the held reports at its step and
params digest, with its own samples, reach the target and every trusted stage-mate is accounted
for (it reported here, or a single ``GET /v1/progress`` shows it elsewhere or silent: a mate that
names another coordinator at this step means the views differ, and the round waits, as the
single leader's does), and its members are a quorum of the stage as listed
(``plan.quorum``; checked again before a commit). It then answers every held report
with the plan, collects the owners' "part ready" reports and decides, once: commit or abort
(``plan.decide``), signed.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from swarmd.pipeline.averaging.allreduce.messages import ArReport, ArReportReply
from swarmd.pipeline.averaging.allreduce.plan import Decision, Ready, RoundPlan, decide
from swarmd.tasks import wait_event

#: Reports of a member older than this no longer count it at a step (for "behind" answers).
REPORT_MEMORY_S = 5.0


@dataclass
class HeldReport:
    report: ArReport
    at: float
    answer: asyncio.Future[ArReportReply] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class CoordRound:
    plan: RoundPlan
    started: float
    readies: dict[int, Ready] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    decision: Decision | None = None
    signature: bytes | None = None
    decided: asyncio.Event = field(default_factory=asyncio.Event)


class Coordinator:
    """Reports held for the next round, and the rounds this peer coordinates (the last few)."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self.held: dict[str, HeldReport] = {}  # member -> its newest report (answered or not)
        self.wake = asyncio.Event()  # a report or a ready arrived
        self.rounds: dict[str, CoordRound] = {}

    # ---- reports ------------------------------------------------------------------------

    async def on_report(self, report: ArReport, reply_now: ArReportReply | None, hold_s: float) -> ArReportReply:
        """Hold ``report`` until the round starts or ``hold_s`` passes (``reply_now``: answer at once)."""
        old = self.held.get(report.peer_id)
        if old is not None and not old.answer.done():
            old.answer.set_result(ArReportReply("superseded", report.step))
        held = HeldReport(report, time.monotonic())
        self.held[report.peer_id] = held
        self.wake.set()
        if reply_now is not None:
            held.answer.set_result(reply_now)
            return reply_now
        try:
            await asyncio.wait_for(asyncio.shield(held.answer), hold_s)
        except asyncio.TimeoutError:
            pass
        finally:
            # Answered "wait" (or its request went away): no longer held, so never planned with. Left
            # pending, a round planned a moment later counted the member and answered nobody: it never
            # sent its parts, and every owner waited out the round's timeout before it aborted.
            if not held.answer.done():
                held.answer.set_result(ArReportReply("wait", report.step))
        return held.answer.result()

    def waiting(self, step: int, digest: str, now: float | None = None) -> dict[str, ArReport]:
        """Members whose report is held now (they will hear of a start) at ``step`` with ``digest``."""
        return {pid: h.report for pid, h in self.held.items()
                if not h.answer.done() and h.report.step == step and h.report.params_digest == digest
                and h.report.coordinator == self.peer_id}

    def recent_steps(self, now: float) -> dict[str, int]:
        """Each member's step by its latest report within REPORT_MEMORY_S."""
        return {pid: h.report.step for pid, h in self.held.items() if now - h.at <= REPORT_MEMORY_S}

    def answer_waiting(self, reply_for: dict[str, ArReportReply]) -> None:
        for pid, reply in reply_for.items():
            held = self.held.get(pid)
            if held is not None and not held.answer.done():
                held.answer.set_result(reply)

    def release_all(self, step: int, missing: int, members: int) -> None:
        """Answer every held report with "wait" (this peer no longer coordinates, or stepped)."""
        for held in self.held.values():
            if not held.answer.done():
                held.answer.set_result(ArReportReply("wait", step, missing, members))

    def forget(self, peer_ids: set[str]) -> None:
        for pid in peer_ids:
            held = self.held.pop(pid, None)
            if held is not None and not held.answer.done():
                held.answer.set_result(ArReportReply("refused", held.report.step, reason="excluded"))

    # ---- rounds -------------------------------------------------------------------------

    def open(self, plan: RoundPlan) -> CoordRound:
        rnd = CoordRound(plan, time.monotonic())
        self.rounds[plan.round_id] = rnd
        while len(self.rounds) > 8:
            self.rounds.pop(next(iter(self.rounds)))
        return rnd

    def on_ready(self, ready: Ready) -> str | None:
        """An owner's report; why it is turned away, if it is."""
        rnd = self.rounds.get(ready.round_id)
        if rnd is None:
            return "no such round here"
        if rnd.decision is not None:
            return "the round is decided"
        if ready.part >= len(rnd.plan.owners) or rnd.plan.owners[ready.part] != ready.owner:
            return "not the owner of that part"
        rnd.readies.setdefault(ready.part, ready)
        rnd.arrived.set()
        return None

    async def collect(self, rnd: CoordRound, wait_s: float) -> None:
        """Wait until every part reported (or one reported it cannot be reduced), at most ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while len(rnd.readies) < len(rnd.plan.owners) and not any(
                r.missing or r.refused for r in rnd.readies.values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            rnd.arrived.clear()
            if not await wait_event(rnd.arrived, remaining):
                return

    @staticmethod
    def decide(rnd: CoordRound, target: int) -> Decision:
        return decide(rnd.plan, rnd.readies, target)

    def settle(self, rnd: CoordRound, decision: Decision, signature: bytes | None) -> None:
        rnd.decision, rnd.signature = decision, signature
        rnd.decided.set()

    def abandon(self, sign: Callable[[Decision], bytes | None], why: str) -> list[Decision]:
        """Decide "abort" every round this peer coordinates and has not decided (it leaves the stage's
        rounds: a move, a stop), so that the members' long-polls for the decision get it now instead of
        waiting out ``T + reply_slack_s`` on a round nobody will decide; answer held reports "wait"."""
        out = []
        for rnd in self.rounds.values():
            if rnd.decision is None:
                plan = rnd.plan
                decision = Decision(plan.round_id, plan.stage, plan.step, "abort", 0, (), plan.coordinator, why)
                self.settle(rnd, decision, sign(decision))
                out.append(decision)
        for held in self.held.values():
            if not held.answer.done():
                held.answer.set_result(ArReportReply("wait", held.report.step, 0, 0))
        return out

    async def decision(self, round_id: str, wait_s: float) -> tuple[Decision, bytes | None] | None:
        rnd = self.rounds.get(round_id)
        if rnd is None:
            return None
        if not await wait_event(rnd.decided, wait_s):
            return None
        assert rnd.decision is not None  # set before ``decided``
        return rnd.decision, rnd.signature


def share_of_missing(missing: int, members: int) -> int:
    """How many more samples a member gathers before it reports again: its share of what the
    stage still misses (at least one), so the reports per round stay O(n), not O(samples)."""
    return max(1, math.ceil(missing / max(1, members)))
