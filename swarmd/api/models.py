"""The control plane's schema: every JSON body it reads or writes, as pydantic models.

``/status`` is built by the daemon from :class:`Status` itself (``Daemon.status``), so the
OpenAPI schema at ``/docs`` and what the daemon reports are one definition and cannot drift;
``extra="forbid"`` makes a field the daemon adds without declaring it here an error in tests.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ModelInfo(BaseModel):
    name: str = Field(description="the model spec's name (a preset name or the model file's stem)")
    digest: str = Field(description="stable sha256 of the spec; peers of one swarm must agree on it")


class PrecisionInfo(BaseModel):
    """How this peer computes its stage (``--precision``, ``swarmd.pipeline.stage.precision``): a peer's own
    choice, like its device; weights, optimizer state and the wire stay float32 whatever it is."""

    model_config = ConfigDict(extra="forbid")

    mode: str = Field(description="fp32 | bf16 | fp16 (autocast for the last two)")
    loss_scale: float | None = Field(default=None, description="fp16: the stage's dynamic loss scale now (a power "
                                     "of two; halved on overflow, doubled after a run of clean backwards); None "
                                     "otherwise")
    overflows: int | None = Field(default=None, description="fp16: backwards recomputed at half the scale since "
                                  "the stage was built; None otherwise")


class StageHealthInfo(BaseModel):
    """One stage as the swarm's records show it (``swarmd.pipeline.placement.coverage``)."""

    model_config = ConfigDict(extra="forbid")

    stage: int
    health: str = Field(description="ok (two or more peers serve it) | thin (one) | starting (none yet, one on its "
                        "way) | empty (none; its state exists) | lost (none, and no live peer holds its state)")
    serving: int = Field(description="peers serving it")
    pending: int = Field(description="peers joining or migrating into it")
    step: int | None = Field(description="the newest step a serving peer of it reports")
    step_age_s: float | None = Field(description="how old that report is, in seconds")
    checkpoint: int | None = Field(description="the newest checkpoint of it a live peer offers")
    hint: str = Field(description="what to do about it; empty when ok")


class _Part(BaseModel):
    """A part of ``/status``: typed, and no field the daemon does not declare here."""

    model_config = ConfigDict(extra="forbid")


class ActivationCacheInfo(_Part):
    """Forwards' activations kept for their backward on this peer (``swarmd.pipeline.stage.activation_cache``)."""

    entries: int = 0
    bytes: int = 0
    max_entries: int = 0
    max_bytes: int = 0
    hits: int = 0
    misses: int = Field(default=0, description="recomputed: nothing kept for that microbatch")
    mismatches: int = Field(default=0, description="same id, other inputs")
    evictions: int = Field(default=0, description="dropped unused: expired, or the step changed")
    skipped: int = Field(default=0, description="not kept: the cache was full")
    held: int = Field(default=0, description="hits whose backward came without its inputs: the kept ones were used")
    unheld: int = Field(default=0, description="backwards without inputs this peer no longer held: refused, resent")


class ExactlyOnceInfo(_Part):
    """Each microbatch's gradient counted once per step (``swarmd.pipeline.stage.step_protocol``)."""

    duplicates: int = Field(default=0, description="an id counted at that step already: answered, not added again")
    late_refused: int = Field(default=0, description="finished past the sender's deadline: not added")
    fenced_refused: int = Field(default=0, description="attempts a trainer's claim fenced off: not added")
    claims: int = Field(default=0, description="POST /v1/claim answered")
    claims_counted: int = Field(default=0, description="claims that found the microbatch counted here")


class ReservationsInfo(_Part):
    """This peer's lease book of sample reservations (``POST /v1/reserve``, ``swarmd.pipeline.reservations``)."""

    step: int
    reserved: int
    open: int = Field(description="samples of open leases")
    target: int
    granted: int = 0
    granted_samples: int = 0
    completed: int = 0
    expired: int = 0
    expired_samples: int = 0
    written_off: int = Field(default=0, description="done samples the stage lost with a peer")
    outside: int = Field(default=0, description="held without a lease")
    fair_cuts: int = Field(default=0, description="requests granted fewer leases than fit, to keep other "
                                                  "trainers' fair shares")


class ProofsInfo(_Part):
    """Stage-mates' proofs: a signed challenge at their announced address (``swarmd.net.proof``)."""

    proven: int = 0
    failing: int = 0
    failing_reasons: dict[str, int] = Field(default_factory=dict)
    proofs_ok: int = 0
    proofs_failed: dict[str, int] = Field(default_factory=dict)
    unproven: int = 0


class RoundRecord(BaseModel):
    """One averaging round as this peer saw it (``AveragerCore._record``). The fields every protocol
    reports are typed; a protocol may add its own (the all-reduce's round id, parts, ...)."""

    model_config = ConfigDict(extra="allow")

    status: str = Field(description="ok | aborted | refused (this peer refused the leader's answer)")
    step: int
    leader: str = Field(description="the leader's (or the all-reduce coordinator's) peer id")
    samples: int
    contributors: int
    missing: list[str] = Field(default_factory=list, description="expected contributors that never came")
    reason: str | None = Field(default=None, description="why it was aborted or refused")
    refused: dict[str, str] = Field(default_factory=dict, description="peer id -> why its contribution was "
                                    "turned away (kind: detail)")
    clipped: list[str] = Field(default_factory=list, description="contributions whose influence the robust mean cut")
    struck: list[str] = Field(default_factory=list, description="counted for their samples, left out of the mean")
    convicted: dict[str, str] = Field(default_factory=dict, description="peers convicted of hostile contributions "
                                      "by this round, and why")
    used: dict[str, int] | None = Field(default=None, description="whose samples the mean holds (as leader)")
    duration_s: float | None = None


class Exclusion(BaseModel):
    """A stage-mate this peer leaves out of its rounds for now (``round_checks.Suspicions``)."""

    offences: int
    excluded_for_s: float
    reason: str


#: What ``AveragingInfo.audits`` counts (``swarmd.pipeline.averaging.allreduce.auditor``), for ``/metrics``.
AUDIT_OUTCOMES = ("drawn", "noticed", "suspected", "ok", "mismatch", "unaccountable", "unanswered", "unprovable",
                  "shown", "seconded", "not_seconded", "busy", "skipped")


class AveragingInfo(BaseModel):
    """The stage's averaging rounds and their checks (``swarmd.pipeline.averaging.averager``, ``round_checks``)."""

    model_config = ConfigDict(extra="allow")

    rounds_ok: int = 0
    rounds_aborted: int = 0
    last_round: RoundRecord | None = None
    recent: list[RoundRecord] = Field(default_factory=list)
    rounds_refused: int = 0
    leaders_refused: dict[str, int] = Field(default_factory=dict)
    leaders_stalling: dict[str, int] = Field(default_factory=dict)
    contributions_refused: dict[str, int] = Field(default_factory=dict)
    refused_samples: int = 0
    hostile_convictions: dict[str, int] = Field(default_factory=dict, description="peer id -> times this peer, "
                                                "leading, convicted it of hostile contributions (robust averaging, "
                                                "issue 29)")
    contributions_clipped: int = Field(default=0, description="contributions whose influence the robust mean cut "
                                       "in rounds this peer led")
    contributions_struck: int = Field(default=0, description="contributions left out of the mean (their samples "
                                      "counted) as far from or against the leader's own gradient, in rounds this "
                                      "peer led")
    own_slices_struck: int = Field(default=0, description="(all-reduce) parts this peer owned whose mean left its own "
                                   "slice out, far from or against the part's median: its gradients disagree with "
                                   "its stage's")
    accusations: dict[str, int] = Field(default_factory=dict, description="convictions of hostile contributions "
                                        "shown to the stage-mates as signed evidence, by outcome: sent (this peer "
                                        "convicted), seconded (a stage-mate's, checked against this peer's own "
                                        "contributions or, for a conviction by recomputation, redone here: the "
                                        "accused is excluded here too), not_seconded, seconded_sent, "
                                        "accepted_by_mates (their ledgers counted it), rechecked (convictions by "
                                        "recomputation this peer recomputed), unchecked (... it could not: no "
                                        "parameters of that step left, inputs that do not fit), "
                                        "recheck_not_taken (stage-mates that did not take up this peer's "
                                        "conviction by recomputation)")
    audits: dict[str, int] = Field(default_factory=dict, description="(all-reduce) audits of part owners: drawn (a "
                                   "commit drew this peer to audit a part), noticed (a stage-mate said the owner "
                                   "would not show a part: audited here too), suspected (a committed part mean "
                                   "pointed against this peer's own slice: audited at once), ok, mismatch (the "
                                   "owner convicted), unaccountable (the owner refused, left requests unanswered "
                                   "while it took part in the rounds, or showed evidence that does not hold up: "
                                   "excluded), unanswered (the owner gone), unprovable (of the unaccountable: "
                                   "evidence that does not hold up), shown (stage-mates that took up a conviction "
                                   "or notice), seconded, not_seconded, busy (evidence shown while checking "
                                   "other), skipped")
    openings: dict[str, int] = Field(default_factory=dict, description="opened contributions (issue 29, item 3: "
                                     "each last-stage contribution's sketch against its microbatches'): sent (by "
                                     "this peer), and as leader ok, missing, bad (refused), inconsistent (convicted); "
                                     "recomputed (a sampled microbatch's gradient, recomputed from the inputs its "
                                     "contribution shipped), mismatch (its opened part was not that: convicted), "
                                     "unchecked (computed at other parameters or precision)")
    duplicate_microbatches: int = 0
    silent_contributors: int = 0
    dissenting_mates: int = Field(default=0, description="stage-mates this peer stopped waiting for to agree on "
                                  "the round's leader (they named another for longer than the stage's patience)")
    dissenting: list[str] = Field(default_factory=list, description="stage-mates left out of this peer's rounds "
                                  "now: they name another leader")
    excluded: dict[str, Exclusion] = Field(default_factory=dict, description="peer id -> why and for how long")
    excluded_by_reports: list[str] = Field(default_factory=list)
    proofs: ProofsInfo | None = None
    control_requests: dict[str, int] = Field(default_factory=dict, description="averaging requests without "
                                             "gradients this peer sent, by kind")
    codecs_sent: dict[str, int] = Field(default_factory=dict, description="gradients this peer sent to stage-mates "
                                        "(contributions, all-reduce parts), by codec (auto chooses per link)")
    links_mbit_s: dict[str, float] = Field(default_factory=dict, description="stage-mate address -> the throughput "
                                           "of this peer's averaging transfers from it, as measured (swarmd.net.links)")


class MigrationInfo(_Part):
    """The last move between stages (``swarmd.pipeline.placement.migration``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    from_stage: int | None = Field(default=None, alias="from")
    to: int | None = None
    reason: str | None = None
    phase: str | None = None
    started_at: float | None = None
    error: str | None = None
    dropped_samples: int | None = Field(default=None, description="accumulated for the old stage when it was "
                                        "dropped (None until then)")
    duration_s: float | None = None


class StateTransferInfo(_Part):
    """The stage's state between stage-mates (``swarmd.net.state_transfer``,
    ``swarmd.pipeline.placement.state_sync``)."""

    downloaded_bytes: int = Field(default=0, description="read from donors, failed attempts included")
    downloads_ok: int = 0
    downloads_failed: int = Field(default=0, description="every donor failed")
    last_download_s: float | None = None
    served_bytes: int = Field(default=0, description="GET /v1/state to joiners")
    served_streams: int = 0


class ServedInfo(_Part):
    """Data-plane requests answered."""

    forward: int = 0
    backward: int = 0
    rejected: int = 0


class AuthRefusals(_Part):
    dht: dict[str, int] = Field(default_factory=dict)
    data_plane: dict[str, int] = Field(default_factory=dict)


class AuthInfo(_Part):
    """Private swarms (``--swarm-key``): refusals by plane and reason."""

    private: bool
    key_id: str | None = Field(default=None, description="a fingerprint of the key")
    refused: AuthRefusals = Field(default_factory=AuthRefusals)


class RelayClientInfo(_Part):
    state: str = Field(description="direct | searching | relayed | none")
    relay_id: str | None = None
    relay_addr: str | None = None
    relayed_addr: str | None = None
    since: float | None = None
    requests: int = 0
    why: str | None = None


class RelayServerInfo(_Part):
    enabled: bool = False
    max_peers: int = 0
    budget_bytes_s: float = 0.0
    peers: dict[str, dict[str, Any]] = Field(default_factory=dict, description="relayed peer -> since, requests, bytes")
    requests: int = 0
    bytes: int = 0
    over_budget: int = 0
    refused: dict[str, int] = Field(default_factory=dict)


class RelayInfo(_Part):
    """Relays (``swarmd.net.relay``): whether this peer is relayed, and what it relays for others."""

    client: RelayClientInfo | None = None
    server: RelayServerInfo = Field(default_factory=RelayServerInfo)


class ReachabilityInfo(_Part):
    """Whether other members could dial ``data_addr`` (``swarmd.net.reachability``)."""

    status: str = Field(default="unknown", description="unknown | yes | no")
    addr: str | None = None
    by: dict[str, str] = Field(default_factory=dict, description="prober peer id -> 'reached' or why not")
    checked_at: float | None = None


class CheckpointNewest(_Part):
    step: int
    stage: int
    age_s: float
    bytes: int
    path: str


class CheckpointStatus(_Part):
    """Checkpoints under ``--state-dir`` (``swarmd.checkpoint``)."""

    every: int = Field(description="steps between checkpoints; 0: none written")
    keep: int
    dir: str
    newest: CheckpointNewest | None = None
    resumed_from_step: int | None = None
    writes: int = 0
    failures: int = 0
    last_error: str | None = None
    last_write_s: float | None = None


class GradientHandoverInfo(_Part):
    """Gradients handed over on graceful leave (``POST /v1/gradients``), in samples."""

    handed_out: int = 0
    dropped: int = Field(default=0, description="nobody took them")
    to: str | None = None
    handed_in: int = Field(default=0, description="from leaving stage-mates")


class ReportsInfo(_Part):
    """Trainers' signed misbehaviour reports (``POST /v1/report``, ``swarmd.pipeline.reports``)."""

    received: int = 0
    accepted: int = 0
    exclusions: int = 0
    refused: dict[str, int] = Field(default_factory=dict)
    excluded: list[str] = Field(default_factory=list)
    excluded_now: int = 0
    suspected: list[str] = Field(default_factory=list)  # accused once, not excluded: trainers check them more
    accused: int = 0


class AddressesInfo(BaseModel):
    """Bound and announced addresses, and how the announced host was chosen (``net/addresses.py``)."""

    data_bound: str | None = None
    data_announced: str | None = None
    dht_bound: str | None = None
    dht_announced: str | None = None
    how: str | None = Field(default=None, description="flag | bound | observed | route | loopback")
    observed: list[str] = Field(default_factory=list, description="what DHT contacts saw of this peer's address")


class DroppedPeer(BaseModel):
    """A peer record left out of this daemon's view of the swarm (``dht/membership.py``)."""

    peer_id: str
    stage: int
    data_addr: str
    reason: str


class SourceTopRefused(BaseModel):
    source: str
    refused: int


class DHTSourcesInfo(BaseModel):
    """What this node's DHT storage refused by source (issue 18: the source quota and fair sharing)."""

    grouping: str | None = None
    max_per_source: int = 0
    refused_over_quota: int = 0
    refused_full: int = 0
    evicted: int = 0
    top_refused_sources: list[SourceTopRefused] = Field(default_factory=list)
    one_replica: int = Field(default=0, description="lookups dropped as held by one replica only")


class UntrustedInfo(BaseModel):
    """Fake, unreachable or misbehaving peers left out of this daemon's views (issue 18)."""

    dropped: dict[str, int] = Field(default_factory=dict, description="peers left out of the newest view, by reason")
    peers: list[DroppedPeer] = Field(default_factory=list, description="examples")
    dropped_peers_total: dict[str, int] = Field(default_factory=dict, description="distinct peers ever left out, "
                                                "by reason")
    dht: DHTSourcesInfo | None = None


class Status(BaseModel):
    model_config = ConfigDict(extra="forbid")

    peer_id: str | None = Field(description="derived from the peer's ed25519 public key")
    stage: int | None = Field(description="the pipeline stage this peer serves (None while choosing)")
    n_stages: int | None
    state: str = Field(description="starting | joining | serving | migrating | draining | stopped")
    swarm: str = Field(description="the swarm's name")
    model: ModelInfo | None
    step: int = Field(description="optimizer steps applied to this stage's parameters")
    queue: int = Field(description="compute jobs waiting or running on the stage's worker thread")
    in_flight: int = Field(description="data-plane requests being served")
    throughput: float = Field(description="samples/s for forward+backward (bias-corrected EMA, alpha 0.1)")
    grad_samples: int = Field(description="samples whose gradients are accumulated since the last step")
    stale_dropped: int = Field(description="backwards refused because their forward ran at an older step")
    stale_applied: int = Field(description="delayed updates: backwards one step old, applied to the next update")
    activation_cache: ActivationCacheInfo | None = Field(
        default=None,
        description="forwards' activations kept for their backward on this peer: entries, bytes, max_entries, "
        "max_bytes, hits, misses (recomputed), mismatches (same id, other inputs), evictions (dropped unused: "
        "expired, or the step changed), skipped (not kept: the cache was full), held (hits whose backward came "
        "without its inputs: the kept ones were used), unheld (backwards without inputs this peer no longer held: "
        "refused with InputsNotCached, resent with them)",
    )
    worker_cpu_s: float = Field(default=0.0, description="CPU seconds the stage's worker thread spent computing")
    exactly_once: ExactlyOnceInfo = Field(
        default_factory=ExactlyOnceInfo,
        description="each microbatch's gradient counted once per step: duplicates (a microbatch id this peer had "
        "counted at that step already: answered, not added again), late_refused (finished past the sender's "
        "deadline: not added, the sender retried elsewhere), fenced_refused (attempts a trainer's claim fenced "
        "off: not added, it retried elsewhere), claims (POST /v1/claim answered), claims_counted (of them, "
        "those that found the microbatch counted here: the retry then only computes)",
    )
    reservations: ReservationsInfo | None = Field(
        default=None,
        description="this peer's lease book of sample reservations (POST /v1/reserve): step, reserved, open "
        "(samples of open leases), target, and granted, granted_samples, completed, expired, expired_samples, "
        "written_off (done samples the stage lost with a peer), outside (held without a lease)",
    )
    params_digest: str | None = Field(description="sha256 of the stage's parameters at `step`")
    averaging: AveragingInfo | None = Field(
        description="the stage's averaging rounds: rounds_ok, rounds_aborted, last_round, recent (each round: "
        "status, step, leader, samples, contributors, missing, duration_s, ...); the round "
        "checks (issue 17): rounds_refused, leaders_refused, leaders_stalling, contributions_refused (by reason), "
        "refused_samples, silent_contributors, duplicate_microbatches, excluded, excluded_by_reports; proofs "
        "(issue 18): proven, failing, failing_reasons, proofs_ok, proofs_failed, unproven"
    )
    synced_from: str | None = Field(description="the stage-mate whose state this peer downloaded last")
    migration: MigrationInfo | None = Field(description="the last move between stages: from, to, phase, reason, "
                                             "started_at, duration_s, error, dropped_samples")
    migrations: dict[str, int] = Field(
        default_factory=dict,
        description="moves between stages since the daemon started, by how they ended: done, failed, cancelled, "
        "and refused (requests or rebalancing decisions checked and refused)",
    )
    state_transfer: StateTransferInfo = Field(
        default_factory=StateTransferInfo,
        description="the stage's state (parameters, optimizer state, step) between stage-mates: downloaded_bytes "
        "(read from donors, failed attempts included), downloads_ok, downloads_failed (every donor failed), "
        "last_download_s; served_bytes and served_streams (GET /v1/state to joiners)",
    )
    precision: PrecisionInfo | None = Field(default=None, description="how this peer computes its stage (None "
                                            "before a stage is built)")
    served: ServedInfo = Field(description="data-plane requests answered: forward, backward, rejected")
    auth: AuthInfo | None = Field(
        default=None,
        description="private swarms (--swarm-key): private, key_id (a fingerprint of the key), and refused: "
        "DHT datagrams and data-plane requests refused for lacking the key, by reason "
        "(missing, malformed, stale, bad_mac, replay)",
    )
    data_addr: str | None = Field(description="host:port of the aiohttp data plane")
    api_addr: str | None = Field(description="host:port of this control plane")
    dht_addr: str | None = Field(description="host:port of this peer's DHT node (UDP); others --join it")
    addresses: AddressesInfo = Field(
        default_factory=AddressesInfo,
        description="data_bound/data_announced and dht_bound/dht_announced host:port, and how the announced "
        "host was chosen: flag (--announce), bound (a specific --host), observed (two or more DHT contacts agree "
        "on what they see), route (the local address of the route to the bootstrap peer), loopback",
    )
    relay: RelayInfo = Field(
        default_factory=RelayInfo,
        description="client: whether this peer is relayed (state direct | searching | relayed | none, relay_id, "
        "relay_addr, relayed_addr, requests, why); server: what it relays for others (enabled, max_peers, "
        "budget_bytes_s, peers, requests, bytes, over_budget, refused)",
    )
    reachability: ReachabilityInfo = Field(
        default_factory=ReachabilityInfo,
        description="whether other members could dial data_addr: status unknown | yes | no, the addr probed, "
        "by (prober peer id -> 'reached' or why not), checked_at (unix time)",
    )
    founder: bool = Field(description="whether this peer founded the swarm (started without --join)")
    announcements: int = Field(description="peer records this daemon published to the DHT")
    task_crashes: dict[str, int] = Field(
        default_factory=dict,
        description="background tasks that crashed (logged with their traceback), by name: how often",
    )
    checkpoint: CheckpointStatus | None = Field(
        default=None,
        description="checkpoints under --state-dir (None without one): every (steps; 0: none written), keep, "
        "dir, newest (step, stage, age_s, bytes, path), resumed_from_step, writes, failures, last_error, "
        "last_write_s",
    )
    gradient_handover: GradientHandoverInfo = Field(
        default_factory=GradientHandoverInfo,
        description="gradients handed over on graceful leave (POST /v1/gradients), in samples: handed_out and "
        "to (this peer, leaving), dropped (nobody took them), handed_in (from leaving stage-mates)",
    )
    untrusted: UntrustedInfo = Field(
        default_factory=UntrustedInfo,
        description="fake, unreachable or misbehaving peers (issue 18): dropped (peers left out of this daemon's "
        "newest view of the swarm, by reason: never_answered, failed_proof, excluded), peers (examples: peer_id, "
        "stage, data_addr, reason), dropped_peers_total (distinct peers ever left out, by reason), and dht: what "
        "this node's DHT storage refused (grouping, max_per_source, refused_over_quota, refused_full, evicted, "
        "top_refused_sources) and lookups dropped as held by one replica only (one_replica)",
    )
    reports: ReportsInfo = Field(
        default_factory=ReportsInfo,
        description="trainers' signed misbehaviour reports (POST /v1/report, issue 17): received, accepted, "
        "exclusions, refused (by reason: stale, duplicate, same_source, rate_limited, already_excluded), "
        "excluded (peer ids excluded now: two independent reports), excluded_now, accused (peers tracked)",
    )
    stages: list[StageHealthInfo] = Field(
        default_factory=list,
        description="every stage's health as the swarm's records show it, refreshed every announce period: a "
        "stage without a peer, or with one, is a warning with what to do (also in the log, /metrics and the "
        "dashboard)",
    )
    state_source: str | None = Field(
        default=None,
        description="where the served stage's state came from: live (a stage-mate), own (this peer's checkpoint), "
        "offered (another peer's checkpoint), fresh (nothing had trained), lost (waiting: nothing holds it)",
    )
    device: str
    version: str
    uptime_s: float


class SwarmPeer(BaseModel):
    peer_id: str
    state: str = Field(description="joining | serving | migrating | draining")
    data_addr: str
    api_addr: str
    throughput: float
    queue: int
    step: int
    params_digest: str | None
    version: str
    reachable: str = Field(default="unknown", description="whether members could dial data_addr: unknown | yes | no")
    age_s: float = Field(description="seconds since the peer last announced itself")


class SwarmStage(BaseModel):
    stage: int
    throughput: float = Field(description="summed throughput of the stage's peers, samples/s")
    health: StageHealthInfo | None = Field(default=None, description="the stage's health, its newest step and how old "
                                           "that report is (None from daemons of older builds)")
    peers: list[SwarmPeer]
    dropped: list[DroppedPeer] = Field(
        default_factory=list,
        description="records left out of this view, with the reason (peer_id, stage, data_addr, reason; at most 32)",
    )


class SwarmModel(ModelInfo):
    spec: dict[str, Any]


class SwarmView(BaseModel):
    swarm: str
    model: SwarmModel
    training: dict[str, Any]
    stages: list[SwarmStage]
    dht: dict[str, Any] = Field(description="DHT health: routing_table_size, rejected records, dropped datagrams")


class TrainerRequest(BaseModel):
    name: str = Field(default="trainer", max_length=64, description="a label shown in GET /trainers")
    sync: bool = Field(default=False, description="a --sync trainer: it needs the swarm to itself, so it is refused "
                       "(409) while another trainer trains through this daemon, and refuses others meanwhile")


class TrainerWelcome(BaseModel):
    trainer_id: str = Field(description="send heartbeats to POST /trainers/{trainer_id}/heartbeat")
    ttl_s: float = Field(description="the registration expires after this long without a heartbeat")
    swarm: str
    model: SwarmModel
    training: dict[str, Any] = Field(description="the swarm's TrainingSpec (target_batch_size, optimizer, ...)")
    step: int = Field(description="the optimizer step of the stage this daemon serves")
    rank: int | None = Field(default=None, description="the trainer's rank among those registered here: which "
                             "shard of the training data it draws from (the smallest rank no live trainer holds)")


class TrainerInfo(BaseModel):
    trainer_id: str
    name: str
    registered_at: float = Field(description="unix time")
    last_seen_s: float = Field(description="seconds since its last heartbeat")
    step: int | None = Field(default=None, description="the newest step it reported (None: no report yet)")
    loss: float | None = Field(default=None, description="the newest training loss it reported")
    val_loss: float | None = Field(default=None, description="the newest validation loss it reported")
    samples: int | None = Field(default=None, description="samples it has computed, as it reported")
    samples_per_s: float | None = Field(default=None, description="its samples/s, as it reported")
    rank: int | None = Field(default=None, description="its rank: the data shard it draws from")
    sync: bool = Field(default=False, description="a --sync trainer")
    steps_seen: int = Field(default=0, description="steps of the swarm it has reported, each with its loss")
    finished: bool = Field(default=False, description="it finished (listed until its registration expires)")
    retries: int = Field(default=0, description="requests it retried on another peer, as it reported")
    bans: int = Field(default=0, description="peers it banned after a failure, as it reported")
    spot_checks: dict[str, int] | None = Field(default=None, description="its spot checks of peers' answers so far "
                                               "(issue 17), as it reported: checks, mismatches, arbitrations, "
                                               "liars, reports_sent (None: it reported none)")


class SpotCheckCounts(BaseModel):
    """A trainer's spot checks since it started (``swarmd.train.verify.VerifyStats``), cumulative."""

    checks: int = Field(default=0, ge=0, description="calls re-sent to a second peer")
    mismatches: int = Field(default=0, ge=0, description="checks whose two answers disagreed")
    arbitrations: int = Field(default=0, ge=0, description="third opinions asked for")
    liars: int = Field(default=0, ge=0, description="distinct peers caught (banned and reported)")
    reports_sent: int = Field(default=0, ge=0, description="signed reports peers accepted")


MAX_REPORT_STEPS = 256  # steps one heartbeat may report (a trainer reports every ~10 s)


class ReportStep(BaseModel):
    step: int = Field(ge=0, description="the swarm's step index")
    loss: float | None = Field(default=None, allow_inf_nan=False,
                               description="mean training loss of this trainer's samples at it (finite, or null)")
    val_loss: float | None = Field(default=None, allow_inf_nan=False,
                                   description="a validation loss, when one was computed at it")


class TrainerReport(BaseModel):
    """What a heartbeat may carry (``swarmd.training_summary``): the steps since the last one."""

    steps: list[ReportStep] = Field(default_factory=list, max_length=MAX_REPORT_STEPS)
    samples: int = Field(default=0, ge=0, description="samples computed since the trainer started")
    samples_per_s: float = Field(default=0.0, ge=0, allow_inf_nan=False, description="the trainer's samples/s lately")
    retries: int = Field(default=0, ge=0, description="requests the trainer retried on another peer since it started")
    bans: int = Field(default=0, ge=0, description="peers the trainer banned after a failure since it started")
    spot_checks: SpotCheckCounts | None = Field(default=None, description="its spot checks since it started "
                                                "(optional: trainers before issue 17 send none)")


class TrainingPointInfo(BaseModel):
    t: float = Field(description="unix time the daemon received it")
    trainer_id: str
    step: int
    loss: float | None
    val_loss: float | None
    samples_per_s: float


class SwarmPointInfo(BaseModel):
    t: float = Field(description="unix time the daemon merged it from the DHT")
    step: int
    loss: float | None = Field(description="mean of the publishing daemons' newest losses")
    val_loss: float | None
    samples_per_s: float = Field(description="summed over the swarm's reporting trainers")
    trainers: int
    publishers: int = Field(description="daemons whose trainers reported")


class TrainingPublisher(BaseModel):
    peer_id: str
    step: int
    samples: int
    loss: float | None
    val_loss: float | None
    samples_per_s: float
    trainers: int
    age_s: float


class TrainingView(BaseModel):
    local: list[TrainingPointInfo] = Field(description="steps reported by the trainers registered with this daemon")
    swarm: list[SwarmPointInfo] = Field(description="the swarm's curve, merged from every daemon's DHT record")
    publishers: list[TrainingPublisher] = Field(description="the daemons' training records read last")


class MigrateRequest(BaseModel):
    model_config = {"extra": "forbid"}

    stage: int = Field(ge=0, description="the stage to move to")
    force: bool = Field(default=False, description="move even if this peer is the last one of its stage")


class Migration(BaseModel):
    model_config = {"extra": "allow"}

    to: int = Field(description="the stage this peer is moving to")
    phase: str = Field(description="starting | draining | building | downloading | done | failed")
    reason: str


class Health(BaseModel):
    ok: bool
    state: str


class Detail(BaseModel):
    """FastAPI's own refusals: a body that is not JSON (400), a missing or wrong token (401)."""

    detail: str


class ErrorBody(BaseModel):
    """Every refusal of the control plane (4xx/5xx) that is not FastAPI's own validation error."""

    error: str = Field(description="the error's class name, e.g. NotReady, MigrationRefused")
    message: str
    state: str | None = Field(default=None, description="NotReady: the state the peer is in (starting, joining, "
                              "migrating: ask again shortly; draining, stopped: ask another daemon)")
