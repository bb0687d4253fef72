"""A sync step's wait, decided from one progress poll (swarmd.train.sync_steps.assess): who is still
waited for, how short a stage is, whether it is stuck, and whom not to wait for any more; and the next
batch's calls, each held at its stage's gate until that stage took the step (StageGates)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from swarmd.pipeline.routing import StageRouter
from swarmd.pipeline.spec import TrainingSpec
from swarmd.train.config import TrainerConfig
from swarmd.train.summary import TrainSummary
from swarmd.train.swarm_client import PeerProgress, TrainerError
from swarmd.train.sync_steps import LeftBehind, Standing, SyncSteps, assess

TARGET = 12


def p(peer_id: str, step: int | None, samples: int = 0, *, averaging: bool = False,
      excluded: tuple[str, ...] = (), digest: str = "d") -> PeerProgress:
    return PeerProgress(peer_id, step, samples, averaging, excluded=excluded, params_digest=digest)


def test_every_peer_at_the_step_is_nothing_to_wait_for() -> None:
    standing = assess([[p("a", 1), p("b", 2)], [p("c", 1)]], 1, TARGET, LeftBehind(30.0), now=0.0)
    assert standing == Standing(lagging=(), missing=0, stuck=False, refused=False)


def test_a_silent_peer_is_waited_for_and_a_short_stage_says_how_short() -> None:
    standing = assess([[p("a", 1)], [p("b", 0, 4), p("c", None)]], 1, TARGET, LeftBehind(30.0), now=0.0)
    assert standing.lagging == ((1, "b", 0), (1, "c", None))
    assert standing.missing == TARGET - 4 and not standing.stuck and not standing.refused


def test_a_stage_that_holds_the_batch_without_stepping_is_stuck_and_one_averaging_is_neither() -> None:
    stuck = assess([[p("a", 0, 8), p("b", 0, 4)]], 1, TARGET, LeftBehind(30.0), now=0.0)
    assert stuck.stuck and stuck.missing == 0
    busy = assess([[p("a", 0, 8, averaging=True), p("b", 0, 4)]], 1, TARGET, LeftBehind(30.0), now=0.0)
    assert not busy.stuck and busy.missing == 0 and len(busy.lagging) == 2


def test_a_distrusted_peer_counts_neither_its_samples_nor_its_step() -> None:
    # its leader refused z's poisoned work: z's 4 samples are not the stage's, and it is not waited for
    polled = [[p("a", 0, 4, excluded=("z",)), p("b", 0, 4), p("z", 0, 4)]]
    standing = assess(polled, 1, TARGET, LeftBehind(30.0), now=0.0)
    assert standing.missing == TARGET - 8 and standing.refused
    assert [peer for _, peer, _ in standing.lagging] == ["a", "b"]
    # a refused leader that stepped alone on its own lie (a fork) does not make the stage look stepped
    forked = [[p("L", 1, digest="x"), p("a", 0, 4, excluded=("L",)), p("b", 0, 4, excluded=("L",))]]
    assert assess(forked, 1, TARGET, LeftBehind(30.0), now=0.0).missing == TARGET - 8


def test_a_peer_most_of_its_stage_left_behind_is_waited_for_only_a_grace() -> None:
    left = LeftBehind(grace_s=30.0)
    polled = [[p("a", 1), p("b", 1), p("z", 0)]]
    assert assess(polled, 1, TARGET, left, now=100.0).lagging == ((0, "z", 0),)
    assert assess(polled, 1, TARGET, left, now=130.0).lagging == ((0, "z", 0),)  # the grace is not over
    assert assess(polled, 1, TARGET, left, now=130.5).lagging == ()
    assert left.late(130.5) == ["z"] and left.late(120.0) == []
    # half of a stage behind is no majority past it: both waited for, however long
    even = LeftBehind(grace_s=30.0)
    half = [[p("a", 1), p("z", 0)]]
    assert assess(half, 1, TARGET, even, now=0.0).lagging == assess(half, 1, TARGET, even, now=1e6).lagging


# ---- the next batch, gated per stage (swarmd.train.sync_steps.StageGates) ------------------------------


class _Swarm:
    """Two stages of one peer each as a sync trainer sees them (its view and its microbatch runner: the
    fakes below say how they answer polls and run microbatches); no spot checks."""

    def __init__(self) -> None:
        self.routers = [StageRouter(0), StageRouter(1)]
        self.log: list[tuple[Any, ...]] = []
        self.batch = 0

    async def refresh(self, force: bool = False) -> None:
        return None

    async def swarm_step(self) -> int:
        return 0

    def pairs(self) -> bool:
        return False

    @staticmethod
    def told(stages: list[list[PeerProgress]], on_stage: Any) -> list[list[PeerProgress]]:
        """A poll's answers, each stage's told to ``on_stage`` first."""
        if on_stage is not None:
            for k, answers in enumerate(stages):
                on_stage(k, answers)
        return stages

    async def through_gates(self, gates: Any) -> int:
        """A new microbatch (its number) past each stage's gate in turn, logged at each."""
        self.batch += 1
        batch = self.batch
        for stage in (0, 1):
            if gates is not None:
                await gates.wait(stage)
            self.log.append((f"stage {stage}", batch))
        return batch


class _TwoStages(_Swarm):
    """Two stages as a sync trainer's polls see them: stage 0 takes every step at once, stage 1 only once
    ``release`` is set (its poll answers then); each microbatch logs when it passed each stage's gate."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def poll(self, wait_step: int | None = None, on_stage: Any = None,
                   refresh: bool = True) -> list[list[PeerProgress]]:
        step = wait_step or 0
        self.log.append(("poll", step))
        first = [p("a", step)]
        if on_stage is not None:
            on_stage(0, first)
        await self.release.wait()
        second = [p("b", step)]
        if on_stage is not None:
            on_stage(1, second)
        return [first, second]

    async def run(self, x: torch.Tensor, y: torch.Tensor, *, on_forward: Any = None, paired: Any = None,
                  gates: Any = None, on_last_stage: Any = None) -> None:
        batch = await self.through_gates(gates)
        if on_last_stage is not None:
            on_last_stage()
        await asyncio.sleep(0.02)  # the first stage's backward, after the last stage's
        self.log.append(("drained", batch))
        if on_forward is not None:
            on_forward()


class _Sampler:
    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(n, 4, dtype=torch.long), torch.zeros(n, 4, dtype=torch.long)


def _steps(stages: _TwoStages, done: list[int], *, steps: int = 2,
           calls_on_step: Any = None) -> SyncSteps:
    config = TrainerConfig(api="http://127.0.0.1:9", steps=steps, sync=True, batch_size=4, microbatch_size=4,
                           window=1, taper=False, val_every=0)

    async def on_step(step: int, n: int) -> None:
        done.append(step)

    return SyncSteps(config, TrainingSpec(target_batch_size=4), view=stages, microbatches=stages,
                     summary=TrainSummary(), on_step=on_step, calls_on_step=calls_on_step)


async def _until(condition: Any) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_the_next_batch_starts_on_a_stage_that_stepped_while_a_later_stage_is_still_waited_for() -> None:
    stages, done = _TwoStages(), []
    run = asyncio.create_task(_steps(stages, done).run(_Sampler()))
    try:
        await _until(lambda: ("stage 0", 2) in stages.log)  # the second batch began on stage 0 ...
        await asyncio.sleep(0.05)
        assert ("stage 1", 2) not in stages.log and done == []  # ... not on stage 1, still at step 0
        stages.release.set()
        await asyncio.wait_for(run, 5)
    finally:
        run.cancel()
    # the wait for step 1 polled once the last stage had the whole batch, while the first still drained it
    assert stages.log == [("stage 0", 1), ("stage 1", 1), ("poll", 1), ("drained", 1), ("stage 0", 2),
                          ("stage 1", 2), ("poll", 2), ("drained", 2)]
    assert done == [0, 1]  # each step closed once every stage took it, in order


async def test_a_step_whose_end_calls_the_stages_is_waited_for_whole_before_the_next_batch() -> None:
    stages, done = _TwoStages(), []
    run = asyncio.create_task(_steps(stages, done, calls_on_step=lambda n: n == 1).run(_Sampler()))
    try:
        await asyncio.sleep(0.1)
        # a validation pass after step 0: nothing of step 1 before the whole swarm took step 0
        assert [e for e in stages.log if e[0].startswith("stage")] == [("stage 0", 1), ("stage 1", 1)]
        stages.release.set()
        await asyncio.wait_for(run, 5)
    finally:
        run.cancel()
    assert done == [0, 1] and ("stage 1", 2) in stages.log


async def test_a_wait_that_fails_ends_the_next_batch_too() -> None:
    stages, done = _TwoStages(), []

    async def failing(wait_step: int | None = None, on_stage: Any = None,
                      refresh: bool = True) -> list[list[PeerProgress]]:
        on_stage(0, [p("a", wait_step or 0)])
        await asyncio.sleep(0.05)
        raise TrainerError("stages did not reach step 1 in time")

    stages.poll = failing  # type: ignore[method-assign]
    with pytest.raises(TrainerError, match="did not reach step 1"):
        await asyncio.wait_for(_steps(stages, done, steps=3).run(_Sampler()), 5)
    assert ("stage 1", 2) not in stages.log and done == []
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not any("swarmd-trainer-wait" in t.get_name() for t in others)  # nothing left running


class _FirstStageDrains(_Swarm):
    """Two stages: the last answers a microbatch at once, the first drains it for 0.2 s after and takes the
    step halfway through (as a first stage steps on its last backward, before the trainer hears the answer);
    polls answer at once (no long-poll), logged with whether they re-read the stage map."""

    def __init__(self) -> None:
        super().__init__()
        self.first_at = 0  # the step stage 0 has taken

    async def poll(self, wait_step: int | None = None, on_stage: Any = None,
                   refresh: bool = True) -> list[list[PeerProgress]]:
        step = wait_step or 0
        self.log.append(("poll", step, refresh))
        return self.told([[p("a", self.first_at)], [p("b", step)]], on_stage)

    async def run(self, x: torch.Tensor, y: torch.Tensor, *, on_forward: Any = None, paired: Any = None,
                  gates: Any = None, on_last_stage: Any = None) -> None:
        batch = await self.through_gates(gates)
        on_last_stage()
        await asyncio.sleep(0.1)
        self.first_at = batch  # its last backward: stage 0 steps ...
        await asyncio.sleep(0.1)  # ... and its answer is on the way back
        self.log.append(("drained", batch))
        if on_forward is not None:
            on_forward()


async def test_the_early_wait_polls_until_the_batch_is_sent_and_leaves_the_stage_map_alone() -> None:
    stages, done = _FirstStageDrains(), []
    await asyncio.wait_for(_steps(stages, done).run(_Sampler()), 5)  # type: ignore[arg-type]
    assert done == [0, 1]
    # while stage 0 drained the batch, the wait polled on and found it stepped: the next batch's first call went
    # out as the batch was sent, without a poll after it
    first = stages.log.index(("drained", 1))
    assert stages.log[first + 1] == ("stage 0", 2)
    assert sum(1 for e in stages.log[:first] if e[:2] == ("poll", 1)) >= 2
    # none of those polls re-read the stage map (a DHT read behind the control plane, on the step's path)
    assert [e for e in stages.log if e[0] == "poll" and e[2]] == []


class _Overlapping(_Swarm):
    """Stages that take every step at once; each microbatch takes 0.05 s more than the one before (a batch's
    microbatches end one after another), and logs when it began and ended."""

    async def poll(self, wait_step: int | None = None, on_stage: Any = None,
                   refresh: bool = True) -> list[list[PeerProgress]]:
        return self.told([[p("a", wait_step or 0)], [p("b", wait_step or 0)]], on_stage)

    async def run(self, x: torch.Tensor, y: torch.Tensor, *, on_forward: Any = None, paired: Any = None,
                  gates: Any = None, on_last_stage: Any = None) -> None:
        calls = sum(1 for e in self.log if e[0] == "begin")
        batch, index = 1 + calls // 3, calls % 3  # three microbatches a batch, in order
        self.log.append(("begin", batch, index))
        if on_forward is not None:
            on_forward()
        await asyncio.sleep(0.05 * (index + 1))
        on_last_stage()
        self.log.append(("end", batch, index))


async def test_the_next_batch_begins_once_all_but_the_last_microbatch_of_this_one_went_through() -> None:
    stages = _Overlapping()
    config = TrainerConfig(api="http://127.0.0.1:9", steps=2, sync=True, batch_size=12, microbatch_size=4,
                           window=4, taper=False, val_every=0)
    done: list[int] = []

    async def on_step(step: int, n: int) -> None:
        done.append(step)

    steps = SyncSteps(config, TrainingSpec(target_batch_size=12), view=stages, microbatches=stages,
                      summary=TrainSummary(), on_step=on_step)
    await asyncio.wait_for(steps.run(_Sampler()), 5)  # type: ignore[arg-type]
    # (its calls still wait at the gates of the step before, and peer to peer its first stage waits for the step)
    second = stages.log.index(("begin", 2, 0))
    assert ("end", 1, 1) in stages.log[:second] and stages.log.index(("end", 1, 2)) > second
    assert done == [0, 1]
