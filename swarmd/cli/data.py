"""``swarmd data``: pre-tokenize a corpus into memmapped shards that trainers stream (``swarmd.train.shards``).

``swarmd data prepare --data PATH --tokenizer FILE --out DIR`` reads PATH as ``swarmd train
--data`` does (text files, folders, ``.jsonl``), tokenizes it once and writes ``.bin`` shards and
``DIR/index.json``; then ``swarmd train --data DIR`` streams them with bounded memory, however
large the corpus. Without ``--tokenizer`` the shards are byte-level. ``swarmd data info DIR``
shows an index. The parser imports nothing heavy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarmd.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    Parser,
    add_log_level,
    add_text_source,
    non_negative_int,
    positive_int,
    setup_logging,
)
from swarmd.errors import ConfigError
from swarmd.finite import strict_json_dumps


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text} must lie strictly between 0 and 1")
    return value


def build_parser(prog: str = "swarmd data") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=f"Example: {prog} prepare --data corpus/ --tokenizer tokenizer.json --out shards/")
    sub = p.add_subparsers(dest="action", required=True, metavar="{prepare,info}", parser_class=Parser)
    pr = sub.add_parser("prepare", help="tokenize a corpus into .bin shards plus an index",
                        description="Tokenize a corpus once into .bin shards (numpy memmap) plus index.json.")
    add_text_source(pr)
    pr.add_argument("--tokenizer", type=Path, default=None, metavar="FILE",
                    help="a Hugging Face tokenizers JSON file, the swarm's (default: byte-level)")
    pr.add_argument("--out", type=Path, required=True, metavar="DIR", help="an empty or new folder for the shards")
    pr.add_argument("--val-fraction", type=fraction, default=0.005, metavar="F",
                    help="the held-out share of the text, the tail of the seeded file order (default: 0.005)")
    pr.add_argument("--seed", type=non_negative_int, default=0, help="the order files are read in (default: 0)")
    pr.add_argument("--shard-tokens", type=positive_int, default=None, metavar="N",
                    help="token ids per .bin shard (default: 67108864)")
    pr.add_argument("--json", action="store_true", help="print one JSON summary line at the end")
    pr.add_argument("--no-progress", action="store_true", help="no progress bar (there is none unless stderr is a "
                    "terminal)")
    add_log_level(pr, "WARNING")
    i = sub.add_parser("info", help="what a prepared folder holds", description="Show a prepared folder's index.")
    i.add_argument("dir", type=Path, metavar="DIR")
    i.add_argument("--json", action="store_true", help="the index as one JSON object")
    add_log_level(i, "WARNING")
    return p


def _summary(index: dict[str, Any]) -> dict[str, Any]:
    return {
        "dtype": index["dtype"], "tokenizer": index["tokenizer"], "vocab_size": index["vocab_size"],
        "train_tokens": sum(e["tokens"] for e in index["train"]), "val_tokens": sum(e["tokens"] for e in index["val"]),
        "shards": len(index["train"]) + len(index["val"]), "documents": index.get("documents"),
    }


def prepare(args: argparse.Namespace, prog: str) -> int:
    from tqdm import tqdm

    from swarmd.train.shards import DEFAULT_SHARD_TOKENS
    from swarmd.train.shards import prepare as run_prepare
    from swarmd.train.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    with tqdm(unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, dynamic_ncols=True,
              disable=True if args.no_progress else None, desc="tokenizing") as bar:  # None: only on a terminal
        result = run_prepare(args.data, args.out, tokenizer=tok, text_field=args.text_field,
                             val_fraction=args.val_fraction, seed=args.seed,
                             shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS, on_progress=bar.update,
                             on_start=lambda total: setattr(bar, "total", total))
    summary = _summary(result.index) | {
        "out": str(args.out), "source_bytes": result.source_bytes, "seconds": round(result.seconds, 3),
        "mb_per_s": round(result.mb_per_s, 3), "tokens_per_s": round(result.tokens_per_s, 1),
    }
    if args.json:
        print(strict_json_dumps(summary))
    else:
        print(f"wrote {summary['train_tokens']} training and {summary['val_tokens']} validation tokens "
              f"({summary['dtype']}, {summary['shards']} shards) to {args.out} in {result.seconds:.1f}s: "
              f"{result.mb_per_s:.1f} MB/s, {result.tokens_per_s:,.0f} tokens/s. "
              f"Train on it: swarmd train --data {args.out}"
              + (f" --tokenizer {args.tokenizer}" if args.tokenizer else ""))
    return 0


def info(args: argparse.Namespace) -> int:
    from swarmd.train.shards import read_index

    index = read_index(args.dir)
    if args.json:
        print(strict_json_dumps(index))
    else:
        s = _summary(index)
        print(f"{args.dir}: {s['train_tokens']} training and {s['val_tokens']} validation tokens, {s['dtype']}, "
              f"{s['shards']} shards, vocabulary {s['vocab_size']}, tokenizer {s['tokenizer'] or 'byte-level'}")
    return 0


def main(argv: Sequence[str], prog: str = "swarmd data") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        return prepare(args, prog) if args.action == "prepare" else info(args)
    except ConfigError as exc:
        print(f"{prog} {args.action}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # prepare leaves no index and no shards behind; train writes --out last
        return EXIT_INTERRUPTED
    except OSError as exc:  # the output folder cannot be written (a full disk, no permission)
        print(f"{prog} {args.action}: error: cannot write {getattr(args, 'out', '')}: {exc.strerror or exc}",
              file=sys.stderr)
        return EXIT_USAGE
