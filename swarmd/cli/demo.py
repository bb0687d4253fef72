"""``swarmd demo``: a local swarm that trains on real text, loses a peer, and heals.

It starts ``--stages`` x ``--peers`` daemons on 127.0.0.1 as subprocesses through the real CLI
(the first founds the swarm, the rest join it over the DHT), trains ``--model`` (default: the tiny
preset; ``--model llama-tiny`` for a Llama-style one, or a model file) on the Python
standard library's own sources with a trainer in this process, SIGKILLs one peer halfway, starts
a replacement that joins through the DHT and downloads its stage's state from a survivor, and
ends with a summary: the loss, what the kill cost, every peer's parameter digest (the peers
of a stage must agree), and a short sample of text from the trained model, assembled from the
swarm as ``swarmd export`` does. Ctrl-C, SIGTERM or any failure stops every child process.

It tells what happens in a newcomer's words (peer numbers, not ids; "sent again to peer 1", not
the trainer's protocol terms): the trainer's own log goes to ``--out``/trainer.log, and the demo
narrates from the trainer's typed events (``swarmd.train.events``) and its summary instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarmd.cli.common import EXIT_INTERRUPTED, EXIT_RUNTIME, EXIT_USAGE, Parser, load_swarm_key
from swarmd.errors import ConfigError, SwarmdError
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
    p.add_argument("--codec", choices=("none", "fp16", "bf16", "8bit", "4bit"), default="8bit")
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
        except (DaemonStartError, SwarmdError) as exc:  # a peer that did not start; a trainer that gave up
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return EXIT_RUNTIME
        finally:
            codes = stop_all(peers)
            if peers:
                clean = sum(code == 0 for code in codes)
                killed = sum(code == -signal.SIGKILL for code in codes)
                other = len(codes) - clean - killed
                print(f"stopped the {len(peers)} peers: {clean} shut down cleanly"
                      + (f", {killed} had been killed (the one killed halfway, or one that did not stop in time)"
                         if killed else "")
                      + (f", {other} exited with an error (exit codes {codes})" if other else ""), file=sys.stderr)


def _demo_spec(model: str, stages: int | None) -> Any:
    """The model the demo trains: ``--model`` with ``--stages`` stages (its depth per stage kept)."""
    import dataclasses

    from swarmd.pipeline.spec_files import load_spec

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


def _number(peers: list[DaemonProcess], peer_id: str | None) -> str:
    """``peer 3`` for the demo's peer with that id (its start order), the id's head for another."""
    for i, p in enumerate(peers):
        if p.info.get("peer_id") == peer_id:
            return f"peer {i}"
    return f"peer {str(peer_id)[:12]}"


class Narrator:
    """The trainer's events after the kill, told in plain words (a listener of ``swarmd.train.events``):
    the first call to the victim's stage that needed another try is the trainer routing around the
    dead peer, and the first step taken afterwards is the swarm going on without it."""

    def __init__(self, peers: list[DaemonProcess]) -> None:
        self.peers = peers
        self.victim: DaemonProcess | None = None
        self.killed_at = 0.0  # time.perf_counter(), as the events' times
        self.killed_step = 0  # the swarm's step when it died: later steps were taken without it
        self.rerouted = False
        self.stepped = False

    def killed(self, victim: DaemonProcess, step: int) -> None:
        self.victim, self.killed_at, self.killed_step = victim, time.perf_counter(), step

    def __call__(self, event: Any) -> None:
        from swarmd.train.events import CallDone, StepDone

        victim = self.victim
        if victim is None:
            return
        stage, name = victim.info["stage"], _number(self.peers, victim.info["peer_id"])
        if isinstance(event, CallDone) and not self.rerouted and event.attempts > 1 and event.stage == stage:
            self.rerouted = True
            _say(f">>> the trainer's requests to {name} went unanswered; it sent them again to "
                 f"{_number(self.peers, event.peer_id)}, another peer of stage {stage}")
        elif isinstance(event, StepDone) and not self.stepped and event.step >= self.killed_step:
            self.stepped = True
            mates = [_number(self.peers, p.info["peer_id"]) for p in self.peers
                     if p is not victim and p.info.get("stage") == stage and p.running()]
            _say(f">>> {event.at - self.killed_at:.0f} s after {name} died, the swarm took its next step without it"
                 + (f"; stage {stage} runs on {' and '.join(mates)} until a new peer is ready" if mates else ""))


def _peer(peers: list[DaemonProcess], workdir: Path, args: Sequence[str]) -> DaemonProcess:
    """Start peer number ``len(peers)`` (its files: peerN.json, peerN.log, peerN/) and keep it in ``peers``."""
    peer = DaemonProcess([*args, "--log-level", "INFO"], workdir, name=f"peer{len(peers)}")
    peers.append(peer)
    return peer


async def _demo(args: argparse.Namespace, workdir: Path, peers: list[DaemonProcess]) -> int:
    from swarmd.cli.train import run_trainer
    from swarmd.train.trainer import TrainerConfig

    args.out.mkdir(parents=True, exist_ok=True)
    trainer_log = args.out / "trainer.log"  # the trainer's own warnings; the demo says what happened itself
    logging.basicConfig(filename=trainer_log, filemode="w", level=logging.INFO,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    common = ["--swarm", "demo", "--announce-period", "2"]
    if args.swarm_key is not None:
        common += ["--swarm-key", args.swarm_key.source]
    _say(f"starting a swarm of {args.stages} stages x {args.peers} peers on 127.0.0.1 through the swarmd CLI ...")
    from swarmd.pipeline.spec_files import load_spec

    model = args.model
    if args.spec != load_spec(args.model):  # --stages changed it: the founder gets the spec as a file
        model = str(workdir / "model.json")
        Path(model).write_text(json.dumps(args.spec.to_dict()), encoding="utf-8")
    founder = _peer(peers, workdir, [*common, "--model", model, "--stage", "0", "--target-batch-size",
                                     str(args.target_batch_size), "--lr", str(args.lr), "--averaging-timeout", "10",
                                     *(["--delay-updates"] if args.delay_updates else [])])
    await founder.wait_ready_async()
    join = [*common, "--join", founder.info["dht_addr"]]
    _say(f"  peer 0 founded the swarm and serves stage 0; others find it at {founder.info['dht_addr']} (its DHT)")
    for i in range(1, args.stages * args.peers):
        _peer(peers, workdir, [*join, "--stage", str(i % args.stages)])
    await asyncio.gather(*(p.wait_ready_async() for p in peers[1:]))
    for p in peers[1:]:
        _say(f"  peer {p.name.removeprefix('peer')} joined through --join {founder.info['dht_addr']} and serves "
             f"stage {p.info['stage']}")
    first_stage = {p.info["peer_id"]: p.info["stage"] for p in peers}

    config = TrainerConfig(api=founder.api, steps=args.steps, codec=args.codec,
                           microbatch_size=8, window=8, val_every=max(1, args.steps // 6), sync=not args.asynchronous,
                           swarm_key=args.swarm_key)
    kill_at = None if args.no_kill or args.peers < 2 else args.steps // 2
    victim = peers[-1] if kill_at is not None else None
    killed_at_step: list[int] = []
    narrator = Narrator(peers)

    async def watch_for_halfway() -> None:
        if victim is None or kill_at is None:
            return
        while True:
            await asyncio.sleep(0.2)
            step = await asyncio.to_thread(lambda: min(_step_of(p) for p in peers if p.running()))
            if step >= kill_at:
                break
        victim.kill()
        narrator.killed(victim, step)
        killed_at_step.append(step)
        name = _number(peers, victim.info["peer_id"])
        _say(f"\n>>> step {step}: {name} (stage {victim.info['stage']}) is killed without warning (SIGKILL), as when "
             "a volunteer's machine dies; a new peer is started, to serve the stage that needs it most")
        new = _peer(peers, workdir, [*join, "--stage", "auto"])  # where the swarm is short by then
        await new.wait_ready_async()
        st = await new.status_async()
        _say(f">>> {_number(peers, st['peer_id'])} joined stage {st['stage']} through the DHT, copied the stage's "
             f"parameters as of step {st['step']} from {_number(peers, st['synced_from'])}, and serves from "
             "there\n")

    _say(f"\ntraining the {args.spec.name} model ({args.spec.arch}, {args.spec.n_layers} blocks in stages of "
         f"{list(args.spec.blocks_per_stage)}) on the Python standard library's sources "
         f"({args.codec} activations, {args.target_batch_size} samples per step) ...")
    _say(f"while it trains, the dashboard of every peer shows the swarm live, e.g. {founder.api}/ (or run "
         f"swarmd status --api {founder.api}); the peers stop when the demo ends")
    watcher = asyncio.create_task(watch_for_halfway())
    started = time.monotonic()
    try:
        summary = await run_trainer(config, log_csv=args.out / "training.csv", events=narrator)
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
    _say(f"trained {summary.steps} steps in {elapsed:.0f}s: the loss fell from {summary.first_loss:.3f} to "
         f"{summary.final_loss:.3f} (on held-out text: {summary.val_loss:.3f}), {summary.samples_per_s:.0f} samples/s")
    for line in _what_the_churn_cost(summary):
        _say(line)
    for st in sorted(statuses, key=lambda s: (s["stage"], _number(peers, s["peer_id"]))):
        moved = first_stage.get(st["peer_id"])
        _say(f"  {_number(peers, st['peer_id'])}, stage {st['stage']}: step {st['step']}, parameters "
             f"{st['params_digest'][:16]}"
             + (f" (moved here from stage {moved} by the swarm's rebalancing)" if moved not in (None, st["stage"])
                else "")
             + (f" (last copied its stage's state from {_number(peers, st['synced_from'])})"
                if st["synced_from"] and moved in (None, st["stage"]) else ""))
    _say("the peers of every stage hold identical parameters, as they must" if identical
         else "WARNING: peers of a stage disagree on their parameters")
    _say(_plot(args.out / "training.csv") + f"; the trainer's log: {trainer_log}")
    sample = await _sample(founder.api, args.swarm_key)
    if sample is not None:
        _say(f"\na sample of what the swarm learned (swarmd export, then swarmd generate --prompt 'def '):\n{sample}")
    if args.json:
        print(strict_json_dumps({**summary.to_json(), "killed_at_step": killed_at_step[0] if killed_at_step else None,
                                 "identical_params": identical, "peers": len(alive)}))
    return 0 if identical else 1


def _what_the_churn_cost(summary: Any) -> list[str]:
    """The trainer's counters (``TrainSummary``) as sentences; zero counters say nothing."""
    done, sent = summary.microbatches_completed, summary.microbatches_issued
    lines = [f"the trainer sent {sent} batches of samples through the pipeline and "
             + ("every one came back, none lost" if done == sent else f"{done} of them came back")]
    if summary.retries:
        lines.append(f"  {summary.retries} request(s) failed on a dead or busy peer and were sent to another peer of "
                     "the same stage")
    if summary.topup_microbatches:
        lines.append(f"  {summary.topup_microbatches} extra batch(es) replaced the work the killed peer took with it, "
                     "so that every step still averaged a full batch")
    if summary.stale_redos:
        lines.append(f"  {summary.stale_redos} batch(es) were computed again because their stage had taken a step "
                     "meanwhile (a gradient is only ever applied to the parameters it was computed with)")
    return lines


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
