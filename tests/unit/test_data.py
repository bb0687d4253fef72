"""The corpus (swarmd.train.data): loading text, .jsonl and BPE ids, held-out split, sampling, validation windows."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from swarmd.errors import ConfigError
from swarmd.pipeline.spec import PRESETS
from swarmd.train.data import BatchSampler, Corpus, load_corpus, read_pieces, stdlib_root, val_batches
from swarmd.train.tokenizer import HFTokenizer

SMALL = 2**20  # enough stdlib text for every test but the full-size one, and fast to read
QUARTER = SMALL // 4  # for BPE-tokenized corpora: a fraction of a second to tokenize


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.tolist()) if t.numel() < 1000 else t.numpy().tobytes()


def write_files(root: Path, n: int, size: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = root / f"f{i:02d}.txt"
        p.write_bytes((f"file {i} " * size).encode()[:size])
        paths.append(p)
    return paths


# ---- the default corpus ------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_corpus() -> Corpus:
    return load_corpus()


def test_default_corpus_is_the_stdlib_split_by_whole_files(stdlib_corpus: Corpus) -> None:
    corpus = stdlib_corpus
    assert corpus.train.dtype == torch.uint8 and corpus.train.dim() == 1
    assert corpus.val.dtype == torch.uint8 and corpus.val.dim() == 1
    assert corpus.total_bytes == corpus.train.numel() + corpus.val.numel()
    assert corpus.total_bytes > 10 * 2**20  # the whole stdlib, well over 10 MB
    assert corpus.sources == len(corpus.train_files) + len(corpus.val_files) > 500
    assert not set(corpus.train_files) & set(corpus.val_files)
    assert all(f.endswith(".py") and "site-packages" not in f for f in corpus.train_files)
    assert all(Path(f).is_relative_to(stdlib_root()) for f in corpus.val_files)
    assert 0.015 < corpus.val.numel() / corpus.total_bytes < 0.04  # about val_fraction
    assert b"def " in as_bytes(corpus.train[:100_000])


def test_default_corpus_is_deterministic_per_seed_and_differs_across_seeds() -> None:
    a = load_corpus(max_bytes=SMALL, seed=1)
    b = load_corpus(max_bytes=SMALL, seed=1)
    c = load_corpus(max_bytes=SMALL, seed=2)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train_files == b.train_files and a.val_files == b.val_files
    assert a.train_files != c.train_files
    assert not torch.equal(a.train[:10_000], c.train[:10_000])


def test_max_bytes_caps_the_corpus() -> None:
    corpus = load_corpus(max_bytes=SMALL)
    assert corpus.total_bytes == SMALL
    assert corpus.sources < 200


def test_held_out_files_are_whole_and_absent_from_training(stdlib_corpus: Corpus) -> None:
    corpus = stdlib_corpus
    val = as_bytes(corpus.val)
    assert len(corpus.val_files) >= 2 and not set(corpus.train_files) & set(corpus.val_files)
    # every held-out file is in the held-out text whole (the last one may have been cut short
    # by max_bytes); the stdlib repeats some code across files, so the "not in training" half
    # is checked on unique text below
    for name in corpus.val_files[:-1]:
        assert Path(name).read_bytes() in val


def test_held_out_text_does_not_appear_in_training_text(tmp_path: Path) -> None:
    for i in range(50):
        (tmp_path / f"{i}.txt").write_bytes(b"".join(b"file %d line %d\n" % (i, j) for j in range(40)))
    corpus = load_corpus(tmp_path, val_fraction=0.1, seq_len=32)
    train, val = as_bytes(corpus.train), as_bytes(corpus.val)
    assert len(corpus.val_files) == 5
    for name in corpus.val_files:
        i = int(Path(name).stem)
        assert b"file %d line" % i in val and b"file %d line" % i not in train


# ---- --data PATH -----------------------------------------------------------------------


def test_a_single_text_file(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    text = b"".join(b"line %d of the book\n" % i for i in range(2000))
    path.write_bytes(text)
    corpus = load_corpus(path, seq_len=16)
    assert corpus.sources == 1
    # one file cannot be split by files: it is cut at about val_fraction from its end
    assert as_bytes(corpus.train) + as_bytes(corpus.val) == text
    assert corpus.val.numel() == pytest.approx(0.02 * len(text), abs=1)
    assert load_corpus(str(path), seq_len=16).total_bytes == len(text)  # str works too


def test_a_folder_reads_every_text_file_recursively_and_splits_by_files(tmp_path: Path) -> None:
    write_files(tmp_path / "a", 10, 1000)
    write_files(tmp_path / "b" / "deep", 10, 1000)
    (tmp_path / "image.bin").write_bytes(b"\x89PNG\0\0\0" * 100)  # binary: skipped
    (tmp_path / ".hidden.txt").write_bytes(b"secret " * 100)  # hidden: skipped
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_bytes(b"[core]\n" * 100)
    (tmp_path / "empty.txt").write_bytes(b"")
    corpus = load_corpus(tmp_path, val_fraction=0.1, seq_len=32)
    assert corpus.sources == 20
    assert corpus.total_bytes == 20 * 1000 + 19  # plus one newline between files
    assert len(corpus.val_files) == 2  # whole files, the nearest to 10% of the bytes
    assert not set(corpus.train_files) & set(corpus.val_files)
    names = {Path(f).name for f in corpus.train_files + corpus.val_files}
    assert "image.bin" not in names and ".hidden.txt" not in names and "config" not in names
    val = as_bytes(corpus.val)
    for f in corpus.val_files:
        assert Path(f).read_bytes() in val


def test_folder_order_follows_the_seed(tmp_path: Path) -> None:
    write_files(tmp_path, 30, 200)
    a = load_corpus(tmp_path, seq_len=8, seed=0)
    assert load_corpus(tmp_path, seq_len=8, seed=0).train_files == a.train_files
    assert load_corpus(tmp_path, seq_len=8, seed=1).train_files != a.train_files


def test_a_few_large_files_are_cut_inside_a_file_not_handed_to_validation(tmp_path: Path) -> None:
    write_files(tmp_path, 2, 10_000)
    corpus = load_corpus(tmp_path, seq_len=16)
    assert corpus.val.numel() == pytest.approx(0.02 * corpus.total_bytes, abs=1)
    assert len(corpus.val_files) == 1 and corpus.val_files[0] in corpus.train_files


def test_validation_split_is_at_least_one_sequence(tmp_path: Path) -> None:
    write_files(tmp_path, 5, 100)
    corpus = load_corpus(tmp_path, seq_len=64, val_fraction=0.01)
    assert corpus.val.numel() >= 65 and corpus.train.numel() >= 65


def test_missing_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_corpus(tmp_path / "nope.txt")


def test_empty_folder_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no readable text"):
        load_corpus(tmp_path)
    (tmp_path / "blob").write_bytes(b"\0" * 100)
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ConfigError, match="no readable text"):
        load_corpus(tmp_path)


def test_binary_single_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"abc\0def" * 100)
    with pytest.raises(ConfigError, match="looks binary"):
        load_corpus(path)


def test_too_short_corpus_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * 200)
    with pytest.raises(ConfigError, match=r"only 200 bytes, which is too few.*at least 258 bytes"):
        load_corpus(path, seq_len=128)
    assert load_corpus(path, seq_len=99).total_bytes == 200
    with pytest.raises(ConfigError, match=r"a corpus limit of 100 bytes is too few"):
        load_corpus(max_bytes=100, seq_len=128)


@pytest.mark.parametrize(
    "kwargs", [{"max_bytes": 0}, {"val_fraction": 0.0}, {"val_fraction": 1.0}, {"seq_len": 0}]
)
def test_bad_arguments_are_config_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        load_corpus(**kwargs)  # type: ignore[arg-type]


def test_corpus_is_not_compared_by_tensor_truth() -> None:
    t = torch.zeros(3, dtype=torch.uint8)
    a = Corpus(train=t, val=t, sources=1)
    assert a == a and a != Corpus(train=t, val=t, sources=1)  # identity, never a tensor bool


# ---- batch sampling ------------------------------------------------------------------------


@pytest.fixture
def data() -> torch.Tensor:
    return torch.arange(1000, dtype=torch.int64).remainder(256).to(torch.uint8)


def test_sampler_shapes_dtypes_and_shifted_targets(data: torch.Tensor) -> None:
    sampler = BatchSampler(data, 32, seed=0)
    inputs, targets = sampler.sample(8)
    assert inputs.shape == targets.shape == (8, 32)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.is_contiguous() and targets.is_contiguous()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    # each row is a real window of the data: consecutive bytes of the stream
    assert torch.equal((targets - inputs).remainder(256), torch.ones_like(inputs))
    assert int(inputs.min()) >= 0 and int(targets.max()) <= 255


def test_sampler_windows_cover_the_whole_stream_and_stay_in_bounds() -> None:
    data = torch.arange(20, dtype=torch.uint8)
    sampler = BatchSampler(data, 4, seed=0)
    inputs, targets = sampler.sample(2000)
    starts = set(inputs[:, 0].tolist())
    assert starts == set(range(16))  # every start 0..len-seq_len-1, none beyond
    assert int(targets.max()) == 19


def test_sampler_is_deterministic_by_seed(data: torch.Tensor) -> None:
    def run(seed: int) -> list[torch.Tensor]:
        sampler = BatchSampler(data, 16, seed=seed)
        return [sampler.sample(4)[0] for _ in range(3)]

    assert all(torch.equal(x, y) for x, y in zip(run(7), run(7)))
    assert not all(torch.equal(x, y) for x, y in zip(run(7), run(8)))
    batches = run(7)
    assert not torch.equal(batches[0], batches[1])  # successive batches differ


def test_sampler_state_round_trip_resumes_the_sequence(data: torch.Tensor) -> None:
    sampler = BatchSampler(data, 16, seed=3)
    sampler.sample(4)
    state = sampler.state_dict()
    expected = [sampler.sample(4)[0] for _ in range(3)]
    resumed = BatchSampler(data, 16, seed=999)
    resumed.load_state_dict(state)
    assert all(torch.equal(x, resumed.sample(4)[0]) for x in expected)
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(data, 8).load_state_dict(state)


def test_sampler_refuses_bad_input(data: torch.Tensor) -> None:
    with pytest.raises(ConfigError, match="too few"):
        BatchSampler(data[:16], 16)
    BatchSampler(data[:17], 16).sample(1)  # exactly one window fits
    with pytest.raises(ValueError):
        BatchSampler(data.view(10, 100), 16)
    with pytest.raises(ValueError):
        BatchSampler(data, 16).sample(0)


def test_sampler_on_a_real_corpus() -> None:
    corpus = load_corpus(max_bytes=SMALL)
    inputs, targets = BatchSampler(corpus.train, 128, seed=0).sample(16)
    assert inputs.shape == (16, 128)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


# ---- validation windows ----------------------------------------------------------------


def test_val_batches_are_fixed_evenly_spaced_windows(data: torch.Tensor) -> None:
    batches = val_batches(data, 10, batch_size=4, n_batches=3)
    again = val_batches(data, 10, batch_size=4, n_batches=3)
    assert len(batches) == 3
    for (x, y), (x2, y2) in zip(batches, again):
        assert x.shape == y.shape == (4, 10) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])
    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    # windows from the first to the very last valid start (989), 89 bytes apart
    assert starts == [(i * 989 // 11) % 256 for i in range(12)]
    assert int(batches[-1][1][-1, -1]) == 999 % 256


def test_val_batches_single_window_and_errors(data: torch.Tensor) -> None:
    ((x, y),) = val_batches(data, 10, batch_size=1, n_batches=1)
    assert x[0, 0] == 0 and y.shape == (1, 10)
    with pytest.raises(ConfigError):
        val_batches(data[:10], 10, 1, 1)
    with pytest.raises(ValueError):
        val_batches(data, 10, 0, 1)


# ---- .jsonl, tokenizers, large files ---------------------------------------------------------


def test_jsonl_records_are_documents(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"record {i} " + "words " * 20, "meta": i}) for i in range(40)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:20]) + "\n\n")  # a blank line is skipped
    (tmp_path / "b.jsonl").write_text("\n".join(lines[20:]) + "\n")
    corpus = load_corpus(tmp_path, seq_len=16, val_fraction=0.1)
    assert corpus.sources == 40
    text = as_bytes(corpus.train) + b"\n" + as_bytes(corpus.val)
    assert all(b"record %d words" % i in text for i in range(40)) and b'"meta"' not in text
    assert 3 <= as_bytes(corpus.val).count(b"record ") <= 5  # whole records held out
    body = tmp_path / "body"
    body.mkdir()
    (body / "c.jsonl").write_text(json.dumps({"body": "x " * 200}) + "\n")
    assert load_corpus(body / "c.jsonl", seq_len=8, text_field="body").total_bytes == 400


@pytest.mark.parametrize(("line", "match"), [
    ("not json", r"line 2 is not a JSON object"),
    ("[1, 2]", r"line 2 is not a JSON object \(got list\)"),
    ('{"body": "x"}', r"line 2 has no string field 'text' \(its fields: body\); name the text's field with "
                      "--text-field"),
    ('{"text": 5}', r"line 2 has no string field 'text'"),
    ('{"text": NaN}', r"line 2 is not a JSON object"),
])
def test_a_malformed_jsonl_line_is_a_config_error_naming_it(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "fine " * 50}) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=match):
        load_corpus(tmp_path, seq_len=8)  # in a folder too: a structured file that does not parse is an error


def test_large_files_are_read_in_pieces_cut_after_line_breaks(tmp_path: Path) -> None:
    path = tmp_path / "big.txt"
    text = b"".join(b"line %d\n" % i for i in range(5000)) + b"no newline at the end"
    path.write_bytes(text)
    pieces = list(read_pieces([path], piece_bytes=1000))
    assert len(pieces) > 30 and pieces[0].first and not any(p.first for p in pieces[1:])
    assert b"".join(p.data for p in pieces) == text and sum(p.raw for p in pieces) == len(text)
    assert all(p.data.endswith(b"\n") for p in pieces[:-1])
    (tmp_path / "blob.bin").write_bytes(b"\0" * 50)
    skipped = list(read_pieces([tmp_path / "blob.bin"]))
    assert [(p.data, p.raw) for p in skipped] == [(b"", 50)]  # skipped, but counted as read


def test_a_bpe_corpus_holds_the_tokenizers_ids(tmp_path: Path) -> None:
    from tests.support.tokenizers import small_bpe

    tok_path = small_bpe(tmp_path)
    tok = HFTokenizer.from_file(tok_path)
    corpus = load_corpus(max_bytes=QUARTER, seq_len=64, tokenizer=tok_path)
    assert corpus.tokenizer == tok.digest and corpus.vocab_size == tok.vocab_size
    assert corpus.train.dtype == torch.int32 and 256 <= int(corpus.train.max()) < tok.vocab_size
    assert corpus.total_tokens < QUARTER * 0.7  # even a 600-token BPE compresses code
    # <|endoftext|> between two documents, wherever the held-out split begins
    assert int((corpus.train == 0).sum()) + int((corpus.val == 0).sum()) == corpus.sources - 1
    x, y = BatchSampler(corpus.train, 64, seed=0).sample(4)
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    same = load_corpus(max_bytes=QUARTER, seq_len=64, tokenizer=tok)  # a Tokenizer object works too
    assert torch.equal(same.train, corpus.train) and torch.equal(same.val, corpus.val)
    spec = replace(PRESETS["tiny"], vocab_size=tok.vocab_size, tokenizer=tok.digest)
    load_corpus(max_bytes=QUARTER, seq_len=64, tokenizer=tok_path, spec=spec)
    with pytest.raises(ConfigError, match=f"uses tokenizer {tok.digest}, but this trainer uses byte-level"):
        load_corpus(max_bytes=QUARTER, seq_len=64, spec=spec)
    with pytest.raises(ConfigError, match=f"uses byte-level tokens.*but --tokenizer .* uses tokenizer {tok.digest}"):
        load_corpus(max_bytes=QUARTER, seq_len=64, tokenizer=tok_path, spec=PRESETS["tiny"])


def test_a_sharded_sampler_starts_on_its_shard_stays_disjoint_and_moves_on() -> None:
    """Trainers start on the shards of their ranks (disjoint while they draw at similar rates), and move
    to the next shard after one pass over theirs, so a trainer alone still sees all of its data."""
    seq_len, count = 8, 4
    data = torch.arange(4 * 400, dtype=torch.long)  # each id says where it lies: shard k holds [400k, 400k + 400)
    samplers = [BatchSampler(data, seq_len, seed=k, shards=(k, count)) for k in range(count)]
    per_pass = 400 // seq_len  # 50 windows: one pass over a shard
    for _ in range(per_pass // 5):
        for k, s in enumerate(samplers):
            x, y = s.sample(5)
            assert torch.equal(x[:, 1:], y[:, :-1])
            assert bool(((y // 400) == k).all()), k  # every window, targets included, inside shard k
    assert [s.current_shard for s in samplers] == [1, 2, 3, 0]  # one pass each: all moved on, still disjoint
    lone = BatchSampler(data, seq_len, seed=9, shards=(2, count))
    seen = {int(lone.sample(per_pass)[1][0, 0]) // 400 for _ in range(count)}
    assert seen == {0, 1, 2, 3}  # alone, it covers the whole split
    state = lone.state_dict()
    resumed = BatchSampler(data, seq_len, seed=0, shards=(2, count))
    resumed.load_state_dict(state)
    assert resumed.current_shard == lone.current_shard == 2 and torch.equal(resumed.sample(3)[0], lone.sample(3)[0])
    assert BatchSampler(data[:35], seq_len, shards=(1, count)).current_shard is None  # 8 ids a shard: too few to cut
    plain, whole = BatchSampler(data, seq_len, seed=5), BatchSampler(data, seq_len, seed=5, shards=(0, 1))
    assert torch.equal(plain.sample(6)[0], whole.sample(6)[0])  # one shard is the whole split, drawn as before
    with pytest.raises(ValueError, match="shard index"):
        BatchSampler(data, seq_len, shards=(4, count))
