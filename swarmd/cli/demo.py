"""``swarmd demo``: a local swarm that trains on real text, loses a peer, and heals.

It starts ``--stages`` x ``--peers`` daemons on 127.0.0.1 as subprocesses through the real CLI
(the first founds the swarm, the rest join it over the DHT), trains ``--model`` (default: the tiny
preset; ``--model llama-tiny`` for a Llama-style one, or a model file) on the Python
standard library's own sources with a trainer in this process, SIGKILLs one peer halfway, starts
a replacement that joins through the DHT and downloads its stage's state from a survivor, and
ends with a summary: the loss, what the kill cost, every peer's parameter digest (the peers
of a stage must agree), and a short sample of text from the trained model, assembled from the
swarm as ``swarmd export`` does. Ctrl-C, SIGTERM or any failure stops every child process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarmd.cli.common import EXIT_INTERRUPTED, EXIT_RUNTIME, EXIT_USAGE, Parser, load_swarm_key
from swarmd.errors import ConfigError
from swarmd.finite import strict_json_dumps
from swarmd.local_swarm import DaemonProcess, DaemonStartError, stop_all

MODEL = "tiny"  # the default --model


def build_parser(prog: str = "swarmd demo") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL, metavar="PRESET|FILE",
                   help="model preset (tiny, llama-tiny, small, ...) or a JSON model file (default: tiny)")
    p.add_argument("--stages", type=int, choices=range(1, 9), default=None, metavar="S",
                   help="pipeline stages (default: the model's, 2 for the presets)")
    p.add_argument("--peers", type=int, choices=range(1, 9), default=2, metavar="P",
                   help="peers per stage (default: 2)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps to train (default: 60)")
    p.add_argument("--target-batch-size", type=int, default=32, help="samples per step (default: 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    p.add_argument("--codec", choices=("none", "fp16", "bf16", "8bit"), default="8bit")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="let the trainer run ahead of the steps instead of one batch per step")
    p.add_argument("--delay-updates", action="store_true",
                   help="delayed parameter updates: peers keep serving while their stage averages")
    p.add_argument("--no-kill", action="store_true", help="do not kill and replace a peer halfway")
    p.add_argument("--swarm-key", default=None, metavar="FILE",
                   help="run a private swarm: every peer and the trainer get this key file (see 'swarmd --help')")
    p.add_argument("--json", action="store_true", help="print one JSON summary line at the end")
    p.add_argument("--out", type=Path, default=Path("swarmd-demo"), metavar="DIR",
                   help="where the run's training.csv and training.png (with matplotlib) are kept "
                   "(default: ./swarmd-demo)")
    return p


def main(argv: Sequence[str], prog: str = "swarmd demo") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.steps < 2 or args.target_batch_size < 1:
        print(f"{prog}: error: --steps must be at least 2 and --target-batch-size at least 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        args.swarm_key = load_swarm_key(args.swarm_key)  # checked before any peer starts
        args.spec = _demo_spec(args.model, args.stages)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    args.stages = args.spec.n_stages

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM cleans up the children exactly like Ctrl-C

    signal.signal(signal.SIGTERM, interrupt)
    peers: list[DaemonProcess] = []
    with tempfile.TemporaryDirectory(prefix="swarmd-demo-") as tmp:
        try:
            return asyncio.run(_demo(args, Path(tmp), peers))
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except DaemonStartError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return EXIT_RUNTIME
        finally:
            codes = stop_all(peers)
            if peers:
                why = (f"; {-signal.SIGKILL}: SIGKILLed, the peer killed halfway or one that did not drain in time"
                       if -signal.SIGKILL in codes else "")
                print(f"stopped {len(peers)} peer processes (exit codes {codes}{why})", file=sys.stderr)


def _demo_spec(model: str, stages: int | None) -> Any:
    """The model the demo trains: ``--model`` with ``--stages`` stages (its depth per stage kept)."""
    import dataclasses

    from swarmd.pipeline.spec import load_spec

    spec = load_spec(model)
    if stages is None or stages == spec.n_stages:
        return spec
    if spec.partition:
        raise ConfigError(f"model {spec.name!r} has a partition of {spec.n_stages} stages; --stages {stages} "
                          "would need another one (leave --stages out, or edit the model file)")
    return dataclasses.replace(spec, n_stages=stages)


def _say(text: str) -> None:
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)  # above the trainer's progress bar, not through it


def _peer(peers: list[DaemonProcess], workdir: Path, args: Sequence[str]) -> DaemonProcess:
    """Start peer number ``len(peers)`` (its files: peerN.json, peerN.log, peerN/) and keep it in ``peers``."""
    peer = DaemonProcess([*args, "--log-level", "INFO"], workdir, name=f"peer{len(peers)}")
    peers.append(peer)
    return peer


async def _demo(args: argparse.Namespace, workdir: Path, peers: list[DaemonProcess]) -> int:
    from swarmd.cli.train import run_trainer
    from swarmd.train.trainer import TrainerConfig

    common = ["--swarm", "demo", "--announce-period", "2"]
    if args.swarm_key is not None:
        common += ["--swarm-key", args.swarm_key.source]
    _say(f"starting a swarm of {args.stages} stages x {args.peers} peers on 127.0.0.1 through the swarmd CLI ...")
    from swarmd.pipeline.spec import load_spec

    model = args.model
    if args.spec != load_spec(args.model):  # --stages changed it: the founder gets the spec as a file
        model = str(workdir / "model.json")
        Path(model).write_text(json.dumps(args.spec.to_dict()), encoding="utf-8")
    founder = _peer(peers, workdir, [*common, "--model", model, "--stage", "0", "--target-batch-size",
                                     str(args.target_batch_size), "--lr", str(args.lr), "--averaging-timeout", "10",
                                     *(["--delay-updates"] if args.delay_updates else [])])
    await founder.wait_ready_async()
    join = [*common, "--join", founder.info["dht_addr"]]
    _say(f"  peer 0 founded swarm 'demo' (DHT udp://{founder.info['dht_addr']}) on stage 0")
    for i in range(1, args.stages * args.peers):
        _peer(peers, workdir, [*join, "--stage", str(i % args.stages)])
    await asyncio.gather(*(p.wait_ready_async() for p in peers[1:]))
    for p in peers[1:]:
        _say(f"  peer {p.name.removeprefix('peer')} joined with --join {founder.info['dht_addr']} "
             f"on stage {p.info['stage']}")

    config = TrainerConfig(api=founder.api, steps=args.steps, codec=args.codec,
                           microbatch_size=8, window=8, val_every=max(1, args.steps // 6), sync=not args.asynchronous,
                           swarm_key=args.swarm_key)
    kill_at = None if args.no_kill or args.peers < 2 else args.steps // 2
    victim = peers[-1] if kill_at is not None else None
    killed_at_step: list[int] = []

    async def watch_for_halfway() -> None:
        if victim is None or kill_at is None:
            return
        while True:
            await asyncio.sleep(0.2)
            step = await asyncio.to_thread(lambda: min(_step_of(p) for p in peers if p.running()))
            if step >= kill_at:
                break
        victim.kill()
        killed_at_step.append(step)
        _say(f"\n>>> step {step}: SIGKILL peer {victim.name.removeprefix('peer')} (stage {victim.info['stage']}); "
             "training goes on through its stage-mates")
        new = _peer(peers, workdir, [*join, "--stage", str(victim.info["stage"])])
        await new.wait_ready_async()
        st = await new.status_async()
        _say(f">>> replacement peer {new.name.removeprefix('peer')} joined stage {st['stage']} over the DHT "
             f"and downloaded its state (step {st['step']}) from peer {str(st['synced_from'])[:12]}\n")

    _say(f"\ntraining the {args.spec.name} model ({args.spec.arch}, {args.spec.n_layers} blocks in stages of "
         f"{list(args.spec.blocks_per_stage)}) on the Python standard library's sources "
         f"({args.codec} activations, {args.target_batch_size} samples per step) ...")
    _say(f"while it trains, the dashboard of every peer shows the swarm live, e.g. {founder.api}/ (or run "
         f"swarmd status --api {founder.api}); the peers stop when the demo ends")
    watcher = asyncio.create_task(watch_for_halfway())
    started = time.monotonic()
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = await run_trainer(config, log_csv=args.out / "training.csv")
    finally:
        if not watcher.done():
            watcher.cancel()
        (outcome,) = await asyncio.gather(watcher, return_exceptions=True)
        if isinstance(outcome, Exception):
            _say(f"(the kill-and-replace step failed: {outcome!r})")
    elapsed = time.monotonic() - started

    alive = [p for p in peers if p.running()]
    statuses = await asyncio.to_thread(_settled, alive)
    by_stage: dict[int, set[str]] = {}
    for st in statuses:
        by_stage.setdefault(st["stage"], set()).add(st["params_digest"])
    identical = all(len(d) == 1 for d in by_stage.values())
    _say("")
    _say(f"trained {summary.steps} steps in {elapsed:.0f}s: loss {summary.first_loss:.3f} -> {summary.final_loss:.3f}, "
         f"validation loss {summary.val_loss:.3f}")
    _say(f"microbatches issued {summary.microbatches_issued}, completed {summary.microbatches_completed}, "
         f"retries {summary.retries}, stale redos {summary.stale_redos}, top-ups {summary.topup_microbatches}, "
         f"{summary.samples_per_s:.0f} samples/s")
    for st in sorted(statuses, key=lambda s: (s["stage"], s["peer_id"])):
        _say(f"  stage {st['stage']} peer {st['peer_id'][:12]}: step {st['step']}, params {st['params_digest'][:16]}"
             + (f" (state downloaded from {st['synced_from'][:12]})" if st["synced_from"] else ""))
    _say("the peers of every stage hold identical parameters" if identical
         else "WARNING: peers of a stage disagree on their parameters")
    _say(_plot(args.out / "training.csv"))
    sample = await _sample(founder.api, args.swarm_key)
    if sample is not None:
        _say(f"\na sample of what the swarm learned (swarmd export, then swarmd generate --prompt 'def '):\n{sample}")
    if args.json:
        print(strict_json_dumps({**summary.to_json(), "killed_at_step": killed_at_step[0] if killed_at_step else None,
                                 "identical_params": identical, "peers": len(alive)}))
    return 0 if identical else 1


def _plot(csv_path: Path) -> str:
    """The run's curves as a PNG beside its CSV (``swarmd.train.plot``), when matplotlib is there."""
    from swarmd.train.plot import have_matplotlib, plot_training

    if not have_matplotlib():
        return f"per-step loss in {csv_path} (install matplotlib for a PNG: pip install 'swarmd[plot]')"
    png = plot_training(csv_path, csv_path.with_suffix(".png"), title="swarmd demo")
    return f"training curves: {png} (per-step numbers in {csv_path})"


async def _sample(api: str, swarm_key: Any, prompt: str = "def ", tokens: int = 160) -> str | None:
    """The trained model assembled from the live swarm (as ``swarmd export`` does) and a short sample."""
    from swarmd.errors import SwarmdError
    from swarmd.export import from_swarm
    from swarmd.generate import sample_text

    try:
        model = await from_swarm(api, swarm_key=swarm_key)
    except SwarmdError as exc:
        _say(f"(could not assemble the model for a sample: {exc})")
        return None
    return await asyncio.to_thread(sample_text, model.to_full_model(), prompt, tokens, temperature=0.7, seed=0)


def _settled(alive: list[DaemonProcess], timeout_s: float = 15.0) -> list[dict[str, Any]]:
    """Every live peer's /status once the peers of each stage are at one step (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = [p.status() for p in alive]
        steps: dict[int, set[int]] = {}
        for st in statuses:
            steps.setdefault(st["stage"], set()).add(st["step"])
        if all(len(s) == 1 for s in steps.values()) or time.monotonic() > deadline:
            return statuses
        time.sleep(0.2)


def _step_of(peer: DaemonProcess) -> int:
    """A peer's step, 0 while its control plane does not answer (killed, starting)."""
    try:
        return int(peer.status()["step"])
    except (OSError, KeyError, TypeError, ValueError):  # URLError and timeouts are OSErrors
        return 0
