"""Traffic, control requests and latency of a stage's averaging round, per mode and stage size.

``n`` in-process peers of one stage of the chosen preset (default ``small``, stage 0): real
``StageExecutor``, aiohttp data plane and averager (``leader``: ``StageAverager``; ``allreduce``:
``AllReduceAverager``), one event loop. Peer ``i`` listens on its own loopback address
``127.0.0.<i + 2>`` and dials from it, so every socket belongs to one peer by its local address.

Bytes are *measured*: every byte the peer's sockets hand to the kernel (``transport.write``) and
every byte they read (the aiohttp protocols' ``data_received``), HTTP headers included, counted
per peer for each round. ``max_peer_bytes_per_round`` is the largest, over peers and rounds, of
``max(bytes sent, bytes received)`` by one peer in one round (each direction is a link's capacity);
``max_peer_bytes_total_per_round`` the largest sent + received. ``gradient_bytes`` (G) is the
stage's gradient as float32 (4 bytes a value, whatever the codec).

Control requests: HTTP requests of the averaging protocol that carry no gradients (``GET
/v1/progress``, ``GET /v1/proof``, and the all-reduce's ``report``, ``ready``, ``decision``),
counted by every client session's request trace, summed over peers, per round: a mean over the
measured rounds, each from "every peer holds its share of the batch" to "every peer stepped", plus
the idle time in between (the leader's stage keeps polling while it waits).

``owner_bytes_held_max`` (all-reduce): the most bytes one peer's part owners still hold once the rounds are
over (decoded slices and members' signed frames, kept for the owners of its last 16 rounds).

Time: that interval, median over ``--rounds`` rounds (the first, warming up, is not counted).
``cpu_s_per_peer_round_median``: this process's CPU time from the round's start until its audits' fetches ended (every thread: the
codec and digest work runs off the loop), divided by ``n``: what one peer of a round costs its machine.
All ``n`` peers share this machine's cores, so the round's time grows with ``n`` here whatever the
protocol; the CPU a peer spends says what the round would take with a machine per peer.

    .venv/bin/python scripts/bench_averaging.py --json
    .venv/bin/python scripts/bench_averaging.py --peers 2 4 --modes allreduce --rounds 3 --preset tiny
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import aiohttp
import torch
from aiohttp import client_proto, web_protocol

from swarmd.dht.identity import Identity
from swarmd.finite import strict_json_dumps
from swarmd.net.server import DataPlane
from swarmd.net.wire import WireLimits
from swarmd.pipeline.averaging.allreduce.averager import AllReduceAverager
from swarmd.pipeline.averaging.averager import StageAverager
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.stage.runtime import StageRuntime
from swarmd.pipeline.spec import GRAD_CODECS, PRESETS, TrainingSpec

TARGET = 32  # a multiple of every n below 32 would be neater; each peer holds TARGET // n (+1 for the rest)
ROUND_LIMIT_S = 180.0
DEBUG = False
CONTROL_PATHS = ("/v1/progress", "/v1/proof", "/v1/allreduce/report", "/v1/allreduce/ready", "/v1/allreduce/decision")

SENT: Counter[str] = Counter()  # by local IP
RECEIVED: Counter[str] = Counter()
CONTROL: Counter[str] = Counter()  # by path


def _local_ip(transport: Any) -> str:
    name = transport.get_extra_info("sockname") if transport is not None else None
    return str(name[0]) if name else "?"


def install_counters() -> None:
    """Count every byte through every socket of this process, by the socket's local address."""
    import asyncio.selector_events as se

    write = se._SelectorSocketTransport.write

    def counted_write(self: Any, data: Any) -> None:
        SENT[_local_ip(self)] += len(data)
        write(self, data)

    se._SelectorSocketTransport.write = counted_write  # type: ignore[method-assign]
    for cls in (client_proto.ResponseHandler, web_protocol.RequestHandler):
        received = cls.data_received

        def counted(self: Any, data: bytes, _received: Any = received) -> Any:
            RECEIVED[_local_ip(self.transport)] += len(data)
            return _received(self, data)

        cls.data_received = counted  # type: ignore[method-assign]


async def _trace_request(session: Any, ctx: Any, params: aiohttp.TraceRequestStartParams) -> None:
    path = params.url.path
    if path in CONTROL_PATHS:
        CONTROL[path] += 1


def _held_by_owners(averager: AllReduceAverager) -> int:
    """Bytes a peer's part owners still hold after the rounds: decoded slices and the members' signed frames."""
    return sum(sum(len(f) for f in o.frames.values())
               + sum(g.numel() * g.element_size() for _, g in o.parts.values() if g is not None)
               for o in averager.owners.values())


async def run_mode(spec: Any, n: int, mode: str, codec: str, rounds: int,
                   audit_share: float | None = None) -> dict[str, Any]:
    training = TrainingSpec(target_batch_size=TARGET, grad_codec=codec, averaging_timeout_s=60.0, averaging=mode)
    executors = [StageExecutor(spec, 0, "cpu", training=training, threads=1) for _ in range(n)]
    runtimes = [StageRuntime(ex) for ex in executors]
    planes = [DataPlane(lambda rt=rt: rt, limits=WireLimits()) for rt in runtimes]
    addrs: dict[str, str] = {}
    ips: list[str] = []
    sessions: list[aiohttp.ClientSession] = []
    identities: list[Identity] = []
    for i, plane in enumerate(planes):
        ip = f"127.0.0.{i + 2}"
        host, port = await plane.start(ip, 0)
        identities.append(Identity.generate())
        addrs[identities[-1].peer_id] = f"{host}:{port}"
        ips.append(ip)
        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(_trace_request)
        sessions.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(ip, 0), limit=0),
                                              trace_configs=[trace]))

    async def stage_peers(*, fresh: bool = False) -> dict[str, str]:
        return dict(addrs)

    kind = AllReduceAverager if mode == "allreduce" else StageAverager
    averagers = [kind(ex, peer_id=ident.peer_id, stage_peers=stage_peers, session=s, identity=ident)
                 for ex, ident, s in zip(executors, identities, sessions, strict=True)]
    for runtime, averager in zip(runtimes, averagers, strict=True):
        runtime.averager = averager
        if isinstance(averager, AllReduceAverager) and audit_share is not None:
            averager.auditor.share = audit_share
    tasks = [asyncio.create_task(a.run()) for a in averagers]
    gen = torch.Generator().manual_seed(1)
    took, peak, peak_total, control, cpu = [], 0, 0, [], []
    by_path: Counter[str] = Counter()  # control requests of the measured rounds, by path
    try:
        for r in range(rounds + 1):  # the first round warms up (connections, imports)
            for i, ex in enumerate(executors):
                flat = torch.randn(ex.grad_numel, generator=gen) * 1e-3
                await ex.add_gradients(flat, TARGET // n + (1 if i < TARGET % n else 0))
            sent0, recv0, ctl0 = Counter(SENT), Counter(RECEIVED), Counter(CONTROL)
            started, cpu0 = time.perf_counter(), time.process_time()
            while not all(ex.step == r + 1 for ex in executors):
                if time.perf_counter() - started > ROUND_LIMIT_S:
                    raise RuntimeError(f"{mode} n={n}: round {r} did not complete in {ROUND_LIMIT_S:.0f}s")
                await asyncio.sleep(0.002)
            elapsed = time.perf_counter() - started
            # an audit's piece (all-reduce) moves its bytes after the step: counted in its round
            while any(getattr(a, "auditor", None) is not None and a.auditor.fetching for a in averagers):
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.05)  # the last answers' bytes
            if not r:
                continue
            took.append(elapsed)
            cpu.append((time.process_time() - cpu0) / n)
            for ip in ips:
                s, rcv = SENT[ip] - sent0[ip], RECEIVED[ip] - recv0[ip]
                peak, peak_total = max(peak, s, rcv), max(peak_total, s + rcv)
            control.append(sum((CONTROL - ctl0).values()))
            by_path.update(CONTROL - ctl0)
        if DEBUG:
            for a in averagers:
                print(a.peer_id[:6], [(h["step"], h["status"], h.get("reason")) for h in a.history],
                      sorted(getattr(a, "members", {})), file=sys.stderr)
        if len({ex.digest for ex in executors}) != 1:
            raise RuntimeError("peers diverged")
        held = [_held_by_owners(a) for a in averagers if isinstance(a, AllReduceAverager)]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for a in averagers:
            await a.close()
        for s in sessions:
            await s.close()
        for plane in planes:
            await plane.close()
        for ex in executors:
            await ex.close()
    grad_bytes = executors[0].grad_numel * 4
    audits = sum(a.auditor.counts["drawn"] for a in averagers if isinstance(a, AllReduceAverager))
    return {"peers": n, "mode": mode, "codec": codec, "gradient_bytes": grad_bytes,
            **({"audit_share": averagers[0].auditor.share, "audits": audits}
               if isinstance(averagers[0], AllReduceAverager) else {}),
            "max_peer_bytes_per_round": peak, "max_peer_bytes_total_per_round": peak_total,
            "ratio_to_gradient": round(peak / grad_bytes, 3),
            "control_requests_per_round": round(statistics.mean(control), 1),
            "control_requests_per_round_by_path": {k.rsplit("/", 1)[-1]: round(v / len(control), 1)
                                                   for k, v in sorted(by_path.items())},
            **({"owner_bytes_held_max": max(held)} if held else {}),
            "round_s_median": round(statistics.median(took), 4),
            "cpu_s_per_peer_round_median": round(statistics.median(cpu), 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--modes", nargs="+", default=["leader", "allreduce"], choices=["leader", "allreduce"])
    p.add_argument("--codecs", nargs="+", default=["none"], choices=GRAD_CODECS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--audit-share", type=float, nargs="+", default=[None],
                   help="the all-reduce's share of commits audited (default: the daemon's, audit.AUDIT_SHARE); "
                        "several: each measured")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if max(args.peers) > 250:
        p.error("at most 250 peers (one loopback address each)")
    install_counters()
    spec = replace(PRESETS[args.preset])  # its stage 0
    results = []
    for codec in args.codecs:
        for mode in args.modes:
            for n in args.peers:
                for share in (args.audit_share if mode == "allreduce" else [None]):
                    results.append(asyncio.run(run_mode(spec, n, mode, codec, args.rounds, share)))
                    if not args.json:
                        print(results[-1], flush=True)
    out = {"preset": args.preset, "target_batch_size": TARGET, "rounds": args.rounds, "torch": torch.__version__,
           "results": results}
    if args.json:
        print(strict_json_dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
