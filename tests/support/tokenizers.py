"""Tokenizers trained locally on the standard library's sources (nothing is downloaded)."""
from __future__ import annotations

from pathlib import Path

from swarmd.train.data import stdlib_root
from swarmd.train.tokenizer import (
    train_bpe,
    write_tokenizer,
)


def small_bpe(tmp: Path, vocab_size: int = 600) -> Path:
    """A byte-level BPE trained on :data:`TRAIN_FILES`, written to ``tmp/tokenizer.json`` (other tests reuse it)."""
    path = tmp / "tokenizer.json"
    write_tokenizer(train_bpe(stdlib_texts(), vocab_size), path)
    return path


def stdlib_texts() -> list[str]:
    return [(stdlib_root() / name).read_text(encoding="utf-8") for name in TRAIN_FILES]


#: Real text for a small tokenizer: a few stdlib modules (about 100 KB), trained in well under a second.
TRAIN_FILES = ("json/decoder.py", "json/encoder.py", "json/__init__.py", "textwrap.py")
