"""The network lab (scripts/netlab.py): reachability, isolation, rate caps, delay, and cleanup.

Every measurement runs in processes inside the lab's hosts (``ip netns exec``) against an echo server
in another host; the lab's tests skip with the reason where the lab cannot run (not root, no ``ip``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from scripts.netlab import (
    EchoServer,
    Lab,
    Shape,
    cleanup_stale,
    list_netns,
    parse_delay,
    parse_rate,
    probe,
    run_probe,
)

from tests.support.netlab_fixture import require_lab

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
MakeLab = Callable[..., Lab]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _alive(pid)


def test_parse_rate_and_delay() -> None:
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1.5gbit") == 1_500_000_000
    assert parse_rate("10mbps") == 80_000_000
    assert parse_delay("50ms") == pytest.approx(0.05)
    assert parse_delay("0.1s") == pytest.approx(0.1)
    assert parse_delay("20") == pytest.approx(0.02)
    for bad in ("fast", "100", "1bit", "-5mbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    with pytest.raises(ValueError):
        parse_delay("50 parsecs")
    with pytest.raises(ValueError):
        Shape(delay_s=-1.0)


def test_hosts_reach_each_other_over_tcp_and_udp_v4_and_v6(netlab: MakeLab) -> None:
    # host 0's traffic goes through the delay relay, host 2's is routed directly by the hub
    lab = netlab(3, shapes={0: Shape(rate="200mbit", delay_s=0.01)})
    assert len({lab.addr(i) for i in range(3)}) == 3 and len({lab.addr6(i) for i in range(3)}) == 3
    with EchoServer(lab, 1) as echo:
        for src in (0, 2):
            for addr in (lab.addr(1), lab.addr6(1)):
                assert run_probe(lab, src, "tcp", addr, echo.tcp_port(addr))["ok"], (src, addr)
                assert run_probe(lab, src, "udp", addr, echo.udp_port(addr))["ok"], (src, addr)
    route = lab.run(0, ["ip", "-j", "route", "get", lab.addr(2)], capture_output=True, text=True, check=True)
    assert json.loads(route.stdout)[0]["prefsrc"] == lab.addr(0)  # "the local address of the route to X"
    route6 = lab.run(0, ["ip", "-j", "-6", "route", "get", lab.addr6(2)], capture_output=True, text=True, check=True)
    assert json.loads(route6.stdout)[0]["prefsrc"] == lab.addr6(0)


def test_hosts_do_not_reach_the_root_namespace(netlab: MakeLab) -> None:
    lab = netlab(1)
    root = subprocess.Popen([sys.executable, str(SCRIPTS / "netlab.py"), "_echo", "0.0.0.0", "::"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout is not None
        ports = json.loads(root.stdout.readline())
        port4, port6 = ports["0.0.0.0"]["tcp"], ports["::"]["tcp"]
        assert probe("tcp", "127.0.0.1", port4)["ok"]  # the root namespace's echo server answers there
        shown = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True).stdout
        root_addrs = [a["local"] for link in json.loads(shown) for a in link.get("addr_info", [])
                      if not a["local"].startswith("fe80")]
        assert "127.0.0.1" in root_addrs
        for addr in root_addrs:
            port = port6 if ":" in addr else port4
            result = run_probe(lab, 0, "tcp", addr, port, timeout_s=2.0)
            assert not result["ok"], f"host 0 reached the root namespace at {addr}: {result}"
    finally:
        root.terminate()
        root.wait(10)
        assert root.stdout is not None
        root.stdout.close()


def test_a_host_s_kernel_knobs_are_its_own(netlab: MakeLab) -> None:
    """bench_wan --no-slow-start-after-idle: set in the lab's hosts, never in the machine's namespace."""
    knob = "net.ipv4.tcp_slow_start_after_idle"

    def read(argv: list[str]) -> str:
        return subprocess.run([*argv, "sysctl", "-n", knob], capture_output=True, text=True, check=True).stdout.strip()

    root_before = read([])
    lab = netlab(2)
    lab.sysctl(0, {knob: "0"})
    assert read(lab.command(0, [])) == "0"
    assert read(lab.command(1, [])) == "1"  # a new namespace starts from the kernel's default
    assert read([]) == root_before


def test_a_capped_host_stays_below_its_rate(netlab: MakeLab) -> None:
    cap = 20_000_000
    lab = netlab(2, shapes={0: Shape(rate="20mbit")})
    with EchoServer(lab, 1) as echo:
        capped = run_probe(lab, 0, "sink", lab.addr(1), echo.tcp_port(lab.addr(1)), nbytes=2_500_000)
        free = run_probe(lab, 1, "sink", lab.addr(1), echo.tcp_port(lab.addr(1)), nbytes=2_500_000)
    assert capped["ok"] and free["ok"]
    assert capped["bits_per_s"] < cap, capped
    assert capped["bits_per_s"] > cap / 10, capped  # it is the cap that limits, not a broken link
    assert free["bits_per_s"] > cap, free  # the uncapped host is not limited


def test_a_delayed_host_adds_its_delay_to_a_round_trip(netlab: MakeLab) -> None:
    delay = 0.1
    lab = netlab(3, shapes={0: Shape(delay_s=delay)})
    with EchoServer(lab, 1) as echo:
        for addr in (lab.addr(1), lab.addr6(1)):
            slow = run_probe(lab, 0, "rtt", addr, echo.tcp_port(addr), count=3)
            fast = run_probe(lab, 2, "rtt", addr, echo.tcp_port(addr), count=3)
            assert slow["ok"] and fast["ok"]
            assert min(slow["rtt_s"]) >= delay, slow
            # (the two hosts' own round trips differ by microseconds: CI once saw the delayed one 6 us under the
            # fast one's plus the delay)
            assert min(slow["rtt_s"]) - min(fast["rtt_s"]) >= 0.95 * delay, (slow, fast)


def test_close_removes_everything_even_after_an_exception() -> None:
    require_lab()
    with pytest.raises(RuntimeError, match="inside the lab"):
        with Lab(2, delay_s=0.01) as lab:
            names = lab.namespaces
            relay = lab.relay_pid
            sleeper = lab.popen(1, ["sleep", "600"])
            assert relay is not None and set(names) <= set(list_netns())
            raise RuntimeError("inside the lab")
    assert not set(names) & set(list_netns())
    assert sleeper.poll() is not None
    assert relay is not None and _wait_gone(relay)
    assert not lab.state_file.exists()


def _lab_in_child(*extra: str) -> tuple[subprocess.Popen[str], dict[str, object]]:
    """A lab built by another Python process, which then waits to be killed; (process, lab description)."""
    code = ("import json, sys, time; sys.path.insert(0, sys.argv[1]); import netlab; "
            "lab = netlab.Lab(2, delay_s=0.01).start(); "
            "print(json.dumps({'names': lab.namespaces, 'relay': lab.relay_pid}), flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(SCRIPTS), *extra], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()
    assert line, "the child did not build its lab"
    return proc, json.loads(line)


def test_sigterm_removes_the_lab() -> None:
    require_lab()
    proc, built = _lab_in_child()
    names = built["names"]
    assert isinstance(names, list) and set(names) <= set(list_netns())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert not set(names) & set(list_netns())


def test_cleanup_stale_removes_a_killed_runs_lab_and_keeps_live_ones() -> None:
    require_lab()
    with Lab(1) as live:
        proc, built = _lab_in_child()
        names, relay = built["names"], built["relay"]
        assert isinstance(names, list) and isinstance(relay, int)
        proc.kill()  # no cleanup: the namespaces stay, the relay dies with its parent
        proc.wait(10)
        assert _wait_gone(relay)
        assert set(names) <= set(list_netns())
        removed = cleanup_stale()
        assert set(names) <= set(removed)
        assert not set(names) & set(list_netns())
        assert set(live.namespaces) <= set(list_netns())
