"""Swarm membership end to end: daemons started through the CLI find each other over the DHT."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from swarmd.pipeline.spec import PRESETS
from tests.conftest import DaemonProcess, swarmd_command

PERIOD = "1"  # announce period (s): records expire after 3 s
EXPIRY_S = 3.0


def swarm_of(d: DaemonProcess) -> dict:
    r = httpx.get(f"{d.api}/swarm", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def peers_by_id(view: dict) -> dict[str, tuple[int, str]]:
    return {p["peer_id"]: (s["stage"], p["state"]) for s in view["stages"] for p in s["peers"]}


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` until it holds; return the seconds it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.1)
    return time.monotonic() - start


def test_three_daemons_list_each_other_and_a_killed_one_vanishes(spawn) -> None:
    founder = spawn("--stage", "0", "--model", "tiny", "--swarm", "trio", "--announce-period", PERIOD)
    info = founder.wait_ready()
    join = ["--join", info["dht_addr"], "--swarm", "trio", "--announce-period", PERIOD]
    first = spawn(*join)
    first.wait_ready()
    second = spawn(*join)
    second.wait_ready()
    members = [founder, first, second]
    ids = {d.info["peer_id"]: d for d in members}
    assert len(ids) == 3

    # --stage auto: the empty stage 1 first, then (both stages idle, one peer each) the lowest index
    assert [d.info["stage"] for d in members] == [0, 1, 0]
    # the joiners gave no --model and serve the founder's
    for d in members:
        assert httpx.get(f"{d.api}/status").json()["model"]["digest"] == PRESETS["tiny"].digest

    expected = {pid: (d.info["stage"], "serving") for pid, d in ids.items()}
    for d in members:
        wait_until(lambda d=d: peers_by_id(swarm_of(d)) == expected, 10, f"{d.api}/swarm lists all three")
    view = swarm_of(first)
    assert view["model"]["digest"] == PRESETS["tiny"].digest and view["swarm"] == "trio"
    assert view["dht"]["routing_table_size"] >= 2
    assert all(p["params_digest"] for s in view["stages"] for p in s["peers"])

    victim = first
    victim.proc.kill()  # SIGKILL: no goodbye, the record must expire
    victim.proc.wait(10)
    del expected[victim.info["peer_id"]]
    for d in (founder, second):
        took = wait_until(lambda d=d: set(peers_by_id(swarm_of(d))) == set(expected), EXPIRY_S + 5,
                          "the killed peer disappears")
        assert took <= EXPIRY_S + 5
    # its stage is empty now: the rebalancer moves one of the two stage-0 peers there at once
    wait_until(lambda: sorted(s for s, state in peers_by_id(swarm_of(founder)).values() if state == "serving")
               == [0, 1], 30, "stage 1 is covered again")


@pytest.fixture(scope="module")
def slow_founder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A founder with a 5 s announce period (records expire after 15 s), shared by the tests below
    that only need a swarm to join: one daemon start instead of one per test."""
    founder = DaemonProcess(["--model", "tiny", "--announce-period", "5"], tmp_path_factory.mktemp("founder"))
    try:
        founder.wait_ready()
        yield founder
    finally:
        founder.close()


def test_a_graceful_stop_withdraws_the_peer_from_every_view_at_once(spawn, slow_founder: DaemonProcess) -> None:
    founder, info = slow_founder, slow_founder.info
    leaver = spawn("--join", info["dht_addr"], "--announce-period", "5")
    leaver.wait_ready()
    pid = leaver.info["peer_id"]
    wait_until(lambda: pid in peers_by_id(swarm_of(founder)), 10, "the joiner is listed")
    assert leaver.terminate() == 0
    # at once, long before its record would expire (15 s): its last record withdrew it
    wait_until(lambda: pid not in peers_by_id(swarm_of(founder)), 3, "the leaver is gone from /swarm")


def test_joiner_with_another_model_exits_2(slow_founder: DaemonProcess, tmp_path) -> None:
    info = slow_founder.info
    out = subprocess.run(
        [*swarmd_command(), "--join", info["dht_addr"], "--model", "small", "--api-port", "0",
         "--state-dir", str(tmp_path / "joiner")],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "swarmd: error: --model small" in out.stderr and "omit --model" in out.stderr


def test_unreachable_bootstrap_fails_clearly_within_the_bound(tmp_path) -> None:
    start = time.monotonic()
    out = subprocess.run(
        [*swarmd_command(), "--join", "127.0.0.1:9", "--bootstrap-timeout", "2", "--api-port", "0",
         "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert "127.0.0.1:9" in out.stderr and "swarmd: error:" in out.stderr
    assert time.monotonic() - start < 30


def test_identity_persists_and_a_state_dir_serves_one_daemon(spawn, tmp_path) -> None:
    state = tmp_path / "peer"
    d = spawn("--state-dir", str(state))
    first_id = d.wait_ready()["peer_id"]
    clash = subprocess.run(
        [*swarmd_command(), "--state-dir", str(state), "--api-port", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert clash.returncode == 2 and "another swarmd is running with --state-dir" in clash.stderr
    assert d.terminate() == 0
    again = spawn("--state-dir", str(state))
    assert again.wait_ready()["peer_id"] == first_id
    again.proc.send_signal(signal.SIGTERM)
    assert again.proc.wait(30) == 0


@pytest.mark.slow  # the suite's 10-minute budget: the same property runs in CI in tests/system/test_chaos.py and
# tests/integration/test_many_trainers.py::test_three_trainers_and_a_sigkilled_peer_keep_the_books (./scripts/test -m slow)
async def test_training_survives_a_sigkilled_peer(spawn) -> None:
    from swarmd.train.trainer import Trainer, TrainerConfig

    founder = spawn("--model", "tiny", "--stage", "0", "--announce-period", PERIOD, "--target-batch-size", "16",
                    "--averaging-timeout", "5")
    info = founder.wait_ready()
    others = [spawn("--join", info["dht_addr"], "--stage", str(i % 2), "--announce-period", PERIOD)
              for i in range(1, 4)]
    for d in others:
        d.wait_ready()
    victim = others[-1]  # a stage-1 peer
    killed: list[int] = []

    def on_step(step: int, loss: float, info: dict) -> None:
        if step == 3 and not killed:
            victim.proc.kill()
            killed.append(step)

    trainer = Trainer(TrainerConfig(api=founder.api, steps=10, sync=True, microbatch_size=4, val_every=0,
                                    max_corpus_bytes=1 << 20, stage_wait_timeout_s=60), on_step=on_step)
    summary = await trainer.run()
    assert killed and summary.steps == 10
    assert summary.microbatches_issued == summary.microbatches_completed  # nothing lost
    assert summary.step_losses[-1] < summary.step_losses[0]
    survivors = [d for d in (founder, *others) if d is not victim]
    statuses = [httpx.get(f"{d.api}/status").json() for d in survivors]
    for stage in (0, 1):
        at = {(s["step"], s["params_digest"]) for s in statuses if s["stage"] == stage}
        assert len(at) == 1, at  # the stage's survivors agree
