"""Pre-tokenized corpora: ``swarmd data prepare`` writes them, trainers stream them from memory maps.

A corpus larger than RAM cannot be tokenized at every trainer start nor held in memory, so it is
tokenized once (nanoGPT's ``prepare.py`` recipe): ``prepare`` reads the sources piece by piece
(``swarmd.train.corpus.read_pieces``), tokenizes them in batches on the ``tokenizers`` thread pool
and writes the ids through ``numpy.memmap`` into ``.bin`` shards of unsigned integers (uint16 for
vocabularies up to 65,536, uint32 above; uint8 for byte-level), plus ``index.json``::

    {"format": "swarmd-tokens", "version": 1, "dtype": "uint16", "tokenizer": "<digest>",
     "vocab_size": 4096, "separator": [0], "seed": 0, "val_fraction": 0.005, "text_field": "text",
     "documents": {"train": 980, "val": 5}, "source_bytes": 123456,
     "train": [{"file": "train-00000.bin", "tokens": 67108864}, ...],
     "val": [{"file": "val-00000.bin", "tokens": 4242}]}

The validation split is the tail of the sources' seeded order (about ``val_fraction`` of their
bytes, cut inside a document only where one straddles the point), written to shards of its own,
so every trainer of a swarm evaluates on the same held-out windows (``val_batches``).

Reading (:class:`ShardStream`) never loads a shard: a stream is a ``(start, stop)`` view over the
shards' concatenation, and each call for windows maps the shards it touches, copies the windows
out and unmaps them again (nanoGPT re-creates its memmap for every batch for the same reason: a
long-lived map keeps every page it ever touched resident), so a trainer's memory stays bounded
by its batch, not by the corpus; the maps are advised ``MADV_RANDOM``, so a window costs the
pages it lies on and no read-ahead. The index is the user's file: every field is checked and
problems are a ConfigError sentence naming the folder.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarmd.errors import ConfigError
from swarmd.train.corpus import INDEX_NAME, Corpus, Piece, read_pieces, source_files
from swarmd.train.tokenizer import BYTE_LEVEL, MAX_VOCAB, Tokenizer, describe

__all__ = ["FORMAT", "PrepareResult", "ShardFile", "ShardStream", "open_prepared", "prepare", "read_index"]

FORMAT = "swarmd-tokens"
VERSION = 1
#: Tokens per shard (128 MiB of uint16): a shard is a unit of copying and of checking sizes.
DEFAULT_SHARD_TOKENS = 64 * 2**20
#: Pieces are tokenized in batches of about this much text (the Rust tokenizer parallelises a batch).
BATCH_BYTES = 2 * 2**20
_FILE_RE = re.compile(r"(train|val)-[0-9]{5}\.bin")
_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}


@dataclass(frozen=True)
class ShardFile:
    path: Path
    tokens: int


class ShardStream:
    """Token ids across ``.bin`` shards, as a 1-D view ``[start, stop)`` of their concatenation.

    A :class:`~swarmd.train.corpus.TokenStream`: it quacks like the 1-D tensors ``swarmd.train.data``
    samples from (``numel``, ``dim``, ``shape``, slicing with step 1); :meth:`windows` reads only
    the windows asked for.
    """

    def __init__(self, files: Sequence[ShardFile], dtype: np.dtype, start: int = 0, stop: int | None = None) -> None:
        self.files = tuple(files)
        self.dtype = np.dtype(dtype)
        self._ends: list[int] = []
        total = 0
        for f in self.files:
            total += f.tokens
            self._ends.append(total)
        self.start = start
        self.stop = total if stop is None else stop
        if not 0 <= self.start <= self.stop <= total:
            raise ValueError(f"view [{start}, {stop}) lies outside the shards' {total} tokens")

    def numel(self) -> int:
        return self.stop - self.start

    def __len__(self) -> int:
        return self.numel()

    def dim(self) -> int:
        return 1

    @property
    def shape(self) -> tuple[int]:
        return (self.numel(),)

    def __getitem__(self, key: slice) -> ShardStream:
        if not isinstance(key, slice):
            raise TypeError("a ShardStream is sliced, not indexed: use windows() to read ids")
        lo, hi, step = key.indices(self.numel())
        if step != 1:
            raise ValueError("a ShardStream slices with step 1 only")
        return ShardStream(self.files, self.dtype, self.start + lo, self.start + max(lo, hi))

    def windows(self, starts: torch.Tensor | Sequence[int], length: int) -> torch.Tensor:
        """int64 ``[len(starts), length]``: the ids at ``starts[i] .. starts[i] + length`` of this view.

        Windows may cross a shard boundary (the shards are one stream cut into files). The maps
        opened for this call are closed before it returns, so no page stays resident after it.
        """
        rows = starts.tolist() if isinstance(starts, torch.Tensor) else list(starts)
        out = np.empty((len(rows), length), dtype=np.int64)
        maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
        try:
            for row, s in enumerate(rows):
                if not 0 <= s <= self.numel() - length:
                    raise IndexError(f"window [{s}, {s + length}) lies outside the stream's {self.numel()} tokens")
                at = self.start + s
                k = bisect_right(self._ends, at)
                filled = 0
                while filled < length:
                    base = self._ends[k] - self.files[k].tokens
                    lo = at + filled - base
                    take = min(length - filled, self.files[k].tokens - lo)
                    if k not in maps:
                        maps[k] = _map(self.files[k], self.dtype)
                    out[row, filled:filled + take] = maps[k][1][lo:lo + take]
                    filled += take
                    k += 1
        finally:
            while maps:
                _, (region, ids) = maps.popitem()
                del ids  # the array over the map goes first (its buffer pins the map), then the map
                region.close()
        return torch.from_numpy(out)


def _map(shard: ShardFile, dtype: np.dtype) -> tuple[mmap.mmap, np.ndarray]:
    """A read-only map of a shard and its ids as an array over it (no copy).

    ``MADV_RANDOM``: windows are read at random offsets, so the kernel's read-ahead and fault-around
    (up to 128 KiB around each fault) would read, and keep resident, ~500 times what a 258-byte
    window needs; on a corpus that is not in the page cache that is the difference between about
    100 and 4,000 microbatches per second here (docs/BENCHMARKS.md). It is what ``numpy.memmap``
    does, plus that advice, which numpy offers no way to give.
    """
    with open(shard.path, "rb") as fh:
        region = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(region, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        region.madvise(mmap.MADV_RANDOM)
    return region, np.frombuffer(region, dtype=dtype, count=shard.tokens)


# ---- reading ----------------------------------------------------------------------------------


def read_index(folder: Path) -> dict[str, Any]:
    """The folder's ``index.json``, every field checked; ConfigError with a sentence otherwise."""
    where = f"the prepared data in {str(folder)!r}"
    try:
        text = (folder / INDEX_NAME).read_text(encoding="utf-8")
        index = json.loads(text, parse_constant=_no_constant)
    except OSError as exc:
        raise ConfigError(f"{where} has no readable {INDEX_NAME}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"{where} has a corrupt {INDEX_NAME} (not strict JSON: {exc}); prepare it again") from None

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{where} has a corrupt {INDEX_NAME}: {what}; prepare it again with 'swarmd data prepare'")

    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise bad(f"it is not a {FORMAT} index")
    if index.get("version") != VERSION:
        raise bad(f"version {index.get('version')!r}, this swarmd reads version {VERSION}")
    if index.get("dtype") not in _DTYPES:
        raise bad(f"dtype {index.get('dtype')!r} is not one of {', '.join(_DTYPES)}")
    digest = index.get("tokenizer")
    if not isinstance(digest, str) or not (digest == "" or re.fullmatch(r"[0-9a-f]{64}", digest)):
        raise bad("its tokenizer digest is neither empty nor 64 hex digits")
    vocab = index.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab <= MAX_VOCAB:
        raise bad(f"vocab_size {vocab!r} is not an integer in [1, {MAX_VOCAB}]")
    if vocab > np.iinfo(_DTYPES[index["dtype"]]).max + 1:
        raise bad(f"a vocabulary of {vocab} does not fit dtype {index['dtype']}")
    for split in ("train", "val"):
        entries = index.get(split)
        if not isinstance(entries, list):
            raise bad(f"its {split!r} shard list is missing")
        for entry in entries:
            if not (isinstance(entry, dict) and isinstance(entry.get("file"), str)
                    and _FILE_RE.fullmatch(entry["file"]) and entry["file"].startswith(split)
                    and isinstance(entry.get("tokens"), int) and not isinstance(entry["tokens"], bool)
                    and entry["tokens"] > 0):
                raise bad(f"a {split} shard entry {entry!r} is not {{'file': '{split}-NNNNN.bin', 'tokens': N > 0}}")
    return index


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _stream(folder: Path, index: dict[str, Any], split: str) -> ShardStream:
    dtype = np.dtype(_DTYPES[index["dtype"]])
    files = []
    for entry in index[split]:
        path = folder / entry["file"]
        want = entry["tokens"] * dtype.itemsize
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise ConfigError(f"shard {str(path)!r} of the prepared data cannot be read: "
                              f"{exc.strerror or exc}") from exc
        if size != want:
            raise ConfigError(f"shard {str(path)!r} holds {size} bytes, its index says {want} "
                              f"({entry['tokens']} {index['dtype']} tokens): truncated or replaced; prepare it again")
        files.append(ShardFile(path, entry["tokens"]))
    return ShardStream(files, dtype)


def open_prepared(folder: Path, *, seq_len: int, tokenizer: Tokenizer | None = None) -> Corpus:
    """A prepared folder as a :class:`~swarmd.train.corpus.Corpus` of memmapped streams.

    ``tokenizer`` (the user's ``--tokenizer``, if any) must be the one the data was prepared with.
    """
    index = read_index(folder)
    where = f"the prepared data in {str(folder)!r}"
    if tokenizer is not None and tokenizer.digest != index["tokenizer"]:
        raise ConfigError(f"{where} uses {describe(index['tokenizer'])}, but {tokenizer.source} uses "
                          f"{describe(tokenizer.digest)}; prepare the data with the swarm's tokenizer")
    train, val = _stream(folder, index, "train"), _stream(folder, index, "val")
    for split, stream in (("training", train), ("validation", val)):
        if stream.numel() < seq_len + 1:
            raise ConfigError(f"{where} holds {stream.numel()} {split} tokens, too few for one sequence of "
                              f"{seq_len} tokens plus its target; prepare more text (or a larger --val-fraction)")
    docs = index.get("documents")
    counts = docs.values() if isinstance(docs, dict) else ()
    count = sum(int(v) for v in counts if isinstance(v, int) and not isinstance(v, bool))
    return Corpus(train=train, val=val, sources=count, tokenizer=index["tokenizer"], vocab_size=index["vocab_size"])


# ---- writing ----------------------------------------------------------------------------------


@dataclass
class PrepareResult:
    index: dict[str, Any]
    source_bytes: int  # bytes of source files read
    tokens: int  # ids written, both splits
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.source_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class _ShardWriter:
    """Appends ids to ``<prefix>-NNNNN.bin`` files of at most ``shard_tokens`` ids, through
    ``numpy.memmap`` (each shard is mapped at its full size, filled, flushed and truncated to
    what was written)."""

    def __init__(self, folder: Path, prefix: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.prefix, self.dtype, self.shard_tokens = folder, prefix, dtype, shard_tokens
        self.entries: list[dict[str, Any]] = []
        self.written: list[Path] = []
        self._map: np.memmap | None = None
        self._fill = 0
        self.tokens = 0

    def write(self, ids: np.ndarray) -> None:
        at = 0
        while at < len(ids):
            if self._map is None:
                path = self.folder / f"{self.prefix}-{len(self.entries):05d}.bin"
                self.written.append(path)
                self._map = np.memmap(path, dtype=self.dtype, mode="w+", shape=(self.shard_tokens,))
                self._fill = 0
            take = min(len(ids) - at, self.shard_tokens - self._fill)
            self._map[self._fill:self._fill + take] = ids[at:at + take]
            self._fill += take
            self.tokens += take
            at += take
            if self._fill == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        if self._map is None:
            return
        self._map.flush()
        self._map = None  # unmapped
        path = self.written[-1]
        if self._fill == 0:
            path.unlink()
            self.written.pop()
            return
        os.truncate(path, self._fill * self.dtype.itemsize)
        self.entries.append({"file": path.name, "tokens": self._fill})

    def close(self) -> list[dict[str, Any]]:
        self._finish()
        return self.entries


def prepare(
    path: str | Path | None,
    out: Path,
    *,
    tokenizer: Tokenizer = BYTE_LEVEL,
    text_field: str = "text",
    val_fraction: float = 0.005,
    seed: int = 0,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    on_progress: Callable[[int], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> PrepareResult:
    """Tokenize the sources of ``path`` (as ``--data`` reads them) into shards under ``out``.

    ``out`` must be empty or absent. ``on_progress(bytes)`` is called with source bytes as they
    are consumed and ``on_start(total)`` once with their total (the CLI's tqdm bar). The index is
    written last, atomically: a folder whose preparation died holds no index and is not mistaken
    for a prepared one.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must lie strictly between 0 and 1, got {val_fraction}")
    if shard_tokens < 1:
        raise ConfigError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} already exists and is not an empty folder; choose a new one")
    files, what, lone = source_files(path, seed)
    total = 0
    for file in files:
        try:
            total += file.stat().st_size
        except OSError:
            continue
    cut = total * (1.0 - val_fraction)
    if on_start is not None:
        on_start(total)
    dtype = tokenizer.dtype
    sep = np.asarray(tokenizer.separator, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    writers = {split: _ShardWriter(out, split, dtype, shard_tokens) for split in ("train", "val")}
    documents = {"train": 0, "val": 0}
    started = time.perf_counter()
    consumed = 0
    batch: list[tuple[str, Piece]] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if not batch:
            return
        for (split, piece), ids in zip(batch, tokenizer.encode_documents([p.data for _, p in batch]), strict=True):
            w = writers[split]
            if piece.first:
                if w.tokens:
                    w.write(sep)
                documents[split] += 1
            w.write(ids.astype(dtype, copy=False))
        batch, batch_bytes = [], 0

    try:
        for piece in read_pieces(files, text_field=text_field, lone=lone):
            if piece.data:
                for split, part in _split_piece(piece, consumed, cut):
                    batch.append((split, part))
                    batch_bytes += len(part.data)
            consumed += piece.raw
            if on_progress is not None:
                on_progress(piece.raw)
            if batch_bytes >= BATCH_BYTES:
                flush()
        flush()
        entries = {split: w.close() for split, w in writers.items()}
        tokens = {split: w.tokens for split, w in writers.items()}
        if not tokens["train"] or not tokens["val"]:
            raise ConfigError(f"{what} holds too little text to prepare ({tokens['train']} training and "
                              f"{tokens['val']} validation tokens); give more text or a larger --val-fraction")
        index = {
            "format": FORMAT, "version": VERSION, "dtype": dtype.name, "tokenizer": tokenizer.digest,
            "vocab_size": tokenizer.vocab_size, "separator": [int(i) for i in tokenizer.separator], "seed": seed,
            "val_fraction": val_fraction, "text_field": text_field, "documents": documents,
            "source_bytes": consumed, "tokens": tokens, "train": entries["train"], "val": entries["val"],
        }
        tmp = out / f".{INDEX_NAME}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(index, indent=1, allow_nan=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out / INDEX_NAME)
    except BaseException:
        for w in writers.values():
            w._map = None
            for p in w.written:
                p.unlink(missing_ok=True)
        raise
    return PrepareResult(index=index, source_bytes=consumed, tokens=sum(tokens.values()),
                         seconds=time.perf_counter() - started)


def _split_piece(piece: Piece, consumed: int, cut: float) -> list[tuple[str, Piece]]:
    """Which split a piece belongs to by where it lies in the sources (``consumed`` bytes before
    it, the held-out tail from byte ``cut``); the one piece that straddles the cut is divided
    there (moved to the next line break close by, never inside a UTF-8 character)."""
    if consumed + piece.raw <= cut:
        return [("train", piece)]
    if consumed >= cut:
        return [("val", piece)]
    data = piece.data
    at = min(len(data), max(0, int((cut - consumed) / piece.raw * len(data))))
    line = data.find(b"\n", at, at + 4096)
    at = line + 1 if line != -1 else at
    while at < len(data) and (data[at] & 0xC0) == 0x80:  # a UTF-8 continuation byte
        at += 1
    parts = [("train", Piece(piece.name, data[:at], piece.first, at)),
             ("val", Piece(piece.name, data[at:], True, len(data) - at))]
    return [(split, p) for split, p in parts if p.data]
