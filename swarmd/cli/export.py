"""``swarmd export``: the trained model as one safetensors file, from the live swarm or from checkpoints.

``swarmd export --api URL --out model.safetensors`` downloads every stage's state from a serving
peer (through any daemon's control plane); ``swarmd export --from DIR [DIR ...] --out FILE``
assembles the newest valid checkpoint of each stage found in those state directories.
Either checks every stage's parameters against its digest (``swarmd.export``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from swarmd.cli.common import (
    EXIT_RUNTIME,
    Parser,
    add_log_level,
    api_url,
    fail_usage,
    load_swarm_key,
    read_token,
    setup_logging,
)
from swarmd.errors import ConfigError, SwarmdError


def build_parser(prog: str = "swarmd export") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--api", type=api_url, metavar="URL", help="control plane of any daemon of the swarm, "
                        "e.g. http://127.0.0.1:8080 (or 127.0.0.1:8080)")
    source.add_argument("--from", dest="dirs", nargs="+", type=Path, metavar="DIR",
                        help="state directories (or their checkpoints/ folders) holding checkpoints of every stage")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="the safetensors file to write")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--swarm-key", type=Path, default=None, metavar="FILE", help="a private swarm's key file")
    p.add_argument("--api-token-file", type=Path, default=None, metavar="FILE",
                   help="the control plane's bearer token, when it has one")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_log_level(p, "WARNING")
    return p


def check_inputs(args: argparse.Namespace, prog: str) -> None:
    """Everything local, before the swarm is asked for anything: an existing --out is kept unless
    --force (an export is minutes of downloads, and the file it would replace may be the only copy
    of an older model), and every --from folder exists. Exit 2 with one sentence otherwise."""
    out: Path = args.out
    if out.is_dir():
        fail_usage(f"--out {out} is a folder; give the file to write, e.g. {out / 'model.safetensors'}", prog)
    if out.exists() and not args.force:
        fail_usage(f"--out {out} exists; give --force to overwrite it, or another --out", prog)
    for folder in args.dirs or ():
        if not folder.is_dir():
            fail_usage(f"--from {folder} is not a folder; give the --state-dir of each peer (or its checkpoints/)",
                       prog)


def main(argv: Sequence[str], prog: str = "swarmd export") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    check_inputs(args, prog)
    from tqdm import tqdm

    from swarmd.export import ExportError, from_checkpoints, from_swarm, stage_summary, write_model

    try:
        swarm_key = load_swarm_key(args.swarm_key)
        token = read_token(args.api_token_file) if args.api_token_file else None
    except ConfigError as exc:
        fail_usage(str(exc), prog)
    bar = tqdm(total=None, unit="stage", desc="export", disable=args.no_progress, file=sys.stderr)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    started = time.monotonic()
    try:
        if args.api:
            model = asyncio.run(from_swarm(args.api, swarm_key=swarm_key, api_token=token, progress=progress))
        else:
            model = from_checkpoints(args.dirs, progress=progress)
        size = write_model(model, args.out)
    except (ExportError, SwarmdError, OSError) as exc:
        bar.close()
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    bar.close()
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB, model {model.spec.name} {model.spec.digest[:12]}) "
          f"in {time.monotonic() - started:.1f}s: " + "; ".join(stage_summary(model)))
    return 0
