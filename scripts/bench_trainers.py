"""Many trainers on one swarm: aggregate samples/s, stale fraction and steps/s for 1, 2 and 4 trainers.

A local swarm of ``--stages`` x ``--peers`` daemons (child processes through the real CLI, like
``swarmd demo``; ``--preset small`` by default, target batch ``--batch``) and, for each trainer
count N, N :class:`~swarmd.train.trainer.Trainer` objects in this process started together, each
with a window of ``--window // N`` microbatches, so the total in-flight window is the same for
every N. Each run drives ``--steps`` steps of the swarm (the swarm is reused: its step goes on).

Reported per N: ``samples_per_s`` (every trainer's completed samples over the run's wall time,
start-up included: registration, each trainer's corpus, the first step's fill), ``steady_samples_per_s``
and ``steady_steps_per_s`` (the swarm's steps between the first and the last one any trainer saw,
times the target batch, over the time between them: start-up excluded, the rate to compare),
``stale_fraction`` (microbatches redone as stale over microbatches issued), ``steps_per_s``, and
the issue-13 targets: stale fraction <= 5% with 4 trainers, and 4 trainers' steady samples/s >= 0.9
x one trainer's. ``--no-reservations`` paces each trainer on its own (the behaviour before the lease
book), for comparison. ``requests_per_step``: the requests the daemons served during the run, by
endpoint (their ``/metrics``, summed over the daemons), per step of the swarm: what the trainers'
coordination costs, counted rather than timed (a rate on a loaded machine is noisy, a count is not).

    .venv/bin/python scripts/bench_trainers.py --json
    .venv/bin/python scripts/bench_trainers.py --preset tiny --steps 10 --trainers 1 2 4
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd.finite import strict_json_dumps  # noqa: E402
from swarmd.local_swarm import DaemonProcess  # noqa: E402
from swarmd.train.events import StepDone, TrainerEvent  # noqa: E402
from swarmd.train.trainer import Trainer, TrainerConfig  # noqa: E402


def start_swarm(workdir: Path, preset: str, stages: int, peers: int, batch: int, threads: int) -> list[DaemonProcess]:
    common = ["--announce-period", "2", "--rebalance-policy", "none"]
    founder = DaemonProcess(["--model", preset, "--stage", "0", "--target-batch-size", str(batch), *common],
                            workdir, name="peer0", threads=threads)
    info = founder.wait_ready()
    daemons = [founder]
    for i in range(1, stages * peers):
        daemons.append(DaemonProcess(["--join", info["dht_addr"], "--stage", str(i % stages), *common], workdir,
                                     name=f"peer{i}", threads=threads))
    for d in daemons[1:]:
        d.wait_ready()
    return daemons


REQUESTS = re.compile(r'^swarmd_(?:data|control)_plane_requests_total\{endpoint="([^"]+)",status="\d+"\} (\S+)$', re.M)


def request_counts(daemons: list[DaemonProcess]) -> dict[str, float]:
    """Requests served so far by endpoint, summed over the daemons (from their ``/metrics``)."""
    counts: dict[str, float] = {}
    for d in daemons:
        with urllib.request.urlopen(f"{d.api}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for endpoint, value in REQUESTS.findall(text):
            counts[endpoint] = counts.get(endpoint, 0.0) + float(value)
    return counts


def measured(daemons: list[DaemonProcess], n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``n`` trainers, with the requests it cost the daemons per step of the swarm."""
    before = request_counts(daemons)
    result = asyncio.run(run(daemons[0].api, n, args))
    after = request_counts(daemons)
    result["requests_per_step"] = {k: round((after[k] - before.get(k, 0.0)) / args.steps, 2)
                                   for k in sorted(after) if after[k] > before.get(k, 0.0) and k != "/metrics"}
    return result


async def run(api: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    window = max(1, args.window // n)
    first_seen: dict[int, float] = {}  # swarm step -> when the first trainer saw it taken

    def on_event(event: TrainerEvent) -> None:
        if isinstance(event, StepDone):
            first_seen[event.step] = min(event.at, first_seen.get(event.step, event.at))

    trainers = [Trainer(TrainerConfig(api=api, steps=args.steps, microbatch_size=args.microbatch, window=window,
                                      codec=args.codec, seed=k, val_every=0, val_batches=1, name=f"bench{k}",
                                      max_corpus_bytes=4 << 20, reserve=args.reservations, refresh_s=1.0),
                        events=on_event)
                for k in range(n)]
    began = time.perf_counter()
    summaries = await asyncio.gather(*(t.run() for t in trainers))
    wall = time.perf_counter() - began
    issued = sum(s.microbatches_issued for s in summaries)
    lo, hi = (min(first_seen), max(first_seen)) if first_seen else (0, 0)
    span = first_seen[hi] - first_seen[lo] if hi > lo else 0.0
    steady_steps = (hi - lo) / span if span > 0 else None
    return {
        "trainers": n,
        "window_each": window,
        "samples_per_s": round(sum(s.samples for s in summaries) / wall, 2),
        "steady_samples_per_s": round(steady_steps * args.batch, 2) if steady_steps is not None else None,
        "steady_steps_per_s": round(steady_steps, 3) if steady_steps is not None else None,
        "steady_steps": hi - lo,
        "stale_fraction": round(sum(s.stale_redos for s in summaries) / issued, 4) if issued else 0.0,
        "steps_per_s": round(max(s.steps for s in summaries) / wall, 3),
        "microbatches_issued": issued,
        "microbatches_completed": sum(s.microbatches_completed for s in summaries),
        "stale_redos": sum(s.stale_redos for s in summaries),
        "full_waits": sum(s.full_waits for s in summaries),
        "lost_answers": sum(s.claims for s in summaries),  # backwards whose answer was lost (exactly once)
        "wall_s": round(wall, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--peers", type=int, default=2, help="peers per stage")
    p.add_argument("--batch", type=int, default=32, help="the swarm's target batch size")
    p.add_argument("--microbatch", type=int, default=8)
    p.add_argument("--window", type=int, default=8, help="total microbatches in flight, split among the trainers")
    p.add_argument("--steps", type=int, default=10, help="swarm steps per run")
    p.add_argument("--trainers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--codec", default="none")
    p.add_argument("--threads", type=int, default=1, help="torch threads per daemon")
    p.add_argument("--no-reservations", dest="reservations", action="store_false")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-trainers-") as tmp:
        daemons = start_swarm(Path(tmp), args.preset, args.stages, args.peers, args.batch, args.threads)
        try:
            results = [measured(daemons, n, args) for n in args.trainers]
        finally:
            for d in daemons:
                d.stop()
    by_n = {r["trainers"]: r for r in results}
    report: dict[str, Any] = {"preset": args.preset, "stages": args.stages, "peers_per_stage": args.peers,
                              "target_batch": args.batch, "microbatch": args.microbatch, "total_window": args.window,
                              "reservations": args.reservations, "runs": results}
    if 1 in by_n and 4 in by_n:
        report["scaling_4_vs_1"] = round(by_n[4]["samples_per_s"] / by_n[1]["samples_per_s"], 3)
        one, four = by_n[1]["steady_samples_per_s"], by_n[4]["steady_samples_per_s"]
        report["steady_scaling_4_vs_1"] = round(four / one, 3) if one and four is not None else None
        report["targets_met"] = {"stale_fraction_4_le_0.05": by_n[4]["stale_fraction"] <= 0.05,
                                 "samples_per_s_4_ge_0.9x1": (report["steady_scaling_4_vs_1"] or 0.0) >= 0.9}
    if args.json:
        print(strict_json_dumps(report))
        return
    for r in results:
        print(f"{r['trainers']} trainer(s), window {r['window_each']} each: {r['samples_per_s']:.1f} samples/s "
              f"(steady {r['steady_samples_per_s']}), stale {100 * r['stale_fraction']:.1f}%, "
              f"{r['steps_per_s']:.2f} steps/s")
    if "scaling_4_vs_1" in report:
        print(f"4 vs 1 trainer(s): {report['scaling_4_vs_1']:.2f}x whole run, {report['steady_scaling_4_vs_1']}x "
              f"steady; targets met: {report['targets_met']}")


if __name__ == "__main__":
    main()
