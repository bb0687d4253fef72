"""Tokenizers: byte-level (the default) or a Hugging Face ``tokenizers`` JSON file, behind one interface.

Everyone who touches token ids must agree on them: a trainer's ids go into the first stage's
embedding and its targets into the last stage's loss, and ``swarmd generate`` turns the ids back
into text. So the tokenizer is part of the model's contract: ``ModelSpec.tokenizer`` holds its
:func:`file_digest` ("" for byte-level), a founder started with ``--tokenizer FILE`` publishes
it, and trainers, prepared datasets and exported models are checked against it
(:func:`check_matches`), refusing with a sentence that names both digests.

*Canonical* JSON, what the digest covers: the file parsed as strict JSON (no NaN) and written
back with sorted keys, no whitespace and UTF-8, so re-indenting or reordering a file does not
change its digest but any change to its vocabulary, merges or pre-tokenizer does.

``tokenizers`` (Rust, offline) is imported only where a file is loaded or trained, so the byte
tokenizer and ``swarmd --help`` need none of it.
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from swarmd.errors import ConfigError

if TYPE_CHECKING:
    from swarmd.pipeline.spec import ModelSpec

__all__ = [
    "BYTE_LEVEL",
    "ByteTokenizer",
    "END_OF_TEXT",
    "HFTokenizer",
    "Tokenizer",
    "canonical_json",
    "check_matches",
    "describe",
    "file_digest",
    "load_tokenizer",
    "train_bpe",
]

#: The special token ``swarmd tokenizer train`` adds; prepared shards and corpora put it between documents.
END_OF_TEXT = "<|endoftext|>"
#: The largest vocabulary a model spec accepts (``ModelSpec.vocab_size``'s bound).
MAX_VOCAB = 1_048_576
#: Byte-level BPE starts from 256 byte symbols; the end-of-text token comes on top.
MIN_BPE_VOCAB = 257


def describe(digest: str) -> str:
    """A digest as what follows "uses" in a sentence: byte-level tokens, or the tokenizer's full digest."""
    return "byte-level tokens (no tokenizer file)" if not digest else f"tokenizer {digest}"


class Tokenizer(ABC):
    """Text to token ids and back; ``digest`` is what ``ModelSpec.tokenizer`` must equal."""

    digest: str
    vocab_size: int  # ids lie in [0, vocab_size)
    source: str  # where it came from, for messages
    separator: tuple[int, ...]  # the ids written between two documents

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def encode_documents(self, documents: Sequence[bytes]) -> list[np.ndarray]:
        """Each document's ids (UTF-8 bytes in; malformed bytes become U+FFFD for text tokenizers)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned integer type that holds every id (nanoGPT's uint16 for GPT-2's 50257)."""
        return np.dtype(np.uint8 if self.vocab_size <= 2**8 else np.uint16 if self.vocab_size <= 2**16
                        else np.uint32)


class ByteTokenizer(Tokenizer):
    """Ids are the text's UTF-8 bytes (0..255): nothing to agree on, nothing to download."""

    digest = ""
    vocab_size = 256
    source = "byte-level"
    separator = (10,)  # a line break, as byte-level corpora always had between files

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_documents(self, documents: Sequence[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(doc, dtype=np.uint8) for doc in documents]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


BYTE_LEVEL = ByteTokenizer()


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` JSON file (BPE, WordPiece, Unigram: whatever it describes)."""

    def __init__(self, text: str, source: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.digest = hashlib.sha256(canonical_json(text, source)).hexdigest()
        self.source = source
        try:
            self._tok = RustTokenizer.from_str(text)
        except Exception as exc:  # the Rust side raises plain Exceptions with its parse error
            raise ConfigError(f"{source} is not a Hugging Face tokenizers file: {exc}") from exc
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ConfigError(f"{source} has an empty vocabulary")
        self.vocab_size = max(vocab.values()) + 1
        if self.vocab_size > MAX_VOCAB:
            raise ConfigError(f"{source} has {self.vocab_size} token ids; a model takes at most {MAX_VOCAB}")
        eot = self._tok.token_to_id(END_OF_TEXT)
        self.separator = (eot,) if eot is not None else tuple(self.encode("\n"))

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        source = f"tokenizer file {str(path)!r}"
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{source} does not exist; train one with 'swarmd tokenizer train'") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{source} cannot be read: {getattr(exc, 'strerror', None) or exc}") from exc
        return cls(text, source)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_documents(self, documents: Sequence[bytes]) -> list[np.ndarray]:
        texts = [doc.decode("utf-8", errors="replace") for doc in documents]
        # encode_batch runs on the Rust side's thread pool: this is where prepare spends its time;
        # the _fast variant (tokenizers >= 0.20) skips character offsets nobody here reads (~15 % less CPU)
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [np.asarray(e.ids, dtype=np.int64) for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def to_str(self) -> str:
        return str(self._tok.to_str())


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def canonical_json(text: str, source: str = "the tokenizer") -> bytes:
    """The bytes the digest covers: strict JSON re-serialised with sorted keys, compact, UTF-8."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise ConfigError(f"{source} is not strict JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{source} is not a Hugging Face tokenizers file: its JSON is not an object")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def file_digest(path: str | Path) -> str:
    """SHA-256 hex of a tokenizer file's canonical JSON (what ``ModelSpec.tokenizer`` holds)."""
    return HFTokenizer.from_file(path).digest


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """``--tokenizer FILE``'s tokenizer; None: byte-level."""
    return BYTE_LEVEL if path is None else HFTokenizer.from_file(path)


def check_matches(digest: str, spec: ModelSpec, what: str) -> None:
    """Refuse, in one sentence naming both, ``what``'s tokenizer when it is not the model's.

    ``what`` completes "... but <what> is ...", e.g. "--tokenizer tok.json" or "the prepared data in DIR".
    """
    if digest != spec.tokenizer:
        hint = ("pass the swarm's tokenizer file with --tokenizer" if spec.tokenizer
                else "this swarm is byte-level: drop --tokenizer (and prepare data without it)")
        raise ConfigError(f"the swarm's model {spec.name} uses {describe(spec.tokenizer)}, but {what} uses "
                          f"{describe(digest)}; {hint}")


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2,
              show_progress: bool = False) -> HFTokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer, every byte in the base alphabet, so any text encodes
    and decodes back exactly) with :data:`END_OF_TEXT` as id 0, trained offline on ``texts``.

    The Rust trainer is deterministic for the same texts in the same order, so two machines that
    train on the same files get the same file and the same digest.
    """
    if not MIN_BPE_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ConfigError(f"--vocab-size must lie in [{MIN_BPE_VOCAB}, {MAX_VOCAB}] (256 bytes + {END_OF_TEXT} "
                          f"are the least a byte-level BPE holds), got {vocab_size}")
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[END_OF_TEXT])
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer(tok.to_str(), "the trained tokenizer")


def write_tokenizer(tokenizer: HFTokenizer, out: Path) -> None:
    """Write the file atomically (a temporary file, fsynced, renamed): a reader never sees half of it."""
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(tokenizer.to_str())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out)
