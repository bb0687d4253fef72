"""Cost of one rebalancing decision on a large swarm: 10,000 peers over 64 stages by default.

Every peer of a live swarm runs the policy on each DHT snapshot, so a decision must be cheap
(the issue asks for well under 100 ms at this size). Four seeded snapshots, each timed for
``swarm.decide``, ``adaptive.decide`` and ``choose_stage_for`` (median and max of ``--repeats``
after one warm-up; building the snapshot itself is timed separately, it is the caller's cost):

- ``random``: every peer on a uniformly random stage, speeds drawn from {1.0, 2.2, 4.5} in
  proportions close to the mixed trace's (60/26/14%), times a ±10% measurement jitter; 2% of
  peers downloading. Stages differ by several peers, so ``adaptive`` plans many moves.
- ``balanced``: the same peers, LPT-assigned, all serving; nothing to do.
- ``departure``: ``balanced`` after a tenth of one stage's peers left at once.
- ``one_stage``: every peer on stage 0, the others empty: ``adaptive`` moves almost everyone in
  one decision. Unrealistic (newcomers join the weakest stage), so an upper bound.

    .venv/bin/python scripts/bench_rebalance.py --json
"""

from __future__ import annotations

import argparse
import heapq
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

from swarmd.finite import strict_json_dumps
from swarmd.pipeline.placement.rebalance import (
    POLICIES,
    PeerLoad,
    SwarmSnapshot,
    bottleneck,
    choose_stage_for,
    stage_totals,
)


def make_peers(n: int, rng: random.Random) -> list[tuple[str, float]]:
    speeds = rng.choices([1.0, 2.2, 4.5], weights=[60, 26, 14], k=n)
    return [(f"peer-{i:05d}", round(v * rng.uniform(0.9, 1.1), 4)) for i, v in enumerate(speeds)]


def snapshot(assignment: list[tuple[str, float, int]], n_stages: int, rng: random.Random,
             pending: float = 0.02) -> SwarmSnapshot:
    now = 100_000.0
    peers = []
    for pid, v, stage in assignment:
        if rng.random() < pending:
            peers.append(PeerLoad(pid, stage, "joining", v, 0, now + rng.uniform(0, 60)))
        else:
            peers.append(PeerLoad(pid, stage, "serving", v, rng.randrange(4), now - rng.uniform(0, 10_000)))
    return SwarmSnapshot(n_stages, tuple(peers), now=now)


def lpt(peers: list[tuple[str, float]], n_stages: int) -> list[tuple[str, float, int]]:
    sums = [(0.0, s) for s in range(n_stages)]
    out = []
    for pid, v in sorted(peers, key=lambda p: (-p[1], p[0])):
        total, s = heapq.heappop(sums)
        out.append((pid, v, s))
        heapq.heappush(sums, (total + v, s))
    return out


def timed(fn: Callable[[], object], repeats: int) -> tuple[dict[str, float], object]:
    result = fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return {"median_ms": round(statistics.median(samples) * 1e3, 3), "max_ms": round(max(samples) * 1e3, 3)}, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=10_000)
    ap.add_argument("--stages", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    peers = make_peers(args.peers, rng)
    balanced = lpt(peers, args.stages)
    victim = balanced[0][2]
    on_victim = [p for p in balanced if p[2] == victim]
    gone = {p[0] for p in rng.sample(on_victim, max(1, len(on_victim) // 10))}
    scenarios = {
        "random": [(pid, v, rng.randrange(args.stages)) for pid, v in peers],
        "balanced": balanced,
        "departure": [p for p in balanced if p[0] not in gone],
        "one_stage": [(pid, v, 0) for pid, v in peers],
    }
    report: dict[str, object] = {
        "peers": args.peers, "stages": args.stages, "repeats": args.repeats, "seed": args.seed,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0], "scenarios": {},
    }
    for name, assignment in scenarios.items():
        t0 = time.perf_counter()
        snap = snapshot(assignment, args.stages, random.Random(args.seed + 1), 0.0 if name == "balanced" else 0.02)
        build_ms = (time.perf_counter() - t0) * 1e3
        row: dict[str, object] = {"peers": len(snap.peers), "build_snapshot_ms": round(build_ms, 3)}
        row["stage_totals"], _ = timed(lambda: stage_totals(snap), args.repeats)
        for policy in ("swarm", "adaptive"):
            cost, moves = timed(lambda: POLICIES[policy].decide(snap, event="leave" if policy == "adaptive" else "period"),
                                args.repeats)
            row[policy] = {**cost, "moves": len(moves)}  # type: ignore[arg-type]
            if policy == "adaptive" and moves:
                speed = {p.peer_id: p.throughput for p in snap.peers}
                fut = list(stage_totals(snap).future)
                before = min(fut)
                for m in moves:  # type: ignore[attr-defined]
                    fut[m.src] -= speed[m.peer_id]
                    fut[m.dst] += speed[m.peer_id]
                row[policy]["future_bottleneck_before"] = round(before, 3)  # type: ignore[index]
                row[policy]["future_bottleneck_after"] = round(min(fut), 3)  # type: ignore[index]
        row["choose_stage_for"], _ = timed(lambda: choose_stage_for(snap, 1.0), args.repeats)
        row["bottleneck"] = round(bottleneck(snap), 3)
        report["scenarios"][name] = row  # type: ignore[index]
    if args.json:
        print(strict_json_dumps(report))
    else:
        for name, row in report["scenarios"].items():  # type: ignore[union-attr]
            print(f"{name:10s} swarm {row['swarm']['median_ms']:7.2f} ms ({row['swarm']['moves']} move)  "
                  f"adaptive {row['adaptive']['median_ms']:7.2f} ms ({row['adaptive']['moves']} moves)  "
                  f"choose_stage_for {row['choose_stage_for']['median_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
