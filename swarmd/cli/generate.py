"""``swarmd generate``: sample text from a model exported by ``swarmd export``, on this machine."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from swarmd.cli.common import (
    EXIT_USAGE,
    Parser,
    add_log_level,
    non_negative_int,
    positive_int,
    setup_logging,
)
from swarmd.errors import ConfigError


def temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a temperature") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text} must lie in [0, 100] (0: greedy)")
    return value


def build_parser(prog: str = "swarmd generate") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=__doc__)
    p.add_argument("--model", type=Path, required=True, metavar="FILE", help="a file written by 'swarmd export'")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="FILE",
                   help="the tokenizer file the model was trained with (its digest is checked against the "
                   "model's; default: byte-level)")
    p.add_argument("--prompt", default="", help="the text to continue (default: none)")
    p.add_argument("--tokens", type=non_negative_int, default=200, metavar="N",
                   help="tokens to sample (bytes, for a byte-level model) (default: 200)")
    p.add_argument("--temperature", type=temperature, default=0.8, help="0 is greedy (default: 0.8)")
    p.add_argument("--top-k", type=positive_int, default=40, metavar="K", help="sample among the K likeliest "
                   "tokens (default: 40)")
    p.add_argument("--seed", type=int, default=0, help="the sample's random seed (default: 0)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_log_level(p, "WARNING")
    return p


def main(argv: Sequence[str], prog: str = "swarmd generate") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    from swarmd.export import ExportError, load_model
    from swarmd.generate import sample_text
    from swarmd.train.tokenizer import describe, load_tokenizer

    try:
        model = load_model(args.model, device=args.device)
    except ExportError as exc:  # the file given is missing or not an export: the user's to fix
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        if tokenizer.digest != model.spec.tokenizer:
            raise ConfigError(
                f"{args.model} was trained with {describe(model.spec.tokenizer)}, "
                f"but {tokenizer.source} uses {describe(tokenizer.digest)}; "
                + ("pass the tokenizer file it was trained with: --tokenizer FILE" if model.spec.tokenizer
                   else "it is byte-level: drop --tokenizer"))
        text = sample_text(model, args.prompt, args.tokens, temperature=args.temperature, top_k=args.top_k,
                           seed=args.seed, tokenizer=tokenizer)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(text)
    return 0
