"""Wire bytes per trained sample against held-out loss, for each way of compressing a swarm's traffic.

Issue 30, item 4. SWARM (Ryabinin et al., 2023) hides communication behind compute only when the
bytes at each stage boundary are small against the stage's compute (the square-cube law); its
Appendix I asks whether compression-aware architecture helps smaller models. This script trains the
same model on the same data for the same number of steps in each configuration and reports, per
configuration:

- ``bytes_per_sample``: the bytes of every ``/v1/forward``, ``/v1/backward`` and ``/v1/average``
  request and reply body (all stage boundaries both ways, the trainer's relayed activations and
  gradients, the stateless backward's resent inputs, and the stage-mates' gradient averaging),
  counted by each daemon's data-plane byte counters (``swarmd_data_plane_{received,sent}_bytes``:
  every data-plane message has exactly one daemon as its server, so each is counted once),
  read just after the last training step and before the trainer's final validation, divided by
  the samples trained (steps x batch). Bodies only: HTTP headers (a few hundred bytes per request)
  are not in it. The split into boundary and averaging bytes, and the token ids' share, are in
  each result's ``detail``;
- ``heldout_loss``: the trainer's final validation (``--val-batches`` microbatches of the corpus's
  held-out split, the same in every configuration of a seed), computed *through the swarm* with the
  configuration's activation codec: the loss the compressed swarm actually serves;
- ``reduction_vs_fp32`` and ``loss_gap_vs_fp32``: against the ``fp32`` configuration (no codec,
  no bottleneck), means over ``--seeds`` (``g`` relative: 0.03 is 3% worse).

A run is **disturbed** when a stage's round came up short (a contribution timed out or was refused,
and the trainer topped the step up with more samples) or a peer downloaded its stage's state
(``/v1/state``: it fell behind and adopted a stage-mate's parameters): it then trained something
else than its seed's other runs at equal steps, and on a loaded machine that happens to any
configuration, fp32 included. ``--retries K`` runs a disturbed run again (up to K times); the means
leave a disturbed run out where its configuration has a clean run of the same seed, and each result
says how many of its runs were disturbed (``disturbed_runs``) and lists those left out
(``left_out``), so a codec that disturbs its runs shows it.

Each run is a real swarm: ``--peers-per-stage`` daemons per stage started through the CLI
(``swarmd.local_swarm``), one founder with the model file and ``--grad-codec``, the others joining,
and a :class:`~swarmd.train.trainer.Trainer` in this process in sync mode (``--batch-size`` samples
per step, spot checks off: ``--verify-fraction 0`` traffic is not compression's subject). A
configuration names its activation codec (``TrainerConfig.codec``: activations forward and their
gradients backward), its gradient codec (``TrainingSpec.grad_codec``, with error feedback for the
quantizing codecs: ``8bit``, ``4bit``, ``3bit``, ``2bit``, ``5level``) and its boundary width
(``ModelSpec.boundary_dim``: ``bottleneck`` is ``d_model / 4`` or ``--boundary-dim``,
``bottleneck/8`` is ``d_model / 8``).

    .venv/bin/python scripts/bench_compression.py --json                      # tiny, 2 seeds
    .venv/bin/python scripts/bench_compression.py --model small --seeds 0 --steps 30
    .venv/bin/python scripts/bench_compression.py --configs fp32 4bit bottleneck+4bit
    .venv/bin/python scripts/bench_compression.py --json --merge seeds01.json seed2.json   # one table
    .venv/bin/python scripts/bench_compression.py --json --no-baseline --configs 4bit > more.json  # fp32 elsewhere

JSON: ``{"results": [{"config", "bytes_per_sample", "reduction_vs_fp32", "heldout_loss",
"loss_gap_vs_fp32", ...}], "settings": {...}, "load_average": [...]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmd.finite import strict_json_dumps
from swarmd.local_swarm import DaemonProcess, stop_all
from swarmd.pipeline.spec import PRESETS, ModelSpec
from swarmd.train.events import StepDone, TrainerEvent
from swarmd.train.trainer import Trainer, TrainerConfig


@dataclass(frozen=True)
class Setup:
    """One configuration: activation codec, gradient codec, bottleneck (0: none; k: d_model / k
    wide, or ``--boundary-dim`` for k = 4)."""

    codec: str
    grad_codec: str
    bottleneck: int = 0


CONFIGS: dict[str, Setup] = {
    "fp32": Setup("none", "none"),
    "fp16": Setup("fp16", "fp16"),
    "8bit": Setup("8bit", "8bit"),
    "4bit": Setup("4bit", "4bit"),
    "bottleneck": Setup("none", "none", bottleneck=4),
    "bottleneck+8bit": Setup("8bit", "8bit", bottleneck=4),
    "bottleneck+4bit": Setup("4bit", "4bit", bottleneck=4),
    "bottleneck/8+4bit": Setup("4bit", "4bit", bottleneck=8),
    # averaging's own bytes cut too: 2-bit gradients with error feedback (issue 30)
    "4bit+grad3bit": Setup("4bit", "3bit"),
    "bottleneck+4bit+grad3bit": Setup("4bit", "3bit", bottleneck=4),
    "bottleneck/8+4bit+grad3bit": Setup("4bit", "3bit", bottleneck=8),
    "4bit+grad2bit": Setup("4bit", "2bit"),
    "bottleneck+4bit+grad2bit": Setup("4bit", "2bit", bottleneck=4),
    "bottleneck/8+4bit+grad2bit": Setup("4bit", "2bit", bottleneck=8),
    # five levels with a zero: 2.58 bits a value, and error feedback cannot amplify it
    "4bit+grad5level": Setup("4bit", "5level"),
    "bottleneck+4bit+grad5level": Setup("4bit", "5level", bottleneck=4),
    "bottleneck/8+4bit+grad5level": Setup("4bit", "5level", bottleneck=8),
}
BASELINE = "fp32"
BOUNDARY = ("/v1/forward", "/v1/backward")
AVERAGING = ("/v1/average",)
STATE = "/v1/state"
CORPUS_BYTES = 4 << 20
_METRIC = re.compile(r'^swarmd_data_plane_(received|sent)_bytes_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def data_plane_bytes(api: str) -> dict[str, int]:
    """Request plus reply body bytes by data-plane endpoint, from a daemon's ``/metrics``."""
    with urllib.request.urlopen(f"{api}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
        endpoint = labels.get("endpoint", "other")
        out[endpoint] = out.get(endpoint, 0) + int(float(m.group("value")))
    return out


class Counters:
    """The trainer's listener: reads every daemon's byte counters once the last step is done
    (blocking, on purpose: in sync mode nothing else runs at that moment, and the final
    validation has not started)."""

    def __init__(self, daemons: list[DaemonProcess], last: int) -> None:
        self.daemons = daemons
        self.last = last
        self.bytes: dict[str, int] | None = None
        self.samples = 0
        self.losses: list[float] = []

    def observe(self, event: TrainerEvent) -> None:
        if not isinstance(event, StepDone):
            return
        if event.loss is not None:
            self.losses.append(event.loss)
        if event.done == self.last:
            self.samples = int(event.progress.get("samples", 0))
            total: dict[str, int] = {}
            for d in self.daemons:
                for endpoint, n in data_plane_bytes(d.api).items():
                    total[endpoint] = total.get(endpoint, 0) + n
            self.bytes = total


def spec_for(args: argparse.Namespace, setup: Setup, seed: int) -> ModelSpec:
    base = PRESETS[args.model]
    if not setup.bottleneck:
        dim = 0
    elif setup.bottleneck == 4 and args.boundary_dim:
        dim = args.boundary_dim
    else:
        dim = base.d_model // setup.bottleneck
    return dataclasses.replace(base, name=f"bench-{args.model}", seed=seed, boundary_dim=dim)


async def one_run(args: argparse.Namespace, name: str, setup: Setup, seed: int, workdir: Path) -> dict[str, Any]:
    """Start a swarm for ``setup``, train ``args.steps`` steps, stop it; bytes, samples and losses."""
    spec = spec_for(args, setup, seed)
    model_file = workdir / "model.json"
    model_file.write_text(json.dumps(spec.to_dict()))
    common = ["--swarm", f"bench-{name}", "--device", "cpu", "--announce-period", "2", "--drain-timeout", "5",
              "--log-level", "WARNING"]
    founder = DaemonProcess([*common, "--model", str(model_file), "--stage", "0", "--target-batch-size",
                             str(args.batch_size), "--grad-codec", setup.grad_codec, "--lr", str(args.lr),
                             "--warmup-steps", str(args.warmup_steps)],
                            workdir, name="peer0", threads=args.threads)
    daemons = [founder]
    try:
        await founder.wait_ready_async()
        for i in range(1, spec.n_stages * args.peers_per_stage):
            daemons.append(DaemonProcess([*common, "--join", founder.info["dht_addr"], "--stage",
                                          str(i % spec.n_stages)], workdir, name=f"peer{i}", threads=args.threads))
        await asyncio.gather(*(d.wait_ready_async() for d in daemons[1:]))
        # joiners download their stage's state when they join: only what comes after counts as disturbing
        state_before = sum(data_plane_bytes(d.api).get(STATE, 0) for d in daemons)
        counters = Counters(daemons, args.steps)
        config = TrainerConfig(api=founder.api, steps=args.steps, batch_size=args.batch_size,
                               microbatch_size=args.microbatch_size, codec=setup.codec, seed=seed, sync=True,
                               window=args.window, val_every=0, val_batches=args.val_batches,
                               max_corpus_bytes=CORPUS_BYTES, name="bench", verify_fraction=0.0)
        started = time.monotonic()
        summary = await Trainer(config, events=counters.observe).run()
        wall = time.monotonic() - started
    finally:
        await asyncio.to_thread(stop_all, daemons)
    if counters.bytes is None or summary.val_loss is None:
        raise RuntimeError(f"{name} seed {seed}: the run ended before step {args.steps} or without a validation")
    by_endpoint = counters.bytes
    boundary = sum(by_endpoint.get(e, 0) for e in BOUNDARY)
    averaging = sum(by_endpoint.get(e, 0) for e in AVERAGING)
    samples = counters.samples or args.steps * args.batch_size
    state = by_endpoint.get(STATE, 0) - state_before
    return {
        "seed": seed,
        "samples": samples,
        # a stage's round short of samples (the trainer topped the step up) or a peer that downloaded
        # its stage's state mid-run: the run trained something else than the others at equal steps
        "disturbed": samples != args.steps * args.batch_size or state > 0,
        "state_bytes": state,  # /v1/state during training (a peer that fell behind), not at join
        "bytes": boundary + averaging,
        "boundary_bytes": boundary,
        "averaging_bytes": averaging,
        "other_data_plane_bytes": sum(by_endpoint.values()) - boundary - averaging,
        "heldout_loss": summary.val_loss,
        "final_train_loss": counters.losses[-1] if counters.losses else None,
        "step_losses": [round(x, 4) for x in counters.losses],
        "wall_s": round(wall, 1),
    }


def token_bytes_per_sample(spec: ModelSpec) -> int:
    """Token-id bytes a trained sample sends (never compressed; in the narrowest integer dtype
    holding the vocabulary, ``swarmd.net.token_ids``): the first stage's forward inputs (its
    backward omits the inputs it kept) and the last stage's targets with its fused forward +
    backward, ``seq_len`` ids each."""
    width = 1 if spec.vocab_size <= 256 else 2 if spec.vocab_size <= 2**15 else 4
    return 2 * spec.seq_len * width


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for name in args.configs:
        for seed in args.seeds:
            for attempt in range(1 + args.retries):
                with tempfile.TemporaryDirectory(prefix="swarmd-bench-compression-") as tmp:
                    try:
                        run = await one_run(args, name, CONFIGS[name], seed, Path(tmp))
                    finally:
                        if args.keep_logs:
                            keep = args.keep_logs / f"{name.replace('/', '_')}-seed{seed}-{attempt}"
                            keep.mkdir(parents=True, exist_ok=True)
                            for log in Path(tmp).glob("*.log"):
                                shutil.copy(log, keep / log.name)
                runs.setdefault(name, []).append(run)
                print(f"{name} seed {seed}: {run['bytes'] / run['samples']:.0f} B/sample, held-out loss "
                      f"{run['heldout_loss']:.4f} ({run['wall_s']}s){' DISTURBED' if run['disturbed'] else ''}",
                      file=sys.stderr, flush=True)
                if not run["disturbed"]:
                    break
    return summarize(runs, args)


def summarize(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    """Means over seeds, against the fp32 runs; ``loss_gap_per_seed`` pairs each run with fp32's of its seed."""
    disturbed = {name: [r for r in rs if r.get("disturbed")] for name, rs in runs.items()}
    if not args.keep_disturbed:  # leave out disturbed runs where the configuration has a clean one for the seed
        runs = {name: [r for r in rs if not r.get("disturbed")
                       or not any(c["seed"] == r["seed"] and not c.get("disturbed") for c in rs)]
                for name, rs in runs.items()}
    base = runs.get(BASELINE) or []
    base_by_seed = {seed: statistics.mean(r["heldout_loss"] for r in base if r["seed"] == seed)
                    for seed in {r["seed"] for r in base}}
    base_bps_by_seed = {seed: statistics.mean(r["bytes"] / r["samples"] for r in base if r["seed"] == seed)
                        for seed in base_by_seed}
    results = []
    for name, rs in runs.items():
        def per_sample(key: str, rs: list[dict[str, Any]] = rs) -> float:
            return round(statistics.mean(r[key] / r["samples"] for r in rs), 1)

        bps = statistics.mean(r["bytes"] / r["samples"] for r in rs)
        loss = statistics.mean(r["heldout_loss"] for r in rs)
        # against fp32 of the same seeds (all of fp32's where it has none of them)
        paired = sorted({r["seed"] for r in rs} & set(base_by_seed)) or sorted(base_by_seed)
        base_bps = statistics.mean(base_bps_by_seed[seed] for seed in paired) if paired else None
        base_loss = statistics.mean(base_by_seed[seed] for seed in paired) if paired else None
        setup = CONFIGS[name]
        spec = spec_for(args, setup, args.seeds[0])
        results.append({
            "config": name,
            "bytes_per_sample": round(bps, 1),
            "reduction_vs_fp32": round(base_bps / bps, 2) if base_bps else None,
            "heldout_loss": round(loss, 4),
            "loss_gap_vs_fp32": round((loss - base_loss) / base_loss, 4) if base_loss else None,
            "detail": {
                "activation_codec": setup.codec, "grad_codec": setup.grad_codec,
                "boundary_dim": spec.boundary_dim or None,
                "boundary_bytes_per_sample": per_sample("boundary_bytes"),
                "averaging_bytes_per_sample": per_sample("averaging_bytes"),
                "token_id_bytes_per_sample": token_bytes_per_sample(spec),
                "heldout_loss_per_seed": [round(r["heldout_loss"], 4) for r in rs],
                "loss_gap_per_seed": [round((r["heldout_loss"] - base_by_seed[r["seed"]]) / base_by_seed[r["seed"]], 4)
                                      for r in rs if r["seed"] in base_by_seed],
                "heldout_loss_stdev": (round(statistics.stdev(r["heldout_loss"] for r in rs), 4)
                                       if len(rs) > 1 else None),
                "runs": rs,
                "disturbed_runs": len(disturbed[name]),
                "left_out": [r for r in disturbed[name] if r not in rs],
            },
        })
    return {
        "results": results,
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "merge", "keep_logs")},
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--microbatch-size", type=int, default=8)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--peers-per-stage", type=int, default=2)
    p.add_argument("--boundary-dim", type=int, default=0, help="bottleneck width (default: d_model / 4)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads per daemon")
    p.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                   help="run nothing: summarize the runs of earlier --json outputs together (e.g. other seeds)")
    p.add_argument("--retries", type=int, default=0,
                   help="run a disturbed run (short rounds or a state download) again, up to this many times")
    p.add_argument("--keep-disturbed", action="store_true",
                   help="average disturbed runs in even where the seed has a clean run (default: left out, listed)")
    p.add_argument("--keep-logs", type=Path, metavar="DIR", help="copy each run's daemon logs under DIR")
    p.add_argument("--no-baseline", action="store_true",
                   help=f"do not add {BASELINE!r} to --configs (its runs come from another JSON, with --merge)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if BASELINE not in args.configs and not args.no_baseline:
        args.configs.insert(0, BASELINE)
    if args.merge:
        runs: dict[str, list[dict[str, Any]]] = {}
        for path in args.merge:
            data = json.loads(path.read_text())
            expected = data["settings"]["steps"] * data["settings"]["batch_size"]
            for r in data["results"]:
                for run in r["detail"]["runs"] + r["detail"].get("left_out", []):
                    run.setdefault("disturbed", run["samples"] != expected)  # JSON from before the flag
                    runs.setdefault(r["config"], []).append(run)
        args.configs = list(runs)
        args.seeds = sorted({r["seed"] for rs in runs.values() for r in rs})
        result = summarize(runs, args)
        result["merged"] = [str(path) for path in args.merge]
    else:
        result = asyncio.run(run_all(args))
    if args.json or result["results"][0]["reduction_vs_fp32"] is None:
        print(strict_json_dumps(result))
        return
    print(f"{'config':32} {'B/sample':>10} {'reduction':>9} {'held-out':>9} {'gap':>8}")
    for r in result["results"]:
        print(f"{r['config']:32} {r['bytes_per_sample']:10.0f} {r['reduction_vs_fp32']:8.2f}x "
              f"{r['heldout_loss']:9.4f} {r['loss_gap_vs_fp32']:+8.2%}")
    print(f"load average: {result['load_average']}")


if __name__ == "__main__":
    main()
