"""Pre-tokenized shards (swarmd.train.shards): prepare, the index, memmapped streams with bounded memory."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmd.errors import ConfigError
from swarmd.pipeline.spec import PRESETS
from swarmd.train.data import BatchSampler, load_corpus, shard, val_batches
from swarmd.train.shards import ShardFile, ShardStream, open_prepared, prepare, read_index
from swarmd.train.tokenizer import BYTE_LEVEL, HFTokenizer
from tests.support.tokenizers import small_bpe


def write_docs(root: Path, n: int, lines: int = 30) -> dict[str, bytes]:
    """``n`` files whose every line names the file, so a split's text tells which files it holds."""
    root.mkdir(parents=True, exist_ok=True)
    docs = {}
    for i in range(n):
        data = b"".join(b"document %03d line %d: some text\n" % (i, j) for j in range(lines))
        (root / f"doc{i:03d}.txt").write_bytes(data)
        docs[f"document {i:03d}"] = data
    return docs


def all_ids(stream: ShardStream) -> np.ndarray:
    return np.concatenate([np.fromfile(f.path, dtype=stream.dtype) for f in stream.files])[stream.start:stream.stop]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer.from_file(small_bpe(tmp_path_factory.mktemp("bpe")))


def test_byte_level_prepare_writes_the_text_and_an_index(tmp_path: Path) -> None:
    docs = write_docs(tmp_path / "src", 40)
    result = prepare(tmp_path / "src", tmp_path / "out", val_fraction=0.1, seed=3)
    index = read_index(tmp_path / "out")
    assert index == json.loads((tmp_path / "out" / "index.json").read_text()) == result.index
    assert index["format"] == "swarmd-tokens" and index["dtype"] == "uint8" and index["tokenizer"] == ""
    assert index["vocab_size"] == 256 and index["separator"] == [10] and index["seed"] == 3
    corpus = open_prepared(tmp_path / "out", seq_len=16)
    train = all_ids(corpus.train).tobytes()
    val = all_ids(corpus.val).tobytes()
    total = sum(map(len, docs.values()))
    assert result.source_bytes == total
    assert len(train) + len(val) == total + 38  # a line break between two documents of a split
    assert result.tokens == len(train) + len(val)
    assert 0.07 < len(val) / total < 0.13  # about val_fraction, at a line break
    held = {name for name in docs if name.encode() in val}
    assert 3 <= len(held) <= 5
    for name, data in docs.items():  # every document is whole in one split, or cut once where the splits meet
        assert data in train or data in val or name.encode() in train and name.encode() in val
    cut = [name for name in docs if name.encode() in train and name.encode() in val]
    assert len(cut) <= 1
    assert val.startswith(b"document ") and val.endswith(b"\n")  # the cut is at a line break


def test_prepare_follows_the_seed_and_is_reproducible(tmp_path: Path) -> None:
    write_docs(tmp_path / "src", 20)
    a = prepare(tmp_path / "src", tmp_path / "a", seed=1)
    b = prepare(tmp_path / "src", tmp_path / "b", seed=1)
    c = prepare(tmp_path / "src", tmp_path / "c", seed=2)
    read = lambda d: (d / "train-00000.bin").read_bytes()  # noqa: E731
    assert read(tmp_path / "a") == read(tmp_path / "b") != read(tmp_path / "c")
    assert a.tokens == b.tokens == c.tokens


def test_bpe_shards_cut_anywhere_read_back_as_one_stream(tmp_path: Path, bpe: HFTokenizer) -> None:
    write_docs(tmp_path / "src", 30)
    prepare(tmp_path / "src", tmp_path / "out", tokenizer=bpe, shard_tokens=500, val_fraction=0.2)
    index = read_index(tmp_path / "out")
    assert index["dtype"] == "uint16" and index["tokenizer"] == bpe.digest and index["vocab_size"] == bpe.vocab_size
    assert len(index["train"]) > 5 and all(e["tokens"] == 500 for e in index["train"][:-1])
    corpus = open_prepared(tmp_path / "out", seq_len=32, tokenizer=bpe)
    ids = all_ids(corpus.train)
    assert ids.max() < bpe.vocab_size and corpus.train.numel() == len(ids)
    assert "document 0" in bpe.decode(ids.tolist()) and bpe.decode(ids.tolist()).count("<|endoftext|>") >= 20
    starts = torch.tensor([0, 480, 499, 990, len(ids) - 64])  # windows across shard boundaries
    windows = corpus.train.windows(starts, 64)
    assert windows.dtype == torch.int64 and windows.shape == (5, 64)
    for row, s in zip(windows, starts.tolist(), strict=True):
        assert row.tolist() == ids[s:s + 64].tolist()
    view = corpus.train[700:1800]  # a view of a view reads its own offsets
    assert view.numel() == 1100 and view[100:200].windows([0], 100)[0].tolist() == ids[800:900].tolist()
    with pytest.raises(IndexError):
        view.windows([1050], 64)


def test_jsonl_sources_and_text_field(tmp_path: Path, bpe: HFTokenizer) -> None:
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps({"body": f"record {i}: " + "lorem ipsum " * 20, "id": i}) + "\n"
                           for i in range(100)))
    with pytest.raises(ConfigError, match=r"line 1 has no string field 'text' \(its fields: body, id\)"):
        prepare(src, tmp_path / "a", tokenizer=bpe)
    prepare(src, tmp_path / "b", tokenizer=bpe, text_field="body", val_fraction=0.05)
    index = read_index(tmp_path / "b")
    assert index["documents"]["train"] + index["documents"]["val"] >= 100
    corpus = open_prepared(tmp_path / "b", seq_len=8)
    text = bpe.decode(all_ids(corpus.train).tolist() + [0] + all_ids(corpus.val).tolist())
    assert text.count("record ") == 100 and "lorem ipsum" in bpe.decode(all_ids(corpus.val).tolist())


def test_one_file_is_cut_inside_at_the_fraction(tmp_path: Path) -> None:
    src = tmp_path / "book.txt"
    text = b"".join(b"line %d of the book\n" % i for i in range(5000))
    src.write_bytes(text)
    prepare(src, tmp_path / "out", val_fraction=0.02)
    corpus = open_prepared(tmp_path / "out", seq_len=16)
    train, val = all_ids(corpus.train).tobytes(), all_ids(corpus.val).tobytes()
    assert train + val == text
    assert val.startswith(b"line ") and len(val) == pytest.approx(0.02 * len(text), rel=0.05)


def test_trainers_draw_disjoint_shards_and_share_validation(tmp_path: Path) -> None:
    write_docs(tmp_path / "src", 60, lines=50)
    prepare(tmp_path / "src", tmp_path / "out", shard_tokens=4096)
    corpus = load_corpus(tmp_path / "out", seq_len=32)
    parts = [shard(corpus.train, k, 4, 32) for k in range(4)]
    assert all(isinstance(p, ShardStream) for p in parts)
    spans = [(p.start, p.stop) for p in parts]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # disjoint, in order
    for k, p in enumerate(parts):
        x, y = BatchSampler(p, 32, seed=k).sample(64)
        assert torch.equal(x[:, 1:], y[:, :-1])
        ids = all_ids(p)
        for row in x[:8]:  # each window is inside this trainer's shard
            hits = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(ids, 32) == row.numpy(), axis=1))
            assert len(hits) >= 1
    first = val_batches(load_corpus(tmp_path / "out", seq_len=32).val, 32, 4, 2)
    second = val_batches(load_corpus(tmp_path / "out", seq_len=32).val, 32, 4, 2)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, second, strict=True))


def test_the_spec_check_names_both_digests(tmp_path: Path, bpe: HFTokenizer) -> None:
    write_docs(tmp_path / "src", 20)
    prepare(tmp_path / "src", tmp_path / "out", tokenizer=bpe)
    spec = replace(PRESETS["tiny"], vocab_size=bpe.vocab_size, tokenizer=bpe.digest)
    assert load_corpus(tmp_path / "out", seq_len=32, spec=spec).tokenizer == bpe.digest
    with pytest.raises(ConfigError) as err:
        load_corpus(tmp_path / "out", seq_len=32, spec=PRESETS["tiny"])
    assert bpe.digest in str(err.value) and "byte-level" in str(err.value) and "prepared data" in str(err.value)
    with pytest.raises(ConfigError, match="uses byte-level tokens"):  # --tokenizer must be the data's
        load_corpus(tmp_path / "out", seq_len=32, tokenizer=BYTE_LEVEL)
    small = replace(spec, vocab_size=300)
    with pytest.raises(ConfigError, match="embeds only 300"):
        load_corpus(tmp_path / "out", seq_len=32, spec=small)


def test_bad_folders_are_config_errors(tmp_path: Path) -> None:
    write_docs(tmp_path / "src", 10)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not an empty folder"):
        prepare(tmp_path / "src", tmp_path / "full")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a")
    with pytest.raises(ConfigError, match="too little text"):
        prepare(tiny, tmp_path / "t")
    assert not list((tmp_path / "t").iterdir())  # nothing left behind
    prepare(tmp_path / "src", tmp_path / "out")
    with pytest.raises(ConfigError, match="too few for one sequence"):
        open_prepared(tmp_path / "out", seq_len=100_000)
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    for broken, match in [
        ({**index, "dtype": "float32"}, "dtype 'float32'"),
        ({**index, "version": 9}, "version 9"),
        ({**index, "train": [{"file": "../etc/passwd", "tokens": 5}]}, "shard entry"),
        ({**index, "tokenizer": "zz"}, "tokenizer digest"),
        ({**index, "vocab_size": 70_000}, "does not fit dtype uint8"),
    ]:
        (tmp_path / "out" / "index.json").write_text(json.dumps(broken))
        with pytest.raises(ConfigError, match=match):
            load_corpus(tmp_path / "out", seq_len=8)
    (tmp_path / "out" / "index.json").write_text('{"format": NaN}')
    with pytest.raises(ConfigError, match="not strict JSON"):
        read_index(tmp_path / "out")
    (tmp_path / "out" / "index.json").write_text(json.dumps(index))
    with open(tmp_path / "out" / "train-00000.bin", "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(ConfigError, match="truncated or replaced"):
        load_corpus(tmp_path / "out", seq_len=8)


def test_an_interrupted_prepare_leaves_no_index_and_no_shards(tmp_path: Path) -> None:
    write_docs(tmp_path / "src", 10)

    def interrupt(_: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path / "src", tmp_path / "out", on_progress=interrupt)
    assert list((tmp_path / "out").iterdir()) == []


def _rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


#: Resident memory a stream may gain while sampling 6,400 windows from a 512 MiB shard (it keeps none).
RSS_BOUND = 12 * 2**20


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from Linux's /proc/self/status")
def test_sampling_a_shard_far_larger_than_what_is_read_keeps_memory_bounded(tmp_path: Path) -> None:
    """RSS growth while sampling windows from a 512 MiB shard (a sparse file: no disk, no time to
    write) stays under 12 MiB, while the same windows through one long-lived np.memmap (what a
    naive loader does) keep >= 25 MiB resident: every window faults in at least a page that stays
    mapped. So this measures what it claims, on this kernel, and could fail."""
    path = tmp_path / "train-00000.bin"
    tokens = 256 * 2**20  # uint16: 512 MiB
    with open(path, "wb") as fh:
        fh.truncate(tokens * 2)
    stream = ShardStream([ShardFile(path, tokens)], np.dtype(np.uint16))
    sampler = BatchSampler(stream, 128, seed=0)
    sampler.sample(16)  # warm up allocators
    before = _rss()
    for _ in range(400):
        x, _y = sampler.sample(16)
    grown = _rss() - before
    assert x.shape == (16, 128)
    assert grown < RSS_BOUND, f"RSS grew {grown / 2**20:.1f} MiB sampling a memmapped shard"

    naive = np.memmap(path, dtype=np.uint16, mode="r")
    gen = np.random.default_rng(0)
    before = _rss()
    for _ in range(400):
        starts = gen.integers(0, tokens - 129, 16)
        np.stack([np.array(naive[s:s + 129]) for s in starts])
    kept = _rss() - before
    del naive
    assert kept > 2 * RSS_BOUND, f"the control kept only {kept / 2**20:.1f} MiB: this check would not see a leak"
