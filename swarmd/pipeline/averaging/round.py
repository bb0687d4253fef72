"""What both sides of a stage's averaging round share (``swarmd.pipeline.averaging.averager`` has the protocol).

The round's messages and outcomes (:class:`RoundResult`, the leader's :class:`_OpenRound`, the
signed :func:`contribution_message`), the wire-codec choice for gradients, the protocol's timing
constants, and :class:`AveragerCore`: one peer's state in its stage's rounds, its view of the
stage-mates (listed, not excluded, proven; polled for progress), and its records of rounds and
checks for ``/status``. The leader's side is :class:`~swarmd.pipeline.averaging.leader.RoundLeader`,
the contributor's :class:`~swarmd.pipeline.averaging.contributor.RoundContributor`, and the loop
that chooses between them :class:`~swarmd.pipeline.averaging.averager.StageAverager` (SWARM section 3.2).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import aiohttp
import torch

from swarmd.dht.identity import Identity
from swarmd.errors import PeerError
from swarmd.finite import all_finite
from swarmd.net.client import DataPlaneClient
from swarmd.net.links import LinkMeter, dials_loopback
from swarmd.net.messages import AverageReply, ProgressReply
from swarmd.net.wire import WireTensor, decode_frame, encode_frame, encode_tensor
from swarmd.pipeline.averaging.codec_choice import AUTO, resolve
from swarmd.pipeline.averaging.patience import CatchUp, Dissent, RoundPatience
from swarmd.pipeline.averaging.reduction import HOSTILE_EXCLUSION_S
from swarmd.pipeline.averaging.trust.accusations import Claim, OwnNorms, RecomputedEvidence, StruckClaims
from swarmd.pipeline.averaging.trust.contribution_proofs import Awaited
from swarmd.pipeline.averaging.trust.hostile_contributions import HostileWatch
from swarmd.pipeline.averaging.trust.recomputation import RECOMPUTE_SHARE
from swarmd.pipeline.averaging.trust.refusals import Refusal
from swarmd.pipeline.averaging.trust.round_checks import (
    StallWatch,
    Suspicions,
    Used,
    tensor_digest,
)
from swarmd.pipeline.stage.executor import Contribution, StageExecutor
from swarmd.pipeline.stage.step_protocol import repeated_microbatches
from swarmd.tasks import wait_cancelled

if TYPE_CHECKING:
    from swarmd.net.proof import Prover

# one logger for the whole protocol, whichever module of it speaks
log = logging.getLogger("swarmd.pipeline.averaging.averager")


def _log_failure(task: asyncio.Task[None]) -> None:
    """A done callback: log the exception a task of an averager ended with (its traceback included)."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("averaging task %s failed", task.get_name(), exc_info=exc)


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
#: A leader holds off its next round for the contributors of its last one while they apply its answer
#: (``patience.CatchUp``) for the stage's patience, and at most this long.
CATCH_UP_MAX_S = 10.0
#: A round does not start while a few stage-mates never challenged before are being proven, at
#: most this long (once per new identity: a failed one backs off and is not waited for again).
FIRST_PROOF_WAIT_S = 2.0
#: ... and only when at most this many are new at once: a joining honest peer or two, not a flood
#: of minted identities (those are proven in the background while rounds go on without them).
FIRST_PROOF_WAIT_MAX = 8
#: At most one warning per peer and reason in this many seconds (a liar must not flood the log).
LOG_EVERY_S = 30.0
#: A peer alone in its stage re-reads the stage's listing at most this often while it accumulates a batch
#: (in the background), so that the read it makes sure of before stepping alone is rarely on the step's path...
LISTING_PERIOD_S = 0.25
#: ... a read that ended at most this long before the step, or at most as long as it took itself, counts as fresh
#: (older: read again, then step; a read in flight is awaited). Ended, not begun: on a long link a DHT lookup takes
#: up to a second here, and a newly listed mate's trainers took at least as long to find its record as this
#: peer's read does (with reads back to back, the last one ended is then always fresh: no lone step waits on one);
LISTING_FRESH_S = 0.5
#: ... and it goes on this long after the peer last held samples (between batches: on a long link a DHT read
#: takes longer than a batch's backwards take to arrive, so a read begun with the batch would end after it).
LISTING_KEEP_S = 30.0
#: A resync that left this peer behind (no stage-mate proved itself at that step yet, or its download failed) is
#: tried again after a pause that doubles from ``poll_s`` up to this: the tick that finds the peer behind comes
#: round again at once, and each try reads the stage's listing and asks for proofs (in the all-reduce a member's
#: report is answered "behind" at once: without the pause that loop spun, one event loop for every daemon of a
#: test swarm, and the stage stalled).
RESYNC_PAUSE_MAX_S = 2.0
#: A stage-mate a round waited for in vain is not excluded as silent when, asked then, it says it left the stage
#: (it serves another, or is leaving: a move, ``swarmd.pipeline.placement.migration``, stops its averager mid-round):
#: at most once per peer in this many seconds, so a fake that says so whenever asked still pays for its silence.
SPARE_MOVER_EVERY_S = 300.0



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
    codecs: dict[str, str] = field(default_factory=dict)  # the codec each contribution came with
    claims: dict[str, tuple[bytes, Claim]] = field(default_factory=dict)  # signed contributions: key, claim
    refused: dict[str, Refusal] = field(default_factory=dict)  # contributions the reduction refused, and why
    refused_samples: int = 0  # their samples (kept by their senders)
    convicted: dict[str, str] = field(default_factory=dict)  # peers the reduction convicted (reduction)
    clipped: tuple[str, ...] = ()  # contributions whose influence the robust mean cut
    struck: tuple[str, ...] = ()  # contributions counted for their samples but left out of the mean
    sketched: dict[str, Awaited] = field(default_factory=dict)  # contributions sketched to check openings against
    sketch_cpu_s: float = 0.0  # what sketching them cost
    # the inputs each contribution came with: (mb, activations, targets)s, parameters' digest, precision
    inputs: dict[str, tuple[tuple[tuple[int, torch.Tensor, torch.Tensor], ...], str, str]] = field(default_factory=dict)
    closed: bool = False  # reduced: the mean is fixed, a contribution arriving now is turned away
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    result: asyncio.Future[RoundResult] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def lone_mean(grads: torch.Tensor, samples: int) -> torch.Tensor:
    """The mean of one peer's float32 gradient sum over ``samples``, bit for bit what the round's
    float64 path gives for a lone contribution (``((zeros + grads) / samples).float()``), in
    one float32 copy (see :func:`lone_result`)."""
    return torch.add(grads, 0.0).div_(samples)


def lone_result(peer_id: str, step: int, own: Contribution, numel: int) -> RoundResult:
    """The outcome of a round that holds only ``peer_id``'s own gradients, at least the target (a
    stage of one, or stage-mates that did not join): nobody to check against or to answer, so no
    digest of the contribution (the ``used`` list goes to no one), no float64 copy of it, and a
    finiteness test that sums first (:func:`~swarmd.finite.all_finite`; the elementwise one took
    4 ms here), together ~8 ms of a sync step's critical path on small. The single leader's round
    alone and the all-reduce's round of one member (``allreduce.averager``) both end here.

    The mean is the general path's, bit for bit: the float32 quotient of a correctly rounded
    division rounded twice (53 >= 2 * 24 + 2 bits); + 0.0 first turns -0.0 into +0.0 as
    zeros + g does, and keeps the sign of a quotient that underflows to zero (checked on 27M
    values, with subnormals). Off the event loop."""
    samples = own.samples
    mean = torch.zeros(numel, dtype=torch.float32) if own.grads is None else lone_mean(own.grads, samples)
    if not all_finite(mean):  # contributions are checked finite; never apply one that is not
        log.error("step %d: the mean gradient of a lone round is not finite; round aborted", step)
        return RoundResult("aborted", step, samples, 1, None)
    norm = float(torch.linalg.vector_norm(mean))  # ||sum|| / samples: the per-sample norm used lists carry
    return RoundResult("ok", step, samples, 1, mean, used=(Used(peer_id, samples, "", norm),))


def _encoded_once(grads: torch.Tensor | None, codec: str) -> tuple[torch.Tensor | None, str, WireTensor | None]:
    """``grads`` as their receiver will decode them from a frame sent with ``codec``, their digest, and (a lossy
    codec) the encoded tensor to send: the very bytes decoded here, not encoded a second time."""
    if grads is None:
        return None, "", None
    if codec == "none":
        return grads, tensor_digest(grads), None
    wire = encode_tensor(grads, codec)
    decoded = decode_frame(encode_frame("grads", {}, {"grads": wire})).tensors["grads"]
    return decoded, tensor_digest(decoded), wire


# float16's largest finite value is 65504; anything from 65520 up rounds to inf
_FP16_LIMIT = 65504.0


def _wire_codec(grads: torch.Tensor, codec: str, links: LinkMeter | None = None, addr: str = "") -> str:
    """The codec to send ``grads`` with to ``addr``: the swarm's ``grad_codec`` (under ``auto``, the one
    ``codec_choice`` picks for the link to ``addr`` as ``links`` measured it), except that gradients
    float16 cannot carry (overflow to inf, which the leader would refuse) go uncompressed. Each
    frame names its codec, so the receiver needs no agreement on it."""
    if codec == AUTO:
        link = links.estimate(addr) if links is not None else None
        codec = resolve(codec, grads.numel(), link.bytes_per_s if link is not None else None,
                        loopback=links.is_local(addr) if links is not None else dials_loopback(addr))
    if codec == "fp16" and grads.numel() and float(grads.abs().max()) > _FP16_LIMIT:
        return "none"
    return codec


class AveragerCore:
    """One peer's state in its stage's rounds, its view of the stage-mates, and its records."""

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
        self.resyncs_failed = 0  # resyncs in a row that left this peer behind (``_resync``)
        self.control_requests: Counter[str] = Counter()  # averaging requests without gradients sent, by kind
        self.rounds_refused = 0  # answers of a leader this peer refused to apply
        self.codecs_sent: Counter[str] = Counter()  # gradients this peer sent (contributions, parts), by codec
        self.leaders_refused: Counter[str] = Counter()  # by leader peer id
        self.leaders_stalling: Counter[str] = Counter()  # leaders accused of aborting every round, by peer id
        self.stalls = StallWatch()
        self.contributions_refused: Counter[str] = Counter()  # by reason (outlier, unproven, unsigned, ...)
        self.refused_samples = 0  # samples of contributions this leader refused
        self.hostile = HostileWatch()  # strikes of the contributions this peer scored as leader (issue #29)
        self.hostile_convictions: Counter[str] = Counter()  # peers convicted of hostile contributions
        self.contributions_clipped = 0  # contributions whose influence the robust mean cut, in rounds led
        self.contributions_struck = 0  # contributions left out of the mean as hostile-looking, in rounds led
        # a conviction's evidence, and what this peer seconds others' with (swarmd.pipeline.averaging.trust.accusations)
        self.struck_claims = StruckClaims()
        self.own_norms = OwnNorms()
        self.accusations: Counter[str] = Counter()  # sent, seconded, not_seconded, refused (bad evidence)
        # opened contributions (swarmd.pipeline.averaging.trust.openings): sent; as leader ok, missing, bad,
        # inconsistent
        self.openings: Counter[str] = Counter()
        self._due_openings: dict[str, bytes] = {}  # leader -> this peer's opening of its last contribution there
        self._awaited: dict[str, Awaited] = {}  # contributor -> its last contribution here, sketched
        self._opening_convictions: dict[str, str] = {}  # convicted on openings since the last round recorded
        self._owing: dict[str, int] = {}  # contributor -> the step of its contribution that came without its opening
        # the step -> parameters' digest and precision of the inputs this peer shipped with its contribution (its
        # opening signs them), and the convictions by recomputation it checked for stage-mates (accuser)
        self._shipped_at: dict[int, tuple[str, str]] = {}
        self._rechecked: dict[tuple[str, int], None] = {}
        self._recheck_queue: deque[tuple[RecomputedEvidence, Callable[[], object]]] = deque()
        self._sent_codec = "none"  # the codec of this peer's last contribution
        # sketching (both sides), openings sent, the largest gap of a consistent opening checked here
        # and the recomputations of sampled microbatches (wall seconds on the leader, input bytes shipped, the
        # largest gap of an honest recomputed part: swarmd.pipeline.averaging.trust.recomputation)
        self.opening_costs: dict[str, float] = {"cpu_s": 0.0, "bytes": 0.0, "max_gap": 0.0, "recompute_s": 0.0,
                                                "recomputed_samples": 0.0, "input_bytes": 0.0,
                                                "max_recompute_gap": 0.0, "max_extra_share": 0.0}
        # the share of its contributors' samples a leader recomputes, in expectation (recomputation)
        self.recompute_share = RECOMPUTE_SHARE
        # microbatch ids two contributions to a round this peer led both held: counted twice, seen
        # (the exactly-once rule's last resort, swarmd.pipeline.stage.step_protocol)
        self.duplicate_microbatches = 0
        self.patience = RoundPatience()  # how long rounds wait for contributors (issue #18)
        self.catch_up = CatchUp()  # the last round's contributors, still applying its answer, are waited for
        self.silent_contributors = 0  # expected contributors that never came (then excluded)
        self.dissent = Dissent()  # mates naming another leader: waited for to agree a bounded time (patience)
        self._spared: dict[str, float] = {}  # mates not excluded as silent because they had moved, and when
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
        self._own_addr = ""  # this peer's address, as the stage's records list it
        # the stage's listing read afresh (when the read began and ended, what it said), and the read in flight
        # (_prefetch_listing)
        self._listing: tuple[float, float, dict[str, str]] | None = None
        self._listing_read: asyncio.Task[None] | None = None
        self._held_at = float("-inf")  # when this peer last held samples (time.monotonic())

    def count_repeats(self, step: int, groups: list[Collection[int]]) -> None:
        """The microbatch ids of a round this peer led (one group per contribution, peer-id order):
        ids two groups hold, or the last round led (``step - 1``) held too, were counted twice. The
        step weighs them twice; they are counted in ``duplicate_microbatches`` and logged (the
        exactly-once rule's last resort, ``swarmd.pipeline.stage.step_protocol``)."""
        last_step, last_ids = self._led_mbs
        repeated = repeated_microbatches([*groups, last_ids] if last_step == step - 1 else groups)
        self._led_mbs = (step, frozenset(m for g in groups for m in g))
        if repeated:
            self.duplicate_microbatches += len(repeated)
            log.warning("stage %d step %d: %d microbatch(es) were counted by two peers (a lost backward answer "
                        "whose peer could not be asked); the step weighs them twice",
                        self.executor.stage, step, len(repeated))

    def exclude_hostile(self, peer_id: str, why: str) -> float:
        """Exclude ``peer_id`` from this peer's rounds as hostile (reason ``hostile: why``, for
        ``HOSTILE_EXCLUSION_S``, growing on repeat) and prove it afresh before trusting it again; the
        exclusion's period in seconds."""
        period = self.suspicions.accuse(peer_id, str(Refusal("hostile", why)), base_s=HOSTILE_EXCLUSION_S)
        if self.prover is not None:
            self.prover.table.forget(peer_id)
        return period

    async def mates_to_tell(self, accused: str, what: str) -> list[str]:
        """The addresses of every listed stage-mate but ``accused`` and this peer, to show ``what`` (a
        conviction's evidence); none when the listing fails or lists nobody else (both logged)."""
        try:
            mates = await self.stage_peers()
        except Exception as exc:  # the DHT lookup failed: nobody to tell this time
            log.warning("stage %d: could not list the stage-mates to show %s of %s (%s)", self.executor.stage,
                        what, accused[:12], exc)
            return []
        targets = [addr for pid, addr in sorted(mates.items()) if pid not in (accused, self.peer_id)]
        if not targets:
            log.warning("stage %d: no stage-mate listed to show %s of %s", self.executor.stage, what, accused[:12])
        return targets

    def _own(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run ``coro`` as a task this averager owns: cancelled and awaited by :meth:`close`; one that
        fails is logged with its traceback when it ends (never silently)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

    async def close(self) -> None:
        """Cancel and await the rounds this peer leads on behalf of others and its proofs; stop the
        client's codec threads (the session is the daemon's)."""
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        await wait_cancelled(tasks, f"an averaging task of stage {self.executor.stage}")
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
            "accusations": dict(self.accusations),
            "openings": dict(self.openings),
            "duplicate_microbatches": self.duplicate_microbatches,
            "silent_contributors": self.silent_contributors,
            "dissenting_mates": self.dissent.left_out,
            "dissenting": sorted(self.dissent.current),
            "excluded": self.suspicions.status(),
            "excluded_by_reports": sorted(self.exclude()),
            "control_requests": dict(self.control_requests),
            "codecs_sent": dict(self.codecs_sent),
            "links_mbit_s": {a: round(e.bytes_per_s * 8 / 1e6, 1) for a, e in self.client.links.snapshot().items()},
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

    async def _trusted_mates(self) -> dict[str, str]:
        """The stage-mates (not this peer) this peer averages with: listed, not excluded, proven."""
        mates = await self.stage_peers()
        self._own_addr = mates.pop(self.peer_id, "")
        excluded = self.excluded()
        mates = {pid: addr for pid, addr in mates.items() if pid not in excluded}
        self._mates = mates
        now = time.monotonic()
        if self.executor.grad_samples > 0:
            self._held_at = now
        if not mates and now - self._held_at < LISTING_KEEP_S:  # alone, and training: a lone step will come
            self._prefetch_listing()
        if self.prover is None:
            return mates
        prover = self.prover
        fresh = [pid for pid, addr in mates.items() if prover.table.due(pid, addr) and not prover.table.tried(pid)]
        task = self._prove(mates)
        if fresh and len(fresh) <= FIRST_PROOF_WAIT_MAX and task is not None:  # new: a moment to prove themselves
            await asyncio.wait({task}, timeout=FIRST_PROOF_WAIT_S)
        return {pid: mates[pid] for pid in prover.proven(mates)}

    async def _resync(self, step: int) -> None:
        """``on_behind(step)``: adopt a stage-mate's state at ``step``; when that left this peer behind,
        pause before the tick that will find it behind again (``RESYNC_PAUSE_MAX_S``)."""
        if self.on_behind is None:
            return
        await self.on_behind(step)
        if self.executor.step >= step:
            self.resyncs_failed = 0
            return
        self.resyncs_failed += 1
        pause = min(RESYNC_PAUSE_MAX_S, self.poll_s * 2 ** min(self.resyncs_failed - 1, 16))
        log.info("stage %d: still at step %d after a resync to %d (%d in a row); trying again in %.2f s",
                 self.executor.stage, self.executor.step, step, self.resyncs_failed, pause)
        await asyncio.sleep(pause)

    async def _newly_listed(self) -> bool:
        """Whether a fresh read of the stage's listing names a stage-mate (not excluded) that the
        last one did not. Asked before a round of this peer alone: stage-mates that began serving
        within the listing's cache age may hold samples of this step (trainers route to a peer as
        soon as its record is out), and a lone step would leave them behind together, where the
        rule of :meth:`_tick` keeps them (two of them outnumber the one ahead) for good."""
        def fresh() -> dict[str, str] | None:  # the last read's answer, if it ended within LISTING_FRESH_S or its time
            read = self._listing
            if read is None or time.monotonic() - read[1] > max(LISTING_FRESH_S, read[1] - read[0]):
                return None
            return read[2]

        reading = self._listing_read
        if fresh() is None and reading is not None and not reading.done():
            await asyncio.shield(reading)  # its answer, rather than a read of its own begun later
        answer = fresh()
        if answer is None:
            began = time.monotonic()
            answer = await self.stage_peers(fresh=True)
            self._listing = (began, time.monotonic(), answer)
        listed = dict(answer)
        listed.pop(self.peer_id, None)
        excluded = self.excluded()
        return any(pid not in self._mates and pid not in excluded for pid in listed)

    def _prefetch_listing(self) -> None:
        """Read the stage's listing afresh in a task this averager owns, unless a read is in flight or one
        began within ``LISTING_PERIOD_S``: :meth:`_newly_listed` takes a read that ended within
        ``LISTING_FRESH_S`` (or its own duration) before the step (or awaits the one in flight) instead of
        reading then (a DHT lookup: on a long link the largest part of a lone peer's step; the read also keeps
        the daemon's cached listing fresh, which the tick reads). A mate whose record appears after such a read began is
        missed, as one appearing during the read itself always was; it is heard from at the next step."""
        now = time.monotonic()
        if (self._listing_read is not None and not self._listing_read.done()) or (
                self._listing is not None and now - self._listing[0] < LISTING_PERIOD_S):
            return

        async def read() -> None:
            try:
                listed = await self.stage_peers(fresh=True)
                if self._listing is None or self._listing[0] < now:  # a read begun later may have ended first
                    self._listing = (now, time.monotonic(), listed)
            except Exception as exc:  # the DHT unreachable for a moment: the step reads it again itself
                log.info("stage %d: reading the stage's listing failed (%s)", self.executor.stage, exc)

        self._listing_read = self._own(read(), "swarmd-listing")

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

        task = self._proving = self._own(prove(), "swarmd-prove")
        return task

    async def _poll(self, mates: dict[str, str]) -> dict[str, ProgressReply]:
        """The progress of the stage-mates that answered and take part in this stage's rounds."""
        return self._taking_part(await self._answers(mates))

    async def _answers(self, mates: dict[str, str]) -> dict[str, ProgressReply]:
        """The stage-mates' answers to ``GET /v1/progress``, whatever they say (silent, refusing or
        unreadable ones left out)."""

        async def one(pid: str, addr: str) -> tuple[str, ProgressReply | None]:
            try:
                return pid, await self.client.progress(addr, timeout_s=POLL_TIMEOUT_S)
            except PeerError:
                return pid, None

        self.control_requests["progress"] += len(mates)
        answers = await asyncio.gather(*(one(pid, addr) for pid, addr in mates.items()))
        return {pid: body for pid, body in answers if body is not None}

    def _taking_part(self, answers: dict[str, ProgressReply]) -> dict[str, ProgressReply]:
        """The answers of the mates that take part in this stage's rounds: not a peer leaving the stage
        (away), nor one that serves another stage, or answers for another peer."""
        return {pid: body for pid, body in answers.items()
                if not body.away and body.stage == self.executor.stage and body.peer_id in (None, pid)}

    def _movers(self, answers: dict[str, ProgressReply]) -> set[str]:
        """Of these answers of stage-mates a round waited for in vain, those that say they left the stage
        (another stage, or away) and were not spared that way lately (``SPARE_MOVER_EVERY_S``): a move
        stops a peer's rounds mid-way, which is no silence to exclude it for (its exclusion would also
        leave it out of this daemon's view of the swarm: its trainers would not use it on its new stage)."""
        now = time.monotonic()
        movers = {pid for pid, body in answers.items() if body.peer_id in (None, pid)
                  and (body.away or body.stage != self.executor.stage)
                  and now - self._spared.get(pid, -SPARE_MOVER_EVERY_S) >= SPARE_MOVER_EVERY_S}
        for pid in movers:
            self._spared.pop(pid, None)
            self._spared[pid] = now
        while len(self._spared) > 4096:
            self._spared.pop(next(iter(self._spared)))
        return movers

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

    def accuse_silent(self, peer_ids: Iterable[str], step: int, what: str) -> None:
        """Exclude stage-mates that a round waited for in vain (issue #18: a proof shows a peer holds its
        identity, not that it will contribute), with the growing periods of the round checks; ``what``:
        what each one failed to do. The leader's expected contributors that never came and the
        all-reduce's members and mates that never sent their parts or reports (``patience``)."""
        excluded = self.suspicions.excluded()  # already (a peer convicted while the round was open): not "silent"
        for pid in sorted(set(peer_ids) - excluded - {self.peer_id}):
            period = self.suspicions.accuse(pid, f"silent: {what}")
            self.silent_contributors += 1
            self._warn(pid, "silent", "stage %d step %d: stage-mate %s %s; excluded from this stage's rounds for "
                       "%.0fs", self.executor.stage, step, pid[:12], what, period)

    def _warn(self, peer_id: str, reason: str, msg: str, *args: Any) -> None:
        """A warning at most once per peer and reason every LOG_EVERY_S."""
        now = time.monotonic()
        if now - self._logged.get((peer_id, reason), -1e9) < LOG_EVERY_S:
            return
        self._logged[(peer_id, reason)] = now
        if len(self._logged) > 4096:
            self._logged.pop(next(iter(self._logged)))
        log.warning(msg, *args)


