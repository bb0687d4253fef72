"""Synchronous training (``--sync``): one global batch per step, then wait until every peer stepped.

A sync trainer sends exactly one global batch per step, and no call of the next step runs on a peer
before that peer's stage has stepped, which makes a swarm compute exactly what single-process
training computes (the equivalence test). The next batch starts once all but the last microbatch of
this one went through, while this step's wait is still on: each of its calls waits at its stage's
gate (:class:`StageGates`), open once every peer of that stage stepped (a long-poll of
``/v1/progress``), so the first stage's forwards go out while a later stage's answer is still on the
link (a round trip per step on a long link). A microbatch's first call waits for the step at the
first stage's peer instead (``ForwardRequest.min_step``), so it is there the moment that stage steps,
and peer to peer so does every stage of its chain. The wait itself begins once the last stage has
answered the whole batch (or a chain to it went out), while the first stages drain it (its polls only
open gates until the batch is sent). A step that ends in a validation pass waits for the whole swarm
and the pass first. The batch is tapered at both ends (the first and last microbatches halved, or a
ramp in quarters once the stages' measured latencies say a small microbatch is worth its request:
``swarmd.pipeline.partition.tapered_sizes``, depth from :func:`taper_depth_for`) and each microbatch
starts once the one before has its first forward back, which shortens the pipeline's fill and drain
at every step (``swarmd.pipeline.schedule`` models it).

The wait (:meth:`SyncSteps.wait_all_stepped`, its decisions pure in :func:`assess`): a stage whose
peers hold fewer than the target batch and are not averaging lost gradients with a dead peer, and
is topped up with fresh microbatches after a short grace. Liars (issue #17): a peer a stage-mate
excludes, or a fork (``verify.stage_distrust``), counts neither for its stage's samples nor as
lagging: a poisoned contributor's samples are refused by the round, and a refused leader stepped
alone on its own lie, so the honest peers are topped up as for a dead peer. A stage that holds the
target yet does not step (a peer reports samples it never contributes) gets one more microbatch
per grace, and a peer most of its stage left behind is not waited for past a grace.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from swarmd.errors import ConfigError
from swarmd.pipeline.partition import taper_depth, tapered_sizes
from swarmd.pipeline.routing import StageRouter
from swarmd.pipeline.spec import TrainingSpec
from swarmd.tasks import all_or_nothing
from swarmd.train.config import TrainerConfig
from swarmd.train.events import StepWait, TrainerEvent
from swarmd.train.microbatches import Gates
from swarmd.train.summary import TrainSummary
from swarmd.train.swarm_client import PeerProgress, TrainerError
from swarmd.train.verify import stage_distrust

__all__ = ["LeftBehind", "StageGates", "Standing", "SyncSteps", "assess", "split_batch", "taper_depth_for"]

log = logging.getLogger(__name__)


def split_batch(batch: int, microbatch: int, *, taper: bool = False) -> list[int]:
    """Microbatch sizes for one global batch: ``microbatch`` each, the remainder last; with
    ``taper``, the first and the last halved (``32, 8`` gives ``4 8 8 8 4``; ``36, 8`` gives
    ``4 8 8 8 4 4``). :func:`swarmd.pipeline.partition.tapered_sizes` at depth 0 or 1, which
    says why; a sync trainer may taper finer (depth 2) once it has measured its stages."""
    return tapered_sizes(batch, microbatch, 1 if taper else 0)


def taper_depth_for(routers: Sequence[StageRouter], *, taper: bool, most: int, microbatch_size: int) -> int:
    """How finely a sync step's batch is tapered (``swarmd.pipeline.partition.taper_depth``, at most
    ``most``): from the slowest stage's typical seconds per sample (a forward and a backward on
    stages before the last, the fused call on the last) as the routers measured them; 0 without a
    taper or with one stage (no pipeline to fill)."""
    if not taper or len(routers) < 2:
        return 0
    per_sample = [sum(v for v in (router.typical_latency(kind) for kind in ("forward", "backward"))
                      if v is not None) for router in routers]
    slowest = max(per_sample)
    return min(most, taper_depth(slowest if slowest > 0 else None, microbatch_size))


class LeftBehind:
    """The peers most of their stage left behind, since when (pure: the times are passed in)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._since: dict[str, float] = {}

    def note(self, peer_ids: Sequence[str], now: float) -> None:
        for peer_id in peer_ids:
            self._since.setdefault(peer_id, now)

    def waited_out(self, peer_id: str, now: float) -> bool:
        """Whether ``peer_id`` was left behind for longer than the grace: not waited for any more."""
        since = self._since.get(peer_id)
        return since is not None and now - since > self.grace_s

    def late(self, now: float) -> list[str]:
        """Every peer not waited for any more, sorted."""
        return sorted(p for p in self._since if self.waited_out(p, now))


@dataclass(frozen=True)
class Standing:
    """Where the stages stand against one step, from one poll (:func:`assess`)."""

    lagging: tuple[tuple[int, str, int | None], ...]  # (stage, peer, its step) still waited for
    missing: int  # samples the shortest stage lacks of the target batch (0: none is short)
    stuck: bool  # a stage holds the target batch yet has not stepped
    refused: bool  # a stage is short because its stage-mates refuse a liar's work: nothing to wait for


def assess(polled: Sequence[Sequence[PeerProgress]], step: int, target: int, left_behind: LeftBehind,
           now: float) -> Standing:
    """What one poll says of ``step`` (see the module docstring): a peer that did not answer counts
    as lagging until the DHT forgets it (a dead one) or it answers; one that most of its stage left
    behind is noted in ``left_behind`` and not waited for past its grace."""
    lagging: list[tuple[int, str, int | None]] = []
    missing = 0
    stuck = refused = False
    for stage, peers in enumerate(polled):
        distrusted = stage_distrust(peers)
        counted = [p for p in peers if p.peer_id not in distrusted]
        behind = [p for p in counted if p.step is None or p.step < step]
        if len(counted) - len(behind) > len(counted) // 2:
            left_behind.note([p.peer_id for p in behind], now)
            behind = [p for p in behind if not left_behind.waited_out(p.peer_id, now)]
        lagging += [(stage, p.peer_id, p.step) for p in behind]
        seen = [p for p in counted if p.step is not None]
        front = max((p.step for p in seen if p.step is not None), default=step)
        if front < step:  # the whole stage has yet to step: does it hold a full batch?
            at_front = [p for p in seen if p.step == front]
            if not any(p.averaging for p in at_front):
                held = sum(p.samples for p in at_front)
                missing = max(missing, target - held)
                stuck = stuck or held >= target
                refused = refused or (bool(distrusted) and held < target)
    return Standing(tuple(lagging), missing, stuck, refused)


class Polls(Protocol):
    """Where the stages stand (``swarmd.train.swarm_view.SwarmView``)."""

    @property
    def routers(self) -> Sequence[StageRouter]: ...

    async def refresh(self, force: bool = False) -> None: ...

    async def poll(self, wait_step: int | None = None,
                   on_stage: Callable[[int, list[PeerProgress]], None] | None = None, *,
                   refresh: bool = True) -> list[list[PeerProgress]]: ...

    async def swarm_step(self) -> int: ...


class Runner(Protocol):
    """Runs one microbatch (``swarmd.train.microbatches.Microbatches``)."""

    async def run(self, x: torch.Tensor, y: torch.Tensor, *, on_forward: Callable[[], None] | None = None,
                  paired: bool | None = None, gates: Gates | None = None,
                  on_last_stage: Callable[[], None] | None = None) -> None: ...

    def pairs(self) -> bool: ...


class Sampler(Protocol):
    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class StageGates:
    """Which stages the next step's calls may go to yet: stage ``k``'s gate opens once every peer of it
    the step's wait waits for has taken the step (:meth:`SyncSteps.wait_all_stepped`), so the next
    batch starts on a stage that stepped while a later stage's answer is still on its way back,
    instead of after the whole swarm's (a round trip per step saved on a long link)."""

    def __init__(self, n_stages: int, step: int) -> None:
        self.step = step  # the step each stage must have taken (a chain's hops wait for it there: min_step)
        self._open = [asyncio.Event() for _ in range(n_stages)]

    def open(self, stages: Iterable[int] | None = None) -> None:
        """Open the gates of ``stages`` (None: of every stage)."""
        for k in range(len(self._open)) if stages is None else stages:
            if 0 <= k < len(self._open):
                self._open[k].set()

    async def wait(self, stage: int) -> None:
        """Until ``stage``'s gate is open (a stage the gates do not know of is never held)."""
        if 0 <= stage < len(self._open):
            await self._open[stage].wait()


class SyncSteps:
    """Runs ``config.steps`` synchronous steps: a tapered batch each, then the wait for the step."""

    def __init__(self, config: TrainerConfig, training: TrainingSpec, *, view: Polls, microbatches: Runner,
                 summary: TrainSummary, on_step: Callable[[int, int], Awaitable[None]],
                 emit: Callable[[TrainerEvent], None] | None = None,
                 window: Callable[[int], int] | None = None,
                 calls_on_step: Callable[[int], bool] | None = None) -> None:
        self.config = config
        # microbatches in flight for a step of so many (the trainer's swarmd.train.window sizing; by default the start)
        self.window = window if window is not None else (lambda _: config.start_window)
        self.training = training
        self.view = view
        self.microbatches = microbatches
        self.summary = summary
        self.on_step = on_step  # (step, steps done in this run): every peer took it
        # whether on_step after the done-th step of this run calls the stages (a validation pass): then the
        # next batch waits for it, so those calls all see the step's parameters
        self.calls_on_step = calls_on_step if calls_on_step is not None else (lambda _: False)
        self.emit = emit

    async def run(self, sampler: Sampler) -> None:
        cfg, training = self.config, self.training
        batch = cfg.batch_size or training.target_batch_size
        if batch < training.target_batch_size:
            raise ConfigError(
                f"--batch-size {batch} is below the swarm's target_batch_size {training.target_batch_size}: "
                "in --sync mode the stages would never step"
            )
        start = await self.view.swarm_step()
        began = time.monotonic()
        # the step before: its batch's last microbatch may still be on its way, its wait is on; its gates hold
        # each call of this step to a stage until that stage stepped, and on_step follows the wait (the ledger
        # closes that step then)
        waiting: _Waiting | None = None
        tasks: list[asyncio.Task[None]] = []  # every batch and wait started, for the cleanup
        try:
            for i in range(cfg.steps):
                if cfg.max_seconds is not None and time.monotonic() - began > cfg.max_seconds:
                    break
                step = start + i
                # this step's wait starts as soon as the last stage has the whole batch (its polls then only open
                # the next batch's gates: a later stage's answer travels while the first stage drains), or at
                # the latest once the batch is sent
                after = _Waiting(step, i + 1, StageGates(len(self.view.routers), step + 1), asyncio.Event())

                def start_wait(after: _Waiting = after, step: int = step) -> None:
                    if after.task is None:
                        after.task = asyncio.create_task(self.wait_all_stepped(step + 1, sampler, after.gates,
                                                                               after.sent),
                                                         name=f"swarmd-trainer-wait-{step + 1}")
                        tasks.append(after.task)

                # the next batch starts once this one's last microbatch is all that is left of it: peer to peer,
                # its first calls then reach the first stage as that stage steps (ForwardRequest.min_step)
                nearly = asyncio.Event()
                after.sending = asyncio.create_task(
                    self._send_step(after, batch, sampler, None if waiting is None else waiting.gates, start_wait,
                                    nearly.set), name=f"swarmd-trainer-batch-{step}")
                tasks.append(after.sending)
                if waiting is None:
                    await _either(nearly, after.sending)
                else:
                    await all_or_nothing(_either(nearly, after.sending), self._closed(waiting))
                waiting = after
                if self.calls_on_step(i + 1) or i + 1 == cfg.steps:
                    await self._closed(waiting)
                    waiting = None
            if waiting is not None:  # stopped by --max-seconds before the next batch
                await self._closed(waiting)
        finally:
            running = [task for task in tasks if not task.done()]
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _send_step(self, after: _Waiting, batch: int, sampler: Sampler, gates: StageGates | None,
                         start_wait: Callable[[], None], nearly: Callable[[], None]) -> None:
        """A step's batch (``send_batch``), then the step's wait told it is sent."""
        await self.send_batch(batch, sampler, gates, on_last_stage=start_wait, on_nearly_sent=nearly)
        after.sent.set()
        start_wait()

    async def _closed(self, waiting: _Waiting) -> None:
        """The step's batch sent, its wait done, then ``on_step`` for it."""
        if waiting.sending is not None:
            await waiting.sending
        if waiting.task is not None:
            await waiting.task
        await self.on_step(waiting.step, waiting.done)

    async def send_batch(self, batch: int, sampler: Sampler, gates: StageGates | None = None,
                         on_last_stage: Callable[[], None] | None = None,
                         on_nearly_sent: Callable[[], None] | None = None) -> None:
        """One step's batch, tapered, every microbatch through the pipeline.

        The first microbatch leads: the others start once its first forward is back, so stage 0
        computes it first (requests sent together reach the worker in any order) and the next stage
        starts after the step's smallest forward. Under the finer taper each one waits for the one
        before, so the ramp reaches stage 0 in order (its calls are long enough that the round trip
        between them costs little; a model whose calls are mostly overhead is not chained).

        ``gates``: each call waits at its stage's (the step before still being taken); ``on_last_stage``:
        called once the last stage has answered every microbatch of the batch; ``on_nearly_sent``: once
        all of them but one went through (or all, for a batch of one)."""
        cfg = self.config
        depth = taper_depth_for(self.view.routers, taper=cfg.taper, most=cfg.max_taper_depth,
                                microbatch_size=cfg.microbatch_size)
        microbatches = [sampler.sample(size) for size in tapered_sizes(batch, cfg.microbatch_size, depth)]  # in order
        window = asyncio.Semaphore(self.window(len(microbatches)))
        led = [asyncio.Event() for _ in microbatches]
        # a spot check is a paired microbatch: the same sample twice, in two slots of the same size (the
        # second slot's sample is not used: the step still holds the batch it was planned with)
        paired: dict[int, bool] = {}
        for k in range(len(microbatches)):
            if k in paired:
                continue
            twin = k + 1 < len(microbatches) and microbatches[k + 1][0].shape == microbatches[k][0].shape
            paired[k] = twin and self.microbatches.pairs()
            if paired[k]:
                paired[k + 1] = False

        runs = [k for k in range(len(microbatches)) if not paired.get(k - 1, False)]  # a pair's second slot: none
        at_last: set[int] = set()

        def last_stage_done(index: int) -> None:
            at_last.add(index)
            if len(at_last) == len(runs) and on_last_stage is not None:
                on_last_stage()

        through = 0

        async def one(index: int, x: torch.Tensor, y: torch.Tensor) -> None:
            nonlocal through
            if index:
                await led[index - 1 if depth >= 2 else 0].wait()
            if index - 1 in paired and paired[index - 1]:  # its slot went to the pair before it
                await led[index - 1].wait()
                led[index].set()
                return
            async with window:
                await self.microbatches.run(x, y, on_forward=led[index].set, paired=paired[index],
                                            gates=gates,
                                            on_last_stage=functools.partial(last_stage_done, index))
            through += 1
            if through == max(1, len(runs) - 1) and on_nearly_sent is not None:
                on_nearly_sent()

        async def refresh() -> None:
            # the stage map is re-read (when due) mid-step, while the pipeline is full: not at the step's
            # ends, where the first stage's daemon (often the control plane's too) is the critical path
            await led[len(led) // 2].wait()
            await self.view.refresh()

        refreshed = asyncio.create_task(refresh(), name="swarmd-trainer-refresh")
        try:
            await asyncio.gather(*(one(k, x, y) for k, (x, y) in enumerate(microbatches)))
            await refreshed
        finally:
            if not refreshed.done():  # a microbatch failed: the step ends here
                refreshed.cancel()
                await asyncio.gather(refreshed, return_exceptions=True)

    @staticmethod
    def _heard(gates: StageGates, step: int, target: int, left_behind: LeftBehind, stage: int,
               answers: list[PeerProgress]) -> None:
        """One stage's answers to a poll: its gate opens if none of its peers is still waited for."""
        alone = [answers if k == stage else [] for k in range(stage + 1)]
        if not assess(alone, step, target, left_behind, time.monotonic()).lagging:
            gates.open((stage,))

    async def wait_all_stepped(self, step: int, sampler: Sampler, gates: StageGates | None = None,
                               sent: asyncio.Event | None = None) -> None:
        """Poll every serving peer's progress until all are at ``step`` or later (see the module
        docstring: top-ups for a short or stuck stage, no wait for a peer left behind). ``gates``: each
        stage's opened as soon as a poll finds none of its peers waited for, all of them at the end.
        ``sent``: set once the step's batch is sent; until then the polls only open gates (no top-up, no
        deadline, no end: the batch's last microbatches are still being booked)."""
        cfg, timing, s = self.config, self.config.timing, self.summary
        target = self.training.target_batch_size
        began = time.perf_counter()
        deadline = time.monotonic() + cfg.stage_wait_timeout_s
        short_since: float | None = None
        stuck_since: float | None = None
        left_behind = LeftBehind(timing.lag_grace_s)
        waited_from = time.monotonic()  # (from the batch sent, once it is)
        while True:
            polled_at = time.monotonic()
            early = sent is not None and not sent.is_set()
            if gates is None:
                polled = await self.view.poll(wait_step=step)
            else:  # the stage map was re-read mid-step when due (send_batch): again only if the wait goes on
                refresh = not early and polled_at - waited_from > timing.wait_refresh_after_s
                polled = await self.view.poll(wait_step=step, on_stage=functools.partial(
                    self._heard, gates, step, target, left_behind), refresh=refresh)
            standing = assess(polled, step, target, left_behind, time.monotonic())
            if gates is not None:
                gates.open(set(range(len(polled))) - {stage for stage, _, _ in standing.lagging})
            if early and sent is not None:  # begun early: the wait proper begins with the batch sent
                if standing.lagging and not sent.is_set():  # meanwhile its polls go on opening gates
                    await asyncio.sleep(max(0.0, timing.step_poll_period_s - (time.monotonic() - polled_at)))
                    continue
                await sent.wait()
                began, deadline = time.perf_counter(), time.monotonic() + cfg.stage_wait_timeout_s
                waited_from = time.monotonic()
                if standing.lagging:  # asked again: what is short or stuck is judged on a poll after the batch
                    continue
            if not standing.lagging:  # (every gate opened just above)
                late = [p[:12] for p in left_behind.late(time.monotonic())]
                if late:
                    log.warning("step %d: not waiting any longer for %s, left behind by most of its stage for "
                                "%.0fs", step, ", ".join(late), timing.lag_grace_s)
                if self.emit is not None:
                    self.emit(StepWait(step=step, started=began, ended=time.perf_counter()))
                return
            now = time.monotonic()
            if now > deadline:
                raise TrainerError(f"stages did not reach step {step} in time: {list(standing.lagging)}")
            if standing.missing > 0:
                short_since = short_since or now
                if standing.refused or now - short_since > timing.topup_grace_s:
                    count = -(-standing.missing // cfg.microbatch_size)
                    log.warning("a stage is %d samples short of step %d (a peer died holding gradients, or its "
                                "stage-mates refused its work); topping up with %d microbatches",
                                standing.missing, step, count)
                    s.topup_microbatches += count
                    await asyncio.gather(*(self.microbatches.run(*sampler.sample(cfg.microbatch_size))
                                           for _ in range(count)))
                    short_since = None
            else:
                short_since = None
            stuck_since = (stuck_since or now) if standing.stuck and not standing.missing > 0 else None
            if stuck_since is not None and now - stuck_since > timing.stuck_grace_s:
                log.warning("a stage holds the samples of step %d but has not stepped for %.0fs (a peer holds "
                            "samples it does not contribute?); topping up with one microbatch", step,
                            timing.stuck_grace_s)
                s.topup_microbatches += 1
                await self.microbatches.run(*sampler.sample(cfg.microbatch_size))
                stuck_since = None
            await asyncio.sleep(max(0.0, timing.step_poll_period_s - (time.monotonic() - polled_at)))


@dataclass
class _Waiting:
    """A step's batch (a task) and its wait for every stage to take it (a task, once started), the gates
    the wait opens, whether the batch is sent, and what ``on_step`` is told."""

    step: int
    done: int  # steps done in this run once it ends
    gates: StageGates
    sent: asyncio.Event
    task: asyncio.Task[None] | None = None  # the wait
    sending: asyncio.Task[None] | None = None  # the batch


async def _either(event: asyncio.Event, task: asyncio.Task[None]) -> None:
    """Until ``event`` is set or ``task`` ended (its error, if it failed); ``task`` itself goes on."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
    if task.done():
        task.result()
