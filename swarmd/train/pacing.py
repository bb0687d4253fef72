"""Asynchronous training: a window of microbatches in flight, paced through the first stage's lease book.

In SWARM's default mode the stages step on their own whenever the swarm accumulated
``target_batch_size`` samples from every trainer together (paper, section 3.2). A trainer that
sent microbatches blindly would overfill steps and see many straddle one (their backward refused
as stale, the whole microbatch redone). So it paces itself through the first stage's sample
reservations (``POST /v1/reserve``, the lease book of ``swarmd.pipeline.reservations``): it starts
a microbatch only under a lease for the stage's current step, so all trainers' in-flight work plus
what the stages hold never exceeds the target, each step aggregates exactly the target batch, and
few microbatches straddle a step. A trainer that finds the step full waits for it: a long-poll of the
first stage's next step, and of each later stage only as far as the work leased already takes it
(:func:`reachable_steps`; a stage a batch behind would hold every wait to its end).

Which book: the smallest usable first-stage peer id (:func:`book_peer`), so that trainers with the
same stage map use the same book; a book peer seen behind the stage's front step is waited for a
grace (:class:`BookLag`) before the trainer turns to the next one, since a second book would lease
samples the stage's book never learns of. Without a lease book (a single stage, delayed updates, a
peer of an older version) the trainer paces from what the stages hold and what *it* has in flight
(:func:`pace_budget`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Protocol

import torch

from swarmd.errors import PeerError
from swarmd.net.client import DataPlaneClient
from swarmd.net.messages import ReserveReply, ReserveRequest
from swarmd.pipeline.failures import Action, classify
from swarmd.pipeline.routing import RoutedPeer, StageRouter
from swarmd.pipeline.spec import TrainingSpec
from swarmd.pipeline.stage.delayed_updates import needs_pacing
from swarmd.train.config import TrainerConfig
from swarmd.train.summary import TrainSummary
from swarmd.train.swarm_client import PeerProgress, TrainerError
from swarmd.train.swarm_view import front_step, stage_fronts
from swarmd.train.verify import excluded_by_stage, forks, stage_distrust
from swarmd.train.window import MOST

__all__ = ["AsyncPacing", "BookLag", "LeaseBook", "book_peer", "pace_budget", "reachable_steps", "rounds_pending"]

log = logging.getLogger(__name__)

Progress = Sequence[Sequence[PeerProgress]]


def book_peer(peers: Sequence[RoutedPeer], *, behind: Collection[str] = (),
              answered: Collection[str] = ()) -> RoutedPeer | None:
    """The first stage's peer whose lease book a trainer uses, from its router's snapshot (sorted by
    id): the smallest usable id, so that trainers with the same stage map use the same book; among
    peers that have answered this trainer when there are any (a fake record with a small id is not
    asked before the peers that proved themselves), then among those alive (they answered a progress
    poll: a tarpit never does, issue #18); never one ``behind`` the stage's front step (it would
    refuse every reservation with PeerBehind until it catches up). A peer banned for a failed
    compute call still keeps its book while it ``answered`` the last progress poll: a trainer that
    turned to another book would lease samples the stage's book never learns of."""
    usable = [p for p in peers
              if (not p.banned or p.peer_id in answered) and not p.excluded and p.peer_id not in behind]
    for p in [p for p in usable if p.proven] or [p for p in usable if p.alive] or usable:
        return p
    return None


class BookLag:
    """Since when each first-stage peer has been behind the stage's front step, and which ones have
    been so for longer than ``grace_s`` (pure: the times are passed in)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._since: dict[str, float] = {}

    def update(self, lagging: Collection[str], now: float) -> frozenset[str]:
        """``lagging`` are behind now (the others caught up): those behind for longer than the grace."""
        for peer_id in [p for p in self._since if p not in lagging]:
            del self._since[peer_id]
        for peer_id in lagging:
            self._since.setdefault(peer_id, now)
        return frozenset(p for p in lagging if now - self._since[p] > self.grace_s)


def pace_budget(progress: Progress, *, target: int, in_flight_samples: int, delay_updates: bool) -> int | None:
    """Samples a trainer without a lease book may still start before the stages' next step (None:
    no limit). The stages whose backwards are step-checked (all but the last) step once their peers
    hold ``target`` samples; what they hold for their current step (per stage, at its most advanced
    step) and what is in flight count against it. Delayed updates accept a backward one step old, so
    they need no pacing."""
    if not needs_pacing(delay_updates) or len(progress) < 2:
        return None
    held = 0
    for peers in progress[:-1]:
        seen = [p for p in peers if p.step is not None]
        if seen:
            front = max(p.step for p in seen if p.step is not None)
            held = max(held, sum(p.samples for p in seen if p.step == front))
    return target - held - in_flight_samples


def rounds_pending(progress: Progress, step: int, target: int) -> bool:
    """Whether a stage after the first holds a full batch of the step before ``step`` and has not
    taken it out for its round yet: a new microbatch's fused backward could slip into that step."""
    for peers in progress[1:]:
        seen = [p for p in peers if p.step is not None]
        front = max((p.step for p in seen if p.step is not None), default=step)
        at_front = [p for p in seen if p.step == front]
        if front < step and sum(p.samples for p in at_front) >= target and not all(p.averaging for p in at_front):
            return True
    return False


def reachable_steps(progress: Progress, step: int, target: int) -> list[int]:
    """The step each stage is asked to reach in the long-poll for the lease book's next step (``step + 1``,
    the first stage's): that step, or for a later stage the one it can reach on the work leased already,
    when that is less. Every backward reaches a later stage before the first, so a later stage gets at
    most the samples of ``step`` the first stage does not hold yet (``target`` less what it holds there):
    with what it holds at its front, that many steps. A later stage behind by a batch (it lost one: a
    convicted peer's samples are dropped) steps only on leases of the next step, which no trainer is
    granted before the first stage steps: waiting for it there would cost the whole wait at every step.
    A stage in its round steps once more; a first stage not at ``step`` or silent, a silent later
    stage: the book's next step (nothing known to wait less for)."""
    wanted = step + 1
    fronts = stage_fronts(progress)
    if not progress or fronts[0] != step:
        return [wanted] * len(progress)
    incoming = max(0, target - _held_at(progress[0], step, _ignored(progress[0])))
    reach = [wanted]
    for peers, front in zip(progress[1:], fronts[1:], strict=True):
        if front is None or front >= wanted:
            reach.append(wanted)
            continue
        ignored = _ignored(peers)
        averaging = any(p.averaging for p in peers if p.step == front and p.peer_id not in ignored)
        steps = (_held_at(peers, front, ignored) + incoming) // target if target > 0 else 0
        reach.append(min(wanted, front + max(steps, 1 if averaging else 0)))
    return reach


def _ignored(peers: Sequence[PeerProgress]) -> frozenset[str]:
    """A stage's peers that most of it excludes or that fork it: their stage-mates do not count their samples."""
    return excluded_by_stage(peers) | forks(peers)


def _held_at(peers: Sequence[PeerProgress], step: int, ignored: Collection[str]) -> int:
    """Samples a stage's peers hold at ``step``, but those of the ``ignored`` (:func:`_ignored`)."""
    return sum(p.samples for p in peers if p.step == step and p.peer_id not in ignored)


class Polls(Protocol):
    """Where the stages stand (``swarmd.train.swarm_view.SwarmView``)."""

    @property
    def routers(self) -> Sequence[StageRouter]: ...

    async def poll(self, wait_step: int | Sequence[int] | None = None) -> list[list[PeerProgress]]: ...

    async def swarm_step(self) -> int: ...


class LeaseBook:
    """The first stage's lease book, as this trainer uses it: which peer keeps it, and the leases."""

    def __init__(self, config: TrainerConfig, training: TrainingSpec, *, n_stages: int, view: Polls,
                 client: DataPlaneClient, summary: TrainSummary, trainer_id: Callable[[], str | None]) -> None:
        self.config = config
        self.view = view
        self.client = client
        self.summary = summary
        self.trainer_id = trainer_id  # the registration's current id (a registration again changes it)
        self.lag = BookLag(config.timing.book_lag_grace_s)
        # delayed updates accept a backward one step old (nothing to pace); one stage has no forward to lease
        self._enabled = config.reserve and not training.delay_updates and n_stages >= 2

    @property
    def active(self) -> bool:
        """Whether this swarm paces through the lease book (off for good once a peer had none)."""
        return self._enabled

    async def reserve(self, progress: Progress, room: int, done: Sequence[int],
                      renew: Sequence[int]) -> ReserveReply | None:
        """Up to ``room`` leases for the first stage's current step, reporting ``done`` leases and
        renewing ``renew``; None without a book (see :attr:`active`), or when the book's peer failed
        (it is banned: the next call asks the next peer) or is finishing its step (asked again shortly)."""
        if not self._enabled or not self.view.routers:
            return None
        router = self.view.routers[0]
        peers = router.snapshot()
        # an excluded peer's samples are never averaged in (swarmd.pipeline.averaging.averager): not the stage's
        excluded = {p.peer_id for p in peers if p.excluded}
        seen = [p for p in progress[0] if p.step is not None and p.peer_id not in excluded] if progress else []
        front = max((p.step for p in seen if p.step is not None), default=None)
        lagging = {p.peer_id for p in seen if front is not None and p.step != front}
        book = book_peer(peers, behind=self.lag.update(lagging, time.monotonic()),
                         answered={p.peer_id for p in seen})
        trainer = self.trainer_id()
        if book is None or trainer is None or book.peer_id in lagging:
            return None  # (the book's peer is finishing its step: ask again shortly, not another book)
        # nor are those of a peer one stage-mate excludes, while the trainers (needing two accusers) still route to
        # it: where it is excluded its samples never enter a round, so counting them would leave the book waiting
        # for them for ever (its deficit written off after a grace instead, and granted again: ``reservations``);
        # an honest peer named by a liar only makes the step larger than the target, as a sync trainer's top-up
        distrusted = stage_distrust(progress[0]) if progress else frozenset()
        held = sum(p.samples for p in seen if p.step == front and p.peer_id not in distrusted)
        complete = seen and len(seen) == len(progress[0])  # every stage-0 peer answered: the sum is the stage's
        cfg, timing = self.config, self.config.timing
        request = ReserveRequest(stage=0, trainer=trainer, step=front or 0, size=cfg.microbatch_size,
                                 count=max(0, room), lease_s=cfg.lease_s, done=tuple(done), renew=tuple(renew),
                                 held=held if complete and front is not None else None)
        timeout = timing.reserve_timeout_s if book.proven else timing.probation_reserve_timeout_s
        try:
            return await self.client.reserve(book.addr, request, timeout_s=min(timeout, cfg.request_timeout_s))
        except PeerError as exc:
            action = classify(exc)
            if exc.status == 404:  # a peer of an older version: no lease book anywhere, most likely
                log.warning("stage 0 peer %s has no lease book (%s); pacing without reservations",
                            book.peer_id[:12], exc)
                self._enabled = False
            elif action is Action.FATAL:  # e.g. 401 without the swarm key: no retry can fix it
                raise TrainerError(f"stage 0 peer {book.peer_id[:12]} refused a request: {exc}") from exc
            else:
                log.warning("stage 0 peer %s did not grant reservations (%s)", book.peer_id[:12], exc)
                if action is Action.BAN:
                    router.report_failure(book.peer_id)
                    self.summary.bans += 1
            return None


class Runner(Protocol):
    """Runs one microbatch (``swarmd.train.microbatches.Microbatches``)."""

    async def run(self, x: torch.Tensor, y: torch.Tensor, *, lease_step: int | None = None,
                  paired: bool | None = None) -> None: ...

    def pairs(self) -> bool: ...


class Sampler(Protocol):
    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class AsyncPacing:
    """Keeps up to a window of microbatches in flight (``window(microbatches of a step)``, by default the
    config's start) until the swarm has taken ``steps`` steps."""

    def __init__(self, config: TrainerConfig, training: TrainingSpec, *, view: Polls, book: LeaseBook,
                 microbatches: Runner, summary: TrainSummary, on_step: Callable[[int, int], Awaitable[None]],
                 window: Callable[[int], int] | None = None) -> None:
        self.config = config
        # microbatches in flight for a step of so many (the trainer's swarmd.train.window sizing; by default the start)
        self.window = window if window is not None else (lambda _: config.start_window)
        self.training = training
        self.view = view
        self.book = book
        self.microbatches = microbatches
        self.summary = summary
        self.on_step = on_step  # (step, steps done in this run): the swarm took it

    async def run(self, sampler: Sampler) -> None:
        """Paced by the lease book when there is one, else by :func:`pace_budget`; either way, once
        the batch is complete, the trainer waits for the step. What is in flight when the run ends is
        finished rather than abandoned (its gradients count towards the swarm's next step)."""
        cfg, s = self.config, self.summary
        start = await self.view.swarm_step()
        target = start + cfg.steps
        started = time.monotonic()
        done_steps = 0
        in_flight: set[asyncio.Task[None]] = set()
        sizes: dict[asyncio.Task[None], int] = {}
        leases: dict[asyncio.Task[None], list[int]] = {}  # task -> its lease ids (two: a paired check's)
        done_leases: list[int] = []  # finished under a lease, not reported yet
        waited: Progress | None = None  # the answer of the long-poll for the next step, when the loop waited
        try:
            while True:
                # the long-poll's answer is as fresh as a poll's (every peer answered it just now, at the step
                # it waited for or at its wait's end): polling again would only add a round trip to each step
                progress = waited if waited is not None else await self.view.poll()
                waited = None
                step_now = front_step(progress)
                # the swarm may take two steps between polls (leases of the next step in flight): a run that
                # asked for n steps reports n, the one past them is the swarm's next run's
                while done_steps < min(step_now - start, cfg.steps):
                    done_steps += 1
                    await self.on_step(start + done_steps - 1, done_steps)
                if step_now >= target or (cfg.max_seconds is not None and time.monotonic() - started > cfg.max_seconds):
                    break
                # not capped at a step's microbatches: the lease book caps what is in flight at the step's samples
                # already, and without it (delayed updates) microbatches may span steps
                window = self.window(MOST)
                room = window - sum(len(leases.get(task, [0])) for task in in_flight)  # a paired check holds two
                held = [lease for ids in leases.values() for lease in ids]
                reply = await self.book.reserve(progress, room, done_leases, held)
                asked_at = time.monotonic()
                if reply is not None:
                    done_leases.clear()
                    if reply.leases:
                        await self._await_rounds_taken(progress, reply.step)
                    granted = list(reply.leases)
                    while granted:
                        lease_id, samples = granted.pop(0)
                        ids = [lease_id]
                        # a spot check is a paired microbatch: the same sample twice, on two leases
                        if granted and granted[0][1] == samples and self.microbatches.pairs():
                            ids.append(granted.pop(0)[0])
                        x, y = sampler.sample(samples)
                        task = asyncio.create_task(self.microbatches.run(x, y, lease_step=reply.step,
                                                                         paired=len(ids) == 2))
                        in_flight.add(task)
                        sizes[task], leases[task] = samples * len(ids), ids
                    s.leases += len(reply.leases)
                    if not reply.leases and room and reply.reserved >= reply.target:
                        s.full_waits += 1
                elif not self.book.active:
                    budget = pace_budget(progress, target=self.training.target_batch_size,
                                         in_flight_samples=sum(sizes[t] for t in in_flight),
                                         delay_updates=self.training.delay_updates)
                    while len(in_flight) < window and (budget is None or budget > 0):
                        x, y = sampler.sample(cfg.microbatch_size)
                        task = asyncio.create_task(self.microbatches.run(x, y))
                        in_flight.add(task)
                        sizes[task] = x.shape[0]
                        if budget is not None:
                            budget -= x.shape[0]
                if not in_flight:  # the stages hold (or have reserved) a full batch: wait until they step
                    if reply is None and self.book.active:  # the book did not answer: ask again shortly
                        await asyncio.sleep(cfg.timing.book_retry_s)
                    elif reply is not None:  # wait for the book's next step, and each later stage as far as it gets
                        waited = await self.view.poll(wait_step=reachable_steps(
                            progress, reply.step, self.training.target_batch_size))
                    else:
                        waited = await self.view.poll(wait_step=step_now + 1)
                    continue
                spoken_for = reply is not None and reply.reserved >= reply.target
                while True:
                    done, in_flight = await asyncio.wait(in_flight, timeout=cfg.timing.window_poll_s,
                                                         return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        sizes.pop(task, None)
                        lease_done = leases.pop(task, [])
                        if not task.cancelled() and task.exception() is None:
                            done_leases += lease_done
                    # retrieve every error (else asyncio logs "Task exception was never retrieved" for
                    # each failed microbatch after the first), then raise the first one
                    failed = [task for task in done if not task.cancelled() and task.exception() is not None]
                    for task in failed[:1] or done:
                        task.result()
                    # the book said the step is spoken for and more of this trainer's microbatches are in flight:
                    # the book has nothing to grant, and the step closes only once they are in (when they are
                    # leases of it), so a poll and a request now would only load the peers (they were 3 of a tiny
                    # step's 5 control requests per microbatch). The done leases are reported with the next
                    # request, after the last microbatch in flight (the book's write-off needs them), and the
                    # open ones are renewed well within lease_s.
                    if not (done and in_flight and spoken_for and time.monotonic() - asked_at < cfg.lease_s / 4):
                        break
            for finished in asyncio.as_completed(in_flight):
                await finished
            done_leases += [lease for ids in leases.values() for lease in ids]
            in_flight = set()
            # report the done leases (or the book would take them for a dead trainer's and grant them again),
            # and withdraw this trainer's claim on the step (the book would keep its fair share for it a while)
            if self.book.active:
                await self.book.reserve(await self.view.poll(), 0, done_leases, [])
        finally:
            for task in in_flight:  # only after an error: cancel the rest
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _await_rounds_taken(self, progress: Progress, step: int) -> None:
        """Before the microbatches of ``step`` start: wait (at most ``Timing.stage_catch_up_s``) while
        :func:`rounds_pending`, so a new microbatch's fused backward cannot slip into the step before."""
        timing = self.config.timing
        deadline = time.monotonic() + timing.stage_catch_up_s
        while time.monotonic() < deadline:
            if not rounds_pending(progress, step, self.training.target_batch_size):
                return
            await asyncio.sleep(timing.tick_s)
            progress = await self.view.poll()
