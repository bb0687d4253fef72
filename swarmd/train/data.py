"""The training corpus: token ids from real text, sampled into next-token-prediction microbatches.

SWARM's trainers (Ryabinin et al., 2023, section 3.2) each draw their own microbatches and push
them through the pipeline; nothing about the data is shared but the recipe. This module is that
recipe: a corpus that every machine can rebuild identically from ``(path, max_bytes,
val_fraction, seed, tokenizer)``, a seeded sampler of random training windows, and fixed
validation windows so losses are comparable across trainers and runs.

Sources (``--data PATH``): a text file, a folder of them (every regular file below it, hidden
entries and binary-looking files skipped), ``.jsonl`` files (one JSON object per line, its text
under ``text`` or ``--text-field``), or a folder written by ``swarmd data prepare``
(``swarmd.train.shards``: pre-tokenized ``.bin`` shards read through memory maps, so a corpus
larger than RAM trains with bounded memory). Without ``--data`` the corpus is the Python
standard library's own ``.py`` sources: real text, already present wherever swarmd runs, so a
demo or test needs no download. Which files those are and how they are read lives in
``swarmd.train.corpus``, shared with ``swarmd data prepare``.

Tokens: byte-level by default (ids 0..255, the bytes themselves, so no tokenizer has to be
agreed on), or a Hugging Face tokenizer (``swarmd.train.tokenizer``) whose digest must be the
model's (``ModelSpec.tokenizer``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from swarmd.errors import ConfigError
from swarmd.train.corpus import (
    BINARY_SNIFF_BYTES,
    INDEX_NAME,
    Corpus,
    Piece,
    Tokens,
    check_exists,
    read_pieces,
    source_files,
    stdlib_root,
)
from swarmd.train.shards import open_prepared, read_index
from swarmd.train.tokenizer import BYTE_LEVEL, Tokenizer, check_matches, describe, load_tokenizer

if TYPE_CHECKING:
    from swarmd.pipeline.spec import ModelSpec

__all__ = [
    "BatchSampler",
    "check_source",
    "Corpus",
    "Piece",
    "Tokens",
    "load_corpus",
    "read_pieces",
    "shard",
    "source_files",
    "stdlib_root",
    "val_batches",
]

#: Written between two files, so a window that spans them sees a plain line break.
SEPARATOR = b"\n"


def check_source(path: str | Path | None, *, tokenizer: str | Path | None = None) -> None:
    """What can be known of ``--data`` and ``--tokenizer`` without the swarm's model, in one
    ConfigError sentence: the tokenizer file loads, the data exists and is a file or a folder, and a
    prepared folder's index reads. A trainer checks this before it calls any daemon, so that a typo
    fails at once rather than after registering (the model-dependent checks come in load_corpus)."""
    load_tokenizer(tokenizer)
    if path is None:
        return
    root = Path(path).expanduser()
    if root.is_dir() and (root / INDEX_NAME).exists():
        read_index(root)
        return
    check_exists(root, f"training data {str(root)!r}")


def load_corpus(
    path: str | Path | None = None,
    *,
    max_bytes: int = 32 * 2**20,
    val_fraction: float = 0.02,
    seed: int = 0,
    seq_len: int = 128,
    tokenizer: str | Path | Tokenizer | None = None,
    text_field: str = "text",
    spec: ModelSpec | None = None,
) -> Corpus:
    """Read a corpus deterministically from ``(path, max_bytes, val_fraction, seed, tokenizer)``.

    ``path`` is a text file, a ``.jsonl`` file (the ``text_field`` of every line's object) or a
    folder of such files (hidden entries and binary-looking files skipped); None means the
    standard library's ``.py`` files. Files are read in a ``random.Random(seed)`` shuffle of
    their sorted order, each file (or ``.jsonl`` record) one document, until ``max_bytes`` of
    text; the documents' ids are joined with the tokenizer's separator (a line break for
    byte-level). The held-out split is the last documents of that order, about ``val_fraction``
    of the ids and at least one window of ``seq_len + 1``, so no document is in both splits; only
    a corpus with too few documents for that is cut inside one (which then shows in both
    ``train_files`` and ``val_files``).

    A folder written by ``swarmd data prepare`` is opened as memmapped shards instead
    (``max_bytes``, ``val_fraction`` and ``seed`` are the prepare step's business then).
    ``spec``, the swarm's model: refuse a tokenizer (or prepared data) whose digest is not
    ``spec.tokenizer``, or whose ids do not fit ``spec.vocab_size``, in one sentence.
    """
    if max_bytes < 1:
        raise ConfigError(f"the corpus size limit must be at least 1 byte, got {max_bytes}")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"the held-out fraction must lie strictly between 0 and 1, got {val_fraction}")
    if seq_len < 1:
        raise ConfigError(f"the sequence length must be at least 1, got {seq_len}")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    if path is not None and Path(path).expanduser().is_dir() and (Path(path).expanduser() / INDEX_NAME).exists():
        corpus = open_prepared(Path(path).expanduser(), seq_len=seq_len,
                               tokenizer=tok if tokenizer is not None else None)
        if spec is not None:
            _check_spec(corpus.tokenizer, corpus.vocab_size, spec, f"the prepared data in {str(path)!r}")
        return corpus
    if spec is not None:
        _check_spec(tok.digest, tok.vocab_size, spec,
                    f"--tokenizer {str(tokenizer)!r}" if tokenizer is not None else "this trainer")

    files, what, lone = source_files(path, seed)
    docs = _read_documents(files, max_bytes, lone, text_field)
    if not docs:
        raise ConfigError(
            f"{what} holds no readable text: every file is empty, unreadable or binary-looking "
            f"(a NUL byte in its first {BINARY_SNIFF_BYTES} bytes); hidden files are skipped"
        )
    ids, spans = _join(tok, docs)
    need = seq_len + 1
    if len(ids) < 2 * need:
        unit = "bytes" if tok is BYTE_LEVEL else "tokens"
        if sum(len(d) for _, d in docs) + len(docs) - 1 >= max_bytes:
            held = f"a corpus limit of {max_bytes} bytes is"
        else:
            held = f"{what} holds only {len(ids)} {unit}, which is"
        raise ConfigError(
            f"{held} too few for one training and one held-out sequence of {seq_len} tokens "
            f"(at least {2 * need} {unit} are needed)"
        )

    cut = _split_point(len(ids), [start for _, start, _ in spans], val_fraction, need)
    tokens = torch.from_numpy(ids)
    return Corpus(
        train=tokens[:cut].clone(),
        val=tokens[cut:].clone(),
        sources=len(spans),
        train_files=_unique(name for name, start, _ in spans if start < cut),
        val_files=_unique(name for name, _, end in spans if end > cut),
        tokenizer=tok.digest,
        vocab_size=tok.vocab_size,
    )


def _check_spec(digest: str, vocab_size: int, spec: ModelSpec, what: str) -> None:
    check_matches(digest, spec, what)
    if vocab_size > spec.vocab_size:
        raise ConfigError(f"{what} has {vocab_size} token ids ({describe(digest)}), but the swarm's model "
                          f"{spec.name} embeds only {spec.vocab_size}")


def _unique(names: Iterator[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def _read_documents(files: list[Path], max_bytes: int, lone: str | None,
                    text_field: str) -> list[tuple[str, bytes]]:
    """Whole documents in order, at most ``max_bytes`` of text counting one separator byte
    between two (a byte-level corpus is exactly ``max_bytes`` long when the sources have more)."""
    docs: list[tuple[str, bytearray]] = []
    used = 0
    for piece in read_pieces(files, text_field=text_field, lone=lone):
        if not piece.data:
            continue
        sep = 1 if docs and piece.first else 0
        budget = max_bytes - used - sep
        if budget <= 0:
            break
        data = piece.data[:budget]
        if piece.first:
            docs.append((piece.name, bytearray()))
        docs[-1][1].extend(data)
        used += sep + len(data)
    return [(name, bytes(data)) for name, data in docs]


def _join(tok: Tokenizer, docs: list[tuple[str, bytes]]) -> tuple[np.ndarray, list[tuple[str, int, int]]]:
    """The documents' ids joined by the tokenizer's separator, and ``(name, start, end)`` of each."""
    encoded = tok.encode_documents([data for _, data in docs])
    dtype = np.uint8 if tok.vocab_size <= 256 else np.int32  # torch has no uint16/uint32 arithmetic to rely on
    sep = np.asarray(tok.separator, dtype=dtype)
    parts: list[np.ndarray] = []
    spans: list[tuple[str, int, int]] = []
    at = 0
    for (name, _), ids in zip(docs, encoded, strict=True):
        if parts:
            parts.append(sep)
            at += len(sep)
        parts.append(ids.astype(dtype, copy=False))
        spans.append((name, at, at + len(ids)))
        at += len(ids)
    return np.concatenate(parts), spans


def _split_point(total: int, starts: list[int], val_fraction: float, need: int) -> int:
    """Offset where the held-out split begins.

    The target is ``val_fraction`` of the bytes, at least ``need`` and leaving at least ``need``
    for training. Prefer the file boundary that comes closest to it; if even that one is off by
    more than a factor of two (a corpus of a few large files), cut inside a file instead, so
    the split stays about the size that was asked for.
    """
    target = min(max(math.ceil(val_fraction * total), need), total - need)
    fitting = [s for s in starts if need <= s <= total - need]
    if fitting:
        best = min(fitting, key=lambda s: (abs(total - s - target), s))
        if target / 2 <= total - best <= 2 * target:
            return best
    return total - target


def shard(data: Tokens, index: int, count: int, seq_len: int) -> Tokens:
    """Shard ``index`` of ``count`` of a training split: the ``index``-th of ``count`` contiguous,
    disjoint slices, so trainers of one swarm (each with its own rank) draw different windows.
    Every window of a shard lies inside it. A split too small to give every shard one window is
    returned whole (the trainers then share it, as before shards). A prepared corpus's shard
    is a view of its memmapped files, so nothing is read until windows are sampled.
    """
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is not in [0, {count})")
    size = data.numel() // count
    if size < seq_len + 1:
        return data
    return data[index * size : (index + 1) * size]


class BatchSampler:
    """Random training windows from a stream of token ids, reproducible from a seed.

    Each sample is a window ``data[s : s + seq_len + 1]``; inputs are its first ``seq_len``
    ids and targets the last ``seq_len`` (next-token prediction). The start offsets come from a
    ``torch.Generator`` seeded with ``seed``, so the sequence of batches is fixed by the seed
    and, through :meth:`state_dict`, resumable.

    With ``shards=(index, count)`` the split is cut by :func:`shard` and the windows come
    from one shard at a time, starting at shard ``index`` and moving to the next (mod ``count``)
    after as many windows as the shard holds (one pass, in expectation). Trainers of one swarm
    start on the shards of their ranks, so trainers drawing at similar rates stay on disjoint
    shards, and a trainer alone still covers the whole split instead of one ``count``-th of it.
    A split too small to give every shard one window is sampled whole, as without ``shards``.
    """

    def __init__(self, data: Tokens, seq_len: int, *, seed: int = 0,
                 shards: tuple[int, int] | None = None) -> None:
        _check_windows(data, seq_len)
        self.data = data
        self.seq_len = seq_len
        self.seed = seed
        self._offsets = torch.arange(seq_len + 1)
        self._gen = torch.Generator().manual_seed(seed)
        self.drawn = 0  # windows sampled so far (moves the shard along; part of the state)
        self._first = 0
        self._parts: list[Tokens] = []  # the shards, cut by shard(); empty: the whole split
        if shards is not None:
            self._first, count = shards
            if not 0 <= self._first < count:
                raise ValueError(f"shard index {self._first} is not in [0, {count})")
            parts = [shard(data, k, count, seq_len) for k in range(count)]
            if count > 1 and parts[0] is not data:  # shard() returns the split whole when it is too small
                self._parts = parts

    @property
    def current_shard(self) -> int | None:
        """The shard the next batch is drawn from (None: the whole split)."""
        if not self._parts:
            return None
        per_pass = max(1, self._parts[0].numel() // self.seq_len)  # windows in one pass over a shard
        return (self._first + self.drawn // per_pass) % len(self._parts)

    def sample(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, both int64 ``[batch_size, seq_len]``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        current = self.current_shard
        data = self.data if current is None else self._parts[current]
        starts = torch.randint(
            0, data.numel() - self.seq_len, (batch_size,), generator=self._gen
        )
        self.drawn += batch_size
        return _windows(data, starts, self._offsets)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "seq_len": self.seq_len, "generator": self._gen.get_state(),
                "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the batch sequence where the sampler that produced ``state`` stood."""
        if state.get("seq_len") != self.seq_len:
            raise ValueError(
                f"sampler state is for seq_len {state.get('seq_len')}, this sampler has {self.seq_len}"
            )
        self.seed = int(state["seed"])
        self._gen.set_state(state["generator"])
        self.drawn = int(state.get("drawn", 0))  # states written before shards rotated: from the first


def val_batches(
    data: Tokens, seq_len: int, batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: ``batch_size * n_batches`` evenly spaced windows, no RNG.

    The same windows every time, so a validation loss is comparable across steps, trainers
    and runs; spreading them over the whole split covers it evenly instead of its start.
    """
    if batch_size < 1 or n_batches < 1:
        raise ValueError(f"batch_size and n_batches must be at least 1, got {batch_size}, {n_batches}")
    _check_windows(data, seq_len)
    count = batch_size * n_batches
    last = data.numel() - seq_len - 1  # the last valid start
    starts = torch.tensor([i * last // max(count - 1, 1) for i in range(count)], dtype=torch.int64)
    offsets = torch.arange(seq_len + 1)
    return [
        _windows(data, starts[b * batch_size : (b + 1) * batch_size], offsets) for b in range(n_batches)
    ]


def _check_windows(data: Tokens, seq_len: int) -> None:
    if data.dim() != 1:
        raise ValueError(f"expected a 1-D tensor of token ids, got shape {tuple(data.shape)}")
    if seq_len < 1:
        raise ConfigError(f"the sequence length must be at least 1, got {seq_len}")
    if data.numel() < seq_len + 1:
        raise ConfigError(
            f"the data holds {data.numel()} tokens, too few for one sequence of {seq_len} tokens "
            f"plus its target ({seq_len + 1} tokens)"
        )


def _windows(
    data: Tokens, starts: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(data, torch.Tensor):
        chunk = data[starts[:, None] + offsets].long()
    else:  # memmapped shards: read just these windows
        chunk = data.windows(starts, offsets.numel())
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
