"""The trainer: a lightweight client that drives microbatches through the swarm's stages.

SWARM's trainers (paper, section 3.2) hold no parameters. A trainer registers with any daemon's
control plane, learns the stage map from that daemon's ``GET /swarm`` (it runs no DHT node),
and sends each microbatch through one peer per stage, picked by stochastic wiring
(``swarmd.pipeline.routing``): forward through stages ``0..S-2``, a fused forward + backward on
the last stage (loss and input gradients in one round trip), then backward through
``S-2..0``. Many microbatches are in flight at once (a bounded window), so every stage is busy.

Faults: a peer that fails or times out is banned with exponential backoff and the call is
retried on another peer of the same stage; a stage with no live peer makes the trainer wait
(and say so) until one appears, up to a timeout. A backward refused as ``StaleStep`` (the
stage stepped since this microbatch's forward) redoes the whole microbatch, so its gradient is
never mixed into the wrong step and the microbatch is never lost: every microbatch issued is
completed, and ``microbatches_issued == microbatches_completed`` at the end.

Steps: in the default (asynchronous) mode the stages step on their own whenever the swarm
accumulated ``target_batch_size`` samples, from every trainer together. The trainer paces
itself through the first stage's sample reservations (``POST /v1/reserve``, the lease book of
``swarmd.pipeline.reservations``): it starts a microbatch only under a lease for the stage's
current step, so all trainers' in-flight work plus what the stages hold never exceeds the
target, each step aggregates exactly the target batch, and few microbatches straddle a step and
get redone. A trainer that finds the step full waits for it (a long-poll). Without a lease book
(a single stage, delayed updates, a peer of an older version) it paces from what the stages hold
and what *it* has in flight. In ``sync`` mode the trainer sends exactly one
global batch per step and waits until every peer of every stage has stepped (a long-poll of
``/v1/progress``), which makes a swarm compute exactly what single-process training computes
(the equivalence test); the batch's first and last microbatches are halved and the first one
leads, which shortens the pipeline's fill and drain at every step.

Each attempt of a microbatch carries a random 64-bit id (``meta.mb``); its backward on a stage
goes to the peer that ran its forward while that peer is usable, where the activations are
still cached (``swarmd.pipeline.executor``), so the forward is not recomputed. Any other peer
serves it statelessly.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

import aiohttp
import torch

from swarmd.errors import ConfigError, PeerError
from swarmd.net.client import DataPlaneClient, client_session
from swarmd.net.messages import BackwardReply, ForwardReply, ReserveReply, ReserveRequest
from swarmd.pipeline.failures import Action, classify
from swarmd.pipeline.routing import StageRouter
from swarmd.pipeline.spec import ModelSpec, TrainingSpec
from swarmd.swarm_key import SwarmKey
from swarmd.train.data import BatchSampler, load_corpus, shard, val_batches
from swarmd.train.events import CallDone, StepDone, StepWait, TrainerListener
from swarmd.train.swarm_client import PeerProgress, Registration, SwarmClient, TrainerError

__all__ = ["TrainSummary", "Trainer", "TrainerConfig", "TrainerError", "split_batch"]

log = logging.getLogger(__name__)

R = TypeVar("R")

PROGRESS_WAIT_S = 0.5  # how long one /v1/progress long-poll may wait for a step
#: A backward's peer adds its gradient only within this share of the trainer's request timeout
#: (the rest covers the way there and back): past it the trainer may have retried elsewhere.
DEADLINE_SHARE = 0.75
#: How long a leased microbatch waits for a stage still at the previous step (finishing its
#: round) before it is sent anyway (a stage short of samples would never step without it).
STAGE_CATCH_UP_S = 2.0


def split_batch(batch: int, microbatch: int, *, taper: bool = False) -> list[int]:
    """Microbatch sizes for one global batch: ``microbatch`` each, the remainder last.

    ``taper``: the first microbatch is half size, and so is the last (``32, 8`` gives
    ``4 8 8 8 4``; ``36, 8`` gives ``4 8 8 8 4 4``). In sync mode the pipeline fills and drains
    at every step, and only the first microbatch's forwards and the last one's backwards run
    while the other stages idle: halving those shortens the step by about half a microbatch's
    compute on every stage but the slowest. The samples (drawn one after another) and so the
    step's gradient are the same however the batch is split, up to float rounding.
    """
    sizes: list[int] = []
    taper = taper and microbatch > 1 and batch > microbatch
    if taper:
        sizes.append(microbatch // 2)
    rest = batch - sum(sizes)
    sizes += [microbatch] * (rest // microbatch)
    if rest % microbatch:
        sizes.append(rest % microbatch)
    elif taper and len(sizes) > 2:  # the last is a full one: halve it too
        sizes[-1:] = [microbatch - microbatch // 2, microbatch // 2]
    return sizes


def _front_step(progress: list[list[PeerProgress]]) -> int:
    """The step the whole swarm has reached: the slowest stage's most advanced peer (0 if a
    stage has no peer that answered)."""
    fronts = [max((p.step for p in peers if p.step is not None), default=None) for peers in progress]
    known = [f for f in fronts if f is not None]
    return min(known) if len(known) == len(fronts) and known else 0


class _Redo(Exception):
    """A backward was refused as stale: redo the whole microbatch at the stages' new step."""


@dataclass(frozen=True)
class TrainerConfig:
    api: str  # control-plane URL of any daemon of the swarm, e.g. http://127.0.0.1:8080
    steps: int = 100  # optimizer steps the swarm should take from now
    data: str | None = None  # text file or folder; None: the Python standard library's sources
    batch_size: int | None = None  # samples per step (sync mode); None: the swarm's target_batch_size
    microbatch_size: int = 8
    codec: str = "8bit"  # activations and their gradients between stages
    seed: int = 0
    window: int = 8  # microbatches in flight at once
    taper: bool = True  # sync mode: halve the step's first and last microbatch (see split_batch)
    sync: bool = False
    val_every: int = 10  # steps between validation losses (0: only at the end)
    val_batches: int = 4
    request_timeout_s: float = 60.0
    stage_wait_timeout_s: float = 120.0  # give up when a stage has had no usable peer this long
    refresh_s: float = 2.0  # how often the stage map is re-read from /swarm
    heartbeat_s: float = 10.0  # how often the registration is renewed (daemons forget it after 30 s)
    max_corpus_bytes: int = 8 * 2**20
    name: str = "trainer"
    max_seconds: float | None = None  # stop after the step that ends past this (chaos runs)
    api_token: str | None = None  # the daemon's control-plane token, when it has one
    swarm_key: SwarmKey | None = None  # a private swarm's key: signs every data-plane request
    reserve: bool = True  # pace through the first stage's sample reservations (False: each trainer on its own)
    lease_s: float = 5.0  # sample reservations expire this long after the last renewal (a dead trainer's)
    data_shards: int = 16  # the training split is cut in this many shards; each async trainer draws from one
    shard: int | None = None  # which one; None: the rank the daemon handed out at registration

    def __post_init__(self) -> None:
        for name in ("steps", "microbatch_size", "window", "val_batches", "max_corpus_bytes", "data_shards"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError("--batch-size must be at least 1")
        if self.val_every < 0:
            raise ConfigError("--val-every must not be negative")
        if self.shard is not None and self.shard < 0:
            raise ConfigError("--shard must not be negative")
        if not 0.5 <= self.lease_s <= 300:
            raise ConfigError("--lease-s must lie in [0.5, 300] seconds")


@dataclass
class TrainSummary:
    steps: int = 0
    first_loss: float | None = None
    final_loss: float | None = None
    val_loss: float | None = None
    samples_per_s: float = 0.0
    retries: int = 0
    bans: int = 0
    stale_redos: int = 0
    topup_microbatches: int = 0
    microbatches_issued: int = 0
    microbatches_completed: int = 0
    samples: int = 0
    duplicates: int = 0  # backwards a stage had counted already (a retry after a lost answer): not added twice
    leases: int = 0  # sample reservations granted to this trainer
    full_waits: int = 0  # times the step was fully reserved and the trainer waited for it
    shard: int | None = None  # the shard of the training split it drew from (None: the whole split)
    elapsed_s: float = 0.0
    step_losses: list[float] = field(default_factory=list)
    step_samples: list[int] = field(default_factory=list)  # its share of each step: samples counted at it
    val_losses: list[tuple[int, float]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The summary as strict JSON values: a loss that is undefined (NaN: a step none of this
        trainer's samples were computed at) or infinite is None, so ``json.dumps(...,
        allow_nan=False)`` accepts it and other languages' parsers do too."""
        return _strict_json(asdict(self))


def _strict_json(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def unreachable_hint(failures: dict[str, PeerError], unreachable: Sequence[str] = ()) -> str:
    """The end of a give-up sentence: the addresses that failed and why, or that no member of the
    swarm could dial, with the likely cause (a firewall, a NAT, a wrong ``--announce``)."""
    cause = "a firewall or NAT in the way, or a wrong --announce on that peer?"
    parts = []
    if unreachable:
        parts.append(f"{len(unreachable)} peer(s) listed at {', '.join(unreachable[:3])} could not be dialled by "
                     f"other members (reachable: no; {cause})")
    if failures:
        shown = "; ".join(f"{addr}: {exc.message or exc.error}" for addr, exc in list(failures.items())[-3:])
        hint = f" ({cause})" if all(exc.status == 0 for exc in failures.values()) else ""
        parts.append(f"its peers failed: {shown}{hint}")
    return (". " + "; ".join(parts)) if parts else ""


class Trainer:
    """Drives ``config.steps`` optimizer steps of the swarm behind ``config.api``.

    Observers: ``on_step(done, loss, progress)`` after every step of the swarm (``loss`` NaN
    when none of this trainer's samples were computed at that step), and ``events``, a
    listener for every typed event (``swarmd.train.events``: calls, waits for a step, steps).
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        on_step: Callable[[int, float, dict[str, Any]], None] | None = None,
        events: TrainerListener | None = None,
    ) -> None:
        self.config = config
        self.on_step = on_step
        self.events = events
        self.summary = TrainSummary()
        self.spec: ModelSpec | None = None
        self.training: TrainingSpec | None = None
        self.routers: list[StageRouter] = []
        self._last_failures: dict[int, dict[str, PeerError]] = {}  # stage -> addr -> its last failure
        self.trainer_id: str | None = None
        self._swarm: SwarmClient | None = None
        self._client: DataPlaneClient | None = None
        self._step_losses: dict[int, list[tuple[float, int]]] = {}
        self._step_samples: dict[int, int] = {}  # first-stage step -> this trainer's samples counted at it
        self._rank: int | None = None
        self._reserving = config.reserve  # False once the first stage turned out to have no lease book (an older peer)

    # ---- public ------------------------------------------------------------------------------

    async def run(self) -> TrainSummary:
        cfg = self.config
        started = time.monotonic()
        async with client_session(cfg.swarm_key, timeout=aiohttp.ClientTimeout(total=30)) as http, \
                DataPlaneClient(timeout_s=cfg.request_timeout_s, swarm_key=cfg.swarm_key) as client:
            self._client = client
            self._swarm = SwarmClient(cfg.api, http=http, data=client, name=cfg.name, api_token=cfg.api_token,
                                      refresh_s=cfg.refresh_s, sync=cfg.sync)
            spec, _ = self._registered(await self._swarm.register(), first=True)
            corpus = await asyncio.to_thread(
                load_corpus, cfg.data, max_bytes=cfg.max_corpus_bytes, seed=cfg.seed, seq_len=spec.seq_len
            )
            index = cfg.shard if cfg.shard is not None else self._rank
            train, self.summary.shard = corpus.train, None
            if index is not None and cfg.data_shards > 1 and not cfg.sync:  # a sync trainer trains alone: all of it
                train = shard(corpus.train, index % cfg.data_shards, cfg.data_shards, spec.seq_len)
                self.summary.shard = index % cfg.data_shards if train is not corpus.train else None
            sampler = BatchSampler(train, spec.seq_len, seed=cfg.seed)
            validation = val_batches(corpus.val, spec.seq_len, cfg.microbatch_size, cfg.val_batches)
            heartbeat = asyncio.create_task(self._swarm.keep_registered(cfg.heartbeat_s, self._registered_again),
                                            name="swarmd-trainer-heartbeat")
            try:
                await self._refresh_view(force=True)
                if cfg.sync:
                    await self._run_sync(sampler, validation)
                else:
                    await self._run_async(sampler, validation)
                if not self.summary.val_losses or self.summary.val_losses[-1][0] != self.summary.steps:
                    await self._validate(validation)
            finally:
                heartbeat.cancel()
                await asyncio.gather(heartbeat, return_exceptions=True)
                await self._swarm.flush()  # the last steps' losses, for the daemons' curves
                await self._swarm.unregister()
        s = self.summary
        s.elapsed_s = round(time.monotonic() - started, 3)
        s.samples_per_s = round(s.samples / s.elapsed_s, 2) if s.elapsed_s else 0.0
        return s

    def progress(self) -> dict[str, Any]:
        s = self.summary
        return {
            "samples": s.samples,
            "retries": s.retries,
            "stale_redos": s.stale_redos,
            "peers": [r.usable_count for r in self.routers],
            "val_loss": s.val_loss,
        }

    # ---- registration and the stage map -----------------------------------------------------

    def _registered(self, registration: Registration, *, first: bool = False) -> tuple[ModelSpec, TrainingSpec]:
        """Adopt a registration: the first sets up one router per stage; a registration again
        (the daemon forgot us) only takes the new id, keeping what the routers measured."""
        self.trainer_id = registration.trainer_id
        if first:
            self._rank = registration.rank
            self.spec, self.training = registration.spec, registration.training
            self.routers = [StageRouter(stage) for stage in range(registration.spec.n_stages)]
        return registration.spec, registration.training

    def _registered_again(self, registration: Registration) -> None:
        self._registered(registration)

    async def _refresh_view(self, force: bool = False) -> None:
        """Re-read the stage map from the daemon's /swarm (at most every ``refresh_s``)."""
        view = await self._require_swarm().stage_map(force=force)
        if view is None:
            return
        for stage, peers in view.items():
            if 0 <= stage < len(self.routers):
                self.routers[stage].update_peers(peers)

    def _require_swarm(self) -> SwarmClient:
        if self._swarm is None:
            raise RuntimeError("the trainer is not running")
        return self._swarm

    # ---- the two modes ---------------------------------------------------------------------------

    async def _run_async(self, sampler: BatchSampler, validation: list) -> None:
        """Keep up to ``window`` microbatches in flight until the swarm has taken ``steps`` steps.

        Paced (without delayed updates): a microbatch starts only under a lease of the first
        stage's book for its current step (:meth:`_reserve`); without a book, only while the
        samples the stages hold for their current step plus those this trainer has in flight
        fall short of the target batch. Either way few microbatches straddle a step (their
        backward would be refused as stale and the whole microbatch redone); once the batch is
        complete, the trainer waits for the step.
        """
        cfg = self.config
        start = await self._swarm_step()
        target = start + cfg.steps
        started = time.monotonic()
        done_steps = 0
        in_flight: set[asyncio.Task[tuple[float, int, int]]] = set()
        sizes: dict[asyncio.Task[tuple[float, int, int]], int] = {}
        leases: dict[asyncio.Task[tuple[float, int, int]], int] = {}  # task -> its lease id
        done_leases: list[int] = []  # finished under a lease, not reported yet
        try:
            while True:
                progress = await self._poll_progress()
                step_now = _front_step(progress)
                while done_steps < step_now - start:
                    done_steps += 1
                    await self._finish_step(start + done_steps - 1, done_steps, validation)
                if step_now >= target or (
                    cfg.max_seconds is not None and time.monotonic() - started > cfg.max_seconds
                ):
                    break
                room = cfg.window - len(in_flight)
                reply = await self._reserve(progress, room, done_leases, list(leases.values()))
                if reply is not None:
                    done_leases.clear()
                    if reply.leases:
                        await self._await_rounds_taken(progress, reply.step)
                    for lease_id, samples in reply.leases:
                        x, y = sampler.sample(samples)
                        task = asyncio.create_task(self._microbatch(x, y, lease_step=reply.step))
                        in_flight.add(task)
                        sizes[task], leases[task] = samples, lease_id
                    self.summary.leases += len(reply.leases)
                    if not reply.leases and room and reply.reserved >= reply.target:
                        self.summary.full_waits += 1
                elif not self._paced_by_book():
                    budget = self._pace_budget(progress, sum(sizes[t] for t in in_flight))
                    while len(in_flight) < cfg.window and (budget is None or budget > 0):
                        x, y = sampler.sample(cfg.microbatch_size)
                        task = asyncio.create_task(self._microbatch(x, y))
                        in_flight.add(task)
                        sizes[task] = x.shape[0]
                        if budget is not None:
                            budget -= x.shape[0]
                if not in_flight:  # the stages hold (or have reserved) a full batch: wait until they step
                    if reply is None and self._paced_by_book():  # the book did not answer: ask again shortly
                        await asyncio.sleep(0.1)
                    else:
                        await self._poll_progress(wait_step=(reply.step if reply is not None else step_now) + 1)
                    continue
                done, in_flight = await asyncio.wait(in_flight, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    sizes.pop(task, None)
                    lease_done = leases.pop(task, -1)
                    if lease_done >= 0 and not task.cancelled() and task.exception() is None:
                        done_leases.append(lease_done)
                # retrieve every error (else asyncio logs "Task exception was never retrieved" for
                # each failed microbatch after the first), then raise the first one
                failed = [task for task in done if not task.cancelled() and task.exception() is not None]
                for task in failed[:1] or done:
                    task.result()
            # finish what is in flight rather than abandon it: every microbatch issued completes
            # (its gradients count towards the swarm's next step)
            for finished in asyncio.as_completed(in_flight):
                await finished
            done_leases += leases.values()
            in_flight = set()
            if done_leases:  # report them, or the book would take them for a dead trainer's and grant them again
                await self._reserve(await self._poll_progress(), 0, done_leases, [])
        finally:
            for task in in_flight:  # only after an error: cancel the rest
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    def _paced_by_book(self) -> bool:
        """Whether this swarm paces through the first stage's lease book (see ``_run_async``)."""
        training, spec = self._require_training(), self._require_spec()
        return self._reserving and not training.delay_updates and spec.n_stages >= 2

    def _book_peer(self) -> tuple[str, str] | None:
        """The first stage's peer whose lease book this trainer uses: the smallest usable peer
        id, so that trainers with the same stage map use the same book."""
        for peer in self.routers[0].snapshot() if self.routers else []:
            if not peer["banned_for_s"]:
                return peer["id"], peer["addr"]
        return None

    async def _reserve(
        self, progress: list[list[PeerProgress]], room: int, done: Sequence[int], renew: Sequence[int]
    ) -> ReserveReply | None:
        """Up to ``room`` leases for the first stage's current step, reporting ``done`` leases and
        renewing ``renew``; None when this swarm paces without a lease book (see ``_run_async``)
        or the book's peer failed (it is banned: the next call asks the next peer)."""
        if not self._paced_by_book():
            return None
        book = self._book_peer()
        if book is None or self.trainer_id is None:
            return None
        peer_id, addr = book
        seen = [p for p in progress[0] if p.step is not None] if progress else []
        front = max((p.step for p in seen if p.step is not None), default=None)
        held = sum(p.samples for p in seen if p.step == front)
        complete = seen and len(seen) == len(progress[0])  # every stage-0 peer answered: the sum is the stage's
        request = ReserveRequest(stage=0, trainer=self.trainer_id, step=front or 0, size=self.config.microbatch_size,
                                 count=max(0, room), lease_s=self.config.lease_s, done=tuple(done),
                                 renew=tuple(renew), held=held if complete and front is not None else None)
        try:
            return await self._require_client().reserve(addr, request, timeout_s=min(10.0,
                                                                                      self.config.request_timeout_s))
        except PeerError as exc:
            if exc.status == 404:  # a peer of an older version: no lease book anywhere, most likely
                log.warning("stage 0 peer %s has no lease book (%s); pacing without reservations", peer_id[:12], exc)
                self._reserving = False
            elif classify(exc) is Action.FATAL:  # e.g. 401 without the swarm key: no retry can fix it
                raise TrainerError(f"stage 0 peer {peer_id[:12]} refused a request: {exc}") from exc
            else:
                log.warning("stage 0 peer %s did not grant reservations (%s)", peer_id[:12], exc)
                if classify(exc) is Action.BAN:
                    self.routers[0].report_failure(peer_id)
                    self.summary.bans += 1
            return None

    async def _await_rounds_taken(self, progress: list[list[PeerProgress]], step: int) -> None:
        """Before the microbatches of ``step`` start: wait (briefly) while a later stage holds a
        full batch of the step before and has not taken it out for its round yet, so a new
        microbatch's fused backward on the last stage cannot slip into the previous step."""
        training = self._require_training()
        deadline = time.monotonic() + STAGE_CATCH_UP_S
        while time.monotonic() < deadline:
            pending = False
            for peers in progress[1:]:
                seen = [p for p in peers if p.step is not None]
                front = max((p.step for p in seen if p.step is not None), default=step)
                at_front = [p for p in seen if p.step == front]
                if front < step and sum(p.samples for p in at_front) >= training.target_batch_size \
                        and not all(p.averaging for p in at_front):
                    pending = True
            if not pending:
                return
            await asyncio.sleep(0.01)
            progress = await self._poll_progress()

    async def _run_sync(self, sampler: BatchSampler, validation: list) -> None:
        """One global batch per step; wait until every peer of every stage has stepped."""
        training = self._require_training()
        cfg = self.config
        batch = cfg.batch_size or training.target_batch_size
        if batch < training.target_batch_size:
            raise ConfigError(
                f"--batch-size {batch} is below the swarm's target_batch_size {training.target_batch_size}: "
                "in --sync mode the stages would never step"
            )
        start = await self._swarm_step()
        began = time.monotonic()
        for i in range(cfg.steps):
            if cfg.max_seconds is not None and time.monotonic() - began > cfg.max_seconds:
                break
            step = start + i
            sizes = split_batch(batch, cfg.microbatch_size, taper=cfg.taper and len(self.routers) > 1)
            microbatches = [sampler.sample(size) for size in sizes]  # drawn in order: reproducible
            semaphore = asyncio.Semaphore(cfg.window)
            # the first microbatch leads: the others start once its first forward is back, so
            # stage 0 computes it first (requests sent together reach the worker in any order)
            # and the next stage starts after the step's smallest forward, not a larger one
            led = asyncio.Event()

            async def one(index: int, x: torch.Tensor, y: torch.Tensor, led: asyncio.Event = led,
                          semaphore: asyncio.Semaphore = semaphore) -> tuple[float, int, int]:
                if index:
                    await led.wait()
                async with semaphore:
                    return await self._microbatch(x, y, on_forward=led.set if index == 0 else None)

            await asyncio.gather(*(one(k, x, y) for k, (x, y) in enumerate(microbatches)))
            await self._wait_all_stepped(step + 1, sampler)
            await self._finish_step(step, i + 1, validation)

    async def _finish_step(self, step: int, done: int, validation: list) -> None:
        losses = [entry for at in sorted(k for k in self._step_losses if k <= step)
                  for entry in self._step_losses.pop(at)]
        total = sum(n for _, n in losses)
        loss = sum(value * n for value, n in losses) / total if total else float("nan")
        s = self.summary
        s.steps = done
        s.step_losses.append(loss)
        s.step_samples.append(sum(self._step_samples.pop(at) for at in [k for k in self._step_samples if k <= step]))
        if s.first_loss is None and total:
            s.first_loss = loss
        if total:
            s.final_loss = loss
        validated = bool(self.config.val_every and done % self.config.val_every == 0)
        if validated:
            await self._validate(validation)
        progress = self.progress()
        if self._swarm is not None:  # reported with the next heartbeat (swarmd.training_summary)
            self._swarm.observe_step(step, loss if total else None, s.samples, s.val_loss if validated else None)
        self._emit(StepDone(done=done, step=step, loss=loss if total else None, progress=progress,
                            at=time.perf_counter()))
        if self.on_step is not None:
            self.on_step(done, loss, progress)

    def _emit(self, event: CallDone | StepWait | StepDone) -> None:
        if self.events is not None:
            self.events(event)

    async def _swarm_step(self) -> int:
        """The step the whole swarm has reached: the slowest stage's most advanced peer."""
        return _front_step(await self._poll_progress())

    def _pace_budget(self, progress: list[list[PeerProgress]], in_flight_samples: int) -> int | None:
        """Samples this trainer may still start before the stages' next step (None: no limit).

        The stages whose backwards are step-checked (all but the last) step once their peers
        hold ``target_batch_size`` samples; what they hold for their current step (per stage,
        at its most advanced step) and what is in flight count against it. Delayed updates
        accept a backward one step old, so they need no pacing.
        """
        training = self._require_training()
        if training.delay_updates or len(progress) < 2:
            return None
        held = 0
        for peers in progress[:-1]:
            seen = [p for p in peers if p.step is not None]
            if seen:
                front = max(p.step for p in seen if p.step is not None)
                held = max(held, sum(p.samples for p in seen if p.step == front))
        return training.target_batch_size - held - in_flight_samples

    async def _poll_progress(self, wait_step: int | None = None) -> list[list[PeerProgress]]:
        """Every serving peer's ``/v1/progress`` (step, samples held, averaging), per stage.

        The DHT view's steps can be an announce period old; these answers are fresh. A peer
        that does not answer is listed with ``step`` None: it may be dead (its record expires
        soon) or merely slow, and a synchronous trainer must not run ahead of a slow peer.
        With ``wait_step``, a long-poll: each peer answers once it reaches that step, or after
        ``PROGRESS_WAIT_S``.
        """
        await self._refresh_view()
        stages = [[(p["id"], p["addr"]) for p in router.snapshot()] for router in self.routers]
        return await self._require_swarm().progress(stages, wait_step=wait_step, wait_s=PROGRESS_WAIT_S)

    async def _wait_all_stepped(self, step: int, sampler: BatchSampler) -> None:
        """Poll every serving peer's /v1/progress until all are at ``step`` or later.

        A stage whose peers hold fewer than ``target_batch_size`` samples for the step and are
        not averaging lost gradients with a dead peer: after a short grace period it is topped
        up with fresh microbatches, so the step still aggregates a full batch.
        """
        training = self._require_training()
        began = time.perf_counter()
        deadline = time.monotonic() + self.config.stage_wait_timeout_s
        short_since: float | None = None
        while True:
            lagging = []
            missing = 0
            polled_at = time.monotonic()
            for stage, polled in enumerate(await self._poll_progress(wait_step=step)):
                # a silent peer counts as lagging until the DHT forgets it (a dead one) or it answers
                lagging += [(stage, p.peer_id, p.step) for p in polled if p.step is None or p.step < step]
                seen = [p for p in polled if p.step is not None]
                front = max((p.step for p in seen if p.step is not None), default=step)
                if front < step:  # the whole stage has yet to step: does it hold a full batch?
                    at_front = [p for p in seen if p.step == front]
                    if not any(p.averaging for p in at_front):
                        held = sum(p.samples for p in at_front)
                        missing = max(missing, training.target_batch_size - held)
            if not lagging:
                self._emit(StepWait(step=step, started=began, ended=time.perf_counter()))
                return
            now = time.monotonic()
            if now > deadline:
                raise TrainerError(f"stages did not reach step {step} in time: {lagging}")
            if missing > 0:
                short_since = short_since or now
                if now - short_since > 1.0:
                    count = -(-missing // self.config.microbatch_size)
                    log.warning("a stage is %d samples short of step %d (a peer died holding gradients); "
                                "topping up with %d microbatches", missing, step, count)
                    self.summary.topup_microbatches += count
                    await asyncio.gather(*(self._microbatch(*sampler.sample(self.config.microbatch_size))
                                           for _ in range(count)))
                    short_since = None
            else:
                short_since = None
            # the long-poll already waited; a peer that answered at once (or not at all) did not
            await asyncio.sleep(max(0.0, 0.05 - (time.monotonic() - polled_at)))

    # ---- one microbatch --------------------------------------------------------------------------

    async def _microbatch(
        self, x: torch.Tensor, y: torch.Tensor, *, on_forward: Callable[[], None] | None = None,
        lease_step: int | None = None,
    ) -> tuple[float, int, int]:
        """Forward and backward through every stage; redo on staleness. Returns (loss, step, samples).

        ``on_forward`` is called once the first stage's forward is back (or the microbatch fails).
        ``lease_step``: the step its reservation is for; a stage that answers a forward at an
        earlier step is finishing that step's round, so the forward is sent again once it has
        stepped (for at most ``STAGE_CATCH_UP_S``), instead of being redone as stale later.
        """
        s = self.summary
        s.microbatches_issued += 1
        last = self._require_spec().n_stages - 1
        if last == 0 and on_forward is not None:  # one stage: no forward before the fused call
            on_forward()
            on_forward = None
        while True:
            # a fresh id per attempt: the peers keep each forward's activations under it, and
            # the backward goes back to the peer that ran the forward (when it is still usable)
            mb = secrets.randbits(64)
            acts, steps, served = [x], [], []
            for stage in range(last):
                catch_up = time.monotonic() + STAGE_CATCH_UP_S
                while True:
                    try:
                        forward, peer = await self._forward(stage, acts[-1], mb=mb)
                    finally:
                        if on_forward is not None:
                            on_forward()
                            on_forward = None
                    if lease_step is None or forward.step >= lease_step or time.monotonic() > catch_up:
                        break
                    await asyncio.sleep(0.01)
                acts.append(forward.outputs)
                steps.append(forward.step)
                served.append(peer)
            backward, _ = await self._backward(last, acts[-1], targets=y, mb=mb)
            if backward.loss is None:
                raise TrainerError(f"stage {last} answered a backward with targets without its loss")
            loss, last_step = backward.loss, backward.step
            grad = backward.grad_inputs
            duplicates = int(backward.duplicate)
            try:
                for stage in range(last - 1, -1, -1):
                    backward, _ = await self._backward(stage, acts[stage], grad_outputs=grad, step=steps[stage],
                                                       mb=mb, prefer=served[stage])
                    grad = backward.grad_inputs
                    duplicates += int(backward.duplicate)
            except _Redo:
                s.stale_redos += 1
                continue
            break
        s.microbatches_completed += 1
        s.samples += x.shape[0]
        s.duplicates += duplicates
        self._step_losses.setdefault(last_step, []).append((loss, x.shape[0]))
        # the first stage's step (the last backward's): where the microbatch counts, in the lease book's terms
        self._step_samples[backward.step] = self._step_samples.get(backward.step, 0) + x.shape[0]
        return loss, last_step, x.shape[0]

    async def _forward(
        self, stage: int, inputs: torch.Tensor, targets: torch.Tensor | None = None, *, mb: int | None = None
    ) -> tuple[ForwardReply, str]:
        client, spec, codec = self._require_client(), self._require_spec(), self.config.codec
        return await self._call(
            stage, "forward", inputs.shape[0],
            lambda addr: client.forward(addr, stage, inputs, targets, codec=codec, model=spec.digest, mb=mb),
        )

    async def _backward(
        self,
        stage: int,
        inputs: torch.Tensor,
        *,
        grad_outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        step: int | None = None,
        mb: int | None = None,
        prefer: str | None = None,
    ) -> tuple[BackwardReply, str]:
        client, spec, codec = self._require_client(), self._require_spec(), self.config.codec
        deadline_ms = int(self.config.request_timeout_s * 1000 * DEADLINE_SHARE)
        return await self._call(
            stage, "backward", inputs.shape[0],
            lambda addr: client.backward(addr, stage, inputs, grad_outputs, targets, codec=codec, model=spec.digest,
                                         step=step, mb=mb, deadline_ms=deadline_ms),
            prefer=prefer,
        )

    async def _call(
        self,
        stage: int,
        kind: Literal["forward", "backward"],
        samples: int,
        send: Callable[[str], Awaitable[R]],
        *,
        prefer: str | None = None,
    ) -> tuple[R, str]:
        """One request to some peer of ``stage``: route, act on refusals (``swarmd.pipeline
        .failures``), wait for peers; the reply and the id of the peer that answered.

        ``prefer`` is a peer to try first when it is usable (a backward's: the peer that ran
        the forward, whose activation cache holds the microbatch).
        """
        router = self.routers[stage]
        tried: set[str] = set()
        waiting_since: float | None = None
        began = time.perf_counter()
        attempts = 0
        while True:
            choice = router.choose_preferred(prefer, exclude=tried)
            if choice is None and tried and router.usable_count:
                tried.clear()  # every usable peer was tried once in this call: go round again
                await asyncio.sleep(0.05)
                continue
            if choice is None:  # no usable peer at all: none listed, or all banned
                now = time.monotonic()
                if waiting_since is None:
                    waiting_since = now
                    log.warning("no usable peer for stage %d right now; waiting for one (up to %.0fs)",
                                stage, self.config.stage_wait_timeout_s)
                elif now - waiting_since > self.config.stage_wait_timeout_s:
                    raise TrainerError(
                        f"stage {stage} has had no usable peer for {self.config.stage_wait_timeout_s:.0f}s; giving up"
                        + unreachable_hint(self._last_failures.get(stage, {}),
                                           self._swarm.unreachable.get(stage, []) if self._swarm else [])
                    )
                tried.clear()
                unban = router.next_unban_in()
                await asyncio.sleep(min(unban if unban is not None else 0.5, 0.5))
                await self._refresh_view()
                continue
            peer_id, addr = choice
            router.begin(peer_id)
            attempts += 1
            started = time.monotonic()
            try:
                reply = await send(addr)
            except PeerError as exc:
                action = classify(exc)
                if action is Action.BAN:
                    self._last_failures.setdefault(stage, {})[addr] = exc
                    self.summary.retries += 1
                    self.summary.bans += 1
                    ban = router.report_failure(peer_id)
                    log.warning("stage %d peer %s failed (%s); banned for %.1fs, retrying elsewhere",
                                stage, peer_id[:12], exc, ban)
                    tried.add(peer_id)
                    continue
                router.release(peer_id)
                if action is Action.REDO:
                    raise _Redo() from exc
                if action is Action.RETRY_SOON:  # e.g. Busy averaging: this peer is fine, shortly
                    await asyncio.sleep(0.02)
                    continue
                if action is Action.RETRY_ELSEWHERE:  # leaving, behind, or not this stage any more
                    tried.add(peer_id)
                    continue
                raise TrainerError(f"stage {stage} peer {peer_id[:12]} refused a request: {exc}") from exc
            except BaseException:
                router.release(peer_id)
                raise
            router.report_success(peer_id, samples, time.monotonic() - started)
            self._emit(CallDone(stage=stage, kind=kind, samples=samples, peer_id=peer_id, attempts=attempts,
                                started=began, ended=time.perf_counter()))
            return reply, peer_id

    def _require_spec(self) -> ModelSpec:
        if self.spec is None:
            raise RuntimeError("the trainer has not registered with the swarm yet")
        return self.spec

    def _require_training(self) -> TrainingSpec:
        if self.training is None:
            raise RuntimeError("the trainer has not registered with the swarm yet")
        return self.training

    def _require_client(self) -> DataPlaneClient:
        if self._client is None:
            raise RuntimeError("the trainer is not running")
        return self._client

    # ---- validation ------------------------------------------------------------------------------

    async def _validate(self, batches: list) -> None:
        last = self._require_spec().n_stages - 1
        total, count = 0.0, 0
        for x, y in batches:
            acts = x
            for stage in range(last):
                acts = (await self._forward(stage, acts))[0].outputs
            reply, _ = await self._forward(last, acts, targets=y)
            if reply.loss is None:
                raise TrainerError(f"stage {last} answered a forward with targets without its loss")
            total += reply.loss * x.shape[0]
            count += x.shape[0]
        if count:
            self.summary.val_loss = total / count
            self.summary.val_losses.append((self.summary.steps, self.summary.val_loss))
