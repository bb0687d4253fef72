"""A network lab of Linux network namespaces: N hosts on one virtual LAN, optional bandwidth caps and latency.

Why: every swarmd test used to run on 127.0.0.1; volunteers run one daemon per machine. The lab gives each
peer its own host (network namespace) and address, so announced addresses, reachability and WAN speed can be
tested on one machine. It needs root and ``ip`` (iproute2); nothing of it is installed with swarmd.

    sudo python scripts/netlab.py up --hosts 3 --rate 100mbit --delay 50ms   # prints the run id, addresses
    sudo python scripts/netlab.py exec 0 -- python -m swarmd --host 10.213.7.1 ...
    sudo python scripts/netlab.py measure                                    # RTT and throughput, host 0 -> 1
    sudo python scripts/netlab.py down                                       # or: down RUN_ID
    sudo python scripts/netlab.py cleanup-stale                              # leftovers of dead runs

    with Lab(3, shapes={0: Shape(rate="20mbit", delay_s=0.05)}) as lab:
        proc = lab.popen(1, [sys.executable, "-m", "swarmd", "--host", lab.addr(1), ...])

Topology (run id ``R``, 6 random hex digits, so parallel and leftover runs never clash):

- ``swl-R-hub``: a namespace of the lab's own holding the bridge ``br0`` (gateway ``10.213.X.254/24`` and
  ``<ula>::fe/64``), ``ip_forward`` on, ICMP redirects off. It has no link to the root namespace: the root
  namespace's interfaces, addresses and routes are never touched, and no lab traffic can leave the lab.
- ``swl-R-<i>`` for host ``i`` (0-based): ``lo`` up and ``eth0``, one end of a veth whose other end
  (``h<i>``) is a port of ``br0``. The host has ``10.213.X.<i+1>/32`` and ``<ula>::<i+1>/128``, a link route
  to the gateway and a default route via it (so "the local address of the route to X" is the host's address).
  Because the prefix is /32, every packet between hosts is *routed* by the hub rather than bridged directly:
  that is what lets the hub delay it. ``X`` and the ULA prefix are chosen per run so that they do not overlap
  the root namespace's routes (they are isolated anyway: the hub has no way out).

NAT (``nat=[i, ...]``): the hub masquerades what host ``i`` sends (it leaves with the gateway's
address) and drops every new connection or UDP flow towards it (``iptables``/``ip6tables``, conntrack):
a home router without port forwards. The host keeps its own address, which it may announce, but nobody
can dial it; it can dial everyone.

Bandwidth: ``tc qdisc add dev eth0 root tbf rate R burst B latency 100ms`` on the host's egress, inside the
host's namespace (``B`` = 5 ms at the rate, at least 64 KiB). Only egress is capped; to cap a host both ways,
cap the other hosts too (a symmetric WAN is every host capped).

Latency, without netem: this kernel has neither ``netem`` nor ``fq`` (both answer "Specified qdisc kind is
unknown"; ``tbf``, ``htb``, ``pfifo``, ``clsact``, ``ifb``, TUN devices in namespaces, veth and bridges
work), so BPF departure times (which need ``fq``) are out too. The lab delays packets in user space at the IP
level instead: the hub holds a TUN device ``tun0`` and a policy rule per delayed host (``from <host> iif br0
lookup 100``, table 100: ``default dev tun0``) sends everything that host sends into the TUN; a small relay
process in the hub (this file, ``_relay``) reads each packet, holds it for that host's delay and writes it
back into the TUN; the packet re-enters the hub's stack from ``tun0``, matches no rule, and is routed to its
destination by the main table. This works for TCP and UDP, IPv4 and IPv6, any port. The relay opens the TUN
with ``IFF_VNET_HDR`` and TSO/checksum offload (``TUNSETOFFLOAD``), so TCP's 64 KiB GSO super-packets cross it
whole: a few thousand reads and writes per second at 500 Mbit/s instead of ~40,000 1500-byte packets, while
the wire MTU stays 1500 (what real paths have). If offload cannot be set, the relay still works, packet by
packet.

Limits (what this is not):
- The delay is a fixed one-way delay on the host's *egress* (as ``netem delay`` on its interface would be):
  the RTT between two hosts is the sum of their delays, e.g. 25 ms each for a 50 ms RTT. No jitter, no loss,
  no reordering; packets of one host leave in order.
- Delayed traffic costs the relay CPU (one Python process for the whole lab): measure with ``measure`` and
  keep in mind that on a loaded machine the relay's scheduling adds to the delay (never subtracts).
- Caps and delays are fixed at ``up``/``start``; tbf's queue holds up to 100 ms of traffic at the rate.
- Hosts share the root's file system, users and processes (only the network is separate).

Cleanup: :meth:`Lab.close` (the context manager's exit, an ``atexit`` hook, and SIGTERM while a lab is open
in the main thread) stops every process started with :meth:`Lab.popen`, kills whatever else still runs in the
lab's namespaces (only the lab's own processes can be there), and deletes the namespaces, which takes their
veths, bridge and TUN with them. The relay dies with the process that started the lab (``PR_SET_PDEATHSIG``)
unless the lab is persistent (``up``). A lab's state file in ``/run/swarmd-netlab`` names its owner; after a
SIGKILL, ``cleanup-stale`` removes the namespaces of every run whose owner is gone, by prefix ``swl-``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import fcntl
import heapq
import ipaddress
import json
import os
import random
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "swl-"
STATE_DIR = Path("/run/swarmd-netlab")
HUB = "hub"
BRIDGE = "br0"
TUN = "tun0"
DELAY_TABLE = "100"
TBF_QUEUE_LATENCY = "100ms"
MIN_TBF_BURST_BYTES = 64 * 1024
READY_LINE = "ready"
CMD_TIMEOUT_S = 30.0
MAX_HOSTS = 250  # .1 to .250 of the /24; .254 is the gateway

# linux/if_tun.h
_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000
_TUN_F_CSUM, _TUN_F_TSO4, _TUN_F_TSO6 = 0x01, 0x02, 0x04
_VNET_HDR_LEN = 10  # struct virtio_net_hdr, the default size
_PR_SET_PDEATHSIG = 1


class LabError(RuntimeError):
    """The lab could not be built or used; the message says which command failed and what it printed."""


# ---- parsing --------------------------------------------------------------------------------------


_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bps": 8, "kbps": 8 * 10**3,
               "mbps": 8 * 10**6, "gbps": 8 * 10**9}
_DELAY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_rate(text: str) -> int:
    """``100mbit`` -> 100_000_000 (bits per second; tc's units: bit/kbit/mbit/gbit, bps = bytes/s)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise ValueError(f"not a rate: {text!r} (use e.g. 100mbit, 500kbit, 1gbit)")
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if bits < 8000:
        raise ValueError(f"rate {text!r} is below 8kbit")
    return int(bits)


def parse_delay(text: str) -> float:
    """``50ms`` -> 0.05 (seconds; units s, ms, us; a bare number is milliseconds, as in tc)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", text)
    if not m or (m.group(2) and m.group(2) not in _DELAY_UNITS):
        raise ValueError(f"not a delay: {text!r} (use e.g. 50ms, 0.1s)")
    return float(m.group(1)) * _DELAY_UNITS[m.group(2) or "ms"]


@dataclass(frozen=True)
class Shape:
    """A host's egress shaping: ``rate`` a tc rate (``100mbit``) or None; ``delay_s`` a one-way delay."""

    rate: str | None = None
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.rate is not None:
            parse_rate(self.rate)
        if self.delay_s < 0:
            raise ValueError("a delay cannot be negative")

    @property
    def rate_bits(self) -> int | None:
        return None if self.rate is None else parse_rate(self.rate)


@dataclass(frozen=True)
class Host:
    """One host of the lab: its namespace and addresses."""

    index: int
    netns: str
    addr: str
    addr6: str
    shape: Shape = field(default_factory=Shape)


# ---- running commands -----------------------------------------------------------------------------


def _run(argv: Sequence[str], *, check: bool = True, input_text: str | None = None) -> str:
    """Run an ``ip``/``tc``/``sysctl`` command; its stdout, or LabError with its stderr."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, input=input_text, timeout=CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{' '.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _ip_batch(netns: str, commands: Sequence[str], family: str | None = None) -> None:
    """Several ``ip`` commands in one namespace and one process (``ip -n NS -batch -``; ``family`` for rules)."""
    if commands:
        _run(["ip", *([family] if family else []), "-n", netns, "-batch", "-"], input_text="\n".join(commands) + "\n")


def _sysctl(netns: str, settings: Mapping[str, str]) -> None:
    _run(["ip", "netns", "exec", netns, "sysctl", "-q", "-w", *(f"{k}={v}" for k, v in settings.items())])


def list_netns() -> list[str]:
    """Every named network namespace (``ip netns list``), names only."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def netns_pids(netns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_netns(netns: str) -> None:
    """SIGKILL whatever runs in one of the lab's namespaces, then delete it (its devices go with it)."""
    for pid in netns_pids(netns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _run(["ip", "netns", "del", netns], check=False)


def support_problem() -> str | None:
    """Why a lab cannot run here (not root, no ``ip``, ``ip netns`` refused), or None when it can."""
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, veths, tc)"
    for tool in ("ip", "tc", "sysctl"):
        if not any((Path(d) / tool).exists() for d in os.environ.get("PATH", "").split(":") + ["/usr/sbin", "/sbin"]):
            return f"the network lab needs `{tool}` (Debian: apt-get install iproute2 procps)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
    except LabError as exc:
        return f"`ip netns add` does not work here: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def nat_problem() -> str | None:
    """Why hosts cannot be put behind a NAT here (no ``iptables``), or None when they can."""
    for tool in ("iptables", "ip6tables"):
        if not any((Path(d) / tool).exists() for d in os.environ.get("PATH", "").split(":") + ["/usr/sbin", "/sbin"]):
            return f"NAT in the lab needs `{tool}` (Debian: apt-get install iptables)"
    return None


def _proc_start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), to tell it from a later process with its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _set_pdeathsig() -> None:
    """In a child before exec: die with SIGKILL when the parent (thread) that started it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# ---- the lab ---------------------------------------------------------------------------------------


def _used_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Every destination the root namespace routes (all tables), to keep the lab's prefixes apart from."""
    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for family in ("-4", "-6"):
        for route in json.loads(_run(["ip", "-j", family, "route", "show", "table", "all"]) or "[]"):
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.ip_network(route.get("dst", "default"), strict=False))
    return nets


def _pick_prefixes(rng: random.Random) -> tuple[ipaddress.IPv4Network, ipaddress.IPv6Network]:
    """A 10.213.X.0/24 and a random ULA /64 that overlap no route of the root namespace."""
    used = _used_networks()
    for _ in range(256):
        v4 = ipaddress.IPv4Network(f"10.213.{rng.randrange(256)}.0/24")
        v6 = ipaddress.IPv6Network(((0xFD << 120) | (rng.getrandbits(56) << 64), 64))
        if not any(v4.overlaps(n) for n in used if n.version == 4) and not any(
            v6.overlaps(n) for n in used if n.version == 6
        ):
            return v4, v6
    raise LabError("no free 10.213.X.0/24 for the lab: the root namespace routes all of 10.213.0.0/16")


class Lab:
    """N hosts (network namespaces) on one bridge, with optional per-host egress rate caps and delays.

    ``rate``/``delay_s`` apply to every host; ``shapes`` overrides them per host index. With
    ``persistent`` (the CLI's ``up``) the lab outlives this process until ``down``; otherwise close it
    (``with Lab(...) as lab:``), which happens also at exit and on SIGTERM.
    """

    def __init__(self, hosts: int, *, rate: str | None = None, delay_s: float = 0.0,
                 shapes: Mapping[int, Shape] | None = None, persistent: bool = False,
                 run_id: str | None = None, nat: Sequence[int] = ()) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"a lab has 1 to {MAX_HOSTS} hosts")
        if not all(0 <= i < hosts for i in nat):
            raise ValueError(f"nat names hosts outside 0..{hosts - 1}")
        self.nat = tuple(sorted(set(nat)))
        if shapes and not all(0 <= i < hosts for i in shapes):
            raise ValueError(f"shapes name hosts outside 0..{hosts - 1}")
        self.run_id = run_id or os.urandom(3).hex()
        self.persistent = persistent
        self.hub = f"{PREFIX}{self.run_id}-{HUB}"
        default = Shape(rate=rate, delay_s=delay_s)
        self._shapes = [dict(shapes or {}).get(i, default) for i in range(hosts)]
        self.hosts: list[Host] = []
        self.gateway = self.gateway6 = ""
        self.relay_pid: int | None = None
        self._relay: subprocess.Popen[str] | None = None
        self._procs: list[subprocess.Popen[Any]] = []
        self._closed = False
        self._previous_sigterm: Any = None

    # -- identity ---------------------------------------------------------------------------------

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this lab: the hosts', then the hub's."""
        return [f"{PREFIX}{self.run_id}-{i}" for i in range(len(self._shapes))] + [self.hub]

    @property
    def state_file(self) -> Path:
        return STATE_DIR / f"{self.run_id}.json"

    def host(self, host: int) -> Host:
        return self.hosts[host]

    def netns(self, host: int) -> str:
        return self.hosts[host].netns

    def addr(self, host: int) -> str:
        """The host's IPv4 address (its only one besides loopback)."""
        return self.hosts[host].addr

    def addr6(self, host: int) -> str:
        """The host's IPv6 (ULA) address."""
        return self.hosts[host].addr6

    # -- building ---------------------------------------------------------------------------------

    def start(self) -> Lab:
        """Build every namespace, link, address, route and shaper; on any failure, undo all of it."""
        if self.hosts:
            raise LabError("this lab is already started")
        try:
            self._install_cleanup_hooks()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        v4, v6 = _pick_prefixes(random.Random(self.run_id))
        self.gateway, self.gateway6 = str(v4[254]), str(v6[0xFE])
        self.hosts = [Host(i, ns, str(v4[i + 1]), str(v6[i + 1]), shape)
                      for i, (ns, shape) in enumerate(zip(self.namespaces[:-1], self._shapes, strict=True))]
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._write_state()  # before anything exists, so cleanup-stale finds a half-built lab too
        for ns in self.namespaces:
            _run(["ip", "netns", "add", ns])
        _sysctl(self.hub, {"net.ipv4.ip_forward": "1", "net.ipv6.conf.all.forwarding": "1",
                           "net.ipv4.conf.all.rp_filter": "0", "net.ipv4.conf.default.rp_filter": "0",
                           "net.ipv4.conf.all.send_redirects": "0", "net.ipv4.conf.default.send_redirects": "0",
                           "net.ipv6.conf.default.accept_dad": "0"})
        _ip_batch(self.hub, [
            "link set lo up",
            f"link add {BRIDGE} type bridge stp_state 0 mcast_snooping 0",
            f"addr add {self.gateway}/24 dev {BRIDGE}",
            f"addr add {self.gateway6}/64 dev {BRIDGE} nodad",
            f"link set {BRIDGE} up",
        ])
        for h in self.hosts:
            _sysctl(h.netns, {"net.ipv4.conf.all.accept_redirects": "0", "net.ipv6.conf.all.accept_redirects": "0",
                              "net.ipv6.conf.default.accept_redirects": "0", "net.ipv6.conf.default.accept_dad": "0",
                              "net.ipv6.conf.all.accept_dad": "0"})
            _ip_batch(self.hub, [f"link add h{h.index} type veth peer name eth0 netns {h.netns}",
                                 f"link set h{h.index} master {BRIDGE} up"])
            _ip_batch(h.netns, [
                "link set lo up",
                "link set eth0 up",
                f"addr add {h.addr}/32 dev eth0",
                f"addr add {h.addr6}/128 dev eth0 nodad",
                f"route add {self.gateway}/32 dev eth0 src {h.addr}",
                f"route add default via {self.gateway} dev eth0 src {h.addr}",
                f"route add {self.gateway6}/128 dev eth0 src {h.addr6}",
                f"route add ::/0 via {self.gateway6} dev eth0 src {h.addr6}",
            ])
            if h.shape.rate_bits is not None:
                burst = max(MIN_TBF_BURST_BYTES, h.shape.rate_bits // 8 // 200)  # 5 ms at the rate
                _run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                      "rate", f"{h.shape.rate_bits}bit", "burst", str(burst), "latency", TBF_QUEUE_LATENCY])
        for i in self.nat:
            self._put_behind_nat(self.hosts[i])
        delayed = [h for h in self.hosts if h.shape.delay_s > 0]
        if delayed:
            self._start_relay(delayed)
        self._write_state()

    def _put_behind_nat(self, h: Host) -> None:
        """Make the hub the host's masquerading home router: what it sends leaves with the gateway's
        address (its connections and UDP flows out work, their answers come back through conntrack),
        and nobody can open a connection or a UDP flow *to* it (dropped, as a NAT without a port
        forward drops it: callers time out)."""
        for tool, addr in (("iptables", h.addr), ("ip6tables", h.addr6)):
            _run(["ip", "netns", "exec", self.hub, tool, "-t", "nat", "-A", "POSTROUTING", "-s", addr,
                  "-j", "MASQUERADE"])
            _run(["ip", "netns", "exec", self.hub, tool, "-A", "FORWARD", "-d", addr, "-m", "conntrack",
                  "--ctstate", "NEW,INVALID", "-j", "DROP"])

    def _start_relay(self, delayed: Sequence[Host]) -> None:
        _sysctl(self.hub, {"net.ipv4.conf.all.rp_filter": "0"})
        _ip_batch(self.hub, [f"tuntap add dev {TUN} mode tun", f"link set {TUN} up"])
        _sysctl(self.hub, {f"net.ipv4.conf.{TUN}.rp_filter": "0"})
        for family, addrs in (("-4", [f"{h.addr}/32" for h in delayed]), ("-6", [f"{h.addr6}/128" for h in delayed])):
            _ip_batch(self.hub, [f"route add default dev {TUN} table {DELAY_TABLE}",
                                 *(f"rule add from {a} iif {BRIDGE} lookup {DELAY_TABLE} pref 100" for a in addrs)],
                      family)
        delays = [f"{a}={h.shape.delay_s!r}" for h in delayed for a in (h.addr, h.addr6)]
        log = open(STATE_DIR / f"{self.run_id}.relay.log", "ab")  # the child holds its own descriptor
        try:
            self._relay = subprocess.Popen(
                ["ip", "netns", "exec", self.hub, sys.executable, str(Path(__file__).resolve()), "_relay",
                 "--tun", TUN, *delays],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                preexec_fn=None if self.persistent else _set_pdeathsig, start_new_session=self.persistent,
            )
        finally:
            log.close()
        assert self._relay.stdout is not None
        ready, _, _ = select.select([self._relay.stdout], [], [], CMD_TIMEOUT_S)
        line = self._relay.stdout.readline().strip() if ready else ""
        if line != READY_LINE:
            raise LabError(f"the delay relay did not start (said {line!r}); see {STATE_DIR}/{self.run_id}.relay.log")
        self._relay.stdout.close()
        self.relay_pid = self._relay.pid

    def _write_state(self) -> None:
        state = {
            "run_id": self.run_id, "owner_pid": os.getpid(), "owner_start": _proc_start_time(os.getpid()),
            "persistent": self.persistent, "gateway": self.gateway, "gateway6": self.gateway6,
            "relay_pid": self.relay_pid, "hosts": [asdict(h) for h in self.hosts],
            "shapes": [asdict(s) for s in self._shapes],
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_file)

    @classmethod
    def attach(cls, run_id: str) -> Lab:
        """The lab ``run_id`` that a (possibly earlier) process built: to exec in it or take it down."""
        try:
            state = json.loads((STATE_DIR / f"{run_id}.json").read_text())
        except (OSError, ValueError) as exc:
            raise LabError(f"no lab {run_id!r} ({exc})") from exc
        shapes = [Shape(**s) for s in state["shapes"]]
        lab = cls(len(shapes), shapes=dict(enumerate(shapes)), persistent=True, run_id=run_id)
        lab.hosts = [Host(**{**h, "shape": Shape(**h["shape"])}) for h in state["hosts"]]
        lab.gateway, lab.gateway6, lab.relay_pid = state["gateway"], state["gateway6"], state["relay_pid"]
        return lab

    # -- running things in hosts ------------------------------------------------------------------

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside the host (``ip netns exec``, which execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns(host), *argv]

    def popen(self, host: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the host (Popen keywords as usual); stopped by :meth:`close` if still running."""
        proc: subprocess.Popen[Any] = subprocess.Popen(self.command(host, argv), **kw)
        self._procs.append(proc)
        return proc

    def run(self, host: int, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` inside the host."""
        return subprocess.run(self.command(host, argv), **kw)

    def sysctl(self, host: int, settings: Mapping[str, str]) -> None:
        """Set kernel knobs of the host's own network namespace (per-namespace ones, e.g.
        ``net.ipv4.tcp_slow_start_after_idle``; the root namespace's stay as they are)."""
        _sysctl(self.netns(host), settings)

    # -- cleanup ----------------------------------------------------------------------------------

    def _install_cleanup_hooks(self) -> None:
        if self.persistent:
            return
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
            signal.SIG_DFL, None
        ):
            self._previous_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def close(self) -> None:
        """Stop the lab's processes and delete every namespace (and with them every device). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            _stop_process(proc)
        if self._relay is not None:
            _stop_process(self._relay)
        existing = set(list_netns())
        for ns in self.namespaces:
            if ns in existing:
                _kill_netns(ns)
        for path in (self.state_file, self.state_file.with_suffix(".tmp"), STATE_DIR / f"{self.run_id}.relay.log"):
            with contextlib.suppress(OSError):
                path.unlink()
        if not self.persistent:
            atexit.unregister(self.close)
            if self._previous_sigterm is not None and signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
                with contextlib.suppress(ValueError):  # not the main thread any more
                    signal.signal(signal.SIGTERM, self._previous_sigterm)

    def __enter__(self) -> Lab:
        return self.start() if not self.hosts else self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM while a lab is open: unwind (``finally`` and ``with`` run, so the lab is removed)."""
    raise SystemExit(128 + signum)


def _stop_process(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def lab_runs() -> dict[str, list[str]]:
    """Run id -> its namespaces, for every ``swl-`` namespace that exists now."""
    runs: dict[str, list[str]] = {}
    for ns in list_netns():
        if ns.startswith(PREFIX) and ns.count("-") >= 2:
            runs.setdefault(ns.split("-")[1], []).append(ns)
    return runs


def _owner_alive(run_id: str) -> bool:
    """Whether the lab's state file names a live owner (the same process, not a reuse of its pid)."""
    try:
        state = json.loads((STATE_DIR / f"{run_id}.json").read_text())
    except (OSError, ValueError):
        return False
    if state.get("persistent"):
        return True
    pid, start = state.get("owner_pid"), state.get("owner_start")
    return isinstance(pid, int) and start is not None and _proc_start_time(pid) == start


def cleanup_stale(include_persistent: bool = False) -> list[str]:
    """Delete the namespaces (and processes) of every lab run whose owner is gone; the names deleted.

    A persistent lab (``up``) counts as owned until ``down``, unless ``include_persistent``.
    """
    removed = []
    for run_id, namespaces in sorted(lab_runs().items()):
        if run_id.startswith("probe"):
            pass  # a support_problem() probe that was interrupted: always stale
        elif _owner_alive(run_id) and not include_persistent:
            continue
        for ns in sorted(namespaces, key=lambda n: n.endswith(HUB)):  # hosts first, the relay's hub last
            _kill_netns(ns)
            removed.append(ns)
        for path in STATE_DIR.glob(f"{run_id}.*"):
            with contextlib.suppress(OSError):
                path.unlink()
    return removed


# ---- the delay relay (runs inside the hub) -----------------------------------------------------------


def open_tun(name: str) -> tuple[int, int]:
    """Attach to the TUN device ``name``; (fd, header length): 10 with GSO offload, 0 without."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI | _IFF_VNET_HDR))
        fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6)
        return fd, _VNET_HDR_LEN
    except OSError:
        os.close(fd)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd, 0


def packet_source(packet: bytes, offset: int) -> bytes:
    """The IP source address of a packet (after ``offset`` bytes of TUN header), as packed bytes."""
    version = packet[offset] >> 4 if len(packet) > offset else 0
    if version == 4:
        return packet[offset + 12 : offset + 16]
    if version == 6:
        return packet[offset + 8 : offset + 24]
    return b""


def run_relay(tun: str, delays: Mapping[str, float]) -> None:
    """Hold every packet read from ``tun`` for its source's delay, then write it back; forever.

    Packets wait in a heap by due time (ties by arrival), so one source's packets keep their order.
    """
    fd, offset = open_tun(tun)
    by_source = {ipaddress.ip_address(a).packed: d for a, d in delays.items()}
    print(READY_LINE, flush=True)
    heap: list[tuple[float, int, bytes]] = []
    seq = 0
    poller = select.epoll()
    poller.register(fd, select.EPOLLIN)
    while True:
        timeout = max(0.0, heap[0][0] - time.monotonic()) if heap else -1
        if poller.poll(timeout):
            now = time.monotonic()
            for _ in range(256):
                try:
                    packet = os.read(fd, 65536 + offset)
                except BlockingIOError:
                    break
                heapq.heappush(heap, (now + by_source.get(packet_source(packet, offset), 0.0), seq, packet))
                seq += 1
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            try:
                os.write(fd, heapq.heappop(heap)[2])
            except OSError as exc:  # a packet the kernel will not take back: drop it, as a router would
                print(f"relay: dropped a packet: {exc}", file=sys.stderr, flush=True)


# ---- probes: a TCP/UDP echo server and its client, run inside hosts -------------------------------


ECHO, SINK = b"E", b"S"
RTT_MESSAGE_BYTES = 64


def _serve_tcp(listener: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve_tcp_conn, args=(conn,), daemon=True).start()


def _serve_tcp_conn(conn: socket.socket) -> None:
    """First byte ``E``: echo everything back; ``S``: read to EOF, answer the byte count (8 bytes)."""
    with conn:
        mode = conn.recv(1)
        total = 0
        while chunk := conn.recv(1 << 16):
            if mode == ECHO:
                conn.sendall(chunk)
            total += len(chunk)
        if mode == SINK:
            conn.sendall(struct.pack("!Q", total))


def _serve_udp(sock: socket.socket) -> None:
    while True:
        data, peer = sock.recvfrom(65536)
        sock.sendto(data, peer)


def serve_echo(addrs: Sequence[str]) -> None:
    """Echo servers (TCP and UDP, port 0) on each address; prints ``{addr: {"tcp": p, "udp": p}}``, serves."""
    ports: dict[str, dict[str, int]] = {}
    for addr in addrs:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        tcp = socket.socket(family, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((addr, 0))
        tcp.listen(16)
        udp = socket.socket(family, socket.SOCK_DGRAM)
        udp.bind((addr, 0))
        ports[addr] = {"tcp": tcp.getsockname()[1], "udp": udp.getsockname()[1]}
        threading.Thread(target=_serve_tcp, args=(tcp,), daemon=True).start()
        threading.Thread(target=_serve_udp, args=(udp,), daemon=True).start()
    print(json.dumps(ports), flush=True)
    threading.Event().wait()


def probe(kind: str, addr: str, port: int, *, count: int = 5, nbytes: int = 1 << 20,
          timeout_s: float = 10.0) -> dict[str, Any]:
    """One client measurement against an echo server; never raises for network errors (``ok: false``).

    ``tcp``/``udp``: one message echoed; ``rtt``: ``count`` 64-byte TCP round trips on one connection
    (seconds each); ``sink``: ``nbytes`` sent over TCP, timed until the server confirmed them (bits/s).
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        if kind == "udp":
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.settimeout(timeout_s)
                s.sendto(b"swarmd-netlab", (addr, port))
                data, _ = s.recvfrom(65536)
                return {"ok": data == b"swarmd-netlab"}
        with socket.create_connection((addr, port), timeout=timeout_s) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if kind == "sink":
                s.sendall(SINK)
                t0 = time.perf_counter()
                s.sendall(bytes(nbytes))
                s.shutdown(socket.SHUT_WR)
                (received,) = struct.unpack("!Q", _recv_exact(s, 8))
                elapsed = time.perf_counter() - t0
                return {"ok": received == nbytes, "bytes": received, "seconds": elapsed,
                        "bits_per_s": received * 8 / elapsed}
            s.sendall(ECHO)
            if kind == "tcp":
                s.sendall(b"swarmd-netlab")
                return {"ok": _recv_exact(s, 13) == b"swarmd-netlab"}
            rtts = []
            for i in range(count):
                message = bytes([i % 256]) * RTT_MESSAGE_BYTES
                t0 = time.perf_counter()
                s.sendall(message)
                if _recv_exact(s, RTT_MESSAGE_BYTES) != message:
                    return {"ok": False, "error": "echo differed"}
                rtts.append(time.perf_counter() - t0)
            return {"ok": True, "rtt_s": rtts}
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


class EchoServer:
    """:func:`serve_echo` running inside a host of a lab: ``tcp_port(addr)``, ``udp_port(addr)``."""

    def __init__(self, lab: Lab, host: int, addrs: Sequence[str] | None = None) -> None:
        self.addrs = list(addrs or [lab.addr(host), lab.addr6(host)])
        self.proc = lab.popen(host, [sys.executable, str(Path(__file__).resolve()), "_echo", *self.addrs],
                              stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], CMD_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise LabError(f"the echo server in host {host} did not start")
        self.ports: dict[str, dict[str, int]] = json.loads(line)

    def tcp_port(self, addr: str) -> int:
        return self.ports[addr]["tcp"]

    def udp_port(self, addr: str) -> int:
        return self.ports[addr]["udp"]

    def close(self) -> None:
        _stop_process(self.proc)

    def __enter__(self) -> EchoServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_probe(lab: Lab, host: int, kind: str, addr: str, port: int, **kw: Any) -> dict[str, Any]:
    """:func:`probe` run inside ``host`` (a fresh interpreter there); its result."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    done = lab.run(host, [sys.executable, str(Path(__file__).resolve()), "_probe", kind, addr, str(port), *args],
                   capture_output=True, text=True, timeout=CMD_TIMEOUT_S * 2)
    if done.returncode != 0:
        raise LabError(f"the probe in host {host} failed: {done.stderr.strip()}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def measure(lab: Lab, src: int = 0, dst: int = 1, nbytes: int = 8 << 20) -> dict[str, Any]:
    """RTT (TCP, 10 round trips) and throughput (TCP, ``nbytes``) from host ``src`` to host ``dst``."""
    with EchoServer(lab, dst) as echo:
        addr = lab.addr(dst)
        rtt = run_probe(lab, src, "rtt", addr, echo.tcp_port(addr), count=10)
        sink = run_probe(lab, src, "sink", addr, echo.tcp_port(addr), nbytes=nbytes)
    rtts = sorted(rtt.get("rtt_s", []))
    return {
        "src": src, "dst": dst,
        "shape_src": asdict(lab.host(src).shape), "shape_dst": asdict(lab.host(dst).shape),
        "rtt_ms_min": rtts[0] * 1e3 if rtts else None,
        "rtt_ms_median": rtts[len(rtts) // 2] * 1e3 if rtts else None,
        "throughput_mbit_s": sink["bits_per_s"] / 1e6 if sink.get("ok") else None,
        "errors": [r["error"] for r in (rtt, sink) if not r.get("ok")],
    }


# ---- the command line ----------------------------------------------------------------------------


def _only_run(run_id: str | None) -> str:
    if run_id:
        return run_id
    runs = [r for r in lab_runs() if (STATE_DIR / f"{r}.json").exists()]
    if len(runs) != 1:
        raise LabError(f"name a lab with --run (labs now: {', '.join(sorted(runs)) or 'none'})")
    return runs[0]


def _describe(lab: Lab) -> dict[str, Any]:
    return {"run_id": lab.run_id, "gateway": lab.gateway, "gateway6": lab.gateway6, "relay_pid": lab.relay_pid,
            "hosts": [asdict(h) for h in lab.hosts]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="netlab.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a lab that stays until `down`; prints its run id and hosts (JSON)")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--rate", default=None, help="every host's egress cap, e.g. 100mbit (tc tbf)")
    up.add_argument("--delay", default="0ms", help="every host's one-way egress delay, e.g. 25ms (RTT: twice it)")
    down = sub.add_parser("down", help="remove a lab (the only one, or --run)")
    down.add_argument("--run", default=None)
    ex = sub.add_parser("exec", help="run a command inside a host: exec HOST -- CMD ...")
    ex.add_argument("--run", default=None)
    ex.add_argument("host", type=int)
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    ms = sub.add_parser("measure", help="TCP RTT and throughput from host SRC to host DST (JSON)")
    ms.add_argument("--run", default=None)
    ms.add_argument("--src", type=int, default=0)
    ms.add_argument("--dst", type=int, default=1)
    ms.add_argument("--bytes", type=int, default=8 << 20)
    sub.add_parser("list", help="labs that exist now (JSON)")
    stale = sub.add_parser("cleanup-stale", help="remove the namespaces of labs whose owner process is gone")
    stale.add_argument("--all", action="store_true", help="also labs made with `up` (every swl- namespace)")
    relay = sub.add_parser("_relay")  # internal: the delay relay, inside the hub
    relay.add_argument("--tun", required=True)
    relay.add_argument("delays", nargs="*", metavar="ADDR=SECONDS")
    echo = sub.add_parser("_echo")  # internal: echo servers, inside a host
    echo.add_argument("addrs", nargs="+")
    pr = sub.add_parser("_probe")  # internal: one measurement, inside a host
    pr.add_argument("kind", choices=("tcp", "udp", "rtt", "sink"))
    pr.add_argument("addr")
    pr.add_argument("port", type=int)
    pr.add_argument("--count", type=int, default=5)
    pr.add_argument("--nbytes", type=int, default=1 << 20)
    pr.add_argument("--timeout-s", type=float, default=10.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "_relay":
            run_relay(args.tun, {a: float(d) for a, _, d in (x.partition("=") for x in args.delays)})
        elif args.command == "_echo":
            serve_echo(args.addrs)
        elif args.command == "_probe":
            print(json.dumps(probe(args.kind, args.addr, args.port, count=args.count, nbytes=args.nbytes,
                                   timeout_s=args.timeout_s)))
        elif (problem := support_problem()) is not None:
            print(f"netlab: {problem}", file=sys.stderr)
            return 2
        elif args.command == "up":
            lab = Lab(args.hosts, rate=args.rate, delay_s=parse_delay(args.delay), persistent=True).start()
            print(json.dumps(_describe(lab), indent=2))
        elif args.command == "down":
            Lab.attach(_only_run(args.run)).close()
        elif args.command == "exec":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                raise LabError("exec HOST -- CMD: no command given")
            lab = Lab.attach(_only_run(args.run))
            os.execvp("ip", lab.command(args.host, cmd))
        elif args.command == "measure":
            print(json.dumps(measure(Lab.attach(_only_run(args.run)), args.src, args.dst, args.bytes), indent=2))
        elif args.command == "list":
            print(json.dumps({r: sorted(ns) for r, ns in lab_runs().items()}, indent=2))
        elif args.command == "cleanup-stale":
            for ns in cleanup_stale(args.all):
                print(f"removed {ns}")
    except (LabError, ValueError, IndexError) as exc:
        print(f"netlab: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
