"""The training corpus: bytes from real text, sampled into next-token-prediction microbatches.

SWARM's trainers (Ryabinin et al., 2023, section 3.2) each draw their own microbatches and push
them through the pipeline; nothing about the data is shared but the recipe. This module is that
recipe: a byte-level corpus (token ids 0..255, so no tokenizer has to be agreed on) that every
machine can rebuild identically from ``(path, max_bytes, val_fraction, seed)``, a seeded
sampler of random training windows, and fixed validation windows so losses are comparable
across trainers and runs.

Without ``--data`` the corpus is the Python standard library's own ``.py`` sources: real text,
already present wherever swarmd runs, so a demo or test needs no download.
"""

from __future__ import annotations

import math
import os
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmd.errors import ConfigError

__all__ = ["BatchSampler", "Corpus", "load_corpus", "shard", "stdlib_root", "val_batches"]

#: Written between two files, so a window that spans them sees a plain line break.
SEPARATOR = b"\n"
#: A file with a NUL byte in its first this many bytes is taken for binary and skipped.
BINARY_SNIFF_BYTES = 8192
# Directories never walked: installed third-party code (not "the standard library") and
# byte-code caches.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no truth value to compare by
class Corpus:
    """The bytes a trainer samples from, split into training text and held-out text."""

    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D, the held-out split
    sources: int  # files read
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()  # disjoint from train_files unless the corpus had too few files

    @property
    def total_bytes(self) -> int:
        return self.train.numel() + self.val.numel()


def stdlib_root() -> Path:
    """Where this interpreter's standard library lives: the default corpus."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(
    path: str | Path | None = None,
    *,
    max_bytes: int = 32 * 2**20,
    val_fraction: float = 0.02,
    seed: int = 0,
    seq_len: int = 128,
) -> Corpus:
    """Read a corpus deterministically from ``(path, max_bytes, val_fraction, seed)``.

    ``path`` is a text file or a folder (every regular file below it, hidden entries and
    binary-looking files skipped); None means the standard library's ``.py`` files. Files are
    concatenated in a ``random.Random(seed)`` shuffle of their sorted order, separated by a
    newline, until ``max_bytes``. The held-out split is the last files of that order, about
    ``val_fraction`` of the bytes and at least one window of ``seq_len + 1`` bytes, so no file
    is in both splits; only a corpus with too few files for that is cut inside a file (which
    then shows in both ``train_files`` and ``val_files``).
    """
    if max_bytes < 1:
        raise ConfigError(f"the corpus size limit must be at least 1 byte, got {max_bytes}")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"the held-out fraction must lie strictly between 0 and 1, got {val_fraction}")
    if seq_len < 1:
        raise ConfigError(f"the sequence length must be at least 1, got {seq_len}")

    lone: str | None = None  # set when the user named one file: its problems are errors
    if path is None:
        root = stdlib_root()
        what = f"the Python standard library at {root}"
        files = sorted(_walk(root, suffix=".py"))
    else:
        root = Path(path).expanduser()
        what = f"training data {str(root)!r}"
        if not root.exists():
            raise ConfigError(f"{what} does not exist; pass a text file or a folder of text files")
        if root.is_dir():
            files = sorted(_walk(root))
        elif root.is_file():
            files, lone = [root], what
        else:
            raise ConfigError(f"{what} is neither a regular file nor a folder")

    random.Random(seed).shuffle(files)
    buf, spans = _concatenate(files, max_bytes, lone)
    if not spans:
        raise ConfigError(
            f"{what} holds no readable text: every file is empty, unreadable or binary-looking "
            f"(a NUL byte in its first {BINARY_SNIFF_BYTES} bytes); hidden files are skipped"
        )
    need = seq_len + 1
    if len(buf) < 2 * need:
        if len(buf) >= max_bytes:
            held = f"a corpus limit of {max_bytes} bytes is"
        else:
            held = f"{what} holds only {len(buf)} bytes, which is"
        raise ConfigError(
            f"{held} too few for one training and one held-out sequence of {seq_len} tokens "
            f"(at least {2 * need} bytes are needed)"
        )

    cut = _split_point(len(buf), [start for _, start, _ in spans], val_fraction, need)
    tokens = torch.frombuffer(buf, dtype=torch.uint8)
    return Corpus(
        train=tokens[:cut].clone(),
        val=tokens[cut:].clone(),
        sources=len(spans),
        train_files=tuple(name for name, start, _ in spans if start < cut),
        val_files=tuple(name for name, _, end in spans if end > cut),
    )


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


def _concatenate(
    files: list[Path], max_bytes: int, lone: str | None
) -> tuple[bytearray, list[tuple[str, int, int]]]:
    """Read ``files`` in order into one buffer of at most ``max_bytes``.

    Returns the buffer and ``(name, start, end)`` for each file that contributed. Unreadable
    and binary-looking files are skipped; when ``lone`` names the one file the user asked for,
    they are a ConfigError instead, since skipping it would only say "empty".
    """
    buf = bytearray()
    spans: list[tuple[str, int, int]] = []
    for file in files:
        sep = SEPARATOR if buf else b""
        budget = max_bytes - len(buf) - len(sep)
        if budget <= 0:
            break
        try:
            with open(file, "rb") as fh:
                data = fh.read(budget)
        except OSError as exc:
            if lone is not None:
                raise ConfigError(f"{lone} cannot be read: {exc.strerror or exc}") from exc
            continue
        if b"\0" in data[:BINARY_SNIFF_BYTES]:
            if lone is not None:
                raise ConfigError(f"{lone} looks binary (it contains NUL bytes); pass a text file")
            continue
        if not data:
            continue
        buf += sep
        spans.append((str(file), len(buf), len(buf) + len(data)))
        buf += data
    return buf, spans


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


def shard(data: torch.Tensor, index: int, count: int, seq_len: int) -> torch.Tensor:
    """Shard ``index`` of ``count`` of a training split: the ``index``-th of ``count`` contiguous,
    disjoint slices, so trainers of one swarm (each with its own rank) draw different windows.
    Every window of a shard lies inside it. A split too small to give every shard one window is
    returned whole (the trainers then share it, as before shards).
    """
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is not in [0, {count})")
    size = data.numel() // count
    if size < seq_len + 1:
        return data
    return data[index * size : (index + 1) * size]


class BatchSampler:
    """Random training windows from a byte stream, reproducible from a seed.

    Each sample is a window ``data[s : s + seq_len + 1]``; inputs are its first ``seq_len``
    bytes and targets the last ``seq_len`` (next-byte prediction). The start offsets come from a
    ``torch.Generator`` seeded with ``seed``, so the sequence of batches is fixed by the seed
    and, through :meth:`state_dict`, resumable.
    """

    def __init__(self, data: torch.Tensor, seq_len: int, *, seed: int = 0) -> None:
        _check_windows(data, seq_len)
        self.data = data
        self.seq_len = seq_len
        self.seed = seed
        self._offsets = torch.arange(seq_len + 1)
        self._gen = torch.Generator().manual_seed(seed)

    def sample(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, both int64 ``[batch_size, seq_len]``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        starts = torch.randint(
            0, self.data.numel() - self.seq_len, (batch_size,), generator=self._gen
        )
        return _windows(self.data, starts, self._offsets)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "seq_len": self.seq_len, "generator": self._gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the batch sequence where the sampler that produced ``state`` stood."""
        if state.get("seq_len") != self.seq_len:
            raise ValueError(
                f"sampler state is for seq_len {state.get('seq_len')}, this sampler has {self.seq_len}"
            )
        self.seed = int(state["seed"])
        self._gen.set_state(state["generator"])


def val_batches(
    data: torch.Tensor, seq_len: int, batch_size: int, n_batches: int
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


def _check_windows(data: torch.Tensor, seq_len: int) -> None:
    if data.dim() != 1:
        raise ValueError(f"expected a 1-D byte tensor, got shape {tuple(data.shape)}")
    if seq_len < 1:
        raise ConfigError(f"the sequence length must be at least 1, got {seq_len}")
    if data.numel() < seq_len + 1:
        raise ConfigError(
            f"the data holds {data.numel()} bytes, too few for one sequence of {seq_len} tokens "
            f"plus its target ({seq_len + 1} bytes)"
        )


def _windows(
    data: torch.Tensor, starts: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = data[starts[:, None] + offsets].long()
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
