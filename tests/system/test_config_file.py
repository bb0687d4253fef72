"""``swarmd --config FILE.toml``: every flag settable in a file, flags win, bad files fail in one sentence."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from swarmd.cli import serve, train
from swarmd.cli.config_file import parse_args, settable_options
from tests.conftest import swarmd_command

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "swarmd.example.toml"

# every serve flag: (its value in a file, the same setting as flags); none is the flag's default
SERVE_SAMPLES: dict[str, tuple[Any, list[str]]] = {
    "join": (["127.0.0.1:31337", "[::1]:31338"], ["--join", "127.0.0.1:31337", "--join", "[::1]:31338"]),
    "announce": ("[2001:db8::7]:7000", ["--announce", "[2001:db8::7]:7000"]),
    "relay-max-peers": (2, ["--relay-max-peers", "2"]),
    "relay-budget": (12.5, ["--relay-budget", "12.5"]),
    "stage": (1, ["--stage", "1"]),
    "model": ("tiny", ["--model", "tiny"]),
    "tokenizer": ("/etc/swarmd/tokenizer.json", ["--tokenizer", "/etc/swarmd/tokenizer.json"]),
    "swarm": ("from-a-file", ["--swarm", "from-a-file"]),
    "target-batch-size": (16, ["--target-batch-size", "16"]),
    "lr": (0.002, ["--lr", "0.002"]),
    "optimizer": ("lamb", ["--optimizer", "lamb"]),
    "warmup-steps": (3, ["--warmup-steps", "3"]),
    "delay-updates": (True, ["--delay-updates"]),
    "averaging-timeout": (12.5, ["--averaging-timeout", "12.5"]),
    "grad-codec": ("8bit", ["--grad-codec", "8bit"]),
    "averaging": ("allreduce", ["--averaging", "allreduce"]),
    "host": ("0.0.0.0", ["--host", "0.0.0.0"]),
    "port": (31330, ["--port", "31330"]),
    "api-host": ("::1", ["--api-host", "::1"]),
    "swarm-key": ("/etc/swarmd/swarm.key", ["--swarm-key", "/etc/swarmd/swarm.key"]),
    "api-token-file": ("/etc/swarmd/api.token", ["--api-token-file", "/etc/swarmd/api.token"]),
    "api-port": (8081, ["--api-port", "8081"]),
    "dht-host": ("0.0.0.0", ["--dht-host", "0.0.0.0"]),
    "dht-port": (31337, ["--dht-port", "31337"]),
    "announce-period": (2, ["--announce-period", "2"]),
    "bootstrap-timeout": (60, ["--bootstrap-timeout", "60"]),
    "dht-source-quota": (16, ["--dht-source-quota", "16"]),
    "dht-source-grouping": ("address", ["--dht-source-grouping", "address"]),
    "state-dir": ("/var/lib/swarmd", ["--state-dir", "/var/lib/swarmd"]),
    "rebalance-policy": ("swarm", ["--rebalance-policy", "swarm"]),
    "rebalance-period": (120, ["--rebalance-period", "120"]),
    "checkpoint-every": (10, ["--checkpoint-every", "10"]),
    "keep-checkpoints": (5, ["--keep-checkpoints", "5"]),
    "device": ("cpu", ["--device", "cpu"]),
    "precision": ("bf16", ["--precision", "bf16"]),
    "partition": ("balanced", ["--partition", "balanced"]),
    "threads": (3, ["--threads", "3"]),
    "drain-timeout": (5, ["--drain-timeout", "5"]),
    "ready-file": ("/run/swarmd/ready.json", ["--ready-file", "/run/swarmd/ready.json"]),
    "log-level": ("debug", ["--log-level", "debug"]),
    "log-format": ("json", ["--log-format", "json"]),
}


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string, for these plain values
    return repr(value)


def write_toml(path: Path, values: dict[str, Any]) -> Path:
    path.write_text("".join(f"{key} = {toml_value(value)}\n" for key, value in values.items()))
    return path


def parsed(argv: list[str], parser: argparse.ArgumentParser | None = None) -> dict[str, Any]:
    args = vars(parse_args(parser or serve.build_parser(), argv))
    args.pop("config")
    return args


def usage_error(capsys: pytest.CaptureFixture[str], argv: list[str],
                parser: argparse.ArgumentParser | None = None) -> str:
    """The one line a bad file prints; fails unless parsing exits 2."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(parser or serve.build_parser(), argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_every_serve_flag_is_accepted_from_a_file(tmp_path: Path) -> None:
    assert set(SERVE_SAMPLES) == set(settable_options(serve.build_parser())), "a serve flag has no sample here"
    # half the keys spelled with underscores: both spellings name the same flag
    values = {(k.replace("-", "_") if i % 2 else k): v for i, (k, (v, _)) in enumerate(SERVE_SAMPLES.items())}
    path = write_toml(tmp_path / "all.toml", values)
    flags = [flag for _, argv in SERVE_SAMPLES.values() for flag in argv]
    from_file, from_flags, defaults = parsed(["--config", str(path)]), parsed(flags), parsed([])
    assert from_file == from_flags
    assert all(from_file[dest] != defaults[dest] for dest in from_file), "a sample equals its flag's default"


def test_flags_on_the_command_line_override_the_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path / "s.toml", {"api-port": 8081, "log_level": "debug", "join": ["10.0.0.1:31337"],
                                           "swarm": "file"})
    for argv in (["--config", str(path), "--api-port", "9000", "--join", "10.0.0.2:1"],
                 ["--api-port", "9000", "--join", "10.0.0.2:1", "--config", str(path)]):
        args = parsed(argv)
        assert args["api_port"] == 9000 and args["join"] == [("10.0.0.2", 1)]  # the flags
        assert args["log_level"] == "DEBUG" and args["swarm"] == "file"  # the file, where no flag was given


def test_join_takes_a_list_or_one_address(tmp_path: Path) -> None:
    many = write_toml(tmp_path / "many.toml", {"join": ["10.0.0.1:31337", "peer.example.org:31338"]})
    assert parsed(["--config", str(many)])["join"] == [("10.0.0.1", 31337), ("peer.example.org", 31338)]
    one = write_toml(tmp_path / "one.toml", {"join": "10.0.0.1:31337"})
    assert parsed(["--config", str(one)])["join"] == [("10.0.0.1", 31337)]


def test_a_flag_without_a_value_takes_true_or_false(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for value in (True, False):
        path = write_toml(tmp_path / f"{value}.toml", {"delay-updates": value})
        assert parsed(["--config", str(path)])["delay_updates"] is value
    line = usage_error(capsys, ["--config", str(write_toml(tmp_path / "x.toml", {"delay-updates": "yes"}))])
    assert "delay-updates" in line and "true or false" in line


def test_an_unknown_key_is_named_with_the_nearest_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_toml(tmp_path / "typo.toml", {"api-prot": 8081})
    line = usage_error(capsys, ["--config", str(path)])
    assert line.startswith("swarmd: error: ") and str(path) in line
    assert "unknown key 'api-prot'" in line and "did you mean 'api-port'" in line
    far = usage_error(capsys, ["--config", str(write_toml(tmp_path / "far.toml", {"colour": "blue"}))])
    assert "unknown key 'colour'" in far and "did you mean" not in far
    nested = tmp_path / "nested.toml"
    nested.write_text("[serve]\nport = 1\n")
    assert "unknown key 'serve'" in usage_error(capsys, ["--config", str(nested)])


@pytest.mark.parametrize(
    ("key", "value", "phrase"),
    [
        ("api-port", 70000, "70000 is not a port number"),  # the very sentence the flag gives
        ("stage", "x", "'x' is not a stage"),
        ("join", ["localhost"], "not HOST:PORT"),
        ("announce-period", 0, "positive number of seconds"),
        ("device", "tpu", "invalid choice: 'tpu'"),
        ("threads", 2.5, "not an integer"),
        ("port", [1, 2], "one value, not a list"),
        ("model", True, "not true or false"),
    ],
)
def test_a_bad_value_fails_like_the_flag_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: Any, phrase: str
) -> None:
    path = write_toml(tmp_path / "bad.toml", {key: value})
    line = usage_error(capsys, ["--config", str(path)])
    assert line.startswith("swarmd: error: ") and f"{path}: {key}: " in line and phrase in line, line


def test_a_key_given_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_toml(tmp_path / "twice.toml", {"api-port": 1, "api_port": 2})
    assert "both set --api-port" in usage_error(capsys, ["--config", str(path)])


def test_bad_toml_names_the_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.toml"
    path.write_text('swarm = "ok"\napi-port = \n')
    line = usage_error(capsys, ["--config", str(path)])
    assert str(path) in line and "not valid TOML" in line and "line 2" in line


def test_a_missing_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere.toml"
    line = usage_error(capsys, ["--config", str(missing)])
    assert f"cannot read config file {missing}" in line and "No such file" in line


def test_train_reads_a_config_file_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_toml(tmp_path / "train.toml", {"steps": 7, "codec": "none", "sync": True, "api": "http://h:1"})
    args = parsed(["--config", str(path), "--steps", "9"], train.build_parser())
    assert (args["steps"], args["codec"], args["sync"], args["api"]) == (9, "none", True, "http://h:1")
    bad = write_toml(tmp_path / "bad.toml", {"steps": 0})
    line = usage_error(capsys, ["--config", str(bad)], train.build_parser())
    assert line.startswith("swarmd train: error: ") and "steps: 0 must be at least 1" in line


def test_the_example_file_matches_the_flags(tmp_path: Path) -> None:
    """docs/swarmd.example.toml through the real parser and config mapping (its secrets swapped for test files)."""
    token, key = tmp_path / "api.token", tmp_path / "swarm.key"
    token.write_text("a-long-random-control-plane-token\n")
    key.write_text("c3dhcm1kIHRlc3Qgc3dhcm0ga2V5IG9mIDMyIGJ5dGVz\n")
    key.chmod(0o600)
    example = parsed(["--config", str(EXAMPLE)])
    assert example["join"] and example["state_dir"] is not None and example["swarm_key"] is not None
    args = parse_args(serve.build_parser(), ["--config", str(EXAMPLE), "--api-token-file", str(token),
                                             "--swarm-key", str(key), "--state-dir", str(tmp_path / "state")])
    config = serve.config_from_args(args)
    assert config.dht.join == tuple(example["join"]) and config.api.token is not None
    assert config.swarm_key is not None and config.rebalance.policy == example["rebalance_policy"]


def test_a_daemon_serves_what_its_config_file_says(spawn, tmp_path: Path) -> None:  # noqa: ANN001
    path = write_toml(tmp_path / "daemon.toml", {"model": "tiny", "stage": 1, "swarm": "configured",
                                                "announce_period": 5})
    d = spawn("--config", str(path))
    info = d.wait_ready()
    assert info["swarm"] == "configured" and info["stage"] == 1
    assert d.terminate() == 0


def test_bad_config_exits_2_through_the_real_cli(tmp_path: Path) -> None:
    path = write_toml(tmp_path / "bad.toml", {"api-port": "http"})
    for command in ([], ["serve"], ["train"]):
        out = subprocess.run([*swarmd_command(), *command, "--config", str(path)], capture_output=True, text=True,
                             timeout=60)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr
        assert (f"{path}: api-port: 'http' is not a port number" in lines[0]) == (command != ["train"]), lines
        assert command != ["train"] or "unknown key 'api-port'" in lines[0]
