"""``swarmd`` as a user runs it: a subprocess through the real CLI, real HTTP, real signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import httpx
import pytest
import torch

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


def test_port_in_use_exits_1_with_a_sentence(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_cli("--api-port", str(port), "--port", "0", "--state-dir", str(tmp_path))
    assert out.returncode == 1
    assert "swarmd: error: cannot start" in out.stderr and "port" in out.stderr


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
