"""Separate hosts (issues #11, #12): daemons in the network lab's namespaces, bound to wildcards.

Each test builds a lab (``tests/support/netlab_fixture.py``; skipped with the reason where the lab cannot
run), starts ``swarmd`` in its hosts through the real CLI, and trains through them with
``tests/support/hosts_driver.py`` run inside the founder's host. Daemons bind ``0.0.0.0`` (or ``::``), as a
volunteer would; their control planes listen on every address with a token (a trainer needs it to
register); each ``/status`` is read from inside its own host (a host behind NAT cannot be dialled).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scripts.netlab import Lab, Shape, nat_problem

from swarmd.local_swarm import DaemonProcess, stop_all
from tests.support.swarms import TINY, TRAINING, reference_run

DRIVER = Path(__file__).resolve().parent.parent / "support" / "hosts_driver.py"
TOKEN = "lab-test-token-0123456789abcdef"
DRIVE_TIMEOUT_S = 90  # one drive of a test; each test's own timeout is 120 s (setup.cfg)


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


class Swarm:
    """swarmd daemons in lab hosts: host i runs ``daemons[i]``, stage ``i % 2`` unless told otherwise."""

    def __init__(self, lab: Lab, workdir: Path) -> None:
        self.lab = lab
        self.workdir = workdir
        self.daemons: dict[int, DaemonProcess] = {}
        token = workdir / "token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        self.common = ["--swarm", "lab", "--announce-period", "1", "--rebalance-policy", "none",
                       "--drain-timeout", "5", "--api-host", "0.0.0.0", "--api-token-file", str(token)]

    def start(self, host: int, stage: int, *args: str, wildcard: str = "0.0.0.0") -> DaemonProcess:
        founder = not self.daemons
        argv = [*self.common, "--host", wildcard, "--dht-host", wildcard, "--stage", str(stage), *args]
        if founder:
            argv += ["--model", "tiny", "--target-batch-size", str(TRAINING.target_batch_size), "--lr", "3e-3",
                     "--warmup-steps", str(TRAINING.warmup_steps), "--averaging-timeout", "10"]
        else:
            argv += ["--join", self.daemons[min(self.daemons)].info["dht_addr"]]
        d = DaemonProcess(argv, self.workdir, name=f"host{host}",
                          command=self.lab.command(host, [sys.executable, "-m", "swarmd"]))
        self.daemons[host] = d
        if founder:
            d.wait_ready(120)
        return d

    def wait(self) -> None:
        for d in self.daemons.values():
            d.wait_ready(120)

    def api(self, host: int) -> str:
        """Host ``host``'s control plane, from inside that host."""
        return f"http://127.0.0.1:{self.daemons[host].info['api_addr'].rsplit(':', 1)[1]}"

    def drive(self, steps: int, *, kill: tuple[int, int] | None = None, settle_s: float = 1.0,
              codec: str = "none", verify_fraction: float = 0.02) -> dict[str, Any]:
        spec = {"api": self.api(0), "token": TOKEN, "steps": steps, "codec": codec, "settle_s": settle_s,
                "verify_fraction": verify_fraction,
                "kill": [self.daemons[kill[0]].pid, kill[1]] if kill else None}
        try:  # bounded below the test's own timeout, so a hang reports the daemons' logs
            done = self.lab.run(0, [sys.executable, str(DRIVER), json.dumps(spec)], capture_output=True, text=True,
                                timeout=DRIVE_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"the driver hung for {DRIVE_TIMEOUT_S} s: {_text(e.stderr)[-4000:]}\n{self.logs()}")
        if done.returncode != 0:
            raise AssertionError(f"the driver failed ({done.returncode}): {done.stderr[-4000:]}\n{self.logs()}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def logs(self) -> str:
        return "\n".join(f"--- host {h} ---\n{d.log_tail(3000)}" for h, d in self.daemons.items())

    def status(self, host: int) -> dict[str, Any]:
        """Host ``host``'s ``/status``, read from inside that host (a host behind NAT cannot be dialled)."""
        port = self.daemons[host].info["api_addr"].rsplit(":", 1)[1]
        code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/status').read().decode())"
        done = self.lab.run(host, [sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def read_from(self, host: int, target: int, path: str, token: str | None = None) -> int:
        """The HTTP status of ``GET path`` on host ``target``'s control plane, asked from host ``host``
        (another machine: its address is not the target's loopback)."""
        port = self.daemons[target].info["api_addr"].rsplit(":", 1)[1]
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        code = (f"import urllib.request, urllib.error\n"
                f"r = urllib.request.Request('http://{self.lab.addr(target)}:{port}{path}', headers={headers!r})\n"
                "try:\n    print(urllib.request.urlopen(r, timeout=20).status)\n"
                "except urllib.error.HTTPError as e:\n    print(e.code)")
        done = self.lab.run(host, [sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    def close(self) -> None:
        stop_all(list(self.daemons.values()), 15)


@pytest.fixture
def swarm_in(netlab: Any, tmp_path: Path) -> Iterator[Any]:
    swarms: list[Swarm] = []

    def make(hosts: int, **lab_kw: Any) -> Swarm:
        s = Swarm(netlab(hosts, **lab_kw), tmp_path)
        swarms.append(s)
        return s

    try:
        yield make
    finally:
        for s in swarms:
            s.close()


def test_hosts_bound_to_the_wildcard_train_with_the_losses_of_loopback_even_capped_and_behind_nat(swarm_in) -> None:
    """Four hosts bound to 0.0.0.0: host 2 capped at 20 Mbit/s, host 3 behind a masquerading NAT
    (relayed through a reachable peer). Five sync steps follow single-process training's losses."""
    if nat_problem():
        pytest.skip(nat_problem())
    s = swarm_in(4, shapes={2: Shape(rate="20mbit")}, nat=[3])
    for host in range(4):
        s.start(host, host % 2)
    s.wait()
    # no spot checks: a check's pair takes a slot of its step, which then trains on other samples than
    # single-process training does (the losses drifted past 1% in CI); checks across hosts: the relay test below
    summary = s.drive(5, verify_fraction=0.0)["summary"]
    statuses = [s.status(h) for h in range(4)]
    expected, _ = reference_run(TINY, TRAINING, 5, 0)
    assert summary["steps"] == 5
    got_losses = summary["step_losses"]
    # not bit for bit: the stage sums its peers' gradients in the order they arrive (measured up to 1.2e-4 apart)
    assert got_losses == pytest.approx(expected, rel=1e-3), summary
    assert got_losses[-1] < got_losses[0]
    assert summary["microbatches_issued"] == summary["microbatches_completed"]
    assert summary["bans"] == 0 and summary["retries"] == 0, summary  # nothing wasted, NATed peer included
    for host, st in enumerate(statuses):
        assert st is not None, host
        addr = st["data_addr"]
        assert not addr.startswith("0.0.0.0"), (host, st["addresses"])
        if host == 3:  # behind the NAT: relayed, through a reachable peer, and reachable that way
            assert st["relay"]["client"]["state"] == "relayed", st["relay"]
            assert addr.startswith(st["peer_id"] + "@"), addr
        else:
            assert addr.rsplit(":", 1)[0] == s.lab.addr(host), (host, st["addresses"])
        assert st["reachability"]["status"] == "yes", (host, st["reachability"])
        assert st["step"] == 5
    assert statuses[3]["served"]["backward"] > 0  # the NATed peer's samples count in its stage's steps
    # read-only endpoints: open on loopback (s.status above), behind the token from another machine
    assert [s.read_from(1, 0, path) for path in ("/status", "/metrics")] == [401, 401]
    assert [s.read_from(1, 0, path, TOKEN) for path in ("/status", "/metrics")] == [200, 200]
    assert s.read_from(1, 0, "/healthz") == 200
    assert statuses[3]["params_digest"] == statuses[1]["params_digest"]
    # and so do the capped host's (failed once in a full CI run, never alone: what each stage-0 host served says why)
    assert statuses[2]["served"]["backward"] > 0, [statuses[h]["served"] for h in (0, 2)]


def test_losing_the_relay_of_a_peer_behind_nat_loses_nothing_and_it_is_relayed_again(swarm_in) -> None:
    if nat_problem():
        pytest.skip(nat_problem())
    s = swarm_in(4, nat=[3])
    s.start(0, 0, "--relay-max-peers", "0")  # the founder relays for nobody: host 1 or 2 must
    s.start(1, 0)
    s.start(2, 1)
    s.start(3, 1)
    s.wait()
    s.drive(1)
    first = s.status(3)["relay"]["client"]
    assert first["state"] == "relayed", first
    relay_host = next(h for h in (1, 2) if s.daemons[h].info["peer_id"] == first["relay_id"])
    other = 3 - relay_host
    out = s.drive(8, kill=(relay_host, 3), settle_s=3.0)
    summary, natted, survivor = out["summary"], s.status(3), s.status(other)
    assert out["killed_at"] is not None and summary["steps"] == 8
    assert summary["microbatches_issued"] == summary["microbatches_completed"]
    assert natted["relay"]["client"]["state"] == "relayed", natted["relay"]
    assert natted["relay"]["client"]["relay_id"] == survivor["peer_id"]
    assert natted["step"] == survivor["step"] or natted["stage"] != survivor["stage"]


def test_ipv6_hosts_and_a_wrong_announce_that_is_reported_and_never_used(swarm_in) -> None:
    """Three hosts bound to ``::`` joined over IPv6; host 2 announces an address nobody answers at,
    and nobody relays, so it is reported unreachable and the trainer never sends it anything."""
    s = swarm_in(3)
    no_relay = ("--relay-max-peers", "0")
    s.start(0, 0, *no_relay, wildcard="::")
    s.start(1, 1, *no_relay, wildcard="::")
    unused = s.lab.addr6(1).rsplit(":", 1)[0] + ":ffff"  # in the lab's prefix, on no host
    s.start(2, 1, *no_relay, "--announce", f"[{unused}]:7000", wildcard="::")
    s.wait()
    summary = s.drive(2, codec="8bit")["summary"]
    founder, joiner, wrong = (s.status(h) for h in range(3))
    assert summary["steps"] == 2 and summary["bans"] == 0
    assert joiner["data_addr"].startswith(f"[{s.lab.addr6(1)}]:"), joiner["addresses"]
    assert founder["dht_addr"].startswith("["), founder["addresses"]
    assert joiner["reachability"]["status"] == "yes"
    assert wrong["reachability"]["status"] == "no" and wrong["data_addr"] == f"[{unused}]:7000"
    assert wrong["served"]["forward"] == 0 and wrong["served"]["backward"] == 0
    assert joiner["step"] == 2
