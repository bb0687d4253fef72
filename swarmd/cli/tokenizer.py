"""``swarmd tokenizer``: train a byte-level BPE on your own text, offline, or show a tokenizer file's digest.

``swarmd tokenizer train --data PATH --vocab-size N --out tokenizer.json`` reads PATH as
``swarmd train --data`` does (text files, folders, ``.jsonl``) and trains with the Hugging Face
``tokenizers`` package on this machine; give the file to the founder (``swarmd --tokenizer
FILE``), to ``swarmd data prepare`` and to every trainer. ``swarmd tokenizer info FILE`` prints
the digest that ``ModelSpec.tokenizer`` carries. The parser imports nothing heavy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

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


def build_parser(prog: str = "swarmd tokenizer") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=f"Example: {prog} train --data notes/ --vocab-size 4096 --out tokenizer.json")
    sub = p.add_subparsers(dest="action", required=True, metavar="{train,info}", parser_class=Parser)
    t = sub.add_parser("train", help="train a byte-level BPE tokenizer on local text (offline)",
                       description="Train a byte-level BPE tokenizer (GPT-2's pre-tokenizer, <|endoftext|> as id 0).")
    add_text_source(t)
    t.add_argument("--vocab-size", type=positive_int, required=True, metavar="N",
                   help="token ids the tokenizer may use (at least 257: 256 bytes + <|endoftext|>)")
    t.add_argument("--out", type=Path, required=True, metavar="FILE", help="the tokenizer JSON file to write")
    t.add_argument("--max-bytes", type=positive_int, default=None, metavar="N",
                   help="train on at most N bytes of text (default: all of it)")
    t.add_argument("--min-frequency", type=positive_int, default=2, metavar="N",
                   help="merge only pairs seen at least N times (default: 2)")
    t.add_argument("--seed", type=non_negative_int, default=0, help="the order files are read in (default: 0)")
    t.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    add_log_level(t, "WARNING")
    i = sub.add_parser("info", help="a tokenizer file's digest and vocabulary size",
                       description="Print a tokenizer file's digest (what ModelSpec.tokenizer holds) and "
                       "vocabulary size.")
    i.add_argument("file", type=Path, metavar="FILE")
    i.add_argument("--json", action="store_true", help="one JSON object")
    add_log_level(i, "WARNING")
    return p


def _texts(pieces: Iterator[tuple[str, bytes]]) -> Iterator[str]:
    for _, data in pieces:
        yield data.decode("utf-8", errors="replace")


def train(args: argparse.Namespace) -> int:
    from swarmd.train.data import read_pieces, source_files
    from swarmd.train.tokenizer import train_bpe, write_tokenizer

    out: Path = args.out
    if out.exists() and not args.force:
        raise ConfigError(f"--out {str(out)!r} already exists; a swarm's tokenizer must not change under it "
                          "(choose another file, or --force)")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {str(out)!r}: the folder {str(out.parent)!r} does not exist")
    files, _, lone = source_files(args.data, args.seed)
    budget = args.max_bytes

    def pieces() -> Iterator[tuple[str, bytes]]:
        used = 0
        for piece in read_pieces(files, text_field=args.text_field, lone=lone):
            if not piece.data:
                continue
            data = piece.data if budget is None else piece.data[: budget - used]
            if not data:
                return
            used += len(data)
            yield piece.name, data

    tok = train_bpe(_texts(pieces()), args.vocab_size, min_frequency=args.min_frequency,
                    show_progress=sys.stderr.isatty())
    try:
        write_tokenizer(tok, out)
    except OSError as exc:
        raise ConfigError(f"cannot write --out {str(out)!r}: {exc.strerror or exc}") from exc
    print(f"wrote {out}: a byte-level BPE of {tok.vocab_size} tokens, digest {tok.digest}")
    return 0


def info(args: argparse.Namespace) -> int:
    from swarmd.train.tokenizer import HFTokenizer

    tok = HFTokenizer.from_file(args.file)
    if args.json:
        print(strict_json_dumps({"file": str(args.file), "digest": tok.digest, "vocab_size": tok.vocab_size}))
    else:
        print(f"{args.file}: {tok.vocab_size} token ids, digest {tok.digest}")
    return 0


def main(argv: Sequence[str], prog: str = "swarmd tokenizer") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        return train(args) if args.action == "train" else info(args)
    except ConfigError as exc:
        print(f"{prog} {args.action}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # prepare leaves no index and no shards behind; train writes --out last
        return EXIT_INTERRUPTED
