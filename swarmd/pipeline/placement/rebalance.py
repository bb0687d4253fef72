"""Which stage a peer should serve: pure functions over a snapshot of the swarm.

SWARM (paper, section 3.3 and Algorithm 2) keeps the pipeline balanced by sending peers where
throughput is lowest: a pipeline runs at the speed of its slowest stage. This module holds the
newcomer's rule (:func:`choose_stage_for`, and :func:`choose_stage` for the daemon's aggregate
view) and the rebalancing policies, keyed by name in :data:`POLICIES`:

- ``none``: never moves anyone (the paper's "no rebalancing" baseline).
- ``swarm``: Algorithm 2. Every ``T`` seconds the most underutilized peer of the least loaded
  stage moves to the most loaded stage, one peer per period, only when that raises the bottleneck.
- ``adaptive`` (the default): the same goal, decided at once on a departure or arrival as well as
  every ``T`` seconds, as many movers as it takes to raise the bottleneck, each chosen by its
  speed, only moves that never lower the pipeline's throughput while the movers download, and
  only plans whose gain is worth their downloads (see :class:`AdaptiveRebalancing`).

Every function here is pure: no I/O, no clock, no global state. ``snapshot.now`` is the only time
they see, and the only memory ``adaptive`` keeps (a mover's cool-down) travels in the snapshot as
each peer's ``ready_at`` (``ready_at=0``, unknown, means no cool-down: the caller may keep its own,
as the daemon does). The simulator (``scripts/simulate_rebalancing.py``) and the daemon call the
same functions.

How peers agree without a coordinator: in the live swarm every peer reads the same DHT snapshot,
runs ``decide`` on it, and executes only a :class:`Move` that names itself. ``decide`` is a
function of the snapshot's *contents*, not of the order the DHT returned peers in: stage sums
are exactly rounded (:func:`math.fsum`) and every tie is broken by a fixed rule that ends in the
stage index or the ``peer_id``. So each move has exactly one mover and two peers never race for
one move. Peers that read different snapshots (a record not yet visible to one of them) can
still disagree; the counter-measures are that in-flight downloads count towards their stage's
future capacity (a second reader sees the first move and does not repeat it), that a peer that
just arrived or moved is held back for a cool-down, and that a decision taken on the snapshot
its own moves produce is empty (tested), so a peer that sees the moves in flight never adds
more for the same gap.

Definitions and how the paper's wording was read here (the simulator uses the same ones):

- A peer *serves* only in state ``serving``. ``joining`` and ``migrating`` peers are downloading
  the stage's parameters and serve nothing yet; ``draining`` peers are leaving and count nowhere.
- A stage's *capacity* is the summed ``throughput`` of its serving peers, and its *load* is
  demand / capacity. Every sample passes every stage, so demand is the same for all stages and
  "most loaded" is "least capacity" (an empty stage is infinitely loaded). The paper measures
  queue lengths instead; a simulator has no queues, and with equal demand the two orders agree.
  ``swarm`` measures, so it sees only serving peers: with a period shorter than a download it
  can send a second peer to a gap the first is still downloading for (the simulator shows it).
- ``swarm``'s "most underutilized peer" is the one with the shortest ``queue`` in the least loaded
  stage, ties to the slowest peer (it gives up the least), then the smallest ``peer_id``. With
  homogeneous speeds and no queues that is simply the smallest ``peer_id``.
- ``swarm``'s "raises the bottleneck": after the move, the destination gains the mover's
  throughput and the source must keep more than the destination had, i.e. the move strictly
  improves the sorted vector of stage capacities. (Requiring the *global* minimum to rise would
  freeze ``swarm`` whenever two stages tie for last place, which with homogeneous peers is most
  of the time.)
- ``adaptive`` plans with *future* capacity: serving peers plus the peers downloading into the
  stage, so it never moves twice for one gap. It accepts a batch of moves only if it raises the
  minimum future capacity, and only moves whose source keeps at least the current bottleneck's
  capacity (so throughput never drops while movers download; a mover serves nothing for
  ``download_s`` seconds).
- No policy ever takes the last serving peer out of a stage.
- ``adaptive`` covers first (:func:`coverage_moves`): a stage with no peer at all takes one from
  the stage with the most serving peers at once, on any event and past any cool-down, whatever
  the throughputs say (a fresh swarm has measured nothing, and an empty stage stops the whole
  pipeline). ``swarm`` stays the paper's Algorithm 2, which fills a gap only at its period and
  only with measured throughput.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from swarmd.peer_state import LISTED, PENDING

STATES = LISTED
PENDING_STATES = PENDING
DEFAULT_POLICY = "adaptive"
DEFAULT_DOWNLOAD_S = 60.0
EVENTS = ("period", "join", "leave")

# Relative tolerance for "strictly raises": gains below it are float rounding, not progress.
_REL_EPS = 1e-9


@dataclass(frozen=True)
class StageLoad:
    """One stage as the DHT shows it: how many peers serve it and their summed throughput."""

    stage: int
    peers: int
    throughput: float  # samples/s, summed over the stage's peers


def choose_stage(loads: Sequence[StageLoad]) -> int:
    """The stage a newcomer should join: the lowest total throughput.

    Ties go to the stage with the fewest peers (a fresh peer reports 0 samples/s, so an empty
    stage beats one whose only peer has not measured itself yet), then the lowest index. This is
    :func:`choose_stage_for`'s rule on per-stage totals, for callers that have only those.
    """
    if not loads:
        raise ValueError("choose_stage needs at least one stage")
    return min(loads, key=lambda s: (s.throughput, s.peers, s.stage)).stage


@dataclass(frozen=True)
class PeerLoad:
    """One peer in a snapshot, as its DHT record shows it."""

    peer_id: str
    stage: int
    state: str  # "joining" | "serving" | "migrating" | "draining"
    throughput: float  # samples/s; for a joining/migrating peer, what it is expected to serve
    queue: int = 0
    # When it starts (or started) serving after its last join or move, on the snapshot's clock;
    # 0 (or less) when unknown: a peer serving since before anyone looked. ``adaptive`` holds a
    # peer back until ``ready_at + cooldown_s``: the only memory the policy needs.
    ready_at: float = 0.0

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"peer {self.peer_id!r}: unknown state {self.state!r}, expected one of {STATES}")
        if self.stage < 0:
            raise ValueError(f"peer {self.peer_id!r}: negative stage {self.stage}")
        if not (math.isfinite(self.throughput) and self.throughput >= 0):
            raise ValueError(f"peer {self.peer_id!r}: throughput must be finite and >= 0, got {self.throughput}")
        if self.queue < 0:
            raise ValueError(f"peer {self.peer_id!r}: negative queue {self.queue}")


@dataclass(frozen=True)
class Move:
    """``peer_id`` leaves stage ``src`` and downloads stage ``dst``; executed only by that peer."""

    peer_id: str
    src: int
    dst: int


@dataclass(frozen=True)
class SwarmSnapshot:
    """Every known peer of a swarm of ``n_stages`` stages at time ``now``."""

    n_stages: int
    peers: tuple[PeerLoad, ...]
    now: float = 0.0

    def __post_init__(self) -> None:
        if self.n_stages < 1:
            raise ValueError(f"a swarm needs at least one stage, got n_stages={self.n_stages}")
        seen: set[str] = set()
        for p in self.peers:
            if p.stage >= self.n_stages:
                raise ValueError(f"peer {p.peer_id!r} is on stage {p.stage}, but there are {self.n_stages}")
            if p.peer_id in seen:
                raise ValueError(f"peer {p.peer_id!r} appears twice in the snapshot")
            seen.add(p.peer_id)


@dataclass(frozen=True)
class StageTotals:
    """Per-stage sums a policy decides on (index = stage)."""

    capacity: tuple[float, ...]  # summed throughput of the peers serving now
    future: tuple[float, ...]  # capacity plus the peers downloading into the stage
    serving: tuple[int, ...]  # how many peers serve now
    peers: tuple[int, ...]  # serving plus downloading (draining peers are gone)


def expected_speeds(snapshot: SwarmSnapshot) -> dict[str, float]:
    """Each peer's throughput, with an estimate for the pending ones that have not measured yet.

    A peer that is joining (downloading its stage's state) announces 0 samples/s. Counted as 0 it
    makes its stage look empty for an announce period, and a policy would move a second peer to
    fill a gap that the newcomer is already filling (the demo's 1/3 ending). So a pending peer
    (joining or migrating) with no throughput counts as the mean throughput of every peer that
    has one (0 when nobody has measured anything yet). The mean is over the whole swarm, not the
    newcomer's stage, so that no move changes it (a mover keeps announcing what it served):
    the greedy plans of the policies stay exact. Serving peers count as measured: one that
    serves and measures nothing is no capacity (a daemon that has just started serving
    announces its donor's throughput until it has measured its own).
    """
    known = [p.throughput for p in snapshot.peers if p.state != "draining" and p.throughput > 0]
    guess = math.fsum(known) / len(known) if known else 0.0
    return {p.peer_id: guess if p.state in PENDING_STATES and p.throughput <= 0 else p.throughput
            for p in snapshot.peers}


def stage_totals(snapshot: SwarmSnapshot, *, estimate_unmeasured: bool = True) -> StageTotals:
    """Sum the snapshot per stage; exactly rounded, so the order of ``peers`` never matters.

    ``estimate_unmeasured``: count pending peers that announce 0 samples/s at :func:`expected_speeds`
    (the adaptive policy); False counts measured throughput only (the paper's Algorithm 2).
    """
    n = snapshot.n_stages
    speed = expected_speeds(snapshot) if estimate_unmeasured else {p.peer_id: p.throughput for p in snapshot.peers}
    now_speeds: list[list[float]] = [[] for _ in range(n)]
    pending_speeds: list[list[float]] = [[] for _ in range(n)]
    for p in snapshot.peers:
        if p.state == "serving":
            now_speeds[p.stage].append(speed[p.peer_id])
        elif p.state in PENDING_STATES:
            pending_speeds[p.stage].append(speed[p.peer_id])
    return StageTotals(
        capacity=tuple(math.fsum(x) for x in now_speeds),
        future=tuple(math.fsum(x + y) for x, y in zip(now_speeds, pending_speeds, strict=True)),
        serving=tuple(len(x) for x in now_speeds),
        peers=tuple(len(x) + len(y) for x, y in zip(now_speeds, pending_speeds, strict=True)),
    )


def bottleneck(snapshot: SwarmSnapshot) -> float:
    """The pipeline's throughput now: the least capacity over stages."""
    return min(stage_totals(snapshot, estimate_unmeasured=False).capacity)


class Policy(Protocol):
    """A rebalancing rule: pure, deterministic, a function of the snapshot's contents only."""

    name: str

    def decide(
        self, snapshot: SwarmSnapshot, *, event: str = "period", download_s: float = DEFAULT_DOWNLOAD_S
    ) -> list[Move]:
        """The moves to make now. ``event``: "period" (every T seconds), "join" or "leave"."""
        ...

    def choose_stage(self, snapshot: SwarmSnapshot, throughput: float) -> int:
        """The stage a newcomer expected to serve ``throughput`` samples/s should join."""
        ...

    def stage_keys(self, snapshot: SwarmSnapshot) -> list[tuple[float, int]]:
        """Per stage, how badly it needs a newcomer (smaller: more): ``choose_stage`` takes the
        smallest, ties to the lowest index."""
        ...


def _check_args(snapshot: SwarmSnapshot, event: str, download_s: float) -> None:
    if event not in EVENTS:
        raise ValueError(f"unknown event {event!r}, expected one of {EVENTS}")
    if not (math.isfinite(download_s) and download_s >= 0):
        raise ValueError(f"download_s must be finite and >= 0, got {download_s}")


def _eps(totals: Sequence[float]) -> float:
    return _REL_EPS * max(1.0, max(totals, default=0.0))


@dataclass(frozen=True)
class NoRebalancing:
    """The paper's baseline: peers stay where they joined."""

    name: str = "none"

    def decide(
        self, snapshot: SwarmSnapshot, *, event: str = "period", download_s: float = DEFAULT_DOWNLOAD_S
    ) -> list[Move]:
        _check_args(snapshot, event, download_s)
        return []

    def choose_stage(self, snapshot: SwarmSnapshot, throughput: float) -> int:
        """Least measured capacity, then fewest peers, then lowest index (:func:`choose_stage`)."""
        keys = self.stage_keys(snapshot)
        return min(range(snapshot.n_stages), key=lambda s: (keys[s], s))

    def stage_keys(self, snapshot: SwarmSnapshot) -> list[tuple[float, int]]:
        t = stage_totals(snapshot, estimate_unmeasured=False)
        return [(t.capacity[s], t.peers[s]) for s in range(snapshot.n_stages)]


@dataclass(frozen=True)
class SwarmRebalancing:
    """Algorithm 2 of the paper: at most one peer per period, least loaded stage to most loaded.

    Loads are measured, so only serving peers count: a peer still downloading shows no
    throughput yet, exactly as its empty queue would show in the paper's measurement.
    Membership events are ignored; the policy acts on the period only.
    """

    name: str = "swarm"

    def decide(
        self, snapshot: SwarmSnapshot, *, event: str = "period", download_s: float = DEFAULT_DOWNLOAD_S
    ) -> list[Move]:
        _check_args(snapshot, event, download_s)
        if event != "period":
            return []
        t = stage_totals(snapshot, estimate_unmeasured=False)
        cap = t.capacity
        n = snapshot.n_stages
        dst = min(range(n), key=lambda s: (cap[s], s))  # most loaded: least capacity
        src = min(range(n), key=lambda s: (-cap[s], s))  # least loaded: most capacity
        if src == dst or t.serving[src] < 2:
            return []
        mover = min(
            (p for p in snapshot.peers if p.stage == src and p.state == "serving"),
            key=lambda p: (p.queue, p.throughput, p.peer_id),
        )
        # Raise the bottleneck: the destination gains, the source stays above where it was.
        if mover.throughput <= 0 or cap[src] - mover.throughput <= cap[dst] + _eps(cap):
            return []
        return [Move(mover.peer_id, src, dst)]

    def choose_stage(self, snapshot: SwarmSnapshot, throughput: float) -> int:
        return NoRebalancing().choose_stage(snapshot, throughput)

    def stage_keys(self, snapshot: SwarmSnapshot) -> list[tuple[float, int]]:
        return NoRebalancing().stage_keys(snapshot)


@dataclass(frozen=True)
class AdaptiveRebalancing:
    """Ours: react to membership at once, move as many peers as raise the bottleneck, by speed.

    A decision is a greedy plan over *future* capacities (serving + downloading). Repeatedly,
    the weakest stage ``b`` takes the one mover, from any other stage ``a``, that maximises
    ``min(F[b] + v, F[a] - v)`` (ties: the slower mover, it costs less service while it
    downloads, then the richer source, then ``peer_id``), subject to

    - ``F[a] - v > F[b]``: the source stays above the old bottleneck, so every move strictly
      improves the sorted future capacities and, between membership changes, no sequence of
      decisions can cycle (no thrash);
    - ``C[a] - v >= min(C)``: while the mover downloads, its source still serves at least as much
      as today's bottleneck, so throughput never drops because of a move;
    - the source keeps a serving peer, and the mover is past its cool-down
      (``now >= ready_at + cooldown_s``).

    The plan is cut after the last move that raised ``min(F)`` (moves that only reshuffle cost a
    download and gain nothing now), and shortened further until it is worth its downloads: on
    average each migration must raise the bottleneck by at least ``efficiency * v / n_stages``,
    where ``v`` is the mean peer speed, i.e. by what one more typical peer adds to a balanced
    pipeline. That is the hysteresis: no download for a gain smaller than a newcomer's share, and
    so none for the noise of measured throughputs. With homogeneous peers a plan that raises the
    bottleneck by one peer's speed always passes (it needs at most ``n_stages - 1`` moves).
    ``cooldown_s=None`` means ``download_s``: a peer serves at least as long as it spent
    downloading before it may move again, so no peer spends more than half its time moving.
    """

    name: str = "adaptive"
    cooldown_s: float | None = None
    efficiency: float = 1.0  # raise of min(F) per migration, in units of mean speed / n_stages
    max_moves: int | None = None  # cap per decision (None: as many as help)

    def decide(
        self, snapshot: SwarmSnapshot, *, event: str = "period", download_s: float = DEFAULT_DOWNLOAD_S
    ) -> list[Move]:
        _check_args(snapshot, event, download_s)
        n = snapshot.n_stages
        if n < 2:
            return []
        cover = coverage_moves(snapshot)
        if cover:  # then plan on from where the coverage moves leave the swarm
            return cover + self.decide(moving(snapshot, cover, download_s), event=event, download_s=download_s)
        t = stage_totals(snapshot)
        cap = list(t.capacity)
        fut = list(t.future)
        serving = list(t.serving)
        floor = min(cap)  # throughput now; no move may push a source below it
        eps = _eps(fut)
        cooldown = download_s if self.cooldown_s is None else self.cooldown_s
        # Movable peers per stage, sorted by (speed, peer_id), with a parallel list of speeds.
        movable: list[list[tuple[float, str]]] = [[] for _ in range(n)]
        for p in snapshot.peers:
            settled = p.ready_at <= 0 or snapshot.now >= p.ready_at + cooldown
            if p.state == "serving" and p.throughput > 0 and settled:
                movable[p.stage].append((p.throughput, p.peer_id))
        for lst in movable:
            lst.sort()
        speeds = [[v for v, _ in lst] for lst in movable]

        start = min(fut)
        # Mean peer speed; over n stages, what a typical newcomer adds to a balanced bottleneck.
        unit = math.fsum(fut) / max(1, sum(t.peers))
        best = start
        raises: list[tuple[int, float]] = []  # (moves so far, min(F) after them) at each raise
        moves: list[Move] = []
        while self.max_moves is None or len(moves) < self.max_moves:
            b = min(range(n), key=fut.__getitem__)  # ties: the lowest index
            # (-pair minimum, speed, -source's remainder, peer_id, a, index): best first
            choice: tuple[float, float, float, str, int, int] | None = None
            for a in range(n):
                if a == b or serving[a] < 2 or not speeds[a]:
                    continue
                gap = fut[a] - fut[b]
                # source above old bottleneck; floor kept (to within eps: ``cap`` is updated move by move, and
                # 8.7 - 4.5 - 1.0 falls short of the 3.2 a fresh sum gives, so a move refused here was
                # made by the next decision on the same swarm)
                vmax = min(gap - eps, cap[a] - floor + eps)
                if vmax <= 0:
                    continue
                sp = speeds[a]
                half = gap / 2
                for i in (bisect_right(sp, min(half, vmax)) - 1, bisect_left(sp, half)):
                    if i < 0 or i >= len(sp) or sp[i] > vmax:
                        continue
                    i = bisect_left(sp, sp[i])  # first (smallest peer_id) of that speed
                    v, pid = movable[a][i]
                    key = (-min(fut[b] + v, fut[a] - v), v, v - fut[a], pid, a, i)
                    if choice is None or key < choice:
                        choice = key
            if choice is None:
                break
            _, v, _, pid, a, i = choice
            del movable[a][i], speeds[a][i]
            cap[a] -= v
            fut[a] -= v
            fut[b] += v
            serving[a] -= 1
            moves.append(Move(pid, a, b))
            low = min(fut)
            if low > best + eps:
                best = low
                raises.append((len(moves), low))
        # The longest plan, cut after a raise, that is worth its downloads.
        for keep, low in reversed(raises):
            if (low - start) * n >= self.efficiency * keep * unit:
                return moves[:keep]
        return []

    def choose_stage(self, snapshot: SwarmSnapshot, throughput: float) -> int:
        """Least future capacity (downloads in flight count), then fewest peers, then index.

        Adding to the stage of least future capacity is the only single placement that can
        raise the future bottleneck, whatever the newcomer's speed.
        """
        keys = self.stage_keys(snapshot)
        return min(range(snapshot.n_stages), key=lambda s: (keys[s], s))

    def stage_keys(self, snapshot: SwarmSnapshot) -> list[tuple[float, int]]:
        t = stage_totals(snapshot)
        return [(t.future[s], t.peers[s]) for s in range(snapshot.n_stages)]


POLICIES: Mapping[str, Policy] = MappingProxyType(
    {p.name: p for p in (NoRebalancing(), SwarmRebalancing(), AdaptiveRebalancing())}  # type: ignore[misc]
)


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown rebalancing policy {name!r}, expected one of {sorted(POLICIES)}") from None


def choose_stage_for(snapshot: SwarmSnapshot, throughput: float, policy: str = DEFAULT_POLICY, *,
                     prefer: Collection[int] = ()) -> int:
    """The stage a newcomer should join: the one that needs it most, as ``policy`` measures it.

    ``none`` and ``swarm`` look at measured capacity (serving peers only), ``adaptive`` also
    counts the peers still downloading into a stage. ``throughput`` is the newcomer's expected
    samples/s (0 if it has not measured itself yet). ``prefer``: stages the newcomer would rather
    serve when they need it as much as the best (e.g. those it holds checkpoints of, so a stage
    comes back from its own disk); ties among them go to the lowest index.
    """
    if not (math.isfinite(throughput) and throughput >= 0):
        raise ValueError(f"throughput must be finite and >= 0, got {throughput}")
    chosen = get_policy(policy)
    keys = chosen.stage_keys(snapshot)
    best = min(keys)
    for s in sorted(prefer):
        if 0 <= s < snapshot.n_stages and keys[s] == best:
            return s
    return chosen.choose_stage(snapshot, throughput)


def coverage_moves(snapshot: SwarmSnapshot) -> list[Move]:
    """Moves that give every stage at least one peer: a pipeline with an empty stage trains nothing.

    Throughput rules cannot see that gap in a swarm that has measured nothing yet (a fresh swarm,
    or peers that have not served a batch): every capacity is 0 and no move raises a minimum. So
    before any throughput rule, each empty stage (no serving or pending peer), lowest index first,
    takes one serving peer from the stage with the most serving peers (at least two: no stage is
    ever emptied to fill another; ties: more future capacity, then the lowest index), the slowest
    of them (it gives up the least), ties by ``peer_id``. Cool-downs do not apply: the gap costs
    more than a move. Once the mover is on its way the stage is no longer empty, so a decision on
    the snapshot the moves produce is empty.
    """
    t = stage_totals(snapshot)
    n = snapshot.n_stages
    serving = list(t.serving)
    movable: list[list[tuple[float, str]]] = [[] for _ in range(n)]
    for p in snapshot.peers:
        if p.state == "serving":
            movable[p.stage].append((p.throughput, p.peer_id))
    for lst in movable:
        lst.sort()
    moves: list[Move] = []
    for b in range(n):
        if t.peers[b] > 0:
            continue
        sources = [a for a in range(n) if serving[a] >= 2 and movable[a]]
        if not sources:
            break
        a = min(sources, key=lambda x: (-serving[x], -t.future[x], x))
        _, pid = movable[a].pop(0)
        serving[a] -= 1
        moves.append(Move(pid, a, b))
    return moves


def moving(snapshot: SwarmSnapshot, moves: Sequence[Move], download_s: float = DEFAULT_DOWNLOAD_S) -> SwarmSnapshot:
    """The snapshot once ``moves`` started: each mover migrating into its destination, ready after
    its download."""
    by_id = {m.peer_id: m for m in moves}
    peers = tuple(
        PeerLoad(p.peer_id, by_id[p.peer_id].dst, "migrating", p.throughput, p.queue, snapshot.now + download_s)
        if p.peer_id in by_id else p
        for p in snapshot.peers
    )
    return SwarmSnapshot(snapshot.n_stages, peers, snapshot.now)


def empty_stages(snapshot: SwarmSnapshot) -> list[int]:
    """Stages no serving or pending peer covers."""
    t = stage_totals(snapshot)
    return [s for s in range(snapshot.n_stages) if t.peers[s] == 0]
