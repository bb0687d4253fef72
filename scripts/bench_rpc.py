"""Data-plane RPC speed: one transformer block served over loopback against the same block run locally.

The work of hivemind's RemoteExpert benchmark: one pre-norm transformer block (``d_model`` 512,
8 heads, ``d_ff`` 2048), a microbatch of 4 x 256 hidden states, a forward RPC followed by its
backward RPC, one microbatch after the other (nothing overlaps), with the activations and
gradients sent as ``8bit`` (and ``none`` and ``fp16``). The block is swarmd's own stage: a
middle stage of a 3-stage custom ``ModelSpec`` with one layer per stage (no embedding, no
head), computed by a real :class:`~swarmd.pipeline.stage.executor.StageExecutor` behind a real
aiohttp :class:`~swarmd.net.server.DataPlane` on 127.0.0.1, and called with
:class:`~swarmd.net.client.DataPlaneClient` exactly as the trainer calls it: the forward names
its microbatch (``mb``), so the backward hits the activation cache and sends back ``step``.

The baseline is the same block (``build_stage``, the same deterministic parameters) computed in
this process: ``out = block(x)``, ``out.backward(grad)``, the input gradient read, parameter
gradients accumulating as they do on the peer.

    ratio = RPC samples/s / local samples/s            (per codec; 1.0 = the RPC costs nothing)

Threads: the machine's cores are shared by the baseline and the served stage, so they never
run at the same time: every round runs the baseline once and each codec's RPC once, in a
rotating order, and the medians over ``--rounds`` rounds are compared. Both computations use
``--threads`` torch threads (default: every core): the baseline on this thread, the stage on
its worker thread (``StageExecutor(threads=...)``). The client's and the server's codec work
runs in the same process, on their own threads, so everything the RPC costs is on the clock.

Noise: the report gives process CPU time per microbatch next to wall time (an RPC that waits
idle shows as wall time without CPU time) and ``other_processes_cpu_cores``, the CPU the rest of
the machine used per second of the run (``/proc/stat`` minus this process). Above ~0.1 the
wall-time ratios are unreliable: two torch threads on two shared cores wait for each other at
every kernel. ``--threads 1`` is far less sensitive to that.

    .venv/bin/python scripts/bench_rpc.py                      # a table
    .venv/bin/python scripts/bench_rpc.py --json               # one JSON object
    .venv/bin/python scripts/bench_rpc.py --threads 1 --rounds 10 --codecs 8bit
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

from swarmd.finite import strict_json_dumps
from swarmd.net.client import DataPlaneClient
from swarmd.net.server import DataPlane
from swarmd.net.wire import DEFAULT_LIMITS
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.model import build_stage
from swarmd.pipeline.stage.runtime import StageRuntime
from swarmd.pipeline.spec import ModelSpec, TrainingSpec

STAGE = 1  # the middle stage: one block, hidden states in and out
# Gradients accumulate for the whole run (no averaging round steps the stage), so the target
# batch is simply the largest the spec allows.
TRAINING = TrainingSpec(target_batch_size=2**24)


def block_spec(d_model: int = 512, n_heads: int = 8, d_ff: int = 2048, seq_len: int = 256) -> ModelSpec:
    """Three stages of one block each; stage 1 is a bare pre-norm block."""
    return ModelSpec(name=f"bench-block-{d_model}", d_model=d_model, n_heads=n_heads, d_ff=d_ff,
                     layers_per_stage=1, n_stages=3, seq_len=seq_len)


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has used (user + nice + system + irq + softirq + steal)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    busy = fields[0] + fields[1] + fields[2] + sum(fields[5:8])
    return busy / os.sysconf("SC_CLK_TCK")


class LocalBlock:
    """The baseline: the same stage module, forward + backward in this thread."""

    def __init__(self, spec: ModelSpec, x: torch.Tensor, grad: torch.Tensor) -> None:
        self.module = build_stage(spec, STAGE)
        self.x, self.grad = x, grad

    def run(self) -> torch.Tensor:
        leaf = self.x.detach().requires_grad_(True)
        out = self.module(leaf)
        out.backward(self.grad)
        if leaf.grad is None:
            raise RuntimeError("the local backward left no input gradient")
        return leaf.grad


class RemoteBlock:
    """The same stage served by a real data plane and called over 127.0.0.1."""

    def __init__(self, spec: ModelSpec, x: torch.Tensor, grad: torch.Tensor, threads: int) -> None:
        self.executor = StageExecutor(spec, STAGE, "cpu", training=TRAINING, threads=threads)
        self.runtime = StageRuntime(self.executor)
        self.plane = DataPlane(lambda: self.runtime, limits=DEFAULT_LIMITS)
        self.client = DataPlaneClient()
        self.x, self.grad = x, grad
        self.addr = ""
        self._ids = random.Random(0)

    async def __aenter__(self) -> RemoteBlock:
        host, port = await self.plane.start("127.0.0.1", 0)
        self.addr = f"{host}:{port}"
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self.plane.close()
        await self.executor.close()

    async def run(self, codec: str) -> torch.Tensor:
        """One microbatch: forward then backward, as the trainer sends them."""
        mb = self._ids.getrandbits(64)
        fwd = await self.client.forward(self.addr, STAGE, self.x, codec=codec, mb=mb)
        bwd = await self.client.backward(self.addr, STAGE, self.x, self.grad, codec=codec, step=fwd.step, mb=mb)
        if bwd.grad_inputs is None or bwd.grad_inputs.shape != self.x.shape:
            raise RuntimeError("the backward reply carries no input gradient of the input's shape")
        return bwd.grad_inputs


async def measure(spec: ModelSpec, batch: int, codecs: list[str], rounds: int, warmup: int,
                  threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, spec.seq_len, spec.d_model, generator=gen)
    grad = torch.randn(batch, spec.seq_len, spec.d_model, generator=gen) * 1e-3
    local = LocalBlock(spec, x, grad)
    wall: dict[str, list[float]] = {arm: [] for arm in ["local", *codecs]}
    cpu: dict[str, list[float]] = {arm: [] for arm in wall}
    async with RemoteBlock(spec, x, grad, threads) as remote:
        with torch.no_grad():  # a sanity check: the served block is the local block
            if not torch.equal((await remote.client.forward(remote.addr, STAGE, x)).outputs, local.module(x)):
                raise RuntimeError("the served stage and the local one disagree")
        order = list(wall)
        started_other, started_own, started = machine_cpu_s(), time.process_time(), time.perf_counter()
        for r in range(warmup + rounds):
            order = order[1:] + order[:1]  # rotate: no arm always runs right after another
            for arm in order:
                t0, c0 = time.perf_counter(), time.process_time()
                if arm == "local":
                    local.run()
                else:
                    await remote.run(arm)
                if r >= warmup:
                    wall[arm].append(time.perf_counter() - t0)
                    cpu[arm].append(time.process_time() - c0)
        elapsed = time.perf_counter() - started
        other = (machine_cpu_s() - started_other - (time.process_time() - started_own)) / elapsed
        cache = remote.executor.cache_stats()
    local_wall, local_cpu = statistics.median(wall["local"]), statistics.median(cpu["local"])
    result: dict[str, Any] = {
        "local": {"samples_per_s": round(batch / local_wall, 3), "wall_s_per_mb": round(local_wall, 5),
                  "cpu_s_per_mb": round(local_cpu, 5)},
        "rpc": {},
        "activation_cache": {k: cache[k] for k in ("hits", "misses", "skipped")},
        "other_processes_cpu_cores": round(max(other, 0.0), 3),
    }
    for codec in codecs:
        med_wall, med_cpu = statistics.median(wall[codec]), statistics.median(cpu[codec])
        result["rpc"][codec] = {
            "samples_per_s": round(batch / med_wall, 3),
            "wall_s_per_mb": round(med_wall, 5),
            "cpu_s_per_mb": round(med_cpu, 5),
            "ratio": round(local_wall / med_wall, 3),
            "cpu_ratio": round(local_cpu / med_cpu, 3),
            # the same ratio taken within each round, then the median: robust to slow phases
            "paired_ratio": round(statistics.median(a / b for a, b in zip(wall["local"], wall[codec], strict=True)), 3),
        }
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codecs", nargs="+", default=["none", "fp16", "8bit"], choices=["none", "fp16", "bf16", "8bit"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    spec = block_spec(args.d_model, max(1, args.d_model // 64), 4 * args.d_model, args.seq)
    out: dict[str, Any] = {
        "block": {"d_model": spec.d_model, "n_heads": spec.n_heads, "d_ff": spec.d_ff, "seq": spec.seq_len,
                  "batch": args.batch},
        "threads": args.threads, "rounds": args.rounds, "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "aiohttp": importlib.metadata.version("aiohttp"), "python": sys.version.split()[0],
    }
    out.update(asyncio.run(measure(spec, args.batch, args.codecs, args.rounds, args.warmup, args.threads)))
    if args.json:
        print(strict_json_dumps(out, indent=2))
        print()
        return 0
    loc = out["local"]
    print(f"block d={spec.d_model} seq={spec.seq_len} batch={args.batch}, {args.threads} torch thread(s), "
          f"{args.rounds} rounds; other processes used {out['other_processes_cpu_cores']} cores")
    print(f"{'':6} {'samples/s':>10} {'wall ms/mb':>11} {'cpu ms/mb':>10} {'ratio':>6} {'paired':>7} {'cpu ratio':>9}")
    print(f"{'local':6} {loc['samples_per_s']:10.2f} {loc['wall_s_per_mb'] * 1e3:11.1f} "
          f"{loc['cpu_s_per_mb'] * 1e3:10.1f}")
    for codec, e in out["rpc"].items():
        print(f"{codec:6} {e['samples_per_s']:10.2f} {e['wall_s_per_mb'] * 1e3:11.1f} {e['cpu_s_per_mb'] * 1e3:10.1f} "
              f"{e['ratio']:6.3f} {e['paired_ratio']:7.3f} {e['cpu_ratio']:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
