"""The trainer's scheduling: pacing in asynchronous mode, backwards routed to the forward's peer;
its events and its strict-JSON summary."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter

import pytest
import torch

from swarmd.pipeline.partition import tapered_sizes
from swarmd.pipeline.routing import StageRouter
from swarmd.train.data import BatchSampler
from swarmd.train.events import CallDone, StepDone, StepWait, TrainerEvent
from swarmd.train.swarm_client import PeerProgress
from swarmd.train.sync_steps import SyncSteps
from swarmd.train.trainer import Trainer, TrainerConfig, TrainSummary, split_batch
from tests.support.routing import listed
from tests.support.swarms import CORPUS_BYTES, MICRO, TINY, TRAINING, swarm


@pytest.mark.parametrize(("batch", "micro", "plain", "tapered"), [
    (32, 8, [8, 8, 8, 8], [4, 8, 8, 8, 4]),
    (16, 4, [4, 4, 4, 4], [2, 4, 4, 4, 2]),
    (33, 8, [8, 8, 8, 8, 1], [4, 8, 8, 8, 5]),
    (36, 8, [8, 8, 8, 8, 4], [4, 8, 8, 8, 4, 4]),
    (16, 8, [8, 8], [4, 8, 4]),
    (9, 8, [8, 1], [4, 5]),
    (8, 8, [8], [8]),
    (5, 8, [5], [5]),
    (3, 1, [1, 1, 1], [1, 1, 1]),
])
def test_split_batch(batch: int, micro: int, plain: list[int], tapered: list[int]) -> None:
    assert split_batch(batch, micro) == plain
    assert split_batch(batch, micro, taper=True) == tapered


def test_a_tapered_split_draws_the_same_samples() -> None:
    data = torch.randint(0, 256, (50_000,), generator=torch.Generator().manual_seed(0))
    a, b = BatchSampler(data, 64, seed=3), BatchSampler(data, 64, seed=3)
    plain = torch.cat([a.sample(n)[0] for n in split_batch(32, 8)])
    tapered = torch.cat([b.sample(n)[0] for n in split_batch(32, 8, taper=True)])
    assert torch.equal(plain, tapered)


class _Quiet:
    """The stages as a sync step sees them, without a swarm: at step 0, every step taken at once."""

    def __init__(self) -> None:
        self.routers = [StageRouter(k) for k in range(TINY.n_stages)]

    async def refresh(self, force: bool = False) -> None:
        return None

    async def poll(self, wait_step: int | None = None, on_stage=None, refresh=True) -> list[list[PeerProgress]]:
        return [[] for _ in self.routers]  # nobody to wait for

    async def swarm_step(self) -> int:
        return 0


async def test_a_sync_step_starts_with_its_first_microbatch_alone() -> None:
    events: list[tuple] = []

    class Microbatches:
        def pairs(self) -> bool:
            return False  # no spot checks here

        async def run(self, x: torch.Tensor, y: torch.Tensor, *, on_forward=None, paired=None, gates=None,
                  on_last_stage=None) -> None:
            events.append(("start", x.shape[0], on_forward is not None))
            await asyncio.sleep(0.01)
            if on_forward is not None:
                events.append(("first forward back",))
                on_forward()
            await asyncio.sleep(0.01)

    async def nothing(*args: object) -> None:
        return None

    view = _Quiet()
    config = TrainerConfig(api="http://unused", steps=2, sync=True, microbatch_size=4, window=4, val_every=0)
    steps = SyncSteps(config, TRAINING, view=view, microbatches=Microbatches(), summary=TrainSummary(),
                      on_step=nothing)
    data = torch.randint(0, 256, (10_000,), generator=torch.Generator().manual_seed(0))
    await steps.run(BatchSampler(data, TINY.seq_len, seed=0))
    assert len(events) == 2 * 10  # nothing measured: the halved taper (2 4 4 4 2), the first one leading
    for step in (events[:10], events[10:]):
        assert step[:2] == [("start", 2, True), ("first forward back",)]
        assert sorted(e[1] for e in step[2:] if e[0] == "start") == [2, 4, 4, 4]
    # measured latencies worth a quarter ramp (1 2 3 4 3 2 1 here): each waits for the one before's forward
    events.clear()
    for k, router in enumerate(view.routers):
        router.update_peers(listed({f"peer{k}": f"127.0.0.1:{4000 + k}"}, stage=k))
        router.report_success(f"peer{k}", 4, 4 * 0.03, "backward")
    await steps.run(BatchSampler(data, TINY.seq_len, seed=0))
    one_step = [event for size in (1, 2, 3, 4, 3, 2, 1) for event in (("start", size, True), ("first forward back",))]
    assert events == one_step * 2


async def test_async_trainer_paces_itself_so_few_microbatches_are_redone() -> None:
    # without pacing, a window of 8 microbatches of 4 against a target batch of 16 straddled
    # nearly every step: whatever was in flight when stage 0 stepped was refused and redone
    async with swarm(TINY, TRAINING, peers_per_stage=1) as daemons:
        run = TrainerConfig(api=f"http://{daemons[0].status()['api_addr']}", steps=6, codec="none",
                            microbatch_size=MICRO, window=8, val_every=0, max_corpus_bytes=CORPUS_BYTES)
        summary = await Trainer(run).run()
        stale = sum(d.executor.stale_dropped for d in daemons)
    assert summary.steps == 6 and summary.microbatches_issued == summary.microbatches_completed
    assert summary.step_losses[-1] < summary.step_losses[0]
    assert summary.stale_redos <= 1 and stale <= 1, (summary.stale_redos, stale)
    json.dumps(summary.to_json(), allow_nan=False)


async def test_backwards_go_to_the_peer_that_ran_the_forward() -> None:
    async with swarm(TINY, TRAINING, peers_per_stage=2) as daemons:
        run = TrainerConfig(api=f"http://{daemons[0].status()['api_addr']}", steps=3, sync=True, codec="none",
                            microbatch_size=MICRO, window=4, val_every=0, max_corpus_bytes=CORPUS_BYTES,
                            verify_fraction=0.0)  # a paired check's pair would hit the cache too
        summary = await Trainer(run).run()
        stage0 = [d.executor.cache_stats() for d in daemons if d.stage == 0]
        served = [d.executor.forward_ema.count for d in daemons if d.stage == 0]
    assert summary.retries == 0 and summary.stale_redos == 0
    assert sum(c["hits"] for c in stage0) == summary.microbatches_completed  # every backward reused its graph
    assert sum(c["misses"] for c in stage0) == 0
    assert all(n > 0 for n in served)  # both peers of the stage served forwards: affinity did not pin one
    assert all(c["entries"] == 0 and c["bytes"] == 0 for c in stage0)


def test_the_json_summary_is_strict_json() -> None:
    """An undefined loss (NaN: a step none of this trainer's samples were computed at) or an
    infinite one is None in the summary, so strict parsers (and json.dumps(allow_nan=False)) take it."""
    summary = TrainSummary(steps=3, first_loss=5.0, final_loss=math.inf, val_loss=math.nan,
                           step_losses=[5.0, math.nan, 4.0], val_losses=[(3, math.nan)])
    with pytest.raises(ValueError):
        json.dumps(summary.__dict__, allow_nan=False)  # what the summary holds in memory
    body = json.loads(json.dumps(summary.to_json(), allow_nan=False))
    assert body["step_losses"] == [5.0, None, 4.0] and body["final_loss"] is None and body["val_loss"] is None
    assert body["val_losses"] == [[3, None]] and body["first_loss"] == 5.0 and body["steps"] == 3


async def test_a_step_without_samples_has_no_loss_in_events_and_json() -> None:
    events: list[TrainerEvent] = []
    steps: list[tuple[int, float]] = []
    trainer = Trainer(TrainerConfig(api="http://unused", val_every=0), events=events.append,
                      on_step=lambda done, loss, info: steps.append((done, loss)))
    await trainer._finish_step(0, 1)
    assert [type(e) for e in events] == [StepDone]
    done = events[0]
    assert isinstance(done, StepDone) and done.done == 1 and done.step == 0 and done.loss is None
    assert steps[0][0] == 1 and math.isnan(steps[0][1])  # on_step keeps its float (NaN) signature
    json.dumps(trainer.summary.to_json(), allow_nan=False)


async def test_the_trainer_reports_its_calls_and_steps_as_events() -> None:
    """What scripts/bench_pipeline.py observes: every call to a stage, every wait for a step and
    every step, in order, from a real sync run through a real swarm."""
    events: list[TrainerEvent] = []
    async with swarm(TINY, TRAINING, peers_per_stage=1) as daemons:
        run = TrainerConfig(api=f"http://{daemons[0].status()['api_addr']}", steps=2, sync=True, codec="none",
                            microbatch_size=MICRO, window=4, val_every=0, val_batches=1,
                            max_corpus_bytes=CORPUS_BYTES)
        summary = await Trainer(run, events=events.append).run()
    assert summary.steps == 2 and summary.stale_redos == 0 and summary.retries == 0
    calls = [e for e in events if isinstance(e, CallDone)]
    kinds = Counter((e.stage, e.kind) for e in calls)
    n = summary.microbatches_completed
    # each microbatch: stage 0 forward, stage 1 fused forward + backward, stage 0 backward;
    # then the final validation: one forward per stage
    assert kinds == {(0, "forward"): n + 1, (1, "backward"): n, (0, "backward"): n, (1, "forward"): 1}, kinds
    assert sum(e.samples for e in calls if e.kind == "backward" and e.stage == 1) == summary.samples
    assert all(e.started <= e.ended and e.attempts == 1 for e in calls)
    phases = [e for e in events if not isinstance(e, CallDone)]
    assert [type(e) for e in phases] == [StepWait, StepDone, StepWait, StepDone]
    assert [e.step for e in phases if isinstance(e, StepWait)] == [1, 2]
    dones = [e for e in phases if isinstance(e, StepDone)]
    assert [e.done for e in dones] == [1, 2] and all(e.loss is not None for e in dones)
    assert dones[-1].progress["samples"] == summary.samples
    json.dumps(summary.to_json(), allow_nan=False)


def _in_flight_per_batch(events: list[TrainerEvent], batch_size: int) -> list[int]:
    """The most microbatches of each batch in flight at once: from a first forward's start to its stage-0
    backward's end. A batch's calls are told apart by their samples, not by the steps' events: the next
    batch starts while the step before is still taken, so its calls come before that step's StepDone."""
    calls = [e for e in events if isinstance(e, CallDone) and e.stage == 0]
    forwards = sorted((e for e in calls if e.kind == "forward"), key=lambda e: e.started)
    backwards = sorted((e for e in calls if e.kind == "backward"), key=lambda e: e.ended)

    def batches(done: list[CallDone]) -> list[list[CallDone]]:
        out: list[list[CallDone]] = [[]]
        for call in done:
            if sum(c.samples for c in out[-1]) == batch_size:
                out.append([])
            out[-1].append(call)
        return out

    most_per_batch = []
    for starts, ends in zip(batches(forwards), batches(backwards), strict=True):
        assert sum(c.samples for c in starts) == sum(c.samples for c in ends) == batch_size
        edges = sorted([(e.started, 1) for e in starts] + [(e.ended, -1) for e in ends])
        most = now = 0
        for _, change in edges:
            now += change
            most = max(most, now)
        most_per_batch.append(most)
    return most_per_batch


async def test_the_auto_window_is_sized_from_measurements_and_bounds_what_is_in_flight() -> None:
    """``--window auto`` (the default): once every stage was measured (calls and progress polls) the
    window is swarmd.train.window's, between 2 and the step's microbatches, and the last step never had
    more in flight; ``--window N`` is kept as given, with the estimate still reported."""
    async with swarm(TINY, TRAINING, peers_per_stage=1) as daemons:
        api = f"http://{daemons[0].status()['api_addr']}"
        runs = []
        for window in (None, 3):
            events: list[TrainerEvent] = []
            run = TrainerConfig(api=api, steps=3, sync=True, codec="none", microbatch_size=2, window=window,
                                val_every=0, max_corpus_bytes=CORPUS_BYTES, verify_fraction=0.0)
            runs.append((await Trainer(run, events=events.append).run(), events))
    # the step's microbatches: tapered at both ends when the measured calls are long enough to pay for it
    # (swarmd.pipeline.partition.tapered_sizes: 16 samples of 2 make 8, or 9 halved at the ends; a CI run
    # under load tapered and sized the window 9)
    microbatches = max(len(tapered_sizes(TRAINING.target_batch_size, 2, depth)) for depth in (0, 1, 2))
    (auto, auto_events), (fixed, fixed_events) = runs
    assert auto.window_need is not None and auto.window_need >= 1.0  # at least the bottleneck's own microbatch
    assert 2 <= auto.window <= microbatches
    batch = TRAINING.target_batch_size
    last = max(i for i, e in enumerate(auto_events) if isinstance(e, StepDone))  # then: validation's forwards
    assert 1 <= _in_flight_per_batch(auto_events[:last], batch)[-1] <= auto.window
    assert fixed.window == 3 and fixed.window_need is not None
    last = max(i for i, e in enumerate(fixed_events) if isinstance(e, StepDone))
    assert _in_flight_per_batch(fixed_events[:last], batch) == [3, 3, 3]
    for summary in (auto, fixed):
        assert summary.steps == 3 and summary.microbatches_issued == summary.microbatches_completed
