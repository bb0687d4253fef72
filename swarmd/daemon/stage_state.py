"""The served stage's state on this peer: where it comes from, and where it goes when the peer leaves.

SWARM peers that join a stage, or move to another one, adopt its current state (parameters,
optimizer state, step) from a peer serving it (paper, section 3.2). Here that is one decision and
the I/O around it:

- **in** (:meth:`StageState.obtain`): the newest state of the stage wherever it is
  (``swarmd.pipeline.placement.resume`` decides): a live stage-mate's (``swarmd.pipeline.placement.state_sync``), this
  peer's own checkpoint, or another peer's checkpoint offered through the swarm
  (``swarmd.net.checkpoint_offers``); fresh parameters only while nothing in the swarm has
  trained; otherwise the stage is lost, and a joiner waits, saying so, rather than restart it;
- **behind** (:meth:`StageState.sync`): a peer the averaging rounds left behind downloads its
  stage-mates' state;
- **kept** (``swarmd.checkpoint``): checkpoints every ``--checkpoint-every`` steps, and the newest
  of every stage this peer holds offered to the swarm;
- **out** (:meth:`StageState.leave`): on a graceful stop, the accumulated gradients go to a live
  stage-mate (``swarmd.net.handover``) and a last checkpoint is written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from swarmd.checkpoint import Checkpointer, CheckpointInfo, find_checkpoints, mismatch
from swarmd.errors import StageStateLost, SwarmdError
from swarmd.net.checkpoint_offers import CheckpointOffers, checkpoint_path
from swarmd.net.handover import GradientsRequest, hand_over, handover_order
from swarmd.peer_state import PeerState
from swarmd.pipeline.placement.resume import Offer, Plan, Source, plan
from swarmd.pipeline.placement.state_sync import adopt_state, choose_donors, proven_donors

if TYPE_CHECKING:
    import torch

    from swarmd.daemon.host import Host
    from swarmd.pipeline.spec import TrainingSpec
    from swarmd.pipeline.stage.executor import StageExecutor
    from swarmd.pipeline.stage.runtime import StageRuntime

__all__ = ["CHECKPOINT_TASK", "StageState"]

log = logging.getLogger(__name__)

CHECKPOINT_TASK = "checkpoint"
#: How often a peer whose stage's state is nowhere looks again (seconds): its holder may be a peer
#: started at the same moment, listed as soon as its data plane is up
LOST_RETRY_S = 2.0


class StageState:
    """Obtains, resyncs, checkpoints and hands over the state of the stage its daemon serves."""

    def __init__(self, host: Host) -> None:
        self.host = host
        cfg = host.config
        state_dir = cfg.dht.state_dir
        # None without a --state-dir (swarmd.checkpoint)
        self.checkpoints = None if state_dir is None else Checkpointer(
            state_dir, swarm=cfg.swarm, every=cfg.checkpoint.every, keep=cfg.checkpoint.keep)
        self.offers = CheckpointOffers(self.offered_checkpoint)  # GET /v1/checkpoint/{stage}
        self.source: str | None = None  # where the served stage's state came from (swarmd.pipeline.placement.resume)
        self.synced_from: str | None = None  # the peer whose state this peer adopted last
        self.last_sync_s: float | None = None  # how long the last state download took
        # state downloads (swarmd.pipeline.placement.state_sync): /status -> state_transfer
        self.downloads: dict[str, Any] = {"downloaded_bytes": 0, "downloads_ok": 0, "downloads_failed": 0,
                                          "last_download_s": None}
        self.handover: dict[str, Any] = {"handed_out": 0, "dropped": 0, "to": None}  # on graceful leave
        self._sync_lock = asyncio.Lock()

    def received(self, n: int) -> None:
        self.downloads["downloaded_bytes"] += n

    # ---- in: a live stage-mate's state ----------------------------------------------------------

    async def resync(self, step: int) -> None:
        """The averager found this peer behind its stage: adopt a stage-mate's state at ``step``."""
        await self.sync(min_step=step, required=False)

    async def sync(self, *, min_step: int, required: bool, runtime: StageRuntime | None = None) -> bool:
        """Adopt the state of a live stage-mate at step >= ``min_step`` (``swarmd.pipeline.placement.state_sync``)
        into ``runtime`` (default: the one served now)."""
        host = self.host
        assert host.dht is not None and host.session is not None and host.spec is not None
        async with self._sync_lock:
            runtime = runtime or host.runtime
            assert runtime is not None  # built before any sync
            if runtime.executor.step >= min_step > 0:
                return True  # another sync got there first
            records = await host.dht.get_stage_peers(host.config.swarm, runtime.stage)
            # every usable stage-mate, whatever step its record says (records lag an announce period behind a
            # stage that steps fast); only those that prove, now, to hold their identity, serve at their address
            # and be at min_step or later (their proofs' step is fresh) are donors (issue #18)
            donors = await proven_donors(host.prover, choose_donors(records, self_id=host.peer_id, min_step=0),
                                         stage=runtime.stage, min_step=min_step, exclude=host.excluded_peers())
            if not donors:
                if required:
                    raise SwarmdError(f"no serving peer of stage {runtime.stage} to download its state from")
                return False
            result = await adopt_state(host.session, runtime.executor, donors, model_digest=host.spec.digest,
                                       on_received=self.received)
            self.downloads["downloads_ok" if result is not None else "downloads_failed"] += 1
            if result is None:
                if required:
                    raise SwarmdError(f"could not download the state of stage {runtime.stage} "
                                      f"from any of {len(donors)} peers")
                return False
            self.synced_from = result.donor.peer_id
            self.last_sync_s = result.seconds
            self.downloads["last_download_s"] = round(result.seconds, 3)
            if runtime.executor.throughput == 0.0 and not host.migrator.last_throughput:
                # until it measures its own: what its donor serves (a joiner announcing 0 would make its
                # stage look empty, and the rebalancer would send a second peer to fill the gap)
                host.migrator.last_throughput = result.donor.throughput
            return True

    # ---- in: the newest state wherever it is (swarmd.pipeline.placement.resume) -----------------------------

    async def plan(self, stage: int, *, min_step: int = 0, confirm: bool = False) -> Plan:
        """Every source of ``stage``'s state the swarm shows now, newest first. ``confirm``: only the
        peers among them that prove themselves at their address now (``swarmd.net.proof``, each within
        its timeout, at once): a record outlives its peer by up to its lifetime, and a move to a stage
        whose only holder died since must be refused, not accepted and then failed."""
        host = self.host
        assert host.membership is not None and host.spec is not None
        members = [r for r in await host.membership.all_peers(host.spec.n_stages) if r.peer_id != host.peer_id]
        excluded = host.excluded_peers()
        live = [(r.peer_id, r.step) for r in members if r.stage == stage and r.usable and r.peer_id not in excluded]
        offered = [(r.peer_id, step) for r in members
                   if (step := r.held_step(stage)) is not None and r.data_addr and r.reachable != "no"
                   and r.peer_id not in excluded]
        if confirm:  # the sources only: a dead peer's record still shows that the swarm trained
            addrs = {r.peer_id: r.data_addr for r in members}
            holders = {pid: addrs[pid] for pid, _ in (*live, *offered) if addrs[pid]}
            answering = await host.prover.prove_all(holders, stage=None, fresh=True) if holders else {}
            live = [(pid, step) for pid, step in live if pid in answering]
            offered = [(pid, step) for pid, step in offered if pid in answering]
        held = self.checkpoints.held if self.checkpoints is not None else {}
        trained = (any(step > 0 for step in held.values())
                   or any(r.step > 0 or any(step > 0 for _, step in r.held) for r in members))
        return plan(live=live, own=held.get(stage), offered=offered, swarm_trained=trained, min_step=min_step)

    async def obtain(self, runtime: StageRuntime, *, wait: bool) -> Source:
        """Put the newest state of ``runtime``'s stage that exists into it. A stage whose state is nowhere
        raises :class:`StageStateLost`, or with ``wait`` is reported loudly once and waited for, every
        announce period, until a peer that holds it appears."""
        host = self.host
        stage = runtime.stage
        warned = False
        announced = time.monotonic()
        while True:
            state_plan = await self.plan(stage)
            source = await self._adopt_any(runtime, state_plan)
            if source is None and state_plan.fallback is Source.FRESH:
                source = Source.FRESH
            if source is not None:
                self.source = source.value
                if warned:
                    log.warning("stage %d's state is back: adopted it (%s) at step %d", stage, source.value,
                                runtime.executor.step)
                return source
            message = _lost_message(stage, state_plan)
            if not wait:
                raise StageStateLost(message)
            if not warned:
                log.error("%s", message)
                warned = True
            self.source = Source.LOST.value
            try:  # look again soon: the holder may be a peer that is starting at the same moment
                await asyncio.wait_for(host.stop_requested.wait(), min(LOST_RETRY_S, host.config.dht.announce_period_s))
            except asyncio.TimeoutError:
                if time.monotonic() - announced >= host.config.dht.announce_period_s:
                    await host.announce_quietly()  # stay listed as joining, so nobody else is sent to this stage
                    announced = time.monotonic()
                continue
            raise SwarmdError(f"stopped while waiting for a peer that holds the state of stage {stage}")

    async def _adopt_any(self, runtime: StageRuntime, state_plan: Plan) -> Source | None:
        """Try the plan's candidates in order; the source of the first state adopted, None if none was.

        Live stage-mates are tried once, at the place of the newest step their records claim, and any of
        them will do that proves (``swarmd.net.proof``) to be at least as far as the best checkpoint on
        offer: a record's step is only its peer's word (a fake one may claim any step), a proof is fresh."""
        floor = max((o.step for o in state_plan.candidates if o.source is not Source.LIVE), default=0)
        tried_live = False
        for offer in state_plan.candidates:
            if offer.source is Source.LIVE:
                if tried_live:
                    continue
                tried_live = True
                if await self.sync(min_step=floor, required=False, runtime=runtime):
                    return Source.LIVE
            elif offer.source is Source.OWN:
                if await self._load_own(runtime):
                    return Source.OWN
            elif await self._fetch_offered(runtime, offer):
                return Source.OFFERED
        return None

    async def _load_own(self, runtime: StageRuntime) -> bool:
        """Resume ``runtime`` from this peer's newest valid checkpoint of its stage."""
        if self.checkpoints is None:
            return False
        loaded = await self.checkpoints.load_newest(runtime.stage)
        if loaded is None:
            return False
        info, tensors = loaded
        try:
            await runtime.executor.load_state(info.state_meta, tensors)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("checkpoint %s does not fit stage %d (%s); not used", info.path, runtime.stage, exc)
            return False
        self.checkpoints.newest = self.checkpoints.resumed_from = info
        log.info("resumed stage %d from checkpoint %s at step %d (params %s)", runtime.stage,
                 info.path.with_suffix(""), info.step, info.params_digest[:12])
        return True

    async def _fetch_offered(self, runtime: StageRuntime, offer: Offer) -> bool:
        """Download the checkpoint of ``runtime``'s stage that peer ``offer.peer_id`` offers, and adopt it."""
        host = self.host
        assert host.session is not None and host.spec is not None and host.membership is not None
        members = {r.peer_id: r for r in await host.membership.all_peers(host.spec.n_stages)}
        donor = members.get(offer.peer_id or "")
        if donor is None or not donor.data_addr:
            return False
        result = await adopt_state(host.session, runtime.executor, [donor], model_digest=host.spec.digest,
                                   on_received=self.received, path=checkpoint_path(runtime.stage))
        self.downloads["downloads_ok" if result is not None else "downloads_failed"] += 1
        if result is None:
            return False
        self.synced_from = donor.peer_id
        log.info("stage %d resumed from the checkpoint of step %d that peer %s holds", runtime.stage,
                 runtime.executor.step, donor.peer_id[:12])
        return True

    # ---- kept: checkpoints (swarmd.checkpoint) ------------------------------------------------

    async def offered_checkpoint(self, stage: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        """``GET /v1/checkpoint/{stage}``: this peer's newest valid checkpoint of ``stage``, or None."""
        spec = self.host.spec
        if self.checkpoints is None or spec is None or not 0 <= stage < spec.n_stages:
            return None
        loaded = await self.checkpoints.load_newest(stage)
        return None if loaded is None else (loaded[0].state_meta, loaded[1])

    async def scan(self) -> None:
        """Which checkpoints of this swarm, model and training settings this peer holds (offered to the swarm)."""
        host = self.host
        if self.checkpoints is None or host.spec is None:
            return
        spec, training, swarm = host.spec, host.training, host.config.swarm
        held = await self.checkpoints.scan(
            lambda info: mismatch(info, swarm=swarm, model_digest=spec.digest, training_digest=training.digest))
        if held:
            log.info("holds checkpoints of %s", ", ".join(f"stage {s} (step {n})" for s, n in sorted(held.items())))

    async def note_newest(self) -> None:
        """``/status`` -> checkpoint.newest: this peer's newest checkpoint of the stage it serves, even when
        it took a stage-mate's newer state rather than resume from it."""
        checkpoints, runtime = self.checkpoints, self.host.runtime
        if checkpoints is None or runtime is None:
            return
        if checkpoints.newest is None or checkpoints.newest.stage != runtime.stage:
            mine = await asyncio.to_thread(checkpoints.mine, runtime.stage)
            checkpoints.newest = mine[0] if mine else None

    async def own_checkpoints(self) -> list[CheckpointInfo]:
        """This peer's checkpoints of this swarm, newest first (sidecars only; tensors are checked on use)."""
        if self.checkpoints is None:
            return []
        found = await asyncio.to_thread(find_checkpoints, self.checkpoints.directory)
        return [c for c in found if c.swarm == self.host.config.swarm]

    def held(self, limit: int) -> tuple[tuple[int, int], ...]:
        """The checkpoints this peer offers to the swarm: the newest of each stage (the most recently stepped
        stages when it holds more than ``limit``)."""
        if self.checkpoints is None:
            return ()
        newest = sorted(self.checkpoints.held.items(), key=lambda kv: -kv[1])[:limit]
        return tuple(sorted(newest))

    def _served(self) -> tuple[StageExecutor, TrainingSpec] | None:
        """What the checkpoint task writes: the stage served now (None while moving or stopping)."""
        host = self.host
        if host.runtime is None or host.state != PeerState.SERVING:
            return None
        return host.runtime.executor, host.training

    def start_checkpointing(self) -> None:
        checkpoints = self.checkpoints
        if checkpoints is not None and checkpoints.enabled:
            self.host.tasks.spawn(CHECKPOINT_TASK, lambda: checkpoints.run(self._served), restart=True)

    # ---- out: a graceful leave ------------------------------------------------------------------

    async def leave(self) -> None:
        """Once in-flight requests are done: hand the accumulated gradients to a live stage-mate
        (``swarmd.net.handover``), then write a last checkpoint."""
        runtime = self.host.runtime
        if runtime is None:
            return
        await self._hand_over_gradients(runtime)
        if self.checkpoints is not None:
            try:
                await self.checkpoints.save(runtime.executor, self.host.training)
            except RuntimeError as exc:  # the executor is already closed
                log.warning("no checkpoint on shutdown: %s", exc)

    async def _hand_over_gradients(self, runtime: StageRuntime) -> None:
        host = self.host
        ex = runtime.executor
        if ex.grad_samples == 0 or host.identity is None or host.session is None or host.spec is None:
            return
        contribution = await ex.take_contribution()
        if contribution.grads is None or contribution.samples == 0:
            return
        try:
            mates = await host.stage_mates(max_age_s=0.0)
        except SwarmdError as exc:
            log.warning("cannot list stage-mates for the hand-over: %s", exc)
            mates = {}
        # proven stage-mates first, few others (issue #18: a listing may hold fakes at tarpits)
        averager = runtime.averager
        prover = averager.prover if averager is not None else None
        candidates = handover_order(mates, proven=set(prover.proven(mates)) if prover is not None else None,
                                    excluded=averager.excluded() if averager is not None else (),
                                    self_id=host.identity.peer_id)
        request = GradientsRequest(stage=runtime.stage, model=host.spec.digest, step=contribution.step,
                                   samples=contribution.samples, peer_id=host.identity.peer_id,
                                   grads=contribution.grads)
        result = await hand_over(host.session, candidates, request)
        if result.accepted_by is not None:
            self.handover["handed_out"] += result.samples
            self.handover["to"] = result.accepted_by
            log.info("handed the gradients of %d samples (step %d) to stage-mate %s", result.samples,
                     contribution.step, result.accepted_by[:12])
        else:
            self.handover["dropped"] += result.samples
            log.warning("no stage-mate took the gradients of %d samples (step %d): dropped (%s)", result.samples,
                        contribution.step, "; ".join(result.refusals) or "no serving stage-mate")


def _lost_message(stage: int, state_plan: Plan) -> str:
    tried = "; every source failed" if state_plan.candidates else ""
    return (f"stage {stage}'s state is lost for now: the swarm has trained, but no live peer serves stage {stage} "
            f"and no peer offers a checkpoint of it{tried}. Serving it from step 0 would undo its training, so "
            f"this peer waits; restart a peer that served stage {stage} with its --state-dir, or start a new "
            f"swarm (another --swarm name) to train from scratch")
