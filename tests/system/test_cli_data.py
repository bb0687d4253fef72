"""The data commands through the real CLI: ``swarmd tokenizer``, ``swarmd data``, the trainer's and
founder's ``--tokenizer``, ``swarmd generate --tokenizer``, and an end-to-end run on a real swarm."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from swarmd.cli import data as data_cli
from swarmd.cli import export as export_cli
from swarmd.cli import generate as generate_cli
from swarmd.cli import serve as serve_cli
from swarmd.cli import tokenizer as tokenizer_cli
from swarmd.cli import train as train_cli
from swarmd.errors import ConfigError
from swarmd.pipeline.spec import PRESETS
from swarmd.train.data import stdlib_root
from swarmd.train.tokenizer import file_digest
from tests.conftest import DaemonProcess
from tests.support.tokenizers import small_bpe

HEAVY = ("torch", "tokenizers", "numpy", "bitsandbytes", "fastapi")


@pytest.mark.parametrize("command", [["tokenizer"], ["tokenizer", "train"], ["data"], ["data", "prepare"]],
                         ids=["tokenizer", "tokenizer-train", "data", "data-prepare"])
def test_help_imports_nothing_heavy(command: list[str]) -> None:
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "swarmd", *command, "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: swarmd" in out.stdout, out.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "swarmd.cli.common" in imported
    assert not {m for m in imported if m.split(".")[0] in HEAVY}


def corpus(root: Path) -> Path:
    """A few stdlib modules copied into a folder, plus a .jsonl file: the sources --data reads."""
    root.mkdir()
    for name in ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py"):
        (root / name.replace("/", "_")).write_bytes((stdlib_root() / name).read_bytes())
    (root / "notes.jsonl").write_text("".join(json.dumps({"text": f"note {i}: remember the milk"}) + "\n"
                                              for i in range(50)))
    return root


def test_tokenizer_train_and_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = corpus(tmp_path / "src")
    out = tmp_path / "tok.json"
    assert tokenizer_cli.main(["train", "--data", str(src), "--vocab-size", "700", "--out", str(out)]) == 0
    digest = file_digest(out)
    assert digest in capsys.readouterr().out
    assert tokenizer_cli.main(["info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"file": str(out), "digest": digest, "vocab_size": 700}
    # the same data, the same file: two machines agree
    again = tmp_path / "again.json"
    assert tokenizer_cli.main(["train", "--data", str(src), "--vocab-size", "700", "--out", str(again)]) == 0
    assert file_digest(again) == digest


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "--data", "{tmp}/nope", "--vocab-size", "500", "--out", "{tmp}/t.json"], "does not exist"),
    (["train", "--vocab-size", "100", "--out", "{tmp}/t.json", "--max-bytes", "1000"], "--vocab-size must lie in"),
    (["train", "--vocab-size", "500", "--out", "{tmp}/exists.json", "--max-bytes", "1000"], "already exists"),
    (["train", "--vocab-size", "500", "--out", "{tmp}/no/such/dir/t.json"], "does not exist"),
    (["info", "{tmp}/exists.json"], "not strict JSON"),
])
def test_tokenizer_errors_exit_2_with_a_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 argv: list[str], message: str) -> None:
    (tmp_path / "exists.json").write_text("not json")
    assert tokenizer_cli.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("swarmd tokenizer ") and message in err and len(err.strip().splitlines()) == 1


def test_data_prepare_and_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = corpus(tmp_path / "src")
    tok = small_bpe(tmp_path)
    out = tmp_path / "shards"
    good = ["prepare", "--data", str(src), "--tokenizer", str(tok), "--out", str(out), "--val-fraction", "0.05",
            "--shard-tokens", "10000", "--json", "--no-progress"]
    assert data_cli.main(good) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokenizer"] == file_digest(tok) and summary["dtype"] == "uint16" and summary["shards"] >= 3
    assert summary["train_tokens"] > 10 * summary["val_tokens"] > 0 and summary["mb_per_s"] > 0
    assert summary["documents"]["train"] + summary["documents"]["val"] >= 54  # 4 files + 50 records
    assert data_cli.main(["info", str(out)]) == 0
    assert f"{summary['train_tokens']} training" in capsys.readouterr().out
    # errors: one sentence, exit 2
    for argv, message in [
        (good, "not an empty folder"),
        (["prepare", "--data", str(src), "--tokenizer", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o")],
         "does not exist"),
        (["prepare", "--data", str(src), "--out", str(tmp_path / "o2"), "--text-field", "body"],
         "no string field 'body'"),
        (["info", str(src)], "no readable index.json"),
    ]:
        assert data_cli.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(SystemExit) as exit_:  # argparse: a bad value
        data_cli.main(["prepare", "--out", str(tmp_path / "o3"), "--val-fraction", "2"])
    assert exit_.value.code == 2 and "strictly between 0 and 1" in capsys.readouterr().err


def test_train_flags_map_onto_the_trainer_config(tmp_path: Path) -> None:
    parse = train_cli.build_parser().parse_args
    tok, data = str(small_bpe(tmp_path)), tmp_path / "corpus"
    data.mkdir()  # the files must exist: they are checked before the trainer calls a daemon
    config = train_cli.config_from_args(parse(["--data", str(data), "--tokenizer", tok, "--text-field", "body",
                                               "--data-shards", "4", "--shard", "3", "--lease-s", "12"]))
    assert (config.data, config.tokenizer, config.text_field) == (str(data), tok, "body")
    assert (config.data_shards, config.shard, config.lease_s) == (4, 3, 12.0)
    defaults = train_cli.config_from_args(parse([]))
    assert (defaults.tokenizer, defaults.text_field, defaults.data_shards, defaults.shard) == (None, "text", 16, None)
    with pytest.raises(ConfigError, match="--shard 4 is out of range"):
        train_cli.config_from_args(parse(["--data-shards", "4", "--shard", "4"]))
    with pytest.raises(ConfigError, match="no effect with --sync"):
        train_cli.config_from_args(parse(["--shard", "1", "--sync"]))
    with pytest.raises(ConfigError, match="--lease-s must lie in"):
        train_cli.config_from_args(parse(["--lease-s", "0.1"]))


def test_a_founder_takes_the_tokenizers_vocabulary_and_digest(tmp_path: Path) -> None:
    tok = small_bpe(tmp_path)
    parse = serve_cli.build_parser().parse_args
    base = ["--tokenizer", str(tok), "--state-dir", str(tmp_path / "s"), "--device", "cpu"]
    spec = serve_cli.config_from_args(parse(base)).pipeline.spec
    assert spec is not None and spec.tokenizer == file_digest(tok) and spec.vocab_size == 600
    assert spec.d_model == PRESETS["tiny"].d_model and spec.digest != PRESETS["tiny"].digest
    small = serve_cli.config_from_args(parse([*base, "--model", "small"])).pipeline.spec
    assert small is not None and small.d_model == PRESETS["small"].d_model and small.tokenizer == spec.tokenizer
    with pytest.raises(ConfigError, match="a joiner serves the swarm's model"):
        serve_cli.config_from_args(parse([*base, "--join", "127.0.0.1:9"]))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a Hugging Face tokenizers file"):
        serve_cli.config_from_args(parse(["--tokenizer", str(tmp_path / "bad.json"), "--state-dir", str(tmp_path)]))


@pytest.mark.slow  # ~10 s on an idle machine (two daemon processes); the default run's variant, in-process
# daemons founded the way --tokenizer founds them, is tests/integration/test_equivalence_bpe.py
def test_prepare_then_train_on_a_swarm_founded_with_the_tokenizer(
    tmp_path: Path, spawn: Callable[..., DaemonProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    """The user's path: train a tokenizer, found a swarm with it, prepare shards, train on them through
    the real CLI, export and sample; trainers with another tokenizer are refused, naming both digests."""
    src = corpus(tmp_path / "src")
    tok = tmp_path / "tok.json"
    assert tokenizer_cli.main(["train", "--data", str(src), "--vocab-size", "512", "--out", str(tok)]) == 0
    digest = file_digest(tok)
    founder = spawn("--stage", "0", "--model", "tiny", "--tokenizer", str(tok), "--swarm", "bpe",
                    "--announce-period", "1", "--target-batch-size", "8", "--lr", "3e-3")
    info = founder.wait_ready()
    spawn("--stage", "1", "--join", info["dht_addr"], "--swarm", "bpe", "--announce-period", "1").wait_ready()
    shards = tmp_path / "shards"
    assert data_cli.main(["prepare", "--data", str(src), "--tokenizer", str(tok), "--out", str(shards),
                          "--val-fraction", "0.05", "--no-progress"]) == 0
    capsys.readouterr()
    api = founder.api
    common = ["--api", api, "--steps", "3", "--sync", "--codec", "none", "--microbatch-size", "4", "--val-every", "0",
              "--json"]
    assert train_cli.main([*common, "--data", str(shards), "--tokenizer", str(tok)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["microbatches_issued"] == summary["microbatches_completed"]
    assert all(math.isfinite(x) for x in summary["step_losses"]) and summary["val_loss"] is not None
    assert summary["step_losses"][0] == pytest.approx(math.log(512), rel=0.05)  # ids over the BPE's vocabulary
    # a byte-level trainer, and a trainer with another tokenizer: refused with both digests, exit 2
    other = tmp_path / "other.json"
    assert tokenizer_cli.main(["train", "--data", str(src), "--vocab-size", "300", "--out", str(other)]) == 0
    capsys.readouterr()
    refused = [a for a in common if a != "--sync"]  # (a refused trainer's registration lingers: no --sync after it)
    for extra in ([], ["--tokenizer", str(other)], ["--data", str(shards), "--tokenizer", str(other)]):
        assert train_cli.main([*refused, *extra]) == 2
        err = capsys.readouterr().err
        assert digest in err and len(err.strip().splitlines()) == 1, err
        assert "byte-level" in err or file_digest(other) in err
    # export the trained model and sample from it with its tokenizer (and not without it)
    model = tmp_path / "model.safetensors"
    assert export_cli.main(["--api", api, "--out", str(model), "--no-progress"]) == 0
    capsys.readouterr()
    assert generate_cli.main(["--model", str(model), "--tokenizer", str(tok), "--prompt", "def ", "--tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert generate_cli.main(["--model", str(model), "--prompt", "def "]) == 2
    err = capsys.readouterr().err
    assert digest in err and "--tokenizer" in err


def test_generate_decodes_with_the_models_tokenizer_and_refuses_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from swarmd.export import ExportedModel, write_model
    from swarmd.pipeline.model import build_stage, tensors_digest

    tok = small_bpe(tmp_path)
    spec = serve_cli.with_tokenizer("tiny", tok, joining=False)
    exported = ExportedModel(spec)
    for k in range(spec.n_stages):
        params = {n: p.detach() for n, p in build_stage(spec, k).named_parameters()}
        exported.add(k, params, step=0, digest=tensors_digest(params.items()), source="a fresh init")
    model = tmp_path / "model.safetensors"
    write_model(exported, model)
    argv = ["--model", str(model), "--prompt", "def main():", "--tokens", "12", "--seed", "3"]
    assert generate_cli.main([*argv, "--tokenizer", str(tok)]) == 0
    sample = capsys.readouterr().out
    assert sample.startswith("def main():") and len(sample) > len("def main():")  # BPE ids decoded to text
    assert generate_cli.main([*argv, "--tokenizer", str(tok)]) == 0 and capsys.readouterr().out == sample  # seeded
    assert generate_cli.main(argv) == 2  # no --tokenizer: byte-level, not the model's
    err = capsys.readouterr().err
    assert spec.tokenizer in err and "--tokenizer FILE" in err and len(err.strip().splitlines()) == 1
    other = tmp_path / "other"
    other.mkdir()
    assert generate_cli.main([*argv, "--tokenizer", str(small_bpe(other, vocab_size=300))]) == 2
    assert spec.tokenizer in capsys.readouterr().err


def test_train_exits_2_with_a_sentence_on_bad_data_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in [(["--lease-s", "0.1"], "--lease-s must lie in [0.5, 300]"),
                          (["--data-shards", "2", "--shard", "5"], "--shard 5 is out of range")]:
        assert train_cli.main(["--api", "http://127.0.0.1:9", *argv]) == 2  # refused before any connection
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
