"""Stage-wide synchronous steps: the peers of a stage average their gradients, then all step.

SWARM (paper, section 3.2) trains with a global batch: a stage's peers accumulate gradients of
microbatches from any trainer until, *together*, they hold at least ``target_batch_size``
samples; then they all-reduce the gradients (weighted by sample counts) and apply the same
optimizer step, so their parameters stay bit-identical. This module is that protocol.

Rule of a round, for the peers of one stage at step ``s``:

1. **Progress.** Every peer polls its stage-mates' ``GET /v1/progress`` (step, samples held,
   whom it takes for the round's leader) a few times a second. When the samples held at step
   ``s`` sum to ``>= target_batch_size`` and every peer that answered names the same leader,
   a round starts. The leader is the smallest peer id among the peers at step ``s`` (directly
   reachable ones first: a relayed peer leads only a stage of relayed peers): a pure function
   of the view, so peers with the same view agree without talking.
2. **Contribution.** Each peer takes its gradients out of the stage (``StageExecutor
   .take_contribution``; from then on it refuses backwards with ``Busy`` until the round
   settles) and sends them, with its sample count, to the leader's ``POST /v1/average``. A peer
   with no samples sends its count only: it still receives the update.
3. **Reduction.** The leader waits for every peer of its view at step ``s`` (itself included),
   at most ``averaging_timeout_s``. It sums the contributions in peer-id order (so the result
   does not depend on arrival order) and divides by the total sample count. If the total is
   below the target (a peer died holding gradients), the round is *aborted*: everyone puts its
   gradients back and the stage keeps accumulating; nothing is lost and no step is taken on
   too small a batch. Once the leader reduces, the round is *closed*: a contribution arriving
   later is answered "aborted" (its sender keeps its gradients), never with a mean that does
   not contain it.
4. **Update.** The leader encodes the mean once, with the swarm's ``grad_codec``, and answers
   every contributor with those same bytes; each peer, the leader included, applies the
   *decoded* mean with the same deterministic optimizer step and moves to ``s + 1``.

Compression (``TrainingSpec.grad_codec``: ``none``, ``fp16``, ``8bit``). Contributions travel
with the codec (``fp16`` falls back to ``none`` for gradients it would overflow; each frame
names its codec) and the leader reduces in float64 (finite float32 contributions cannot overflow
the mean) and answers in float32. The leader's own contribution never
travels, so it is not compressed. The mean is encoded once and the leader applies
``decode(encode(mean))``, exactly what the contributors decode, so the peers stay bit-identical
whatever the codec: re-encoding a decoded mean is not the identity for ``8bit``, which is why
the answer's bytes are built once, not per contributor. ``none`` is exact, as before.

Failures: a contributor that dies after sending is simply absent from the answers; one that
dies before sending costs the others at most ``averaging_timeout_s``. A leader that dies makes
its contributors' requests fail: they take their gradients back and retry without it. A peer
that ends up behind (its answer was lost) sees stage-mates at a later step and resyncs from one
of them (the daemon downloads their state). A leader that was *frozen* (SIGSTOP, a VM pause,
swapping) may wake after its contributors stopped waiting (``averaging_timeout_s +
REPLY_SLACK_S``) and stepped without it; so it commits a round only within ``COMMIT_GRACE_S`` of
the round's deadline and aborts it otherwise, then resyncs: stepping alone would leave it at the
same step as its stage-mates with other parameters, which nothing would ever reconcile.
(Residual risk: a freeze of more than ``REPLY_SLACK_S - COMMIT_GRACE_S`` seconds exactly
between that check and the answers; ``tests/test_averaging_faults.py`` covers the rest.)

Why one leader per round, not a chunked all-reduce. A reduce-scatter + all-gather (each peer
owning the reduction of one chunk) spreads the traffic: every peer sends and receives about
``2 * |grads|`` per round whatever the stage's size, where the leader here receives and sends
``(n - 1) * |grads|`` each way (``scripts/bench_averaging.py``: 13 MB per round for a peer of a
``small`` stage with ``none``, 40 MB for the leader of 4 peers, 94 MB of 8; a quarter of that
with ``8bit``). But the leader's answer is also the round's one atomic decision: everybody
applies that mean, or nobody does and everybody keeps its gradients. With several chunk owners
a peer can die after some owners answered and before others did; the peers then disagree on
whether step ``s`` happened (some applied chunk 1's mean, others aborted), and their parameters
diverge for good. A chunked version would need a commit protocol on top: owners reduce and hold
their chunk means; a coordinator collects "chunk ready" from every owner and announces commit
or abort; a peer applies only once it has *every* chunk and the commit, and a peer that missed
the commit (or a chunk) must resync from one that applied it rather than apply its own guess.
It also needs every owner's chunk to survive until all peers fetched it, so a dying owner after
the commit forces the others to resync. Until stages grow beyond a handful of peers per stage,
the single leader's O(n) traffic is the cheaper price for a decision that cannot split.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import torch

from swarmd.errors import Busy, PeerError
from swarmd.net.addresses import is_relayed
from swarmd.net.client import DataPlaneClient
from swarmd.net.messages import AverageReply, AverageRequest, ProgressReply
from swarmd.net.wire import decode_frame
from swarmd.pipeline.executor import Contribution, StageExecutor

log = logging.getLogger(__name__)

StagePeers = Callable[[], Awaitable[dict[str, str]]]  # serving stage-mates: peer_id -> data_addr

#: A contributor waits this long past ``averaging_timeout_s`` for the leader's answer (upload,
#: reduction, the optimizer step, download), then takes its gradients back.
REPLY_SLACK_S = 30.0
#: A leader commits a round only this soon after the round's deadline; later (it was frozen:
#: a VM pause, SIGSTOP, swapping), its contributors may have given up and stepped without it,
#: so it aborts instead. Well below REPLY_SLACK_S: a leader that commits is still awaited.
COMMIT_GRACE_S = 10.0
#: How long one poll of a stage-mate's ``/v1/progress`` may take before it counts as silent.
POLL_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class RoundResult:
    status: Literal["ok", "aborted"]
    step: int
    samples: int  # total samples averaged
    contributors: int
    mean_grads: torch.Tensor | None  # flat float32, on "ok": exactly what every peer applies
    reply: bytes | None = None  # the leader's answer frame on "ok", encoded once for all contributors

    def to_reply(self, stage: int) -> AverageReply:
        """The ``POST /v1/average`` answer that says this outcome."""
        return AverageReply(stage=stage, status=self.status, step=self.step, samples=self.samples,
                            contributors=self.contributors, grads=self.mean_grads)


@dataclass
class _OpenRound:
    """The leader's side of one round."""

    step: int
    expected: set[str]
    deadline: float
    contributions: dict[str, Contribution] = field(default_factory=dict)
    closed: bool = False  # reduced: the mean is fixed, a contribution arriving now is turned away
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    result: asyncio.Future[RoundResult] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class StageAverager:
    """One peer's part in its stage's rounds; owned and awaited by the daemon."""

    def __init__(
        self,
        executor: StageExecutor,
        *,
        peer_id: str,
        stage_peers: StagePeers,
        session: aiohttp.ClientSession,
        poll_s: float = 0.05,
        on_behind: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        """``session``: the daemon's (signed in a private swarm); the averager talks to its
        stage-mates through a :class:`DataPlaneClient` on it and leaves it open."""
        self.executor = executor
        self.peer_id = peer_id
        self.stage_peers = stage_peers
        self.session = session
        self.client = DataPlaneClient(session=session)
        self.poll_s = poll_s
        self.on_behind = on_behind
        self.rounds_ok = 0
        self.rounds_aborted = 0
        self.last_round: dict[str, Any] | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=256)  # recent rounds this peer took part in
        self._leader_view: str | None = None
        self._round: _OpenRound | None = None
        self._suspects: dict[str, float] = {}  # leaders that failed us, excluded until this time
        self._tasks: set[asyncio.Task[None]] = set()  # rounds opened by a stage-mate's request
        self._mates_samples = 0  # what the stage-mates held at this step, as last polled

    async def close(self) -> None:
        """Cancel and await the rounds this peer leads on behalf of others; stop the client's
        codec threads (the session is the daemon's)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()

    @property
    def target(self) -> int:
        return self.executor.training.target_batch_size

    @property
    def timeout_s(self) -> float:
        return self.executor.training.averaging_timeout_s

    def progress(self) -> ProgressReply:
        """This peer's answer to ``GET /v1/progress`` while it takes part in rounds."""
        ex = self.executor
        rnd = self._round
        open_ = rnd is not None and not rnd.result.done()  # not answered yet
        return ProgressReply(
            peer_id=self.peer_id,
            stage=ex.stage,
            step=ex.step,
            samples=ex.grad_samples + ex.out_samples,  # held, whether accumulating or out for averaging
            averaging=ex.averaging,
            leader=self._leader_view,
            round=rnd.step if rnd is not None and open_ and not rnd.closed else None,  # open here to contributions
            # the open round: whom it waits for, and the samples of those already in
            round_expected=tuple(sorted(rnd.expected)) if rnd is not None and open_ else None,
            round_contributors=({pid: c.samples for pid, c in sorted(rnd.contributions.items())}
                                if rnd is not None and open_ else None),
            dropped_samples=ex.dropped_samples,  # discarded by adopting a stage-mate's state (resync)
            target_batch_size=self.target,
        )

    # ---- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Poll the stage's progress and take part in rounds, until cancelled."""
        while True:
            need = self.target - self._mates_samples
            if self.executor.grad_samples >= need:  # enough by the last view, yet no round: poll
                await asyncio.sleep(self.poll_s)
            else:  # wake as soon as this peer's backwards complete the batch, not a poll period later
                await self.executor.wait_progress(self.poll_s, samples=need)
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad round must not end the stage's training
                log.exception("averaging round of stage %d failed", self.executor.stage)

    async def _tick(self) -> None:
        ex = self.executor
        if ex.averaging or self._round is not None:
            return
        mates = await self.stage_peers()
        own = mates.pop(self.peer_id, None) or ""
        progress = await self._poll(mates)
        step = ex.step
        ahead = [p.step for p in progress.values() if p.step > step]
        if ahead and self.on_behind is not None:
            log.info("stage-mates are at step %d, this peer at %d: resyncing", max(ahead), step)
            await self.on_behind(max(ahead))
            return
        if ex.averaging or self._round is not None:  # a stage-mate opened a round meanwhile
            return
        group = {pid: mates[pid] for pid, p in progress.items() if p.step == step}
        now = time.monotonic()
        # a relayed peer (swarmd.net.relay) leads only when no direct one can: its stage-mates reach it
        # through one more hop, and its relay's death would abort the round
        addrs = {**group, self.peer_id: own}
        candidates = sorted((pid for pid in addrs if self._suspects.get(pid, 0) <= now),
                            key=lambda pid: (is_relayed(addrs[pid]), pid))
        self._leader_view = candidates[0] if candidates else self.peer_id
        leader = self._leader_view
        leader_progress = progress.get(leader)
        joining_open_round = leader != self.peer_id and leader_progress is not None and leader_progress.round == step
        if not joining_open_round:
            total = ex.grad_samples + sum(p.samples for pid, p in progress.items() if pid in group)
            self._mates_samples = total - ex.grad_samples
            if total < self.target:
                return
            leaders = {p.leader for pid, p in progress.items() if pid in group}
            if leaders - {leader}:
                return  # views differ (a peer joined or left): wait until they agree
        if leader == self.peer_id:
            await self._lead(step, set(group))
        else:
            await self._contribute_to(self._leader_view, group[self._leader_view])

    async def _poll(self, mates: dict[str, str]) -> dict[str, ProgressReply]:
        """The progress of the stage-mates that answered and take part in this stage's rounds."""

        async def one(pid: str, addr: str) -> tuple[str, ProgressReply | None]:
            try:
                body = await self.client.progress(addr, timeout_s=POLL_TIMEOUT_S)
            except PeerError:  # silent, refusing or unreadable: not part of this round
                return pid, None
            # a peer leaving the stage (away) takes no part in its rounds
            return pid, body if not body.away and body.stage == self.executor.stage else None

        answers = await asyncio.gather(*(one(pid, addr) for pid, addr in mates.items()))
        return {pid: body for pid, body in answers if body is not None}

    # ---- leader ----------------------------------------------------------------------------

    def _open(self, step: int, expected: set[str]) -> tuple[_OpenRound, bool]:
        """The round for ``step``, and whether this call opened it (and so must settle it)."""
        if self._round is not None and self._round.step == step:
            self._round.expected |= expected
            return self._round, False
        self._round = _OpenRound(step=step, expected=expected | {self.peer_id},
                                 deadline=time.monotonic() + self.timeout_s)
        return self._round, True

    async def _lead(self, step: int, expected: set[str]) -> None:
        rnd, opened = self._open(step, expected)
        if opened:
            await self._settle(rnd)
        else:
            await asyncio.shield(rnd.result)

    async def _settle(self, rnd: _OpenRound) -> RoundResult:
        """Add our own contribution, wait for the others, reduce, apply, answer everyone."""
        try:
            own = await self.executor.take_contribution()
        except Busy:  # our gradients are already out (we are contributing elsewhere)
            result = RoundResult("aborted", rnd.step, 0, 0, None)
            rnd.result.set_result(result)
            self._round = None
            return result
        rnd.contributions[self.peer_id] = own
        try:
            while not rnd.expected <= set(rnd.contributions):
                remaining = rnd.deadline - time.monotonic()
                if remaining <= 0:
                    break
                rnd.arrived.clear()
                try:
                    await asyncio.wait_for(rnd.arrived.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            # From here the mean is fixed: a contribution arriving while we apply it would be
            # answered with a mean that does not hold it, and its samples would vanish.
            rnd.closed = True
            result = await asyncio.to_thread(self._reduce, rnd)
            late = time.monotonic() - rnd.deadline
            if result.status == "ok" and late > COMMIT_GRACE_S:
                log.warning("stage %d step %d: this leader is %.1fs past the round's deadline (it was frozen?); "
                            "its contributors may have given up, so the round is aborted",
                            self.executor.stage, rnd.step, late)
                result = RoundResult("aborted", rnd.step, result.samples, result.contributors, None)
            if result.status == "ok":
                assert result.mean_grads is not None
                await self.executor.apply_average(result.mean_grads, rnd.step)
                self.rounds_ok += 1
            else:
                await self.executor.restore_contribution(own)
                self.rounds_aborted += 1
            self._record(result, self.peer_id, missing=sorted(rnd.expected - set(rnd.contributions)))
            rnd.result.set_result(result)
            return result
        except BaseException as exc:
            if not rnd.result.done():
                rnd.result.set_exception(exc if isinstance(exc, Exception) else RuntimeError("round cancelled"))
                rnd.result.exception()  # retrieved: contributors see it through their requests
            if self.executor.averaging:
                await asyncio.shield(self.executor.restore_contribution(own))
            raise
        finally:
            self._round = None

    def _reduce(self, rnd: _OpenRound) -> RoundResult:
        """Sum, divide, encode the answer (off the event loop: called in a thread)."""
        total = sum(c.samples for c in rnd.contributions.values())
        if total < self.target:
            log.warning(
                "stage %d step %d: only %d of %d samples arrived from %d peer(s); round aborted, gradients kept",
                self.executor.stage, rnd.step, total, self.target, len(rnd.contributions),
            )
            return RoundResult("aborted", rnd.step, total, len(rnd.contributions), None)
        # Summed in float64, in a fixed order (the same sum whatever the arrival order). Every
        # contribution is finite float32 and carries at least one sample per gradient it sums, so
        # the mean is bounded by the largest contribution: float32 sums of huge finite gradients
        # could overflow to Inf, this cannot.
        summed = torch.zeros(self.executor.grad_numel, dtype=torch.float64)
        for pid in sorted(rnd.contributions):
            grads = rnd.contributions[pid].grads
            if grads is not None:
                summed += grads
        mean = (summed / total).to(torch.float32)
        if not bool(torch.isfinite(mean).all()):  # cannot happen with the checks above; never apply it
            log.error("stage %d step %d: the mean gradient is not finite; round aborted", self.executor.stage, rnd.step)
            return RoundResult("aborted", rnd.step, total, len(rnd.contributions), None)
        ex = self.executor
        if set(rnd.contributions) <= {self.peer_id}:  # a lone peer: nobody to answer, nothing to encode
            return RoundResult("ok", rnd.step, total, len(rnd.contributions), mean)
        codec = _wire_codec(mean, ex.training.grad_codec)
        answer = AverageReply(stage=ex.stage, status="ok", step=rnd.step, samples=total,
                              contributors=len(rnd.contributions), grads=mean)
        reply = answer.encode(codec)
        if codec != "none":  # lossy: apply what the contributors will decode, bit for bit
            mean = decode_frame(reply).tensors["grads"]
        return RoundResult("ok", rnd.step, total, len(rnd.contributions), mean, reply)

    async def contribute(self, peer_id: str, step: int, samples: int, grads: torch.Tensor | None) -> RoundResult:
        """A stage-mate's contribution arrived (``POST /v1/average``): join or open the round."""
        ex = self.executor
        if step != ex.step:
            return RoundResult("aborted", step, 0, 0, None)
        if grads is not None and grads.numel() != ex.grad_numel:
            raise ValueError(f"a contribution must carry {ex.grad_numel} gradient values, got {grads.numel()}")
        if self._round is None:
            if ex.averaging:  # we are contributing to another leader ourselves
                return RoundResult("aborted", step, 0, 0, None)
            rnd, _ = self._open(step, {peer_id})
            rnd.contributions[peer_id] = Contribution(step=step, samples=samples, grads=grads)
            task = asyncio.get_running_loop().create_task(self._settle_owned(rnd), name="swarmd-average")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            rnd = self._round
            if rnd.step != step or rnd.closed or rnd.result.done():  # too late for this round: keep them
                return RoundResult("aborted", step, 0, 0, None)
            rnd.contributions[peer_id] = Contribution(step=step, samples=samples, grads=grads)
            rnd.expected.add(peer_id)
            rnd.arrived.set()
        return await asyncio.shield(rnd.result)

    async def _settle_owned(self, rnd: _OpenRound) -> None:
        """Settle a round a stage-mate opened: first learn who else is at this step."""
        try:
            mates = await self.stage_peers()
            mates.pop(self.peer_id, None)
            progress = await self._poll(mates)
            rnd.expected |= {pid for pid, p in progress.items() if p.step == rnd.step}
            await self._settle(rnd)
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("averaging round of stage %d failed", self.executor.stage)

    # ---- contributor -----------------------------------------------------------------------

    async def _contribute_to(self, leader: str, addr: str) -> None:
        own = await self.executor.take_contribution()
        try:
            result = await self._post(addr, own)
        except PeerError as exc:
            log.warning("averaging with leader %s failed (%s); keeping the gradients", leader[:12], exc)
            self._suspects[leader] = time.monotonic() + 5.0
            await self.executor.restore_contribution(own)
            return
        except BaseException:
            await asyncio.shield(self.executor.restore_contribution(own))
            raise
        if result.status == "ok" and result.mean_grads is not None:
            await self.executor.apply_average(result.mean_grads, own.step)
            self.rounds_ok += 1
        else:
            await self.executor.restore_contribution(own)
            self.rounds_aborted += 1
        self._record(result, leader, missing=[])

    async def _post(self, addr: str, own: Contribution) -> RoundResult:
        """Send our contribution to the leader at ``addr``; the round's outcome (PeerError when
        the leader refused, did not answer in time, or answered something unreadable)."""
        ex = self.executor
        codec = "none" if own.grads is None else _wire_codec(own.grads, ex.training.grad_codec)
        request = AverageRequest(stage=ex.stage, peer_id=self.peer_id, step=own.step, samples=own.samples,
                                 grads=own.grads, codec=codec)
        answer = await self.client.average(addr, request, grad_numel=ex.grad_numel,
                                           timeout_s=self.timeout_s + REPLY_SLACK_S)
        return RoundResult(status=answer.status, step=own.step, samples=answer.samples,
                           contributors=answer.contributors, mean_grads=answer.grads)

    def _record(self, result: RoundResult, leader: str, missing: list[str]) -> None:
        self.last_round = {
            "status": result.status,
            "step": result.step,
            "leader": leader,
            "samples": result.samples,
            "contributors": result.contributors,
            "missing": missing,
        }
        self.history.append(self.last_round)
        log.info("stage %d step %d: round %s with %d samples from %d peer(s)%s",
                 self.executor.stage, result.step, result.status, result.samples, result.contributors,
                 f", missing {len(missing)}" if missing else "")


# float16's largest finite value is 65504; anything from 65520 up rounds to inf
_FP16_LIMIT = 65504.0


def _wire_codec(grads: torch.Tensor, codec: str) -> str:
    """The codec to send ``grads`` with: the swarm's ``grad_codec``, except that gradients
    float16 cannot carry (overflow to inf, which the leader would refuse) go uncompressed. Each
    frame names its codec, so the receiver needs no agreement on it."""
    if codec == "fp16" and grads.numel() and float(grads.abs().max()) > _FP16_LIMIT:
        return "none"
    return codec
