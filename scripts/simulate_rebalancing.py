"""Replay a join/leave trace through a rebalancing policy and score its pipeline throughput.

The paper's protocol (SWARM, section 4.3 and appendix): peers join and leave as in a real
preemption log; the policy moves them between stages; the score is the pipeline's throughput
relative to an ideal assignment, integrated over the whole trace. Definitions, kept exactly:

- throughput(t) = min over stages of the summed ``speed`` of the peers serving that stage;
- a peer that just joined or moved serves nothing for ``--download-s`` seconds (default 60);
- optimum(t) = the LPT assignment (alive peers sorted by speed, descending, each to the stage
  with the least sum; ties to the lowest index) of all alive peers, with no download cost;
- score = integral of throughput dt / integral of optimum dt over the trace (from t=0 to the
  last event).

Event-driven: between events both curves are constant, so the integrals are exact sums of
rectangles. Events at one instant are handled in this order: downloads that finish, then the
trace's joins and leaves (in file order), then the periodic decision (at T, 2T, ...). ``swarm``
decides only on the period; ``adaptive`` also right after every join and leave. Decisions call
the daemon's functions (``swarmd.pipeline.placement.rebalance``) on a snapshot built from the simulated
swarm, with each peer's trace ``speed`` as its measured throughput and ``queue`` 0.

Choices where the definitions leave room (see also the module docstring of ``rebalance``):

- A peer that leaves mid-download simply disappears; its move still counts as a migration.
- ``--join random`` puts a newcomer on a uniformly random stage (``random.Random(seed + run)``,
  one stream per run); ``--join weakest`` asks ``choose_stage_for`` with the policy's name.
- The periodic decision with ``--period T`` happens at every multiple of T up to the last event.

    .venv/bin/python scripts/simulate_rebalancing.py --trace ../shared/data/fleet-mixed-32h.csv \\
        --stages 4 --policy swarm --period 300 --join random --runs 10 --json
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swarmd.pipeline.placement.rebalance import (
    DEFAULT_DOWNLOAD_S,
    POLICIES,
    AdaptiveRebalancing,
    Move,
    PeerLoad,
    Policy,
    SwarmSnapshot,
    choose_stage_for,
    get_policy,
)

JOIN_RULES = ("random", "weakest")


@dataclass(frozen=True)
class TraceEvent:
    time_s: float
    event: str  # "join" | "leave"
    node_id: str
    speed: float


def load_trace(path: str | Path) -> list[TraceEvent]:
    """Read ``time_s,event,node_id,speed``; events must be in time order and consistent."""
    events: list[TraceEvent] = []
    alive: set[str] = set()
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"time_s", "event", "node_id", "speed"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}")
        for line, row in enumerate(reader, start=2):
            ev = TraceEvent(float(row["time_s"]), row["event"], row["node_id"], float(row["speed"]))
            if events and ev.time_s < events[-1].time_s:
                raise ValueError(f"{path}:{line}: time goes backwards ({ev.time_s} < {events[-1].time_s})")
            if ev.event == "join":
                if ev.node_id in alive:
                    raise ValueError(f"{path}:{line}: node {ev.node_id} joins twice")
                if not (math.isfinite(ev.speed) and ev.speed > 0):
                    raise ValueError(f"{path}:{line}: speed must be > 0, got {ev.speed}")
                alive.add(ev.node_id)
            elif ev.event == "leave":
                if ev.node_id not in alive:
                    raise ValueError(f"{path}:{line}: node {ev.node_id} leaves but is not alive")
                alive.remove(ev.node_id)
            else:
                raise ValueError(f"{path}:{line}: unknown event {ev.event!r}")
            events.append(ev)
    return events


def lpt_optimum(speeds: Iterable[float], n_stages: int) -> float:
    """Reference optimum: LPT (fastest first, each to the stage with the least sum); its minimum."""
    sums = [(0.0, s) for s in range(n_stages)]
    for v in sorted(speeds, reverse=True):
        total, stage = heapq.heappop(sums)
        heapq.heappush(sums, (total + v, stage))
    return min(total for total, _ in sums)


@dataclass
class SimPeer:
    peer_id: str
    stage: int
    speed: float
    state: str  # "joining" | "migrating" | "serving"
    ready_at: float


@dataclass
class RunResult:
    relative_throughput: float
    integral_throughput: float
    integral_optimum: float
    migrations: int
    joins: int
    leaves: int
    decisions: int
    duration_s: float
    timeseries: list[tuple[float, float, float]] = field(default_factory=list)


class Simulation:
    """One run over a trace; the swarm's state plus the two integrals."""

    def __init__(self, n_stages: int, policy: str, period: float | None, join: str, download_s: float,
                 rng: random.Random, record: bool = False, rule: Policy | None = None) -> None:
        if join not in JOIN_RULES:
            raise ValueError(f"unknown join rule {join!r}, expected one of {JOIN_RULES}")
        self.n_stages = n_stages
        self.policy_name = policy
        self.policy = rule if rule is not None else get_policy(policy)
        self.period = period
        self.join_rule = join
        self.download_s = download_s
        self.rng = rng
        self.record = record
        self.peers: dict[str, SimPeer] = {}
        self.ready: list[tuple[float, str]] = []  # heap of (ready_at, peer_id)
        self.now = 0.0
        self.throughput = 0.0
        self.optimum = 0.0
        self.int_tp = 0.0
        self.int_opt = 0.0
        self.migrations = self.joins = self.leaves = self.decisions = 0
        self.timeseries: list[tuple[float, float, float]] = []

    # ---- state -------------------------------------------------------------------------------

    def snapshot(self) -> SwarmSnapshot:
        return SwarmSnapshot(
            self.n_stages,
            tuple(PeerLoad(p.peer_id, p.stage, p.state, p.speed, 0, p.ready_at) for p in self.peers.values()),
            now=self.now,
        )

    def _refresh(self, membership_changed: bool) -> None:
        sums = [0.0] * self.n_stages
        for p in self.peers.values():
            if p.state == "serving":
                sums[p.stage] += p.speed
        self.throughput = min(sums)
        if membership_changed:
            self.optimum = lpt_optimum((p.speed for p in self.peers.values()), self.n_stages)
        if self.record:
            if self.timeseries and self.timeseries[-1][0] == self.now:
                self.timeseries.pop()  # several updates at one instant: keep the last
            if not self.timeseries or self.timeseries[-1][1:] != (self.throughput, self.optimum):
                self.timeseries.append((self.now, self.throughput, self.optimum))

    def advance(self, t: float) -> None:
        """Integrate both curves up to ``t`` (they are constant since the last event)."""
        if t > self.now:
            self.int_tp += self.throughput * (t - self.now)
            self.int_opt += self.optimum * (t - self.now)
            self.now = t

    def _start_download(self, peer: SimPeer, state: str) -> None:
        peer.state = state
        peer.ready_at = self.now + self.download_s
        if self.download_s > 0:
            heapq.heappush(self.ready, (peer.ready_at, peer.peer_id))
        else:
            peer.state = "serving"

    def apply(self, moves: Sequence[Move]) -> None:
        for m in moves:
            peer = self.peers.get(m.peer_id)
            if peer is None or peer.stage != m.src or peer.state != "serving" or not 0 <= m.dst < self.n_stages:
                raise RuntimeError(f"policy {self.policy_name} returned an invalid move {m} for {peer}")
            peer.stage = m.dst
            self._start_download(peer, "migrating")
            self.migrations += 1

    def decide(self, event: str) -> None:
        self.decisions += 1
        self.apply(self.policy.decide(self.snapshot(), event=event, download_s=self.download_s))

    # ---- events ------------------------------------------------------------------------------

    def finish_downloads(self) -> bool:
        changed = False
        while self.ready and self.ready[0][0] <= self.now:
            ready_at, pid = heapq.heappop(self.ready)
            peer = self.peers.get(pid)
            if peer is not None and peer.ready_at == ready_at and peer.state != "serving":
                peer.state = "serving"
                changed = True
        return changed

    def on_trace(self, ev: TraceEvent) -> None:
        if ev.event == "join":
            if self.join_rule == "random":
                stage = self.rng.randrange(self.n_stages)
            else:
                stage = choose_stage_for(self.snapshot(), ev.speed, self.policy_name)
            peer = SimPeer(ev.node_id, stage, ev.speed, "joining", self.now)
            self.peers[ev.node_id] = peer
            self._start_download(peer, "joining")
            self.joins += 1
        else:
            del self.peers[ev.node_id]
            self.leaves += 1
        self.decide(ev.event)  # every policy hears of it; `swarm` and `none` ignore it

    def run(self, trace: Sequence[TraceEvent]) -> RunResult:
        end = trace[-1].time_s if trace else 0.0
        tick = self.period if self.period and self.policy_name != "none" else math.inf
        i = 0
        self._refresh(True)
        while i < len(trace):
            nxt = min(trace[i].time_s, tick, self.ready[0][0] if self.ready else math.inf)
            self.advance(nxt)
            changed = self.finish_downloads()
            membership = False
            while i < len(trace) and trace[i].time_s <= self.now:
                self.on_trace(trace[i])
                i += 1
                membership = changed = True
            if tick <= self.now:
                self.decide("period")
                tick += self.period  # type: ignore[operator]
                changed = True
            if changed:
                self._refresh(membership)
        self.advance(end)
        return RunResult(
            relative_throughput=self.int_tp / self.int_opt if self.int_opt > 0 else math.nan,
            integral_throughput=self.int_tp,
            integral_optimum=self.int_opt,
            migrations=self.migrations,
            joins=self.joins,
            leaves=self.leaves,
            decisions=self.decisions,
            duration_s=end,
            timeseries=self.timeseries,
        )


def simulate(trace: Sequence[TraceEvent], n_stages: int, policy: str, period: float | None, join: str,
             download_s: float = DEFAULT_DOWNLOAD_S, seed: int = 0, record: bool = False,
             rule: Policy | None = None) -> RunResult:
    """One run; ``seed`` seeds ``--join random``; ``rule`` replaces ``POLICIES[policy]``."""
    return Simulation(n_stages, policy, period, join, download_s, random.Random(seed), record, rule).run(trace)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="CSV time_s,event,node_id,speed")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--policy", choices=sorted(POLICIES), default="adaptive")
    ap.add_argument("--period", type=float, default=300.0, help="seconds between periodic decisions")
    ap.add_argument("--join", choices=JOIN_RULES, default="weakest")
    ap.add_argument("--download-s", type=float, default=DEFAULT_DOWNLOAD_S)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=1, help="runs averaged; run k uses seed + k")
    ap.add_argument("--timeseries", help="write t,throughput,optimum of the first run to this CSV")
    ap.add_argument("--efficiency", type=float, help="adaptive only: AdaptiveRebalancing(efficiency=...)")
    ap.add_argument("--cooldown-s", type=float, help="adaptive only: AdaptiveRebalancing(cooldown_s=...)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.stages < 1 or args.runs < 1 or args.period <= 0 or args.download_s < 0:
        ap.error("--stages and --runs must be >= 1, --period > 0, --download-s >= 0")

    rule: Policy | None = None
    if args.efficiency is not None or args.cooldown_s is not None:
        if args.policy != "adaptive":
            ap.error("--efficiency and --cooldown-s tune --policy adaptive only")
        default = AdaptiveRebalancing()
        rule = AdaptiveRebalancing(
            cooldown_s=args.cooldown_s if args.cooldown_s is not None else default.cooldown_s,
            efficiency=args.efficiency if args.efficiency is not None else default.efficiency,
        )

    trace = load_trace(args.trace)
    started = time.perf_counter()
    results = [
        simulate(trace, args.stages, args.policy, args.period, args.join, args.download_s,
                 args.seed + k, record=bool(args.timeseries) and k == 0, rule=rule)
        for k in range(args.runs)
    ]
    wall = time.perf_counter() - started
    if args.timeseries:
        with open(args.timeseries, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["t", "throughput", "optimum"])
            w.writerows(results[0].timeseries)
    rel = [r.relative_throughput for r in results]
    mig = [r.migrations for r in results]
    out = {
        "trace": str(args.trace),
        "stages": args.stages,
        "policy": args.policy,
        "period": args.period,
        "join": args.join,
        "download_s": args.download_s,
        "runs": args.runs,
        "seed": args.seed,
        **({"efficiency": rule.efficiency, "cooldown_s": rule.cooldown_s} if isinstance(rule, AdaptiveRebalancing) else {}),
        "relative_throughput": statistics.fmean(rel),
        "relative_throughput_std": statistics.pstdev(rel),
        "relative_throughput_runs": rel,
        "migrations": statistics.fmean(mig),
        "migrations_runs": mig,
        "joins": results[0].joins,
        "leaves": results[0].leaves,
        "decisions": results[0].decisions,
        "duration_s": results[0].duration_s,
        "wall_s": round(wall, 3),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.policy}@{args.period:g} join={args.join} S={args.stages} on {args.trace}: "
              f"relative throughput {out['relative_throughput']:.4f} (std {out['relative_throughput_std']:.4f}, "
              f"{args.runs} run(s)), {out['migrations']:.1f} migrations, {out['joins']} joins, {out['leaves']} leaves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
