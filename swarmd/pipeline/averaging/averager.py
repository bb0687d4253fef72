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
   of the view, so peers with the same view agree without talking. A leader whose last round's
   contributors are still one step behind (applying its answer) holds off for a grace
   (``patience.CatchUp``): under delayed updates it often holds a batch alone by then,
   and a round without them would leave them behind to resync.
2. **Contribution.** Each peer takes its gradients out of the stage (``StageExecutor
   .take_contribution``; from then on it refuses backwards with ``Busy`` until the round
   settles) and sends them, with its sample count, to the leader's ``POST /v1/average``. A peer
   with no samples sends its count only: it still receives the update.
3. **Reduction.** The leader waits for every peer of its view at step ``s`` (itself included),
   at most ``averaging_timeout_s``. It sums the contributions in float64 in peer-id order (so
   the result does not depend on arrival order) and divides by the total sample count, or, when
   a contribution lies far from the others, takes their robust mean instead (issue #29:
   ``swarmd.pipeline.averaging.reduction``, below). If the total is
   below the target (a peer died holding gradients), the round is *aborted*: everyone puts its
   gradients back and the stage keeps accumulating; nothing is lost and no step is taken on
   too small a batch. Once the leader reduces, the round is *closed*: a contribution arriving
   later is answered "aborted" (its sender keeps its gradients), never with a mean that does
   not contain it.
4. **Update.** The leader encodes the mean once, with the swarm's ``grad_codec``, and answers
   every contributor with those same bytes; each peer, the leader included, applies the
   *decoded* mean with the same deterministic optimizer step and moves to ``s + 1``.

Compression (``TrainingSpec.grad_codec``: ``none``, ``fp16``, ``8bit``, ``4bit``; the quantizing
ones with error feedback, :mod:`swarmd.pipeline.averaging.error_feedback`). Contributions travel
with the codec (``fp16`` falls back to ``none`` for gradients it would overflow; each frame
names its codec) and the leader reduces in float64 (finite float32 contributions cannot overflow
the mean) and answers in float32. The leader's own contribution never
travels, so it is not compressed. The mean is encoded once and the leader applies
``decode(encode(mean))``, exactly what the contributors decode, so the peers stay bit-identical
whatever the codec: re-encoding a decoded mean is not the identity for ``8bit``, which is why
the answer's bytes are built once, not per contributor. ``none`` is exact, as before. ``auto``
(the default) lets each contributor pick ``none``, ``8bit`` or ``5level`` for its link to the leader
from that link's measured throughput, and the leader answers in the most compressed of the codecs
it received (``swarmd.pipeline.averaging.codec_choice``); on loopback it is ``none``.

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
between that check and the answers; ``tests/integration/test_averaging_faults.py`` covers the rest.)

Who follows whom. A peer behind follows the stage-mates ahead only when they are at least as many
as the peers at its own step (itself included): a lost answer leaves the majority ahead, while a
peer that stepped on a batch of its own, or on its own lie, leaves the majority here. The price
is liveness: two peers left behind *together* by one that stepped alone stay behind, since the
trainers' lease book moves to the stage's front step and no longer feeds theirs. So a peer about
to step alone first reads its listing afresh (``_newly_listed``): mates that began serving within
the listing's cache second are polled and proven first (``FIRST_PROOF_WAIT_S``). A peer alone keeps
that read fresh in the background while it trains (every ``LISTING_PERIOD_S``, back to back), and steps
on one that ended within ``LISTING_FRESH_S`` (or as long as it took), or the one in flight: on a long
link the read is a DHT lookup of up to a second, which was the largest part of a lone peer's step.
What remains is a mate whose record appeared after that read began (as during the read itself), or
listed but not proven within the wait; neither is resolved here.

Why one leader per round. Its answer is the round's one atomic decision: everybody applies that
mean, or nobody does and everybody keeps its gradients. The price is traffic: the leader receives
and sends ``(n - 1) * |grads|`` each way (``scripts/bench_averaging.py``). The chunked all-reduce
of ``swarmd.pipeline.averaging.allreduce.averager`` (``TrainingSpec.averaging = "allreduce"``) spreads that to about
``2 * |grads|`` per peer whatever ``n``, and keeps the one decision with a signed commit protocol
(its module docstring has the state diagram); this module stays the default.

Members that lie or do not exist (issues #17 and #18). A stage takes part in rounds only with
stage-mates that *proved themselves* recently (``swarmd.net.proof``: a signed challenge at the
announced address) and whose ``/v1/progress`` shows the same step *and* the same params digest:
only they are polled, waited for, or chosen as leader, so a fake record with the smallest peer
id, pointing at a port that never answers, costs one bounded challenge in a background task and
never a round. Contributions are signed with the contributor's identity and refused unless they
come from a proven, non-excluded stage-mate. The leader refuses outlier contributions, bounds
what any other one can move the mean by (a sample-weighted CenteredClip; with two contributions
one clipped step around its own gradient), leaves out of the mean a contribution far from or
against its own gradient, and convicts and excludes a peer that keeps sending such ones
(issue #29: ``reduction``, ``robust_aggregation``, ``hostile_contributions``), and on the
last stage one whose signed opening after the round shows its contribution is not the sum of its
microbatches' gradients (``contribution_proofs``, ``openings``); it
publishes what it used, and contributors check the answer before applying it
(``swarmd.pipeline.averaging.trust.round_checks`` has the rules and why). A refused answer is not applied (the
contributor keeps its gradients for the next round) and its leader is excluded for a growing
period; so is the sender of a refused contribution, and a leader that keeps aborting rounds while
its contributors hold the batch (``round_checks.StallWatch``). Contributors count no samples of
peers their leader excludes. Peers excluded by the trainers' reports (``exclude``) are treated the
same way.
"""

from __future__ import annotations

import asyncio
import logging
import time

from swarmd.net.addresses import is_relayed
from swarmd.pipeline.averaging.contributor import RoundContributor
from swarmd.pipeline.averaging.leader import RoundLeader
from swarmd.pipeline.averaging.round import (
    CATCH_UP_MAX_S,
    COMMIT_GRACE_S,
    FIRST_PROOF_WAIT_MAX,
    FIRST_PROOF_WAIT_S,
    LOG_EVERY_S,
    POLL_TIMEOUT_S,
    REPLY_SLACK_S,
    AveragerCore,
    RoundResult,
    StagePeers,
    _aborted,
    _OpenRound,
    _wire_codec,
    lone_mean,
)
from swarmd.pipeline.averaging.trust.accusations import contribution_message

__all__ = [
    "CATCH_UP_MAX_S",
    "COMMIT_GRACE_S",
    "FIRST_PROOF_WAIT_MAX",
    "FIRST_PROOF_WAIT_S",
    "LOG_EVERY_S",
    "POLL_TIMEOUT_S",
    "REPLY_SLACK_S",
    "AveragerCore",
    "RoundContributor",
    "RoundLeader",
    "RoundResult",
    "StageAverager",
    "StagePeers",
    "_OpenRound",
    "_aborted",
    "_wire_codec",
    "contribution_message",
    "lone_mean",
]

log = logging.getLogger(__name__)


class StageAverager(RoundLeader, RoundContributor):
    """One peer's part in its stage's rounds; owned and awaited by the daemon. The loop here polls
    the stage and chooses, each tick, to resync, lead (``leader``) or contribute
    (``contributor``); the state and the view of the stage-mates are ``round``'s."""

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

    def _choose_leader(self, group: dict[str, str], now: float) -> str:
        """The round's leader in this peer's view: the least id of ``group`` and this peer, not suspected;
        a relayed peer (swarmd.net.relay) leads only when no direct one can: its stage-mates reach it
        through one more hop, and its relay's death would abort the round."""
        addrs = {**group, self.peer_id: self._own_addr}
        candidates = sorted((pid for pid in addrs if self._suspects.get(pid, 0) <= now),
                            key=lambda pid: (is_relayed(addrs[pid]), pid))
        self._leader_view = candidates[0] if candidates else self.peer_id
        return self._leader_view

    async def _tick(self) -> None:
        ex = self.executor
        if ex.averaging or self._round is not None:
            return
        mates = await self._trusted_mates()
        progress = await self._poll(mates)
        step = ex.step
        # a peer caught lying to this one lately may be ahead on a fork of its own (it applied its own
        # lie): never follow it there (the honest stage-mates that refused it are at this step)
        offenders = self.suspicions.offenders()
        ahead = [p.step for pid, p in progress.items() if p.step > step and pid not in offenders]
        level = 1 + sum(1 for p in progress.values() if p.step == step)  # this peer and those at its step
        # follow only as many peers ahead as stay here: a lost answer leaves the majority ahead, while a peer
        # that stepped alone (on a batch of its own, or on its own lie) leaves the majority here
        if ahead and len(ahead) >= level and self.on_behind is not None:
            log.info("stage-mates are at step %d, this peer at %d: resyncing", max(ahead), step)
            await self._resync(max(ahead))
            return
        if ex.averaging or self._round is not None:  # a stage-mate opened a round meanwhile
            return
        digest = ex.digest
        # a stage-mate at this step with other parameters cannot share a round: its mean would not
        # keep the two bit-identical (and one of them is wrong)
        group = {pid: mates[pid] for pid, p in progress.items() if p.step == step and p.params_digest == digest}
        now = time.monotonic()
        leader = self._choose_leader(group, now)
        patience_s = self.patience.wait_s(self.timeout_s)
        # a mate naming another leader for longer than the stage's patience is not waited for to agree (a
        # proven fake can name one no honest peer would choose at every poll): left out of this peer's rounds
        apart = self.dissent.disregarded({pid: progress[pid].leader for pid in group}, leader, now=now,
                                         grace_s=patience_s, mates=mates)
        if apart:
            group = {pid: addr for pid, addr in group.items() if pid not in apart}
            leader = self._choose_leader(group, now)
        if leader == self.peer_id and self.catch_up.holds_off(
                step, {pid: p.step for pid, p in progress.items()}, now=now,
                grace_s=min(CATCH_UP_MAX_S, patience_s)):
            return  # the last round's contributors are still applying its answer: opening now would leave them behind
        leader_progress = progress.get(leader)
        joining_open_round = leader != self.peer_id and leader_progress is not None and leader_progress.round == step
        if not joining_open_round:
            # the leader's round refuses the peers it excludes (a poisoned contributor it caught): their
            # samples do not count, or this peer would open a round that aborts short at every poll
            refused = set(leader_progress.excluded) if leader_progress is not None else self.excluded()
            total = ex.grad_samples + sum(p.samples for pid, p in progress.items()
                                          if pid in group and pid not in refused)
            self._mates_samples = total - ex.grad_samples
            if total < self.target:
                return
            if self.peer_id in refused:  # the leader turns this peer away: asking would cost it a hash per try,
                self._aborted_by(leader, step)  # and one that turns everyone away stalls the stage
                return
            leaders = {p.leader for pid, p in progress.items() if pid in group}
            if leaders - {leader}:
                return  # views differ (a peer joined or left): wait until they agree
        if leader == self.peer_id and not group and await self._newly_listed():
            return  # a stage-mate began serving since the listing was read: hear from it before stepping alone
        if leader == self.peer_id:
            await self._lead(step, set(group))
        else:
            await self._contribute_to(leader, group[leader])

