"""A corpus: where its text comes from, and what it is once tokenized.

A trainer's corpus is rebuilt identically on every machine from its sources (SWARM, section 3.2:
nothing about the data is shared but the recipe; ``swarmd.train.data`` is that recipe). This module
holds what both ways of building it share, raw text tokenized at start (``swarmd.train.data``) and
pre-tokenized shards (``swarmd.train.shards``): which files the sources are (:func:`source_files`:
a text file, a folder of them, ``.jsonl`` files, or by default the Python standard library's own
``.py`` sources), their documents read in pieces so no file has to fit in memory
(:func:`read_pieces`), and the :class:`Corpus` either way gives a trainer.
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from swarmd.errors import ConfigError

__all__ = ["Corpus", "Piece", "TokenStream", "Tokens", "read_pieces", "source_files", "stdlib_root"]

#: A file with a NUL byte in its first this many bytes is taken for binary and skipped.
BINARY_SNIFF_BYTES = 8192
#: Large text files are read (and, in ``swarmd data prepare``, tokenized) in pieces of about this
#: size, cut after a line break, so no file has to fit in memory.
PIECE_BYTES = 4 * 2**20
#: A ``.jsonl`` line longer than this is refused rather than read into memory.
MAX_JSONL_LINE = 64 * 2**20
#: The name of the index a prepared folder holds (``swarmd.train.shards``).
INDEX_NAME = "index.json"
# Directories never walked: installed third-party code (not "the standard library") and
# byte-code caches.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class TokenStream(Protocol):
    """Token ids too many for memory, read window by window (``swarmd.train.shards.ShardStream``)."""

    @property
    def shape(self) -> tuple[int]: ...

    def numel(self) -> int: ...

    def dim(self) -> int: ...

    def __getitem__(self, key: slice) -> TokenStream: ...

    def windows(self, starts: torch.Tensor | Sequence[int], length: int) -> torch.Tensor:
        """int64 ``[len(starts), length]``: the ids at ``starts[i] .. starts[i] + length``."""
        ...


#: A stream of token ids: an in-memory 1-D tensor, or a :class:`TokenStream` (memmapped shards).
#: Both have ``numel()``, ``dim()`` and slicing, which is all sampling uses (``swarmd.train.data``).
Tokens = torch.Tensor | TokenStream


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no truth value to compare by
class Corpus:
    """The token ids a trainer samples from, split into training ids and held-out ids."""

    train: Tokens  # 1-D: uint8 for byte-level text, int32 for a tokenizer's, memmapped for prepared shards
    val: Tokens  # 1-D, the held-out split
    sources: int  # files (or .jsonl records) read
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()  # disjoint from train_files unless the corpus had too few files
    tokenizer: str = ""  # the digest of the tokenizer that made the ids ("": byte-level)
    vocab_size: int = 256  # ids lie in [0, vocab_size)

    @property
    def total_bytes(self) -> int:
        """Ids in both splits: the bytes of the text for a byte-level corpus (hence the name)."""
        return self.train.numel() + self.val.numel()

    @property
    def total_tokens(self) -> int:
        return self.total_bytes


def stdlib_root() -> Path:
    """Where this interpreter's standard library lives: the default corpus."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(path: str | Path | None, seed: int) -> tuple[list[Path], str, str | None]:
    """The files a corpus reads, in their ``random.Random(seed)`` order; how to name the source in
    messages; and, when the user named one file, that name (its problems are errors, not skips)."""
    lone: str | None = None
    if path is None:
        root = stdlib_root()
        what = f"the Python standard library at {root}"
        files = sorted(_walk(root, suffix=".py"))
    else:
        root = Path(path).expanduser()
        what = f"training data {str(root)!r}"
        check_exists(root, what)
        if root.is_dir():
            files = sorted(_walk(root))
        else:
            files, lone = [root], what
    random.Random(seed).shuffle(files)
    return files, what, lone


def check_exists(root: Path, what: str) -> None:
    """``--data`` names a file or a folder (one ConfigError sentence otherwise)."""
    if not root.exists():
        raise ConfigError(f"{what} does not exist; pass a text file, a .jsonl file or a folder of them")
    if not (root.is_dir() or root.is_file()):
        raise ConfigError(f"{what} is neither a regular file nor a folder")


def _walk(root: Path, suffix: str = "") -> Iterator[Path]:
    """Regular files below ``root`` (symlinked folders not followed, hidden entries skipped)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in _SKIPPED_DIRS]
        for name in filenames:
            if name.startswith(".") or not name.endswith(suffix):
                continue
            file = Path(dirpath, name)
            if file.is_file():
                yield file


@dataclass(frozen=True)
class Piece:
    """A document, or the next piece of a large one (``first`` False), as UTF-8 bytes.

    ``raw`` is how many bytes of the source file it stands for (a ``.jsonl`` line with its JSON
    quoting; a skipped file's whole size with empty ``data``), so a reader can say how far
    through the sources it is.
    """

    name: str
    data: bytes
    first: bool
    raw: int


def read_pieces(files: Sequence[Path], *, text_field: str = "text", lone: str | None = None,
                piece_bytes: int = PIECE_BYTES) -> Iterator[Piece]:
    """Every document of ``files`` in order, large files in pieces of about ``piece_bytes`` cut
    after a line break. Unreadable and binary-looking files are skipped (an empty piece); when
    ``lone`` names the one file the user asked for, they are a ConfigError instead, since
    skipping it would only say "empty". A malformed ``.jsonl`` line is always a ConfigError
    naming the file and line: a structured file that does not parse is not text to skip.
    """
    for file in files:
        try:
            size = file.stat().st_size
            with open(file, "rb") as fh:
                if file.suffix == ".jsonl":
                    yield from _jsonl_pieces(fh, file, text_field)
                else:
                    yield from _text_pieces(fh, file, size, lone, piece_bytes)
        except OSError as exc:
            if lone is not None:
                raise ConfigError(f"{lone} cannot be read: {exc.strerror or exc}") from exc
            yield Piece(str(file), b"", True, 0)


def _text_pieces(fh: Any, file: Path, size: int, lone: str | None, piece_bytes: int) -> Iterator[Piece]:
    head = fh.read(piece_bytes)
    if b"\0" in head[:BINARY_SNIFF_BYTES]:
        if lone is not None:
            raise ConfigError(f"{lone} looks binary (it contains NUL bytes); pass a text file")
        yield Piece(str(file), b"", True, size)
        return
    first, carry = True, head
    while True:
        more = fh.read(piece_bytes) if carry else b""
        if not more:
            if carry:
                yield Piece(str(file), carry, first, len(carry))
            return
        cut = carry.rfind(b"\n") + 1 or len(carry)  # after the last line break, if there is one
        yield Piece(str(file), carry[:cut], first, cut)
        first, carry = False, carry[cut:] + more


def _jsonl_pieces(fh: Any, file: Path, text_field: str) -> Iterator[Piece]:
    for number, line in enumerate(iter(lambda: fh.readline(MAX_JSONL_LINE + 1), b""), start=1):
        where = f"{str(file)!r} line {number}"
        if len(line) > MAX_JSONL_LINE:
            raise ConfigError(f"{where} is longer than {MAX_JSONL_LINE} bytes")
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where} is not a JSON object: {exc}") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where} is not a JSON object (got {type(record).__name__})")
        text = record.get(text_field)
        if not isinstance(text, str):
            found = ", ".join(sorted(map(str, record))[:8]) or "none"
            raise ConfigError(f"{where} has no string field {text_field!r} (its fields: {found}); "
                              "name the text's field with --text-field")
        if text:
            yield Piece(f"{file}:{number}", text.encode("utf-8"), True, len(line))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
