"""The trainer's view of the swarm: registration, heartbeats, the stage map and stage progress.

A trainer runs no DHT node (SWARM, section 3.2: trainers are light clients). It registers with
any daemon's control plane (``POST /trainers``), renews the registration with heartbeats (and
registers again when the daemon forgot it: a restart, a long silence; each heartbeat reports
the steps finished since the last one, with their loss and validation loss, and samples/s, so
the daemons can show the swarm's loss: ``swarmd.training_summary``), says when it finished
(``DELETE /trainers/{id}``; the daemon hands out ranks, the data shards, among training ones,
and refuses a ``--sync`` trainer while another one is registered), reads the stage map
from that daemon's ``GET /swarm``, and asks the serving peers themselves where their stages
stand (``GET /v1/progress``, through :class:`~swarmd.net.client.DataPlaneClient`), since the
DHT's view can be an announce period old. The bodies are parsed with the control plane's own
models (``swarmd.api.models``), so client and server share one schema.

This is I/O only; what the trainer does with the answers lives in ``swarmd.train.swarm_view``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from pydantic import ValidationError

from swarmd.api.models import MAX_REPORT_STEPS, SwarmView, TrainerWelcome
from swarmd.errors import PeerError, SwarmdError
from swarmd.net.client import DataPlaneClient
from swarmd.pipeline.routing import NewcomerPolls
from swarmd.pipeline.spec import ModelSpec, TrainingSpec
from swarmd.train.timing import Timing

__all__ = ["PeerProgress", "Registration", "SwarmClient", "TrainerError"]

log = logging.getLogger(__name__)

RATE_WINDOW_S = 30.0  # the span of the samples/s a trainer reports with its heartbeats

#: A daemon in these states serves soon: a registration it refuses is tried again.
STARTING_STATES = ("starting", "joining", "migrating")

class TrainerError(SwarmdError):
    """The trainer cannot go on (no peer for a stage within the timeout, a refused request)."""


@dataclass(frozen=True)
class Registration:
    """What a daemon answered ``POST /trainers`` with: this trainer's id and the swarm's settings."""

    trainer_id: str
    swarm: str
    spec: ModelSpec
    training: TrainingSpec
    rank: int | None = None  # handed out by the daemon: which data shard to draw from (None: an older daemon)


@dataclass(frozen=True)
class PeerProgress:
    """One serving peer's answer to ``GET /v1/progress``; ``step`` None when it did not answer
    (it may be dead, its record expiring soon, or merely slow)."""

    peer_id: str
    step: int | None
    samples: int = 0
    averaging: bool = False
    error: PeerError | None = None  # why it did not answer (step None)
    excluded: tuple[str, ...] = ()  # peers its stage excluded after two independent reports (issue #17)
    suspected: tuple[str, ...] = ()  # peers it holds one report against: checked more (issue #29)
    params_digest: str | None = None  # of its parameters at ``step`` (a forked peer's differs from its stage's)
    # how long it took to answer (a round trip, when it answered at once): a measurement, not part of the answer
    seconds: float | None = field(default=None, compare=False)


class SwarmClient:
    """Talks to one daemon's control plane and to the stages' data planes, for one trainer."""

    def __init__(
        self,
        api: str,
        *,
        http: aiohttp.ClientSession,
        data: DataPlaneClient,
        name: str = "trainer",
        api_token: str | None = None,
        refresh_s: float = 2.0,
        sync: bool = False,
        timing: Timing | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``sync``: registers a ``--sync`` trainer, which the daemon refuses while another one
        trains through it (see ``POST /trainers``). ``timing``: its polls' and reports' timeouts;
        ``clock``: what the reported rate and the stage map's age are measured by."""
        self.api = api.rstrip("/")
        self.name = name
        self.sync = sync
        self.refresh_s = refresh_s
        self.timing = timing if timing is not None else Timing()
        self._clock = clock
        self.registration: Registration | None = None
        self._http = http
        self._data = data
        self._headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        self._view_lock = asyncio.Lock()
        self._view_at = 0.0
        self._steps: list[dict[str, object]] = []  # steps finished since the last heartbeat got through
        self._samples = 0
        self._retries = self._bans = 0  # cumulative, reported with heartbeats (/metrics sums them)
        self._spot_checks: dict[str, int] | None = None  # cumulative spot-check counts (issue #17), when given
        self.newcomers = NewcomerPolls()  # how polls treat peers that never answered one (issue #18)
        self._answered: set[str] = set()  # peers that answered this client's last poll of them
        self._late: dict[str, asyncio.Task[PeerProgress]] = {}  # newcomers' polls left running in the background
        self.newcomer_stats = {"probed": 0, "left_running": 0, "over_budget": 0}  # counts of never-seen peers' polls
        # (monotonic, samples) at each step seen in the last RATE_WINDOW_S: the reported rate spans that
        # window, not the time since the last heartbeat (a final report right after one said 0 samples/s)
        self._seen: deque[tuple[float, int]] = deque()

    # ---- registration ----------------------------------------------------------------------

    async def register(self) -> Registration:
        """Register (again) with the daemon; TrainerError when it refuses or cannot be reached. A daemon
        still starting, joining its swarm or moving between stages (503 ``NotReady``) is waited for, up to
        ``timing.register_wait_s``; one that is draining is not."""
        deadline = self._clock() + self.timing.register_wait_s
        said = False
        while True:
            try:
                request = {"name": self.name, "sync": self.sync}
                async with self._http.post(f"{self.api}/trainers", json=request, headers=self._headers) as r:
                    body = await r.json(content_type=None)
                    status = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                raise TrainerError(f"cannot register with the daemon at {self.api}: {exc}") from exc
            if status == 201:
                break
            message = body.get("message", body) if isinstance(body, dict) else body
            starting = (status == 503 and isinstance(body, dict) and body.get("error") == "NotReady"
                        and body.get("state") in STARTING_STATES)
            if not starting or self._clock() >= deadline:
                raise TrainerError(f"{self.api} refused the registration ({status}): {message}")
            if not said:
                said = True
                log.info("the daemon at %s is not serving yet (%s): waiting up to %.0fs for it", self.api, message,
                         deadline - self._clock())
            await asyncio.sleep(self.timing.register_retry_s)
        try:
            welcome = TrainerWelcome.model_validate(body)
            registration = Registration(trainer_id=welcome.trainer_id, swarm=welcome.swarm,
                                        spec=ModelSpec.from_dict(welcome.model.spec),
                                        training=TrainingSpec.from_dict(welcome.training), rank=welcome.rank)
        except (ValidationError, SwarmdError, ValueError, TypeError) as exc:
            raise TrainerError(f"the daemon at {self.api} answered the registration with an unreadable body: "
                               f"{exc}") from exc
        self.registration = registration
        if not self._seen:  # the rate's window starts here: samples counted by the first step seen count too
            self._seen.append((self._clock(), self._samples))
        log.info("registered as trainer %s with swarm %r: model %s, %d stages, target batch %d",
                 registration.trainer_id, registration.swarm, registration.spec.name, registration.spec.n_stages,
                 registration.training.target_batch_size)
        return registration

    def observe_step(self, step: int, loss: float | None, samples: int, val_loss: float | None = None,
                     *, retries: int = 0, bans: int = 0, spot_checks: Mapping[str, int] | None = None) -> None:
        """A step the swarm took, as this trainer saw it: reported with the next heartbeat."""
        def finite(v: float | None) -> float | None:
            return v if v is not None and math.isfinite(v) else None

        self._samples = samples
        self._seen.append((self._clock(), samples))  # without a registration, the first one only starts the window
        self._prune(self._clock())
        self._retries, self._bans = retries, bans
        if spot_checks is not None:
            self._spot_checks = dict(spot_checks)
        self._steps.append({"step": step, "loss": finite(loss), "val_loss": finite(val_loss)})
        del self._steps[:-MAX_REPORT_STEPS]  # a long silence: the newest steps are the ones to show

    def samples_per_s(self, now: float | None = None) -> float:
        """This trainer's samples per second over the last :data:`RATE_WINDOW_S` (0 once it has
        seen no step for that long): a rate that neither says 0 right after a heartbeat nor
        stays high while the trainer is stalled."""
        now = self._clock() if now is None else now
        self._prune(now)
        if not self._seen or now <= self._seen[0][0]:
            return 0.0
        t0, s0 = self._seen[0]
        return max(0.0, (self._samples - s0) / (now - t0))

    def _prune(self, now: float) -> None:
        while len(self._seen) > 1 and self._seen[1][0] <= now - RATE_WINDOW_S:
            self._seen.popleft()  # keep the newest observation before the window as its start

    def _report(self) -> dict[str, object]:
        report: dict[str, object] = {"steps": list(self._steps), "samples": self._samples,
                                     "samples_per_s": round(self.samples_per_s(), 3), "retries": self._retries,
                                     "bans": self._bans}
        if self._spot_checks is not None:
            report["spot_checks"] = self._spot_checks
        return report

    async def heartbeat(self) -> bool:
        """Renew the registration, reporting the steps since the last heartbeat; False when the
        daemon no longer knows it (register again). A heartbeat that does not get through is
        logged and counts as renewed (its steps go with the next one)."""
        if self.registration is None:
            return False
        # built each time: after a registration again the trainer has a new id
        url = f"{self.api}/trainers/{self.registration.trainer_id}/heartbeat"
        report = self._report()
        try:
            async with self._http.post(url, json=report, headers=self._headers) as r:
                if r.status == 204:
                    del self._steps[:len(report["steps"])]  # type: ignore[arg-type]  # a list, built above
                return r.status != 404
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("heartbeat to %s failed: %s", url, exc)
            return True

    async def flush(self, samples: int | None = None) -> None:
        """Report the last steps when the trainer finishes, and its final count of ``samples``
        (what completed after the last step it saw counts too); bounded: a gone daemon costs seconds."""
        if samples is not None and samples != self._samples:
            self._samples = samples
        elif not self._steps:
            return
        try:
            await asyncio.wait_for(self.heartbeat(), self.timing.flush_timeout_s)
        except asyncio.TimeoutError:
            log.warning("the last training report to %s timed out", self.api)

    async def unregister(self) -> None:
        """Tell the daemon this trainer finished (so a ``--sync`` trainer may start after it at
        once); bounded and best-effort: the registration expires anyway."""
        if self.registration is None:
            return
        url = f"{self.api}/trainers/{self.registration.trainer_id}"

        async def delete() -> None:
            async with self._http.delete(url, headers=self._headers):
                pass

        try:
            await asyncio.wait_for(delete(), self.timing.flush_timeout_s)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("ending the registration at %s failed: %s", url, exc)

    async def keep_registered(self, period_s: float, on_registered: Callable[[Registration], None]) -> None:
        """Heartbeat every ``period_s`` until cancelled; register again when forgotten and tell
        ``on_registered``. A failed registration is retried at the next period."""
        while True:
            await asyncio.sleep(period_s)
            if await self.heartbeat():
                continue
            log.warning("the daemon forgot this trainer's registration; registering again")
            try:
                on_registered(await self.register())
            except TrainerError as exc:
                log.warning("registering again failed: %s", exc)

    # ---- the stage map ---------------------------------------------------------------------

    def stage_map_due(self) -> bool:
        """Whether :meth:`stage_map` would read ``/swarm`` now (its last read is ``refresh_s`` old)."""
        return self._clock() - self._view_at >= self.refresh_s

    async def stage_map(self, *, force: bool = False) -> SwarmView | None:
        """The daemon's ``/swarm``: every stage's listed peers (``swarmd.train.swarm_view.peer_views``
        reads them); None when it was read less than ``refresh_s`` ago (unless ``force``) or could
        not be read (logged: the trainer keeps its last view)."""
        async with self._view_lock:
            if not force and not self.stage_map_due():
                return None
            try:
                # off loopback the control plane's read-only endpoints need the token too
                async with self._http.get(f"{self.api}/swarm", headers=self._headers) as r:
                    if r.status != 200:
                        raise TrainerError(f"GET /swarm answered {r.status}")
                    return SwarmView.model_validate(await r.json(content_type=None))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, ValidationError, TrainerError) as exc:
                log.warning("could not refresh the stage map: %s", exc)
                return None
            finally:
                self._view_at = self._clock()

    # ---- progress --------------------------------------------------------------------------

    async def progress(
        self, stages: Sequence[Sequence[tuple[str, str]]], *, wait_step: int | Sequence[int] | None = None,
        wait_s: float = 0.5,
        probation: Collection[str] = (), on_late: Callable[[int, PeerProgress], None] | None = None,
    ) -> list[list[PeerProgress]]:
        """Every listed peer's progress (``stages[k]``: ``(peer_id, data_addr)`` pairs), per stage,
        all polled at once. With ``wait_step``, a long-poll: each peer answers once it reaches
        that step (``wait_step[k]`` for stage ``k``'s peers, when one per stage), or after ``wait_s``.
        Peers in ``probation`` (never answered the trainer's calls) get
        ``Timing.probation_progress_timeout_s`` instead of ``Timing.progress_timeout_s``.

        Peers that never answered a poll of this client (newcomers, or fakes: issue #18) do not
        hold the poll up (:class:`~swarmd.pipeline.routing.NewcomerPolls`): once the others are
        in, they get a short grace; one still silent then is left out of the answers, its poll
        goes on in the background (one at a time per peer, owned, awaited by :meth:`aclose`) and
        ``on_late(stage, answer)`` hears how it ended. At most ``newcomers.rate`` never-seen
        peers per second are probed; the others wait for a later poll."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        waits = wait_step is not None
        per_stage = [wait_step] * len(stages) if wait_step is None or isinstance(wait_step, int) else list(wait_step)
        if len(per_stage) != len(stages):
            raise ValueError(f"{len(per_stage)} wait steps for {len(stages)} stages")

        async def one(stage: int, peer_id: str, addr: str) -> PeerProgress:
            limit = (self.timing.probation_progress_timeout_s if peer_id in probation
                     else self.timing.progress_timeout_s)
            sent = loop.time()
            try:
                reply = await self._data.progress(addr, wait_step=per_stage[stage], wait_s=wait_s if waits else None,
                                                  timeout_s=limit + (wait_s if waits else 0.0))
            except PeerError as exc:
                self._answered.discard(peer_id)
                return PeerProgress(peer_id, None, error=exc)
            self._answered.add(peer_id)
            if reply.stage != stage:  # it serves another stage now (it moved): no step of this one, and its step
                return PeerProgress(peer_id, None)  # there must not be held against its replies here (spot checks)
            return PeerProgress(peer_id, reply.step, reply.samples, reply.averaging, excluded=reply.excluded,
                                suspected=reply.suspected, params_digest=reply.params_digest,
                                seconds=loop.time() - sent)

        self._answered &= {pid for peers in stages for pid, _ in peers}  # bounded by the listed peers
        trusted: dict[asyncio.Task[PeerProgress], int] = {}
        newcomers: dict[asyncio.Task[PeerProgress], int] = {}
        order: list[tuple[int, str, asyncio.Task[PeerProgress]]] = []
        fresh = [(k, pid, addr) for k, peers in enumerate(stages) for pid, addr in peers
                 if pid not in self._answered and pid not in self._late]
        allowed = {pid for _, pid, _ in fresh[:self.newcomers.take(len(fresh))]}
        self.newcomer_stats["probed"] += len(allowed)
        self.newcomer_stats["over_budget"] += len(fresh) - len(allowed)
        for k, peers in enumerate(stages):
            for pid, addr in peers:
                if pid in self._late or (pid not in self._answered and pid not in allowed):
                    continue  # a poll of it is still out, or over the probe budget: not in this answer
                task = asyncio.create_task(one(k, pid, addr), name=f"swarmd-progress-{pid[:12]}")
                (trusted if pid in self._answered else newcomers)[task] = k
                order.append((k, pid, task))
        answered = [False] * len(stages)
        pending = set(trusted) | set(newcomers)
        try:
            await self._gather_ready(pending, trusted, newcomers, answered, began)
        except BaseException:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            raise
        out: list[list[PeerProgress]] = [[] for _ in stages]
        for k, pid, task in order:
            if not task.done():  # a newcomer still silent: finishes in the background, told to on_late
                self._late[pid] = task
                self.newcomer_stats["left_running"] += 1
                task.add_done_callback(functools.partial(self._late_done, pid, k, on_late))
            else:
                out[k].append(task.result())
        return out

    async def _gather_ready(
        self, pending: set[asyncio.Task[PeerProgress]], trusted: dict[asyncio.Task[PeerProgress], int],
        newcomers: dict[asyncio.Task[PeerProgress], int], answered: list[bool], began: float,
    ) -> None:
        """Wait for ``pending`` polls as :class:`NewcomerPolls` says (``answered`` filled in per
        stage); newcomers' polls still running when the grace ends are left running."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        while pending:
            if deadline is None and self.newcomers.ready(
                    sum(1 for t in trusted if t in pending), answered,
                    [sum(1 for t, k in newcomers.items() if k == stage and t in pending)
                     for stage in range(len(answered))]):
                deadline = loop.time() + self.newcomers.grace_s(loop.time() - began)
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            if timeout == 0.0:
                break
            done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            pending -= done
            for task in done:
                k = trusted.get(task, newcomers.get(task, 0))
                answered[k] = answered[k] or task.result().step is not None

    def _late_done(self, peer_id: str, stage: int, on_late: Callable[[int, PeerProgress], None] | None,
                   task: asyncio.Task[PeerProgress]) -> None:
        self._late.pop(peer_id, None)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # one() turns every PeerError into an answer: anything else is a bug, said loudly
            log.error("a background progress poll of %s failed", peer_id[:12], exc_info=exc)
            return
        if on_late is not None:
            on_late(stage, task.result())

    async def aclose(self) -> None:
        """Cancel and await the progress polls still running in the background."""
        late = list(self._late.values())
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        self._late.clear()
