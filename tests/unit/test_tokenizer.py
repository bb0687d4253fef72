"""Tokenizers (swarmd.train.tokenizer): byte-level, a trained BPE file, the canonical digest, the spec check."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from swarmd.errors import ConfigError
from swarmd.pipeline.spec import PRESETS
from swarmd.train.tokenizer import (
    BYTE_LEVEL,
    END_OF_TEXT,
    HFTokenizer,
    check_matches,
    file_digest,
    load_tokenizer,
    train_bpe,
    write_tokenizer,
)
from tests.support.tokenizers import small_bpe, stdlib_texts

TEXT = "def parse(s):\n    return s.split(',')  # café, naïve, 日本語, 🙂\n\t\r\n  trailing   "


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_bpe(tmp_path_factory.mktemp("bpe"))


def test_byte_level_is_the_utf8_bytes() -> None:
    tok = load_tokenizer(None)
    assert tok is BYTE_LEVEL and tok.digest == "" and tok.vocab_size == 256 and tok.dtype == np.uint8
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and tok.decode(ids) == TEXT
    assert tok.separator == (10,)
    (doc,) = tok.encode_documents([TEXT.encode()])
    assert doc.tolist() == ids


def test_a_trained_bpe_round_trips_any_text_and_compresses(bpe_file: Path) -> None:
    tok = HFTokenizer.from_file(bpe_file)
    assert tok.vocab_size == 600 and tok.dtype == np.uint16
    assert tok.separator == (0,)  # <|endoftext|> is id 0
    for text in (TEXT, stdlib_texts()[0], "", "\x00\x01 binary-ish \uffff"):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text  # byte-level BPE: exact for any text
    source = stdlib_texts()[1]
    assert len(tok.encode(source)) < len(source.encode()) / 2  # merges learnt from real code
    # documents: bytes in, malformed UTF-8 becomes U+FFFD rather than an exception
    docs = tok.encode_documents([TEXT.encode(), b"\xff\xfe ok"])
    assert docs[0].tolist() == tok.encode(TEXT) and tok.decode(docs[1].tolist()) == "\ufffd\ufffd ok"


def test_training_is_deterministic_so_machines_agree_on_the_digest(tmp_path: Path, bpe_file: Path) -> None:
    again = small_bpe(tmp_path)
    assert again.read_text() == bpe_file.read_text()
    assert file_digest(again) == file_digest(bpe_file)
    other = tmp_path / "other.json"
    write_tokenizer(train_bpe(stdlib_texts(), 700), other)
    assert file_digest(other) != file_digest(bpe_file)


def test_the_digest_is_of_canonical_json(tmp_path: Path, bpe_file: Path) -> None:
    digest = file_digest(bpe_file)
    assert len(digest) == 64 and int(digest, 16) >= 0
    data = json.loads(bpe_file.read_text())
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(dict(reversed(list(data.items()))), indent=4))  # reordered, re-indented
    assert file_digest(pretty) == digest
    changed = tmp_path / "changed.json"
    merges = data["model"]["merges"]
    data["model"]["merges"] = [merges[1], merges[0], *merges[2:]]
    changed.write_text(json.dumps(data))
    assert file_digest(changed) != digest


@pytest.mark.parametrize(("content", "match"), [
    ('{"version": NaN}', "not strict JSON"),
    ("[1, 2]", "not an object"),
    ("{not json", "not strict JSON"),
    ('{"version": "1.0", "model": {"type": "Nope"}}', "not a Hugging Face tokenizers file"),
])
def test_bad_tokenizer_files_are_config_errors(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_tokenizer(path)


def test_missing_tokenizer_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist; train one with 'swarmd tokenizer train'"):
        load_tokenizer(tmp_path / "nope.json")


@pytest.mark.parametrize("vocab", [0, 256, 2**21])
def test_vocab_size_out_of_range_is_refused(vocab: int) -> None:
    with pytest.raises(ConfigError, match="--vocab-size must lie in"):
        train_bpe(["abc"], vocab)


def test_a_tiny_corpus_gives_fewer_tokens_than_asked_and_says_so_by_its_vocab_size() -> None:
    tok = train_bpe(["ab ab ab"], 5000)
    assert 257 <= tok.vocab_size < 300  # the 256 bytes, <|endoftext|> and the few merges there were
    # text holding the special token's spelling becomes the separator (as in GPT-2's data), and decodes back
    assert tok.encode(f"a{END_OF_TEXT}b")[1] == 0 and tok.decode(tok.encode(f"a{END_OF_TEXT}b")) == f"a{END_OF_TEXT}b"


def test_check_matches_names_both_digests(bpe_file: Path) -> None:
    tok = HFTokenizer.from_file(bpe_file)
    spec = replace(PRESETS["tiny"], vocab_size=tok.vocab_size, tokenizer=tok.digest)
    check_matches(tok.digest, spec, "--tokenizer x")
    with pytest.raises(ConfigError) as err:
        check_matches("", spec, "this trainer")
    message = str(err.value)
    assert tok.digest in message and "byte-level" in message and "--tokenizer" in message
    with pytest.raises(ConfigError) as err:
        check_matches(tok.digest, PRESETS["tiny"], "--tokenizer x")
    assert tok.digest in str(err.value) and "drop --tokenizer" in str(err.value)
