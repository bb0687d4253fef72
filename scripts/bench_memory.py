#!/usr/bin/env python
"""Memory over a run's length: does a trainer or a daemon grow as the steps go by?

    .venv/bin/python scripts/bench_memory.py --steps 2000 --every 250 --json

Starts a local swarm of ``--stages`` daemons (one per stage, subprocesses through the real CLI,
the ``tiny`` model), trains ``--steps`` steps in ``--sync`` mode with a trainer in this process,
and samples the resident memory (VmRSS) of the trainer's process and of every daemon every
``--every`` steps. Prints one JSON object: the samples, and each process's growth between the
first sample and the last. A trainer holds at most ``window`` microbatches in flight and a
daemon its stage's parameters, gradients, optimizer state and bounded caches, so neither should
grow with the run's length. Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd.finite import strict_json_dumps  # noqa: E402
from swarmd.local_swarm import DaemonProcess  # noqa: E402
from swarmd.train.trainer import Trainer, TrainerConfig  # noqa: E402


def _peer(index: int, workdir: Path, args: list[str]) -> DaemonProcess:
    """A daemon through the real CLI, its files peerN.json, peerN.log and peerN/ in ``workdir``."""
    return DaemonProcess(args, workdir, name=f"peer{index}")


def rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmRSS for {pid}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=250, help="sample every this many steps (default: 250)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--target-batch-size", type=int, default=16)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="swarmd-bench-memory-") as tmp:
        work = Path(tmp)
        founder = _peer(0, work, ["--model", "tiny", "--stage", "0", "--swarm", "bench-memory",
                                  "--target-batch-size", str(args.target_batch_size), "--log-level", "WARNING"])
        peers = [founder]
        try:
            founder.wait_ready()
            for k in range(1, args.stages):
                peers.append(_peer(k, work, ["--join", founder.info["dht_addr"], "--stage", str(k),
                                             "--swarm", "bench-memory", "--log-level", "WARNING"]))
            for peer in peers[1:]:
                peer.wait_ready()
            samples: list[dict[str, float]] = []

            def on_step(step: int, loss: float, info: dict) -> None:
                if step % args.every == 0 or step == args.steps:
                    row = {"step": step, "trainer_mb": rss_mb()}
                    row.update({f"stage{k}_mb": rss_mb(peer.proc.pid) for k, peer in enumerate(peers)})
                    samples.append(row)
                    if not args.json:
                        print(row, flush=True)

            config = TrainerConfig(api=f"http://{founder.info['api_addr']}", steps=args.steps, sync=True,
                                   microbatch_size=args.microbatch_size, window=args.window, val_every=0)
            asyncio.run(Trainer(config, on_step=on_step).run())
        finally:
            for peer in peers:
                peer.stop()
    first, last = samples[0], samples[-1]
    growth = {key: round(last[key] - first[key], 1) for key in first if key != "step"}
    result = {"steps": args.steps, "stages": args.stages, "window": args.window,
              "target_batch_size": args.target_batch_size, "samples": samples,
              "growth_mb_from_step": first["step"], "growth_mb": growth}
    print(strict_json_dumps(result) if args.json else strict_json_dumps(growth))


if __name__ == "__main__":
    main()
