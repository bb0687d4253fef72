"""A swarm under a Sybil flood (issue 18): training throughput with 0, 50 and 500 fake peers.

For each configuration, a fresh local swarm of ``--stages`` x ``--peers`` daemons (child processes
through the real CLI, ``--preset tiny``) and one trainer in this process. Flooded configurations
start ``scripts/flood.py`` as another child process first: it joins the swarm's DHT and publishes
N validly signed ``serving`` records (fresh identities, half per stage, the real peers' step and
params digest, refreshed every 5 s) pointing at a tarpit (accepts TCP, never answers) or at a
refusing port; the trainer starts once the fakes show in the daemons' ``/swarm``, or after 15 s.

Reported per configuration: ``samples_per_s`` and its ``ratio`` to the clean runs' mean (the issue's
target: >= 0.8), the seconds of each step (``step_s``: the first step carries what discovering the
fakes costs) and the ``steady_ratio`` (median step time of clean runs, steps 2..N, over this run's),
the steps done, averaging rounds ok per daemon, whether every real peer stayed
listed in ``/swarm``, how many fakes were listed when the trainer started and at the end,
connections the tarpit accepted (requests wasted on fakes), the trainer's timeouts, bans and
probation calls, and each daemon's ``/status`` -> ``untrusted`` counts; ``by_config`` averages
them over ``--repeat`` rounds. The clean configuration opens every round and closes the last, so
drift on a shared machine shows.

First, the DHT alone (``--dht-nodes``, default 20; no daemons): 1,000 fake records from one attacker
node and from four, against 3 real peers per stage; whether every reader still lists every real
peer, how many fakes it lists, and a stage read's latency before and after.

    .venv/bin/python scripts/bench_flood.py --json
    .venv/bin/python scripts/bench_flood.py --steps 5 --fakes 50 --targets tarpit --dht-nodes 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.flood import FloodProcess, bundle_chunks  # noqa: E402

from swarmd.finite import strict_json_dumps  # noqa: E402
from swarmd.local_swarm import DaemonProcess  # noqa: E402
from swarmd.train.trainer import Trainer, TrainerConfig  # noqa: E402

SWARM = "bench-flood"
LISTED_WAIT_S = 15.0


def start_swarm(workdir: Path, args: argparse.Namespace) -> list[DaemonProcess]:
    common = ["--swarm", SWARM, "--announce-period", "2", "--rebalance-policy", "none"]
    founder = DaemonProcess(["--model", args.preset, "--stage", "0", "--target-batch-size", str(args.batch),
                             *common], workdir, name="peer0", threads=args.threads)
    info = founder.wait_ready()
    daemons = [founder]
    for i in range(1, args.stages * args.peers):
        daemons.append(DaemonProcess(["--join", info["dht_addr"], "--stage", str(i % args.stages), *common],
                                     workdir, name=f"peer{i}", threads=args.threads))
    for d in daemons[1:]:
        d.wait_ready()
    return daemons


def listing(daemon: DaemonProcess) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(f"{daemon.api}/swarm", timeout=10) as resp:
        return dict(json.loads(resp.read()))


def listed_ids(view: dict[str, Any]) -> set[str]:
    return {p["peer_id"] for s in view["stages"] for p in s["peers"]}


async def one(fakes: int, target: str | None, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-flood-") as tmp:
        daemons = start_swarm(Path(tmp), args)
        flood: FloodProcess | None = None
        try:
            real = {d.status()["peer_id"] for d in daemons}
            fake_ids: set[str] = set()
            listed_at_start = 0
            if fakes and target:
                flood = FloodProcess(daemons[0].info["dht_addr"], SWARM, fakes, target, refresh_s=5.0,
                                     workdir=Path(tmp))
                fake_ids = set((await flood.wait_ready_async())["fakes"])
                deadline = time.monotonic() + LISTED_WAIT_S
                while time.monotonic() < deadline:
                    listed_at_start = len(listed_ids(await asyncio.to_thread(listing, daemons[0])) & fake_ids)
                    if listed_at_start >= min(fakes, 16):
                        break
                    await asyncio.sleep(0.5)
            step_at: list[float] = []
            trainer = Trainer(TrainerConfig(api=daemons[0].api, steps=args.steps, microbatch_size=args.microbatch,
                                            window=args.window, codec="none", seed=0, val_every=0, val_batches=1,
                                            max_corpus_bytes=4 << 20, refresh_s=1.0, name="bench-flood"),
                              on_step=lambda *_: step_at.append(time.perf_counter()))
            began = time.perf_counter()
            summary = await trainer.run()
            wall = time.perf_counter() - began
            view = await asyncio.to_thread(listing, daemons[0])
            statuses = [await d.status_async() for d in daemons]
            if args.debug_missing:
                for d, st in zip(daemons, statuses, strict=True):
                    if st["peer_id"] not in listed_ids(view):
                        own = await asyncio.to_thread(listing, d)
                        print(strict_json_dumps({
                            "missing": st["peer_id"], "in_own_view": st["peer_id"] in listed_ids(own),
                            "others_view": [st["peer_id"] in listed_ids(await asyncio.to_thread(listing, o))
                                            for o in daemons if o is not d],
                            "untrusted": st.get("untrusted"), "log": d.log_tail(3000)}), file=sys.stderr)
            stats = flood.stop() if flood is not None else {}
        finally:
            if flood is not None:
                flood.stop()
            for d in daemons:
                d.stop()
    untrusted: Counter[str] = Counter()
    for s in statuses:
        untrusted.update((s.get("untrusted") or {}).get("dropped_peers_total") or {})
    s_json = summary.to_json()
    return {
        "fakes": fakes,
        "target": target,
        "steps": summary.steps,
        "samples_per_s": round(summary.samples / wall, 2) if wall > 0 else 0.0,
        "wall_s": round(wall, 2),
        "step_s": [round(t1 - t0, 2) for t0, t1 in zip([began, *step_at], step_at, strict=False)],
        "rounds_ok": [(s.get("averaging") or {}).get("rounds_ok", 0) for s in statuses],
        "rounds_aborted": [(s.get("averaging") or {}).get("rounds_aborted", 0) for s in statuses],
        "real_listed": f"{len(listed_ids(view) & real)}/{len(real)}",
        "real_missing": [{k: s.get(k) for k in ("peer_id", "stage", "state", "step", "announcements")}
                         for s in statuses if s["peer_id"] not in listed_ids(view)],
        "fakes_listed_at_start": listed_at_start,
        "fakes_listed_at_end": len(listed_ids(view) & fake_ids),
        "tarpit_accepted": stats.get("tarpit_accepted", 0),
        "tarpit_by_path": stats.get("tarpit_by_path", {}),
        "trainer": {k: s_json.get(k) for k in ("retries", "bans", "timeouts", "probation_calls",
                                               "microbatches_issued", "microbatches_completed")},
        "untrusted_seen": dict(untrusted),
        "dht_refused_over_quota": sum(((s.get("untrusted") or {}).get("dht") or {}).get("refused_over_quota", 0)
                                      for s in statuses),
    }


async def dht_flood(nodes_n: int, real_per_stage: int, fakes: int, sources: int) -> dict[str, Any]:
    """The DHT alone (no daemons, no torch): ``nodes_n`` loopback DHT nodes, ``real_per_stage`` real
    peers per stage announcing from their own nodes (half before the flood, half after), and
    ``sources`` attacker nodes storing ``fakes`` signed serving records (half per stage) in bundles.
    Reported: real peers listed on every reader, fakes listed per stage, stage-read latency before
    and after the flood, records the storing nodes refused over quota."""
    from swarmd.dht.identity import Identity
    from swarmd.dht.node import DHTNode, bucket_of, stage_key
    from swarmd.dht.records import PeerRecord, sign_record

    def record(identity: Identity, stage: int, addr: str) -> bytes:
        now = time.time()
        return sign_record(identity, PeerRecord(
            peer_id=identity.peer_id, stage=stage, state="serving", data_addr=addr, api_addr=addr, throughput=10.0,
            queue=0, step=3, params_digest="ab" * 32, version="0.1.0", timestamp=now, expiry=now + 60.0,
            reachable="yes"))

    swarm = "dht-flood"
    nodes: list[DHTNode] = []
    attackers: list[DHTNode] = []
    try:
        for i in range(nodes_n):
            node = DHTNode(Identity.generate(), rpc_timeout=5.0)
            await node.start([] if i == 0 else [nodes[0].address])
            nodes.append(node)
        for _ in range(sources):
            node = DHTNode(Identity.generate(), rpc_timeout=5.0)
            await node.start([nodes[0].address])
            attackers.append(node)
        peers = nodes[: 2 * real_per_stage]
        real = {n.peer_id: k % 2 for k, n in enumerate(peers)}
        readers = nodes[2 * real_per_stage:]

        async def announce(subset: list[DHTNode]) -> None:
            await asyncio.gather(*(n.store_peer(swarm, record(n.identity, real[n.peer_id], "203.0.113.45:1"))
                                   for n in subset))

        async def read_all() -> tuple[float, list[int], int]:
            """Median seconds of a 2-stage read, fakes listed per stage, readers missing a real peer."""
            times, fakes_listed, missing = [], [0, 0], 0
            for reader in readers:
                began = time.perf_counter()
                stages = [await reader.get_stage_peers(swarm, s) for s in (0, 1)]
                times.append(time.perf_counter() - began)
                for s, listed in enumerate(stages):
                    mine = {pid for pid, st in real.items() if st == s}
                    missing += not mine <= set(listed)
                    fakes_listed[s] = max(fakes_listed[s], len(set(listed) - mine))
            return statistics.median(times), fakes_listed, missing

        half = len(peers) // 2
        await announce(peers[:half])
        before = await read_all()
        by_key: dict[str, list[bytes]] = {}
        for k in range(fakes):
            identity = Identity.generate()
            by_key.setdefault(stage_key(swarm, k % 2, bucket_of(identity.peer_id)), []).append(
                record(identity, k % 2, "127.0.0.1:9"))
        began = time.perf_counter()
        jobs = []
        for n, (key, raws) in enumerate(sorted(by_key.items())):
            for chunk in bundle_chunks(raws):
                jobs.append(attackers[(n + len(jobs)) % len(attackers)].store_many(key, chunk))
        await asyncio.gather(*jobs)
        flood_s = time.perf_counter() - began
        await announce(peers[half:])  # newcomers after the flood
        await announce(peers)  # and a refresh of everyone
        after = await read_all()
        return {
            "nodes": nodes_n, "attacker_nodes": sources, "fakes": fakes, "real_peers": len(peers),
            "real_missing_reads": after[2], "fakes_listed_per_stage": after[1],
            "read_s_before": round(before[0], 4), "read_s_after": round(after[0], 4),
            "flood_store_s": round(flood_s, 2),
            "refused_over_quota": sum(n.stats()["sources"]["refused_over_quota"] for n in nodes),
            "one_replica_dropped": sum(n.stats()["sources"]["one_replica"] for n in readers),
        }
    finally:
        for node in [*attackers, *nodes]:
            await node.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--peers", type=int, default=2, help="peers per stage")
    p.add_argument("--batch", type=int, default=32, help="the swarm's target batch size")
    p.add_argument("--microbatch", type=int, default=8)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fakes", type=int, nargs="+", default=[50, 500])
    p.add_argument("--targets", nargs="+", default=["tarpit", "refuse"], choices=["tarpit", "refuse"])
    p.add_argument("--repeat", type=int, default=1, help="rounds of (clean, every flood); one more clean at the end")
    p.add_argument("--threads", type=int, default=1, help="torch threads per daemon")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--dht-nodes", type=int, default=20, help="nodes of the DHT-only flood (0: skip it)")
    p.add_argument("--dht-fakes", type=int, default=1000)
    p.add_argument("--dht-only", action="store_true", help="only the DHT-only flood")
    p.add_argument("--debug-missing", action="store_true", help="a real peer missing from /swarm: its log to stderr")
    args = p.parse_args()
    load_at_start = os.getloadavg()[0]
    dht = [asyncio.run(dht_flood(args.dht_nodes, 3, args.dht_fakes, sources)) for sources in (1, 4)
           if args.dht_nodes]
    if not args.json:
        for d in dht:
            print(f"DHT of {d['nodes']} nodes, {d['fakes']} fakes from {d['attacker_nodes']} node(s): real peers "
                  f"missing in {d['real_missing_reads']} reads, fakes listed per stage {d['fakes_listed_per_stage']}, "
                  f"stage read {d['read_s_before']} s -> {d['read_s_after']} s", flush=True)
    if args.dht_only:
        if args.json:
            print(strict_json_dumps({"dht": dht}))
        return
    plan: list[tuple[int, str | None]] = []
    for _ in range(args.repeat):
        plan.append((0, None))
        plan += [(n, t) for n in args.fakes for t in args.targets]
    plan.append((0, None))
    runs = []
    for fakes, target in plan:
        runs.append(asyncio.run(one(fakes, target, args)))
        if not args.json:
            r = runs[-1]
            print(f"{fakes:4d} fakes {target or 'none':7s}: {r['samples_per_s']:7.1f} samples/s, {r['steps']} steps, "
                  f"rounds ok {r['rounds_ok']}, real listed {r['real_listed']}, tarpit connections "
                  f"{r['tarpit_accepted']}", flush=True)
    clean = [r["samples_per_s"] for r in runs if r["fakes"] == 0]
    base = sum(clean) / len(clean)
    clean_steady = statistics.median(s for r in runs if r["fakes"] == 0 for s in r["step_s"][1:])
    for r in runs:
        r["ratio"] = round(r["samples_per_s"] / base, 3) if base else None
        r["first_step_s"] = r["step_s"][0] if r["step_s"] else None
        r["steady_ratio"] = round(clean_steady / statistics.median(r["step_s"][1:]), 3) if r["step_s"][1:] else None
    summary: dict[str, Any] = {}
    for fakes, target in sorted({(n, t) for n, t in plan if n}, key=str):
        same = [r for r in runs if (r["fakes"], r["target"]) == (fakes, target)]
        summary[f"{fakes} {target}"] = {
            "ratio_mean": round(statistics.mean(r["ratio"] for r in same), 3),
            "steady_ratio_mean": round(statistics.mean(r["steady_ratio"] for r in same if r["steady_ratio"]), 3),
            "first_step_s_mean": round(statistics.mean(r["first_step_s"] for r in same), 2),
        }
    flooded = [v["ratio_mean"] for v in summary.values()]
    report = {"load_average_1m": [round(load_at_start, 2), round(os.getloadavg()[0], 2)], "cpu_count": os.cpu_count(),
              "preset": args.preset, "stages": args.stages, "peers_per_stage": args.peers, "steps": args.steps,
              "target_batch": args.batch, "microbatch": args.microbatch, "window": args.window,
              "repeat": args.repeat, "clean_samples_per_s": clean,
              "clean_first_step_s": [r["step_s"][0] for r in runs if r["fakes"] == 0 and r["step_s"]],
              "dht": dht, "by_config": summary, "runs": runs, "min_ratio": min(flooded) if flooded else None,
              "target_ratio": 0.8, "target_met": bool(flooded) and min(flooded) >= 0.8}
    if args.json:
        print(strict_json_dumps(report))
    else:
        for config, v in summary.items():
            print(f"{config}: ratio {v['ratio_mean']}, steady-state ratio {v['steady_ratio_mean']}, "
                  f"first step {v['first_step_s_mean']} s")
        print(f"min ratio vs clean: {report['min_ratio']} (target >= 0.8: {report['target_met']})")


if __name__ == "__main__":
    main()
