"""``swarmd train``: run a trainer against a swarm from the command line.

The parser imports nothing heavy; the trainer (torch) and tqdm are imported once flags are valid.
:func:`run_trainer` is also what ``swarmd demo`` drives its trainer with.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmd.allocator import keep_freed_memory
from swarmd.cli import config_file
from swarmd.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_RUNTIME,
    EXIT_USAGE,
    Parser,
    add_log_level,
    add_text_source,
    api_url,
    load_swarm_key,
    non_negative_int,
    positive_int,
    read_token,
    seconds,
    setup_logging,
)
from swarmd.errors import ConfigError, SwarmdError
from swarmd.finite import strict_json_dumps

if TYPE_CHECKING:
    from swarmd.train.events import TrainerListener
    from swarmd.train.trainer import TrainerConfig, TrainSummary


def build_parser(prog: str = "swarmd train") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description="Train the swarm's model: route microbatches of text through its stages.",
        epilog=f"Example: {prog} --api http://127.0.0.1:8080 --steps 50",
    )
    config_file.add_config_option(p)
    p.add_argument("--api", type=api_url, default="http://127.0.0.1:8080", metavar="URL",
                   help="control plane of any daemon of the swarm, http://HOST:PORT or HOST:PORT "
                   "(default: http://127.0.0.1:8080)")
    p.add_argument("--api-token-file", default=None, metavar="FILE",
                   help="a file holding the daemon's control-plane token, if it has one")
    p.add_argument("--swarm-key", default=None, metavar="FILE",
                   help="a private swarm's key file (the one its daemons were given with --swarm-key): "
                   "the stages refuse requests not signed with it")
    add_text_source(p, data_help="a text file, .jsonl file or folder to train on, or a folder written by 'swarmd "
                    "data prepare' (streamed from its shards) (default: the Python standard library's sources)")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="the swarm's Hugging Face tokenizers JSON file (its digest must be the model's; default: "
                   "byte-level, or a prepared --data folder's own)")
    p.add_argument("--data-shards", type=positive_int, default=16, metavar="N",
                   help="cut the training data into N disjoint shards; an async trainer draws from one at a time, "
                        "starting at its own and moving on after one pass over it (default: 16)")
    p.add_argument("--shard", type=non_negative_int, default=None, metavar="K",
                   help="start on shard K of --data-shards (default: the rank the swarm hands this trainer)")
    p.add_argument("--lease-s", type=seconds, default=5.0, metavar="SECONDS",
                   help="this trainer's sample reservations expire this long after its last renewal, so a dead "
                   "trainer's samples are granted again (0.5-300; default: 5)")
    p.add_argument("--steps", type=positive_int, default=50, help="optimizer steps the swarm takes (default: 50)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="samples per step in --sync mode (default: the swarm's target_batch_size)")
    p.add_argument("--microbatch-size", type=positive_int, default=8, help="samples per microbatch (default: 8)")
    p.add_argument("--window", type=_window, default=None, metavar="N|auto",
                   help="microbatches in flight at once; auto: enough to keep the slowest stage busy, from the "
                   "compute and round trips this trainer measures (Little's law; swarmd.train.window) "
                   "(default: auto)")
    p.add_argument("--codec", choices=("none", "fp16", "bf16", "8bit", "4bit"), default="8bit",
                   help="how activations and their gradients travel between stages (default: 8bit)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="data order (default: 0)")
    p.add_argument("--sync", action="store_true",
                   help="one global batch per step, waiting for every stage to step (exact, slower)")
    p.add_argument("--val-every", type=non_negative_int, default=10,
                   help="steps between validation losses; 0: only at the end (default: 10)")
    p.add_argument("--stage-wait-timeout", type=seconds, default=120.0, metavar="SECONDS",
                   help="give up when a stage has had no live peer this long (default: 120)")
    p.add_argument("--verify-fraction", type=_fraction, default=0.02, metavar="F",
                   help="spot checks: run this share of microbatches paired (the same sample through other "
                   "peers of each stage too, as an ordinary microbatch) and compare; a peer caught lying is "
                   "banned and reported (default: 0.02; 0: off; a paired sample weighs twice in its step)")
    p.add_argument("--p2p", action="store_true",
                   help="peer to peer: a microbatch's activations go from stage to stage straight to the peers "
                   "this trainer picked, and with a sync trainer its gradients go back the same way, so only stage "
                   "0's backward result comes back (spot-checked pairs, relayed peers and failed hops go through the "
                   "trainer as without it; default: off)")
    p.add_argument("--json", action="store_true", help="print one JSON summary line at the end")
    p.add_argument("--log-csv", default=None, metavar="FILE",
                   help="write one CSV row per step (step, loss, samples/s, val loss); "
                   "plot it with scripts/plot_training.py FILE")
    add_log_level(p, "WARNING")
    return p


def _window(text: str) -> int | None:
    """``--window``: a positive number of microbatches, or ``auto`` (None)."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of microbatches (at least 1) or auto, got {text!r}")
    return value


def _fraction(text: str) -> float:
    """A share in [0, 1] (``--verify-fraction``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    """Map parsed flags onto the trainer's config; ConfigError for an unusable token, key, data or
    tokenizer file, or a --log-csv that cannot be written: every local input is checked here, before
    the trainer calls any daemon."""
    from swarmd.train.data import check_source
    from swarmd.train.trainer import TrainerConfig

    if args.shard is not None and args.shard >= args.data_shards:
        raise ConfigError(f"--shard {args.shard} is out of range: --data-shards {args.data_shards} gives shards "
                          f"0..{args.data_shards - 1}")
    if args.shard is not None and args.sync:
        raise ConfigError("--shard has no effect with --sync: a --sync trainer trains alone, on all of the data")
    check_source(args.data, tokenizer=args.tokenizer)
    if args.log_csv is not None and not Path(args.log_csv).expanduser().parent.is_dir():
        raise ConfigError(f"cannot write --log-csv {args.log_csv}: its folder does not exist")
    return TrainerConfig(
        api=args.api,
        api_token=read_token(Path(args.api_token_file)) if args.api_token_file else None,
        swarm_key=load_swarm_key(args.swarm_key),
        steps=args.steps,
        data=args.data,
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        batch_size=args.batch_size,
        microbatch_size=args.microbatch_size,
        codec=args.codec,
        seed=args.seed,
        window=args.window,
        sync=args.sync,
        val_every=args.val_every,
        stage_wait_timeout_s=args.stage_wait_timeout,
        data_shards=args.data_shards,
        shard=args.shard,
        lease_s=args.lease_s,
        verify_fraction=args.verify_fraction,
        p2p=args.p2p,
    )


#: The columns ``--log-csv`` writes (``scripts/plot_training.py`` reads them by name).
CSV_COLUMNS = ("step", "elapsed_s", "loss", "samples_per_s", "val_loss")


async def run_trainer(config: TrainerConfig, *, show_progress: bool = True, log_csv: Path | None = None,
                      events: TrainerListener | None = None) -> TrainSummary:
    """Run a Trainer with a tqdm bar (step, loss, samples/s, peers per stage, microbatches in flight) on
    stderr, and with ``log_csv`` one row per step (:data:`CSV_COLUMNS`; an undefined loss is an empty cell);
    ``events`` hears the trainer's typed events (``swarmd.train.events``: the demo narrates them)."""
    from tqdm import tqdm

    from swarmd.train.trainer import Trainer

    bar: tqdm[Any] | None = None  # drawn at the first step: a run that fails before it leaves one sentence
    started = time.monotonic()
    csv_file = log_csv.open("w", newline="") if log_csv is not None else None
    rows = csv.writer(csv_file) if csv_file is not None else None
    if rows is not None:
        rows.writerow(CSV_COLUMNS)

    def cell(value: float | None) -> str:
        return "" if value is None or not math.isfinite(value) else f"{value:.6g}"

    def on_step(step: int, loss: float, info: dict[str, Any]) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=config.steps, unit="step", disable=not show_progress, file=sys.stderr, dynamic_ncols=True)
        elapsed_s = time.monotonic() - started
        if rows is not None and csv_file is not None:
            rows.writerow([step, f"{elapsed_s:.3f}", cell(loss),
                           cell(info["samples"] / elapsed_s if elapsed_s else None), cell(info["val_loss"])])
            csv_file.flush()  # a run that dies still leaves its curve
        rate = info["samples"] / elapsed_s if elapsed_s else 0.0
        postfix = {"loss": f"{loss:.3f}", "samples/s": f"{rate:.0f}", "peers": "/".join(map(str, info["peers"])),
                   "window": str(info["window"])}
        if info["val_loss"] is not None:
            postfix["val"] = f"{info['val_loss']:.3f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(step - bar.n)

    try:
        return await Trainer(config, on_step=on_step, events=events).run()
    finally:
        if bar is not None:
            bar.close()
        if csv_file is not None:
            csv_file.close()


def main(argv: Sequence[str], prog: str = "swarmd train") -> int:
    args = config_file.parse_args(build_parser(prog), argv)
    setup_logging(args.log_level, args.log_format)
    keep_freed_memory()  # it encodes and decodes a microbatch's activations per call (swarmd.allocator)
    try:
        config = config_from_args(args)
        summary = asyncio.run(run_trainer(config, show_progress=sys.stderr.isatty() or not args.json,
                                          log_csv=Path(args.log_csv) if args.log_csv else None))
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # --log-csv cannot be written
        print(f"{prog}: error: cannot write --log-csv {args.log_csv}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except SwarmdError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if args.json:
        print(strict_json_dumps(summary.to_json()))
    else:
        print(f"trained {summary.steps} steps: loss {summary.first_loss:.4f} -> {summary.final_loss:.4f}, "
              f"validation {summary.val_loss:.4f}, {summary.samples_per_s:.1f} samples/s, "
              f"{summary.retries} retries, {summary.stale_redos} stale redos")
        from swarmd.train.verify import describe as describe_checks  # torch is loaded by now

        checks = describe_checks(summary.verify, summary.wire_bytes)
        if checks is not None:
            print(checks)
    return 0
