"""Peer-to-peer forwards and backwards against trainer-mediated ones, side by side on the same daemons (issue #31).

For each ``--stages`` count, one daemon per stage is started through the real CLI
(``swarmd.local_swarm.DaemonProcess``, loopback, one torch thread each), and the same sync trainer
(``Trainer``, codec ``--codec``, untapered, spot checks off so every microbatch may go peer to peer)
trains ``--warmup`` + ``--steps`` steps through them, alternately without and with ``p2p``
(``--rounds`` times each, in that order, on the same daemons, which keep training: each run starts
where the last one left the swarm). Each run is timed from the end of its warm-up step to the end of
its last step (as ``bench_gpipe.py``), and reports:

- ``samples_per_s``: samples completed in that window over its wall time;
- ``trainer_bytes_per_microbatch``: the bytes the trainer's data-plane client sent and received in the
  window (frames and JSON bodies as counted by ``DataPlaneClient.bytes_sent`` / ``bytes_received``, i.e.
  the request and response bodies on its sockets, HTTP headers not counted: a few hundred bytes a call),
  over the microbatches completed in it; ``sent`` and ``received`` separately;
- ``p2p_hops`` / ``p2p_fallbacks`` / ``p2p_backwards``: forwards that went peer to peer, hops that failed,
  and backwards run in the backward chain.

The report gives, per stage count, the median of each mode's runs and the ratios p2p / trainer-mediated
(samples/s and bytes), and the load average before and after. With p2p, a forward goes from stage 0 to
stage S-2 peer to peer, on to the last stage's fused forward and backward (sent by the peer of stage
S-2), and back: each peer runs its stage's backward with the gradient the stage after it answered (the
backward chain), so only stage 0's backward result comes back to the trainer, and its bytes per
microbatch are the token ids and targets out and the chain's meta both ways (a hop, a forward's result
and a backward's result per stage: tens of bytes each), whatever the number of stages; without p2p they
grow by two activations and two gradients per extra stage.

    .venv/bin/python scripts/bench_p2p.py --json
    .venv/bin/python scripts/bench_p2p.py --model small --stages 2 4 --steps 3 --rounds 2 --json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmd.finite import strict_json_dumps
from swarmd.local_swarm import DaemonProcess, stopping

SEED = 0
CORPUS_BYTES = 8 * 2**20


@dataclass(frozen=True)
class Settings:
    model: str = "tiny"
    stages: tuple[int, ...] = (2, 4)
    steps: int = 3
    warmup: int = 2
    rounds: int = 2
    batch_size: int = 32
    microbatch_size: int = 8
    window: int = 4
    codec: str = "none"

    def spec(self, stages: int) -> Any:
        """The preset with ``stages`` stages of its ``layers_per_stage`` blocks, cut equally."""
        from swarmd.pipeline.spec import PRESETS
        from swarmd.pipeline.spec_files import with_partition

        return with_partition(dataclasses.replace(PRESETS[self.model], n_stages=stages), "equal")


@dataclass
class Window:
    """The trainer's own view between the end of warm-up step W and the end of step W + N."""

    warmup: int
    last: int
    trainer: Any = None
    open: bool = False
    t0: float = 0.0
    t1: float = 0.0
    samples: tuple[int, int] = (0, 0)
    microbatches: tuple[int, int] = (0, 0)
    sent: tuple[int, int] = (0, 0)
    received: tuple[int, int] = (0, 0)

    def _counts(self) -> tuple[int, int, int]:
        client = self.trainer.calls.client
        return self.trainer.summary.microbatches_completed, client.bytes_sent, client.bytes_received

    def observe(self, event: Any) -> None:
        from swarmd.train.events import StepDone

        if not isinstance(event, StepDone):
            return
        if event.done == self.warmup:
            mbs, sent, received = self._counts()
            self.open, self.t0 = True, event.at
            self.samples, self.microbatches = (int(event.progress["samples"]), 0), (mbs, 0)
            self.sent, self.received = (sent, 0), (received, 0)
        elif event.done == self.last and self.open:
            mbs, sent, received = self._counts()
            self.open, self.t1 = False, event.at
            self.samples = (self.samples[0], int(event.progress["samples"]))
            self.microbatches, self.sent, self.received = ((self.microbatches[0], mbs), (self.sent[0], sent),
                                                           (self.received[0], received))


async def train(s: Settings, api: str, p2p: bool) -> dict[str, Any]:
    from swarmd.train.trainer import Trainer, TrainerConfig

    window = Window(warmup=s.warmup, last=s.warmup + s.steps)
    config = TrainerConfig(api=api, steps=s.warmup + s.steps, batch_size=s.batch_size,
                           microbatch_size=s.microbatch_size, codec=s.codec, seed=SEED, window=s.window, sync=True,
                           val_every=0, max_corpus_bytes=CORPUS_BYTES, name="bench-p2p", taper=False,
                           verify_fraction=0.0, p2p=p2p)
    trainer = Trainer(config, events=window.observe)
    window.trainer = trainer
    summary = await trainer.run()
    if window.t1 == 0.0:
        raise RuntimeError(f"the trainer finished without reaching step {window.last}")
    wall = window.t1 - window.t0
    microbatches = window.microbatches[1] - window.microbatches[0]
    sent, received = window.sent[1] - window.sent[0], window.received[1] - window.received[0]
    return {
        "p2p": p2p,
        "samples_per_s": (window.samples[1] - window.samples[0]) / wall,
        "window_s": wall,
        "microbatches": microbatches,
        "trainer_bytes_per_microbatch": (sent + received) / microbatches,
        "trainer_sent_bytes_per_microbatch": sent / microbatches,
        "trainer_received_bytes_per_microbatch": received / microbatches,
        "p2p_hops": summary.p2p_hops,
        "p2p_fallbacks": summary.p2p_fallbacks,
        "p2p_backwards": summary.p2p_backwards,
        "inputs_recovered": summary.inputs_recovered,
        "retries": summary.retries,
        "stale_redos": summary.stale_redos,
        "issued_equals_completed": summary.microbatches_issued == summary.microbatches_completed,
    }


def run_stages(s: Settings, stages: int, workdir: Path) -> dict[str, Any]:
    import torch

    from swarmd.allocator import keep_freed_memory

    model_file = workdir / f"model{stages}.json"
    model_file.write_text(json.dumps(s.spec(stages).to_dict()))
    daemons: list[DaemonProcess] = []
    runs: list[dict[str, Any]] = []
    with stopping(daemons):
        for k in range(stages):
            args = ["--host", "127.0.0.1", "--dht-host", "127.0.0.1", "--api-host", "127.0.0.1", "--swarm",
                    f"bench-p2p{stages}", "--device", "cpu", "--drain-timeout", "5", "--log-level", "WARNING",
                    "--announce-period", "2", "--rebalance-policy", "none", "--stage", str(k)]
            args += (["--model", str(model_file), "--target-batch-size", str(s.batch_size)] if k == 0
                     else ["--join", daemons[0].info["dht_addr"]])
            daemons.append(DaemonProcess(args, workdir, name=f"s{stages}-stage{k}", env={"OMP_NUM_THREADS": "1"},
                                         threads=1))
            if k == 0:
                daemons[0].wait_ready(300)
        for d in daemons[1:]:
            d.wait_ready(300)
        torch.set_num_threads(1)  # the trainer only samples, encodes and decodes
        keep_freed_memory()
        api = f"http://{daemons[0].info['api_addr']}"
        for _ in range(s.rounds):
            for p2p in (False, True):
                runs.append(asyncio.run(train(s, api, p2p)))

    def median(p2p: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["p2p"] == p2p)

    keys = ("samples_per_s", "trainer_bytes_per_microbatch", "trainer_sent_bytes_per_microbatch",
            "trainer_received_bytes_per_microbatch")
    off = {k: median(False, k) for k in keys}
    on = {k: median(True, k) for k in keys}
    return {
        "stages": stages,
        "trainer_mediated": off,
        "p2p": on,
        "ratio_samples_per_s": on["samples_per_s"] / off["samples_per_s"],
        "ratio_trainer_bytes_per_microbatch": on["trainer_bytes_per_microbatch"] / off["trainer_bytes_per_microbatch"],
        "runs": runs,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="tiny", help="a preset (default: tiny)")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="stage counts to run (default: 2 4)")
    p.add_argument("--steps", type=int, default=3, help="timed sync steps per run (default: 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them, at least 1 (default: 2)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating (default: 2)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--microbatch-size", type=int, default=8)
    p.add_argument("--window", type=int, default=4, help="the trainer's microbatches in flight (default: 4)")
    p.add_argument("--codec", choices=("none", "fp16", "bf16", "8bit", "4bit"), default="none")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    if a.warmup < 1 or a.steps < 1 or a.rounds < 1 or min(a.stages) < 2:
        p.error("--warmup, --steps and --rounds must be at least 1, and every --stages at least 2")
    s = Settings(model=a.model, stages=tuple(a.stages), steps=a.steps, warmup=a.warmup, rounds=a.rounds,
                 batch_size=a.batch_size, microbatch_size=a.microbatch_size, window=a.window, codec=a.codec)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-p2p-") as tmp:
        results = [run_stages(s, n, Path(tmp)) for n in s.stages]
    report = {"settings": dataclasses.asdict(s), "results": results, "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "cpu_count": os.cpu_count()}
    if a.json:
        print(strict_json_dumps(report))
    else:
        for r in results:
            off, on = r["trainer_mediated"], r["p2p"]
            print(f"{r['stages']} stages: samples/s {off['samples_per_s']:.1f} -> {on['samples_per_s']:.1f} "
                  f"(x{r['ratio_samples_per_s']:.2f}); trainer bytes/microbatch "
                  f"{off['trainer_bytes_per_microbatch']:.0f} -> {on['trainer_bytes_per_microbatch']:.0f} "
                  f"(x{r['ratio_trainer_bytes_per_microbatch']:.2f})")
        print(f"load average before {load_before}, after {report['load_average_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
