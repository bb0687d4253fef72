"""Traffic and latency of a stage's averaging round, per gradient codec (``--grad-codec``).

Bytes: the exact frames a round sends for one stage of the chosen preset (default ``small``):
a contributor sends one contribution (``POST /v1/average``) and receives one answer; the round's
leader receives ``n - 1`` contributions and sends ``n - 1`` answers, so its traffic grows as
``O(n * |grads|)``. HTTP headers (a few hundred bytes) are not counted.

Time: ``n`` in-process peers of that stage (real ``StageExecutor``, aiohttp data plane and
``StageAverager`` on 127.0.0.1, one event loop), each holding a random accumulated gradient;
the time from "every peer holds its share of the target batch" to "every peer has stepped",
median over ``--rounds`` rounds. It includes the averagers' progress polling (every 50 ms), the
encode/decode, the reduction, one optimizer step per peer, all on this machine's cores.

    .venv/bin/python scripts/bench_averaging.py                 # a table
    .venv/bin/python scripts/bench_averaging.py --json          # one JSON object
    .venv/bin/python scripts/bench_averaging.py --peers 2 4 --rounds 5 --preset small
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

import aiohttp
import torch

from swarmd.finite import strict_json_dumps
from swarmd.net.messages import AverageReply, AverageRequest
from swarmd.net.server import DataPlane
from swarmd.net.wire import WireLimits
from swarmd.pipeline.averaging import StageAverager
from swarmd.pipeline.executor import StageExecutor
from swarmd.pipeline.runtime import StageRuntime
from swarmd.pipeline.spec import GRAD_CODECS, PRESETS, TrainingSpec

TARGET = 32


def frame_bytes(numel: int, codec: str) -> dict[str, int]:
    grads = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    peer_id = "f" * 64  # a peer id's length
    contribution = AverageRequest(stage=0, peer_id=peer_id, step=12345, samples=8, grads=grads, codec=codec).encode()
    answer = AverageReply(stage=0, status="ok", step=12345, samples=32, contributors=4, grads=grads).encode(codec)
    return {"contribution": len(contribution), "answer": len(answer)}


async def time_rounds(spec: Any, n: int, codec: str, rounds: int) -> list[float]:
    training = TrainingSpec(target_batch_size=TARGET, grad_codec=codec, averaging_timeout_s=30.0)
    executors = [StageExecutor(spec, 0, "cpu", training=training, threads=1) for _ in range(n)]
    runtimes = [StageRuntime(ex) for ex in executors]
    planes = [DataPlane(lambda rt=rt: rt, limits=WireLimits()) for rt in runtimes]
    addrs = {}
    for i, plane in enumerate(planes):
        host, port = await plane.start("127.0.0.1", 0)
        addrs[f"{i:064x}"] = f"{host}:{port}"

    async def stage_peers(*, fresh: bool = False) -> dict[str, str]:
        return dict(addrs)

    session = aiohttp.ClientSession()
    averagers = [StageAverager(ex, peer_id=pid, stage_peers=stage_peers, session=session)
                 for ex, pid in zip(executors, addrs, strict=True)]
    for runtime, averager in zip(runtimes, averagers, strict=True):
        runtime.averager = averager
    tasks = [asyncio.create_task(a.run()) for a in averagers]
    gen = torch.Generator().manual_seed(1)
    took = []
    try:
        for r in range(rounds + 1):  # the first round warms up (imports bitsandbytes for 8bit)
            for ex in executors:
                flat = torch.randn(ex.grad_numel, generator=gen) * 1e-3
                await ex.add_gradients(flat, TARGET // n)
            started = time.perf_counter()
            while not all(ex.step == r + 1 for ex in executors):
                await asyncio.sleep(0.002)
            if r:
                took.append(time.perf_counter() - started)
        assert len({ex.digest for ex in executors}) == 1, "peers diverged"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for a in averagers:
            await a.close()
        await session.close()
        for plane in planes:
            await plane.close()
        for ex in executors:
            await ex.close()
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--peers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    spec = PRESETS[args.preset]  # its stage 0
    numel = StageExecutor(spec, 0, "cpu", threads=1).grad_numel
    out: dict[str, Any] = {"preset": args.preset, "grad_numel": numel, "target_batch_size": TARGET,
                           "cpus": os.cpu_count(), "torch": torch.__version__, "codecs": {}}
    for codec in GRAD_CODECS:
        b = frame_bytes(numel, codec)
        per_round = b["contribution"] + b["answer"]
        entry: dict[str, Any] = {
            "contribution_bytes": b["contribution"],
            "answer_bytes": b["answer"],
            "contributor_bytes_per_round": per_round,  # sent + received
            "leader_bytes_per_round": {str(n): (n - 1) * per_round for n in (2, 4, 8)},
            "round_s": {},
        }
        for n in args.peers:
            took = asyncio.run(time_rounds(spec, n, codec, args.rounds))
            entry["round_s"][str(n)] = {"median": round(statistics.median(took), 4), "min": round(min(took), 4),
                                        "max": round(max(took), 4)}
        out["codecs"][codec] = entry
    if args.json:
        print(strict_json_dumps(out, indent=2))
        print()
        return 0
    mib = 2**20
    print(f"preset {args.preset}, stage 0: {numel} gradient values; target batch {TARGET}")
    print(f"{'codec':6} {'contrib MiB':>11} {'answer MiB':>10} {'peer MiB/round':>14} "
          f"{'leader n=2/4/8 MiB':>20}  round time (median s) by peers")
    for codec, e in out["codecs"].items():
        leader = "/".join(f"{e['leader_bytes_per_round'][k] / mib:.1f}" for k in ("2", "4", "8"))
        times = ", ".join(f"n={n}: {v['median']:.3f}" for n, v in e["round_s"].items())
        print(f"{codec:6} {e['contribution_bytes'] / mib:11.2f} {e['answer_bytes'] / mib:10.2f} "
              f"{e['contributor_bytes_per_round'] / mib:14.2f} {leader:>20}  {times}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
