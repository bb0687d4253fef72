"""The trainer: a lightweight client that drives microbatches through the swarm's stages.

SWARM's trainers (paper, section 3.2) hold no parameters. A trainer registers with any daemon's
control plane, learns the stage map from that daemon's ``GET /swarm`` (it runs no DHT node),
and sends each microbatch through one peer per stage, picked by stochastic wiring
(``swarmd.pipeline.routing``): forward through stages ``0..S-2``, a fused forward + backward on
the last stage (loss and input gradients in one round trip), then backward through
``S-2..0``. Many microbatches are in flight at once (a bounded window), so every stage is busy.

Faults: a peer that fails or times out is banned with exponential backoff and the call is
retried on another peer of the same stage; a stage with no live peer makes the trainer wait
(and say so) until one appears, up to a timeout. Each call's timeout follows what the stage's
peers actually take (``StageRouter.timeout_for``: a multiple of the typical latency, floored,
capped by ``request_timeout_s``) and a backward's ``deadline_ms`` follows that timeout; a peer
never seen answering is on probation (a bounded share of the window) and a peer that keeps
failing is banned for minutes, so a listed peer that accepts connections and never answers (a
tarpit, issue #18) costs about one typical request per probation attempt, not the full timeout.
A backward refused as ``StaleStep`` (the stage stepped since this microbatch's forward) redoes
the whole microbatch, so its gradient is
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
(the equivalence test); the batch is tapered at both ends (the first and last microbatches
halved, or a ramp in quarters once the stages' measured latencies say a small microbatch is worth
its request: ``swarmd.pipeline.partition.tapered_sizes``) and each microbatch starts once the one
before has its first forward back, which shortens the pipeline's fill and drain at every step.

Spot checks (issue #17, ``swarmd.train.verify``): a random ``verify_fraction`` of forward and
backward calls is sent again, in the background, to a second peer of the stage (a forward with a
fresh microbatch id, so it looks like any other; a backward flagged ``verify``, computed but
never accumulated) and the answers compared (a peer's first answers always, and the trainer waits
for that verdict); on a mismatch a third peer arbitrates, the peer
that disagrees with the other two is banned for an hour and a signed report
(``swarmd.pipeline.reports``) goes to every listed peer. Peers the swarm excluded after two
independent reports (a majority of progress answers lists them), peers most of their own stage
excludes (its round checks caught them) and forks (another params digest than most of the stage
at that step) are not routed to; a sync trainer's step wait counts no samples nor step of a peer
any stage-mate excludes (``verify.stage_distrust``: the stage is topped up instead). The cost is
in the summary (``verify``: checks, mismatches, arbitrations, extra samples and bytes, the
traffic fraction).

Each attempt of a microbatch carries a random 64-bit id (``meta.mb``); its backward on a stage
goes to the peer that ran its forward while that peer is usable, where the activations are
still cached (``swarmd.pipeline.executor``), so the forward is not recomputed. Any other peer
serves it statelessly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

import aiohttp
import torch

from swarmd.dht.identity import Identity
from swarmd.errors import ConfigError, PeerError
from swarmd.finite import strict_json
from swarmd.net.client import DataPlaneClient, client_session
from swarmd.net.messages import (
    BackwardReply,
    ClaimRequest,
    ForwardReply,
    ReportRequest,
    ReserveReply,
    ReserveRequest,
)
from swarmd.pipeline import failures
from swarmd.pipeline.failures import Action, classify
from swarmd.pipeline.partition import taper_depth, tapered_sizes
from swarmd.pipeline.reports import MisbehaviourReport, digest_tensor_bytes
from swarmd.pipeline.routing import StageRouter
from swarmd.pipeline.spec import ModelSpec, TrainingSpec
from swarmd.pipeline.step_protocol import BackwardAttempts
from swarmd.swarm_key import SwarmKey
from swarmd.train.data import BatchSampler, load_corpus, val_batches
from swarmd.train.events import CallDone, StepDone, StepWait, TrainerListener
from swarmd.train.swarm_client import PeerProgress, Registration, SwarmClient, TrainerError
from swarmd.train.swarm_view import peer_views
from swarmd.train.verify import (
    LIAR_BAN_S,
    Answer,
    SpotChecker,
    Verdict,
    VerifyStats,
    agree,
    arbitrate,
    excluded_by_stage,
    forks,
    stage_distrust,
    tolerance,
)

__all__ = ["TrainSummary", "Trainer", "TrainerConfig", "TrainerError", "split_batch"]

log = logging.getLogger(__name__)

R = TypeVar("R")

PROGRESS_WAIT_S = 0.5  # how long one /v1/progress long-poll may wait for a step
#: A backward's peer adds its gradient only within this share of the call's timeout, and at least
#: BACKWARD_SLACK_S before it (the rest covers the way there and back, on a loaded machine too):
#: past it the trainer may have given up and retried elsewhere, and the gradient must not count twice.
DEADLINE_SHARE = 0.75
BACKWARD_SLACK_S = 5.0
#: How long a leased microbatch waits for a stage still at the previous step (finishing its
#: round) before it is sent anyway (a stage short of samples would never step without it).
STAGE_CATCH_UP_S = 2.0
RESERVE_TIMEOUT_S = 10.0  # a lease request (no compute) to a peer that has answered this trainer
CLAIM_TIMEOUT_S = 3.0  # asking a peer whether it counted a backward whose answer was lost (no compute)
#: A lease-book peer seen behind the first stage's front step is waited for this long before the
#: trainer turns to the next peer's book: at every step some stage-mate applies its update a moment
#: after the others, and a trainer that switched books then would lease samples the stage's book
#: never learns of (a second book: overfilled steps, and samples no write-off can account for).
BOOK_LAG_GRACE_S = 2.0
#: The corpus order (and so the train/held-out split) of every asynchronous trainer; ``--seed``
#: orders its samples. A ``--sync`` trainer trains alone and splits by its own seed.
SPLIT_SEED = 0
PROBATION_RESERVE_TIMEOUT_S = 5.0  # ... and to one that has not yet (the trainer's first, or a newcomer)
REPORT_TIMEOUT_S = 5.0  # a misbehaviour report to one peer
FIRST_CHECKS = 1  # a peer's answers of each kind checked always until this many were confirmed
OPINION_ATTEMPTS = 4  # tries for a spot check's second (or third) opinion
RECHECKS = 2  # a first check that met no opinion at its step asks the same peer again this often
UNSETTLED_LIMIT = 3  # mismatches of a stage's only two peers redone before their answers go on (see _check)
#: A sync trainer tops up a stage that holds the target batch yet has not stepped for this long (an
#: honest stage starts its round within a poll period of holding it; see ``_wait_all_stepped``).
STUCK_GRACE_S = 10.0
#: ... and stops waiting for a peer that most of its stage left behind this long (a resync takes
#: seconds; a peer that claims an old step forever must not stall the trainer until it gives up).
LAG_GRACE_S = 30.0
#: The shortest per-call timeout (below it, scheduling noise on a loaded machine would ban honest peers).
TIMEOUT_FLOOR_S = 2.0
#: ... of a backward: its deadline (above) must leave the peer time to compute.
BACKWARD_TIMEOUT_FLOOR_S = 2 * BACKWARD_SLACK_S
#: A call to a peer on probation while the stage has no latency estimate yet waits at most this long.
PROBATION_TIMEOUT_S = 15.0


def split_batch(batch: int, microbatch: int, *, taper: bool = False) -> list[int]:
    """Microbatch sizes for one global batch: ``microbatch`` each, the remainder last; with
    ``taper``, the first and the last halved (``32, 8`` gives ``4 8 8 8 4``; ``36, 8`` gives
    ``4 8 8 8 4 4``). :func:`swarmd.pipeline.partition.tapered_sizes` at depth 0 or 1, which
    says why; a sync trainer may taper finer (depth 2) once it has measured its stages."""
    return tapered_sizes(batch, microbatch, 1 if taper else 0)


def _front_step(progress: list[list[PeerProgress]]) -> int:
    """The step the whole swarm has reached: the slowest stage's most advanced peer (0 if a
    stage has no peer that answered), not counting a refused leader that stepped alone on its own
    lie (most of its stage excludes it, or it is a fork: one accuser cannot hold the front back)."""
    fronts = []
    for peers in progress:
        ignored = excluded_by_stage(peers) | forks(peers)
        fronts.append(max((p.step for p in peers if p.step is not None and p.peer_id not in ignored), default=None))
    known = [f for f in fronts if f is not None]
    return min(known) if len(known) == len(fronts) and known else 0


#: A spot check's verdict: the answers disagreed and no third peer settled who lied.
_SUSPECT = Answer("", -1, None)
#: ... and (inside a check only): no opinion at the answer's step, so it is neither confirmed nor refuted.
_UNCONFIRMED = Answer("", -2, None)
#: ... or: the only opinions at its step were computed in another precision (never compared).
_INCOMPARABLE = Answer("", -3, None)


def backward_deadline_ms(timeout_s: float) -> int:
    """The ``deadline_ms`` of a backward the trainer waits ``timeout_s`` for: ``DEADLINE_SHARE`` of
    it, and at least ``BACKWARD_SLACK_S`` short of it (never negative)."""
    return int(1000 * max(0.0, min(timeout_s * DEADLINE_SHARE, timeout_s - BACKWARD_SLACK_S)))


def excluded_by_majority(answers: Sequence[PeerProgress]) -> frozenset[str]:
    """The peers listed as excluded by more than half of ``answers`` (and by at least two).

    Each daemon keeps its own ledger of signed misbehaviour reports
    (``swarmd.pipeline.reports``), and a lying daemon could list honest peers: believing any one
    answer would let it cut them off. A majority of the peers that answered must agree.
    """
    counts: dict[str, int] = {}
    for answer in answers:
        for peer_id in set(answer.excluded):
            counts[peer_id] = counts.get(peer_id, 0) + 1
    need = max(2, len(answers) // 2 + 1)
    return frozenset(p for p, n in counts.items() if n >= need)


def _evidence(request: tuple[torch.Tensor, ...], answers: list[Answer]) -> tuple[str, dict[str, str]]:
    """The digests a report carries: of the request's tensors, and of each peer's answer."""

    def raw(t: torch.Tensor) -> bytes:
        return t.detach().contiguous().cpu().numpy().tobytes()

    request_digest = digest_tensor_bytes(*(raw(t) for t in request))
    digests = {
        a.peer_id: digest_tensor_bytes(raw(a.tensor) if a.tensor is not None else b"", repr(a.loss).encode())
        for a in answers
    }
    return request_digest, digests


class _Redo(Exception):
    """A backward was refused as stale: redo the whole microbatch at the stages' new step. Or
    (``suspect``) a peer's first answer disagreed with another peer's and no third one settled who
    lied: the answer is not used, the microbatch is redone."""

    def __init__(self, *, suspect: bool = False) -> None:
        super().__init__()
        self.suspect = suspect


@dataclass(frozen=True)
class TrainerConfig:
    api: str  # control-plane URL of any daemon of the swarm, e.g. http://127.0.0.1:8080
    steps: int = 100  # optimizer steps the swarm should take from now
    data: str | None = None  # text file or folder; None: the Python standard library's sources
    # --tokenizer FILE (a Hugging Face tokenizers JSON); None: byte-level, or a prepared --data DIR's own
    tokenizer: str | None = None
    text_field: str = "text"  # the field of a .jsonl record that holds its text (--text-field)
    batch_size: int | None = None  # samples per step (sync mode); None: the swarm's target_batch_size
    microbatch_size: int = 8
    codec: str = "8bit"  # activations and their gradients between stages
    seed: int = 0
    window: int = 8  # microbatches in flight at once
    taper: bool = True  # sync mode: taper the step's ends (swarmd.pipeline.partition.tapered_sizes)
    max_taper_depth: int = 2  # ... at most this finely (1: halves only; 2: quarters, when measured to pay)
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
    data_shards: int = 16  # the training split is cut in this many shards; an async trainer draws from one at a time
    shard: int | None = None  # which one; None: the rank the daemon handed out at registration
    verify_fraction: float = 0.02  # spot checks: this share of calls is sent to a second peer too (swarmd.train.verify)

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
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ConfigError("--verify-fraction must lie in [0, 1]")
        if self.max_taper_depth not in (0, 1, 2):
            raise ConfigError("max_taper_depth must be 0, 1 or 2")


@dataclass
class TrainSummary:
    steps: int = 0
    first_loss: float | None = None
    final_loss: float | None = None
    val_loss: float | None = None
    samples_per_s: float = 0.0
    retries: int = 0
    bans: int = 0
    timeouts: int = 0  # calls this trainer gave up waiting for (its per-peer timeout)
    probation_calls: int = 0  # calls sent to peers that had never answered (on probation)
    stale_redos: int = 0
    topup_microbatches: int = 0
    microbatches_issued: int = 0
    microbatches_completed: int = 0
    samples: int = 0
    duplicates: int = 0  # backwards a stage had counted already (a retry after a lost answer): not added twice
    claims: int = 0  # backwards whose answer was lost: the peer was asked whether it had counted them
    claims_counted: int = 0  # ... and it had: the retry only computed (exactly once, step_protocol)
    claims_unanswered: int = 0  # ... the peer could not be asked: the retry counted (perhaps twice; detected)
    leases: int = 0  # sample reservations granted to this trainer
    full_waits: int = 0  # times the step was fully reserved and the trainer waited for it
    shard: int | None = None  # the shard of the training split it started on (None: the whole split at once)
    elapsed_s: float = 0.0
    step_losses: list[float] = field(default_factory=list)
    step_samples: list[int] = field(default_factory=list)  # its share of each step: samples counted at it
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    verify: dict[str, Any] = field(default_factory=dict)  # spot checks: swarmd.train.verify.VerifyStats

    def to_json(self) -> dict[str, Any]:
        """The summary as strict JSON values: a loss that is undefined (NaN: a step none of this
        trainer's samples were computed at) or infinite is None, so ``json.dumps(...,
        allow_nan=False)`` accepts it and other languages' parsers do too."""
        return strict_json(asdict(self))


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
        self._unreachable: dict[int, list[str]] = {}  # stage -> listed data addrs nobody could dial
        self.trainer_id: str | None = None
        self._swarm: SwarmClient | None = None
        self._client: DataPlaneClient | None = None
        self._step_losses: dict[int, list[tuple[float, int]]] = {}
        self._step_samples: dict[int, int] = {}  # first-stage step -> this trainer's samples counted at it
        self._rank: int | None = None
        self._book_behind_since: dict[str, float] = {}  # stage-0 peers seen behind the front step, since when
        self._reserving = config.reserve  # False once the first stage turned out to have no lease book (an older peer)
        self.checks = VerifyStats()
        self._checker = SpotChecker(config.verify_fraction, random.Random(secrets.randbits(64)))
        self._check_tasks: set[asyncio.Task[Answer | None]] = set()  # spot checks running (owned)
        self._identity: Identity | None = None  # ephemeral: signs this trainer's reports
        self._agreed: dict[tuple[str, str], int] = {}  # (peer, kind) -> its answers a check confirmed
        self._disputed: set[str] = set()  # peers in a mismatch no conviction cleared (see _check)
        # (peer, kind): mismatches with the only other peer of its stage, which no third peer could settle
        self._unsettled: dict[tuple[str, str], int] = {}
        self._gave_up: set[tuple[str, str]] = set()  # ... UNSETTLED_LIMIT of them: not first-checked any more

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
                # asynchronous trainers share one train/held-out split whatever their --seed (it orders the
                # corpus's files): their rank shards are then disjoint and their validation the same windows
                load_corpus, cfg.data, max_bytes=cfg.max_corpus_bytes, seed=cfg.seed if cfg.sync else SPLIT_SEED,
                seq_len=spec.seq_len,
                tokenizer=cfg.tokenizer, text_field=cfg.text_field, spec=spec,
            )
            index = cfg.shard if cfg.shard is not None else self._rank
            first = None
            if index is not None and cfg.data_shards > 1 and not cfg.sync:  # a sync trainer trains alone: all of it
                first = (index % cfg.data_shards, cfg.data_shards)  # starts there, then moves on shard by shard
            sampler = BatchSampler(corpus.train, spec.seq_len, seed=cfg.seed, shards=first)
            self.summary.shard = sampler.current_shard
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
                await self._finish_checks()
            finally:
                heartbeat.cancel()
                await self._swarm.aclose()  # newcomers' progress polls still out (issue #18)
                for task in self._check_tasks:
                    task.cancel()
                await asyncio.gather(heartbeat, *self._check_tasks, return_exceptions=True)
                self.summary.verify = self.checks.to_json()
                await self._swarm.flush(self.summary.samples)  # the last steps' losses and the final count
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
            "checks": self.checks.checks,
            "liars": self.checks.liars,
        }

    # ---- registration and the stage map -----------------------------------------------------

    def _registered(self, registration: Registration, *, first: bool = False) -> tuple[ModelSpec, TrainingSpec]:
        """Adopt a registration: the first sets up one router per stage; a registration again
        (the daemon forgot us) only takes the new id, keeping what the routers measured."""
        self.trainer_id = registration.trainer_id
        if first:
            self._rank = registration.rank
            self.spec, self.training = registration.spec, registration.training
            self.routers = [self._router(stage) for stage in range(registration.spec.n_stages)]
        return registration.spec, registration.training

    def _router(self, stage: int) -> StageRouter:
        """A stage's router: timeouts capped by ``request_timeout_s``, probation peers holding at
        most a quarter of the window (at least one call)."""
        ceiling = self.config.request_timeout_s
        return StageRouter(stage, timeout_ceiling_s=ceiling, timeout_floor_s=min(TIMEOUT_FLOOR_S, ceiling),
                           probation_timeout_s=min(PROBATION_TIMEOUT_S, ceiling),
                           probation_slots=max(1, self.config.window // 4), require_alive=True)

    def _floor(self, kind: str) -> float:
        """The shortest timeout of a call of ``kind`` (a backward's leaves room for its deadline)."""
        return min(BACKWARD_TIMEOUT_FLOOR_S if kind == "backward" else TIMEOUT_FLOOR_S, self.config.request_timeout_s)

    def _registered_again(self, registration: Registration) -> None:
        self._registered(registration)

    async def _refresh_view(self, force: bool = False) -> None:
        """Re-read the stage map from the daemon's /swarm (at most every ``refresh_s``)."""
        body = await self._require_swarm().stage_map(force=force)
        if body is None:
            return
        for stage, peers in peer_views(body).items():
            # a peer the swarm could not dial (``reachable: no``, swarmd.net.reachability) would only cost timeouts
            self._unreachable[stage] = [p.addr for p in peers if p.reachable == "no"]
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

    def _book_peer(self, behind: Collection[str] = (), answered: Collection[str] = ()) -> tuple[str, str] | None:
        """The first stage's peer whose lease book this trainer uses: the smallest usable peer
        id, so that trainers with the same stage map use the same book; among peers that have
        answered this trainer when there are any (a fake record with a small id is not asked
        before the peers that proved themselves), and not one ``behind`` the stage's front step
        (it would refuse every reservation with PeerBehind until it catches up). A peer banned
        for a failed compute call still keeps its book while it ``answered`` the last progress
        poll: a trainer that turned to another book would lease samples the stage's book never
        learns of."""
        usable = [p for p in self.routers[0].snapshot()
                  if (not p.banned or p.peer_id in answered) and not p.excluded and p.peer_id not in behind
                  ] if self.routers else []
        # then among peers that answered a progress poll (a tarpit never does: issue #18)
        for peer in [p for p in usable if p.proven] or [p for p in usable if p.alive] or usable:
            return peer.peer_id, peer.addr
        return None

    async def _reserve(
        self, progress: list[list[PeerProgress]], room: int, done: Sequence[int], renew: Sequence[int]
    ) -> ReserveReply | None:
        """Up to ``room`` leases for the first stage's current step, reporting ``done`` leases and
        renewing ``renew``; None when this swarm paces without a lease book (see ``_run_async``)
        or the book's peer failed (it is banned: the next call asks the next peer)."""
        if not self._paced_by_book():
            return None
        # an excluded peer's samples are never averaged in (swarmd.pipeline.averaging): not the stage's
        excluded = {p.peer_id for p in self.routers[0].snapshot() if p.excluded} if self.routers else set()
        seen = [p for p in progress[0] if p.step is not None and p.peer_id not in excluded] if progress else []
        front = max((p.step for p in seen if p.step is not None), default=None)
        now = time.monotonic()
        lagging = {p.peer_id for p in seen if front is not None and p.step != front}
        since = self._book_behind_since
        for pid in [pid for pid in since if pid not in lagging]:
            del since[pid]
        for pid in lagging:
            since.setdefault(pid, now)
        book = self._book_peer(behind={pid for pid in lagging if now - since[pid] > BOOK_LAG_GRACE_S},
                               answered={p.peer_id for p in seen})
        if book is None or self.trainer_id is None or book[0] in lagging:
            return None  # (the book's peer is finishing its step: ask again shortly, not another book)
        peer_id, addr = book
        held = sum(p.samples for p in seen if p.step == front)
        complete = seen and len(seen) == len(progress[0])  # every stage-0 peer answered: the sum is the stage's
        request = ReserveRequest(stage=0, trainer=self.trainer_id, step=front or 0, size=self.config.microbatch_size,
                                 count=max(0, room), lease_s=self.config.lease_s, done=tuple(done),
                                 renew=tuple(renew), held=held if complete and front is not None else None)
        proven = self.routers[0].stats(peer_id).proven if peer_id in self.routers[0] else False
        try:
            return await self._require_client().reserve(
                addr, request, timeout_s=min(RESERVE_TIMEOUT_S if proven else PROBATION_RESERVE_TIMEOUT_S,
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
            depth = self._taper_depth()
            sizes = tapered_sizes(batch, cfg.microbatch_size, depth)
            microbatches = [sampler.sample(size) for size in sizes]  # drawn in order: reproducible
            semaphore = asyncio.Semaphore(cfg.window)
            # the first microbatch leads: the others start once its first forward is back, so stage 0
            # computes it first (requests sent together reach the worker in any order) and the next
            # stage starts after the step's smallest forward. Under the finer taper each one waits for
            # the one before, so the ramp reaches stage 0 in order (its calls are long enough that the
            # round trip between them costs little; a model whose calls are mostly overhead is not chained)
            led = [asyncio.Event() for _ in microbatches]

            async def one(index: int, x: torch.Tensor, y: torch.Tensor, led: list[asyncio.Event] = led,
                          semaphore: asyncio.Semaphore = semaphore,
                          chained: bool = depth >= 2) -> tuple[float, int, int]:
                if index:
                    await led[index - 1 if chained else 0].wait()
                async with semaphore:
                    return await self._microbatch(x, y, on_forward=led[index].set)

            async def refresh(led: list[asyncio.Event] = led) -> None:
                # the stage map is re-read (when due) mid-step, while the pipeline is full: not at the step's
                # ends, where the first stage's daemon (often the control plane's too) is the critical path
                await led[len(led) // 2].wait()
                await self._refresh_view()

            refreshed = asyncio.create_task(refresh(), name="swarmd-trainer-refresh")
            try:
                await asyncio.gather(*(one(k, x, y) for k, (x, y) in enumerate(microbatches)))
                await refreshed
            finally:
                if not refreshed.done():  # a microbatch failed: the step ends here
                    refreshed.cancel()
                    await asyncio.gather(refreshed, return_exceptions=True)
            await self._wait_all_stepped(step + 1, sampler)
            await self._finish_step(step, i + 1, validation)

    def _taper_depth(self) -> int:
        """How finely a sync step's batch is tapered (``swarmd.pipeline.partition.taper_depth``):
        from the slowest stage's typical seconds per sample (a forward and a backward on stages
        before the last, the fused call on the last) as this trainer measured them; 0 without a
        taper or with one stage (no pipeline to fill)."""
        if not self.config.taper or len(self.routers) < 2:
            return 0
        per_sample = [sum(v for v in (router.typical_latency(kind) for kind in ("forward", "backward"))
                          if v is not None) for router in self.routers]
        slowest = max(per_sample)
        return min(self.config.max_taper_depth, taper_depth(slowest if slowest > 0 else None,
                                                            self.config.microbatch_size))

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
            c = self.checks  # the spot checks' counts so far: /trainers and swarmd_trainer_spot_checks_total
            self._swarm.observe_step(step, loss if total else None, s.samples, s.val_loss if validated else None,
                                     retries=s.retries, bans=s.bans,
                                     spot_checks={"checks": c.checks, "mismatches": c.mismatches,
                                                  "arbitrations": c.arbitrations, "liars": c.liars,
                                                  "reports_sent": c.reports_sent})
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

        Peers that never answered this trainer (on probation) are polled with a short timeout,
        banned when they do not answer, and not polled while banned; one never heard from does not
        hold the poll up (``SwarmClient.progress``: its poll may end in the background, told to
        :meth:`_heard`, and it is not in this poll's answers until it answered); excluded peers are not
        polled. A peer that did answer before is polled even while banned (a sync trainer must
        not run ahead of an honest peer that missed one call). The answers also carry each
        peer's excluded set (:func:`excluded_by_majority` decides which to believe).
        """
        await self._refresh_view()
        stages: list[list[tuple[str, str]]] = []
        probation: set[str] = set()
        for router in self.routers:
            peers = [p for p in router.snapshot() if not p.excluded and (p.proven or not p.banned)]
            stages.append([(p.peer_id, p.addr) for p in peers])
            probation |= {p.peer_id for p in peers if not p.proven}
        polled = await self._require_swarm().progress(stages, wait_step=wait_step, wait_s=PROGRESS_WAIT_S,
                                                      probation=probation, on_late=self._heard)
        for stage, answers in enumerate(polled):
            for answer in answers:
                self._heard(stage, answer)
        self._adopt_exclusions(polled)
        return polled

    def _heard(self, stage: int, answer: PeerProgress) -> None:
        """A peer's progress answer, in a poll or after it (a newcomer polled in the background):
        an unproven peer that answered may now be called (``StageRouter.require_alive``: a tarpit
        never is), one on probation that did not answer is banned like a failed call."""
        if not 0 <= stage < len(self.routers) or answer.peer_id not in self.routers[stage]:
            return
        router = self.routers[stage]
        if answer.step is not None:
            router.report_alive(answer.peer_id)
        elif answer.error is not None and answer.error.status in (0, 200) and not router.stats(answer.peer_id).proven:
            router.report_failure(answer.peer_id, timeout=failures.timed_out(answer.error))

    def _adopt_exclusions(self, polled: list[list[PeerProgress]]) -> None:
        """Stop routing to the peers a majority of the answering peers excluded (issue #17), to the
        peers most of their own stage excludes (caught by its round checks), and to forks (a peer
        holding another params digest than most of its stage at its step: ``verify.forks``)."""
        swarm_wide = excluded_by_majority([a for answers in polled for a in answers if a.step is not None])
        for router, answers in zip(self.routers, polled, strict=True):
            by_stage, forked = excluded_by_stage(answers), forks(answers)
            excluded = swarm_wide | by_stage | forked
            if excluded != router.excluded:
                newly = {p for p in excluded - router.excluded if p in router}  # its own stage's, for the log
                if newly:
                    log.warning("stage %d: not routing to %s (%s)", router.stage,
                                ", ".join(sorted(p[:12] for p in newly)),
                                "; ".join(why for why, named in (
                                    ("excluded by the swarm: two independent reports", swarm_wide & newly),
                                    ("excluded by most of its stage: round checks or reports", by_stage & newly),
                                    ("another params digest than most of its stage: a fork", forked & newly))
                                    if named))
                router.set_excluded(excluded)

    async def _wait_all_stepped(self, step: int, sampler: BatchSampler) -> None:
        """Poll every serving peer's /v1/progress until all are at ``step`` or later.

        A stage whose peers hold fewer than ``target_batch_size`` samples for the step and are
        not averaging lost gradients with a dead peer: after a short grace period it is topped
        up with fresh microbatches, so the step still aggregates a full batch.

        Liars (issue #17): a peer a stage-mate excludes, or a fork (``verify.stage_distrust``),
        counts neither for the samples its stage holds nor as lagging: a poisoned contributor's
        samples are refused by the round, and a refused leader stepped alone on its own lie, so
        the honest peers are topped up as for a dead peer. A stage that holds the target yet does
        not step for :data:`STUCK_GRACE_S` (a peer that reports samples it never contributes) gets
        one more microbatch per grace period.
        """
        training = self._require_training()
        began = time.perf_counter()
        deadline = time.monotonic() + self.config.stage_wait_timeout_s
        short_since: float | None = None
        stuck_since: float | None = None
        left_behind: dict[str, float] = {}  # peer -> since when most of its stage is past it
        while True:
            lagging = []
            missing = 0
            stuck = refused = False
            polled_at = time.monotonic()
            for stage, polled in enumerate(await self._poll_progress(wait_step=step)):
                distrusted = stage_distrust(polled)
                counted = [p for p in polled if p.peer_id not in distrusted]
                # a silent peer counts as lagging until the DHT forgets it (a dead one) or it answers; one
                # that most of its stage left behind for LAG_GRACE_S is not waited for (it resyncs, or lies)
                behind = [p for p in counted if p.step is None or p.step < step]
                if len(counted) - len(behind) > len(counted) // 2:
                    left_behind.update({p.peer_id: time.monotonic() for p in behind if p.peer_id not in left_behind})
                    behind = [p for p in behind if time.monotonic() - left_behind[p.peer_id] <= LAG_GRACE_S]
                lagging += [(stage, p.peer_id, p.step) for p in behind]
                seen = [p for p in counted if p.step is not None]
                front = max((p.step for p in seen if p.step is not None), default=step)
                if front < step:  # the whole stage has yet to step: does it hold a full batch?
                    at_front = [p for p in seen if p.step == front]
                    if not any(p.averaging for p in at_front):
                        held = sum(p.samples for p in at_front)
                        missing = max(missing, training.target_batch_size - held)
                        stuck = stuck or held >= training.target_batch_size
                        # short because its stage-mates refuse a liar's work: nothing left to wait for
                        refused = refused or (bool(distrusted) and held < training.target_batch_size)
            if not lagging:
                late = sorted(p[:12] for p, since in left_behind.items() if time.monotonic() - since > LAG_GRACE_S)
                if late:
                    log.warning("step %d: not waiting any longer for %s, left behind by most of its stage for "
                                "%.0fs", step, ", ".join(late), LAG_GRACE_S)
                self._emit(StepWait(step=step, started=began, ended=time.perf_counter()))
                return
            now = time.monotonic()
            if now > deadline:
                raise TrainerError(f"stages did not reach step {step} in time: {lagging}")
            if missing > 0:
                short_since = short_since or now
                if refused or now - short_since > 1.0:
                    count = -(-missing // self.config.microbatch_size)
                    log.warning("a stage is %d samples short of step %d (a peer died holding gradients, or its "
                                "stage-mates refused its work); topping up with %d microbatches", missing, step, count)
                    self.summary.topup_microbatches += count
                    await asyncio.gather(*(self._microbatch(*sampler.sample(self.config.microbatch_size))
                                           for _ in range(count)))
                    short_since = None
            else:
                short_since = None
            stuck_since = (stuck_since or now) if stuck and not missing > 0 else None
            if stuck_since is not None and now - stuck_since > STUCK_GRACE_S:
                log.warning("a stage holds the samples of step %d but has not stepped for %.0fs (a peer holds "
                            "samples it does not contribute?); topping up with one microbatch", step, STUCK_GRACE_S)
                self.summary.topup_microbatches += 1
                await self._microbatch(*sampler.sample(self.config.microbatch_size))
                stuck_since = None
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
            try:
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
                    forward = await self._maybe_check_forward(stage, acts[-1], forward, peer)
                    acts.append(forward.outputs)
                    steps.append(forward.step)
                    served.append(peer)
                backward, last_peer = await self._backward(last, acts[-1], targets=y, mb=mb)
                backward = await self._maybe_check_backward(last, acts[-1], None, y, None, mb, backward, last_peer)
                if backward.loss is None:
                    raise TrainerError(f"stage {last} answered a backward with targets without its loss")
                loss, last_step = backward.loss, backward.step
                grad = backward.grad_inputs
                duplicates = int(backward.duplicate)
                for stage in range(last - 1, -1, -1):
                    backward, peer = await self._backward(stage, acts[stage], grad_outputs=grad, step=steps[stage],
                                                          mb=mb, prefer=served[stage])
                    backward = await self._maybe_check_backward(stage, acts[stage], grad, None, steps[stage], mb,
                                                                backward, peer)
                    grad = backward.grad_inputs
                    duplicates += int(backward.duplicate)
            except _Redo as redo:
                if redo.suspect:  # a first spot check found the answer wrong and could not say whose
                    self.checks.redone += 1
                else:
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
            lambda addr, timeout: client.forward(addr, stage, inputs, targets, codec=codec, model=spec.digest, mb=mb,
                                                 timeout_s=timeout),
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
        # Exactly once (swarmd.pipeline.step_protocol): the peer adds the gradient only within its
        # deadline (past it, this trainer gave up and retries elsewhere); an attempt whose answer was
        # lost is settled by asking its peer before the next attempt, which only computes if it counted.
        attempts = BackwardAttempts(mb)

        async def send(addr: str, timeout: float) -> BackwardReply:
            await self._settle_lost(stage, attempts)
            attempt = attempts.next_attempt()
            try:
                return await client.backward(addr, stage, inputs, grad_outputs, targets, codec=codec,
                                             model=spec.digest, step=step, mb=mb, attempt=attempt,
                                             verify=attempts.compute_only,
                                             deadline_ms=backward_deadline_ms(timeout), timeout_s=timeout)
            except PeerError as exc:
                attempts.failed(addr, exc)
                raise

        return await self._call(stage, "backward", inputs.shape[0], send, prefer=prefer)

    async def _settle_lost(self, stage: int, attempts: BackwardAttempts) -> None:
        """Ask each peer whose attempt at this backward failed without an answer whether it counted
        the microbatch (``POST /v1/claim``): if one did, the next attempts only compute; if not, it
        has fenced the lost attempt off. A peer that cannot be asked is noted, and the retry counts."""
        mb = attempts.mb
        if mb is None:
            return
        client, s = self._require_client(), self.summary
        for addr, fence in attempts.to_settle():
            s.claims += 1
            try:
                reply = await client.claim(addr, ClaimRequest(stage=stage, mb=mb, attempt=fence),
                                           timeout_s=CLAIM_TIMEOUT_S)
            except PeerError as exc:
                s.claims_unanswered += 1
                attempts.settled(addr, None)
                log.warning("stage %d: a backward's answer from %s was lost and that peer cannot say whether it "
                            "counted it (%s); retrying it as a new count (a repeat is detected at averaging)",
                            stage, addr, exc)
                continue
            s.claims_counted += int(reply.counted)
            attempts.settled(addr, reply.counted)

    async def _call(
        self,
        stage: int,
        kind: Literal["forward", "backward"],
        samples: int,
        send: Callable[[str, float], Awaitable[R]],
        *,
        prefer: str | None = None,
    ) -> tuple[R, str]:
        """One request to some peer of ``stage``: route, act on refusals (``swarmd.pipeline
        .failures``), wait for peers; the reply and the id of the peer that answered.

        ``send(addr, timeout_s)`` makes the call within the router's timeout for that peer.
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
            if choice is None and router.waiting_on_caps(exclude=tried):
                await asyncio.sleep(0.01)  # peers on probation are busy: a call ending frees a slot
                continue
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
                        + unreachable_hint(self._last_failures.get(stage, {}), self._unreachable.get(stage, []))
                    )
                tried.clear()
                unban = router.next_unban_in()
                await asyncio.sleep(min(unban if unban is not None else 0.5, 0.5))
                await self._refresh_view()
                continue
            peer_id, addr = choice
            on_probation = not router.stats(peer_id).proven
            timeout = router.timeout_for(peer_id, samples, kind, floor_s=self._floor(kind))
            router.begin(peer_id)
            attempts += 1
            self.summary.probation_calls += int(on_probation)
            started = time.monotonic()
            try:
                if on_probation and kind == "forward":  # no side effect: may be cut short (issue #18)
                    reply = await self._watched(router, peer_id, samples, kind, send(addr, timeout), started)
                else:
                    reply = await send(addr, timeout)
            except PeerError as exc:
                action = classify(exc)
                if action is Action.BAN:
                    timed_out = failures.timed_out(exc)
                    self._last_failures.setdefault(stage, {})[addr] = exc
                    self.summary.retries += 1
                    self.summary.bans += 1
                    self.summary.timeouts += int(timed_out)
                    ban = router.report_failure(peer_id, timeout=timed_out)
                    log.warning("stage %d peer %s failed (%s%s); banned for %.1fs, retrying elsewhere",
                                stage, peer_id[:12], exc, f", no answer within {timeout:.1f}s" if timed_out else "",
                                ban)
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
            router.report_success(peer_id, samples, time.monotonic() - started, kind)
            self._emit(CallDone(stage=stage, kind=kind, samples=samples, peer_id=peer_id, attempts=attempts,
                                started=began, ended=time.perf_counter()))
            return reply, peer_id

    async def _watched(self, router: StageRouter, peer_id: str, samples: int, kind: str, call: Awaitable[R],
                       started: float) -> R:
        """A forward to a peer on probation, given up once it is overdue by the timeout the stage's
        latency gives *now*: a trainer's first calls go out before any estimate exists (the ceiling
        then holds), and a peer that answers polls but holds calls must cost about one typical call
        once its stage-mates have answered, not the ceiling (issue #18)."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                limit = router.timeout_for(peer_id, samples, kind, floor_s=self._floor(kind))
                left = started + limit - time.monotonic()
                if left <= 0:
                    raise PeerError(0, "TimeoutError", f"no answer within {limit:.1f}s, the stage's typical latency "
                                    "(a peer on probation)") from TimeoutError(f"no answer within {limit:.1f}s")
                done, _ = await asyncio.wait({task}, timeout=min(left, 0.25))
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # ---- spot checks (swarmd.train.verify) -------------------------------------------------------

    async def _maybe_check_forward(self, stage: int, inputs: torch.Tensor, reply: ForwardReply,
                                   peer: str) -> ForwardReply:
        """Perhaps ask a second peer of ``stage`` for the same forward (a fresh microbatch id: to
        that peer it is a forward like any other). The reply to go on with: ``reply``, or, when a
        check it waited for convicted ``peer``, the majority's outputs."""
        client, spec, codec = self._require_client(), self._require_spec(), self.config.codec

        def resend(addr: str, timeout: float) -> Awaitable[ForwardReply | BackwardReply]:
            return client.forward(addr, stage, inputs, codec=codec, model=spec.digest, mb=secrets.randbits(64),
                                  timeout_s=timeout)

        honest = await self._maybe_check(stage, "forward", Answer(peer, reply.step, reply.outputs, reply.loss,
                                                                       reply.precision), resend,
                                         (inputs,), secrets.randbits(64))
        if honest is None or honest.tensor is None:
            return reply
        return dataclasses.replace(reply, outputs=honest.tensor, loss=honest.loss)

    async def _maybe_check_backward(
        self, stage: int, inputs: torch.Tensor, grad_outputs: torch.Tensor | None, targets: torch.Tensor | None,
        step: int | None, mb: int, reply: BackwardReply, peer: str,
    ) -> BackwardReply:
        """Perhaps ask a second peer of ``stage`` for the same backward, flagged ``verify`` (computed
        and answered, never accumulated: the microbatch's gradient counts once). The reply to go on
        with, as :meth:`_maybe_check_forward`'s (the liar's own accumulation is the averaging's to
        leave out, once the swarm excluded it)."""
        if reply.grad_inputs is None and reply.loss is None:
            self.checks.calls += 1
            return reply  # the first stage's backward answers nothing to compare
        client, spec, codec = self._require_client(), self._require_spec(), self.config.codec

        def resend(addr: str, timeout: float) -> Awaitable[ForwardReply | BackwardReply]:
            return client.backward(addr, stage, inputs, grad_outputs, targets, codec=codec, model=spec.digest,
                                   step=step, mb=mb, timeout_s=timeout, verify=True)

        tensors = tuple(t for t in (inputs, grad_outputs, targets) if t is not None)
        honest = await self._maybe_check(stage, "backward", Answer(peer, reply.step, reply.grad_inputs, reply.loss,
                                                                        reply.precision),
                                         resend, tensors, mb)
        if honest is None:
            return reply
        return dataclasses.replace(reply, grad_inputs=honest.tensor, loss=honest.loss)

    async def _maybe_check(
        self, stage: int, kind: Literal["forward", "backward"], primary: Answer,
        resend: Callable[[str, float], Awaitable[ForwardReply | BackwardReply]], request: tuple[torch.Tensor, ...],
        mb: int,
    ) -> Answer | None:
        """Draw whether to check this call and start the check. A random check runs in the
        background; a peer's first check is waited for (a liar from the start must not get its
        first answers used): then the majority's answer when it convicted the primary, else None;
        an unsettled mismatch raises ``_Redo(suspect=True)`` (the microbatch is redone)."""
        self.checks.calls += 1
        router = self.routers[stage]
        # a peer's first answers of each kind are always checked (with checks on): a liar from the start
        # is caught at its first answer, before it has done much harm
        first = self.config.verify_fraction > 0 and self._agreed.get((primary.peer_id, kind), 0) < FIRST_CHECKS
        first = first and router.usable_count > 1 and (primary.peer_id, kind) not in self._gave_up
        if not first and not self._checker.should_check(comparable=True, other_peers=router.usable_count - 1):
            return None
        if not first and len(self._check_tasks) >= self.config.window:  # first checks are never skipped
            self.checks.skipped += 1
            return None
        self.checks.first_checks += int(first)
        task = asyncio.create_task(self._check(stage, kind, primary, resend, request, mb, waited=first),
                                   name=f"swarmd-spot-check-{stage}-{kind}")
        self._check_tasks.add(task)
        task.add_done_callback(self._check_done)
        if not first:
            return None
        # shielded: a cancelled microbatch leaves its check running (owned by _check_tasks)
        verdict = await asyncio.shield(task)
        if verdict is _SUSPECT:
            raise _Redo(suspect=True)
        return verdict

    def _check_done(self, task: asyncio.Task[Answer | None]) -> None:
        self._check_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a spot check failed unexpectedly: %r", task.exception())

    async def _finish_checks(self) -> None:
        """Wait for the spot checks still running (each bounded by its peers' timeouts)."""
        while self._check_tasks:
            await asyncio.gather(*list(self._check_tasks), return_exceptions=True)

    async def _check(
        self, stage: int, kind: Literal["forward", "backward"], primary: Answer,
        resend: Callable[[str, float], Awaitable[ForwardReply | BackwardReply]], request: tuple[torch.Tensor, ...],
        mb: int, *, waited: bool = False,
    ) -> Answer | None:
        """One spot check: a second opinion, and on a mismatch a third (``verify.arbitrate``); the
        answer to go on with when the primary lied (the majority's) or was asked again (below),
        :data:`_SUSPECT` when a mismatch stayed unsettled, else None.

        A check the call ``waited`` for (a peer's first answers) that cannot confirm the answer
        (nobody else answered, or the stage stepped in between) asks the *same* peer again, with
        its stage-mates at once (:meth:`_recheck`, up to :data:`RECHECKS` times): the same request a
        moment later meets them at one step. An unconfirmed answer used to go through (a liar not
        yet disputed by this trainer); a gradient liar's one or two such answers per run left the
        held-out loss 6-9 % above an honest run's in 2 of 8 runs of 40 steps (its tripled
        gradients inflate Adam's second moments for hundreds of steps). A backward's recheck is
        flagged ``verify`` (never accumulated), so what goes on is its fresh answer, never the
        unconfirmed one, and the peer's next backward is checked first again (:meth:`_credit`);
        a forward's recheck looks like any forward to the peer, and the original answer goes on.
        Only when the rechecks cannot confirm either is the answer let through, unless the peer
        is *disputed* (in a mismatch no conviction cleared): then it is :data:`_SUSPECT` and the
        microbatch is redone (counted in ``redone``; the stage that added its gradient counts it
        twice). Honest swarms never redo, so their sample counts stay exact."""
        stats = self.checks
        samples = int(request[0].shape[0])
        nbytes = sum(t.numel() * t.element_size() for t in request)
        stats.checks += 1
        both = waited and self.routers[stage].usable_count > 2
        taken: set[str] = set()
        # a first check asks two peers at once: all three answers likely come from one step, so a
        # liar is convicted at once (a third asked only after a mismatch often met the next step:
        # one trainer saw 17 mismatches of a liar and convicted it never)
        opinions = await asyncio.gather(*(self._opinion(stage, kind, resend, samples, nbytes, {primary.peer_id}, taken)
                                          for _ in range(2 if both else 1)))
        verdict = await self._compare(stage, kind, primary, list(opinions), resend, request, mb)
        for _ in range(RECHECKS if waited else 0):
            if verdict is not _UNCONFIRMED:
                break
            stats.rechecks += 1
            again = await self._recheck(stage, kind, primary.peer_id, resend, samples, nbytes)
            if again is None:
                break
            verdict = await self._compare(stage, kind, again[0], again[1], resend, request, mb,
                                          uncredited=primary.peer_id if kind == "backward" else None)
            if verdict is None and kind == "backward":
                verdict = again[0]  # confirmed: its fresh gradients go on, not the unconfirmed ones
        if verdict is _INCOMPARABLE:
            stats.unconfirmed += int(waited)
            self._incomparable(stage, kind, primary)
            return None
        if verdict is _UNCONFIRMED:
            stats.unconfirmed += int(waited)
            return _SUSPECT if waited and primary.peer_id in self._disputed else None
        return verdict

    def _incomparable(self, stage: int, kind: Literal["forward", "backward"], primary: Answer) -> None:
        """The stage-mates that answered computed in another ``--precision`` than ``primary`` (bf16
        against fp32 differ by more than any codec's tolerance): its answer goes on unconfirmed and
        its first checks stop (random ones go on, and compare it with a peer of its precision when
        one answers), said once per peer."""
        if (primary.peer_id, kind) not in self._gave_up:
            log.warning("spot check: stage %d peer %s computes in %s and the stage-mates asked about its %s in "
                        "another precision; its answers are not compared with theirs", stage,
                        primary.peer_id[:12], primary.precision, kind)
            self._gave_up.add((primary.peer_id, kind))

    async def _recheck(
        self, stage: int, kind: Literal["forward", "backward"], peer_id: str,
        resend: Callable[[str, float], Awaitable[ForwardReply | BackwardReply]], samples: int, nbytes: int,
    ) -> tuple[Answer, list[Answer | None]] | None:
        """``peer_id``'s answer to the checked request again, and its stage-mates' (two when the
        stage has them), all asked at once; None when ``peer_id`` cannot be asked or did not answer."""
        if self.routers[stage].choose_only(peer_id) is None:
            return None  # banned or busy meanwhile: its mates are not asked in vain
        taken: set[str] = set()
        others = 2 if self.routers[stage].usable_count > 2 else 1
        answers = await asyncio.gather(
            self._opinion(stage, kind, resend, samples, nbytes, set(), only=peer_id),
            *(self._opinion(stage, kind, resend, samples, nbytes, {peer_id}, taken) for _ in range(others)))
        if answers[0] is None:
            return None
        return answers[0], list(answers[1:])

    def _credit(self, answers: Sequence[Answer], kind: Literal["forward", "backward"], uncredited: str | None) -> None:
        """Count a confirmed answer for each peer (a peer is checked always until :data:`FIRST_CHECKS`),
        but not for ``uncredited``: a backward's recheck is flagged, so it proves nothing of what the
        peer answers to an unflagged request, and that peer's next answer is checked again first."""
        for a in answers:
            if a.peer_id != uncredited:
                self._agreed[(a.peer_id, kind)] = self._agreed.get((a.peer_id, kind), 0) + 1

    async def _compare(
        self, stage: int, kind: Literal["forward", "backward"], primary: Answer, opinions: list[Answer | None],
        resend: Callable[[str, float], Awaitable[ForwardReply | BackwardReply]], request: tuple[torch.Tensor, ...],
        mb: int, uncredited: str | None = None,
    ) -> Answer | None:
        """The verdict on ``primary`` given the ``opinions`` asked for it: None (confirmed), the
        answer to go on with (it lied), :data:`_SUSPECT` (an unsettled mismatch), or
        :data:`_UNCONFIRMED` (no opinion at its step). ``uncredited``: see :meth:`_credit`."""
        stats, tol = self.checks, tolerance(self.config.codec)
        same = [a for a in opinions if a is not None and a.step == primary.step and a.precision == primary.precision]
        if not same and any(a is not None and a.step == primary.step for a in opinions):
            return _INCOMPARABLE
        if len(same) >= 2:
            return await self._settle_three(stage, kind, primary, same[0], same[1], request, mb, uncredited)
        second = same[0] if same else next((a for a in opinions if a is not None), None)
        if second is None:
            return _UNCONFIRMED
        outcome = arbitrate([primary, second], tol)
        if outcome.verdict is Verdict.AGREE:
            stats.agreements += 1
            self._credit((primary, second), kind, uncredited)
            return None
        if outcome.verdict is Verdict.INCONCLUSIVE:
            stats.inconclusive += 1
            return _UNCONFIRMED
        self._disputed |= {primary.peer_id, second.peer_id}
        stats.mismatches += 1
        stats.arbitrations += 1
        log.warning("spot check: stage %d peers %s and %s answered a %s differently at step %d; asking a third",
                    stage, primary.peer_id[:12], second.peer_id[:12], kind, primary.step)
        samples = int(request[0].shape[0])
        nbytes = sum(t.numel() * t.element_size() for t in request)
        third = await self._opinion(stage, kind, resend, samples, nbytes, {primary.peer_id, second.peer_id})
        if third is None:
            return self._unsettled_pair(stage, kind, primary.peer_id, second.peer_id)
        return await self._convicted(stage, kind, [primary, second, third], request, mb)

    def _unsettled_pair(self, stage: int, kind: Literal["forward", "backward"], a: str, b: str) -> Answer | None:
        """A mismatch between ``a`` and ``b`` that no third peer settled: :data:`_SUSPECT` (redo),
        unless they are the only usable peers of their stage and have disagreed so
        :data:`UNSETTLED_LIMIT` times: then no redo can ever settle it (one of two lies, which two
        peers cannot tell apart; or they differ beyond the tolerance for another reason, as
        stage-mates in different ``--precision`` did before replies named it), and redoing each
        microbatch for ever would stall training.
        Their answers then go on, and their first checks stop (random checks go on), said once."""
        for peer in (a, b):
            self._unsettled[(peer, kind)] = self._unsettled.get((peer, kind), 0) + 1
        pair_only = self.routers[stage].usable_count <= 2
        if not pair_only or min(self._unsettled[(a, kind)], self._unsettled[(b, kind)]) < UNSETTLED_LIMIT:
            return _SUSPECT
        if (a, kind) not in self._gave_up or (b, kind) not in self._gave_up:
            log.warning("spot check: stage %d peers %s and %s answered %s %d times differently and the stage has "
                        "no third peer to settle it (one of them lies, or they differ beyond the tolerance); "
                        "going on with their answers unconfirmed", stage, a[:12], b[:12], kind, UNSETTLED_LIMIT)
        self._gave_up |= {(a, kind), (b, kind)}
        return None

    async def _settle_three(
        self, stage: int, kind: Literal["forward", "backward"], primary: Answer, second: Answer, third: Answer,
        request: tuple[torch.Tensor, ...], mb: int, uncredited: str | None = None,
    ) -> Answer | None:
        """The verdict of a first check that asked two peers at once, all three at the primary's
        step: all agree (each confirmed but ``uncredited``), or the odd one out is convicted, or
        :data:`_SUSPECT`."""
        stats, tol = self.checks, tolerance(self.config.codec)
        answers = [primary, second, third]
        with_second, with_third = agree(primary, second, tol), agree(primary, third, tol)
        if with_second and with_third:
            stats.agreements += 1
            self._credit(answers, kind, uncredited)
            return None
        self._disputed |= {a.peer_id for a in answers}
        stats.mismatches += 1
        stats.arbitrations += 1
        log.warning("spot check: stage %d peers %s, %s and %s answered a %s differently at step %d", stage,
                    primary.peer_id[:12], second.peer_id[:12], third.peer_id[:12], kind, primary.step)
        if with_second or with_third:
            # the primary has a witness: the odd one out was a second opinion (convicted when the
            # other two agree, which they do here)
            witness, odd = (second, third) if with_second else (third, second)
            return await self._convicted(stage, kind, [primary, odd, witness], request, mb)
        return await self._convicted(stage, kind, answers, request, mb)

    async def _convicted(
        self, stage: int, kind: Literal["forward", "backward"], answers: list[Answer],
        request: tuple[torch.Tensor, ...], mb: int,
    ) -> Answer | None:
        """Arbitrate ``answers`` (primary, second, arbiter): convict the liar, and the answer to go
        on with (the second's when the primary lied, else None); :data:`_SUSPECT` when unsettled."""
        outcome = arbitrate(answers, tolerance(self.config.codec))
        if outcome.verdict is not Verdict.LIAR or outcome.liar is None:
            self.checks.inconclusive += 1
            return _SUSPECT
        self._disputed -= {a.peer_id for a in answers if a.peer_id != outcome.liar}  # they agreed on the truth
        await self._convict(stage, kind, outcome.liar, answers, request, mb)
        primary, second = answers[0], answers[1]
        return second if outcome.liar == primary.peer_id else None

    async def _opinion(
        self, stage: int, kind: Literal["forward", "backward"],
        resend: Callable[[str, float], Awaitable[ForwardReply | BackwardReply]], samples: int, nbytes: int,
        exclude: set[str], taken: set[str] | None = None, *, only: str | None = None,
    ) -> Answer | None:
        """Another peer's answer to a checked call; None (counted) when there is nobody else to ask or
        none answered (``failed``), or it refused as its stage stepped meanwhile (``inconclusive``).

        Like :meth:`_call`, at most :data:`OPINION_ATTEMPTS` tries: a busy peer (averaging) is asked
        again shortly, a broken one is banned and another one asked. ``taken``: shared by opinions
        asked at once, so that each asks another peer (a peer is added before the first await).
        ``only``: ask that peer and nobody else (a recheck of the primary)."""
        router = self.routers[stage]
        exclude = set(exclude)
        taken = set() if taken is None else taken
        mine: str | None = None  # this opinion's own claim in ``taken`` (a busy peer may be asked again)
        for _ in range(OPINION_ATTEMPTS):
            if only is not None:
                choice = router.choose_only(only) if only not in exclude else None
            else:
                choice = router.choose(exclude=exclude | (taken - {mine}))
            if choice is None:
                break
            peer_id, addr = choice
            taken.discard(mine)
            taken.add(peer_id)
            mine = peer_id
            timeout = router.timeout_for(peer_id, samples, kind, floor_s=self._floor(kind))
            router.begin(peer_id)
            self.checks.extra_requests += 1
            self.checks.extra_samples += samples
            self.checks.extra_bytes += nbytes
            started = time.monotonic()
            try:
                reply = await resend(addr, timeout)
            except PeerError as exc:
                action = classify(exc)
                if action is Action.BAN:
                    router.report_failure(peer_id, timeout=failures.timed_out(exc))
                    exclude.add(peer_id)
                    continue
                router.release(peer_id)
                if action is Action.RETRY_SOON:
                    await asyncio.sleep(0.05)
                    continue
                if action in (Action.REDO, Action.RETRY_ELSEWHERE):  # StaleStep, PeerBehind: a step in between
                    self.checks.inconclusive += 1
                    return None
                break
            except BaseException:
                router.release(peer_id)
                raise
            router.report_success(peer_id, samples, time.monotonic() - started, kind)
            if isinstance(reply, ForwardReply):
                return Answer(peer_id, reply.step, reply.outputs, reply.loss, reply.precision)
            return Answer(peer_id, reply.step, reply.grad_inputs, reply.loss, reply.precision)
        self.checks.failed += 1
        return None

    async def _convict(
        self, stage: int, kind: Literal["forward", "backward"], liar: str, answers: list[Answer],
        request: tuple[torch.Tensor, ...], mb: int,
    ) -> None:
        """Ban ``liar`` for :data:`LIAR_BAN_S`, say so, and report it to every listed peer."""
        stats = self.checks
        self.routers[stage].ban(liar, LIAR_BAN_S)
        if liar in stats.caught:  # another check that was in flight caught it too: reported already
            return
        stats.liars += 1
        stats.caught = (*stats.caught, liar)
        request_digest, answer_digests = await asyncio.to_thread(_evidence, request, answers)
        step = answers[0].step
        log.warning("spot check: stage %d peer %s lied (its %s at step %d disagrees with %s); banned for %.0fs "
                    "and reported (request %s, answers %s)", stage, liar[:12], kind, step,
                    " and ".join(a.peer_id[:12] for a in answers if a.peer_id != liar), LIAR_BAN_S,
                    request_digest[:16], ", ".join(f"{p[:12]}={d[:12]}" for p, d in sorted(answer_digests.items())))
        if self._identity is None:
            self._identity = Identity.generate()
        report = MisbehaviourReport.signed(self._identity, accused=liar, stage=stage, step=step, kind=kind, mb=mb,
                                           request_digest=request_digest, answers=answer_digests, at=time.time())
        body, signature = report.encode()
        client = self._require_client()
        peers = {p.peer_id: p.addr for router in self.routers for p in router.snapshot()
                 if p.peer_id != liar and p.routable}

        async def send(addr: str) -> bool:
            try:
                return (await client.report(addr, ReportRequest(body, signature), timeout_s=REPORT_TIMEOUT_S)).accepted
            except PeerError:
                return False

        accepted = await asyncio.gather(*(send(addr) for addr in peers.values()))
        stats.reports_sent += sum(accepted)

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
