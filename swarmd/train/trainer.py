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
accumulated ``target_batch_size`` samples; the trainer paces itself to that batch (it starts a
microbatch only while what the stages hold plus what is in flight falls short of it), so few
microbatches straddle a step and get redone. In ``sync`` mode the trainer sends exactly one
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
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import torch

from swarmd.errors import ConfigError, PeerError, SwarmdError
from swarmd.net.client import DataPlaneClient, StageReply, client_session
from swarmd.pipeline.optimizer import TrainingSpec
from swarmd.pipeline.routing import StageRouter
from swarmd.pipeline.spec import ModelSpec
from swarmd.swarm_key import SwarmKey
from swarmd.train.data import BatchSampler, load_corpus, val_batches

log = logging.getLogger(__name__)


PROGRESS_WAIT_S = 0.5  # how long one /v1/progress long-poll may wait for a step


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


def _front_step(progress: list[list[dict[str, Any]]]) -> int:
    """The step the whole swarm has reached: the slowest stage's most advanced peer (0 if a
    stage has no peer that answered)."""
    fronts = [max((p["step"] for p in peers if p["step"] is not None), default=None) for peers in progress]
    return min(f for f in fronts if f is not None) if all(f is not None for f in fronts) else 0


class TrainerError(SwarmdError):
    """The trainer cannot go on (no peer for a stage within the timeout, a refused request)."""


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

    def __post_init__(self) -> None:
        for name in ("steps", "microbatch_size", "window", "val_batches", "max_corpus_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError("--batch-size must be at least 1")
        if self.val_every < 0:
            raise ConfigError("--val-every must not be negative")


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
    elapsed_s: float = 0.0
    step_losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Trainer:
    """Drives ``config.steps`` optimizer steps of the swarm behind ``config.api``."""

    def __init__(self, config: TrainerConfig, *, on_step: Callable[[int, float, dict[str, Any]], None] | None = None) -> None:
        self.config = config
        self.on_step = on_step
        self.summary = TrainSummary()
        self.spec: ModelSpec | None = None
        self.training: TrainingSpec | None = None
        self.routers: list[StageRouter] = []
        self.trainer_id: str | None = None
        self._http: aiohttp.ClientSession | None = None
        self._client: DataPlaneClient | None = None
        self._stage_steps: list[dict[str, int]] = []  # per stage: peer -> step, from /swarm and replies
        self._view_lock = asyncio.Lock()
        self._view_at = 0.0
        self._step_losses: dict[int, list[tuple[float, int]]] = {}

    # ---- public ------------------------------------------------------------------------------

    async def run(self) -> TrainSummary:
        cfg = self.config
        started = time.monotonic()
        async with client_session(cfg.swarm_key, timeout=aiohttp.ClientTimeout(total=30)) as http, \
                DataPlaneClient(timeout_s=cfg.request_timeout_s, swarm_key=cfg.swarm_key) as client:
            self._http, self._client = http, client
            await self._register()
            assert self.spec is not None and self.training is not None
            corpus = await asyncio.to_thread(
                load_corpus, cfg.data, max_bytes=cfg.max_corpus_bytes, seed=cfg.seed, seq_len=self.spec.seq_len
            )
            sampler = BatchSampler(corpus.train, self.spec.seq_len, seed=cfg.seed)
            validation = val_batches(corpus.val, self.spec.seq_len, cfg.microbatch_size, cfg.val_batches)
            heartbeat = asyncio.create_task(self._heartbeats(), name="swarmd-trainer-heartbeat")
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
        s = self.summary
        s.elapsed_s = round(time.monotonic() - started, 3)
        s.samples_per_s = round(s.samples / s.elapsed_s, 2) if s.elapsed_s else 0.0
        return s

    # ---- registration and the stage map -----------------------------------------------------

    async def _register(self) -> None:
        assert self._http is not None
        url = self.config.api.rstrip("/")
        try:
            async with self._http.post(f"{url}/trainers", json={"name": self.config.name},
                                       headers=self._auth()) as r:
                body = await r.json(content_type=None)
                if r.status != 201:
                    raise TrainerError(f"{url} refused the registration ({r.status}): {body.get('message', body)}")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise TrainerError(f"cannot register with the daemon at {url}: {exc}") from exc
        self.trainer_id = body["trainer_id"]
        self.spec = ModelSpec.from_dict(body["model"]["spec"])
        self.training = TrainingSpec.from_dict(body["training"])
        self.routers = [StageRouter(stage) for stage in range(self.spec.n_stages)]
        self._stage_steps = [{} for _ in range(self.spec.n_stages)]
        log.info("registered as trainer %s with swarm %r: model %s, %d stages, target batch %d",
                 self.trainer_id, body["swarm"], self.spec.name, self.spec.n_stages, self.training.target_batch_size)

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_token}"} if self.config.api_token else {}

    async def _heartbeats(self) -> None:
        assert self._http is not None
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            # built each time: after a registration again the trainer has a new id
            url = f"{self.config.api.rstrip('/')}/trainers/{self.trainer_id}/heartbeat"
            try:
                async with self._http.post(url, headers=self._auth()) as r:
                    if r.status == 404:
                        log.warning("the daemon forgot this trainer's registration; registering again")
                        await self._register_again()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                log.warning("heartbeat to %s failed: %s", url, exc)

    async def _register_again(self) -> None:
        routers, steps = self.routers, self._stage_steps
        await self._register()
        self.routers, self._stage_steps = routers, steps  # keep what we measured

    async def _refresh_view(self, force: bool = False) -> None:
        """Re-read the stage map from the daemon's /swarm (at most every ``refresh_s``)."""
        async with self._view_lock:
            if not force and time.monotonic() - self._view_at < self.config.refresh_s:
                return
            assert self._http is not None
            try:
                async with self._http.get(f"{self.config.api.rstrip('/')}/swarm") as r:
                    if r.status != 200:
                        raise TrainerError(f"GET /swarm answered {r.status}")
                    view = await r.json()
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                log.warning("could not refresh the stage map: %s", exc)
                return
            finally:
                self._view_at = time.monotonic()
            for stage in view["stages"]:
                k = stage["stage"]
                if k >= len(self.routers):
                    continue
                serving = {p["peer_id"]: p["data_addr"] for p in stage["peers"] if p["state"] == "serving"}
                self.routers[k].update_peers(serving)
                self._stage_steps[k] = {p["peer_id"]: p["step"] for p in stage["peers"] if p["state"] == "serving"}

    # ---- the two modes ---------------------------------------------------------------------------

    async def _run_async(self, sampler: BatchSampler, validation: list) -> None:
        """Keep up to ``window`` microbatches in flight until the swarm has taken ``steps`` steps.

        Paced (without delayed updates): a microbatch is started only while the samples the
        stages hold for their current step plus those in flight fall short of the target batch,
        so few microbatches straddle a step (their backward would be refused as stale and the
        whole microbatch redone); once the batch is complete, the trainer waits for the step.
        """
        cfg = self.config
        start = await self._swarm_step()
        target = start + cfg.steps
        started = time.monotonic()
        done_steps = 0
        in_flight: set[asyncio.Task[tuple[float, int, int]]] = set()
        sizes: dict[asyncio.Task[tuple[float, int, int]], int] = {}
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
                budget = self._pace_budget(progress, sum(sizes[t] for t in in_flight))
                while len(in_flight) < cfg.window and (budget is None or budget > 0):
                    x, y = sampler.sample(cfg.microbatch_size)
                    task = asyncio.create_task(self._microbatch(x, y))
                    in_flight.add(task)
                    sizes[task] = x.shape[0]
                    if budget is not None:
                        budget -= x.shape[0]
                if not in_flight:  # the stages hold a full batch: wait until they step
                    await self._poll_progress(wait_step=step_now + 1)
                    continue
                done, in_flight = await asyncio.wait(in_flight, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    sizes.pop(task, None)
                # retrieve every error (else asyncio logs "Task exception was never retrieved" for
                # each failed microbatch after the first), then raise the first one
                failed = [task for task in done if not task.cancelled() and task.exception() is not None]
                for task in failed[:1] or done:
                    task.result()
            # finish what is in flight rather than abandon it: every microbatch issued completes
            # (its gradients count towards the swarm's next step)
            for task in asyncio.as_completed(in_flight):
                await task
            in_flight = set()
        finally:
            for task in in_flight:  # only after an error: cancel the rest
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _run_sync(self, sampler: BatchSampler, validation: list) -> None:
        """One global batch per step; wait until every peer of every stage has stepped."""
        assert self.training is not None
        cfg = self.config
        batch = cfg.batch_size or self.training.target_batch_size
        if batch < self.training.target_batch_size:
            raise ConfigError(
                f"--batch-size {batch} is below the swarm's target_batch_size {self.training.target_batch_size}: "
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

            async def one(index: int, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
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
        loss = sum(l * n for l, n in losses) / total if total else float("nan")
        s = self.summary
        s.steps = done
        s.step_losses.append(loss)
        if s.first_loss is None and total:
            s.first_loss = loss
        if total:
            s.final_loss = loss
        if self.config.val_every and done % self.config.val_every == 0:
            await self._validate(validation)
        if self.on_step is not None:
            self.on_step(done, loss, self.progress())

    def progress(self) -> dict[str, Any]:
        s = self.summary
        return {
            "samples": s.samples,
            "retries": s.retries,
            "stale_redos": s.stale_redos,
            "peers": [r.usable_count for r in self.routers],
            "val_loss": s.val_loss,
        }

    async def _swarm_step(self) -> int:
        """The step the whole swarm has reached: the slowest stage's most advanced peer."""
        return _front_step(await self._poll_progress())

    def _pace_budget(self, progress: list[list[dict[str, Any]]], in_flight_samples: int) -> int | None:
        """Samples this trainer may still start before the stages' next step (None: no limit).

        The stages whose backwards are step-checked (all but the last) step once their peers
        hold ``target_batch_size`` samples; what they hold for their current step (per stage,
        at its most advanced step) and what is in flight count against it. Delayed updates
        accept a backward one step old, so they need no pacing.
        """
        assert self.training is not None
        if self.training.delay_updates or len(progress) < 2:
            return None
        held = 0
        for peers in progress[:-1]:
            seen = [p for p in peers if p["step"] is not None]
            if seen:
                front = max(p["step"] for p in seen)
                held = max(held, sum(p["samples"] for p in seen if p["step"] == front))
        return self.training.target_batch_size - held - in_flight_samples

    async def _poll_progress(self, wait_step: int | None = None) -> list[list[dict[str, Any]]]:
        """Every serving peer's ``/v1/progress`` (step, samples held, averaging), per stage.

        The DHT view's steps can be an announce period old; these answers are fresh. A peer
        that does not answer is listed with ``step`` None: it may be dead (its record expires
        soon) or merely slow, and a synchronous trainer must not run ahead of a slow peer.
        With ``wait_step``, a long-poll: each peer answers once it reaches that step, or after
        ``PROGRESS_WAIT_S``.
        """
        assert self._http is not None
        await self._refresh_view()
        query = "" if wait_step is None else f"?wait_step={wait_step}&wait_s={PROGRESS_WAIT_S}"

        async def one(addr: str) -> dict[str, Any] | None:
            try:
                async with self._http.get(f"http://{addr}/v1/progress{query}",
                                          timeout=aiohttp.ClientTimeout(total=5)) as r:
                    body = await r.json()
                return {"step": int(body["step"]), "samples": int(body["samples"]),
                        "averaging": bool(body.get("averaging"))}
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
                return None

        out: list[list[dict[str, Any]]] = []
        for stage, router in enumerate(self.routers):
            peers = router.snapshot()
            answers = await asyncio.gather(*(one(p["addr"]) for p in peers))
            stage_out = []
            for peer, answer in zip(peers, answers):
                if answer is None:
                    stage_out.append({"peer_id": peer["id"], "step": None, "samples": 0, "averaging": False})
                else:
                    self._stage_steps[stage][peer["id"]] = answer["step"]
                    stage_out.append({"peer_id": peer["id"], **answer})
            out.append(stage_out)
        return out

    async def _wait_all_stepped(self, step: int, sampler: BatchSampler) -> None:
        """Poll every serving peer's /v1/progress until all are at ``step`` or later.

        A stage whose peers hold fewer than ``target_batch_size`` samples for the step and are
        not averaging lost gradients with a dead peer: after a short grace period it is topped
        up with fresh microbatches, so the step still aggregates a full batch.
        """
        assert self.training is not None
        deadline = time.monotonic() + self.config.stage_wait_timeout_s
        short_since: float | None = None
        while True:
            lagging = []
            missing = 0
            polled_at = time.monotonic()
            for stage, polled in enumerate(await self._poll_progress(wait_step=step)):
                # a silent peer counts as lagging until the DHT forgets it (a dead one) or it answers
                lagging += [(stage, p["peer_id"], p["step"]) for p in polled if p["step"] is None or p["step"] < step]
                seen = [p for p in polled if p["step"] is not None]
                front = max((p["step"] for p in seen), default=step)
                if front < step:  # the whole stage has yet to step: does it hold a full batch?
                    at_front = [p for p in seen if p["step"] == front]
                    if not any(p["averaging"] for p in at_front):
                        held = sum(p["samples"] for p in at_front)
                        missing = max(missing, self.training.target_batch_size - held)
            if not lagging:
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
        self, x: torch.Tensor, y: torch.Tensor, *, on_forward: Callable[[], None] | None = None
    ) -> tuple[float, int, int]:
        """Forward and backward through every stage; redo on staleness. Returns (loss, step, samples).

        ``on_forward`` is called once the first stage's forward is back (or the microbatch fails).
        """
        assert self.spec is not None
        s = self.summary
        s.microbatches_issued += 1
        last = self.spec.n_stages - 1
        if last == 0 and on_forward is not None:  # one stage: no forward before the fused call
            on_forward()
            on_forward = None
        while True:
            # a fresh id per attempt: the peers keep each forward's activations under it, and
            # the backward goes back to the peer that ran the forward (when it is still usable)
            mb = secrets.randbits(64)
            acts, steps, served = [x], [], []
            for stage in range(last):
                try:
                    reply, peer = await self._call_peer(stage, "forward", inputs=acts[-1], mb=mb)
                finally:
                    if on_forward is not None:
                        on_forward()
                        on_forward = None
                acts.append(reply.tensors["outputs"])
                steps.append(int(reply.meta["step"]))
                served.append(peer)
            reply, _ = await self._call_peer(last, "backward", inputs=acts[-1], targets=y)
            loss, last_step = float(reply.meta["loss"]), int(reply.meta["step"])
            grad = reply.tensors.get("grad_inputs")
            try:
                for stage in range(last - 1, -1, -1):
                    reply, _ = await self._call_peer(stage, "backward", inputs=acts[stage], grad_outputs=grad,
                                                     step=steps[stage], mb=mb, prefer=served[stage])
                    grad = reply.tensors.get("grad_inputs")
            except _Redo:
                s.stale_redos += 1
                continue
            break
        s.microbatches_completed += 1
        s.samples += x.shape[0]
        self._step_losses.setdefault(last_step, []).append((loss, x.shape[0]))
        return loss, last_step, x.shape[0]

    async def _call_peer(
        self,
        stage: int,
        kind: str,
        *,
        inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        grad_outputs: torch.Tensor | None = None,
        step: int | None = None,
        mb: int | None = None,
        prefer: str | None = None,
    ) -> tuple[StageReply, str]:
        """One request to some peer of ``stage``: route, retry elsewhere on failure, wait for peers;
        the reply and the id of the peer that answered.

        ``mb`` is the microbatch's id (the peers' activation cache); ``prefer`` a peer to try
        first when it is usable (a backward's: the peer that ran the forward).
        """
        assert self._client is not None and self.spec is not None
        router = self.routers[stage]
        tried: set[str] = set()
        waiting_since: float | None = None
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
                    )
                tried.clear()
                unban = router.next_unban_in()
                await asyncio.sleep(min(unban if unban is not None else 0.5, 0.5))
                await self._refresh_view()
                continue
            peer_id, addr = choice
            router.begin(peer_id)
            started = time.monotonic()
            try:
                if kind == "forward":
                    reply = await self._client.forward(addr, stage, inputs, targets,
                                                       codec=self.config.codec, model=self.spec.digest, mb=mb)
                else:
                    reply = await self._client.backward(addr, stage, inputs, grad_outputs, targets,
                                                        codec=self.config.codec, model=self.spec.digest, step=step,
                                                        mb=mb)
            except PeerError as exc:
                if exc.error == "StaleStep":
                    router.release(peer_id)
                    raise _Redo() from exc
                if exc.status == 503:  # Busy (averaging) or Draining: not this peer's fault
                    router.release(peer_id)
                    if exc.error == "Draining":
                        tried.add(peer_id)
                    await asyncio.sleep(0.02)
                    continue
                if exc.error in ("PeerBehind", "WrongStage"):
                    router.release(peer_id)
                    tried.add(peer_id)
                    continue
                if exc.status in (0, 408) or exc.status >= 500:
                    self.summary.retries += 1
                    self.summary.bans += 1
                    ban = router.report_failure(peer_id)
                    log.warning("stage %d peer %s failed (%s); banned for %.1fs, retrying elsewhere",
                                stage, peer_id[:12], exc, ban)
                    tried.add(peer_id)
                    continue
                router.release(peer_id)
                raise TrainerError(f"stage {stage} peer {peer_id[:12]} refused a request: {exc}") from exc
            except BaseException:
                router.release(peer_id)
                raise
            router.report_success(peer_id, inputs.shape[0], time.monotonic() - started)
            if "step" in reply.meta:
                self._stage_steps[stage][peer_id] = int(reply.meta["step"])
            return reply, peer_id

    # ---- validation ------------------------------------------------------------------------------

    async def _validate(self, batches: list) -> None:
        assert self.spec is not None
        last = self.spec.n_stages - 1
        total, count = 0.0, 0
        for x, y in batches:
            acts = x
            for stage in range(last):
                acts = (await self._call_peer(stage, "forward", inputs=acts))[0].tensors["outputs"]
            reply, _ = await self._call_peer(last, "forward", inputs=acts, targets=y)
            total += float(reply.meta["loss"]) * x.shape[0]
            count += x.shape[0]
        if count:
            self.summary.val_loss = total / count
            self.summary.val_losses.append((self.summary.steps, self.summary.val_loss))
