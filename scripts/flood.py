"""A Sybil flood (issue 18): one outside process mints identities and lists them as serving peers.

It joins a swarm's DHT like any member (its own Kademlia node), mints ``--fakes`` fresh ed25519
identities, and every ``--refresh`` seconds publishes a validly signed ``serving`` PeerRecord for
each, half on each stage (round-robin), that looks as good as a real peer's: the stage's params
digest and step copied from the real peers' records, a high throughput, ``reachable: yes``. Every
record points at one address of the flood's choosing (``--target``):

- ``tarpit``: a TCP port that accepts connections and never answers (each one a request that
  costs its sender a full timeout); the connections it accepted are counted;
- ``refuse``: a TCP port bound but not listening (every connection is refused at once).

Records are sent as bundles (up to ``MAX_BUNDLE_BYTES``, ~25 per datagram) to the k closest nodes
of each stage bucket key, as a hand-over would: the cheapest flood a DHT member can send. With
``--sources S`` the fakes are split over S DHT nodes on S UDP ports (one address: a storing node
grouping by /24 or address counts them once, one grouping by endpoint S times).

    .venv/bin/python scripts/flood.py --join 127.0.0.1:31337 --swarm swarmd --fakes 50 --target tarpit
    .venv/bin/python scripts/flood.py --join 127.0.0.1:31337 --fakes 500 --target refuse --stats-file s.json

It prints one JSON line once the first round is published (``{"ready": true, "target": ...}``) and
rewrites ``--stats-file`` (atomically, strict JSON) after every round: rounds, records published
and how many storing nodes held or refused them, tarpit connections. SIGTERM/SIGINT stop it.

Tests and ``scripts/bench_flood.py`` run it as a child process through :class:`FloodProcess`
(``from scripts.flood import FloodProcess``), so its CPU and its event loop are not the swarm's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd import __version__  # noqa: E402
from swarmd.dht.identity import Identity  # noqa: E402
from swarmd.dht.membership import Membership  # noqa: E402
from swarmd.dht.node import DHTNode, bucket_of, stage_key  # noqa: E402
from swarmd.dht.protocol import MAX_BUNDLE_BYTES  # noqa: E402
from swarmd.dht.records import PeerRecord, bundle_size, sign_record  # noqa: E402
from swarmd.errors import SwarmdError  # noqa: E402

TARGETS = ("tarpit", "refuse")
FAKE_THROUGHPUT = 500.0  # samples/s claimed: more than any tiny-model peer measures, so routers like them


class Tarpit:
    """A TCP server that accepts every connection and never writes a byte (reads and discards).

    It counts the connections by the path of the HTTP request they carry (``/v1/proof``,
    ``/v1/forward``, ...; ``?`` when none came): who wasted how many requests on the fakes."""

    def __init__(self) -> None:
        self.accepted = 0
        self.open = 0
        self.by_path: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str = "127.0.0.1") -> tuple[str, int]:
        self._server = await asyncio.start_server(self._hold, host, 0)
        sockname = self._server.sockets[0].getsockname()
        return sockname[0], sockname[1]

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        self._writers.add(writer)
        try:
            self.by_path[await _request_path(reader)] += 1
            while await reader.read(65536):
                pass
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.open -= 1
            self._writers.discard(writer)
            writer.close()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()


async def _request_path(reader: asyncio.StreamReader) -> str:
    """The path of the HTTP request line a connection opens with (``?`` if none in 4 KB)."""
    try:
        line = await reader.readuntil(b"\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return "?"
    parts = line.decode("latin-1").split(" ")
    return parts[1].split("?", 1)[0][:64] if len(parts) >= 2 else "?"


def refusing_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to a free port and never listening: connecting to it is refused (RST), and
    the port stays taken while the socket is open, so nothing else starts answering there."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    return sock


@dataclass
class FloodStats:
    rounds: int = 0
    published: int = 0  # records sent in the last round
    held: int = 0  # storing nodes that held every record of a bundle, last round (summed over bundles)
    refused: int = 0  # storing nodes that refused some record of a bundle, last round
    errors: Counter[str] = field(default_factory=Counter)
    tarpit_accepted: int = 0
    tarpit_open: int = 0
    tarpit_by_path: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "published": self.published, "held": self.held, "refused": self.refused,
                "errors": dict(self.errors), "tarpit_accepted": self.tarpit_accepted,
                "tarpit_open": self.tarpit_open, "tarpit_by_path": dict(sorted(self.tarpit_by_path.items()))}


class Flood:
    """The attacker (module docstring), as an async context manager in the current process."""

    def __init__(self, bootstrap: Sequence[tuple[str, int]], swarm: str, fakes: int, target: str, *,
                 refresh_s: float = 5.0, sources: int = 1, host: str = "127.0.0.1") -> None:
        if target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
        if fakes < 0 or sources < 1 or refresh_s <= 0:
            raise ValueError("fakes >= 0, sources >= 1 and refresh_s > 0, please")
        self.bootstrap = list(bootstrap)
        self.swarm = swarm
        self.target = target
        self.refresh_s = refresh_s
        self.host = host
        self.identities = [Identity.generate() for _ in range(fakes)]
        self.nodes = [DHTNode(Identity.generate(), host=host, rpc_timeout=1.0) for _ in range(sources)]
        self.stats = FloodStats()
        self.tarpit = Tarpit()
        self.address = ""
        self.n_stages = 0
        self._refusing: socket.socket | None = None

    @property
    def peer_ids(self) -> list[str]:
        return [i.peer_id for i in self.identities]

    async def __aenter__(self) -> Flood:
        if self.target == "tarpit":
            host, port = await self.tarpit.start(self.host)
        else:
            self._refusing = refusing_socket(self.host)
            host, port = self._refusing.getsockname()[:2]
        self.address = f"{host}:{port}"
        for node in self.nodes:
            await node.start(self.bootstrap, deadline_s=30.0)
        info = await Membership(self.nodes[0], self.nodes[0].identity, self.swarm, ttl_s=60).wait_for_swarm(30.0)
        self.n_stages = info.spec.n_stages
        return self

    async def __aexit__(self, *exc: object) -> None:
        for node in self.nodes:
            await node.stop()
        await self.tarpit.aclose()
        if self._refusing is not None:
            self._refusing.close()

    async def _templates(self) -> list[tuple[int, str | None]]:
        """Per stage: the step and params digest the real peers announce (copied into the fakes)."""
        mine = set(self.peer_ids)
        out = []
        for stage in range(self.n_stages):
            try:
                real = [r for pid, r in (await self.nodes[0].get_stage_peers(self.swarm, stage)).items()
                        if pid not in mine]
            except SwarmdError:
                real = []
            newest = max(real, key=lambda r: r.step, default=None)
            out.append((newest.step, newest.params_digest) if newest else (0, None))
        return out

    async def publish(self) -> None:
        """One round: sign a fresh record for every fake and store the bundles of every bucket key."""
        templates = await self._templates()
        now = time.time()
        keys: dict[str, list[bytes]] = {}
        for i, identity in enumerate(self.identities):
            stage = i % self.n_stages
            step, digest = templates[stage]
            record = PeerRecord(peer_id=identity.peer_id, stage=stage, state="serving", data_addr=self.address,
                                api_addr=self.address, throughput=FAKE_THROUGHPUT, queue=0, step=step,
                                params_digest=digest, version=__version__, timestamp=now,
                                expiry=now + 3 * self.refresh_s, reachable="yes")
            key = stage_key(self.swarm, stage, bucket_of(identity.peer_id))
            keys.setdefault(key, []).append(sign_record(identity, record))
        jobs = []
        for n, (key, raws) in enumerate(sorted(keys.items())):
            for chunk in bundle_chunks(raws):
                jobs.append(self.nodes[(n + len(jobs)) % len(self.nodes)].store_many(key, chunk))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        s = self.stats
        s.rounds += 1
        s.published = len(self.identities)
        s.held = s.refused = 0
        for result in results:
            if isinstance(result, BaseException):
                s.errors[type(result).__name__] += 1
            else:
                s.held += result[0]
                s.refused += result[1]
        self._tarpit_counts()

    def _tarpit_counts(self) -> None:
        s = self.stats
        s.tarpit_accepted, s.tarpit_open = self.tarpit.accepted, self.tarpit.open
        s.tarpit_by_path = dict(self.tarpit.by_path)

    async def run(self, stop: asyncio.Event, stats_file: Path | None = None, on_ready: Any = None) -> None:
        """Publish every ``refresh_s`` until ``stop`` is set (the stats file is rewritten after every
        round and once more on the way out, with the tarpit's final counts)."""
        while not stop.is_set():
            await self.publish()
            if stats_file is not None:
                _write_json(stats_file, {"target": self.address, **self.stats.to_json()})
            if on_ready is not None:
                on_ready()
                on_ready = None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.refresh_s)
        self._tarpit_counts()
        if stats_file is not None:
            _write_json(stats_file, {"target": self.address, **self.stats.to_json()})


def bundle_chunks(raws: list[bytes]) -> list[list[bytes]]:
    """Split records into bundles that fit one ``store`` datagram."""
    out: list[list[bytes]] = [[]]
    for raw in raws:
        if out[-1] and bundle_size([*out[-1], raw]) > MAX_BUNDLE_BYTES:
            out.append([])
        out[-1].append(raw)
    return [c for c in out if c]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, allow_nan=False))
    os.replace(tmp, path)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}") from None


class FloodProcess:
    """``scripts/flood.py`` as a child process: started in the constructor, ready once its first round is
    published (:meth:`wait_ready`), its stats read from its stats file, stopped with SIGTERM."""

    def __init__(self, join: str, swarm: str, fakes: int, target: str, *, refresh_s: float = 5.0,
                 sources: int = 1, workdir: Path | None = None) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="swarmd-flood-"))
        self.stats_file = self.workdir / f"flood-{os.getpid()}-{id(self)}.json"
        self.log_path = self.stats_file.with_suffix(".log")
        argv = [sys.executable, str(Path(__file__).resolve()), "--join", join, "--swarm", swarm, "--fakes",
                str(fakes), "--target", target, "--refresh", str(refresh_s), "--sources", str(sources),
                "--stats-file", str(self.stats_file)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log)
        self.info: dict[str, Any] = {}

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The ready line's JSON (its target address and fake peer ids); raises with the log's tail."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # the child prints exactly one line, then nothing
            if line:
                self.info = json.loads(line)
                return self.info
            if self.proc.poll() is not None:
                break
        raise RuntimeError(f"the flood did not start: {self.log_path.read_text()[-2000:]}")

    async def wait_ready_async(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return await asyncio.to_thread(self.wait_ready, timeout_s)

    def stats(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.stats_file.read_text()))
        except (OSError, ValueError):
            return {}

    def stop(self, timeout_s: float = 15.0) -> dict[str, Any]:
        """SIGTERM, wait (SIGKILL after ``timeout_s``); the last stats."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.stats()

    def __enter__(self) -> FloodProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _main(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    flood = Flood([args.join], args.swarm, args.fakes, args.target, refresh_s=args.refresh, sources=args.sources)
    async with flood:
        def ready() -> None:
            print(json.dumps({"ready": True, "target": flood.address, "n_stages": flood.n_stages,
                              "fakes": flood.peer_ids, "dht": [n.stats()["address"] for n in flood.nodes]}),
                  flush=True)

        await flood.run(stop, args.stats_file, ready)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--join", type=_address, required=True, help="a member's DHT address, HOST:PORT")
    parser.add_argument("--swarm", default="swarmd", help="the swarm's name (default: swarmd)")
    parser.add_argument("--fakes", type=int, default=50, help="identities to mint (default: 50)")
    parser.add_argument("--target", choices=TARGETS, default="tarpit", help="where the fakes point")
    parser.add_argument("--refresh", type=float, default=5.0, help="seconds between rounds (default: 5)")
    parser.add_argument("--sources", type=int, default=1, help="DHT nodes (UDP ports) to send from")
    parser.add_argument("--stats-file", type=Path, default=None, help="rewritten after every round")
    args = parser.parse_args(argv)
    if args.fakes < 0 or args.sources < 1 or args.refresh <= 0:
        parser.error("--fakes must be >= 0, --sources >= 1 and --refresh > 0")
    return asyncio.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
