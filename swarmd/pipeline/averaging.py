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

Compression (``TrainingSpec.grad_codec``: ``none``, ``fp16``, ``8bit``, ``4bit``; the quantizing
ones with error feedback, :mod:`swarmd.pipeline.error_feedback`). Contributions travel
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
between that check and the answers; ``tests/integration/test_averaging_faults.py`` covers the rest.)

Who follows whom. A peer behind follows the stage-mates ahead only when they are at least as many
as the peers at its own step (itself included): a lost answer leaves the majority ahead, while a
peer that stepped on a batch of its own, or on its own lie, leaves the majority here. The price
is liveness: two peers left behind *together* by one that stepped alone stay behind, since the
trainers' lease book moves to the stage's front step and no longer feeds theirs. So a peer about
to step alone first reads its listing afresh (``_newly_listed``): mates that began serving within
the listing's cache second are polled and proven first (``FIRST_PROOF_WAIT_S``). What remains is a
mate listed but not proven within that wait; it is not resolved here.

Why one leader per round. Its answer is the round's one atomic decision: everybody applies that
mean, or nobody does and everybody keeps its gradients. The price is traffic: the leader receives
and sends ``(n - 1) * |grads|`` each way (``scripts/bench_averaging.py``). The chunked all-reduce
of ``swarmd.pipeline.allreduce`` (``TrainingSpec.averaging = "allreduce"``) spreads that to about
``2 * |grads|`` per peer whatever ``n``, and keeps the one decision with a signed commit protocol
(its module docstring has the state diagram); this module stays the default.

Members that lie or do not exist (issues #17 and #18). A stage takes part in rounds only with
stage-mates that *proved themselves* recently (``swarmd.net.proof``: a signed challenge at the
announced address) and whose ``/v1/progress`` shows the same step *and* the same params digest:
only they are polled, waited for, or chosen as leader, so a fake record with the smallest peer
id, pointing at a port that never answers, costs one bounded challenge in a background task and
never a round. Contributions are signed with the contributor's identity and refused unless they
come from a proven, non-excluded stage-mate. The leader refuses outlier contributions and
publishes what it used; contributors check the answer before applying it
(``swarmd.pipeline.round_checks`` has the rules and why). A refused answer is not applied (the
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
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import aiohttp
import msgpack
import torch

from swarmd.dht.identity import Identity, peer_id_of, verify
from swarmd.errors import Busy, PeerError
from swarmd.finite import all_finite
from swarmd.net.addresses import is_relayed
from swarmd.net.client import DataPlaneClient
from swarmd.net.messages import AverageReply, AverageRequest, ProgressReply
from swarmd.net.wire import Frame, decode_frame, encode_frame
from swarmd.pipeline.executor import Contribution, StageExecutor
from swarmd.pipeline.hostile_contributions import HostileWatch
from swarmd.pipeline.round_checks import (
    StallWatch,
    Suspicions,
    Used,
    check_answer,
    per_sample_norm,
    tensor_digest,
)
from swarmd.pipeline.round_patience import RoundPatience
from swarmd.pipeline.round_reduction import HOSTILE_EXCLUSION_S, reduce_contributions
from swarmd.pipeline.step_protocol import repeated_microbatches

if TYPE_CHECKING:
    from swarmd.net.proof import Prover

log = logging.getLogger(__name__)


class StagePeers(Protocol):
    """The serving stage-mates (peer_id -> data_addr), this peer included; ``fresh``: read now,
    not from a listing cached for a moment (the daemon's DHT lookup)."""

    def __call__(self, *, fresh: bool = False) -> Awaitable[dict[str, str]]: ...


#: A contributor waits this long past ``averaging_timeout_s`` for the leader's answer (upload,
#: reduction, the optimizer step, download), then takes its gradients back.
REPLY_SLACK_S = 30.0
#: A leader commits a round only this soon after the round's deadline; later (it was frozen:
#: a VM pause, SIGSTOP, swapping), its contributors may have given up and stepped without it,
#: so it aborts instead. Well below REPLY_SLACK_S: a leader that commits is still awaited.
COMMIT_GRACE_S = 10.0
#: How long one poll of a stage-mate's ``/v1/progress`` may take before it counts as silent.
POLL_TIMEOUT_S = 2.0
#: A round does not start while a few stage-mates never challenged before are being proven, at
#: most this long (once per new identity: a failed one backs off and is not waited for again).
FIRST_PROOF_WAIT_S = 2.0
#: ... and only when at most this many are new at once: a joining honest peer or two, not a flood
#: of minted identities (those are proven in the background while rounds go on without them).
FIRST_PROOF_WAIT_MAX = 8
#: At most one warning per peer and reason in this many seconds (a liar must not flood the log).
LOG_EVERY_S = 30.0

_CONTRIBUTION_DOMAIN = b"swarmd-average/1\x00"


def contribution_message(stage: int, step: int, samples: int, digest: str, peer_id: str, leader: str) -> bytes:
    """What a contributor signs: its contribution, and to whom it is sent (so it cannot be replayed
    to another leader or step)."""
    return _CONTRIBUTION_DOMAIN + msgpack.packb([stage, step, samples, digest, peer_id, leader], use_bin_type=True)


@dataclass(frozen=True)
class RoundResult:
    status: Literal["ok", "aborted"]
    step: int
    samples: int  # total samples averaged
    contributors: int
    mean_grads: torch.Tensor | None  # flat float32, on "ok": exactly what every peer applies
    reply: bytes | None = None  # the leader's answer frame on "ok", encoded once for all contributors
    used: tuple[Used, ...] | None = None  # the contributions the mean holds (published in the answer)
    reason: str | None = None  # why this contribution was turned away, when it was

    def to_reply(self, stage: int) -> AverageReply:
        """The ``POST /v1/average`` answer that says this outcome."""
        return AverageReply(stage=stage, status=self.status, step=self.step, samples=self.samples,
                            contributors=self.contributors, grads=self.mean_grads,
                            used=tuple((u.peer_id, u.samples, u.digest, u.norm) for u in self.used)
                            if self.used is not None else None, reason=self.reason)


def _aborted(step: int, reason: str | None = None) -> RoundResult:
    return RoundResult("aborted", step, 0, 0, None, reason=reason)


@dataclass
class _OpenRound:
    """The leader's side of one round."""

    step: int
    expected: set[str]
    deadline: float
    contributions: dict[str, Contribution] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # of the contributions' gradients, as decoded here
    refused: dict[str, str] = field(default_factory=dict)  # contributions the reduction refused, and why
    refused_samples: int = 0  # their samples (kept by their senders)
    convicted: dict[str, str] = field(default_factory=dict)  # peers the reduction convicted (round_reduction)
    clipped: tuple[str, ...] = ()  # contributions whose influence the robust mean cut
    struck: tuple[str, ...] = ()  # contributions counted for their samples but left out of the mean
    closed: bool = False  # reduced: the mean is fixed, a contribution arriving now is turned away
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    result: asyncio.Future[RoundResult] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def lone_mean(grads: torch.Tensor, samples: int) -> torch.Tensor:
    """The mean of one peer's float32 gradient sum over ``samples``, bit for bit what the round's
    float64 path gives for a lone contribution (``((zeros + grads) / samples).float()``), in
    one float32 copy (see :meth:`StageAverager._reduce_alone`)."""
    return torch.add(grads, 0.0).div_(samples)


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
        identity: Identity | None = None,
        prover: Prover | None = None,
        exclude: Callable[[], set[str]] | None = None,
        suspicions: Suspicions | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """``session``: the daemon's (signed in a private swarm); the averager talks to its
        stage-mates through a :class:`DataPlaneClient` on it and leaves it open.

        ``identity``: signs this peer's contributions, and makes it refuse unsigned ones (None:
        neither, for tests of the reduction alone). ``prover``: the daemon's proofs of its peers
        (``swarmd.net.proof``); with it, only proven stage-mates are polled, waited for, led by
        or accepted (None: every listed stage-mate is trusted). ``exclude``: peers excluded from
        elsewhere (the trainers' reports), treated as this averager's own excluded peers.
        ``on_round``: told of every round this peer recorded (``last_round``, with its ``duration_s``),
        for the daemon's ``swarmd_averaging_round_duration_seconds``."""
        self.executor = executor
        self.peer_id = peer_id
        self.stage_peers = stage_peers
        self.session = session
        self.client = DataPlaneClient(session=session)
        self.poll_s = poll_s
        self.on_behind = on_behind
        self.identity = identity
        self.prover = prover
        self.exclude = exclude or set
        self.suspicions = suspicions or Suspicions()
        self.on_round = on_round
        self.rounds_ok = 0
        self.rounds_aborted = 0
        self.control_requests: Counter[str] = Counter()  # averaging requests without gradients sent, by kind
        self.rounds_refused = 0  # answers of a leader this peer refused to apply
        self.leaders_refused: Counter[str] = Counter()  # by leader peer id
        self.leaders_stalling: Counter[str] = Counter()  # leaders accused of aborting every round, by peer id
        self.stalls = StallWatch()
        self.contributions_refused: Counter[str] = Counter()  # by reason (outlier, unproven, unsigned, ...)
        self.refused_samples = 0  # samples of contributions this leader refused
        self.hostile = HostileWatch()  # strikes of the contributions this peer scored as leader (issue #29)
        self.hostile_convictions: Counter[str] = Counter()  # peers convicted of hostile contributions
        self.contributions_clipped = 0  # contributions whose influence the robust mean cut, in rounds led
        self.contributions_struck = 0  # contributions left out of the mean as hostile-looking, in rounds led
        # microbatch ids two contributions to a round this peer led both held: counted twice, seen
        # (the exactly-once rule's last resort, swarmd.pipeline.step_protocol)
        self.duplicate_microbatches = 0
        self.patience = RoundPatience()  # how long rounds wait for contributors (issue #18)
        self.silent_contributors = 0  # expected contributors that never came (then excluded)
        self._led_mbs: tuple[int, frozenset[int]] = (-1, frozenset())  # the step and ids of the last round led
        self.last_round: dict[str, Any] | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=256)  # recent rounds this peer took part in
        self._leader_view: str | None = None
        self._round: _OpenRound | None = None
        self._suspects: dict[str, float] = {}  # leaders that failed us, excluded until this time
        self._tasks: set[asyncio.Task[None]] = set()  # rounds opened by a stage-mate's request; proofs
        self._proving: asyncio.Task[None] | None = None
        self._mates_samples = 0  # what the stage-mates held at this step, as last polled
        self._mates: dict[str, str] = {}  # the stage-mates last listed (for /status: how many are unproven)
        self._logged: dict[tuple[str, str], float] = {}
        self._posting_to = ""  # the leader _post sends to
        self._own_addr = ""  # this peer's address, as the stage's records list it

    async def close(self) -> None:
        """Cancel and await the rounds this peer leads on behalf of others and its proofs; stop the
        client's codec threads (the session is the daemon's)."""
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

    def excluded(self) -> set[str]:
        """Peers this stage does not average with now: caught by the round checks, or excluded by
        the trainers' reports (``exclude``)."""
        return self.suspicions.excluded() | set(self.exclude())

    def distrusted(self) -> set[str]:
        """Peers this one must not take state from: excluded now, or caught lying to it lately
        (``Suspicions.offenders``) -- a refused leader stepped on its own lie, and its state is that."""
        return self.excluded() | self.suspicions.offenders()

    def checks_status(self) -> dict[str, Any]:
        """The round checks' counts for ``/status`` (``averaging``)."""
        out: dict[str, Any] = {
            "rounds_refused": self.rounds_refused,
            "leaders_refused": dict(self.leaders_refused),
            "leaders_stalling": dict(self.leaders_stalling),
            "contributions_refused": dict(self.contributions_refused),
            "refused_samples": self.refused_samples,
            "hostile_convictions": dict(self.hostile_convictions),
            "contributions_clipped": self.contributions_clipped,
            "contributions_struck": self.contributions_struck,
            "duplicate_microbatches": self.duplicate_microbatches,
            "silent_contributors": self.silent_contributors,
            "excluded": self.suspicions.status(),
            "excluded_by_reports": sorted(self.exclude()),
            "control_requests": dict(self.control_requests),
        }
        if self.prover is not None:
            out["proofs"] = self.prover.table.status(self._mates)
        return out

    def progress(self) -> ProgressReply:
        """This peer's answer to ``GET /v1/progress`` while it takes part in rounds."""
        ex = self.executor
        rnd = self._round
        open_ = rnd is not None and not rnd.result.done()  # not answered yet
        snapshot = ex.progress_snapshot  # step and digest of one moment
        return ProgressReply(
            peer_id=self.peer_id,
            stage=ex.stage,
            step=snapshot.step,
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
            params_digest=snapshot.digest,
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

    async def _trusted_mates(self) -> dict[str, str]:
        """The stage-mates (not this peer) this peer averages with: listed, not excluded, proven."""
        mates = await self.stage_peers()
        self._own_addr = mates.pop(self.peer_id, "")
        excluded = self.excluded()
        mates = {pid: addr for pid, addr in mates.items() if pid not in excluded}
        self._mates = mates
        if self.prover is None:
            return mates
        prover = self.prover
        fresh = [pid for pid, addr in mates.items() if prover.table.due(pid, addr) and not prover.table.tried(pid)]
        task = self._prove(mates)
        if fresh and len(fresh) <= FIRST_PROOF_WAIT_MAX and task is not None:  # new: a moment to prove themselves
            await asyncio.wait({task}, timeout=FIRST_PROOF_WAIT_S)
        return {pid: mates[pid] for pid in prover.proven(mates)}

    async def _newly_listed(self) -> bool:
        """Whether a fresh read of the stage's listing names a stage-mate (not excluded) that the
        last one did not. Asked before a round of this peer alone: stage-mates that began serving
        within the listing's cache age may hold samples of this step (trainers route to a peer as
        soon as its record is out), and a lone step would leave them behind together, where the
        rule of :meth:`_tick` keeps them (two of them outnumber the one ahead) for good."""
        listed = await self.stage_peers(fresh=True)
        listed.pop(self.peer_id, None)
        excluded = self.excluded()
        return any(pid not in self._mates and pid not in excluded for pid in listed)

    def _prove(self, mates: dict[str, str]) -> asyncio.Task[None] | None:
        """Challenge the due stage-mates in a task this averager owns (one at a time); the task."""
        prover = self.prover
        if prover is None:
            return None
        if self._proving is not None and not self._proving.done():
            return self._proving
        due = prover.due(mates)
        if not due:
            return None

        async def prove() -> None:
            await prover.prove_all(due, stage=self.executor.stage)

        task = asyncio.get_running_loop().create_task(prove(), name="swarmd-prove")
        self._proving = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _tick(self) -> None:
        ex = self.executor
        if ex.averaging or self._round is not None:
            return
        mates = await self._trusted_mates()
        own = self._own_addr
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
            await self.on_behind(max(ahead))
            return
        if ex.averaging or self._round is not None:  # a stage-mate opened a round meanwhile
            return
        digest = ex.digest
        # a stage-mate at this step with other parameters cannot share a round: its mean would not
        # keep the two bit-identical (and one of them is wrong)
        group = {pid: mates[pid] for pid, p in progress.items() if p.step == step and p.params_digest == digest}
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
            await self._contribute_to(self._leader_view, group[self._leader_view])

    async def _poll(self, mates: dict[str, str]) -> dict[str, ProgressReply]:
        """The progress of the stage-mates that answered and take part in this stage's rounds."""

        async def one(pid: str, addr: str) -> tuple[str, ProgressReply | None]:
            try:
                body = await self.client.progress(addr, timeout_s=POLL_TIMEOUT_S)
            except PeerError:  # silent, refusing or unreadable: not part of this round
                return pid, None
            # a peer leaving the stage (away) takes no part in its rounds; nor one that answers for another
            ok = not body.away and body.stage == self.executor.stage and body.peer_id in (None, pid)
            return pid, body if ok else None

        self.control_requests["progress"] += len(mates)
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
        started = time.monotonic()
        try:
            own = await self.executor.take_contribution()
        except Busy:  # our gradients are already out (we are contributing elsewhere)
            result = _aborted(rnd.step)
            rnd.result.set_result(result)
            self._round = None
            return result
        rnd.contributions[self.peer_id] = own
        # a silent proven contributor (a fake that passed the proof) is waited for only as long as
        # honest contributions take (swarmd.pipeline.round_patience), then excluded
        opened = rnd.deadline - self.timeout_s
        patient_until = min(rnd.deadline, opened + self.patience.wait_s(self.timeout_s, rnd.expected - {self.peer_id}))
        arrivals: dict[str, float] = {}
        try:
            while not rnd.expected <= set(rnd.contributions) | set(rnd.refused):
                arrivals.update({p: time.monotonic() - opened for p in rnd.contributions if p not in arrivals})
                remaining = patient_until - time.monotonic()
                if remaining <= 0:
                    break
                rnd.arrived.clear()
                try:
                    await asyncio.wait_for(rnd.arrived.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            arrivals.update({p: time.monotonic() - opened for p in rnd.contributions if p not in arrivals})
            # From here the mean is fixed: a contribution arriving while we apply it would be
            # answered with a mean that does not hold it, and its samples would vanish.
            rnd.closed = True
            self._accuse_silent(rnd, set(rnd.contributions) | set(rnd.refused))
            result = await asyncio.to_thread(self._reduce, rnd)
            if result.status == "ok":
                self.patience.observe({p: d for p, d in arrivals.items() if p != self.peer_id})
            for pid, why in sorted(rnd.refused.items()):
                if pid not in rnd.convicted:
                    self._refuse_contributor(pid, why, rnd.step)
            self._convict(rnd)
            self.refused_samples += rnd.refused_samples
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
                groups = [c.mbs for _, c in sorted(rnd.contributions.items())]
                last_step, last_ids = self._led_mbs
                repeated = repeated_microbatches([*groups, last_ids] if last_step == rnd.step - 1 else groups)
                self._led_mbs = (rnd.step, frozenset(m for g in groups for m in g))
                if repeated:
                    self.duplicate_microbatches += len(repeated)
                    log.warning("stage %d step %d: %d microbatch(es) were counted by two peers (a lost backward "
                                "answer whose peer could not be asked); the step weighs them twice",
                                self.executor.stage, rnd.step, len(repeated))
            else:
                await self.executor.restore_contribution(own)
                self.rounds_aborted += 1
            self._record(result, self.peer_id, missing=sorted(rnd.expected - set(rnd.contributions)),
                         refused=dict(rnd.refused), started=started, clipped=rnd.clipped, struck=rnd.struck,
                         convicted=rnd.convicted)
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

    def _convict(self, rnd: _OpenRound) -> None:
        """Exclude the peers this round's reduction convicted of hostile contributions
        (``hostile_contributions``), as long as the trainers' reports exclude a peer at first."""
        self.contributions_clipped += len(rnd.clipped)
        self.contributions_struck += len(rnd.struck)
        for pid, why in sorted(rnd.convicted.items()):
            self.hostile_convictions[pid] += 1
            period = self.suspicions.accuse(pid, why, base_s=HOSTILE_EXCLUSION_S)
            if self.prover is not None:
                self.prover.table.forget(pid)
            dropped = "dropped from" if pid in rnd.refused else "kept, clipped, in"
            log.warning("stage %d step %d: convicted %s of hostile contributions (%s); its contribution %s this "
                        "round; excluded from this peer's rounds for %.0fs", self.executor.stage, rnd.step,
                        pid[:12], why, dropped, period)

    def _accuse_silent(self, rnd: _OpenRound, arrived: set[str]) -> None:
        """Exclude the expected contributors that never came (issue #18: a proof shows a peer holds
        its identity, not that it will contribute), with the growing periods of the round checks."""
        for pid in sorted(RoundPatience.silent(rnd.expected, arrived, leader=self.peer_id)):
            period = self.suspicions.accuse(pid, "silent: expected in a round, never contributed")
            self.silent_contributors += 1
            self._warn(pid, "silent", "stage %d step %d: stage-mate %s was expected in the round and never "
                       "contributed; excluded from this stage's rounds for %.0fs", self.executor.stage, rnd.step,
                       pid[:12], period)

    def _reduce(self, rnd: _OpenRound) -> RoundResult:
        """Refuse outliers, take the robust mean, score the contributions, encode the answer
        (``swarmd.pipeline.round_reduction``; off the event loop: called in a thread)."""
        own = rnd.contributions.get(self.peer_id)
        if set(rnd.contributions) <= {self.peer_id} and own is not None and own.samples >= self.target:
            return self._reduce_alone(rnd, own)
        if own is not None and self.peer_id not in rnd.digests:
            rnd.digests[self.peer_id] = tensor_digest(own.grads)
        ex = self.executor
        red = reduce_contributions(rnd.contributions, rnd.digests, leader=self.peer_id, target=self.target,
                                   numel=ex.grad_numel, watch=self.hostile)
        for pid, why in red.refused.items():
            rnd.refused[pid] = why
            rnd.contributions.pop(pid)
        rnd.refused_samples += red.refused_samples
        rnd.convicted, rnd.clipped, rnd.struck = dict(red.convicted), red.clipped, red.struck
        if red.scores:
            log.debug("stage %d step %d: contribution scores %s", ex.stage, rnd.step,
                      {pid[:8]: (round(sc.far, 2), round(sc.cos, 3)) for pid, sc in red.scores.items()})
        used, total, mean = red.used, red.total, red.mean
        if mean is None and total < self.target:
            log.warning(
                "stage %d step %d: only %d of %d samples arrived from %d peer(s)%s; round aborted, gradients kept",
                ex.stage, rnd.step, total, self.target, len(rnd.contributions),
                f" ({len(red.refused)} refused)" if red.refused else "",
            )
        elif mean is None:  # cannot happen with finite contributions; never apply it
            log.error("stage %d step %d: the mean gradient is not finite; round aborted", ex.stage, rnd.step)
        if mean is None:
            return RoundResult("aborted", rnd.step, total, len(rnd.contributions), None)
        if set(rnd.contributions) <= {self.peer_id}:  # a lone peer: nobody to answer, nothing to encode
            return RoundResult("ok", rnd.step, total, len(rnd.contributions), mean, used=used)
        codec = _wire_codec(mean, ex.training.grad_codec)
        answer = RoundResult("ok", rnd.step, total, len(rnd.contributions), mean, used=used).to_reply(ex.stage)
        reply = answer.encode(codec)
        if codec != "none":  # lossy: apply what the contributors will decode, bit for bit
            mean = decode_frame(reply).tensors["grads"]
        return RoundResult("ok", rnd.step, total, len(rnd.contributions), mean, reply, used=used)

    def _reduce_alone(self, rnd: _OpenRound, own: Contribution) -> RoundResult:
        """:meth:`_reduce` for a round that holds only this peer's own gradients, at least the
        target (a stage of one, or stage-mates that did not join; a short one takes the general
        path, which aborts it): nobody to check against or to answer, so no digest of the
        contribution (the ``used`` list goes to no one), no float64 copy of it, and a finiteness
        test that sums first (:func:`~swarmd.finite.all_finite`; the elementwise one took 4 ms
        here), together ~8 ms of a sync step's critical path on small.

        The mean is the general path's, bit for bit: the float32 quotient of a correctly rounded
        division rounded twice (53 >= 2 * 24 + 2 bits); + 0.0 first turns -0.0 into +0.0 as
        zeros + g does, and keeps the sign of a quotient that underflows to zero (checked on 27M
        values, with subnormals)."""
        samples = own.samples
        if own.grads is None:
            mean = torch.zeros(self.executor.grad_numel, dtype=torch.float32)
        else:
            mean = lone_mean(own.grads, samples)
        if not all_finite(mean):  # contributions are checked finite; never apply one that is not
            log.error("stage %d step %d: the mean gradient is not finite; round aborted", self.executor.stage, rnd.step)
            return RoundResult("aborted", rnd.step, samples, 1, None)
        norm = float(torch.linalg.vector_norm(mean))  # ||sum|| / samples: the per-sample norm used lists carry
        return RoundResult("ok", rnd.step, samples, 1, mean, used=(Used(self.peer_id, samples, "", norm),))

    async def contribute(self, peer_id: str, step: int, samples: int, grads: torch.Tensor | None,
                         request: AverageRequest | None = None) -> RoundResult:
        """A stage-mate's contribution arrived (``POST /v1/average``): join or open the round.

        ``request``: the decoded request, for its signature (refused unsigned when this averager
        has an identity)."""
        ex = self.executor
        if step != ex.step:
            return _aborted(step)
        if grads is not None and grads.numel() != ex.grad_numel:
            raise ValueError(f"a contribution must carry {ex.grad_numel} gradient values, got {grads.numel()}")
        why = await self._admit(peer_id, step, samples, grads, request)
        if why is not None:
            self.contributions_refused[why.split(":")[0]] += 1
            self._warn(peer_id, why.split(":")[0], "stage %d step %d: contribution of %s refused (%s)",
                       ex.stage, step, peer_id[:12], why)
            return _aborted(step, why)
        if step != ex.step:  # stepped while the signature was checked
            return _aborted(step)
        digest = request.digest if request is not None and request.digest is not None else None
        if self._round is None:
            if ex.averaging:  # we are contributing to another leader ourselves
                return _aborted(step)
            rnd, _ = self._open(step, {peer_id})
            rnd.contributions[peer_id] = Contribution(step=step, samples=samples, grads=grads,
                                                      mbs=request.mbs if request is not None else ())
            if digest is not None:
                rnd.digests[peer_id] = digest
            task = asyncio.get_running_loop().create_task(self._settle_owned(rnd), name="swarmd-average")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            rnd = self._round
            if rnd.step != step or rnd.closed or rnd.result.done():  # too late for this round: keep them
                return _aborted(step)
            rnd.contributions[peer_id] = Contribution(step=step, samples=samples, grads=grads,
                                                      mbs=request.mbs if request is not None else ())
            if digest is not None:
                rnd.digests[peer_id] = digest
            rnd.expected.add(peer_id)
            rnd.arrived.set()
        result = await asyncio.shield(rnd.result)
        if peer_id in rnd.refused:  # the reduction refused it: the sender keeps its gradients
            return _aborted(step, f"refused: {rnd.refused[peer_id]}")
        return result

    async def _admit(self, peer_id: str, step: int, samples: int, grads: torch.Tensor | None,
                     request: AverageRequest | None) -> str | None:
        """Why a contribution is turned away before it joins a round (None: it may join)."""
        if peer_id in self.excluded():
            return "excluded: this stage excludes that peer for now"
        if self.identity is not None:
            if request is None or request.public_key is None or request.signature is None:
                return "unsigned: a contribution must be signed with its sender's identity"
            if peer_id_of(request.public_key) != peer_id:
                return "bad_signature: the key is not that peer id's"
            digest = await asyncio.to_thread(tensor_digest, grads)
            message = contribution_message(self.executor.stage, step, samples, digest, peer_id, self.peer_id)
            if request.digest != digest or not verify(request.public_key, message, request.signature):
                return "bad_signature: the signature does not cover these gradients for this round"
        if self.prover is not None:
            mates = await self.stage_peers()
            addr = mates.get(peer_id)
            if addr is None:
                return "unproven: not a serving stage-mate in the DHT"
            if self.prover.table.proof(peer_id, addr) is None:
                self._prove({peer_id: addr})  # it may prove itself before its next try
                return "unproven: it has not answered this peer's proof challenge yet"
        return None

    def signer_of(self, frame: Frame) -> str | None:
        """The peer that signed this contribution frame for this leader (its key hashing to the peer id
        it names, the signature covering the frame's step, samples and gradients), else None. Pure and
        thread-safe: the data plane calls it on its codec pool (it hashes the gradients)."""
        meta, grads = frame.meta, frame.tensors.get("grads")
        peer_id, pk, sig, digest = meta.get("peer_id"), meta.get("pk"), meta.get("sig"), meta.get("digest")
        step, samples = meta.get("step"), meta.get("samples")
        if not (isinstance(peer_id, str) and type(pk) is bytes and type(sig) is bytes and isinstance(digest, str)
                and type(step) is int and type(samples) is int and grads is not None
                and grads.dtype == torch.float32 and grads.dim() == 1 and grads.numel() == self.executor.grad_numel
                and peer_id_of(pk) == peer_id and tensor_digest(grads) == digest):
            return None
        message = contribution_message(self.executor.stage, step, samples, digest, peer_id, self.peer_id)
        return peer_id if verify(pk, message, sig) else None

    def note_unreadable(self, frame: Frame, why: str, signer: str | None) -> None:
        """A contribution the data plane refused while decoding it (a 422): non-finite gradients, or a
        malformed frame. Counted and logged (rate-limited); held against the peer it names only when
        that peer signed it (``signer``, from :meth:`signer_of`): anyone can send an unsigned frame in
        another's name."""
        reason = "nonfinite" if "NaN" in why else "malformed"
        self.contributions_refused[reason] += 1
        peer_id = frame.meta.get("peer_id")
        name = peer_id[:12] if isinstance(peer_id, str) else "?"
        if signer is not None:
            period = self.suspicions.accuse(signer, f"{reason}: {why[:120]}")
            rnd = self._round
            if rnd is not None and signer in rnd.expected and not rnd.closed:  # do not wait for it any longer
                rnd.expected.discard(signer)
                rnd.arrived.set()
            self._warn(signer, reason, "stage %d: refused a %s contribution signed by %s (%s); excluded from this "
                       "peer's rounds for %.0fs", self.executor.stage, reason, signer[:12], why[:200], period)
        else:
            self._warn(name, reason, "stage %d: refused an unreadable contribution naming %s (%s)",
                       self.executor.stage, name, why[:200])

    async def _settle_owned(self, rnd: _OpenRound) -> None:
        """Settle a round a stage-mate opened: first learn who else is at this step."""
        try:
            mates = await self._trusted_mates()
            progress = await self._poll(mates)
            digest = self.executor.digest
            rnd.expected |= {pid for pid, p in progress.items() if p.step == rnd.step and p.params_digest == digest}
            await self._settle(rnd)
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("averaging round of stage %d failed", self.executor.stage)

    def _refuse_contributor(self, peer_id: str, why: str, step: int) -> None:
        c = self.contributions_refused
        c[why.split(":")[0]] += 1
        period = self.suspicions.accuse(peer_id, why)
        if self.prover is not None:
            self.prover.table.forget(peer_id)
        self._warn(peer_id, "refused", "stage %d step %d: refused the contribution of %s (%s); excluded from this "
                   "peer's rounds for %.0fs", self.executor.stage, step, peer_id[:12], why, period)

    # ---- contributor -----------------------------------------------------------------------

    async def _contribute_to(self, leader: str, addr: str) -> None:
        started = time.monotonic()
        own = await self.executor.take_contribution()
        try:
            self._posting_to = leader  # (a parameter would change _post's signature, which test hooks wrap)
            mine, decoded, result = await self._post(addr, own)
        except PeerError as exc:
            log.warning("averaging with leader %s failed (%s); keeping the gradients", leader[:12], exc)
            self._suspects[leader] = time.monotonic() + 5.0
            await self.executor.restore_contribution(own)
            return
        except BaseException:
            await asyncio.shield(self.executor.restore_contribution(own))
            raise
        why = None
        if result.status == "ok" and result.mean_grads is not None:
            why = await asyncio.to_thread(self._check_answer, result, mine, decoded, leader)
        if why is not None:
            await self.executor.restore_contribution(own)  # kept, samples and all, for the next round
            self.rounds_refused += 1
            self.leaders_refused[leader] += 1
            period = self.suspicions.accuse(leader, why)
            if self.prover is not None:
                self.prover.table.forget(leader)
            self._warn(leader, "leader", "stage %d step %d: refused the answer of leader %s (%s); keeping the "
                       "gradients, and not averaging with it for %.0fs", self.executor.stage, own.step, leader[:12],
                       why, period)
            self._record(RoundResult("aborted", own.step, result.samples, result.contributors, None), leader,
                         missing=[], status="refused", reason=why, started=started)
            return
        if result.status == "ok" and result.mean_grads is not None:
            await self.executor.apply_average(result.mean_grads, own.step)
            await self.executor.keep_residual(own.grads, decoded)  # error feedback (lossy grad codecs)
            self.rounds_ok += 1
            self.stalls.answered(leader)
        else:
            await self.executor.restore_contribution(own)
            self.rounds_aborted += 1
            self._aborted_by(leader, own.step)
        self._record(result, leader, missing=[], reason=result.reason, started=started)

    def _aborted_by(self, leader: str, step: int) -> None:
        """``leader`` aborted this peer's round at ``step`` (or turned it away) while this peer's view
        held the batch: past twice the averaging timeout of that, it is accused of stalling the stage
        (``round_checks.StallWatch``)."""
        if leader == self.peer_id:
            return
        stalled = self.stalls.aborted(leader, step, 2 * self.timeout_s)
        if stalled is None:
            return
        self.leaders_stalling[leader] += 1
        period = self.suspicions.accuse(leader, f"stalling: every round aborted at step {step} for {stalled:.0f}s")
        self._warn(leader, "stalling", "stage %d step %d: leader %s aborted or turned away every round for %.0fs "
                   "while this peer's view held the batch; not averaging with it for %.0fs", self.executor.stage,
                   step, leader[:12], stalled, period)

    def _check_answer(self, result: RoundResult, mine: Used, decoded: torch.Tensor | None, leader: str) -> str | None:
        """Why this contributor refuses the leader's ``ok`` answer (off the loop: a thread)."""
        assert result.mean_grads is not None  # only called on "ok"
        if result.samples < self.target:
            return f"the round's {result.samples} samples are below the target {self.target}"
        if result.used is None:
            return "the answer does not say which contributions it used"
        return check_answer(own=mine, own_grads=decoded, mean=result.mean_grads, used=result.used,
                            total=result.samples, leader=leader, codec=self.executor.training.grad_codec)

    async def _post(self, addr: str, own: Contribution) -> tuple[Used, torch.Tensor | None, RoundResult]:
        """Send our contribution to the leader (``_posting_to``) at ``addr``; our entry as it should list it,
        our gradients as it decodes them, and the round's outcome (PeerError when the leader
        refused, did not answer in time, or answered something unreadable)."""
        ex = self.executor
        leader = self._posting_to
        codec = "none" if own.grads is None else _wire_codec(own.grads, ex.training.grad_codec)
        decoded, digest = await asyncio.to_thread(_as_decoded, own.grads, codec)
        mine = Used(self.peer_id, own.samples, digest, per_sample_norm(decoded, own.samples))
        key = sig = None
        if self.identity is not None:
            key = self.identity.public_key_bytes
            sig = self.identity.sign(contribution_message(ex.stage, own.step, own.samples, digest, self.peer_id,
                                                          leader))
        request = AverageRequest(stage=ex.stage, peer_id=self.peer_id, step=own.step, samples=own.samples,
                                 grads=own.grads, codec=codec, public_key=key, signature=sig, digest=digest,
                                 mbs=own.mbs)
        answer = await self.client.average(addr, request, grad_numel=ex.grad_numel,
                                           timeout_s=self.timeout_s + REPLY_SLACK_S)
        try:
            used = tuple(Used.from_wire(list(u)) for u in answer.used) if answer.used is not None else None
        except ValueError as exc:
            raise PeerError(200, "BadReply", f"{addr} sent an average answer this peer cannot read: {exc}") from exc
        return mine, decoded, RoundResult(status=answer.status, step=own.step, samples=answer.samples,
                                          contributors=answer.contributors, mean_grads=answer.grads, used=used,
                                          reason=answer.reason)

    def _record(self, result: RoundResult, leader: str, missing: list[str], *, status: str | None = None,
                reason: str | None = None, refused: dict[str, str] | None = None,
                started: float | None = None, clipped: tuple[str, ...] = (), struck: tuple[str, ...] = (),
                convicted: dict[str, str] | None = None) -> None:
        """Keep the round in ``last_round``/``history`` (``duration_s``: from taking this peer's
        contribution to the outcome, leader or contributor) and tell ``on_round``."""
        self.last_round = {
            "status": status or result.status,
            "step": result.step,
            "leader": leader,
            "samples": result.samples,
            "contributors": result.contributors,
            "missing": missing,
        }
        if reason is not None:
            self.last_round["reason"] = reason
        if refused:
            self.last_round["refused"] = refused
        if clipped:
            self.last_round["clipped"] = list(clipped)  # contributions whose influence the robust mean cut
        if struck:
            self.last_round["struck"] = list(struck)  # counted for their samples, left out of the mean
        if convicted:
            self.last_round["convicted"] = convicted  # peers convicted of hostile contributions by this round
        if leader == self.peer_id and result.used is not None:
            self.last_round["used"] = {u.peer_id: u.samples for u in result.used}  # whose samples the mean holds
        if started is not None:
            self.last_round["duration_s"] = round(time.monotonic() - started, 6)
        self.history.append(self.last_round)
        if self.on_round is not None:
            self.on_round(self.last_round)
        log.info("stage %d step %d: round %s with %d samples from %d peer(s)%s%s",
                 self.executor.stage, result.step, status or result.status, result.samples, result.contributors,
                 f", missing {len(missing)}" if missing else "", f", refused {len(refused)}" if refused else "")

    def _warn(self, peer_id: str, reason: str, msg: str, *args: Any) -> None:
        """A warning at most once per peer and reason every LOG_EVERY_S."""
        now = time.monotonic()
        if now - self._logged.get((peer_id, reason), -1e9) < LOG_EVERY_S:
            return
        self._logged[(peer_id, reason)] = now
        if len(self._logged) > 4096:
            self._logged.pop(next(iter(self._logged)))
        log.warning(msg, *args)


def _as_decoded(grads: torch.Tensor | None, codec: str) -> tuple[torch.Tensor | None, str]:
    """``grads`` as the leader will decode them from a frame sent with ``codec``, and their digest."""
    if grads is None:
        return None, ""
    if codec != "none":
        grads = decode_frame(encode_frame("grads", {}, {"grads": grads}, codec)).tensors["grads"]
    return grads, tensor_digest(grads)


# float16's largest finite value is 65504; anything from 65520 up rounds to inf
_FP16_LIMIT = 65504.0


def _wire_codec(grads: torch.Tensor, codec: str) -> str:
    """The codec to send ``grads`` with: the swarm's ``grad_codec``, except that gradients
    float16 cannot carry (overflow to inf, which the leader would refuse) go uncompressed. Each
    frame names its codec, so the receiver needs no agreement on it."""
    if codec == "fp16" and grads.numel() and float(grads.abs().max()) > _FP16_LIMIT:
        return "none"
    return codec
