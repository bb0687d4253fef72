"""``swarmd`` as a user runs it: a subprocess through the real CLI, real HTTP, real signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest
import torch

from swarmd.local_swarm import DaemonProcess, DaemonStartError
from swarmd.net.wire import CONTENT_TYPE, decode_frame, encode_frame
from swarmd.pipeline.model import build_stage
from tests.conftest import TINY, swarmd_command


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*swarmd_command(), *args], capture_output=True, text=True, timeout=60)


def test_help_explains_every_flag() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for flag in ("--stage", "--model", "--host", "--port", "--api-host", "--api-port", "--swarm",
                 "--device", "--log-level", "--threads", "--ready-file", "--drain-timeout", "--join",
                 "--dht-host", "--dht-port", "--announce-period", "--bootstrap-timeout", "--state-dir"):
        assert flag in out.stdout, flag


def test_help_lists_the_commands_first_one_line_each() -> None:
    from swarmd.cli import COMMANDS

    out = run_cli("--help").stdout.splitlines()
    assert out[0] == "usage: swarmd [COMMAND] [FLAGS]"
    flags_from = out.index("options:")
    for name, command in COMMANDS.items():
        shown = "[serve]" if name == "serve" else name
        line = next(i for i, text in enumerate(out) if text.startswith(f"  swarmd {shown} "))
        assert line < flags_from and out[line].endswith(f" {command.summary}"), out[line]


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--stage", "x"], "not a stage"),
        (["--stage", "-1"], "not a stage"),
        (["--join", "localhost"], "not HOST:PORT"),
        (["--join", "127.0.0.1:0"], "port 0"),
        (["--join", "127.0.0.1:99999"], "not a port number"),
        (["--announce-period", "0"], "positive number of seconds"),
        (["--bootstrap-timeout", "soon"], "not a number of seconds"),
        (["--port", "70000"], "not a port number"),
        (["--api-port", "http"], "not a port number"),
        (["--model", "enormous"], "enormous"),
        (["--model", "tiny", "--stage", "2"], "out of range"),
        (["--device", "tpu"], "invalid choice"),
        (["--log-level", "loud"], "invalid choice"),
        (["--bogus"], "unrecognized arguments"),
        (["--drain-timeout", "nan"], "drain-timeout"),
    ],
)
def test_bad_flags_exit_2_with_one_sentence(args: list[str], phrase: str) -> None:
    out = run_cli(*args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("swarmd: error: ") and phrase in lines[0]


def test_model_file_errors_exit_2(tmp_path) -> None:
    bad = tmp_path / "model.json"
    bad.write_text("{not json")
    out = run_cli("--model", str(bad))
    assert out.returncode == 2 and "swarmd: error:" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_daemon_serves_status_survives_garbage_and_exits_0_on_sigterm(spawn) -> None:
    d = spawn("--stage", "0", "--model", "tiny", "--swarm", "cli-test")
    info = d.wait_ready()
    status = httpx.get(f"{d.api}/status").json()
    for key in ("peer_id", "stage", "state", "swarm", "model", "step", "queue", "throughput",
                "data_addr", "version", "uptime_s"):
        assert key in status, key
    assert status["state"] == "serving" and status["swarm"] == "cli-test"
    assert status["data_addr"] == info["data_addr"] and status["model"]["digest"] == TINY.digest
    assert "data plane listening on http://" + info["data_addr"] in d.log()

    for _ in range(20):
        r = httpx.post(f"{d.data}/v1/forward", content=os.urandom(512), headers={"Content-Type": CONTENT_TYPE})
        assert 400 <= r.status_code < 500 and r.json()["message"]

    x = torch.randint(0, 256, (2, 8))
    r = httpx.post(f"{d.data}/v1/forward", content=encode_frame("forward", {"stage": 0}, {"inputs": x}),
                   headers={"Content-Type": CONTENT_TYPE})
    assert r.status_code == 200
    with torch.no_grad():
        assert torch.equal(decode_frame(r.content).tensors["outputs"], build_stage(TINY, 0)(x))
    assert d.terminate() == 0
    assert "stopped" in d.log()


def test_sigterm_during_a_long_request_completes_it_then_exits_0(spawn) -> None:
    d = spawn("--stage", "0", "--model", "tiny")
    d.wait_ready()
    x = torch.randint(0, 256, (4, 32))
    body = encode_frame("forward", {"stage": 0}, {"inputs": x})
    host, port = d.info["data_addr"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (f"POST /v1/forward HTTP/1.1\r\nHost: {host}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        sock.sendall(head + body[: len(body) // 2])
        deadline = time.monotonic() + 10
        while httpx.get(f"{d.api}/status").json()["in_flight"] < 1:
            assert time.monotonic() < deadline, "the request never reached the handler"
            time.sleep(0.02)
        d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(f"{d.api}/status").json()["state"] != "draining":
            assert time.monotonic() < deadline, "SIGTERM did not start draining"
            time.sleep(0.02)
        assert d.proc.poll() is None  # still waiting for our request
        sock.sendall(body[len(body) // 2 :])
        response = b""
        while chunk := sock.recv(1 << 16):
            response += chunk
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    with torch.no_grad():
        assert torch.equal(decode_frame(payload).tensors["outputs"], build_stage(TINY, 0)(x))
    assert d.proc.wait(30) == 0
    d.close()


def test_ready_file_is_json_with_the_bound_addresses(spawn) -> None:
    d = spawn("--stage", "1", "--model", "tiny")
    info = d.wait_ready()
    assert info["stage"] == 1 and json.loads(d.ready_file.read_text()) == info
    assert info["api_addr"].startswith("127.0.0.1:") and not info["api_addr"].endswith(":0")
    assert d.terminate() == 0


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--steps", "0"], "must be at least 1"),
        (["--codec", "zip"], "invalid choice"),
        (["--stage-wait-timeout", "-3"], "positive number of seconds"),
        (["--verify-fraction", "1.5"], "a number in [0, 1]"),
        (["--window", "0"], "at least 1) or auto"),
        (["--window", "many"], "at least 1) or auto"),
    ],
)
def test_train_bad_flags_exit_2_with_one_sentence(args: list[str], phrase: str) -> None:
    out = run_cli("train", *args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("swarmd train: error: ") and phrase in lines[0], out.stderr


def test_train_against_no_daemon_exits_1_naming_the_address() -> None:
    out = run_cli("train", "--api", "http://127.0.0.1:9", "--steps", "1")
    assert out.returncode == 1
    assert "cannot register with the daemon at http://127.0.0.1:9" in out.stderr


def test_control_plane_off_loopback_needs_a_token(tmp_path) -> None:
    out = run_cli("--api-host", "0.0.0.0", "--state-dir", str(tmp_path))
    assert out.returncode == 2 and "--api-token-file" in out.stderr
    short = tmp_path / "token"
    short.write_text("abc\n")
    out = run_cli("--api-host", "0.0.0.0", "--api-token-file", str(short), "--state-dir", str(tmp_path))
    assert out.returncode == 2 and "shorter than 16 characters" in out.stderr


# --- the command line's own weight: fast --help, and no test-only package needed -----------------

HEAVY = ("torch", "bitsandbytes", "fastapi")


@pytest.mark.parametrize("command", [[], ["serve"], ["train"], ["demo"]], ids=["swarmd", "serve", "train", "demo"])
def test_help_imports_no_torch(command: list[str]) -> None:
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "swarmd", *command, "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: swarmd" in out.stdout, out.stderr[-2000:]
    # -X importtime: one "import time: self | cumulative | module" line per module imported
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "swarmd.cli.common" in imported  # the measurement works
    assert not {m for m in imported if m.split(".")[0] in HEAVY}, sorted(m for m in imported if "torch" in m)[:5]


# What `pip install swarmd` without the test extra gives: site-packages without the test-only
# packages. Not a sys.meta_path blocker: torch probes importlib.util.find_spec("hypothesis"), which
# must answer None (not installed), not raise. Every module of swarmd is imported (what the demo
# runs in its own process and in its daemons; not __main__, which would run a daemon) and
# `swarmd demo --help` is run.
TEST_ONLY = ("httpx", "pytest", "_pytest", "py.py", "hypothesis", "_hypothesis", "schemathesis")
WITHOUT_TEST_EXTRAS = r"""
import importlib, importlib.util, pkgutil, sys

for name in ("httpx", "pytest", "hypothesis", "schemathesis"):
    if importlib.util.find_spec(name) is not None:
        raise SystemExit(f"{name} is importable: the test's site-packages is wrong")
import swarmd
names = sorted(m.name for m in pkgutil.walk_packages(swarmd.__path__, "swarmd.") if m.name != "swarmd.__main__")
for name in names:
    importlib.import_module(name)
print("imported", len(names), "modules:", " ".join(names))
from swarmd.cli import main
try:
    main(["demo", "--help"])
except SystemExit as exc:
    assert exc.code == 0, exc.code
"""


def site_without_test_packages(tmp_path: Path) -> Path:
    """A copy of this venv's site-packages, as symlinks, without the test extra's packages."""
    site = tmp_path / "site-packages"
    site.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name.lower().startswith(TEST_ONLY) or entry.suffix == ".pth" or entry.name.startswith("__editable"):
            continue
        (site / entry.name).symlink_to(entry)
    return site


def test_swarmd_needs_no_test_only_package(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(site_without_test_packages(tmp_path))])}
    out = subprocess.run([sys.executable, "-S", "-c", WITHOUT_TEST_EXTRAS], capture_output=True, text=True,
                         timeout=120, env=env, cwd=repo)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage: swarmd demo" in out.stdout
    assert all(f" {m}" in out.stdout for m in ("swarmd.cli.demo", "swarmd.local_swarm", "swarmd.daemon"))


def test_serve_is_the_default_command_and_has_its_own_name() -> None:
    out = run_cli("serve", "--stage", "x")
    assert out.returncode == 2
    assert out.stderr.strip() == ("swarmd serve: error: argument --stage: 'x' is not a stage: give a number or "
                                  "'auto'. See 'swarmd serve --help'.")
    assert run_cli("--version").stdout.startswith("swarmd ")




def test_the_harness_reports_a_child_that_dies_with_its_log(tmp_path) -> None:
    d = DaemonProcess(["--model", "enormous"], tmp_path, name="doomed")
    with d, pytest.raises(DaemonStartError) as failure:
        d.wait_ready(60)
    assert "swarmd doomed exited with 2" in str(failure.value) and "enormous" in str(failure.value)
    assert d.ready_file == tmp_path / "doomed.json" and d.log_path == tmp_path / "doomed.log"


async def test_the_harness_starts_reads_status_and_stops_a_daemon(tmp_path) -> None:
    with DaemonProcess(["--model", "tiny", "--stage", "0", "--swarm", "harness"], tmp_path) as d:
        info = await d.wait_ready_async(60)
        assert d.state_dir.is_dir() and (await d.status_async())["peer_id"] == info["peer_id"]
        assert d.stop() == 0 and not d.running()
