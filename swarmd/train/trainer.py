"""The trainer: a lightweight client that drives microbatches through the swarm's stages.

SWARM's trainers (paper, section 3.2) hold no parameters. A trainer registers with any daemon's
control plane, learns the stage map from that daemon's ``GET /swarm`` (it runs no DHT node), and
sends each microbatch through one peer per stage, picked by stochastic wiring. :class:`Trainer`
wires the parts together and runs one of two modes; each part is a file named after its concept:

==============================  ===============================================================
``swarm_client``                registration, heartbeats, ``/swarm`` and ``/v1/progress`` (I/O)
``swarm_view``                  one router per stage fed from ``/swarm``; progress, exclusions
``stage_calls``                 the one call machine: route, timeout, send, classify, ban, retry
``microbatches``                a microbatch forward and backward through every stage; validation
``spot_checks`` / ``verify``    second opinions on answers, and the rules they are judged by
``pacing``                      asynchronous mode: a window paced through the first stage's lease book
``sync_steps``                  ``--sync`` mode: one tapered global batch per step, then the wait
``summary``                     the step ledger and the summary ``--json`` prints
``config`` / ``timing``         what the trainer is told, and every wait with its reason
``window``                      how many microbatches in flight: Little's law over measured costs
``data`` / ``corpus``           the corpus (``shards``: pre-tokenized) and its sampling
==============================  ===============================================================

Faults: a peer that fails or times out is banned with exponential backoff and the call retried on
another peer of the stage; a stage with no live peer makes the trainer wait (and say so) until one
appears, up to ``stage_wait_timeout_s``. A backward refused as stale (the stage stepped since the
microbatch's forward) redoes the whole microbatch, so every microbatch issued is completed, and
``microbatches_issued == microbatches_completed`` at the end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import torch

from swarmd.net.client import DataPlaneClient, client_session
from swarmd.pipeline.routing import StageRouter
from swarmd.pipeline.spec import ModelSpec, TrainingSpec
from swarmd.task_dump import dump_on_signal
from swarmd.train.config import TrainerConfig
from swarmd.train.data import BatchSampler, load_corpus, val_batches
from swarmd.train.events import CallDone, StepDone, TrainerEvent, TrainerListener
from swarmd.train.microbatches import Microbatches
from swarmd.train.pacing import AsyncPacing, LeaseBook
from swarmd.train.spot_checks import SpotChecks
from swarmd.train.stage_calls import StageCalls
from swarmd.train.summary import StepLedger, TrainSummary
from swarmd.train.swarm_client import Registration, SwarmClient, TrainerError
from swarmd.train.swarm_view import SwarmView
from swarmd.train.sync_steps import SyncSteps, split_batch
from swarmd.train.verify import VerifyStats
from swarmd.train.window import CallCosts, WindowSizer

__all__ = ["TrainSummary", "Trainer", "TrainerConfig", "TrainerError", "split_batch"]

log = logging.getLogger(__name__)

#: The corpus order (and so the train/held-out split) of every asynchronous trainer; ``--seed``
#: orders its samples. A ``--sync`` trainer trains alone and splits by its own seed.
SPLIT_SEED = 0

Batches = list[tuple[torch.Tensor, torch.Tensor]]


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
        self.checks = VerifyStats()  # written by the spot checks, reported with every step
        self.spec: ModelSpec | None = None
        self.training: TrainingSpec | None = None
        self.trainer_id: str | None = None
        self.view: SwarmView | None = None  # the stages' routers, once registered
        self.calls: StageCalls | None = None
        self._swarm: SwarmClient | None = None
        self._microbatches: Microbatches | None = None
        self._ledger = StepLedger()
        self._validation: Batches = []
        self.costs = CallCosts()  # what its calls and polls took: the window's inputs (swarmd.train.window)
        self.sizer = WindowSizer(start=config.start_window)

    @property
    def routers(self) -> list[StageRouter]:
        """Each stage's router (``swarmd.pipeline.routing.StageRouter``), once registered."""
        return self.view.routers if self.view is not None else []

    # ---- public ------------------------------------------------------------------------------

    async def run(self) -> TrainSummary:
        """Register, train ``config.steps`` steps, say goodbye. ``kill -USR1`` meanwhile prints every
        asyncio task's stack to stderr (``swarmd.task_dump``: what a stalled trainer waits on)."""
        with dump_on_signal():
            return await self._run()

    async def _run(self) -> TrainSummary:
        cfg = self.config
        started = time.monotonic()
        async with client_session(cfg.swarm_key, timeout=aiohttp.ClientTimeout(total=30)) as http, \
                DataPlaneClient(timeout_s=cfg.request_timeout_s, swarm_key=cfg.swarm_key) as client:
            swarm = self._swarm = SwarmClient(cfg.api, http=http, data=client, name=cfg.name, api_token=cfg.api_token,
                                              refresh_s=cfg.refresh_s, sync=cfg.sync, timing=cfg.timing)
            registration = await swarm.register()
            spec, training = registration.spec, registration.training
            self.spec, self.training, self.trainer_id = spec, training, registration.trainer_id
            view = self.view = SwarmView(swarm, request_timeout_s=cfg.request_timeout_s, window=cfg.start_window,
                                         timing=cfg.timing, stage_wait_timeout_s=cfg.stage_wait_timeout_s,
                                         on_answer=self.costs.poll)
            view.adopt(spec.n_stages)
            calls = self.calls = StageCalls(view, client, model=spec.digest, codec=cfg.codec, summary=self.summary,
                                            timing=cfg.timing, request_timeout_s=cfg.request_timeout_s,
                                            stage_wait_timeout_s=cfg.stage_wait_timeout_s, emit=self._emit)
            checks = SpotChecks(calls, client, stats=self.checks, codec=cfg.codec, fraction=cfg.verify_fraction,
                                window=cfg.start_window, timing=cfg.timing, stage_steps=view.stage_steps)
            self._microbatches = Microbatches(calls, checks, n_stages=spec.n_stages, summary=self.summary,
                                              ledger=self._ledger, timing=cfg.timing, p2p=cfg.p2p)
            corpus = await asyncio.to_thread(
                # asynchronous trainers share one train/held-out split whatever their --seed (it orders the
                # corpus's files): their rank shards are then disjoint and their validation the same windows
                load_corpus, cfg.data, max_bytes=cfg.max_corpus_bytes, seed=cfg.seed if cfg.sync else SPLIT_SEED,
                seq_len=spec.seq_len, tokenizer=cfg.tokenizer, text_field=cfg.text_field, spec=spec,
            )
            index = cfg.shard if cfg.shard is not None else registration.rank
            first = None
            if index is not None and cfg.data_shards > 1 and not cfg.sync:  # a sync trainer trains alone: all of it
                first = (index % cfg.data_shards, cfg.data_shards)  # starts there, then moves on shard by shard
            sampler = BatchSampler(corpus.train, spec.seq_len, seed=cfg.seed, shards=first)
            self.summary.shard = sampler.current_shard
            self._validation = val_batches(corpus.val, spec.seq_len, cfg.microbatch_size, cfg.val_batches)
            heartbeat = asyncio.create_task(swarm.keep_registered(cfg.heartbeat_s, self._registered_again),
                                            name="swarmd-trainer-heartbeat")
            try:
                await view.refresh(force=True)
                await self._run_mode(spec, training, view, client, sampler)
                if not self.summary.val_losses or self.summary.val_losses[-1][0] != self.summary.steps:
                    await self._validate()
                await checks.finish()
            finally:
                heartbeat.cancel()
                await view.aclose()  # a read of the stage map still out
                await swarm.aclose()  # newcomers' progress polls still out (issue #18)
                await checks.cancel()
                await asyncio.gather(heartbeat, return_exceptions=True)
                self.summary.verify = self.checks.to_json()
                await swarm.flush(self.summary.samples)  # the last steps' losses and the final count
                await swarm.unregister()
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
            "checks": self.checks.checks,
            "liars": self.checks.liars,
            "window": s.window,
        }

    # ---- the parts -------------------------------------------------------------------------------

    async def _run_mode(self, spec: ModelSpec, training: TrainingSpec, view: SwarmView, client: DataPlaneClient,
                        sampler: BatchSampler) -> None:
        """``--sync`` steps, or the asynchronous window paced through the lease book."""
        cfg = self.config
        microbatches = self._require_microbatches()
        if cfg.sync:
            await SyncSteps(cfg, training, view=view, microbatches=microbatches, summary=self.summary,
                            on_step=self._finish_step, emit=self._emit, window=self.window_for,
                            calls_on_step=self._validates).run(sampler)
            return
        book = LeaseBook(cfg, training, n_stages=spec.n_stages, view=view, client=client, summary=self.summary,
                         trainer_id=lambda: self.trainer_id)
        await AsyncPacing(cfg, training, view=view, book=book, microbatches=microbatches, summary=self.summary,
                          on_step=self._finish_step, window=self.window_for).run(sampler)

    def window_for(self, microbatches: int) -> int:
        """Microbatches in flight for a step of ``microbatches`` (``--window N``: N; auto: the
        :class:`~swarmd.train.window.WindowSizer`'s, from what this trainer measured so far). Either way
        the estimate is kept up to date and reported (``window``, ``window_need`` in the summary)."""
        cfg, s, routers = self.config, self.summary, self.routers
        announced = [self.view.announced(k) for k in range(len(routers))] if self.view is not None else []
        stages = self.costs.stages(len(routers), cfg.microbatch_size, [max(1, r.usable_count) for r in routers],
                                   announced) if routers else None
        window = self.sizer.update(stages, microbatches)
        if cfg.window is not None:
            window = cfg.window
        if window != s.window:
            log.info("%d microbatches in flight (%s; estimated need %s)", window,
                     "auto" if cfg.window is None else "--window", _need(self.sizer.estimate))
        s.window = window
        s.window_need = None if self.sizer.estimate is None else round(self.sizer.estimate, 2)
        return window

    def _registered_again(self, registration: Registration) -> None:
        """The daemon forgot this trainer and it registered again: only the id changes (the routers
        keep what they measured)."""
        self.trainer_id = registration.trainer_id

    async def _finish_step(self, step: int, done: int) -> None:
        """The swarm took ``step``, the ``done``-th of this run: close it in the ledger, validate when
        due, report it (heartbeat, events, ``on_step``)."""
        closed = self._ledger.close(step)
        loss = closed.loss if closed.loss is not None else float("nan")
        s = self.summary
        s.steps = done
        s.step_losses.append(loss)
        s.step_samples.append(closed.samples)
        if closed.loss is not None:
            s.first_loss = loss if s.first_loss is None else s.first_loss
            s.final_loss = loss
        validated = self._validates(done)
        if validated:
            await self._validate()
        progress = self.progress()
        if self._swarm is not None:  # reported with the next heartbeat (swarmd.training_summary)
            c = self.checks  # the spot checks' counts so far: /trainers and swarmd_trainer_spot_checks_total
            self._swarm.observe_step(step, closed.loss, s.samples, s.val_loss if validated else None,
                                     retries=s.retries, bans=s.bans,
                                     spot_checks={"checks": c.checks, "mismatches": c.mismatches,
                                                  "arbitrations": c.arbitrations, "liars": c.liars,
                                                  "reports_sent": c.reports_sent})
        self._emit(StepDone(done=done, step=step, loss=closed.loss, progress=progress, at=time.perf_counter()))
        if self.on_step is not None:
            self.on_step(done, loss, progress)

    def _validates(self, done: int) -> bool:
        """Whether the ``done``-th step of this run ends in a validation pass."""
        return bool(self.config.val_every and done % self.config.val_every == 0)

    def _require_microbatches(self) -> Microbatches:
        if self._microbatches is None:
            raise RuntimeError("the trainer is not running")
        return self._microbatches

    async def _validate(self) -> None:
        val_loss = await self._require_microbatches().validate(self._validation)
        if val_loss is not None:
            self.summary.val_loss = val_loss
            self.summary.val_losses.append((self.summary.steps, val_loss))

    def _emit(self, event: TrainerEvent) -> None:
        if isinstance(event, CallDone) and event.attempts == 1:  # a retried call's time is no stage's cost
            self.costs.call(event.stage, event.kind, event.samples, event.ended - event.started)
        if self.events is not None:
            self.events(event)


def _need(estimate: float | None) -> str:
    return "not measured yet" if estimate is None else f"{estimate:.1f}"
