"""The trainer's view of the swarm: one router per stage, fed from ``/swarm``, and where the stages stand.

A trainer runs no DHT node (SWARM, section 3.2: trainers are light clients). It reads the stage map
from one daemon's ``GET /swarm`` (the DHT's peer records) and asks the serving peers themselves how
far their stages are (``GET /v1/progress``), since the DHT's view can be an announce period old
(``swarmd.train.swarm_client`` does that I/O). This module turns the answers into what the trainer
routes by, along one typed path: the listing becomes typed peers (:class:`~swarmd.pipeline.routing.PeerView`,
:func:`peer_views`), each stage's :class:`~swarmd.pipeline.routing.StageRouter` adopts the usable
ones, and the routers' :class:`~swarmd.pipeline.routing.RoutedPeer` snapshots say whom to poll.

What the progress answers decide:

* a newcomer that answers is alive and may be called (``StageRouter.require_alive``: a tarpit never
  answers, so it never holds a microbatch); one on probation that does not answer is banned;
* exclusions (issue #17, :func:`exclusions_of`): peers a majority of the answering peers excluded
  after two independent reports, peers most of their own stage excludes (its round checks caught
  them) and forks (another params digest than most of the stage at their step) are not routed to;
* the swarm's step (:func:`front_step`): the slowest stage's most advanced peer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import get_args

from swarmd.api import models
from swarmd.peer_state import ANNOUNCED, PeerState
from swarmd.pipeline.failures import Action, classify, timed_out
from swarmd.pipeline.routing import PeerView, Reachability, RoutedPeer, StageRouter
from swarmd.tasks import all_or_nothing
from swarmd.train.stage_calls import unreachable_hint
from swarmd.train.swarm_client import PeerProgress, SwarmClient, TrainerError
from swarmd.train.timing import Timing
from swarmd.train.verify import excluded_by_majority, excluded_by_stage, forks

__all__ = ["Exclusions", "SwarmView", "exclusions_of", "front_step", "peer_views", "poll_targets", "stage_fronts"]

log = logging.getLogger(__name__)

_STATES = {state.value: state for state in ANNOUNCED}
_REACHABILITY: tuple[str, ...] = get_args(Reachability)


def peer_views(body: models.SwarmView) -> dict[int, list[PeerView]]:
    """Every stage's listed peers, typed. The listing is read leniently, like the DHT records it
    shows (old and new peers coexist): a state this build does not know is a peer it cannot
    dial (left out), a reachability it does not know is ``unknown``."""
    return {
        stage.stage: [
            PeerView(p.peer_id, stage.stage, p.data_addr, _STATES[p.state],
                     p.reachable if p.reachable in _REACHABILITY else "unknown",  # type: ignore[arg-type]
                     p.throughput)
            for p in stage.peers if p.state in _STATES
        ]
        for stage in body.stages
    }


def stage_fronts(progress: Sequence[Sequence[PeerProgress]]) -> list[int | None]:
    """Each stage's most advanced peer's step (None: no peer of it answered), not counting a refused
    leader that stepped alone on its own lie (most of its stage excludes it, or it is a fork: one
    accuser cannot hold the front back)."""
    fronts = []
    for peers in progress:
        ignored = excluded_by_stage(peers) | forks(peers)
        fronts.append(max((p.step for p in peers if p.step is not None and p.peer_id not in ignored), default=None))
    return fronts


def front_step(progress: Sequence[Sequence[PeerProgress]]) -> int:
    """The step the whole swarm has reached: the slowest stage's front (:func:`stage_fronts`; 0 if a
    stage has no peer that answered)."""
    fronts = stage_fronts(progress)
    known = [f for f in fronts if f is not None]
    return min(known) if len(known) == len(fronts) and known else 0


@dataclass(frozen=True)
class Exclusions:
    """The peers of one stage not to route to, by why (issue #17)."""

    swarm_wide: frozenset[str]  # a majority of all answering peers excluded them: two independent reports
    by_stage: frozenset[str]  # most of their own stage excludes them: its round checks or reports
    forked: frozenset[str]  # another params digest than most of their stage at their step

    @property
    def all(self) -> frozenset[str]:
        return self.swarm_wide | self.by_stage | self.forked

    def reasons(self, peers: frozenset[str]) -> str:
        """Why ``peers`` are excluded, for a log line."""
        return "; ".join(why for why, named in (
            ("excluded by the swarm: two independent reports", self.swarm_wide & peers),
            ("excluded by most of its stage: round checks or reports", self.by_stage & peers),
            ("another params digest than most of its stage: a fork", self.forked & peers)) if named)


def exclusions_of(polled: Sequence[Sequence[PeerProgress]]) -> list[Exclusions]:
    """Each stage's :class:`Exclusions`, from one progress poll of every stage."""
    swarm_wide = excluded_by_majority([a for answers in polled for a in answers if a.step is not None])
    return [Exclusions(swarm_wide, excluded_by_stage(answers), forks(answers)) for answers in polled]


def poll_targets(peers: Sequence[RoutedPeer]) -> list[RoutedPeer]:
    """The peers of a stage whose progress a poll asks: not excluded (their word counts for nothing),
    and not banned unless they answered this trainer before (a sync trainer must not run ahead of an
    honest peer that missed one call; a banned newcomer is asked again once its ban ends)."""
    return [p for p in peers if not p.excluded and (p.proven or not p.banned)]


class SwarmView:
    """One router per stage, kept up to date from ``/swarm`` and from the stages' progress answers."""

    def __init__(self, swarm: SwarmClient, *, request_timeout_s: float, window: int, timing: Timing,
                 stage_wait_timeout_s: float = 120.0,
                 on_answer: Callable[[int, str, float], None] | None = None) -> None:
        self.swarm = swarm
        self.on_answer = on_answer  # (stage, peer, seconds): every progress answer's time (a round trip, at best)
        self.timing = timing
        self.stage_wait_timeout_s = stage_wait_timeout_s  # how long swarm_step waits for a silent stage
        self.routers: list[StageRouter] = []
        self._ceiling_s = request_timeout_s
        self._probation_slots = max(1, window // 4)
        self._listed: dict[int, list[PeerView]] = {}  # stage -> its peers, as /swarm last listed them
        self._steps: dict[int, dict[str, int]] = {}  # stage -> peer -> the step it last reported
        self._refreshing: asyncio.Task[None] | None = None  # a read of the stage map in the background
        self._refresh_failed: BaseException | None = None  # ... that failed with a bug: raised by the next poll
        #: the listed peers that some peer's last progress answer named as accused once (not excluded):
        #: the spot checks check their answers more (``swarmd.train.verify.CheckLedger.watch``)
        self.suspected: frozenset[str] = frozenset()

    def adopt(self, n_stages: int) -> None:
        """Set up one router per stage (once: a registration again keeps what they measured)."""
        if not self.routers:
            self.routers = [self._router(stage) for stage in range(n_stages)]

    def _router(self, stage: int) -> StageRouter:
        """A stage's router: timeouts capped by ``request_timeout_s``, probation peers holding at
        most a quarter of the window (at least one call), unproven peers called only once alive."""
        ceiling, t = self._ceiling_s, self.timing
        return StageRouter(stage, timeout_ceiling_s=ceiling, timeout_floor_s=min(t.timeout_floor_s, ceiling),
                           probation_timeout_s=min(t.probation_timeout_s, ceiling),
                           probation_slots=self._probation_slots, require_alive=True)

    async def refresh(self, force: bool = False) -> None:
        """Re-read the stage map from the daemon's ``/swarm`` (at most every ``refresh_s``)."""
        body = await self.swarm.stage_map(force=force)
        if body is None:
            return
        self._listed = peer_views(body)
        for stage, peers in self._listed.items():
            if 0 <= stage < len(self.routers):
                self.routers[stage].update_peers(peers)

    def refresh_soon(self) -> None:
        """Re-read the stage map in the background when it is due, not while the caller waits: the
        read is a DHT lookup behind the daemon's control plane, which takes seconds when a peer has
        just died (the lookup waits out its DHT node's RPC timeout, 2-3.6 s measured), and a trainer
        that awaited it in every poll stopped renewing its sample leases for that long (the lease
        book took them for a dead trainer's and granted their samples again). The polls go on with
        the map the routers have; the new one is adopted when it comes. One read at a time, owned
        here and cancelled by :meth:`aclose`; a read that fails with anything but the network errors
        :meth:`SwarmClient.stage_map` logs is raised by the next :meth:`poll`."""
        if self._refreshing is not None or not self.swarm.stage_map_due():
            return
        self._refreshing = asyncio.create_task(self.refresh(), name="swarmd-trainer-stage-map")
        self._refreshing.add_done_callback(self._refreshed)

    def _refreshed(self, task: asyncio.Task[None]) -> None:
        self._refreshing = None
        if not task.cancelled() and task.exception() is not None:
            self._refresh_failed = task.exception()

    async def aclose(self) -> None:
        """Cancel and await a read of the stage map still running in the background."""
        task = self._refreshing
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def announced(self, stage: int) -> list[float]:
        """The throughputs (samples/s of a forward and a backward) ``stage``'s serving peers announce in
        their records, as ``/swarm`` last listed them: their own compute, what ``swarmd.train.window``
        sizes the window by."""
        return [p.announced for p in self._listed.get(stage, []) if p.state is PeerState.SERVING]

    def unreachable(self, stage: int) -> list[str]:
        """The data addresses listed for ``stage`` that no member of the swarm could dial."""
        # a peer the swarm could not dial (``reachable: no``, swarmd.net.reachability) would only cost timeouts
        return [p.addr for p in self._listed.get(stage, []) if p.reachable == "no"]

    async def swarm_step(self) -> int:
        """The step the whole swarm has reached, once every stage has a peer that answered: a run
        counts its steps from it, and a stage not heard from yet is not at step 0 (a swarm resumed at
        step 50 whose last stage's peer was still starting would have been taken for a fresh one, and
        every step's loss booked where the run never looked). Waits at most ``stage_wait_timeout_s``, as
        a call waits for a usable peer (``swarmd.train.stage_calls``), and gives up in the same words."""
        deadline = time.monotonic() + self.stage_wait_timeout_s
        while True:
            progress = await self.poll()
            fronts = stage_fronts(progress)
            silent = [stage for stage, front in enumerate(fronts) if front is None]
            for stage in silent:  # a refusal that waiting cannot mend (no swarm key, another model): say it now
                refused = [p.error for p in progress[stage] if p.error and classify(p.error) is Action.FATAL]
                if refused:
                    raise TrainerError(f"stage {stage} refused this trainer's progress poll: {refused[0]}")
            if not silent:
                return min(f for f in fronts if f is not None) if fronts else 0
            if time.monotonic() > deadline:
                raise TrainerError(f"stage {silent[0]} has had no peer that answers for "
                                   f"{self.stage_wait_timeout_s:.0f}s; giving up"
                                   + unreachable_hint({}, self.unreachable(silent[0])))
            await asyncio.sleep(self.timing.no_peer_poll_s)

    async def poll(self, wait_step: int | Sequence[int] | None = None,
                   on_stage: Callable[[int, list[PeerProgress]], None] | None = None, *,
                   refresh: bool = True) -> list[list[PeerProgress]]:
        """Every serving peer's ``/v1/progress`` (step, samples held, averaging), per stage.

        A peer that does not answer is listed with ``step`` None: it may be dead (its record expires
        soon) or merely slow, and a synchronous trainer must not run ahead of a slow peer. With
        ``wait_step``, a long-poll: each peer answers once it reaches that step (one per stage, or
        one for all), or after ``Timing.progress_wait_s``. Peers on probation (never answered this
        trainer) are polled with a short timeout, and one never heard from does not hold the poll up
        (``SwarmClient.progress``: its poll may end in the background, told to :meth:`heard`). The
        answers also carry each peer's excluded set, which decides whom the routers leave out
        (:func:`exclusions_of`). ``on_stage(k, answers)``: each stage polled on its own, told as soon as
        its peers answered (a sync trainer's next batch need not wait for the slowest stage's answer).
        ``refresh``: re-read the stage map when it is due, in the background (:meth:`refresh_soon`;
        False: not at all). Either way the poll asks the peers the routers list now.
        """
        if self._refresh_failed is not None:
            failed, self._refresh_failed = self._refresh_failed, None
            raise failed
        if refresh:
            self.refresh_soon()
        stages: list[list[tuple[str, str]]] = []
        probation: set[str] = set()
        for router in self.routers:
            peers = poll_targets(router.snapshot())
            stages.append([(p.peer_id, p.addr) for p in peers])
            probation |= {p.peer_id for p in peers if not p.proven}

        def ask(of: list[list[tuple[str, str]]]) -> Awaitable[list[list[PeerProgress]]]:
            return self.swarm.progress(of, wait_step=wait_step, wait_s=self.timing.progress_wait_s,
                                       probation=probation, on_late=self.heard)

        if on_stage is None:
            polled = await ask(stages)
        else:
            async def one(stage: int) -> list[PeerProgress]:
                answers = (await ask([peers if k == stage else [] for k, peers in enumerate(stages)]))[stage]
                on_stage(stage, answers)
                return answers

            polled = await all_or_nothing(*(one(k) for k in range(len(stages))))
        for stage, answers in enumerate(polled):
            self._steps[stage] = {}  # only what this poll heard: a peer that did not answer has no step now
            for answer in answers:
                self.heard(stage, answer)
        self._adopt_exclusions(polled)
        named = {s for answers in polled for a in answers for s in a.suspected}
        self.suspected = frozenset(s for s in named if any(s in router for router in self.routers))
        return polled

    def heard(self, stage: int, answer: PeerProgress) -> None:
        """A peer's progress answer, in a poll or after it (a newcomer polled in the background):
        an unproven peer that answered may now be called, one on probation that did not answer
        (unreachable, or a reply it cannot read) is banned like a failed call."""
        if not 0 <= stage < len(self.routers) or answer.peer_id not in self.routers[stage]:
            return
        router = self.routers[stage]
        if answer.step is not None:
            self._steps.setdefault(stage, {})[answer.peer_id] = answer.step
            router.report_alive(answer.peer_id)
            if self.on_answer is not None and answer.seconds is not None:
                self.on_answer(stage, answer.peer_id, answer.seconds)
        elif answer.error is not None and answer.error.status in (0, 200) and not router.stats(answer.peer_id).proven:
            router.report_failure(answer.peer_id, timeout=timed_out(answer.error))

    async def stage_steps(self, stage: int, fresh: bool = False) -> dict[str, int]:
        """The steps ``stage``'s peers last reported (``/v1/progress``), polled again first when
        ``fresh``: what a spot check holds a reply's step against (``verify.step_beyond``)."""
        if fresh:  # only this poll's own answers: a late answer of an earlier poll may be older than the reply
            polled = await self.poll()
            return {a.peer_id: a.step for a in polled[stage] if a.step is not None} if stage < len(polled) else {}
        return dict(self._steps.get(stage, {}))

    def _adopt_exclusions(self, polled: Sequence[Sequence[PeerProgress]]) -> None:
        """Stop routing to the peers :func:`exclusions_of` names; say which of a stage's own are new."""
        for router, exclusions in zip(self.routers, exclusions_of(polled), strict=True):
            excluded = exclusions.all
            if excluded == router.excluded:
                continue
            newly = frozenset(p for p in excluded - router.excluded if p in router)
            if newly:
                log.warning("stage %d: not routing to %s (%s)", router.stage, ", ".join(sorted(p[:12] for p in newly)),
                            exclusions.reasons(newly))
            router.set_excluded(excluded)

